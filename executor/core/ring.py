"""The ring of bounce buffers: N slots registered once, leased in O(1).

Each ring is one allocation carved into equal slots; every slot is registered
with the transport exactly once, at start-up, and never re-registered, so
registrations never overlap. Free slots sit in a FIFO: the slot freed longest
ago is reused first, which leaves the most time for any straggling write.
Only a declared transition into `free` puts a slot back on that list, so the
ring cannot hand out a slot that is not free.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from epd_ring.fsm import EXTENT
from epd_ring.fsm.couplings import ON_ENTER, ON_EVENT

_ALIGN = 64
_EXTENT_ACTIONS = {a for (machine, _), acts in (*ON_ENTER.items(), *ON_EVENT.items())
                   if machine == "extent" for a in acts}
_UNCOUPLED: dict[str, Callable[[Any], None]] = {a: lambda slot: None for a in _EXTENT_ACTIONS}


class Extent:
    __slots__ = ("index", "state", "ring", "room", "writes_in_flight", "unsure", "timer", "due")

    def __init__(self, index: int, ring: Ring):
        self.index = index
        self.ring = ring
        self.state = EXTENT.initial
        self.room: int | None = None
        self.writes_in_flight = 0
        self.unsure = False
        self.timer = 0
        self.due = 0.0

    # guards named in the slot declaration
    def writes_pending(self) -> bool:
        return self.writes_in_flight > 0

    def write_unsure(self) -> bool:
        return self.unsure

    def __repr__(self) -> str:
        return f"slot {self.index}"


class Ring:
    """Main ring plus, for deepstack models, a second ring sharing slot indices."""

    def __init__(self, transport: Any, n_slots: int, slot_bytes: int, device: Any = "cpu",
                 deep_slot_bytes: int = 0, actions: Mapping[str, Callable[[Any], None]] | None = None):
        if n_slots < 1:
            raise ValueError(f"a ring needs at least one slot, got {n_slots}")
        if slot_bytes < 1 or slot_bytes % _ALIGN:
            raise ValueError(f"slot bytes must be a positive multiple of {_ALIGN}, got {slot_bytes}")
        if deep_slot_bytes % _ALIGN:
            raise ValueError(f"deepstack slot bytes must be a multiple of {_ALIGN}, got {deep_slot_bytes}")
        self.device = torch.device(device)
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.deep_slot_bytes = deep_slot_bytes
        self.main = torch.empty(n_slots * slot_bytes, dtype=torch.uint8, device=self.device)
        self.main_base = self.main.data_ptr()
        self.deep = None
        self.deep_base = 0
        regions = [(self.main_base + i * slot_bytes, slot_bytes) for i in range(n_slots)]
        if deep_slot_bytes:
            self.deep = torch.empty(n_slots * deep_slot_bytes, dtype=torch.uint8, device=self.device)
            self.deep_base = self.deep.data_ptr()
            regions += [(self.deep_base + i * deep_slot_bytes, deep_slot_bytes) for i in range(n_slots)]
        transport.register_memory(regions, owner=self)
        # The coupling actions (fsm/couplings.py) a slot's step runs: the manager's. A ring on its
        # own (a tool, a test of the ring) has no deadlines or regions to couple to.
        self.actions: Mapping[str, Callable[[Any], None]] = actions or _UNCOUPLED
        self.slots = [Extent(i, self) for i in range(n_slots)]
        self._free: deque[Extent] = deque(self.slots)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def has_free(self) -> bool:
        return bool(self._free)

    def lease(self) -> Extent | None:
        if not self._free:
            return None
        slot = self._free.popleft()
        self.fire(slot, "lease")
        return slot

    def fire(self, slot: Extent, event: str) -> str:
        """The one place a slot is stepped: its machine, then the actions the couplings name.

        A slot that lands in `free` goes back on the free list."""
        was = slot.state
        dest = EXTENT.step(slot, event)
        if dest == "free":
            slot.room = None
            slot.unsure = False
            self._free.append(slot)
        if dest != was:
            for action in ON_ENTER.get(("extent", dest), ()):
                self.actions[action](slot)
        for action in ON_EVENT.get(("extent", event), ()):
            self.actions[action](slot)
        return dest

    def main_ptr(self, slot: Extent) -> int:
        return self.main_base + slot.index * self.slot_bytes

    def deep_ptr(self, slot: Extent) -> int:
        return self.deep_base + slot.index * self.deep_slot_bytes

    def main_view(self, slot: Extent, nbytes: int) -> torch.Tensor:
        start = slot.index * self.slot_bytes
        return self.main[start:start + nbytes]

    def deep_view(self, slot: Extent, nbytes: int) -> torch.Tensor:
        start = slot.index * self.deep_slot_bytes
        assert self.deep is not None, "this ring has no deepstack half"
        return self.deep[start:start + nbytes]

    def counts(self) -> Counter[str]:
        return Counter(s.state for s in self.slots)

    def close(self) -> int:
        """Retire every free slot; return how many are still busy (not yet retirable)."""
        while self._free:
            self.fire(self._free.popleft(), "retire")
        return sum(1 for s in self.slots if s.state != "retired")
