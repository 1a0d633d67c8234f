"""What a pass sets aside by a mutant's diff (no mutmut needed): log lines, and the claims of
tests/mutation/equivalent.md, each keyed by the function and the exact line before and after
(never by mutmut's index, which changes whenever the code above it does). score.py scores with it,
record.py keeps such survivors when it carries a pass, survivors_today.py keys survivors the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOG_LINE = re.compile(r"^\s*(?:\w+\.)*log\.(debug|info|warning|error)\(")


def equivalents() -> set[tuple[str, str, str]]:
    """(function, line before, line after) of each claimed equivalent: `- `func` | `before` | `after` | why`."""
    claims = set()
    for line in (HERE / "equivalent.md").read_text().splitlines():
        m = re.match(r"- `([^`]+)` \| `(.*)` \| `(.*)` \| ", line)
        if m:
            claims.add((m.group(1), m.group(2), m.group(3)))
    return claims


def changed(diff: str) -> tuple[str, str]:
    """A mutant's diff as (lines before, lines after), each stripped and joined by " / "."""
    minus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return " / ".join(minus), " / ".join(plus)


def function_of(mutant: str) -> str:
    return re.sub(r"__mutmut_\d+$", "", mutant)


def set_aside(mutant: str, before: str, after: str, claims: set[tuple[str, str, str]]) -> str | None:
    """"log line" or "equivalent" if the pass does not score this mutant, else None."""
    if LOG_LINE.match(before):
        return "log line"
    if (function_of(mutant), before, after) in claims:
        return "equivalent"
    return None
