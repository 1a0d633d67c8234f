"""Lease, stage, defer: how an encoded item gets into an extent (base of `EncodeExecutor`).

An item leases an extent of the ring's arena sized to its bytes at once, or
waits in the deferred queue (bounded). The queue is strict FIFO: while its head
does not fit, nothing behind it is served and new items queue behind it, so a
large item is never overtaken by small ones; it waits only for bytes already
leased to come free, which every extent's deadlines bound (park, write,
quarantine). An item that could never fit (larger than the whole arena, or than
`max_item_bytes`) fails its room at once (`too_large`). Its embedding is copied
into the extent's registered memory; on CUDA the copy is asynchronous, so the
chunk goes to the manager only once its copy fence has passed.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .manager import Chunk, EncodeManager
from .reasons import Reason, ReasonKind
from .ring import Extent, Ring

log = logging.getLogger("epd_ring.executor")


class StagingError(ValueError):
    """An item that cannot be staged (wrong shape, no deepstack arena); fails only its room."""


class TooLarge(StagingError):
    """An item that could never fit the ring (`ReasonKind.TOO_LARGE`); fails only its room."""


# An item's embedding and deepstack half with their byte sizes, as `_check` found them.
Checked = tuple[torch.Tensor, int, 'torch.Tensor | None', int]

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _sizes(item: Any) -> tuple[int, int]:
    """Bytes of an item's embedding and deepstack half (0 for what `_check` will refuse when staged)."""
    return tuple(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0  # type: ignore[return-value]
                 for t in (getattr(item, "encoded", None), getattr(item, "encoded_deepstack", None)))


@dataclass(slots=True)
class Sender:
    request_id: Any
    room: int
    bootstrap_host: str
    bootstrap_port: int
    # Its one item was taken: it reached the ring path (staged, deferred or dropped) or the tower failed on it.
    offered: bool = False

    @property
    def bootstrap_room(self) -> int:
        """The seed's name for `room` (its senders carried it), read by loops written for the seed."""
        return self.room


class Staging:
    manager: EncodeManager
    ring: Ring
    senders: dict[Any, Sender]
    stats: Counter[str]
    max_deferred: int
    _deferred: deque[tuple[Any, Any]]
    _copies: deque[tuple[Any, Sender, Chunk]]
    _copy_fence: Callable[[], Any] | None
    _host_copy: bool
    _head_waits: bool  # the deferred queue's head waits for bytes (set by serve_deferred)

    def _offer(self, rid: Any, item: Any) -> None:
        sender = self.senders.get(rid)
        if sender is None:
            self.stats["items_without_sender"] += 1
            log.error("dropping item for unregistered request %r", rid)
            return
        room = sender.room
        manager = self.manager
        if sender.offered:
            manager.fail_room(room, Reason(ReasonKind.PROTOCOL, f"request {sender.request_id!r} sent a second item; "
                                                                "a room carries exactly one"))
            return
        sender.offered = True
        # Settle what can be settled now, before the item waits for a slot.
        if not manager.accepts_chunk(room):
            self.stats["items_for_concluded_rooms"] += 1  # never written (its room failed)
            return
        try:
            checked = self._check(item)
        except Exception as exc:  # StagingError, or an item without the attributes
            kind = ReasonKind.TOO_LARGE if isinstance(exc, TooLarge) else ReasonKind.ITEM
            manager.fail_room(room, Reason(kind, f"staging failed: {exc}"))
            return
        if self._deferred:
            self.serve_deferred()  # deferred sends are served before new ones
        # Deferred sends that serve_deferred passed over wait on their receivers' peers' bound, not the
        # bytes; only a head that waits for bytes keeps this item behind it.
        extent = None
        cost = self.ring.extent_cost(checked[1], checked[3])  # what a peer's bound counts
        if not (self._deferred and self._head_waits) and not manager.held_back(room, cost):
            extent = self.ring.lease(checked[1], checked[3])
        if extent is None:
            if len(self._deferred) >= self.max_deferred:
                manager.fail_room(room, Reason(ReasonKind.DEFERRED_FULL,
                                               f"deferred queue full ({self.max_deferred} sends)"))
                return
            enc = item.encoded
            if isinstance(enc, torch.Tensor):
                # The tower may reuse its output buffer for the next batch.
                item.encoded = enc.clone()
                if isinstance(item.encoded_deepstack, torch.Tensor):
                    item.encoded_deepstack = item.encoded_deepstack.clone()
            self._deferred.append((rid, item))
            self.stats["deferred"] += 1
            if manager.observer is not None:
                manager.observer.deferred(room)
            return
        self._stage(sender, checked, extent, cost)

    def serve_deferred(self) -> None:
        """Stage deferred sends, oldest first, while the oldest fits (strict FIFO: see the module).

        A send whose receiver's peer holds its bound of ring bytes is passed over: it keeps its place
        and blocks nobody (a stuck receiver must not hold up the healthy ones' sends)."""
        dq = self._deferred
        manager = self.manager
        passed: list[tuple[Any, Any]] = []
        self._head_waits = False
        while dq:
            rid, item = dq[0]
            sender = self.senders.get(rid)
            if sender is None:
                dq.popleft()
                self.stats["deferred_dropped"] += 1  # its sender was reaped
                continue
            room = sender.room
            cost = self.ring.extent_cost(*_sizes(item))
            if manager.held_back(room, cost):
                passed.append(dq.popleft())
                continue
            if not manager.accepts_chunk(room):  # its room concluded meanwhile (or just failed held back)
                dq.popleft()
                if manager.observer is not None:
                    manager.observer.undeferred(room)
                self.stats["items_for_concluded_rooms"] += 1
                continue
            try:
                # It passed before it was deferred, but the caller may have changed
                # the item since (dropped `encoded`, say): fail its room, not the loop.
                checked = self._check(item)
            except Exception as exc:
                dq.popleft()
                if manager.observer is not None:
                    manager.observer.undeferred(room)
                manager.fail_room(room, Reason(ReasonKind.ITEM, f"staging failed for a deferred send: {exc}"))
                continue
            extent = self.ring.lease(checked[1], checked[3])
            if extent is None:
                self._head_waits = True  # the head waits for bytes to come free; nothing behind it overtakes it
                break
            dq.popleft()
            if manager.observer is not None:
                manager.observer.undeferred(room)
            self._stage(sender, checked, extent, cost)
        if passed:
            dq.extendleft(reversed(passed))

    def drain_deferred(self) -> None:
        """The seed's name for `serve_deferred`, kept so an encode loop written for the seed's executor
        runs unchanged (here "drain" means the shutdown; see the glossary)."""
        self.serve_deferred()

    def has_deferred(self) -> bool:
        return bool(self._deferred)

    @property
    def deferred_count(self) -> int:
        return len(self._deferred)

    def deferred_requests(self) -> list[Any]:
        """Request ids of the deferred sends, oldest (served first) first."""
        return [rid for rid, _ in self._deferred]

    def copy_fences(self) -> list[tuple[Any, int]]:
        """(fence, room) of each copy still pending: a driver that steps finer than a tick (the model's
        lockstep test) completes a fence, then calls `finish_copies`."""
        return [(fence, sender.room) for fence, sender, _ in self._copies]

    @property
    def copies_pending(self) -> int:
        """Chunks whose copy into their slot has not finished (their fence has not passed)."""
        return len(self._copies)

    def drop_deferred(self) -> int:
        """Forget every deferred send (their rooms failed, at a drain); return how many."""
        n = len(self._deferred)
        if n:
            self.stats["deferred_dropped"] += n
            self._deferred.clear()
        return n

    def _check(self, item: Any) -> Checked:
        """The item's embedding (and deepstack half) with their byte sizes, or StagingError."""
        ring = self.ring
        enc = item.encoded
        if not isinstance(enc, torch.Tensor) or enc.dim() != 2:
            raise StagingError(f"item.encoded must be a 2-D tensor, got {type(enc).__name__}"
                               f"{tuple(enc.shape) if isinstance(enc, torch.Tensor) else ''}")
        nbytes = enc.numel() * enc.element_size()
        deep = item.encoded_deepstack
        if deep is None or deep.numel() == 0:
            if nbytes > ring.fits_bytes:
                raise TooLarge(f"{ring.too_large(nbytes)}; raise arena_bytes or max_item_bytes")
            return enc, nbytes, None, 0
        if ring.deep is None:
            raise StagingError("item has deepstack rows but the model declares no deepstack ring")
        if deep.dim() != 2 or deep.shape[0] != enc.shape[0]:
            raise StagingError(f"deepstack shape {tuple(deep.shape)} does not match {enc.shape[0]} rows")
        dbytes = deep.numel() * deep.element_size()
        why = ring.too_large(nbytes, dbytes)
        if why is not None:
            raise TooLarge(f"{why}; raise arena_bytes (or deep_arena_bytes) or max_item_bytes")
        return enc, nbytes, deep, dbytes

    def _copy(self, dst_ptr: int, view: Callable[[Extent, int], torch.Tensor], slot: Extent, src: torch.Tensor,
              nbytes: int) -> None:
        if self._host_copy and src.is_cpu:
            # A lazily negated view keeps un-negated storage: resolve it before copying raw bytes.
            src = src.resolve_neg().contiguous()
            ctypes.memmove(dst_ptr, src.data_ptr(), nbytes)
        else:
            view(slot, nbytes).view(src.dtype).view(src.shape).copy_(src, non_blocking=True)

    def _stage(self, sender: Sender, checked: Checked, slot: Extent, cost: int) -> None:
        room = sender.room
        manager = self.manager
        enc, nbytes, deep, dbytes = checked
        ring = self.ring
        manager.hold(room, cost)
        obs = manager.observer
        if obs is not None:
            obs.copy_started(room)
        try:
            src = ring.main_base + slot.offset  # ring.main_ptr(slot)
            self._copy(src, ring.main_view, slot, enc, nbytes)
            deep_src = deep_rb = levels = 0
            if deep is not None:
                deep_src = ring.deep_ptr(slot)
                self._copy(deep_src, ring.deep_view, slot, deep, dbytes)
                deep_rb = deep.shape[1] * deep.element_size()
                levels, rest = divmod(deep.shape[1], enc.shape[1]) if enc.shape[1] else (-1, 0)
                if rest or deep.dtype != enc.dtype:
                    levels = -1
        except Exception as exc:
            ring.fire(slot, "abandon")
            manager.fail_room(room, Reason(ReasonKind.ITEM, f"staging failed: {exc}"))
            return
        rows, hidden = enc.shape
        chunk = Chunk(slot, rows, hidden, _dtype_name(enc.dtype), nbytes // rows if rows else 0,
                      src, deep_src, deep_rb, levels)
        slot.room = room
        if self._copy_fence is not None:
            # The write must not read the slot before the copy into it has finished.
            self._copies.append((self._copy_fence(), sender, chunk))
            return
        ring.fire(slot, "copied")
        if obs is not None:
            obs.copy_finished(room)
        manager.submit_chunk(room, chunk)

    def finish_copies(self) -> int:
        """Hand every staged chunk whose copy has finished to the manager (part of `poll`).

        Exposed for drivers that step finer than a tick, such as the model's lockstep test.
        """
        # Any finished copy goes on, not only the oldest: copies on different
        # streams may finish out of order. At most one copy per slot is pending.
        done = [c for c in self._copies if c[0].query()]
        if not done:
            return 0
        self._copies = deque(c for c in self._copies if not any(c is d for d in done))
        obs = self.manager.observer
        for _, sender, chunk in done:
            self.ring.fire(chunk.slot, "copied")
            if obs is not None:
                obs.copy_finished(sender.room)
            self.manager.submit_chunk(sender.room, chunk)
        return len(done)
