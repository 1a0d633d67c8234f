"""The peer table: one `peer` machine per receiver session, and the rules around it.

Sans-I/O like the rest of the core. First contact with a peer runs at the edge:
`contact` arms a connect deadline and leaves a `Contact` effect for the driver,
which starts it without blocking (`Transport.connect`) and reports the answer
back (`EncodeManager.contacts_reported`). Every report carries
the attempt number it answers, so a report that arrives after its deadline
(a handshake that hung for a minute) cannot revive a later attempt.

The manager asks one O(1) question on the write path: is this session's peer
`up`? Everything else here runs on frames, reports and deadlines.

Two rules keep one stuck receiver from costing the others:

- Ring bytes per peer: once a room's receivers are all registered and its writes
  start (or wait for a peer's contact), its chunk's ring bytes are held (`hold`)
  against the peer of each of its receivers until that receiver's write reports
  (or, with no write in flight, until the room concludes). A chunk parked for a
  receiver that has not registered has no peer to charge: each identity's parked
  chunks are bounded instead (`EncodeManager.max_parked_bytes`, `held_back`). A room with a
  receiver whose peer holds `max_bytes` does not take ring space (`over_bound`);
  the executor keeps it deferred without blocking the others.
- Health: the first overdue write makes an `up` peer `suspect` (no new writes,
  re-checked at the edge), and an `up` peer with work pending is probed every
  `probe_interval` under the connect deadline (the heartbeat), so a wedged peer
  goes `down` within `probe_interval + connect_timeout`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from epd_ring.fsm import PEER
from epd_ring.fsm.couplings import ON_ENTER

from . import settings
from .clock import Clock
from .effects import Contact, Effect
from .timers import Deadlines

# Derived from the declaration: where a contact is under way and its report awaited.
_CONTACTING = PEER.sources("connected")


class Beat:
    """When a peer is next probed: its own entry in the table's schedule (not a deadline of the peer's)."""

    __slots__ = ("peer", "timer", "due")

    def __init__(self, peer: Peer):
        self.peer, self.timer, self.due = peer, 0, 0.0


class Peer:
    __slots__ = ("session", "state", "fails", "attempt", "timer", "due", "retry_at", "rooms", "reason", "table",
                 "waiting", "held", "holds", "beat", "identity", "owner")

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
        # A contact (first contact, re-check or probe) is under way and its report awaited.
        self.waiting = False
        self.beat = Beat(self)
        self.held = 0  # ring bytes held for this peer's receivers (see `PeerTable.hold`)
        self.holds: dict[int, int] = {}  # room id -> the bytes of `held` that room's chunk holds

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
                 max_peers: int = 4096, probe_interval: float | None = None, max_bytes: int | None = None,
                 max_peers_per_identity: int = 256,
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
        interval = self.connect_timeout if probe_interval is None else probe_interval
        if settings.seconds("peer_probe_interval", interval) == 0:
            raise ValueError("peer_probe_interval must be > 0 seconds, got 0")
        self.probe_interval = float(interval)
        # Ring bytes one peer's receivers may hold before its rooms stop taking ring space
        # (None: no bound; the executor sets a share of its ring).
        self.max_bytes = None if max_bytes is None else settings.count("max_peer_bytes", max_bytes, 1)
        # The heartbeat's schedule: when each up peer with work pending is next probed.
        self.beats = Deadlines()
        self.held_total = 0  # the sum of every peer's `held`: below the bound, no peer can pass it
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
        return {s: {"state": p.state, "fails": p.fails, "rooms": len(p.rooms), "reason": p.reason, "held": p.held}
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
            if (not peer.rooms and not peer.waiting and not peer.held
                    and identity in (None, peer.identity)):
                self.deadlines.cancel(peer)
                self.beats.cancel(peer.beat)
                del self.by_session[session]
                self.per_identity[peer.identity] -= 1
                if not self.per_identity[peer.identity]:
                    del self.per_identity[peer.identity]
                self.stats["peers_forgotten"] += 1
                return True
        return False

    def _start(self, peer: Peer, probe: bool = False) -> None:
        """Ask the edge to contact the peer; its answer comes back through `report`."""
        peer.attempt += 1
        peer.waiting = True
        self.beats.cancel(peer.beat)  # this contact is the probe; the next is armed when it answers
        self.stats["contacts"] += 1
        self.deadlines.arm(self.clock.now() + self.connect_timeout, "connect", peer)
        self.outbox.append(Contact(peer.session, peer.attempt, peer.identity, probe))

    # the heartbeat ---------------------------------------------------------
    def busy(self, peer: Peer) -> bool:
        """Work is pending on the peer: live rooms, or ring bytes held for its receivers."""
        return bool(peer.rooms or peer.held)

    def schedule(self, peer: Peer) -> None:
        """Arm the next probe of an up peer with work pending (none while one is armed or awaited).

        When the work ends the armed probe is left to fire: it finds the peer idle and stops
        there (`probe_due`), so an idle peer is never probed, and the per-item path does not
        pay an arm and a cancel for every room."""
        if not peer.beat.timer and not peer.waiting and peer.state == "up" and self.busy(peer):
            self.beats.arm(self.clock.now() + self.probe_interval, "probe", peer.beat)

    def beat(self, now: float) -> int:
        """Probe every peer whose probe is due (part of the manager's `poll`); return how many."""
        n = 0
        if self.beats.any_due(now):
            for _, beat in self.beats.due(now):
                n += self.probe_due(beat.peer)
        return n

    def probe_due(self, peer: Peer) -> int:
        """The probe interval passed: probe the peer at the edge if it still has work; an idle peer's
        heartbeat just ends here (its next room arms it again, `schedule`)."""
        if peer.state != "up" or peer.waiting or not self.busy(peer):
            return 0
        self.stats["probes"] += 1
        self.step(peer, "probe")
        self._start(peer, probe=True)
        return 1

    # the edge reports ------------------------------------------------------
    def report(self, session: str, attempt: int, ok: bool, detail: str = "", owner: str | None = None) -> None:
        peer = self.by_session.get(session)
        if peer is None or attempt != peer.attempt or not peer.waiting or peer.state not in _CONTACTING:
            self.stats["reports_stale"] += 1  # answers a contact whose deadline already passed
            return
        self.deadlines.cancel(peer)
        peer.waiting = False
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
            self.schedule(peer)
        else:
            what = "probe" if peer.state == "up" else "contact"
            self._down(peer, "refused", f"{what} failed ({detail or 'refused'})")

    def expired(self, peer: Peer) -> None:
        """The connect deadline passed with no report."""
        what = "a probe" if peer.state == "up" else "contact"  # pragma: no mutate (the reason's wording)
        self._down(peer, "connect_expired",
                   f"no answer to {what} within the connect deadline of {self.connect_timeout} s")

    def _down(self, peer: Peer, event: str, reason: str) -> None:
        peer.waiting = False
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
        elif peer.waiting:
            # A write landed while the heartbeat's probe is under way: the receiver is working, which
            # is all the probe asks (over a slow link the probe's answer can wait behind these very
            # writes). Its answer, when it comes, is stale; the next probe is armed as usual.
            self.deadlines.cancel(peer)
            peer.waiting = False
            self.stats["probes_answered_by_writes"] += 1
            self.schedule(peer)

    def write_failed(self, peer: Peer) -> None:
        peer.fails += 1
        self._suspect_after(peer, "write_failed")

    def write_overdue(self, peer: Peer) -> None:
        """Our write deadline passed with no report: the peer is suspect at once."""
        peer.fails += 1
        self._suspect_after(peer, "write_overdue")

    def _suspect_after(self, peer: Peer, event: str) -> None:
        was = peer.state
        if self.step(peer, event) == "suspect" and was == "up":
            # Re-check at the edge; until it answers no new write goes to the peer. A probe under way
            # is the re-check: starting another would push the connect deadline back, and a wedged
            # peer would go down a connect deadline later than the heartbeat's bound.
            self.stats["suspect"] += 1
            if not peer.waiting:
                self._start(peer)

    # ring bytes held per peer ----------------------------------------------
    def over_bound(self, sessions: Iterable[str], nbytes: int) -> Peer | None:
        """The first of these sessions' peers that may not hold `nbytes` more (None: all may).

        A peer holding nothing may always take one chunk, whatever its size."""
        cap = self.max_bytes
        if cap is None:
            return None
        for session in sessions:
            peer = self.by_session.get(session)
            if peer is not None and peer.held and peer.held + nbytes > cap:
                return peer
        return None

    def hold(self, room: int, nbytes: int, sessions: Iterable[str]) -> None:
        """Room `room`'s chunk holds `nbytes` of the ring for each of these sessions' peers."""
        by_session = self.by_session
        for session in sessions:
            peer = by_session.get(session)
            if peer is not None:
                peer.held += nbytes
                # Added to, not set: `let_go` must give back all that was ever held for the room.
                peer.holds[room] = peer.holds.get(room, 0) + nbytes
                self.held_total += nbytes

    def let_go(self, peer: Peer, room: int) -> None:
        """The peer no longer holds `room`'s bytes: its write reported, or the room ended with none in flight."""
        nbytes = peer.holds.pop(room, 0)
        if nbytes:
            peer.held -= nbytes
            self.held_total -= nbytes


def down_reason(peer: Peer) -> str:
    return f"peer {peer.session} is down: {peer.reason}"


__all__ = ["Peer", "PeerTable", "down_reason"]
