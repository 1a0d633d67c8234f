"""Which identity owns which receiver sessions, and how many rooms each has announced.

An identity is the key the control plane authenticated (a CURVE public key; ""
when it runs without authentication, which puts every frame in one trust
domain). A session (a transfer-engine "host:port") is claimed by the first identity
that names it, so no identity can have the encoder write into another's
buffers (no confused deputy). A transport that proves ownership (it reads the
owner's identity out of the peer's own registered memory) overrides that first
claim: the session is then taken from whoever named it first (`claim(take=True)`),
since a session string is only a spelling and the engine resolves it. Everything here is bounded: sessions per identity
(oldest released first, only ever its own), sessions in all, and rooms
announced per identity, so one identity cannot exhaust what the others need.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class Tenancy:
    __slots__ = ("max_sessions_per_identity", "max_sessions", "max_announced_per_identity", "_owner", "_sessions_of",
                 "announced")

    def __init__(self, max_sessions_per_identity: int = 256, max_sessions: int = 65536,
                 max_announced_per_identity: int = 1024):
        self.max_sessions_per_identity = max_sessions_per_identity
        self.max_sessions = max_sessions
        self.max_announced_per_identity = max_announced_per_identity
        self._owner: dict[str, str] = {}
        self._sessions_of: dict[str, OrderedDict[str, None]] = {}
        self.announced: Counter[str | None] = Counter()

    def session_owner(self, session: str) -> str | None:
        return self._owner.get(session)

    def claim(self, identity: str, session: str, take: bool = False) -> str:
        """Bind `session` to `identity`; '' if done (or already so), else why not.

        With `take` (the session's memory proved it is `identity`'s), another identity's
        claim on the string is withdrawn first."""
        owner = self._owner.get(session)
        if owner is not None and owner != identity and take:
            self._release(owner, session)
            owner = None
        if owner is not None:
            if owner != identity:
                return "session belongs to another receiver"
            self._sessions_of[identity].move_to_end(session)
            return ""
        mine = self._sessions_of.get(identity)
        if mine is None:
            mine = self._sessions_of[identity] = OrderedDict()
        if len(mine) >= self.max_sessions_per_identity:
            old, _ = mine.popitem(last=False)  # this identity's own oldest session: nobody else's
            del self._owner[old]
        elif len(self._owner) >= self.max_sessions:
            return f"too many receiver sessions ({self.max_sessions})"
        mine[session] = None
        self._owner[session] = identity
        return ""

    def _release(self, identity: str, session: str) -> None:
        del self._owner[session]
        mine = self._sessions_of[identity]
        del mine[session]
        if not mine:
            del self._sessions_of[identity]

    def may_announce(self, identity: str) -> bool:
        return self.announced[identity] < self.max_announced_per_identity

    def __len__(self) -> int:
        return len(self._owner)
