"""How rooms, extents and peers move each other: the one place each room is stepped.

`step_room` steps a room's declared machine and runs the actions that
fsm/couplings.py lists for the state it enters; the extent's (`Ring.fire`) and
the peer's (`PeerTable.step`) steps run theirs through the same table and the
`actions` map built here. A room that fails, by whatever cause, takes one path:
its reason is set, `step_room(room, "fail")`, then `abandon_extent` and
`conclude`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from epd_ring.fsm import ROOM
from epd_ring.fsm.couplings import ON_ENTER, ON_EVENT

from .effects import Concluded, Effect, Notify
from .frames import FrameError, ReceiverFrame, check_tiling
from .holds import Holds
from .peers import Peer, PeerTable, down_reason
from .reasons import Reason, ReasonKind
from .regions import RegionBook
from .ring import Extent
from .rooms import Room, chunk_writes
from .tombstones import Tombstone
from .transport import Outcome

if TYPE_CHECKING:
    from .clock import Clock
    from .timers import Deadlines
    from .tombstones import Tombstones
    from .writes import Write, Writes

log = logging.getLogger("epd_ring.manager")

_TIMED_OUT = {"park": ReasonKind.PARK_TIMEOUT, "announce": ReasonKind.ANNOUNCE_TIMEOUT}
_NONE_IN_FLIGHT: dict[str, int] = {}  # never written to


class Announcing(Protocol):
    """What a room's steps ask of admission (`Admission`, which reads this module: so not named here)."""

    def announce(self, room: Room) -> None: ...

    def unannounce(self, room: Room) -> None: ...


class Lifecycle:
    """The live rooms and their one step: the coupling actions, write outcomes, deadlines and notices.

    It owns the room table, the coupling actions (which the ring and the peer table step through),
    the region book of failed rooms, and the parts whose state moves with a room's: the peer table
    and the ring bytes rooms hold (`Holds`). The manager lends it the effects' outbox, the clock, the
    deadline heap, the writes and the tombstones; admission is wired in once built (the two call
    each other)."""

    admission: Announcing

    def __init__(self, outbox: list[Effect], clock: Clock, deadlines: Deadlines, writes: Writes, tombs: Tombstones,
                 stats: Counter[str], *, park_timeout: float, announce_timeout: float, quarantine_s: float,
                 max_parked_bytes: int | None, peers: dict[str, Any]):
        self.outbox, self.clock, self.deadlines, self.writes, self.tombs = outbox, clock, deadlines, writes, tombs
        self.stats = stats
        self.park_timeout, self.announce_timeout, self.quarantine_s = park_timeout, announce_timeout, quarantine_s
        self.rooms: dict[int, Room] = {}
        # The core's own listeners (the executor's senders, a drain's count); the world
        # learns of a concluded room from its `Concluded` effect.
        self.on_conclude: list[Callable[[int, str], None]] = []
        # An `observe.Observer` (metrics); None costs one test per hook point.
        self.observer: Any = None
        # Receive regions of failed rooms that a write may still land in (release notices).
        self.regions = RegionBook(self.tell, tombs.unpin)
        self.actions = self.coupling_actions()
        # fsm/couplings.py's rows for the room machine, looked up once (`step_room` is the per-item path).
        self._room_enter = {s: ON_ENTER.get(("room", s), ()) for s in ROOM.states}
        self._room_on_event = {e: ON_EVENT.get(("room", e), ()) for e in ROOM.events}
        # `step_room`'s success path, compiled (`CompiledMachine.plans`): each unguarded step's
        # destination with its actions' implementations, in the order the couplings name them.
        self._room_plans = {k: (dest, tuple(self.actions[a] for a in acts))
                            for k, (dest, acts) in ROOM.plans(self._room_enter, self._room_on_event).items()}
        self.peers = PeerTable(outbox, clock, deadlines, actions=self.actions, **peers)
        self.holds = Holds(self, self.peers, clock, stats, writes, max_parked_bytes)

    def coupling_actions(self) -> dict[str, Callable[[Any], None]]:
        """Each action fsm/couplings.py names, implemented once (the test checks the set)."""
        return {
            "arm_announce_deadline": self._arm_announce_deadline, "park_extent": self._park_extent,
            "arm_park_deadline": self._arm_park_deadline, "start_writes": self._start_writes,
            "conclude": self._conclude, "abandon_extent": self._abandon_extent,
            "arm_quarantine_deadline": self._arm_quarantine_deadline,
            "release_regions": self.regions.extent_released,
            "resume_rooms": self._resume_rooms, "fail_rooms": self._fail_rooms,
        }

    # the room's one step ---------------------------------------------------
    def step_room(self, room: Room, event: str) -> str:
        plan = self._room_plans.get((room.state, event))
        if plan is None:  # guarded or undeclared: the machine checks the guards (or refuses); a plan's actions
            was = room.state
            now = ROOM.step(room, event)
            for action in (self._room_enter[now] if now != was else ()) + self._room_on_event[event]:
                self.actions[action](room)
            return now
        now, actions = plan
        room.state = now
        for act in actions:
            act(room)
        return now

    def open_room(self, room_id: int) -> Room:
        room = self.rooms[room_id] = Room(room_id)
        if self.observer is not None:
            self.observer.room_opened(room_id)
        return room

    def fail(self, room: Room, reason: Reason, extra: ReceiverFrame | None = None) -> None:
        """Fail a live room (its receivers are told); `extra`, a refused frame, is told too."""
        room.reason = reason
        log.info("room %s failed (%s): %s", room.id, reason.kind.value, reason)
        self.step_room(room, "fail")
        if extra is not None:
            self.tell_failed(extra, room.id, reason)

    def _expire(self, room: Room, kind: str) -> None:
        if kind == "park":
            got = f"only {len(room.frames)} of {room.n}" if room.n else "no"  # pragma: no mutate (reason wording)
            detail = f"{got} receivers registered within {self.park_timeout} s of parking"
        else:
            detail = f"sender never registered within {self.announce_timeout} s"
        room.reason = Reason(_TIMED_OUT[kind], detail)
        self.stats["expired"] += 1
        self.step_room(room, "expire")

    # coupling actions (fsm/couplings.py) -------------------------------------
    def _arm_announce_deadline(self, room: Room) -> None:
        self.admission.announce(room)
        self.deadlines.arm(self.clock.now() + self.announce_timeout, "announce", room)

    def _park_extent(self, room: Room) -> None:
        assert room.chunk is not None
        room.chunk.extent.ring.fire(room.chunk.extent, "park")
        if self.observer is not None:
            self.observer.parked(room.id)

    def _arm_park_deadline(self, room: Room) -> None:
        self.deadlines.arm(self.clock.now() + self.park_timeout, "park", room)

    def _abandon_extent(self, room: Room) -> None:
        chunk = room.chunk
        if chunk is not None:  # no write was issued from it
            room.chunk = None
            chunk.extent.ring.fire(chunk.extent, "abandon")

    def _arm_quarantine_deadline(self, extent: Extent) -> None:
        self.deadlines.arm(self.clock.now() + self.quarantine_s, "quarantine", extent)

    def _start_writes(self, room: Room) -> None:
        if room.parked_bytes:  # its receivers are all here: the chunk no longer counts as parked
            self.holds.unpark(room)
        chunk = room.chunk
        if chunk is None:
            return
        frames = room.frames.values()
        if len(frames) > 1:
            try:
                check_tiling(list(frames))
            except FrameError as exc:
                self.fail(room, Reason(ReasonKind.FRAME, str(exc)))
                return
        if room.timer:
            self.deadlines.cancel(room)
        nbytes = room.uncharged_bytes
        if nbytes:  # its ring bytes are held for its receivers' peers from now on
            room.uncharged_bytes = 0
            self.peers.hold(room.id, nbytes, room.frames)
        peers = self.peers.by_session
        for session in room.frames:
            # Every receiver's peer is in the table while its room lives (admission adds it; a peer
            # with rooms is never forgotten) and is never down (going down fails its rooms first),
            # so only a contact still under way holds the writes back.
            if peers[session].state != "up":
                # The chunk waits in its staged extent; the contact deadline bounds the wait
                # (`resume_rooms` or `fail_rooms` ends it).
                self.stats["waits_for_peer"] += 1
                return
        writes = chunk_writes(chunk, frames)
        room.chunk = None
        extent = chunk.extent
        if not writes:
            extent.ring.fire(extent, "abandon")
            self.step_room(room, "written")
            return
        extent.ring.fire(extent, "send")
        room.writes_left = len(writes)
        if self.observer is not None:
            self.observer.writes_started(room.id)
        self.writes.issue(room.id, extent, writes)

    def _conclude(self, room: Room) -> None:
        if room.announced:
            self.admission.unannounce(room)
        if room.timer:
            self.deadlines.cancel(room)
        state = room.state
        self.stats[state] += 1
        peers = self.peers.by_session
        in_flight = self.writes.of_room(room.id) if room.writes_left else _NONE_IN_FLIGHT
        rid, reason, outbox = room.id, room.reason, self.outbox
        for f in room.frames.values():
            peer = peers.get(f.session)
            if peer is not None:
                peer.rooms.discard(rid)
                # Ring bytes held for it go, but for a write that may still read the extent.
                if peer.holds and f.session not in in_flight:
                    self.peers.let_go(peer, rid)
            outbox.append(Notify(f, rid, state, reason))  # `tell`, written out: every room's path
        holds = self.holds
        if holds.held_since:
            holds.held_since.pop(room.id, None)
        if room.parked_bytes:
            holds.unpark(room)
        room.extent = None
        if holds.parked_since:
            holds.parked_since.pop(room.id, None)
        if state == "failed" and room.frames:
            cause = room.cause
            self.regions.room_failed(room.id, room.frames.values(), in_flight,
                                     {cause.frame.session: cause.extent} if cause is not None else {},
                                     room.withdrawn)
        del self.rooms[room.id]
        # Held while its sender lives and while a write may land in one of its regions: a frame
        # re-sent for it meanwhile must find the room, not open a new one under the same id.
        pins = int(room.sender) + self.regions.room_open(room.id)
        self.tombs.keep(Tombstone(room.id, state, room.reason, self.clock.now(), frozenset(room.frames), pins,
                                  room.owner, room.sender))
        self.outbox.append(Concluded(room.id, state))
        for cb in self.on_conclude:
            cb(room.id, state)

    def _resume_rooms(self, peer: Peer) -> None:
        """Contact succeeded: rooms whose chunk waited for this peer start their writes."""
        for rid in sorted(peer.rooms):
            room = self.rooms.get(rid)
            if room is not None and room.state == "transferring" and room.chunk is not None:
                self._start_writes(room)

    def _fail_rooms(self, peer: Peer) -> None:
        """Every live room with a receiver on this peer fails now, and all its receivers are told."""
        reason = Reason(ReasonKind.PEER_DOWN, down_reason(peer))
        for rid in sorted(peer.rooms):
            room = self.rooms.get(rid)
            if room is not None:
                self.fail(room, reason)
        peer.rooms.clear()

    # deadlines -----------------------------------------------------------------
    def on_deadline(self, kind: str, obj: Any) -> None:
        if kind == "write":
            self._write_overdue(obj)
        elif kind == "quarantine":
            obj.ring.fire(obj, "release")
        elif kind == "connect":
            self.peers.expired(obj)
        else:  # a room's park or announce wait
            self._expire(obj, kind)

    # write outcomes ------------------------------------------------------------
    def _write_overdue(self, w: Write, reason: Reason | None = None) -> None:
        """Our write deadline passed with no report from the transport (or, `reason`, the transport
        gave up on the write but cannot report it yet: its engine still holds the memory).

        The room fails now and its receivers are told. The extent does not: the transport may still
        read it, so it stays `sending` until the write reports, then serves a full quarantine.
        """
        self.stats["write_deadlines"] += 1
        w.overdue = True
        w.extent.unsure = True
        peer = self.peers.get(w.frame.session)
        if peer is not None:
            self.peers.write_overdue(peer)
        room = self.rooms.get(w.room)
        if room is not None and room.state == "transferring":
            self.fail(room, reason or Reason(ReasonKind.WRITE_DEADLINE, f"write to receiver {w.frame.session} got "
                                                                        f"no report within {self.writes.timeout} s"))

    def on_overdue(self, handle: int) -> bool:
        """`Transport.overdue`: handled as at our own deadline, now, once; False if not ours in flight."""
        w = self.writes.by_handle.get(handle)
        if w is None or w.overdue:
            return False
        self.deadlines.cancel(w)
        why = f"write to receiver {w.frame.session} timed out (its engine still holds the memory)"
        self._write_overdue(w, Reason(ReasonKind.WRITE_TIMED_OUT, why))
        return True

    def on_outcome(self, handle: int, outcome: Outcome) -> None:
        w = self.writes.reported(handle)
        if w is None:
            self.stats["completions_unknown"] += 1  # not a write of ours
            return
        if self.observer is not None:
            self.observer.write_reported(w.room, outcome, self.writes.submitted_at(w))
        extent = w.extent
        extent.writes_in_flight -= 1
        if outcome is not Outcome.DONE:
            extent.unsure = True
        extent.ring.fire(extent, "settle")
        peer = self.peers.by_session.get(w.frame.session)
        if peer is not None:
            if peer.holds:
                self.peers.let_go(peer, w.room)
            if outcome is Outcome.DONE:
                if peer.fails or peer.waiting or peer.state != "up":
                    self.peers.write_ok(peer)
            elif not w.overdue:  # an overdue write was counted at its deadline
                self.peers.write_failed(peer)
        room = self.rooms.get(w.room)
        if room is None or room.state != "transferring":
            self.stats["completions_dropped"] += 1
            if self.regions:
                self.regions.write_reported(handle, outcome is Outcome.DONE, extent)
            return
        if outcome is Outcome.DONE:
            room.writes_left -= 1
            if room.writes_left == 0:
                self.step_room(room, "written")
        else:
            room.cause = w
            kind = ReasonKind.WRITE_TIMED_OUT if outcome is Outcome.TIMED_OUT else ReasonKind.WRITE_FAILED
            self.fail(room, Reason(kind, f"write to receiver {w.frame.session} {outcome.value}"))

    # notices ---------------------------------------------------------------
    def tell(self, frame: Any, room_id: int, status: str, reason: str = "") -> None:
        self.outbox.append(Notify(frame, room_id, status, reason))

    def tell_failed(self, frame: Any, room_id: int, reason: str) -> None:
        """Failed, for a receiver no write was ever issued to: its region is free at once."""
        self.tell(frame, room_id, "failed", reason)
        self.tell(frame, room_id, "released")


__all__ = ["Lifecycle"]
