"""The encode-side manager: rooms, receiver frames, parking, deadlines, outcomes.

Sans-I/O: state changes only through calls made by the encode loop's thread
(`bind_sender`, `register_receiver`, `submit_chunk`, `fail_room`, `poll`).
Every room and slot change goes through the declared machines.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from epd_ring.fsm import ROOM, ROOM_CONCLUDED

from . import settings
from .clock import Clock, MonotonicClock
from .peers import Peer, PeerTable, down_reason
from .frames import FrameError, ReceiverFrame, check_against_chunk, check_frame, check_frames_agree, check_tiling
from .regions import RegionBook, Reply
from .ring import Slot
from .tenancy import Tenancy
from .timers import Deadlines
from .transport import Outcome, Transport

log = logging.getLogger("epd_ring.manager")

_ACCEPTS_CHUNK = frozenset(("registered", "ready"))
_TOLD = {"success": "told_success", "failed": "told_failed"}


class RoomConflict(ValueError):
    """A room id already in use (or concluded Success) was registered again."""


@dataclass(slots=True)
class Chunk:
    """One room's embedding, staged in a ring slot."""

    slot: Slot
    n_tokens: int
    hidden: int
    dtype: str
    row_bytes: int
    src: int
    deep_src: int = 0
    deep_row_bytes: int = 0
    # Deepstack levels per row (its width over hidden); -1 when the width is no
    # multiple of hidden, which no frame can match.
    deep_levels: int = 0

    @property
    def has_deep(self) -> bool:
        return self.deep_row_bytes > 0


class Room:
    __slots__ = ("id", "state", "n", "frames", "chunk", "timer", "due", "reason", "writes_left",
                 "sender", "announced", "cause", "withdrawn", "owner")

    def __init__(self, room_id: int):
        self.id = room_id
        self.state = ROOM.initial
        self.n: int | None = None
        self.frames: dict[str, ReceiverFrame] = {}
        self.chunk: Chunk | None = None
        self.timer = 0
        self.due = 0.0
        self.reason = ""
        self.writes_left = 0
        self.sender = False
        self.announced = False
        self.cause: _Write | None = None  # the unsure write that failed it, if one did
        self.withdrawn: str | None = None  # the receiver whose withdraw failed it, if one did
        # The peer whose frames this room takes (None until the sender names one or
        # the first frame claims it); frames from any other peer never touch it.
        self.owner: str | None = None

    # guard named in the room declaration
    def all_receivers(self) -> bool:
        return self.n is not None and len(self.frames) >= self.n

    def __repr__(self) -> str:
        return f"room {self.id}"


class Tombstone:
    """What is kept of a concluded room.

    Bounded by count and age once no sender holds it; while senders do (`pins`),
    it is kept whatever the cap, so a live sender always finds its room's outcome.
    """

    __slots__ = ("room", "state", "reason", "at", "sessions", "pins", "owner")

    def __init__(self, room: int, state: str, reason: str, at: float, sessions: frozenset, pins: int = 0,
                 owner: str | None = None):
        self.room, self.state, self.reason, self.at, self.sessions = room, state, reason, at, sessions
        self.pins = pins
        self.owner = owner

    def __repr__(self) -> str:
        return f"room {self.room} (concluded)"


class _Write:
    __slots__ = ("handle", "room", "slot", "frame", "timer", "due", "overdue")

    def __init__(self, handle: int, room: int, slot: Slot, frame: ReceiverFrame):
        self.handle, self.room, self.slot, self.frame, self.timer, self.due = handle, room, slot, frame, 0, 0.0
        self.overdue = False  # our deadline passed before the transport reported


class EncodeManager:
    """Owns the rooms of one encode worker and drives writes through a transport."""

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
        max_announced_per_peer: int = 1024,
        max_sessions_per_peer: int = 256,
        connect_timeout: float = 5.0,
        peer_backoff: float = 5.0,
        peer_fail_threshold: int = 3,
        max_peers: int = 4096,
    ):
        self.transport = transport
        self.clock = clock or getattr(transport, "clock", None) or MonotonicClock()
        self.park_timeout = settings.seconds("park_timeout", park_timeout)
        self.announce_timeout = settings.seconds(
            "announce_timeout", park_timeout if announce_timeout is None else announce_timeout)
        self.write_timeout = settings.seconds("write_timeout", write_timeout)
        self.quarantine_s = settings.seconds("quarantine_s", quarantine_s)
        self.max_tombstones = settings.count("max_tombstones", max_tombstones, 1)
        self.tombstone_ttl = settings.seconds("tombstone_ttl", tombstone_ttl)
        self.max_announced = settings.count("max_announced", max_announced, 1)
        self.tenancy = Tenancy(settings.count("max_sessions_per_peer", max_sessions_per_peer, 1),
                               max_announced_per_peer=settings.count("max_announced_per_peer",
                                                                     max_announced_per_peer, 1))
        self.rooms: dict[int, Room] = {}
        self.tombstones: OrderedDict[int, Tombstone] = OrderedDict()
        # Tombstones a registered sender still holds: out of the cap and the TTL until
        # `unbind_sender`; bounded by the senders the executor keeps (it reaps them).
        self.pinned: dict[int, Tombstone] = {}
        self.deadlines = Deadlines()
        self._writes: dict[int, _Write] = {}
        self._synthetic: list[tuple[int, Outcome]] = []
        self._synthetic_ids = 0
        self._announced = 0
        self._next_trim = 0.0
        self._warned: dict[str, tuple[float, int]] = {}
        self.on_conclude: list[Callable[[int, str], None]] = []
        # Inputs polled at the start of every tick (a control plane's frame socket, say).
        self.sources: list[Callable[[], int]] = []
        # Receive regions of failed rooms that a write may still land in (release notices).
        self.regions = RegionBook(self._tell, self.unbind_sender)
        self.polled_at: float | None = None  # clock reading of the last poll (health: loop lag)
        self.stats: Counter = Counter()
        # An `observe.Observer` (metrics); None costs one test per hook point.
        self.observer: Any = None
        self.peers = PeerTable(transport, self.clock, self.deadlines, connect_timeout=connect_timeout,
                               backoff=peer_backoff, fail_threshold=peer_fail_threshold, max_peers=max_peers,
                               on_up=self._peer_up, on_down=self._peer_down)

    # queries --------------------------------------------------------------
    def room_status(self, room_id: int) -> str | None:
        room = self.rooms.get(room_id)
        if room is not None:
            return room.state
        tomb = self.tombstone(room_id)
        return tomb.state if tomb is not None else None

    def tombstone(self, room_id: int) -> Tombstone | None:
        tomb = self.pinned.get(room_id)
        return tomb if tomb is not None else self.tombstones.get(room_id)

    def failure_reason(self, room_id: int) -> str | None:
        tomb = self.tombstone(room_id)
        if tomb is not None and tomb.state == "failed":
            return tomb.reason
        return None

    def deadline_of(self, room_id: int) -> float | None:
        """When the room's pending deadline (park or announce) fires, or None if it has none."""
        room = self.rooms.get(room_id)
        return room.due if room is not None and room.timer else None

    def accepts_chunk(self, room_id: int) -> bool:
        room = self.rooms.get(room_id)
        return room is not None and room.state in _ACCEPTS_CHUNK

    def is_parked(self, room_id: int) -> bool:
        room = self.rooms.get(room_id)
        return room is not None and room.state == "parked"

    @property
    def writes_in_flight(self) -> int:
        return len(self._writes)

    # sender side ----------------------------------------------------------
    def bind_sender(self, room_id: int, receiver: str | None = None) -> str:
        """The encode request for `room_id` was registered; return the room's state.

        `receiver` names the peer (authenticated identity) whose frames the room
        takes. Named, frames from any other peer, before or after, can neither
        claim, change, fail nor learn about the room. Unnamed, the first peer to
        send a frame for it claims it.
        """
        if type(room_id) is not int or room_id < 0:
            raise ValueError(f"room must be a non-negative integer, got {room_id!r}")
        if receiver is not None and type(receiver) is not str:
            raise ValueError(f"receiver must be a peer identity string, got {receiver!r}")
        room = self.rooms.get(room_id)
        if room is not None and receiver is not None and room.owner not in (None, receiver) and not room.sender:
            # Announced by another peer: its frames never reach this room. That peer
            # is told its announcement failed, as it would be if no sender came.
            self.stats["foreign_announcements"] += 1
            self._fail(room, "room not open to this receiver")
            room = None
        if room is None:
            tomb = self.tombstone(room_id)
            if tomb is not None and tomb.state == "failed" and receiver is not None and tomb.owner != receiver:
                tomb = None  # failed by another peer's frames: no pre-poisoning of this room
            if tomb is not None:
                if tomb.state == "failed":
                    # Its receivers already failed it (bad frame, expired wait): the
                    # sender binds to the failure and its chunk is never written.
                    self._pin(tomb)
                    return "failed"
                raise RoomConflict(f"room {room_id} already concluded {tomb.state}; room ids must not be reused")
            room = self.rooms[room_id] = Room(room_id)
            if self.observer is not None:
                self.observer.room_opened(room_id)
        elif room.sender:
            raise RoomConflict(f"room {room_id} already has a sender")
        if receiver is not None:
            room.owner = receiver
        if room.announced:
            self._unannounce(room)
        ROOM.step(room, "bind_sender")
        room.sender = True
        return room.state

    def unbind_sender(self, room_id: int) -> None:
        """What held a concluded room's record let go (its sender was reaped, or its last region
        that a write may still land in was released): the record may age out once nothing holds it."""
        tomb = self.pinned.get(room_id)
        if tomb is None:
            return
        tomb.pins -= 1
        if tomb.pins <= 0:
            del self.pinned[room_id]
            tomb.at = self.clock.now()  # its age counts from when no sender needs it
            self._bury(tomb)

    def _pin(self, tomb: Tombstone) -> None:
        if tomb.pins == 0:
            self.tombstones.pop(tomb.room, None)
            self.pinned[tomb.room] = tomb
        tomb.pins += 1

    def _bury(self, tomb: Tombstone) -> None:
        tombs = self.tombstones
        tombs.pop(tomb.room, None)  # a room id another peer had concluded may conclude again: newest last
        tombs[tomb.room] = tomb
        if len(tombs) > self.max_tombstones:
            tombs.popitem(last=False)

    def submit_chunk(self, room_id: int, chunk: Chunk) -> bool:
        """Hand a staged chunk over; the manager owns its slot from here on."""
        slot = chunk.slot
        room = self.rooms.get(room_id)
        if room is None or room.state not in _ACCEPTS_CHUNK:
            slot.ring.fire(slot, "abandon")
            self.stats["chunks_dropped"] += 1
            if room is not None and room.state in ("parked", "transferring"):
                self._fail(room, f"room {room_id} got a second chunk; a room carries exactly one")
            return False
        try:
            for f in room.frames.values():
                check_against_chunk(f, chunk.n_tokens, chunk.hidden, chunk.dtype, chunk.deep_levels)
        except FrameError as exc:
            slot.ring.fire(slot, "abandon")
            self._fail(room, str(exc))
            return False
        room.chunk = chunk
        slot.room = room_id
        if ROOM.step(room, "stage") == "parked":
            slot.ring.fire(slot, "park")
            if self.observer is not None:
                self.observer.parked(room_id)
            # Armed once at park time; partial registrations never extend it.
            self.deadlines.arm(self.clock.now() + self.park_timeout, "park", room)
        else:
            self._start_writes(room)
        return True

    def fail_room(self, room_id: int, reason: str) -> bool:
        """Conclude a room Failed; True if this call failed it."""
        room = self.rooms.get(room_id)
        if room is None:
            tomb = self.tombstone(room_id)
            if tomb is not None and tomb.state == "failed":
                ROOM.step(tomb, "fail")  # declared: failure is sticky
            return False
        self._fail(room, reason)
        return True

    # receiver side --------------------------------------------------------
    def withdraw(self, room_id: int, session: str, status_endpoint: str = "", peer: str = "") -> str:
        """A receiver withdrew its region of `room_id` (its request was aborted).

        A live room fails (every receiver is told). The withdraw is acknowledged
        (`withdrawn`) once no write into the region can land: at once if none was
        issued or all reported done, else when it reports or its slot's quarantine
        ends. Returns what happened: "failed", "deferred" (ack later) or "acked".
        """
        self.stats["withdraws"] += 1
        room = self.rooms.get(room_id)
        if self.tenancy.session_owner(session) not in (None, peer) or (
                room is not None and room.owner not in (None, peer)):
            # Another peer's session or room: it is not touched, and nobody is answered.
            self.stats["withdraws_foreign"] += 1
            self._warn("foreign", "refused a withdraw from another peer for room %s", room_id)
            return "refused"
        if room is not None and session in room.frames:
            room.withdrawn = session
            self._fail(room, f"receiver {session} withdrew")
            return "failed"
        if self.regions.withdraw(room_id, session):
            return "deferred"
        frame = room.frames.get(session) if room is not None else None
        self._tell(frame or Reply(room_id, session, status_endpoint, peer), room_id, "withdrawn")
        return "acked"

    def register_receiver(self, frame: ReceiverFrame) -> bool:
        """Apply one receiver registration frame from `frame.peer`; False if it was refused."""
        try:
            check_frame(frame)
        except FrameError as exc:
            self._refuse(frame, str(exc))
            return False
        peer = frame.peer
        if self.tenancy.session_owner(frame.session) not in (None, peer):
            # Another peer's session: no reply at all, since any reply would be addressed
            # by that session (a confused deputy is what this refuses).
            return self._foreign(frame, "session belongs to another receiver", tell=False)
        room = self.rooms.get(frame.room)
        tomb = self.tombstone(frame.room) if room is None else None
        owner = room.owner if room is not None else (tomb.owner if tomb is not None else None)
        if owner is not None and owner != peer:
            return self._foreign(frame, "room not open to this receiver")
        why = self.tenancy.claim(peer, frame.session)  # only a frame that may proceed claims
        if why:
            return self._foreign(frame, why)
        if room is None:
            if tomb is not None:
                self._tell_late(frame, tomb)
                return True
            if self._announced >= self.max_announced or not self.tenancy.may_announce(peer):
                self.stats["frames_refused"] += 1
                self._tell_failed(frame, frame.room, "too many rooms waiting for their sender")
                self._warn("announce_limit", "refused frames: announce limit reached (%s in all, %s per peer)",
                           self.max_announced, self.tenancy.max_announced_per_peer)
                return False
            room = self.rooms[frame.room] = Room(frame.room)
            if self.observer is not None:
                self.observer.room_opened(frame.room)
        if room.owner is None:
            room.owner = peer
        known = room.frames.get(frame.session)
        if known is not None:
            if known == frame:
                self.stats["duplicate_frames"] += 1
                return True
            self._fail(room, f"receiver {frame.session} registered twice with different frames", extra=frame)
            return False
        try:
            if room.frames:
                check_frames_agree(next(iter(room.frames.values())), frame)
            if len(room.frames) >= frame.n_receivers:
                raise FrameError(f"room {room.id}: receiver {frame.session} is beyond the N={frame.n_receivers} declared")
            if room.chunk is not None:
                c = room.chunk
                check_against_chunk(frame, c.n_tokens, c.hidden, c.dtype, c.deep_levels)
        except FrameError as exc:
            self._fail(room, str(exc), extra=frame)
            return False
        # `link` is the session's transport peer (the peer machine); `peer` stays the
        # authenticated identity that the announce caps and room ownership count by.
        link = self.peers.by_session.get(frame.session)
        if link is None or link.state != "up":  # per-frame cost for a known peer: one dict lookup
            link = self.peers.contact(frame.session)
        if link is None or link.state == "down":
            why = down_reason(link) if link is not None else f"too many peers to add {frame.session}"
            self._fail(room, why, extra=frame)
            return False
        link.rooms.add(room.id)
        room.frames[frame.session] = frame
        room.n = frame.n_receivers
        was = room.state
        now_state = ROOM.step(room, "add_receiver")
        if was == "new":
            room.announced = True
            self._announced += 1
            self.tenancy.announced[peer] += 1
            self.deadlines.arm(self.clock.now() + self.announce_timeout, "announce", room)
        elif was == "parked" and now_state == "transferring":
            self._start_writes(room)
        return True

    # the tick -------------------------------------------------------------
    def poll(self) -> int:
        """Take transfer outcomes, fire due deadlines, age tombstones."""
        n = 0
        for source in self.sources:
            n += source()
        done = self.transport.poll()
        if self._synthetic:
            done += self._synthetic
            self._synthetic = []
        for handle, outcome in done:
            self._on_outcome(handle, outcome)
        n += len(done)
        reports = self.transport.peer_reports()
        if reports:
            for session, attempt, ok, detail in reports:
                self.peers.report(session, attempt, ok, detail)
            n += len(reports)
        now = self.polled_at = self.clock.now()
        if self.deadlines.any_due(now):
            for kind, obj in self.deadlines.due(now):
                n += 1
                if kind == "write":
                    self._write_overdue(obj)
                elif kind == "quarantine":
                    obj.ring.fire(obj, "release")
                    self.regions.slot_released(obj)
                elif kind == "connect":
                    self.peers.expired(obj)
                elif kind == "park":
                    got = f"only {len(obj.frames)} of {obj.n}" if obj.n else "no"
                    self._expire(obj, f"{got} receivers registered within {self.park_timeout} s of parking")
                else:  # announce
                    self._expire(obj, f"sender never registered within {self.announce_timeout} s")
        if now >= self._next_trim:
            # Ageing tombstones is coarse on purpose: a tenth of their lifetime.
            self._next_trim = now + self.tombstone_ttl / 10
            self._trim_tombstones(now)
        return n

    # drivers that keep their own time --------------------------------------
    def expire_room_now(self, room_id: int) -> bool:
        """Fire a room's pending deadline (park or announce) now, whatever the clock says.

        For drivers that keep time themselves, such as the model's replay, which
        fires deadlines in any order. False if the room has no pending deadline.
        """
        room = self.rooms.get(room_id)
        if room is None or not room.timer or room.state not in ("parked", "announced"):
            return False
        self.deadlines.cancel(room)
        self._expire(room, f"deadline fired early by the driver ({room.state})")
        return True

    def expire_peer_now(self, session: str) -> bool:
        """Fire a peer's connect deadline now (see `expire_room_now`); False if it has none."""
        peer = self.peers.get(session)
        if peer is None or not peer.timer:
            return False
        self.deadlines.cancel(peer)
        self.peers.expired(peer)
        return True

    def release_slot_now(self, slot: Slot) -> bool:
        """End a slot's quarantine now (see `expire_room_now`)."""
        if slot.state != "quarantined" or not slot.timer:
            return False
        self.deadlines.cancel(slot)
        slot.ring.fire(slot, "release")
        self.regions.slot_released(slot)
        return True

    # internals ------------------------------------------------------------
    def _start_writes(self, room: Room) -> None:
        chunk = room.chunk
        slot = chunk.slot
        frames = room.frames.values()
        if len(frames) > 1:
            try:
                check_tiling(list(frames))
            except FrameError as exc:
                self._fail(room, str(exc))
                return
        if room.timer:
            self.deadlines.cancel(room)
        peers = self.peers.by_session
        for session in room.frames:
            peer = peers.get(session)
            if peer is None or peer.state != "up":
                if peer is None or peer.state == "down":
                    self._fail(room, down_reason(peer) if peer else f"peer {session} is unknown")
                else:
                    # Still being contacted: the chunk waits in its staged slot. The contact
                    # deadline bounds the wait (`_peer_up` or `_peer_down` ends it).
                    self.stats["waits_for_peer"] += 1
                return
        writes = []
        rb, drb = chunk.row_bytes, chunk.deep_row_bytes
        for f in frames:
            n = f.n_tokens
            if not n:
                continue  # a zero-row shard only counts toward N
            bufs = [(chunk.src + f.row_start * rb, f.dst_ptr, n * rb)]
            if drb:
                bufs.append((chunk.deep_src + f.row_start * drb, f.dst_deep_ptr, n * drb))
            writes.append((f, bufs))
        room.chunk = None
        if not writes:
            slot.ring.fire(slot, "abandon")
            ROOM.step(room, "written")
            self._conclude(room)
            return
        slot.ring.fire(slot, "send")
        room.writes_left = len(writes)
        deadline = self.clock.now() + self.write_timeout
        obs = self.observer
        if obs is not None:
            obs.writes_started(room.id)
        for f, bufs in writes:
            slot.writes_in_flight += 1
            try:
                handle = self.transport.submit_write(f.session, bufs)
            except Exception as exc:  # a transport must not raise here; if it does, fail this write only
                log.error("transport refused a write for room %s to %s: %s", room.id, f.session, exc)
                self._synthetic_ids -= 1
                handle = self._synthetic_ids
                self._synthetic.append((handle, Outcome.FAILED))
            w = self._writes[handle] = _Write(handle, room.id, slot, f)
            self.deadlines.arm(deadline, "write", w)

    def _write_overdue(self, w: _Write) -> None:
        """Our write deadline passed with no report from the transport.

        The room fails now and its receivers are told. The slot does not: the
        transport may still be reading it, so it stays `sending` until the write
        reports, then serves a full quarantine like any unsure write.
        """
        self.stats["write_deadlines"] += 1
        w.overdue = True
        w.slot.unsure = True
        peer = self.peers.get(w.frame.session)
        if peer is not None:
            self.peers.write_failed(peer)
        room = self.rooms.get(w.room)
        if room is not None and room.state == "transferring":
            self._fail(room, f"write to receiver {w.frame.session} got no report within {self.write_timeout} s")

    def _on_outcome(self, handle: int, outcome: Outcome) -> None:
        w = self._writes.pop(handle, None)
        if w is None:
            self.stats["completions_unknown"] += 1  # not a write of ours
            return
        self.deadlines.cancel(w)
        if self.observer is not None:  # its deadline was armed at submit + write_timeout
            self.observer.write_reported(w.room, outcome, w.due - self.write_timeout)
        slot = w.slot
        slot.writes_in_flight -= 1
        if outcome is not Outcome.DONE:
            slot.unsure = True
        if slot.ring.fire(slot, "settle") == "quarantined":
            self.deadlines.arm(self.clock.now() + self.quarantine_s, "quarantine", slot)
        peer = self.peers.by_session.get(w.frame.session)
        if peer is not None:
            if outcome is Outcome.DONE:
                if peer.fails or peer.state != "up":
                    self.peers.write_ok(peer)
            elif not w.overdue:  # an overdue write was counted at its deadline
                self.peers.write_failed(peer)
        room = self.rooms.get(w.room)
        if room is None or room.state != "transferring":
            self.stats["completions_dropped"] += 1
            if self.regions:
                self.regions.write_reported(handle, outcome is Outcome.DONE, slot)
            return
        if outcome is Outcome.DONE:
            room.writes_left -= 1
            if room.writes_left == 0:
                ROOM.step(room, "written")
                self._conclude(room)
        else:
            room.cause = w
            self._fail(room, f"write to receiver {w.frame.session} {outcome.value}")

    def _fail(self, room: Room, reason: str, extra: ReceiverFrame | None = None) -> None:
        chunk = room.chunk
        ROOM.step(room, "fail")
        room.reason = reason
        if chunk is not None:
            room.chunk = None
            chunk.slot.ring.fire(chunk.slot, "abandon")  # no write was issued from it
        log.info("room %s failed: %s", room.id, reason)
        self._conclude(room)
        if extra is not None:
            self._tell_failed(extra, room.id, reason)

    def _expire(self, room: Room, reason: str) -> None:
        chunk = room.chunk
        ROOM.step(room, "expire")
        room.reason = reason
        if chunk is not None:
            room.chunk = None
            chunk.slot.ring.fire(chunk.slot, "abandon")
        self.stats["expired"] += 1
        self._conclude(room)

    def _unannounce(self, room: Room) -> None:
        room.announced = False
        self._announced -= 1
        self.tenancy.announced[room.owner] -= 1
        self.deadlines.cancel(room)

    def _conclude(self, room: Room) -> None:
        if room.announced:
            self._unannounce(room)
        self.deadlines.cancel(room)
        state = room.state
        self.stats[state] += 1
        peers = self.peers.by_session
        for f in room.frames.values():
            peer = peers.get(f.session)
            if peer is not None:
                peer.rooms.discard(room.id)
            self._tell(f, room.id, state, room.reason)
        if state == "failed" and room.frames:
            self._failed_regions(room)
        del self.rooms[room.id]
        # Held while its sender lives and while a write may land in one of its regions: a frame
        # re-sent for it meanwhile must find the room, not open a new one under the same id.
        pins = int(room.sender) + self.regions.room_open(room.id)
        tomb = Tombstone(room.id, state, room.reason, self.clock.now(), frozenset(room.frames), pins, room.owner)
        if pins:
            self.pinned[room.id] = tomb
        else:
            self._bury(tomb)
        for cb in self.on_conclude:
            cb(room.id, state)

    def _failed_regions(self, room: Room) -> None:
        """After Failed: release each region now, or once no write into it can land."""
        in_flight = {}
        if room.writes_left:  # writes were issued and not all reported done
            rid = room.id
            in_flight = {w.frame.session: h for h, w in self._writes.items() if w.room == rid}
        cause = room.cause
        unsure = {cause.frame.session: cause.slot} if cause is not None else {}
        self.regions.room_failed(room.id, room.frames.values(), in_flight, unsure, room.withdrawn)

    def _tell_failed(self, frame: Any, room_id: int, reason: str) -> None:
        """Failed, for a receiver no write was ever issued to: its region is free at once."""
        self._tell(frame, room_id, "failed", reason)
        self._tell(frame, room_id, "released")
    def _peer_up(self, peer: Peer) -> None:
        """Contact succeeded: rooms whose chunk waited for this peer start their writes."""
        for rid in sorted(peer.rooms):
            room = self.rooms.get(rid)
            if room is not None and room.state == "transferring" and room.chunk is not None:
                self._start_writes(room)

    def _peer_down(self, peer: Peer) -> None:
        """Every live room with a receiver on this peer fails now, and all its receivers are told."""
        reason = down_reason(peer)
        for rid in sorted(peer.rooms):
            room = self.rooms.get(rid)
            if room is not None:
                self._fail(room, reason)
        peer.rooms.clear()

    def _trim_tombstones(self, now: float) -> None:
        tombs = self.tombstones
        while len(tombs) > self.max_tombstones:
            tombs.popitem(last=False)
        horizon = now - self.tombstone_ttl
        while tombs and next(iter(tombs.values())).at < horizon:
            tombs.popitem(last=False)

    def _tell(self, frame: ReceiverFrame, room_id: int, status: str, reason: str = "") -> None:
        try:
            self.transport.notify(frame, room_id, status, reason)
            self.stats[_TOLD.get(status) or "told_" + status] += 1
        except Exception as exc:  # one unreachable receiver must not stop the others
            self.stats["notify_errors"] += 1
            log.warning("could not tell %s that room %s %s: %s", getattr(frame, "session", "?"), room_id, status, exc)

    def _tell_late(self, frame: ReceiverFrame, tomb: Tombstone) -> None:
        ROOM.step(tomb, "add_receiver")  # declared only from concluded states
        self.stats["late_frames"] += 1
        if tomb.owner is None:
            # Nobody's room (it concluded before any frame came): its reason is not
            # for whoever asks first.
            self._tell_failed(frame, tomb.room, "room already concluded without this receiver")
        elif tomb.state == "failed":
            if self.regions.is_open(tomb.room, frame.session):
                self._tell(frame, tomb.room, "failed", tomb.reason)  # its release is still to come
            else:
                self._tell_failed(frame, tomb.room, tomb.reason)
        elif frame.session in tomb.sessions:
            self._tell(frame, tomb.room, "success")
        else:
            self._tell_failed(frame, tomb.room, "room already concluded without this receiver")

    def _refuse(self, frame: Any, reason: str) -> None:
        """A malformed frame: counted and logged. It fails the room it names only if that
        room is its sender's (or nobody's yet); it never creates one, so a room id cannot
        be poisoned before its sender binds it."""
        self.stats["frames_refused"] += 1
        self._warn("malformed", "refused receiver frame: %s", reason)
        room_id = getattr(frame, "room", None)
        if not isinstance(room_id, int) or isinstance(room_id, bool) or room_id < 0:
            return
        peer = getattr(frame, "peer", "")
        room = self.rooms.get(room_id)
        if room is not None and room.owner in (None, peer):
            room.owner = peer
            self._fail(room, f"malformed receiver frame: {reason}")
        session = getattr(frame, "session", None)
        if (isinstance(session, str) and isinstance(getattr(frame, "status_endpoint", ""), str)
                and self.tenancy.session_owner(session) in (None, peer)):
            self._tell_failed(frame, room_id, f"malformed receiver frame: {reason}")

    def _foreign(self, frame: ReceiverFrame, reason: str, tell: bool = True) -> bool:
        """A frame for a room or session of another peer: the room is not touched, and the
        sender hears the same answer whatever that room's state or outcome."""
        self.stats["frames_foreign"] += 1
        self._warn("foreign", "refused a frame from another peer: %s", reason)
        if tell:
            self._tell(frame, frame.room, "failed", reason)
        return False

    def _warn(self, key: str, msg: str, *args: Any) -> None:
        """Warnings a peer can provoke at will: at most one line per key per second of the
        injected clock, each saying how many were held back."""
        now = self.clock.now()
        last, held = self._warned.get(key, (-1e300, 0))
        if now - last < 1.0:
            self._warned[key] = (last, held + 1)
            return
        self._warned[key] = (now, 0)
        log.warning(msg + (" (and %d more like it)" if held else ""), *args, *((held,) if held else ()))

    def oldest_write_age(self) -> float:
        """Seconds since the oldest write still in flight was submitted (0 if none)."""
        if not self._writes:
            return 0.0
        return max(0.0, self.clock.now() - (min(w.due for w in self._writes.values()) - self.write_timeout))

    def snapshot(self) -> dict:
        """Rooms with their state and receivers, for debugging dumps."""
        return {
            rid: {"state": r.state, "receivers": list(r.frames), "n": r.n,
                  "slot": r.chunk.slot.index if r.chunk else None, "deadline": r.due if r.timer else None}
            for rid, r in self.rooms.items()
        }


__all__ = ["Chunk", "EncodeManager", "Room", "RoomConflict", "Tombstone", "ROOM_CONCLUDED"]
