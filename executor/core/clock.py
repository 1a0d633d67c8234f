"""Injected time: the controller never reads the wall clock itself."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    """Seconds from `time.monotonic`, for production drivers."""

    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told, so deadlines are testable without sleeping."""

    def __init__(self, start: float = 0.0):
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self._t += seconds
        return self._t
