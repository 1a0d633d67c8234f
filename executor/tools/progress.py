"""Progress of long runs (demo, bench, check), drawn by one library: rich.

On a terminal it is a live bar with the elapsed time and an ETA, on stderr so
that stdout keeps only the report (and `--json` stays parseable). Off a
terminal (CI logs, pipes) it writes a plain line at every tenth of the run,
with the same ETA, instead of repainting a bar nobody sees.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _eta(done: float, total: float | None, elapsed: float) -> str:
    if not total or done <= 0 or done >= total:
        return ""
    return f", ETA {elapsed * (total - done) / done:.1f} s"


class Progress:
    """`update(done, **fields)` as the run goes; `close()` at the end (or use it as a context)."""

    def __init__(self, label: str, total: int | None, *, unit: str = "items", enabled: bool = True,
                 stream: TextIO | None = None):
        self.label, self.total, self.unit, self.enabled = label, total, unit, enabled
        self.stream = stream or sys.stderr
        self._t0 = time.perf_counter()
        self._next_line = 0.0
        self._bar: Any = None
        self._task: Any = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress as RichProgress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            columns = [TextColumn("{task.description}")]
            columns += [BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"),
                        TimeRemainingColumn()] if total else [SpinnerColumn(), TimeElapsedColumn()]
            columns.append(TextColumn("{task.fields[extra]}"))
            self._bar = RichProgress(*columns, console=Console(file=self.stream), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(label, total=total, extra="")

    def update(self, done: int, **fields: Any) -> None:
        if not self.enabled:
            return
        extra = "  ".join(f"{k.replace('_', ' ')} {v}" for k, v in fields.items())
        if self._bar is not None:
            self._bar.update(self._task, completed=done, extra=extra)
            return
        elapsed = time.perf_counter() - self._t0
        if self.total:
            if done < self._next_line:
                return
            self._next_line = done + max(1, self.total // 10)
            head = f"{done}/{self.total} {self.unit}"
        else:
            if elapsed < self._next_line:
                return
            self._next_line = elapsed + 1.0
            head = f"{done:,} {self.unit}"
        print(f"  {self.label}: {head}, {elapsed:.1f} s{_eta(done, self.total, elapsed)}  {extra}".rstrip(),
              file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
