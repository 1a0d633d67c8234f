"""Which authenticated peer owns which receiver sessions, and how many rooms each has announced.

A peer is the identity the control plane authenticated (a CURVE public key; ""
when it runs without authentication, which puts every frame in one trust
domain). A session (a transfer-engine "host:port") is claimed by the first peer
that names it, so no peer can have the encoder write into another peer's
buffers (no confused deputy). Everything here is bounded: sessions per peer
(oldest released first, only ever the peer's own), sessions in all, and rooms
announced per peer, so one peer cannot exhaust what the others need.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class Tenancy:
    __slots__ = ("max_sessions_per_peer", "max_sessions", "max_announced_per_peer", "_owner", "_sessions_of",
                 "announced")

    def __init__(self, max_sessions_per_peer: int = 256, max_sessions: int = 65536, max_announced_per_peer: int = 1024):
        self.max_sessions_per_peer = max_sessions_per_peer
        self.max_sessions = max_sessions
        self.max_announced_per_peer = max_announced_per_peer
        self._owner: dict[str, str] = {}
        self._sessions_of: dict[str, OrderedDict[str, None]] = {}
        self.announced: Counter = Counter()

    def session_owner(self, session: str) -> str | None:
        return self._owner.get(session)

    def claim(self, peer: str, session: str) -> str:
        """Bind `session` to `peer`; '' if done (or already so), else why not."""
        owner = self._owner.get(session)
        if owner is not None:
            if owner != peer:
                return "session belongs to another receiver"
            self._sessions_of[peer].move_to_end(session)
            return ""
        mine = self._sessions_of.get(peer)
        if mine is None:
            mine = self._sessions_of[peer] = OrderedDict()
        if len(mine) >= self.max_sessions_per_peer:
            old, _ = mine.popitem(last=False)  # this peer's own oldest session: nobody else's
            del self._owner[old]
        elif len(self._owner) >= self.max_sessions:
            return f"too many receiver sessions ({self.max_sessions})"
        mine[session] = None
        self._owner[session] = peer
        return ""

    def may_announce(self, peer: str) -> bool:
        return self.announced[peer] < self.max_announced_per_peer

    def __len__(self) -> int:
        return len(self._owner)
