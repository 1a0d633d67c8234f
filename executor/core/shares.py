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

Forgetting: an identity is *idle* while it holds no bytes and has no deferred send (a live room of
it that holds nothing takes nothing from the ring, and an identity holding nothing may always take
one chunk, so its share only matters once it holds). One idle for `idle_s` on the injected clock
is forgotten: `n` drops and every other share grows back, so the table stays bounded by the
identities active within the last `idle_s`. Not at once: a victim whose rooms each succeed before
the next arrives is idle between them, and forgetting it then would hand its share to whoever
holds the most meanwhile, for as long as those bytes take to come back (up to `write_timeout +
quarantine_s`); the default `idle_s` (60 s) outlasts that with the default settings. Its next send
names it again, as a newcomer.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

IDLE_S = 60.0  # an idle identity is forgotten after this long (see the module)


class Share:
    """What one identity's rooms hold: ring bytes (`held`, of which `parked`) and deferred sends."""

    __slots__ = ("identity", "_held", "parked", "queue", "_shares")

    def __init__(self, identity: str | None, shares: Shares | None = None):
        self.identity = identity
        self._held = 0  # bytes of live extents leased for its rooms (see the module)
        self.parked = 0  # of those, bytes of chunks parked for receivers not all registered
        self.queue: deque[tuple[Any, Any]] = deque()  # its deferred sends, oldest first
        self._shares = shares  # told when this share turns idle or busy (None: a share nobody forgets)

    @property
    def held(self) -> int:
        return self._held

    @held.setter
    def held(self, nbytes: int) -> None:
        # The charging sites (ring, manager) only add and subtract: whether that made the share idle or
        # busy is noticed here, so they need not know about forgetting.
        was = self._held
        self._held = nbytes
        if self._shares is not None and (was == 0) != (nbytes == 0):
            self._shares.touched(self)

    def charge(self, nbytes: int) -> None:
        """`held += nbytes` (negative to give back) in one call: the per-item path's."""
        was = self._held
        now = self._held = was + nbytes
        if self._shares is not None and (was == 0) != (now == 0):
            self._shares.touched(self)

    @property
    def idle(self) -> bool:
        return self._held == 0 and not self.queue

    def __repr__(self) -> str:
        return f"share {self.identity!r}: {self.held} B ({self.parked} B parked), {len(self.queue)} deferred"


class Shares:
    """Every identity's share, and the round-robin order of the deferred queues."""

    def __init__(self, ring_bytes: int, max_deferred: int, fraction: float | None = None,
                 clock: Callable[[], float] | None = None, idle_s: float = IDLE_S):
        if idle_s < 0:
            raise ValueError(f"idle_s must be >= 0, got {idle_s}")
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
        # Without a clock nothing is forgotten (a share table that lives as long as one test).
        self.clock = clock
        self.idle_s = idle_s
        self.idle_since: OrderedDict[str | None, float] = OrderedDict()  # idle shares, longest idle first
        self._resize()

    def of(self, identity: str | None) -> Share:
        if self.idle_since:  # `forget_idle` has nothing to forget otherwise
            self.forget_idle()
        share = self.by_identity.get(identity)
        if share is None:
            share = self.by_identity[identity] = Share(identity, self if self.clock is not None else None)
            if identity is not None:
                self.named += 1
                self._resize()
            self.touched(share)  # idle until it holds or defers: forgotten if it never does
        return share

    def touched(self, share: Share) -> None:
        """`share` may have turned idle or busy: (un)mark it for forgetting."""
        if self.clock is None or self.by_identity.get(share.identity) is not share:
            return  # a share already forgotten (a room's old reference) is nobody's
        if share._held == 0 and not share.queue:  # `share.idle`, without the property's call
            self.idle_since.setdefault(share.identity, self.clock())
        else:
            self.idle_since.pop(share.identity, None)

    def forget_idle(self) -> int:
        """Forget the identities idle for `idle_s` or longer; the shares of the others grow back."""
        if not self.idle_since:
            return 0
        assert self.clock is not None
        horizon = self.clock() - self.idle_s
        gone = 0
        while self.idle_since:
            identity, since = next(iter(self.idle_since.items()))
            if since > horizon:
                break
            del self.idle_since[identity]
            del self.by_identity[identity]
            if identity is not None:
                self.named -= 1
                gone += 1
        if gone:
            self._resize()
        return gone

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
        self.touched(share)

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
            self.touched(share)

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
        emptied = list(self.waiting.values())
        for share in emptied:
            share.queue.clear()
        self.waiting.clear()
        self.deferred = 0
        for share in emptied:
            self.touched(share)
        return n


__all__ = ["Share", "Shares"]
