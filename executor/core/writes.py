"""Writes in flight: one per receiver of a transferring room, each with its own deadline.

A write is an id the core hands out with a `Submit` effect; the driver submits it
and reports its outcome under that id (`EncodeManager.writes_reported`), so the
core never holds a transport's handle nor waits for one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .effects import Effect, Submit
from .transport import Buf

if TYPE_CHECKING:
    from .clock import Clock
    from .frames import ReceiverFrame
    from .ring import Extent
    from .timers import Deadlines


class Write:
    __slots__ = ("handle", "room", "extent", "frame", "timer", "due", "overdue")

    def __init__(self, handle: int, room: int, extent: Extent, frame: ReceiverFrame):
        self.handle, self.room, self.extent, self.frame, self.timer, self.due = handle, room, extent, frame, 0, 0.0
        self.overdue = False  # our deadline passed before the transport reported

    def __repr__(self) -> str:
        return f"write {self.handle} of room {self.room} to {self.frame.session}"


class Writes:
    __slots__ = ("clock", "deadlines", "timeout", "outbox", "by_handle", "_last_id")

    def __init__(self, clock: Clock, deadlines: Deadlines, timeout: float, outbox: list[Effect]):
        self.clock, self.deadlines, self.timeout, self.outbox = clock, deadlines, timeout, outbox
        self.by_handle: dict[int, Write] = {}
        self._last_id = 0

    def __len__(self) -> int:
        return len(self.by_handle)

    def issue(self, room: int, extent: Extent, writes: Sequence[tuple[ReceiverFrame, tuple[Buf, ...]]]) -> None:
        """One `Submit` per (frame, buffers) from `extent`, all due `timeout` from now (the buffers a tuple,
        as `Submit` carries them)."""
        due = self.clock.now() + self.timeout
        for frame, bufs in writes:
            extent.writes_in_flight += 1
            self._last_id += 1
            w = self.by_handle[self._last_id] = Write(self._last_id, room, extent, frame)
            self.deadlines.arm(due, "write", w)
            self.outbox.append(Submit(w.handle, frame.session, bufs))

    def reported(self, handle: int) -> Write | None:
        """The write a report answers (None if it is not ours); it leaves the table."""
        w = self.by_handle.pop(handle, None)
        if w is not None:
            self.deadlines.cancel(w)
        return w

    def submitted_at(self, w: Write) -> float:
        return w.due - self.timeout

    def of_room(self, room: int) -> dict[str, int]:
        """session -> id of each write of `room` still in flight."""
        return {w.frame.session: h for h, w in self.by_handle.items() if w.room == room}

    def oldest_age(self) -> float:
        """Seconds since the oldest write still in flight was submitted (0 if none)."""
        if not self.by_handle:
            return 0.0
        return max(0.0, self.clock.now() - min(self.submitted_at(w) for w in self.by_handle.values()))

    def values(self) -> Iterable[Write]:
        return self.by_handle.values()


__all__ = ["Write", "Writes"]
