"""The encode-side manager: rooms, their writes, deadlines and outcomes.

Sans-I/O: state changes only through calls made by the encode loop's thread
(`bind_sender`, `register_receiver`, `submit_chunk`, `fail_room`, `poll`, and
the edge's reports `writes_reported`, `contacts_reported`); what the world must
do comes back from `take_effects()` (effects.py), never as a call out.

Every room change goes through `step_room`, every extent change through the
ring's `fire`, every peer change through the peer table's `step`: each steps
its declared machine and then runs the actions that fsm/couplings.py lists for
the state entered (or the event taken). So what happens when a room fails is
`step_room(room, "fail")` and the table: abandon its extent, conclude.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Iterable
from typing import Any

from mypy_extensions import mypyc_attr

from epd_ring.fsm import ROOM, ROOM_CONCLUDED

from . import settings
from .admission import Admission
from .clock import Clock, MonotonicClock
from .effects import Effect
from .frames import FrameError, ReceiverFrame, check_against_chunk
from .lifecycle import Lifecycle
from .ratelog import RateLimitedLog
from .reasons import Reason, ReasonKind, as_reason
from .rooms import ACCEPTS_CHUNK, Chunk, Room, RoomConflict
from .tenancy import Tenancy
from .timers import Deadlines
from .tombstones import Tombstone, Tombstones
from .transport import Outcome, Transport
from .writes import Writes

log = logging.getLogger("epd_ring.manager")

# Where a room holds a chunk or writes: a second chunk there is a caller's bug that fails it.
_HOLDS_CHUNK = frozenset(ROOM.states_tagged("in_flight"))


# runs when the class is made, at import, before mutmut switches a mutant on, so no mutant of it could be
# caught: not mutated (the tests read and set the properties it makes)
# pragma: no mutate start
def _owned(part: str, name: str, doc: str) -> Any:
    """A setting or figure one of the manager's parts owns, read and set through the manager."""
    return property(operator.attrgetter(f"{part}.{name}"),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)
# pragma: no mutate end


# compiled (setup.py), a class like any other: its settings are properties made by a call (`_owned`)
@mypyc_attr(native_class=False)
class EncodeManager:
    """Owns the rooms of one encode worker: their frames, writes, deadlines and outcomes.

    Its parts own their state: `lifecycle` the live rooms and their steps (with the peer table and
    `holds`, the ring bytes rooms hold), `admission` what a frame may do, `writes` the writes in
    flight, `tombs` what is kept of concluded rooms. The manager holds them and answers the public
    calls; what a part owns is read here through a direct reference or a property."""

    def __init__(
        self,
        transport: Transport,
        clock: Clock | None = None,
        *,
        park_timeout: float = 120.0,
        announce_timeout: float | None = None,
        write_timeout: float = 60.0,
        quarantine_s: float = 30.0,
        max_tombstones: int = 65536,
        tombstone_ttl: float = 600.0,
        max_announced: int = 4096,
        max_announced_per_identity: int = 1024,
        max_sessions_per_identity: int = 256,
        connect_timeout: float = 5.0,
        peer_backoff: float = 5.0,
        peer_fail_threshold: int = 3,
        max_peers: int = 4096,
        peer_probe_interval: float | None = None,
        max_peer_bytes: int | None = None,
        max_peers_per_identity: int = 256,
        max_parked_bytes: int | None = None,
    ):
        # Kept for set-up only: the ring registers its memory with it once, and a `Pump` drives it.
        # The core never calls it after that (see effects.py).
        self.transport = transport
        self.clock: Clock = clock or getattr(transport, "clock", None) or MonotonicClock()
        self.outbox: list[Effect] = []
        park_timeout = settings.seconds("park_timeout", park_timeout)
        announce_timeout = settings.seconds(
            "announce_timeout", park_timeout if announce_timeout is None else announce_timeout)
        quarantine_s = settings.seconds("quarantine_s", quarantine_s)
        self.tenancy = Tenancy(
            settings.count("max_sessions_per_identity", max_sessions_per_identity, 1),
            max_announced_per_identity=settings.count("max_announced_per_identity", max_announced_per_identity, 1))
        self.tombs = Tombstones(self.clock, max_tombstones, tombstone_ttl)
        self.deadlines = Deadlines()
        self.writes = Writes(self.clock, self.deadlines, settings.seconds("write_timeout", write_timeout),
                             self.outbox)
        self.polled_at: float | None = None  # clock reading of the last poll (health: loop lag)
        self.stats: Counter[str] = Counter()
        # Warnings an identity can provoke at will: one line per kind per second of our clock.
        self.log = RateLimitedLog(log, self.clock.now)
        life = self.lifecycle = Lifecycle(
            self.outbox, self.clock, self.deadlines, self.writes, self.tombs, self.stats, park_timeout=park_timeout,
            announce_timeout=announce_timeout, quarantine_s=quarantine_s,
            max_parked_bytes=None if max_parked_bytes is None else settings.count(
                "max_parked_bytes", max_parked_bytes, 1),
            peers=dict(connect_timeout=connect_timeout, backoff=peer_backoff, fail_threshold=peer_fail_threshold,
                       max_peers=max_peers, probe_interval=peer_probe_interval, max_bytes=max_peer_bytes,
                       max_peers_per_identity=max_peers_per_identity))
        # The lifecycle's parts, held here too: the public calls read them without a call in between.
        self.rooms, self.regions, self.actions = life.rooms, life.regions, life.actions
        self.on_conclude, self.peers, self.holds = life.on_conclude, life.peers, life.holds
        self.admission = life.admission = Admission(
            life, self.tenancy, self.log, settings.count("max_announced", max_announced, 1),
            bool(getattr(transport, "proves_ownership", False)))

    # settings and figures held by the parts -----------------------------------
    park_timeout = _owned("lifecycle", "park_timeout", "seconds a chunk waits parked for its receivers")
    announce_timeout = _owned("lifecycle", "announce_timeout", "seconds announced receivers wait for a sender")
    quarantine_s = _owned("lifecycle", "quarantine_s", "seconds an unsure write's extent keeps its bytes")
    observer = _owned("lifecycle", "observer", "an `observe.Observer` (metrics), or None")
    max_parked_bytes = _owned("holds", "max_parked_bytes", "the bound on one identity's parked chunks' bytes")
    parked_bytes = _owned("holds", "parked_bytes", "ring bytes of chunks parked for receivers not all registered")
    shares = _owned("holds", "shares", "every identity's share of the ring and of the deferred queue")
    max_tombstones = _owned("tombs", "cap", "how many tombstones are kept (a lowered cap holds from the next trim)")
    tombstone_ttl = _owned("tombs", "ttl", "seconds a tombstone nothing pins is kept")
    write_timeout = _owned("writes", "timeout", "seconds a write may take (writes submitted from now on)")
    max_announced = _owned("admission", "max_announced", "rooms receivers may announce before their sender")

    # queries --------------------------------------------------------------
    @property
    def tombstones(self) -> Any:
        return self.tombs.buried

    @property
    def pinned(self) -> dict[int, Tombstone]:
        return self.tombs.pinned

    def room_status(self, room_id: int) -> str | None:
        room = self.rooms.get(room_id)
        if room is not None:
            return room.state
        tomb = self.tombs.get(room_id)
        return tomb.state if tomb is not None else None

    def tombstone(self, room_id: int) -> Tombstone | None:
        return self.tombs.get(room_id)

    def has_sender(self, room_id: int) -> bool:
        """Whether a sender was ever bound to the room, live or concluded: a reaped sender is gone
        from the executor, but its room's record (while kept) still says one came."""
        room = self.rooms.get(room_id)
        if room is not None:
            return room.sender
        tomb = self.tombs.get(room_id)
        return tomb is not None and tomb.sender

    def failure_reason(self, room_id: int) -> Reason | None:
        """Why the room failed (a `Reason`: its `kind` and detail text), or None."""
        tomb = self.tombs.failed(room_id)
        return as_reason(tomb.reason) if tomb is not None else None

    def deadline_of(self, room_id: int) -> float | None:
        """When the room's pending deadline (park or announce) fires, or None if it has none."""
        room = self.rooms.get(room_id)
        return room.due if room is not None and room.timer else None

    def accepts_chunk(self, room_id: int) -> bool:
        room = self.rooms.get(room_id)
        return room is not None and room.state in ACCEPTS_CHUNK

    def is_parked(self, room_id: int) -> bool:
        room = self.rooms.get(room_id)
        return room is not None and room.state == "parked"

    @property
    def writes_in_flight(self) -> int:
        return len(self.writes)

    def oldest_write_age(self) -> float:
        """Seconds since the oldest write still in flight was submitted (0 if none)."""
        return self.writes.oldest_age()

    def snapshot(self) -> dict[int, dict[str, Any]]:
        """Rooms with their state and receivers, for debugging dumps."""
        return {
            rid: {"state": r.state, "receivers": list(r.frames), "n": r.n,
                  "extent": r.chunk.extent.index if r.chunk else None, "deadline": r.due if r.timer else None}
            for rid, r in self.rooms.items()
        }

    # sender side ----------------------------------------------------------
    def bind_sender(self, room_id: int, receiver: str | None = None) -> str:
        """The encode request for `room_id` was registered; return the room's state.

        `receiver` names the identity (authenticated key) whose frames the room
        takes. Named, frames from any other identity, before or after, can neither
        claim, change, fail nor learn about the room. Unnamed, the first identity to
        send a frame for it claims it.
        """
        if type(room_id) is not int or room_id < 0:
            raise ValueError(f"room must be a non-negative integer, got {room_id!r}")
        if receiver is not None and type(receiver) is not str:
            raise ValueError(f"receiver must be an identity string, got {receiver!r}")
        room = self.rooms.get(room_id)
        if room is not None and receiver is not None and room.owner not in (None, receiver) and not room.sender:
            # Announced by another identity: its frames never reach this room. It is told its
            # announcement failed, as it would be if no sender came.
            self.stats["foreign_announcements"] += 1
            self.lifecycle.fail(room, Reason(ReasonKind.FOREIGN, "room not open to this receiver"))
            room = None
        if room is None:
            tomb = self.tombs.get(room_id)
            if tomb is not None and tomb.state == "failed" and receiver is not None and tomb.owner != receiver:
                tomb = None  # failed by another identity's frames: no pre-poisoning of this room
            if tomb is not None:
                if tomb.state == "failed":
                    # Its receivers already failed it (bad frame, expired wait): the
                    # sender binds to the failure and its chunk is never written.
                    self.tombs.pin(tomb)
                    tomb.sender = True
                    return tomb.state
                raise RoomConflict(f"room {room_id} already concluded {tomb.state}; room ids must not be reused")
            room = self.lifecycle.open_room(room_id)
        elif room.sender:
            raise RoomConflict(f"room {room_id} already has a sender")
        if receiver is not None:
            room.owner = receiver
        if room.announced:
            self.admission.unannounce(room)
        room.sender = True
        self.lifecycle.step_room(room, "bind_sender")
        return room.state

    def unbind_sender(self, room_id: int) -> None:
        """What held a concluded room's record let go (its sender was reaped, or its last region
        that a write may still land in was released): the record may age out once nothing holds it."""
        self.tombs.unpin(room_id)

    def submit_chunk(self, room_id: int, chunk: Chunk) -> bool:
        """Hand a staged chunk over; the manager owns its extent from here on."""
        extent = chunk.extent
        room = self.rooms.get(room_id)
        if room is None or room.state not in ACCEPTS_CHUNK:
            extent.ring.fire(extent, "abandon")
            self.stats["chunks_dropped"] += 1
            if room is not None and room.state in _HOLDS_CHUNK:
                self.lifecycle.fail(room, Reason(ReasonKind.PROTOCOL,
                                                 f"room {room_id} got a second chunk; a room carries exactly one"))
            return False
        n, hidden, dtype, levels = chunk.n_tokens, chunk.hidden, chunk.dtype, chunk.deep_levels
        try:
            for f in room.frames.values():
                # The contract's fields compared in place; a frame that differs anywhere gets the
                # check's own call, which raises naming the first difference. (`has_deepstack` needs
                # no comparison of its own: a valid frame has it exactly when `deep_levels` is not 0.)
                if f.span != n or f.hidden != hidden or f.dtype != dtype or f.deep_levels != levels:
                    check_against_chunk(f, n, hidden, dtype, levels)
        except FrameError as exc:
            extent.ring.fire(extent, "abandon")
            self.lifecycle.fail(room, Reason(ReasonKind.FRAME, str(exc)))
            return False
        room.chunk = chunk
        extent.room = room_id
        self.lifecycle.step_room(room, "stage")
        return True

    def fail_room(self, room_id: int, reason: str) -> bool:
        """Conclude a room Failed (a plain string is the engine's own reason); True if this call failed it."""
        settings.room_id("fail_room: room_id", room_id)
        room = self.rooms.get(room_id)
        if room is None:
            tomb = self.tombs.failed(room_id)
            if tomb is not None:
                ROOM.step(tomb, "fail")  # declared: failure is sticky
            return False
        self.lifecycle.fail(room, as_reason(reason))
        return True

    # receiver side --------------------------------------------------------
    def register_receiver(self, frame: ReceiverFrame) -> bool:
        """Apply one receiver registration frame from `frame.identity`; False if it was refused.

        A frame that is not a `ReceiverFrame` is a caller's bug, not a receiver's: it raises
        TypeError naming the argument instead of failing somewhere inside the checks."""
        if not isinstance(frame, ReceiverFrame):
            raise TypeError(f"register_receiver: frame must be a ReceiverFrame, got {type(frame).__name__} "
                            f"{frame!r:.64}")
        return self.admission.register(frame)

    def withdraw(self, room_id: int, session: str, status_endpoint: str = "", identity: str = "") -> str:
        """A receiver withdrew its region of `room_id`: "failed", "deferred" (ack later), "acked" or
        "refused" (see `Admission.withdraw`)."""
        settings.room_id("withdraw: room_id", room_id)
        settings.text("withdraw: session", session)
        settings.text("withdraw: status_endpoint", status_endpoint)
        settings.text("withdraw: identity", identity)
        return self.admission.withdraw(room_id, session, status_endpoint, identity)

    # what the edge reports -----------------------------------------------------
    def writes_reported(self, outcomes: Iterable[tuple[int, Outcome]]) -> int:
        """Outcomes of `Submit` effects, by write id; return how many."""
        n = 0
        on_outcome = self.lifecycle.on_outcome
        for write, outcome in outcomes:
            on_outcome(write, outcome)
            n += 1
        return n

    def writes_overdue(self, writes: Iterable[int]) -> int:
        """Writes the transport gave up on but cannot report yet, by write id (`Transport.overdue`):
        each fails its room now, as at its deadline; return how many were not already overdue."""
        on_overdue = self.lifecycle.on_overdue
        return sum(on_overdue(write) for write in writes)

    def contacts_reported(self, reports: Iterable[tuple[Any, ...]]) -> int:
        """Answers to `Contact` effects: (session, attempt, ok, detail[, owner]); return how many.

        `owner`, from a transport that proves ownership, is the identity the peer's own
        memory names: the session is bound to it, whoever named the session first."""
        n = 0
        for session, attempt, ok, detail, *owner in reports:
            self.peers.report(session, attempt, ok, detail, owner[0] if owner else None)
            n += 1
        return n

    def take_effects(self) -> list[Effect]:
        """Everything decided since the last call, in order; the driver does each."""
        out = self.outbox[:]
        self.outbox.clear()
        return out

    # the tick -------------------------------------------------------------
    def poll(self) -> int:
        """Fire due deadlines and age tombstones; return how many deadlines fired."""
        n = 0
        now = self.polled_at = self.clock.now()
        deadlines = self.deadlines
        if deadlines.first <= now:  # `any_due`, without the call on a tick with nothing due
            for kind, obj in deadlines.due(now):
                n += 1
                self.lifecycle.on_deadline(kind, obj)
        peers = self.peers
        if peers.beats.first <= now:
            peers.beat(now)  # the heartbeat: probes of busy peers, left as `Contact` effects
        tombs = self.tombs
        if now >= tombs.next_trim:
            tombs.age(now)
        return n


__all__ = ["Chunk", "EncodeManager", "ROOM_CONCLUDED", "Room", "RoomConflict", "Tombstone"]
