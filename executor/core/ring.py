"""The ring: one registered arena per half (main, deepstack), carved into extents per item.

Each half is one allocation registered with the transport exactly once, at
start-up, as one registration, and never re-registered. An item leases an
extent sized to its bytes (`arena.Arena`: segregated fit, coalescing free
space): in the main arena, and in the deepstack arena when it has deepstack
rows; both or neither. An extent carries the extent machine (fsm/machines.py).

The safety rule is about bytes: an extent's bytes go back to its arena only on
a declared transition into `free`. An extent that is copying, staged, parked,
sending or quarantined (a write that failed may still read it) keeps its bytes,
so no byte is handed out again while a write may still read it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
from mypy_extensions import mypyc_attr

from epd_ring.fsm import EXTENT
from epd_ring.fsm.couplings import ON_ENTER, ON_EVENT

from .arena import Arena, span

_ALIGN = 64
MAX_PIECES = 8  # a write carries a buffer per piece and receiver: a few, not many
_EXTENT_ACTIONS = {a for (machine, _), acts in (*ON_ENTER.items(), *ON_EVENT.items())
                   if machine == "extent" for a in acts}
_UNCOUPLED: dict[str, Callable[[Any], None]] = {a: lambda extent: None for a in _EXTENT_ACTIONS}


class Extent:
    """One item's bytes in the ring: `nbytes` at `offset` of the main arena (and `deep_nbytes` at
    `deep_offset` of the deepstack arena, or -1 and 0). `index` numbers leases, for logs.

    A spanning extent (the ring's `max_pieces` > 1, no free run of the arena large enough) has its
    bytes in several pieces, each its own run of the arena: `pieces` (and `deep_pieces`) hold
    (offset, bytes) of each in the item's order, `offset` the first's; empty when it is one run."""

    __slots__ = ("index", "offset", "nbytes", "deep_offset", "deep_nbytes", "state", "ring", "room",
                 "writes_in_flight", "unsure", "timer", "due", "share", "cost", "pieces", "deep_pieces")

    def __init__(self, index: int, ring: Ring, offset: int, nbytes: int, deep_offset: int = -1,
                 deep_nbytes: int = 0):
        self.index = index
        self.ring = ring
        self.offset = offset
        self.nbytes = nbytes
        self.deep_offset = deep_offset
        self.deep_nbytes = deep_nbytes
        self.state = EXTENT.initial
        self.room: int | None = None
        self.writes_in_flight = 0
        self.unsure = False
        self.timer = 0
        self.due = 0.0
        # The identity's share it is charged to (shares.py) and how much, until it is free again.
        self.share: Any = None
        self.cost = 0
        self.pieces: tuple[tuple[int, int], ...] = ()
        self.deep_pieces: tuple[tuple[int, int], ...] = ()

    # guards named in the extent declaration
    def writes_pending(self) -> bool:
        return self.writes_in_flight > 0

    def write_unsure(self) -> bool:
        return self.unsure

    def __repr__(self) -> str:
        return f"extent {self.index}"


# compiled (setup.py), it stays open to subclasses: the model's seed variant has one (models/seed.py)
@mypyc_attr(allow_interpreted_subclasses=True)
class Ring:
    """Main arena plus, for deepstack models, a deepstack arena; an extent leases from both."""

    def __init__(self, transport: Any, arena_bytes: int, device: Any = "cpu", deep_bytes: int = 0,
                 actions: Mapping[str, Callable[[Any], None]] | None = None, max_item_bytes: int | None = None,
                 max_pieces: int = 1):
        if arena_bytes < _ALIGN or arena_bytes % _ALIGN:
            raise ValueError(f"arena bytes must be a positive multiple of {_ALIGN}, got {arena_bytes}")
        if deep_bytes < 0 or deep_bytes % _ALIGN:
            raise ValueError(f"deepstack arena bytes must be a multiple of {_ALIGN}, got {deep_bytes}")
        if max_item_bytes is not None and max_item_bytes < 1:
            raise ValueError(f"max item bytes must be >= 1, got {max_item_bytes}")
        if type(max_pieces) is not int or not 1 <= max_pieces <= MAX_PIECES:
            raise ValueError(f"max_pieces must be an integer from 1 to {MAX_PIECES}, got {max_pieces!r}")
        # Runs of the arena one extent may span when no free run holds it whole (1: never spans).
        self.max_pieces = max_pieces
        self.device = torch.device(device)
        self.arena_bytes = arena_bytes
        self.deep_bytes = deep_bytes
        self.max_item_bytes = max_item_bytes
        self.main = torch.empty(arena_bytes, dtype=torch.uint8, device=self.device)
        self.main_base = self.main.data_ptr()
        self.main_arena = Arena(arena_bytes, _ALIGN)
        self.deep = None
        self.deep_base = 0
        self.deep_arena: Arena | None = None
        regions = [(self.main_base, arena_bytes)]
        if deep_bytes:
            self.deep = torch.empty(deep_bytes, dtype=torch.uint8, device=self.device)
            self.deep_base = self.deep.data_ptr()
            self.deep_arena = Arena(deep_bytes, _ALIGN)
            regions.append((self.deep_base, deep_bytes))
        transport.register_memory(regions, owner=self)
        # The coupling actions (fsm/couplings.py) an extent's step runs: the manager's. A ring on its
        # own (a tool, a test of the ring) has no deadlines or regions to couple to.
        self.actions: Mapping[str, Callable[[Any], None]] = actions or _UNCOUPLED
        # fsm/couplings.py's rows for the extent machine, looked up once (`fire` is the per-item path).
        self._on_enter = {s: ON_ENTER.get(("extent", s), ()) for s in EXTENT.states}
        self._on_event = {e: ON_EVENT.get(("extent", e), ()) for e in EXTENT.events}
        self._plans = EXTENT.plans(self._on_enter, self._on_event)  # `fire`'s success path, compiled
        # `lease` takes the initial state's one unguarded `lease` edge without the machine's step: a
        # declaration that guards it fails here (KeyError), not on the first lease.
        self._lease_plan = self._plans[EXTENT.initial, "lease"]
        self.extents: dict[int, Extent] = {}  # live extents (not free), by index
        # Items up to this many bytes never need `too_large`'s checks (the per-item path).
        self.fits_bytes = min(self.main_arena.capacity, max_item_bytes if max_item_bytes is not None else arena_bytes)
        self._leases = 0
        self.retired = False

    # -- sizes --------------------------------------------------------------------------
    def too_large(self, nbytes: int, deep_nbytes: int = 0) -> str | None:
        """Why an item of these sizes can never be leased (None if it fits the empty ring)."""
        cap = self.max_item_bytes
        if cap is not None and nbytes > cap:
            return f"embedding of {nbytes} B exceeds max_item_bytes ({cap} B)"
        if not self.main_arena.fits_ever(nbytes):
            return f"embedding of {nbytes} B exceeds the whole ring arena of {self.main_arena.capacity} B"
        if deep_nbytes:
            if self.deep_arena is None:
                return "item has deepstack rows but the ring has no deepstack arena"  # pragma: no mutate (wording)
            if not self.deep_arena.fits_ever(deep_nbytes):
                return (f"deepstack embedding of {deep_nbytes} B exceeds the whole deepstack arena of "
                        f"{self.deep_arena.capacity} B")
        return None

    @staticmethod
    def extent_cost(nbytes: int, deep_nbytes: int = 0) -> int:
        """Arena bytes an item of these sizes takes (each half rounded up to the alignment; at least one unit)."""
        cost = (nbytes + _ALIGN - 1) & -_ALIGN or _ALIGN
        if deep_nbytes:
            cost += (deep_nbytes + _ALIGN - 1) & -_ALIGN
        return cost

    def lease(self, nbytes: int, deep_nbytes: int = 0) -> Extent | None:
        """A new extent holding `nbytes` (and `deep_nbytes` deepstack), or None if it does not fit now."""
        if self.retired:
            return None
        offset = self.main_arena.alloc(nbytes)
        pieces: list[tuple[int, int]] | None = None
        if offset is None:
            if self.max_pieces == 1:
                return None
            pieces = span(self.main_arena, nbytes, self.max_pieces)
            if pieces is None:
                return None
            offset = pieces[0][0]
        deep_offset = -1
        deep_pieces: list[tuple[int, int]] | None = None
        if deep_nbytes:
            assert self.deep_arena is not None  # the executor gives a ring for deepstack rows their arena
            got = self.deep_arena.alloc(deep_nbytes)
            if got is None and self.max_pieces > 1:
                deep_pieces = span(self.deep_arena, deep_nbytes, self.max_pieces)
                got = None if deep_pieces is None else deep_pieces[0][0]
            if got is None:
                for at, _ in pieces or ((offset, nbytes),):  # both or neither
                    self.main_arena.free(at)
                return None
            deep_offset = got
        self._leases += 1
        ext = Extent(self._leases, self, offset, nbytes, deep_offset, deep_nbytes)
        if pieces is not None:
            ext.pieces = tuple(pieces)
        if deep_pieces is not None:
            ext.deep_pieces = tuple(deep_pieces)
        self.extents[ext.index] = ext
        # `fire(ext, "lease")`, written out: a fresh extent is in the initial state, whose lease
        # is one unguarded edge (its compiled plan)
        ext.state, actions = self._lease_plan
        for action in actions:
            self.actions[action](ext)
        return ext

    def fire(self, extent: Extent, event: str) -> str:
        """The one place an extent is stepped: its machine, then the actions the couplings name.

        An extent that lands in `free` gives its bytes back to the arenas and leaves the ring.
        A step with one unguarded edge takes its compiled plan (`CompiledMachine.plans`: the same
        destination and actions); a guarded or undeclared one goes through the machine's `step`,
        which checks the guards and raises on an undeclared event."""
        plan = self._plans.get((extent.state, event))
        if plan is None:
            was = extent.state
            dest = EXTENT.step(extent, event)
            actions = (self._on_enter[dest] if dest != was else ()) + self._on_event[event]
        else:
            dest, actions = plan
            extent.state = dest
        if dest == "free":
            extent.room = None
            extent.unsure = False
            share = extent.share
            if share is not None:  # its bytes count against its identity no more
                share.charge(-extent.cost)
                extent.share = None
            if self.extents.pop(extent.index, None) is not None:
                if extent.pieces:
                    for at, _ in extent.pieces:
                        self.main_arena.free(at)
                else:
                    self.main_arena.free(extent.offset)
                if extent.deep_offset >= 0:
                    assert self.deep_arena is not None
                    if extent.deep_pieces:
                        for at, _ in extent.deep_pieces:
                            self.deep_arena.free(at)
                    else:
                        self.deep_arena.free(extent.deep_offset)
        for action in actions:
            self.actions[action](extent)
        return dest

    def main_ptr(self, extent: Extent) -> int:
        return self.main_base + extent.offset

    def deep_ptr(self, extent: Extent) -> int:
        return self.deep_base + extent.deep_offset

    def main_view(self, extent: Extent, nbytes: int) -> torch.Tensor:
        return self.main[extent.offset:extent.offset + nbytes]

    def deep_view(self, extent: Extent, nbytes: int) -> torch.Tensor:
        assert self.deep is not None, "this ring has no deepstack half"  # pragma: no mutate (wording)
        return self.deep[extent.deep_offset:extent.deep_offset + nbytes]

    # -- gauges -------------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Extents not free: leased and not yet given back."""
        return len(self.extents)

    def counts(self) -> Counter[str]:
        """Live extents by state; a closed ring with none counts as one `retired`."""
        c = Counter(s.state for s in self.extents.values())
        if self.retired and not c:
            c["retired"] = 1
        return c

    def gauges(self) -> dict[str, float]:
        """Bytes in use, largest free extent and fragmentation of each arena."""
        out: dict[str, float] = {}
        for name, arena in (("main", self.main_arena), ("deep", self.deep_arena)):
            if arena is not None:
                out[f"{name}_bytes_in_use"] = arena.in_use
                out[f"{name}_largest_free"] = arena.largest_free
                out[f"{name}_fragmentation"] = arena.fragmentation
        return out

    def close(self) -> int:
        """Retire the ring once no extent is live (no lease after); return how many are still live."""
        if not self.extents:
            self.retired = True
        return len(self.extents)
