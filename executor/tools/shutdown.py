"""SIGTERM and Ctrl-C ask a running demo to drain instead of dying mid-write.

The first signal sets `requested`; the loop notices it at its next tick,
starts `pump.close(...)` (the drain) and reports. A second Ctrl-C stops at once
(KeyboardInterrupt), for a drain that takes too long.
"""

from __future__ import annotations

import signal
from typing import Any

EXIT_FOR_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class DrainOnSignal:
    def __init__(self) -> None:
        self.requested: int | None = None
        self._saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signum

    @property
    def exit_code(self) -> int:
        return EXIT_FOR_SIGNAL.get(self.requested, 1) if self.requested is not None else 0

    def __enter__(self) -> DrainOnSignal:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: signals cannot be caught here
            self._saved.clear()
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
