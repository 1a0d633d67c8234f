"""What the ring's bytes are held for, and the bounds an item waits on before it may lease.

Every extent is charged to its room's identity until it is free (shares.py); once its writes start,
to its receivers' peers too (peers.py); a chunk staged while its receivers are not all registered
counts as parked, against one bound for all parked chunks and its identity's part of it. `Holds`
owns that accounting and the waits it imposes: an item held back by a bound waits at most the write
timeout (or, for the parked bound, the park timeout), then its room fails.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from .reasons import Reason, ReasonKind
from .rooms import Room
from .shares import Share, Shares

if TYPE_CHECKING:
    from .clock import Clock
    from .frames import ReceiverFrame
    from .peers import PeerTable
    from .writes import Writes


class Failing(Protocol):
    """What a wait that ran out asks of the room steps (`Lifecycle`, which builds this part)."""

    rooms: dict[int, Room]
    park_timeout: float

    def fail(self, room: Room, reason: Reason, extra: ReceiverFrame | None = None) -> None: ...


class Holds:
    def __init__(self, steps: Failing, peers: PeerTable, clock: Clock, stats: Counter[str], writes: Writes,
                 max_parked_bytes: int | None):
        self.steps = steps
        self.rooms = steps.rooms
        self.peers = peers
        self.clock = clock
        self.stats = stats
        self.writes = writes
        # Rooms whose item waits because a receiver's peer holds its bound of ring bytes: since when.
        self.held_since: dict[int, float] = {}
        # Ring bytes of chunks staged for rooms whose receivers are not all registered (parked, or
        # being copied to park): charged to no peer, so bounded together (None: no bound; the
        # executor sets a share of its ring).
        self.parked_bytes = 0
        self.max_parked_bytes = max_parked_bytes
        # Rooms whose item waits because the parked chunks hold that bound: since when.
        self.parked_since: dict[int, float] = {}
        # Every identity's share of the ring (shares.py); the executor sizes it to its ring. Without
        # one (a manager on its own) nothing is bounded by identity.
        self.shares = Shares(0, 0, 1.0)

    def hold(self, room_id: int, nbytes: int, extent: Any = None) -> None:
        """An extent was leased for the room's chunk, which holds `nbytes` of the arenas: charged to the
        room's identity until the extent is free again (shares.py), and once its writes start, to its
        receivers' peers until each one's write reports or the room ends with none in flight
        (`Lifecycle._start_writes`, `Lifecycle._conclude`)."""
        room = self.rooms.get(room_id)
        if room is not None:
            share = room.share = self.shares.of(room.owner)
            if extent is not None:
                room.extent = extent
                extent.share = share
                extent.cost = nbytes
                share.charge(nbytes)
            room.uncharged_bytes = nbytes
            if room.state == "registered":  # its receivers are not all here: the chunk parks
                room.parked_bytes = nbytes
                self.parked_bytes += nbytes
                share.parked += nbytes

    def share_of(self, room_id: int) -> Share:
        """The share a room's items count against: its identity's (the unclaimed one's, if it has none yet)."""
        room = self.rooms.get(room_id)
        return self.shares.of(room.owner if room is not None else None)

    def held_back(self, room_id: int, nbytes: int) -> bool:
        """Must the room's chunk of `nbytes` wait without ring space? True while its identity holds its
        share of the ring (shares.py), or a receiver's peer holds its bound (`max_peer_bytes`); such a
        wait lasts at most the write timeout, then the room fails (kind `capacity`) and this answers
        False (its item is dropped when staged). True too while the chunk would park (its receivers are
        not all registered) and its identity's parked chunks hold their bound (`max_parked_bytes`); that
        wait lasts at most the park timeout, then the room fails as a parked one would (kind
        `park_timeout`)."""
        peers = self.peers
        cap = peers.max_bytes
        parked_cap = self.max_parked_bytes
        shares = self.shares
        # No bound can be passed (one identity only, every peer together and every parked chunk hold
        # too little): the per-item case.
        if shares.cap is None and (cap is None or peers.held_total + nbytes <= cap) and (
                parked_cap is None or self.parked_bytes + nbytes <= parked_cap):
            if self.held_since:
                self.held_since.pop(room_id, None)
            if self.parked_since:
                self.parked_since.pop(room_id, None)
            return False
        room = self.rooms.get(room_id)
        if room is None:
            return False
        share = shares.of(room.owner)
        if shares.over(share, nbytes):
            return self._held_wait(room, f"identity {share.identity!r} held {share.held} B of the ring (its share "
                                         f"is {shares.cap} B)", "identity_held_back")
        # An identity holding nothing parked may always park one chunk.
        if parked_cap is not None and room.state == "registered" and share.parked \
                and share.parked + nbytes > parked_cap:
            return self._parked_wait(room, share)
        if self.parked_since:
            self.parked_since.pop(room_id, None)
        if cap is None or peers.held_total + nbytes <= cap or not room.frames:
            if self.held_since:
                self.held_since.pop(room_id, None)
            return False
        peer = peers.over_bound(room.frames, nbytes)
        if peer is None:
            self.held_since.pop(room_id, None)
            return False
        return self._held_wait(room, f"receiver {peer.session}'s peer held {peer.held} B of the ring (its bound "
                                     f"is {peers.max_bytes} B)", "held_back")

    def _held_wait(self, room: Room, why: str, stat: str) -> bool:
        """The room's chunk waits on a bound of held bytes: at most the write timeout, then it fails."""
        now = self.clock.now()
        since = self.held_since.get(room.id)
        if since is None:
            since = self.held_since[room.id] = now
            self.stats[stat] += 1
        if now - since < self.writes.timeout:
            return True
        self.steps.fail(room, Reason(ReasonKind.CAPACITY, f"{why} for {self.writes.timeout} s"))
        return False

    def _parked_wait(self, room: Room, share: Share) -> bool:
        """The room's chunk would park past the parked chunks' bound: it waits, at most the park timeout."""
        now = self.clock.now()
        since = self.parked_since.get(room.id)
        if since is None:
            since = self.parked_since[room.id] = now
            self.stats["parked_held_back"] += 1
        park_timeout = self.steps.park_timeout
        if now - since < park_timeout:
            return True
        got = f"only {len(room.frames)} of {room.n}" if room.n else "no"  # pragma: no mutate (reason wording)
        self.steps.fail(room, Reason(ReasonKind.PARK_TIMEOUT,
                                     f"{got} receivers registered within {park_timeout} s while the chunks parked "
                                     f"for unregistered receivers held their bound ({share.parked} B of "
                                     f"{self.max_parked_bytes} B)"))
        return False

    def claimed(self, room: Room) -> None:
        """A frame claimed a room the engine named no identity for: what it holds is that identity's now."""
        old = room.share
        if old is None or old.identity == room.owner:
            return
        new = room.share = self.shares.of(room.owner)
        ext = room.extent
        if ext is not None and ext.share is old:
            old.held -= ext.cost
            new.held += ext.cost
            ext.share = new
        if room.parked_bytes:
            old.parked -= room.parked_bytes
            new.parked += room.parked_bytes

    def unpark(self, room: Room) -> None:
        """The room's chunk counts against the parked bound, and its identity's, no more."""
        self.parked_bytes -= room.parked_bytes
        if room.share is not None:
            room.share.parked -= room.parked_bytes
        room.parked_bytes = 0


__all__ = ["Holds"]
