"""Lease, stage, defer: how an encoded item gets into an extent (the executor's `staging` part).

An item leases an extent of the ring's arena sized to its bytes at once, or
waits in the deferred queue (bounded): one FIFO per identity, served
round-robin (shares.py). While a send that is within every bound does not fit,
nothing is served and new items queue behind it, so a large item is never
overtaken by small ones; it waits only for bytes already leased to come free,
which every extent's deadlines bound (park, write, quarantine). An item that
could never fit (larger than the whole arena, or than `max_item_bytes`) fails
its room at once (`too_large`). Its embedding is copied into the extent's
registered memory; on CUDA the copy is asynchronous, so the chunk goes
to the manager only once its copy fence has passed.
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
from .shares import Share, Shares

log = logging.getLogger("epd_ring.executor")


class StagingError(ValueError):
    """An item that cannot be staged (wrong shape, no deepstack arena); fails only its room."""


class TooLarge(StagingError):
    """An item that could never fit the ring (`ReasonKind.TOO_LARGE`); fails only its room."""


# An item's embedding and deepstack half with their byte sizes, as `_check` found them.
Checked = tuple[torch.Tensor, int, 'torch.Tensor | None', int]

_DTYPE_NAMES: dict[torch.dtype, str] = {}
_EVICTED = "deferred queue full: this identity held more than its part of it"


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _sizes(item: Any) -> tuple[int, int]:
    """Bytes of an item's embedding and deepstack half (0 for what `_check` will refuse when staged)."""
    return tuple(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0  # type: ignore[return-value]
                 for t in (getattr(item, "encoded", None), getattr(item, "encoded_deepstack", None)))


def copy_into(host_copy: bool, dst_ptr: int, view: Callable[[Extent, int], torch.Tensor], extent: Extent,
              src: torch.Tensor, nbytes: int) -> None:
    """Copy `src`'s bytes to the extent's run at `dst_ptr` (a host memmove, else through its `view`)."""
    if host_copy and src.is_cpu:
        # A lazily negated view keeps un-negated storage: resolve it before copying raw bytes (asked
        # first: `resolve_neg` of a plain tensor costs five times `is_neg`).
        if src.is_neg():
            src = src.resolve_neg()
        src = src.contiguous()
        ctypes.memmove(dst_ptr, src.data_ptr(), nbytes)
        _kept(src)
    else:
        view(extent, nbytes).view(src.dtype).view(src.shape).copy_(src, non_blocking=True)


def _kept(src: torch.Tensor) -> None:
    """Nothing: called once the bytes of `src` are copied, so that it lives until then. Compiled
    (setup.py), a local is released at its last use, and a tensor made here (a resolved negation, a
    contiguous copy) was last used to read its address: its memory went back before the memmove."""


def copy_pieces(host_copy: bool, arena: torch.Tensor | None, base: int, pieces: tuple[tuple[int, int], ...],
                src: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """Copy `src`'s bytes into a spanning extent's pieces of `arena` (at `base`), in order; (address,
    bytes) of each."""
    if src.is_neg():
        src = src.resolve_neg()
    src = src.contiguous()
    flat = None if host_copy and src.is_cpu else src.view(-1).view(torch.uint8)
    at = 0  # the item's byte this piece begins with
    out = []
    for offset, n in pieces:
        if flat is None:
            ctypes.memmove(base + offset, src.data_ptr() + at, n)
        else:
            assert arena is not None  # the ring leased these pieces from it
            arena[offset:offset + n].copy_(flat[at:at + n], non_blocking=True)
        out.append((base + offset, n))
        at += n
    _kept(src)
    return tuple(out)


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


class StagedCalls:
    """The calls and figures an executor answers through its `staging` part, each `Staging`'s own of
    that name: the seed's (`drain_deferred`, `has_deferred`), the loop's gate and the deferred queue's
    and copies' gauges. A base of `EncodeExecutor`, so that its class stays compiled (setup.py): a
    compiled class runs methods, not descriptors made at import."""

    staging: Staging

    def serve_deferred(self) -> None:
        self.staging.serve_deferred()

    def drain_deferred(self) -> None:
        self.staging.drain_deferred()

    def has_deferred(self) -> bool:
        return self.staging.has_deferred()

    def can_take(self) -> bool:
        return self.staging.can_take()

    @property
    def deferred_count(self) -> int:
        return self.staging.deferred_count

    def deferred_requests(self) -> list[Any]:
        return self.staging.deferred_requests()

    def copy_fences(self) -> list[tuple[Any, int]]:
        return self.staging.copy_fences()

    @property
    def copies_pending(self) -> int:
        return self.staging.copies_pending

    def finish_copies(self) -> int:
        return self.staging.finish_copies()

    def drop_deferred(self) -> int:
        return self.staging.drop_deferred()

    @property
    def max_deferred(self) -> int:
        return self.staging.max_deferred

    @max_deferred.setter
    def max_deferred(self, value: int) -> None:
        self.staging.max_deferred = value


class Staging:
    """Owns the deferred queue's bound and whether its head waits for bytes, and the copies still
    under way; reads the executor's senders and ring, and asks the manager's parts (`holds` for the
    bounds, the manager for a room's state and its chunk)."""

    def __init__(self, manager: EncodeManager, ring: Ring, senders: dict[Any, Sender], *, max_deferred: int,
                 copy_fence: Callable[[], Any] | None, host_copy: bool):
        self.manager = manager
        self.holds = manager.holds  # the bounds an item waits on, and what a leased extent holds
        self.life = manager.lifecycle  # its observer, read per item without a call
        self.ring = ring
        self.senders = senders  # the executor's, by request id
        self.stats: Counter[str] = manager.stats
        self.shares: Shares = manager.holds.shares  # ring bytes and deferred sends by identity
        self.max_deferred = max_deferred
        self.copies: deque[tuple[Any, Sender, Chunk]] = deque()
        self._copy_fence = copy_fence
        self._host_copy = host_copy
        self._head_waits = False  # the queue's head waits for bytes (set by serve_deferred, and offer)

    def offer(self, rid: Any, item: Any) -> None:
        """Lease an extent for the item and stage it, or defer it; a failure fails its room."""
        sender = self.senders.get(rid)
        if sender is None:
            self.stats["items_without_sender"] += 1
            log.error("dropping item for unregistered request %r", rid)
            return
        room = sender.room
        manager = self.manager
        if sender.offered:
            why = f"request {sender.request_id!r} sent a second item; a room carries exactly one"  # pragma: no mutate
            manager.fail_room(room, Reason(ReasonKind.PROTOCOL, why))
            return
        sender.offered = True
        # Settle what can be settled now, before the item waits for an extent.
        if not manager.accepts_chunk(room):
            self.stats["items_for_concluded_rooms"] += 1  # never written (its room failed)
            return
        try:
            checked = self._check(item)
        except Exception as exc:  # StagingError, or an item without the attributes
            kind = ReasonKind.TOO_LARGE if isinstance(exc, TooLarge) else ReasonKind.ITEM
            manager.fail_room(room, Reason(kind, f"staging failed: {exc}"))
            return
        shares = self.shares
        if shares.deferred:
            self.serve_deferred()  # deferred sends are served before new ones
        # Deferred sends that serve_deferred passed over wait on a bound (their identity's share, their
        # receivers' peers'), not the bytes; only a head that waits for bytes keeps this item behind it.
        cost = self.ring.extent_cost(checked[1], checked[3])  # what the shares and a peer's bound count
        tried = not (shares.deferred and self._head_waits) and not self.holds.held_back(room, cost)
        extent = self.ring.lease(checked[1], checked[3]) if tried else None
        if extent is None:
            share = self.holds.share_of(room)
            if len(share.queue) >= shares.queue_cap or (
                    shares.deferred >= self.max_deferred and not self._evict_deferred()):
                manager.fail_room(room, Reason(ReasonKind.DEFERRED_FULL,
                                               f"deferred queue full ({len(share.queue)} sends of this identity, "
                                               f"{shares.queue_cap} its part; {self.max_deferred} in all)"))
                return
            enc = item.encoded
            if isinstance(enc, torch.Tensor):
                # The tower may reuse its output buffer for the next batch.
                item.encoded = enc.clone()
                if isinstance(item.encoded_deepstack, torch.Tensor):
                    item.encoded_deepstack = item.encoded_deepstack.clone()
            shares.defer(share, (rid, item))
            if tried:  # within every bound, no extent for it: it waits for bytes, as serving it would find
                self._head_waits = True
            self.stats["deferred"] += 1
            if self.life.observer is not None:
                self.life.observer.deferred(room)
            return
        self._stage(sender, checked, extent, cost)

    def _evict_deferred(self) -> bool:
        """The queue is full but this identity's part of it is not: the newest send of an identity past
        its part fails (kind `deferred_full`) to make the place. False if none is past its part."""
        shares = self.shares
        over = shares.over_queue()
        if over is None:
            return False
        rid, _ = over.queue[-1]
        sender = self.senders.get(rid)
        self._undefer(over, len(over.queue) - 1, None if sender is None else sender.room)
        self.stats["deferred_evicted"] += 1
        if sender is not None:
            self.manager.fail_room(sender.room, Reason(ReasonKind.DEFERRED_FULL, _EVICTED))
        return True

    def serve_deferred(self) -> None:
        """Stage deferred sends: one per identity per turn, round-robin, each identity's oldest first
        (shares.py), while the one served fits.

        A send held back by a bound (its identity's share, its receiver's peer's bound, the parked bound)
        is passed over: it keeps its place and blocks nobody (a stuck receiver or a greedy identity must
        not hold up the others' sends). A send that waits for bytes (within every bound, but the arena
        has no extent for it) stops the serving, for every identity: nothing overtakes it, so a large
        item is never starved by small ones."""
        shares = self.shares
        self._head_waits = False
        start: dict[Any, int] = {}  # per identity: how many of its oldest sends were passed over
        progress = True
        while progress:
            progress = False
            for share in list(shares.waiting.values()):
                i, staged = self._serve_one(share, start.get(share.identity, 0))
                start[share.identity] = i
                if self._head_waits:
                    return
                if staged:
                    progress = True
                    shares.rotate(share)

    def _serve_one(self, share: Share, i: int) -> tuple[int, bool]:
        """Serve `share`'s oldest send not passed over (from its `i`-th on): (sends passed, staged one?)."""
        q = share.queue
        shares = self.shares
        manager = self.manager
        holds = self.holds
        while i < len(q):
            rid, item = q[i]
            sender = self.senders.get(rid)
            if sender is None:
                shares.remove(share, i)
                self.stats["deferred_dropped"] += 1  # its sender was reaped
                continue
            room = sender.room
            cost = self.ring.extent_cost(*_sizes(item))
            if holds.held_back(room, cost):
                i += 1
                continue
            if not manager.accepts_chunk(room):  # its room concluded meanwhile (or just failed held back)
                self._undefer(share, i, room)
                self.stats["items_for_concluded_rooms"] += 1
                continue
            try:
                # It passed before it was deferred, but the caller may have changed
                # the item since (dropped `encoded`, say): fail its room, not the loop.
                checked = self._check(item)
            except Exception as exc:
                self._undefer(share, i, room)
                manager.fail_room(room, Reason(ReasonKind.ITEM, f"staging failed for a deferred send: {exc}"))
                continue
            extent = self.ring.lease(checked[1], checked[3])
            if extent is None:
                self._head_waits = True  # it waits for bytes to come free; nothing overtakes it
                return i, False
            self._undefer(share, i, room)
            self._stage(sender, checked, extent, cost)
            return i, True
        return i, False

    def _undefer(self, share: Share, i: int, room: int | None) -> None:
        """`share`'s `i`-th send leaves the deferred queue (staged, dropped or failed)."""
        self.shares.remove(share, i)
        if room is not None and self.life.observer is not None:
            self.life.observer.undeferred(room)

    def drain_deferred(self) -> None:
        """The seed's name for `serve_deferred`, kept so an encode loop written for the seed's executor
        runs unchanged (here "drain" means the shutdown; see the glossary)."""
        self.serve_deferred()

    def has_deferred(self) -> bool:
        """Whether any send waits in the deferred queue (the seed's meaning). Not the loop's gate: a
        send held back by its own identity's share or its peer's bound is deferred while the arena
        takes everyone else's items; ask `can_take`."""
        return bool(self.shares.deferred)

    def can_take(self) -> bool:
        """Can the arena take the next item? The encode loop's gate before a tower run.

        False while a deferred send within every bound waits for bytes (the arena is full: a tower run
        now would only add to the queue), or while the deferred queue holds all it may. Sends passed
        over because their identity or their receiver's peer holds its bound do not close it."""
        shares = self.shares
        return not (shares.deferred and self._head_waits) and shares.deferred < self.max_deferred

    @property
    def deferred_count(self) -> int:
        return self.shares.deferred

    def deferred_requests(self) -> list[Any]:
        """Request ids of the deferred sends, identity by identity in the order they are served, each
        identity's oldest first."""
        return [rid for rid, _ in self.shares.entries()]

    def copy_fences(self) -> list[tuple[Any, int]]:
        """(fence, room) of each copy still pending: a driver that steps finer than a tick (the model's
        lockstep test) completes a fence, then calls `finish_copies`."""
        return [(fence, sender.room) for fence, sender, _ in self.copies]

    @property
    def copies_pending(self) -> int:
        """Chunks whose copy into their extent has not finished (their fence has not passed)."""
        return len(self.copies)

    def drop_deferred(self) -> int:
        """Forget every deferred send (their rooms failed, at a drain); return how many."""
        n = self.shares.clear()
        if n:
            self.stats["deferred_dropped"] += n
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

    def _stage(self, sender: Sender, checked: Checked, extent: Extent, cost: int) -> None:
        room = sender.room
        manager = self.manager
        enc, nbytes, deep, dbytes = checked
        ring = self.ring
        self.holds.hold(room, cost, extent)
        obs = self.life.observer
        if obs is not None:
            obs.copy_started(room)
        pieces: tuple[tuple[int, int], ...] = ()
        deep_pieces: tuple[tuple[int, int], ...] = ()
        try:
            src = ring.main_base + extent.offset  # ring.main_ptr(extent)
            if extent.pieces:
                pieces = copy_pieces(self._host_copy, ring.main, ring.main_base, extent.pieces, enc)
            elif self._host_copy and enc.is_cpu and not enc.is_neg() and enc.is_contiguous():
                ctypes.memmove(src, enc.data_ptr(), nbytes)  # `copy_into`'s host path for a plain tensor, inline
            else:
                copy_into(self._host_copy, src, ring.main_view, extent, enc, nbytes)
            deep_src = deep_rb = levels = 0
            if deep is not None:
                deep_src = ring.deep_ptr(extent)
                if extent.deep_pieces:
                    deep_pieces = copy_pieces(self._host_copy, ring.deep, ring.deep_base, extent.deep_pieces, deep)
                else:
                    copy_into(self._host_copy, deep_src, ring.deep_view, extent, deep, dbytes)
                deep_rb = deep.shape[1] * deep.element_size()
                levels, rest = divmod(deep.shape[1], enc.shape[1]) if enc.shape[1] else (-1, 0)
                if rest or deep.dtype != enc.dtype:
                    levels = -1
        except Exception as exc:
            ring.fire(extent, "abandon")
            manager.fail_room(room, Reason(ReasonKind.ITEM, f"staging failed: {exc}"))
            return
        if pieces or deep_pieces:
            self.stats["spanned"] += 1  # items staged across several runs of an arena
        rows, hidden = enc.shape
        dtype = enc.dtype
        chunk = Chunk(extent, rows, hidden, _DTYPE_NAMES.get(dtype) or _dtype_name(dtype),
                      nbytes // rows if rows else 0, src, deep_src, deep_rb, levels, pieces, deep_pieces)
        extent.room = room
        if self._copy_fence is not None:
            # The write must not read the extent before the copy into it has finished.
            self.copies.append((self._copy_fence(), sender, chunk))
            return
        ring.fire(extent, "copied")
        if obs is not None:
            obs.copy_finished(room)
        manager.submit_chunk(room, chunk)

    def finish_copies(self) -> int:
        """Hand every staged chunk whose copy has finished to the manager (part of `poll`).

        Exposed for drivers that step finer than a tick, such as the model's lockstep test.
        """
        # Any finished copy goes on, not only the oldest: copies on different
        # streams may finish out of order. At most one copy per extent is pending.
        done: list[tuple[Any, Sender, Chunk]] = []
        kept: deque[tuple[Any, Sender, Chunk]] = deque()
        for copy in self.copies:  # one pass, in order (compiled, a tuple read back is a new object: no `is`)
            (done if copy[0].query() else kept).append(copy)
        if not done:
            return 0
        self.copies = kept
        obs = self.life.observer
        for _, sender, chunk in done:
            self.ring.fire(chunk.extent, "copied")
            if obs is not None:
                obs.copy_finished(sender.room)
            self.manager.submit_chunk(sender.room, chunk)
        return len(done)
