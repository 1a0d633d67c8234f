"""Admission of receiver frames and withdraws: checks, ownership, caps, late frames.

Everything here arrives from the network, authenticated (`frame.identity` is
the key the control plane verified) but not trusted: a frame is checked, its
session and room must belong to its identity, and the rooms an identity may
announce before their sender binds are capped. What a frame may do to a room
is then one step of the room machine (`add_receiver`), through the manager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from epd_ring.fsm import ROOM

from .frames import FrameError, ReceiverFrame, check_against_chunk, check_frame, check_frames_agree
from .peers import Peer, down_reason
from .reasons import Reason, ReasonKind
from .regions import Reply
from .rooms import Room
from .tombstones import Tombstone

if TYPE_CHECKING:
    from .lifecycle import Lifecycle
    from .ratelog import RateLimitedLog
    from .tenancy import Tenancy

_NOT_OPEN = "room not open to this receiver"
_NOT_YOURS = "session is another receiver's (its own memory names another key)"
_TOO_LATE = "room already concluded without this receiver"
_CLAIMED = "session belongs to another receiver"


class Admission:
    """Owns the count of rooms announced before their sender and what a frame may do; a frame that
    passes steps its room through the room steps (`m`, the manager's `Lifecycle`)."""

    __slots__ = ("m", "tenancy", "log", "max_announced", "announced", "proves")

    def __init__(self, steps: Lifecycle, tenancy: Tenancy, log: RateLimitedLog, max_announced: int, proves: bool):
        self.m = steps
        self.tenancy = tenancy  # sessions and announced rooms by identity
        self.log = log
        self.max_announced = max_announced
        self.announced = 0  # rooms receivers announced whose sender has not bound yet
        steps.peers.on_owner = self.owner_proven
        # Whether contacts name a session's owner (the transport's, read once at set-up).
        self.proves = proves

    # a room announced by receivers before its sender ------------------------------
    def announce(self, room: Room) -> None:
        room.announced = True
        self.announced += 1
        self.tenancy.announced[room.owner] += 1

    def unannounce(self, room: Room) -> None:
        room.announced = False
        self.announced -= 1
        self.tenancy.announced[room.owner] -= 1
        self.m.deadlines.cancel(room)

    # frames ----------------------------------------------------------------------
    def register(self, frame: ReceiverFrame) -> bool:
        m = self.m
        try:
            check_frame(frame)
        except FrameError as exc:
            self.refuse(frame, str(exc))
            return False
        identity = frame.identity
        session = frame.session
        peer = m.peers.by_session.get(session)
        proven = peer.owner if peer is not None else None
        if proven is not None and proven != identity:
            # The session's own memory names another key: told so at the frame's own endpoint,
            # under its own key (the status socket serves only the key the frame came with).
            return self.foreign(frame, _NOT_YOURS)
        claimed = self.tenancy.session_owner(session)
        if claimed not in (None, identity) and proven is None and not self.proves:
            # Another identity's session: no reply at all, since any reply would be addressed
            # by that session (a confused deputy is what this refuses).
            return self.foreign(frame, _CLAIMED, tell=False)
        room = m.rooms.get(frame.room)
        tomb = m.tombs.get(frame.room) if room is None else None
        owner = room.owner if room is not None else (tomb.owner if tomb is not None else None)
        if owner is not None and owner != identity:
            return self.foreign(frame, _NOT_OPEN)
        # Only a frame that may proceed claims. Where the transport proves ownership, a string
        # another identity named first is no claim on it: the contact's proof decides, and this
        # frame's room waits for it (no write goes to a peer before its contact answers).
        if claimed in (None, identity) or proven == identity:
            why = self.tenancy.claim(identity, session, take=proven == identity)
            if why:
                return self.foreign(frame, why)
        if room is None:
            if tomb is not None:
                self.tell_late(frame, tomb)
                return True
            if self.announced >= self.max_announced or not self.tenancy.may_announce(identity):
                m.stats["frames_refused"] += 1
                m.tell_failed(frame, frame.room, Reason(ReasonKind.CAPACITY, "too many rooms waiting for their sender"))
                self.log.warning("announce_limit", "refused frames: announce limit reached (%s in all, %s per "
                                 "identity)", self.max_announced, self.tenancy.max_announced_per_identity)
                return False
            room = m.open_room(frame.room)
        if room.owner is None:
            room.owner = identity
            if room.share is not None:
                m.holds.claimed(room)
        known = room.frames.get(frame.session)
        if known is not None:
            if known == frame:
                m.stats["duplicate_frames"] += 1
                return True
            m.fail(room, Reason(ReasonKind.FRAME, f"receiver {frame.session} registered twice with different "
                                                  "frames"), extra=frame)
            return False
        try:
            if room.frames:
                check_frames_agree(next(iter(room.frames.values())), frame)
            if len(room.frames) >= frame.n_receivers:
                raise FrameError(f"room {room.id}: receiver {frame.session} is beyond the N={frame.n_receivers} "
                                 "declared")
            if room.chunk is not None:
                c = room.chunk
                check_against_chunk(frame, c.n_tokens, c.hidden, c.dtype, c.deep_levels)
        except FrameError as exc:
            m.fail(room, Reason(ReasonKind.FRAME, str(exc)), extra=frame)
            return False
        if peer is None or peer.state != "up":  # per-frame cost for a known peer: one dict lookup (above)
            peer = m.peers.contact(session, identity)
        if peer is None or peer.state == "down":
            if peer is None:
                # which bound the refusal names: wording (the kind is capacity either way)
                mine = m.peers.per_identity[identity] >= m.peers.max_peers_per_identity  # pragma: no mutate
                key = f" (this receiver key has {m.peers.max_peers_per_identity})" if mine else ""  # pragma: no mutate
                why_down = Reason(ReasonKind.CAPACITY, f"too many peers to add {frame.session}{key}")
            else:
                why_down = Reason(ReasonKind.PEER_DOWN, down_reason(peer))
            m.fail(room, why_down, extra=frame)
            return False
        peer.rooms.add(room.id)
        if not peer.beat.timer:
            m.peers.schedule(peer)  # work pending: the heartbeat runs
        room.frames[frame.session] = frame
        room.n = frame.n_receivers
        m.step_room(room, "add_receiver")
        return True

    def owner_proven(self, peer: Peer) -> None:
        """A contact read the peer's owner out of its own memory: the session is that identity's,
        and every live room of another identity with a receiver there fails (kind `foreign`)
        before the peer comes up, so none of its writes goes out. A pre-claim or an alias of
        another receiver's session ends here."""
        m = self.m
        owner = peer.owner
        if owner is None:
            return
        self.tenancy.claim(owner, peer.session, take=True)
        reason = Reason(ReasonKind.FOREIGN, f"receiver {peer.session}: {_NOT_YOURS}")
        for rid in sorted(peer.rooms):
            room = m.rooms.get(rid)
            if room is not None and room.owner != owner:
                peer.rooms.discard(rid)
                m.stats["rooms_disowned"] += 1
                self.log.warning("disowned", "failed room %s: a receiver named a session whose memory names "
                                 "another key", rid)
                m.fail(room, reason)

    def tell_late(self, frame: ReceiverFrame, tomb: Tombstone) -> None:
        m = self.m
        ROOM.step(tomb, "add_receiver")  # declared only from concluded states
        m.stats["late_frames"] += 1
        if tomb.owner is None:
            # Nobody's room (it concluded before any frame came): its reason is not
            # for whoever asks first.
            m.tell_failed(frame, tomb.room, Reason(ReasonKind.LATE, _TOO_LATE))
        elif tomb.state == "failed":
            if m.regions.is_open(tomb.room, frame.session):
                m.tell(frame, tomb.room, "failed", tomb.reason)  # its release is still to come
            else:
                m.tell_failed(frame, tomb.room, tomb.reason)
        elif frame.session in tomb.sessions:
            m.tell(frame, tomb.room, "success")
        else:
            m.tell_failed(frame, tomb.room, Reason(ReasonKind.LATE, _TOO_LATE))

    def refuse(self, frame: Any, why: str) -> None:
        """A malformed frame: counted and logged. It fails the room it names only if that
        room is its sender's (or nobody's yet); it never creates one, so a room id cannot
        be poisoned before its sender binds it."""
        m = self.m
        m.stats["frames_refused"] += 1
        self.log.warning("malformed", "refused receiver frame: %s", why)
        room_id = getattr(frame, "room", None)
        if not isinstance(room_id, int) or isinstance(room_id, bool) or room_id < 0:
            return
        identity = getattr(frame, "identity", "")
        reason = Reason(ReasonKind.FRAME, f"malformed receiver frame: {why}")
        room = m.rooms.get(room_id)
        if room is not None and room.owner in (None, identity):
            room.owner = identity
            m.fail(room, reason)
        session = getattr(frame, "session", None)
        if (isinstance(session, str) and isinstance(getattr(frame, "status_endpoint", ""), str)
                and self.tenancy.session_owner(session) in (None, identity)):
            m.tell_failed(frame, room_id, reason)

    def foreign(self, frame: ReceiverFrame, why: str, tell: bool = True) -> bool:
        """A frame for a room or session of another identity: the room is not touched, and the
        sender hears the same answer whatever that room's state or outcome."""
        m = self.m
        m.stats["frames_foreign"] += 1
        self.log.warning("foreign", "refused a frame from another identity: %s", why)
        if tell:
            m.tell(frame, frame.room, "failed", Reason(ReasonKind.FOREIGN, why))
        return False

    # withdraws --------------------------------------------------------------------
    def withdraw(self, room_id: int, session: str, status_endpoint: str = "", identity: str = "") -> str:
        """A receiver withdrew its region of `room_id` (its request was aborted).

        A live room fails (every receiver is told). The withdraw is acknowledged
        (`withdrawn`) once no write into the region can land: at once if none was
        issued or all reported done, else when it reports or its extent's quarantine
        ends. Returns what happened: "failed", "deferred" (ack later), "acked", or
        "refused" (another identity's session or room: untouched, nobody answered).
        """
        m = self.m
        m.stats["withdraws"] += 1
        room = m.rooms.get(room_id)
        if self.tenancy.session_owner(session) not in (None, identity) or (
                room is not None and room.owner not in (None, identity)):
            m.stats["withdraws_foreign"] += 1
            self.log.warning("foreign", "refused a withdraw from another identity for room %s", room_id)
            return "refused"
        if room is not None and session in room.frames:
            room.withdrawn = session
            m.fail(room, Reason(ReasonKind.WITHDRAWN, f"receiver {session} withdrew"))
            return "failed"
        if m.regions.withdraw(room_id, session):
            return "deferred"
        frame = room.frames.get(session) if room is not None else None
        m.tell(frame or Reply(room_id, session, status_endpoint, identity), room_id, "withdrawn")
        return "acked"


__all__ = ["Admission"]
