"""Hooks for observers (metrics, traces): the core tells, it never exports.

The core stays sans-I/O: it calls an optional `Observer` at a few points of a
room's life and knows nothing of Prometheus or any other sink. An observer
reads the time itself (from the manager's clock, or a wall clock for copy
durations), keeps what it needs, and must be cheap: it runs on the encode
loop's thread, inside the per-item cycle. With no observer attached each hook
point costs one attribute test.

Extent and room counts by state are not pushed: an exporter reads them when it
is scraped (`ring.counts()`, `manager.rooms`), so they cost nothing per item.
A room's end is already announced through `manager.on_conclude`.
"""

from __future__ import annotations

from typing import Any


class Observer:
    """No-op base: override what you need. Every method gets ids only."""

    def room_opened(self, room: int) -> None:
        """A room record was created (sender or first receiver frame)."""

    def deferred(self, room: int) -> None:
        """The room's item waits for a free extent."""

    def undeferred(self, room: int) -> None:
        """A deferred item left the queue to be staged (or dropped, if its room concluded)."""

    def copy_started(self, room: int) -> None:
        """The room's embedding starts being copied into its extent."""

    def copy_finished(self, room: int) -> None:
        """The copy is complete (on CUDA: its fence has passed)."""

    def parked(self, room: int) -> None:
        """The chunk is staged but receivers are missing: it waits in its extent."""

    def writes_started(self, room: int) -> None:
        """Writes to all receivers of the room are being submitted (ends any park wait)."""

    def write_reported(self, room: int, outcome: Any, submitted_at: float) -> None:
        """The transport reported the outcome (an `Outcome`) of a write submitted at `submitted_at`."""

    def tower_failed(self, rooms: list[int]) -> None:
        """The tower raised on a batch; these rooms are about to fail because of it."""
