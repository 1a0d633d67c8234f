"""Graceful drain: stop intake, let in-flight writes finish, then let go of the ring.

A worker that is shutting down must not free the ring while a write may still
read it, nor leave a receiver waiting for a status that never comes. The drain
is a small state of its own, stepped by the executor's `poll()`, so it runs on
the loop's thread like everything else and its deadline is the injected clock:

1. Intake stops: a request registered from now on fails at once, and every
   room not yet transferring (waiting for its sender, receivers or chunk,
   parked, or deferred for an extent) fails, its receivers told why.
2. Rooms whose writes are in flight finish; at the deadline they fail.
3. Once no room is live, no write is in flight, no copy is pending and every
   quarantine has ended (a write that failed may still land: its extent is not
   released early), the ring is retired and a `Release` effect asks the
   driver to unregister the ring's memory and close the transport.

If the deadline passes before step 3, `Pump.close()` returns a report that says
what is still busy and leaves the ring registered: leaking it is safe,
freeing memory a write may still read is not. Later polls carry on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .effects import Release
from .reasons import Reason, ReasonKind

if TYPE_CHECKING:
    # The executor as its base declares it: the executor starts a Drain, so the drain does not import it.
    from .staging import Staging

DRAINING = Reason(ReasonKind.DRAINING, "encode worker is draining (shutting down); no new transfers")
DEADLINE = Reason(ReasonKind.DRAIN_DEADLINE, "encode worker drain deadline passed with the room's writes in flight")


@dataclass
class DrainReport:
    """What a drain did; `clean` when the ring was unregistered and the transport closed."""

    clean: bool
    rooms_failed: int = 0  # rooms this drain failed (not yet transferring, or past the deadline)
    rooms_finished: int = 0  # rooms that concluded on their own during the drain
    busy_extents: dict[str, int] = field(default_factory=dict)  # states of extents still live (unclean only)
    writes_in_flight: int = 0
    live_rooms: int = 0


class Drain:
    def __init__(self, executor: Staging, deadline: float, close_transport: bool):
        self.executor = executor
        self.deadline = deadline
        self.close_transport = close_transport
        self.done = False
        self.rooms_failed = 0
        self.rooms_finished = 0
        self._counting = True
        executor.manager.on_conclude.append(self._concluded)

    def _concluded(self, room: int, state: str) -> None:
        if self._counting:
            self.rooms_finished += 1

    def fail(self, room: int, reason: Reason) -> None:
        self._counting = False
        try:
            if self.executor.manager.fail_room(room, reason):
                self.rooms_failed += 1
        finally:
            self._counting = True

    def step(self) -> bool:
        """One drain step (called from `poll`); True once the ring is let go."""
        if self.done:
            return True
        ex = self.executor
        manager = ex.manager
        past = manager.clock.now() >= self.deadline
        for room_id, room in list(manager.rooms.items()):
            if room.state != "transferring":
                self.fail(room_id, DRAINING)
            elif past:
                self.fail(room_id, DEADLINE)
        ex.drop_deferred()  # their rooms just failed
        ring = ex.ring
        if manager.rooms or manager.writes_in_flight or ex.copies_pending or ring.live:
            return False
        ring.close()
        manager.outbox.append(Release(ring, self.close_transport))
        self.done = True
        manager.on_conclude.remove(self._concluded)
        return True

    def report(self) -> DrainReport:
        ex = self.executor
        # The ring counts live extents only: a free one has left it.
        busy: dict[str, int] = {} if self.done else dict(ex.ring.counts())
        return DrainReport(self.done, self.rooms_failed, self.rooms_finished, busy,
                           ex.manager.writes_in_flight, len(ex.manager.rooms))


