"""The transport seam: register memory once, submit writes, collect outcomes later."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

# (source pointer, destination pointer, length in bytes)
Buf = tuple[int, int, int]


class Outcome(enum.Enum):
    DONE = "done"
    FAILED = "failed"
    # The transport gave up waiting. The bytes may still land later.
    TIMED_OUT = "timed_out"


class TransportError(RuntimeError):
    """Raised by a transport at set-up (registration) time; never swallowed."""


class Transport(ABC):
    """What the controller needs from a transfer engine.

    None of these may block: `submit_write` returns a handle at once and the
    outcome arrives through a later `poll`; `connect` starts first contact with
    a peer and its answer arrives through a later `peer_reports`. `notify` tells one receiver the
    final status of its room.
    """

    @abstractmethod
    def register_memory(self, regions: Sequence[tuple[int, int]], owner: Any = None) -> None:
        """Register local (pointer, length) regions once; raise TransportError on failure."""

    @abstractmethod
    def submit_write(self, session: str, bufs: Sequence[Buf]) -> int:
        """Start a one-sided write of `bufs` to receiver `session`; return a handle."""

    @abstractmethod
    def poll(self) -> list[tuple[int, Outcome]]:
        """Outcomes of writes that finished since the last poll."""

    def overdue(self) -> list[int]:
        """Handles of writes past the transport's own deadline that it cannot report yet, as its
        engine still holds their memory (NIXL while a contact holds its agent), each named once.
        The core fails their rooms now and keeps their extents until `poll` reports them."""
        return []

    # True when `peer_reports` names, for each peer that answers, the identity its own memory
    # says owns it (see `peer_reports`): the core then binds a session to that identity, not
    # to whoever named the session first.
    proves_ownership = False

    def connect(self, session: str, attempt: int, identity: str = "", probe: bool = False) -> bool | None:
        """Start first contact with the peer `session` (segment open, handshake) without blocking.

        Return True if the peer is usable now, False if it refused now, or None
        if the answer comes later from `peer_reports` under the same `attempt`.
        A transport with nothing to open (in-process) answers True. `identity` is the
        key whose frame asked for the contact (for per-identity bounds at the edge). `probe`:
        the heartbeat of a peer already up, which need only find out whether it answers.
        """
        return True

    def peer_reports(self) -> list[tuple[Any, ...]]:
        """(session, attempt, ok, detail) for contacts that finished since the last call, or
        (session, attempt, ok, detail, owner) from a transport that `proves_ownership`: `owner`
        is the identity the peer's registered memory names, None if it could not be read."""
        return []

    @abstractmethod
    def notify(self, frame: Any, room: int, status: str, reason: str = "") -> None:
        """Tell the receiver that sent `frame` its room's final status."""

    def unregister_memory(self, owner: Any) -> None:  # noqa: B027 (optional: nothing to undo by default)
        """Unregister every region registered for `owner` (at shutdown, once no write can read them)."""

    def close(self) -> None:  # noqa: B027 (optional: nothing to release by default)
        """Release the engine; nothing may be submitted afterwards."""
