"""`epd-ring check`: explore the model exhaustively and report, or replay a saved trace."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .explore import event_name, explore, format_trace, replay, trace_to_json
from .spec import VARIANTS, Config, Spec


def add_arguments(p) -> None:
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--rooms", type=int, default=4)
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--faults", type=int, default=1)
    p.add_argument("--variant", default="project", choices=sorted(VARIANTS))
    p.add_argument("--no-symmetry", action="store_true", help="explore without symmetry reduction")
    p.add_argument("--compare-symmetry", action="store_true", help="run with and without symmetry reduction")
    p.add_argument("--save-traces", metavar="DIR", help="write each violation's trace as JSON")
    p.add_argument("--replay", metavar="FILE", help="replay a saved trace instead of exploring")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--engine", choices=["explorer", "spin"], default="explorer",
                   help="the Python explorer, or SPIN on Promela generated from the same declarations and rules")
    p.add_argument("--spin-opt", default=None, help="gcc optimisation for pan (default -O0 below 100k states' "
                   "worth of bound, else -O2: compiling at -O2 takes ~30 s)")
    p.add_argument("--spin-collapse", action="store_true", help="pan -DCOLLAPSE: lossless state compression")
    p.add_argument("--spin-hash", type=int, default=None, help="pan -w: log2 of the hash table size")
    p.add_argument("--spin-memlim", type=int, default=8192, help="pan -DMEMLIM, in MB")
    p.add_argument("--spin-keep", metavar="DIR", help="keep the Promela model, pan.c and trails in DIR")


def run(args, out=print) -> int:
    if args.replay:
        data = json.loads(Path(args.replay).read_text())
        spec = Spec(Config(**data["config"]))
        steps, problem = replay(data)
        for n, (event, state) in enumerate(steps):
            out(f"  {n:2d}. {event_name(event):<22} {spec.describe(state)}")
        if problem:
            out(f"violation: {problem[0]}: {problem[1]}")
            return 1
        out("no violation")
        return 0
    cfg = Config(args.slots, args.rooms, args.receivers, args.faults, args.variant)
    if args.engine == "spin":
        raise SystemExit("--engine spin starts processes: run it as `epd-ring check --engine spin`")
    runs = [True, False] if args.compare_symmetry else [not args.no_symmetry]
    status = 0
    for symmetry in runs:
        label = "with" if symmetry else "without"
        out(f"checking {cfg.variant}: {cfg.slots} slots, {cfg.rooms} rooms, {cfg.receivers} receivers per room, "
            f"{cfg.faults} fault(s), {label} symmetry reduction")

        def progress(states, seconds, depth):
            if not args.quiet:
                out(f"  states {states:>9,}  states/s {states / seconds:>9,.0f}  depth {depth}")

        r = explore(cfg, symmetry=symmetry, progress=progress)
        out(f"  {r.states:,} states, {r.transitions:,} transitions, depth {r.depth}, {r.finals:,} quiescent "
            f"end states, {r.seconds:.2f} s, {r.states_per_s:,.0f} states/s")
        if symmetry:
            out(f"  they stand for {r.represented:,} states without symmetry reduction: "
                f"{r.represented_per_s:,.0f} states/s of the unreduced space")
        if not r.violations:
            out("  no violation: every invariant holds in every reachable state, no deadlock, "
                "and a quiescent state is reachable from every state")
            continue
        status = 1
        spec = Spec(cfg)
        for kind, v in sorted(r.violations.items()):
            out(format_trace(spec, v))
            if args.save_traces:
                d = Path(args.save_traces)
                d.mkdir(parents=True, exist_ok=True)
                name = d / f"{cfg.variant}--{v.hazard or kind}.json"
                name.write_text(trace_to_json(cfg, v))
                out(f"  saved {name}")
    return status


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
