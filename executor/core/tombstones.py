"""What is kept of concluded rooms, and for how long.

A concluded room leaves a tombstone, so a late frame or a sender that binds
after the fact learns the outcome instead of opening a new room under the same
id. Tombstones are bounded by count and age once nothing holds them; while
something does (`pins`: its sender is registered, or a write may still land in
one of its regions), a tombstone is kept whatever the cap.
"""

from __future__ import annotations

from collections import OrderedDict

from . import settings
from .clock import Clock
from .reasons import Reason

_FAILED = "failed"


class Tombstone:
    """A concluded room: its outcome, reason, receivers and owner (steps only on late frames), and
    whether a sender was ever bound to it (`sender`: before it concluded, or to its failure after)."""

    __slots__ = ("room", "state", "reason", "at", "sessions", "pins", "owner", "sender")

    def __init__(self, room: int, state: str, reason: Reason | str, at: float, sessions: frozenset[str],
                 pins: int, owner: str | None, sender: bool):
        self.room, self.state, self.reason, self.at, self.sessions = room, state, reason, at, sessions
        self.pins = pins
        self.owner = owner
        self.sender = sender

    def __repr__(self) -> str:
        return f"room {self.room} (concluded)"


class Tombstones:
    __slots__ = ("clock", "cap", "ttl", "buried", "pinned", "next_trim")

    def __init__(self, clock: Clock, cap: int, ttl: float):
        self.clock = clock
        self.cap = settings.count("max_tombstones", cap, 1)
        self.ttl = settings.seconds("tombstone_ttl", ttl)
        self.buried: OrderedDict[int, Tombstone] = OrderedDict()  # oldest first, bounded
        self.pinned: dict[int, Tombstone] = {}  # held: out of the cap and the TTL
        self.next_trim = 0.0  # when `age` next trims (a tick skips the call before)

    def get(self, room: int) -> Tombstone | None:
        tomb = self.pinned.get(room)
        return tomb if tomb is not None else self.buried.get(room)

    def failed(self, room: int) -> Tombstone | None:
        tomb = self.get(room)
        return tomb if tomb is not None and tomb.state == _FAILED else None

    def keep(self, tomb: Tombstone) -> None:
        """A room just concluded: pinned while anything holds it, else buried."""
        if tomb.pins:
            self.pinned[tomb.room] = tomb
        else:
            self._bury(tomb)

    def pin(self, tomb: Tombstone) -> None:
        if tomb.pins == 0:
            self.buried.pop(tomb.room, None)
            self.pinned[tomb.room] = tomb
        tomb.pins += 1

    def unpin(self, room: int) -> None:
        """One holder let go; the last one starts the tombstone's age."""
        tomb = self.pinned.get(room)
        if tomb is None:
            return
        tomb.pins -= 1
        if tomb.pins <= 0:
            del self.pinned[room]
            tomb.at = self.clock.now()
            self._bury(tomb)

    def _bury(self, tomb: Tombstone) -> None:
        buried = self.buried
        buried.pop(tomb.room, None)  # a room id another identity had concluded may conclude again: newest last
        buried[tomb.room] = tomb
        if len(buried) > self.cap:
            buried.popitem(last=False)

    def age(self, now: float) -> None:
        """Drop tombstones past their TTL; coarse on purpose (every tenth of the TTL)."""
        if now < self.next_trim:
            return
        self.next_trim = now + self.ttl / 10
        buried = self.buried
        while len(buried) > self.cap:
            buried.popitem(last=False)
        horizon = now - self.ttl
        while buried and next(iter(buried.values())).at < horizon:
            buried.popitem(last=False)


__all__ = ["Tombstone", "Tombstones"]
