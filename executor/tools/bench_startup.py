"""`epd-ring bench --startup`: how long `epd-ring --version` and `--help` take to answer.

Each run is a fresh `python -m epd_ring` process, as a shell starts one, so the figure is what a
user waits for: the interpreter's start, the imports and the answer. The imports are also timed on
their own, by Python's `-X importtime` (each module's self time, summed). Figures are printed, not
judged: a loaded machine makes them larger, and `tests/test_cli.py` checks what is imported instead.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

COMMANDS = ("--version", "--help")


def _answer(flag: str, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *options, "-m", "epd_ring", flag], capture_output=True, text=True,
                          check=True)


def import_ms(flag: str) -> float:
    """Milliseconds of imports (self times summed) of one `python -X importtime -m epd_ring FLAG`."""
    total_us = 0
    for line in _answer(flag, "-X", "importtime").stderr.splitlines():
        # "import time:       123 |        456 | module": self, cumulative, name (one header line first)
        fields = line.removeprefix("import time:").split("|")
        if line.startswith("import time:") and fields[0].strip().isdigit():
            total_us += int(fields[0])
    return total_us / 1000


def run(runs: int = 5, echo: Callable[..., Any] = print) -> dict[str, dict[str, float]]:
    """Print (through `echo`) and return {flag: {best_ms, median_ms, imports_ms}} over `runs` processes each."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    echo(f"startup: a fresh `python -m epd_ring FLAG` per run, best and median of {runs}")
    echo(f"{'command':>10} {'best ms':>8} {'median ms':>10} {'imports ms':>11}")
    figures = {}
    for flag in COMMANDS:
        walls = []
        for _ in range(runs):
            start = time.perf_counter()
            _answer(flag)
            walls.append((time.perf_counter() - start) * 1000)
        figures[flag] = {"best_ms": min(walls), "median_ms": statistics.median(walls), "imports_ms": import_ms(flag)}
        f = figures[flag]
        echo(f"{flag:>10} {f['best_ms']:>8.1f} {f['median_ms']:>10.1f} {f['imports_ms']:>11.1f}")
    return figures
