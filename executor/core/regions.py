"""Encode-side bookkeeping of receive regions: when to send release notices and withdraw acks.

A Success notice releases a region by itself (every write into it reported
done). A Failed one does not when a write into the region may still land: the
write is in flight, or it reported failure or timeout and its extent is in
quarantine. Such regions stay open here until that ends; then the receiver
gets `released`, or `withdrawn` if it had withdrawn the region (the ack means
the same: nothing will land there any more). Only failed rooms with writes
issued pass through here, so the success path costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from .frames import _endpoint_ok

RELEASED, WITHDRAWN = "released", "withdrawn"


class Reply(NamedTuple):
    """Where to answer a receiver the manager holds no frame of (a withdraw for an unknown region)."""

    room: int
    session: str
    status_endpoint: str = ""
    identity: str = ""  # the authenticated sender, set by the control plane (see ReceiverFrame.identity)


class RegionBook:
    __slots__ = ("_tell", "_open", "_by_handle", "_by_extent", "_per_room", "_room_closed")

    def __init__(self, tell: Callable[[Any, int, str], None], room_closed: Callable[[int], None] = lambda room: None):
        self._tell = tell  # tell(frame, room, status)
        self._room_closed = room_closed  # called when a room's last open region closes
        self._per_room: dict[int, int] = {}  # room -> its regions still open
        self._open: dict[tuple[int, str], list[Any]] = {}  # (room, session) -> [frame, withdrawn]
        self._by_handle: dict[int, tuple[int, str]] = {}  # write still in flight -> its region
        self._by_extent: dict[Any, list[tuple[int, str]]] = {}  # extent in quarantine -> regions waiting on it

    def __len__(self) -> int:
        return len(self._open)

    @property
    def rooms_open(self) -> int:
        """Failed rooms with a region that a write may still land in."""
        return len(self._per_room)

    def is_open(self, room: int, session: str) -> bool:
        return (room, session) in self._open

    def room_open(self, room: int) -> bool:
        """Some region of the room may still take a write: its record must be kept."""
        return room in self._per_room

    def room_failed(self, room: int, frames: Iterable[Any], in_flight: dict[str, int],
                    unsure: dict[str, Any], withdrawn: str | None = None) -> None:
        """Tell each receiver of a room just failed when its region is free.

        `in_flight`: session -> handle of its write still in flight; `unsure`: session ->
        extent whose quarantine its failed or timed-out write waits out.
        """
        for f in frames:
            key = (room, f.session)
            handle = in_flight.get(f.session)
            extent = unsure.get(f.session) if handle is None else None
            if handle is None and extent is None:
                self._tell(f, room, WITHDRAWN if f.session == withdrawn else RELEASED)
                continue
            self._open[key] = [f, f.session == withdrawn]
            self._per_room[room] = self._per_room.get(room, 0) + 1
            if handle is not None:
                self._by_handle[handle] = key
            else:
                self._by_extent.setdefault(extent, []).append(key)

    def write_reported(self, handle: int, done: bool, extent: Any) -> None:
        key = self._by_handle.pop(handle, None)
        if key is None:
            return
        if done:
            self._close(key)
        else:
            self._by_extent.setdefault(extent, []).append(key)

    def extent_released(self, extent: Any) -> None:
        for key in self._by_extent.pop(extent, ()):
            self._close(key)

    def withdraw(self, room: int, session: str) -> bool:
        """Mark an open region withdrawn (acked when it closes); False if it is not open."""
        entry = self._open.get((room, session))
        if entry is None:
            return False
        entry[1] = True
        return True

    def _close(self, key: tuple[int, str]) -> None:
        entry = self._open.pop(key, None)
        if entry is not None:
            frame, withdrawn = entry
            room = key[0]
            self._tell(frame, room, WITHDRAWN if withdrawn else RELEASED)
            left = self._per_room[room] - 1
            if left:
                self._per_room[room] = left
            else:
                del self._per_room[room]
                self._room_closed(room)


# -- wire (control plane): a withdraw, receiver to encoder ------------------------------------
WITHDRAW_MAGIC = b"epd-ring/withdraw/1"


class WithdrawError(ValueError):
    """A withdraw message that does not parse; refused alone."""


def withdraw_to_parts(room: int, session: str, status_endpoint: str = "") -> list[bytes]:
    return [WITHDRAW_MAGIC, b"%d" % room, session.encode(), status_endpoint.encode()]


def withdraw_from_parts(parts: Sequence[Any]) -> Reply:
    """Parse a withdraw (its parts bytes, memoryviews or zmq frames); raise WithdrawError naming the first bad part."""
    if len(parts) != 4 or parts[0] != WITHDRAW_MAGIC:
        raise WithdrawError("not a withdraw message")
    room, session, endpoint = (bytes(p) for p in parts[1:])
    if not 0 < len(room) <= 20 or not room.isdigit():
        raise WithdrawError(f"room must be a decimal integer, got {room[:24]!r}")
    for name, part in (("session", session), ("status_endpoint", endpoint)):
        if len(part) > 256 or not part.isascii():
            raise WithdrawError(f"{name} must be ASCII of at most 256 bytes")
    if not session:
        raise WithdrawError("session must not be empty")
    if endpoint and not _endpoint_ok(endpoint.decode()):
        raise WithdrawError("status_endpoint must be a numeric tcp://ADDRESS:PORT")
    return Reply(int(room), session.decode(), endpoint.decode())


__all__ = ["RELEASED", "RegionBook", "Reply", "WITHDRAWN", "WITHDRAW_MAGIC", "WithdrawError",
           "withdraw_from_parts", "withdraw_to_parts"]
