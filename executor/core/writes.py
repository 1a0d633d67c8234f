"""Writes in flight: one per receiver of a transferring room, each with its own deadline.

The transport answers a submit with a handle and reports the outcome through
its `poll()`; a write the transport refused outright (it raised) is reported
failed on the next tick like any other, so one code path handles outcomes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .transport import Buf, Outcome, Transport

if TYPE_CHECKING:
    from .clock import Clock
    from .frames import ReceiverFrame
    from .ring import Slot
    from .timers import Deadlines

log = logging.getLogger("epd_ring.manager")


class Write:
    __slots__ = ("handle", "room", "slot", "frame", "timer", "due", "overdue")

    def __init__(self, handle: int, room: int, slot: Slot, frame: ReceiverFrame):
        self.handle, self.room, self.slot, self.frame, self.timer, self.due = handle, room, slot, frame, 0, 0.0
        self.overdue = False  # our deadline passed before the transport reported

    def __repr__(self) -> str:
        return f"write {self.handle} of room {self.room} to {self.frame.session}"


class Writes:
    __slots__ = ("transport", "clock", "deadlines", "timeout", "by_handle", "_refused", "_refused_ids")

    def __init__(self, transport: Transport, clock: Clock, deadlines: Deadlines, timeout: float):
        self.transport, self.clock, self.deadlines, self.timeout = transport, clock, deadlines, timeout
        self.by_handle: dict[int, Write] = {}
        self._refused: list[tuple[int, Outcome]] = []
        self._refused_ids = 0  # negative handles, never the transport's

    def __len__(self) -> int:
        return len(self.by_handle)

    def issue(self, room: int, slot: Slot, writes: Sequence[tuple[ReceiverFrame, list[Buf]]]) -> None:
        """Submit one write per (frame, buffers) from `slot`, all due `timeout` from now."""
        due = self.clock.now() + self.timeout
        for frame, bufs in writes:
            slot.writes_in_flight += 1
            try:
                handle = self.transport.submit_write(frame.session, bufs)
            except Exception as exc:  # a transport must not raise here; if it does, fail this write only
                log.error("transport refused a write for room %s to %s: %s", room, frame.session, exc)
                self._refused_ids -= 1
                handle = self._refused_ids
                self._refused.append((handle, Outcome.FAILED))
            w = self.by_handle[handle] = Write(handle, room, slot, frame)
            self.deadlines.arm(due, "write", w)

    def outcomes(self) -> list[tuple[int, Outcome]]:
        """What the transport reported since the last tick, and the writes it refused."""
        done = self.transport.poll()
        if self._refused:
            done += self._refused
            self._refused = []
        return done

    def reported(self, handle: int) -> Write | None:
        """The write a report answers (None if it is not ours); it leaves the table."""
        w = self.by_handle.pop(handle, None)
        if w is not None:
            self.deadlines.cancel(w)
        return w

    def submitted_at(self, w: Write) -> float:
        return w.due - self.timeout

    def of_room(self, room: int) -> dict[str, int]:
        """session -> handle of each write of `room` still in flight."""
        return {w.frame.session: h for h, w in self.by_handle.items() if w.room == room}

    def oldest_age(self) -> float:
        """Seconds since the oldest write still in flight was submitted (0 if none)."""
        if not self.by_handle:
            return 0.0
        return max(0.0, self.clock.now() - min(self.submitted_at(w) for w in self.by_handle.values()))

    def values(self) -> Iterable[Write]:
        return self.by_handle.values()


__all__ = ["Write", "Writes"]
