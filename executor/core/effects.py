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

from typing import Any, NamedTuple

from .transport import Buf


class Submit(NamedTuple):
    """Start a one-sided write of `bufs` to `session`; report its outcome under `write`."""

    write: int
    session: str
    bufs: tuple[Buf, ...]


class Contact(NamedTuple):
    """Start first contact with the peer `session` (off the loop); report the answer with `attempt`.

    The same effect re-checks a `suspect` peer and is the heartbeat's probe of a busy `up` one: the
    edge does the same cheap probe for each, under the connect deadline. `identity` is the key whose
    frame made the peer: the edge bounds how many contacts one identity has under way, so no key can
    hold every connector thread."""

    session: str
    attempt: int
    identity: str = ""
    probe: bool = False  # the heartbeat of an up peer: only "does it answer?" (no segment open)


class Notify(NamedTuple):
    """Tell `receiver` (the frame it registered with, or a `Reply`) the room's `status`."""

    receiver: Any
    room: int
    status: str
    reason: str = ""


class Concluded(NamedTuple):
    """The room reached `state` (success or failed) and every receiver was told."""

    room: int
    state: str


class Release(NamedTuple):
    """A drain is done: unregister `owner`'s memory (the ring), then close the transport if asked."""

    owner: Any
    close_transport: bool


Effect = Submit | Contact | Notify | Concluded | Release


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and tuple.__eq__(a, b) is True


def _differ(a: Any, b: Any) -> bool:
    return not _same(a, b)


# Immutable tuples: one is made per write, notice and conclusion, and a tuple's making costs a third of
# a frozen dataclass's (no per-field setattr). Equal only to an effect of the same kind with equal fields,
# as the dataclasses they were: a Submit never equals a tuple, nor a Notify a Concluded.
_kind: type
for _kind in (Submit, Contact, Notify, Concluded, Release):
    _kind.__eq__ = _same  # type: ignore[method-assign]
    _kind.__ne__ = _differ  # type: ignore[method-assign]
    _kind.__hash__ = tuple.__hash__  # type: ignore[method-assign]

__all__ = ["Concluded", "Contact", "Effect", "Notify", "Release", "Submit"]
