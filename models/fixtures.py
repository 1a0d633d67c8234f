"""The minimal hazard traces committed under tests/fixtures/hazards/, regenerated on demand."""

from __future__ import annotations

import sys
from pathlib import Path

from .explore import explore, trace_to_json
from .spec import HAZARDS, Config

# The smallest bounds at which each variant shows its hazards. One cell per item: the traces are
# also replayed on the implementation, whose ring has one extent per item until the arena is in it.
FIXTURE_CONFIGS = [
    Config(cells=1, rooms=2, receivers=2, faults=1, variant="seed", sizes=(1,)),
    Config(cells=1, rooms=2, receivers=1, faults=1, variant="no-parked-check", sizes=(1,)),
    Config(cells=1, rooms=2, receivers=2, faults=1, variant="reuse-when-terminal", sizes=(1,)),
    Config(cells=1, rooms=2, receivers=1, faults=1, variant="busy-wait", sizes=(1,)),
    Config(cells=1, rooms=2, receivers=1, faults=1, variant="reaped-deferred-crash", sizes=(1,)),
    Config(cells=1, rooms=1, receivers=1, faults=0, variant="blocking-contact", peers=True, sizes=(1,)),
    Config(cells=1, rooms=1, receivers=1, faults=0, variant="write-before-up", peers=True, sizes=(1,)),
]


def hazard_traces() -> dict[str, str]:
    """File name -> JSON text, one per (variant, violation) named in HAZARDS."""
    out = {}
    for cfg in FIXTURE_CONFIGS:
        result = explore(cfg)
        for kind, violation in sorted(result.violations.items()):
            hazard = HAZARDS.get((cfg.variant, kind))
            if hazard:
                out[f"{cfg.variant}--{hazard}.json"] = trace_to_json(cfg, violation)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] != ["--write"] or len(argv) != 2:
        print("usage: python -m epd_ring.models.fixtures --write DIR")  # pragma: no mutate (usage wording)
        return 2
    d = Path(argv[1])
    d.mkdir(parents=True, exist_ok=True)
    for name, text in hazard_traces().items():
        (d / name).write_text(text)
        print(f"wrote {d / name}")  # pragma: no mutate (report wording)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
