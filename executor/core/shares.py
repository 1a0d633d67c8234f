"""Shares by identity: the ring bytes and deferred places each identity's rooms may take.

An identity is the key that owns a room (`Room.owner`: the key the engine named at
`register`, or the first frame's). Every extent leased for a room is charged to that
identity's `Share` from its lease until it is `free` again, whatever it does between
(copying, staged, parked, sending, quarantined), so bytes a room holds always count
against somebody, and all the sessions of one key count against one budget. A room with
no owner yet is charged to the unclaimed share (`None`) until a frame claims it.

How big a share is: `1 / n` of the ring and of the deferred queue, `n` the named identities
that have had a room on this worker (max-min fairness with every identity's demand taken as
unbounded), or a fixed fraction (`identity_ring_share`). It is a reservation, not a
work-conserving split: ring bytes cannot be taken back (a write may read its extent until it
reports and its quarantine ends, up to `write_timeout + quarantine_s`), so a share an
identity got while it was alone could not be returned when another arrives. With one
identity only it is the whole ring, so a worker serving one prefill instance loses nothing.

The deferred queue is one FIFO per identity, served round-robin (one item per identity per
turn), so one identity's backlog delays another's items by at most one item per turn.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class Share:
    """What one identity's rooms hold: ring bytes (`held`, of which `parked`) and deferred sends."""

    __slots__ = ("identity", "held", "parked", "queue")

    def __init__(self, identity: str | None):
        self.identity = identity
        self.held = 0  # bytes of live extents leased for its rooms (see the module)
        self.parked = 0  # of those, bytes of chunks parked for receivers not all registered
        self.queue: deque[tuple[Any, Any]] = deque()  # its deferred sends, oldest first

    def __repr__(self) -> str:
        return f"share {self.identity!r}: {self.held} B ({self.parked} B parked), {len(self.queue)} deferred"


class Shares:
    """Every identity's share, and the round-robin order of the deferred queues."""

    def __init__(self, ring_bytes: int, max_deferred: int, fraction: float | None = None):
        self.ring_bytes = ring_bytes
        self.max_deferred = max_deferred
        self.fraction = fraction  # None: 1 / named identities
        self.by_identity: dict[str | None, Share] = {}
        self.named = 0  # identities other than the unclaimed share
        # Identities with deferred sends, in the order they are next served (a dict keeps the order).
        self.waiting: dict[str | None, Share] = {}
        self.deferred = 0  # deferred sends in all
        self.cap: int | None = None  # bytes one identity may hold (None: no bound)
        self.queue_cap = max_deferred  # deferred sends one identity may have
        self._resize()

    def of(self, identity: str | None) -> Share:
        share = self.by_identity.get(identity)
        if share is None:
            share = self.by_identity[identity] = Share(identity)
            if identity is not None:
                self.named += 1
                self._resize()
        return share

    def _resize(self) -> None:
        f = self.fraction if self.fraction is not None else 1.0 / max(1, self.named)
        self.cap = None if f >= 1 else max(1, int(self.ring_bytes * f))
        self.queue_cap = self.max_deferred if f >= 1 else max(1, int(self.max_deferred * f))

    def over(self, share: Share, nbytes: int) -> bool:
        """May `share` not take `nbytes` more? One holding nothing may always take one chunk."""
        cap = self.cap
        return cap is not None and share.held > 0 and share.held + nbytes > cap

    # the deferred queues ---------------------------------------------------
    def over_queue(self) -> Share | None:
        """The identity with the most deferred sends past its part of the queue, if any: parts shrink
        as identities come, so one that filled the queue alone gives way to a newcomer."""
        worst = max(self.waiting.values(), key=lambda sh: len(sh.queue), default=None)
        return worst if worst is not None and len(worst.queue) > self.queue_cap else None

    def defer(self, share: Share, entry: tuple[Any, Any]) -> None:
        """Queue a send at the back of its identity's queue (`has_place` said it may)."""
        if not share.queue:
            self.waiting[share.identity] = share
        share.queue.append(entry)
        self.deferred += 1

    def remove(self, share: Share, i: int) -> None:
        """The `i`-th of `share`'s sends left the queue (staged, dropped or failed)."""
        q = share.queue
        if i:
            del q[i]
        else:
            q.popleft()
        self.deferred -= 1
        if not q:
            del self.waiting[share.identity]

    def rotate(self, share: Share) -> None:
        """`share` was served this turn: it goes to the back of the round."""
        if share.queue:
            del self.waiting[share.identity]
            self.waiting[share.identity] = share

    def entries(self) -> list[tuple[Any, Any]]:
        """Every deferred send, identity by identity in serving order."""
        return [e for share in self.waiting.values() for e in share.queue]

    def clear(self) -> int:
        n = self.deferred
        for share in self.waiting.values():
            share.queue.clear()
        self.waiting.clear()
        self.deferred = 0
        return n


__all__ = ["Share", "Shares"]
