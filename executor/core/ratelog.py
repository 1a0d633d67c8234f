"""Warnings a peer can provoke at will, rate-limited so that log volume stays bounded."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

# Appended to the first line after a run held back: the count is the line's last argument.
_HELD_BACK = " (and %d more like it)"


class RateLimitedLog:
    """At most one line per key per `interval` seconds of `now()`; the next line says how many
    were held back. The clock is injected (the core's clock, or time.monotonic at the edge)."""

    __slots__ = ("logger", "interval", "now", "_last", "suppressed")

    def __init__(self, logger: logging.Logger, now: Callable[[], float], interval: float = 1.0):
        self.logger, self.now, self.interval = logger, now, interval
        self._last: dict[str, tuple[float, int]] = {}
        self.suppressed = 0

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = self.now()
        last, held = self._last.get(key, (-1e300, 0))
        if now - last < self.interval:
            self._last[key] = (last, held + 1)
            self.suppressed += 1
            return
        self._last[key] = (now, 0)
        if held:
            self.logger.warning(msg + _HELD_BACK, *args, held)
        else:
            self.logger.warning(msg, *args)


__all__ = ["RateLimitedLog"]
