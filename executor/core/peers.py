"""The peer table: one `peer` machine per receiver session, and the rules around it.

Sans-I/O like the rest of the core. First contact with a peer runs at the edge:
`contact` arms a connect deadline and leaves a `Contact` effect for the driver,
which starts it without blocking (`Transport.connect`) and reports the answer
back (`EncodeManager.contacts_reported`). Every report carries
the attempt number it answers, so a report that arrives after its deadline
(a handshake that hung for a minute) cannot revive a later attempt.

The manager asks one O(1) question on the write path: is this session's peer
`up`? Everything else here runs on frames, reports and deadlines.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from epd_ring.fsm import PEER
from epd_ring.fsm.couplings import ON_ENTER

from . import settings
from .clock import Clock
from .effects import Contact, Effect
from .timers import Deadlines

# Derived from the declaration: where a contact is under way and its report awaited.
_CONTACTING = PEER.sources("connected")


class Peer:
    __slots__ = ("session", "state", "fails", "attempt", "timer", "due", "retry_at", "rooms", "reason", "table",
                 "identity", "owner")

    def __init__(self, session: str, table: PeerTable, identity: str = ""):
        self.session = session
        self.identity = identity  # whose frame made this peer: it counts against that identity's cap
        self.owner: str | None = None  # the identity the peer's own memory names, once its contact read it
        self.state = PEER.initial
        self.fails = 0  # consecutive failed or overdue writes
        self.attempt = 0  # number of the contact whose report we wait for
        self.timer = 0
        self.due = 0.0
        self.retry_at = 0.0
        self.rooms: set[int] = set()  # live rooms with a frame from this session
        self.reason = ""
        self.table = table

    # guards named in the peer declaration
    def backing_off(self) -> bool:
        return self.table.clock.now() < self.retry_at

    def at_threshold(self) -> bool:
        return self.fails >= self.table.fail_threshold

    def __repr__(self) -> str:
        return f"peer {self.session}"


class PeerTable:
    """Peers by session, bounded by `max_peers` in all and `max_peers_per_identity` per identity
    that made them (idle peers are forgotten oldest first), so one identity naming sessions
    by the thousand fills its own share, never the table."""

    def __init__(self, outbox: list[Effect], clock: Clock, deadlines: Deadlines, *,
                 connect_timeout: float = 5.0, backoff: float = 5.0, fail_threshold: int = 3,
                 max_peers: int = 4096, max_peers_per_identity: int = 256,
                 actions: Mapping[str, Callable[[Any], None]] | None = None):
        if settings.seconds("connect_timeout", connect_timeout) == 0:
            raise ValueError("connect_timeout must be > 0 seconds, got 0")
        self.outbox = outbox
        self.clock = clock
        self.deadlines = deadlines
        self.connect_timeout = float(connect_timeout)
        self.backoff = settings.seconds("peer_backoff", backoff)
        self.fail_threshold = settings.count("peer_fail_threshold", fail_threshold, 1)
        self.max_peers = settings.count("max_peers", max_peers, 1)
        self.max_peers_per_identity = settings.count("max_peers_per_identity", max_peers_per_identity, 1)
        self.per_identity: Counter[str] = Counter()  # peers made by each identity
        # Called when a contact names the peer's owner, before the peer comes up (so no write
        # of another identity's room goes to it): the admission's `owner_proven`.
        self.on_owner: Callable[[Peer], None] | None = None
        # The coupling actions (fsm/couplings.py) a peer's step runs: the manager's.
        self.actions: Mapping[str, Callable[[Any], None]] = actions or {}
        self.by_session: OrderedDict[str, Peer] = OrderedDict()
        self.stats: Counter[str] = Counter()

    def step(self, peer: Peer, event: str) -> str:
        """The one place a peer is stepped: its machine, then the actions of the state entered."""
        was = peer.state
        now = PEER.step(peer, event)
        if now != was:
            for action in ON_ENTER.get(("peer", now), ()):
                self.actions[action](peer)
        return now

    def get(self, session: str) -> Peer | None:
        return self.by_session.get(session)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Each peer's state, consecutive failures, live rooms and last reason, for dumps."""
        return {s: {"state": p.state, "fails": p.fails, "rooms": len(p.rooms), "reason": p.reason}
                for s, p in self.by_session.items()}

    def counts(self) -> dict[str, int]:
        c = Counter(p.state for p in self.by_session.values())
        return {s: c.get(s, 0) for s in PEER.states}

    # a frame names the peer -------------------------------------------------
    def contact(self, session: str, identity: str = "") -> Peer | None:
        """The peer a frame from `session` will be written through; None if the table is full,
        or `identity`'s share of it is (with none of its own peers idle to forget).

        Starts first contact (or a retry of a down peer whose backoff passed).
        The returned peer may be `up`, `connecting`, `suspect` or `down`.
        """
        peer = self.by_session.get(session)
        if peer is None:
            if self.per_identity[identity] >= self.max_peers_per_identity and not self._forget_one(identity):
                self.stats["peers_refused_identity"] += 1
                return None
            if len(self.by_session) >= self.max_peers and not self._forget_one():
                self.stats["peers_refused"] += 1
                return None
            peer = self.by_session[session] = Peer(session, self, identity)
            self.per_identity[identity] += 1
        was = peer.state
        if was == "up":
            return peer  # the declared up -> up self-loop; nothing to do on the frame path
        if self.step(peer, "contact") == "connecting" and was != "connecting":
            self._start(peer)
        return peer

    def _forget_one(self, identity: str | None = None) -> bool:
        """Forget the oldest idle peer (of `identity`'s, if given)."""
        for session, peer in self.by_session.items():
            if not peer.rooms and peer.state not in _CONTACTING and identity in (None, peer.identity):
                self.deadlines.cancel(peer)
                del self.by_session[session]
                self.per_identity[peer.identity] -= 1
                if not self.per_identity[peer.identity]:
                    del self.per_identity[peer.identity]
                self.stats["peers_forgotten"] += 1
                return True
        return False

    def _start(self, peer: Peer) -> None:
        """Ask the edge to contact the peer; its answer comes back through `report`."""
        peer.attempt += 1
        self.stats["contacts"] += 1
        self.deadlines.arm(self.clock.now() + self.connect_timeout, "connect", peer)
        self.outbox.append(Contact(peer.session, peer.attempt, peer.identity))

    # the edge reports ------------------------------------------------------
    def report(self, session: str, attempt: int, ok: bool, detail: str = "", owner: str | None = None) -> None:
        peer = self.by_session.get(session)
        if peer is None or attempt != peer.attempt or peer.state not in _CONTACTING:
            self.stats["reports_stale"] += 1  # answers a contact whose deadline already passed
            return
        self.deadlines.cancel(peer)
        if ok:
            if owner is not None:
                # Before the peer comes up: the rooms of other identities leave it first.
                peer.owner = owner
                self.stats["owners_proven"] += 1
                if self.on_owner is not None:
                    self.on_owner(peer)
            peer.fails = 0
            peer.reason = ""
            self.stats["connected"] += 1
            self.step(peer, "connected")
        else:
            self._down(peer, "refused", f"contact failed ({detail or 'refused'})")

    def expired(self, peer: Peer) -> None:
        """The connect deadline passed with no report."""
        self._down(peer, "connect_expired",
                   f"no answer to contact within the connect deadline of {self.connect_timeout} s")

    def _down(self, peer: Peer, event: str, reason: str) -> None:
        peer.reason = reason
        peer.retry_at = self.clock.now() + self.backoff
        self.stats["down"] += 1
        self.step(peer, event)

    # write reports ---------------------------------------------------------
    def write_ok(self, peer: Peer) -> None:
        if peer.fails:
            peer.fails = 0
        if peer.state != "up":
            self.step(peer, "write_ok")

    def write_failed(self, peer: Peer) -> None:
        peer.fails += 1
        was = peer.state
        if self.step(peer, "write_failed") == "suspect" and was == "up":
            # Re-check at the edge; until it answers no new write goes to the peer.
            self.stats["suspect"] += 1
            self._start(peer)


def down_reason(peer: Peer) -> str:
    return f"peer {peer.session} is down: {peer.reason}"


__all__ = ["Peer", "PeerTable", "down_reason"]
