"""What the core asks the edge to do.

The core never calls a transport, a socket or a callback to act on the world:
every entry point (`execute`, `register_receiver`, `poll`, ...) leaves what must
happen in its outbox, in order, and `take_effects()` hands it over. A driver
does each (the `Pump` for any `Transport`) and feeds what comes back (write
outcomes, contact answers, frames) in through the entry points again. This is
what lets a test or the model run the core without a network, and shows in one
list everything a tick decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .transport import Buf


@dataclass(frozen=True, slots=True)
class Submit:
    """Start a one-sided write of `bufs` to `session`; report its outcome under `write`."""

    write: int
    session: str
    bufs: tuple[Buf, ...]


@dataclass(frozen=True, slots=True)
class Contact:
    """Start first contact with the peer `session` (off the loop); report the answer with `attempt`.

    The same effect re-checks a `suspect` peer and is the heartbeat's probe of a busy `up` one: the
    edge does the same cheap probe for each, under the connect deadline. `identity` is the key whose
    frame made the peer: the edge bounds how many contacts one identity has under way, so no key can
    hold every connector thread."""

    session: str
    attempt: int
    identity: str = ""
    probe: bool = False  # the heartbeat of an up peer: only "does it answer?" (no segment open)


@dataclass(frozen=True, slots=True)
class Notify:
    """Tell `receiver` (the frame it registered with, or a `Reply`) the room's `status`."""

    receiver: Any
    room: int
    status: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Concluded:
    """The room reached `state` (success or failed) and every receiver was told."""

    room: int
    state: str


@dataclass(frozen=True, slots=True)
class Release:
    """A drain is done: unregister `owner`'s memory (the ring), then close the transport if asked."""

    owner: Any
    close_transport: bool


Effect = Submit | Contact | Notify | Concluded | Release

__all__ = ["Concluded", "Contact", "Effect", "Notify", "Release", "Submit"]
