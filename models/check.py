"""`epd-ring check`: explore the model exhaustively and report, or replay a saved trace."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import liveness
from .explore import event_name, explore, format_trace, replay, trace_to_json
from .spec import VARIANTS, Config, Spec

# Defaults of the model's size; None in argparse so that `--replay` can tell an
# explicit flag (refused: the trace file fixes the configuration) from none.
DEFAULTS = {"cells": 3, "rooms": 3, "receivers": 2, "faults": 1, "variant": "project", "sizes": (1, 2)}


class CheckInputError(ValueError):
    """Bad input to `check` (a flag or a trace file): a usage error, not a finding."""


def count_at_least(low: int, what: str = ""):  # pragma: no mutate (message wording)
    """An argparse type: an integer >= `low`, refused with a one-line reason (the CLI uses it too)."""
    def parse(text: str) -> int:
        import argparse

        try:
            value = int(text)
        except ValueError:
            # message wording: not mutated (the pragma below)
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None  # pragma: no mutate
        if value < low:
            # message wording: not mutated (the pragma below)
            raise argparse.ArgumentTypeError(f"must be >= {low}{what}, got {value}")  # pragma: no mutate
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def cell_sizes(text: str) -> tuple[int, ...]:
    """An argparse type: ascending distinct cell counts, comma-separated ("1,2")."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
        Config(sizes=sizes)
    except ValueError as exc:
        # pragma: no mutate start (message wording)
        raise argparse.ArgumentTypeError(f"expected ascending cell counts like 1,2: {exc}") from None
        # pragma: no mutate end
    return sizes


def add_arguments(p) -> None:
    # Each help= starts a line of its own: the mutation pass leaves such lines alone (wording, not behaviour).
    d = DEFAULTS
    p.add_argument("--cells", type=count_at_least(1), default=None,
                   help=f"cells of the arena in the model (default: {d['cells']})")
    p.add_argument("--sizes", type=cell_sizes, default=None,
                   help=f"item sizes in cells the tower may produce, comma-separated (default: "
                        f"{','.join(map(str, d['sizes']))}; a size above --cells fails its room)")
    # The model's ring was slots once; say what replaced the flag rather than "unrecognized argument".
    p.add_argument("--slots", type=int, default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--rooms", type=count_at_least(1), default=None,
                   help=f"rooms in the model (default: {d['rooms']})")
    p.add_argument("--receivers", type=count_at_least(1), default=None,
                   help=f"receivers per room (default: {d['receivers']})")
    p.add_argument("--faults", type=count_at_least(0), default=None,
                   help=f"transport faults the model may inject (default: {d['faults']})")
    p.add_argument("--variant", default=None, choices=sorted(VARIANTS),
                   help=f"whose rules to explore (default: {d['variant']})")
    p.add_argument("--peers", action="store_true",
                   help="model the peer machine too (one peer per receiver rank; grows the state space)")
    p.add_argument("--channels", action="store_true",
                   help="notices travel in a FIFO per receiver and withdraws the other way, so they may cross "
                        "(grows the state space)")
    p.add_argument("--late-landing", action="store_true",
                   help="a failed write may land after its quarantine ended: shows the hazard the quarantine's "
                        "bound guards against (finds violations by design)")
    p.add_argument("--restarts", type=count_at_least(0), default=0,
                   metavar="N",  # pragma: no mutate (presentation: the help's placeholder)
                   help="the encoder may restart up to N times (a new incarnation): its side is lost, the "
                        "receivers fail the rooms of the dead one and take every region back (default: 0)")
    p.add_argument("--identities", type=count_at_least(1), default=1,
                   metavar="K",  # pragma: no mutate (presentation: the help's placeholder)
                   help="the rooms are split among K identities; each identity's rooms hold at most 1/K of the "
                        "arena and its deferred sends wait in a FIFO of their own, served round-robin; checks that "
                        "an identity within its share is served whatever another does (default: 1, no shares)")
    p.add_argument("--pieces", type=count_at_least(1), default=1,
                   metavar="P",  # pragma: no mutate (presentation: the help's placeholder)
                   help="an item no run of free cells holds may span up to P runs (the executor's max_pieces; "
                        "default: 1, no spanning)")
    p.add_argument("--no-symmetry", action="store_true",
                   help="explore without symmetry reduction")
    p.add_argument("--compare-symmetry", action="store_true",
                   help="run with and without symmetry reduction")
    p.add_argument("--save-traces",
                   metavar="DIR",  # pragma: no mutate (presentation: the help's placeholder)
                   help="write each violation's trace as JSON")
    p.add_argument("--replay",
                   metavar="FILE",  # pragma: no mutate (presentation: the help's placeholder)
                   help="replay a saved trace instead of exploring (its configuration comes from the file)")
    p.add_argument("--engine", choices=["explorer", "spin"], default="explorer",
                   help="the Python explorer, or SPIN on Promela generated from the same declarations and rules")
    p.add_argument("--spin-opt", default=None,
                   help="spin only: gcc optimisation for pan (default -O0 below 100k "
                        "states' worth of bound, else -O2: compiling at -O2 takes ~30 s)")
    p.add_argument("--spin-collapse", action="store_true",
                   help="spin only: pan -DCOLLAPSE, lossless state compression")
    p.add_argument("--spin-hash", type=count_at_least(1), default=None,
                   help="spin only: pan -w, log2 of the hash table size")
    p.add_argument("--spin-memlim", type=count_at_least(1), default=None,
                   help="spin only: pan -DMEMLIM, in MB (default: 8192)")
    p.add_argument("--spin-keep",
                   metavar="DIR",  # pragma: no mutate (presentation: the help's placeholder)
                   help="spin only: keep the Promela model, pan.c and trails in DIR")
    p.add_argument("--spin-no-regions", action="store_true",
                   help="spin only: the encode side alone, without "
                        "the receivers' regions (Config(regions=False)), for bigger bounds")


SPIN_FLAGS = ("spin_opt", "spin_collapse", "spin_hash", "spin_memlim", "spin_keep", "spin_no_regions")


def apply_defaults(args) -> None:
    """Fill the model's size flags left unset, and refuse flags the chosen engine would ignore."""
    if getattr(args, "slots", None) is not None:
        raise CheckInputError("--slots is gone: the model's ring is an arena of --cells, carved into extents of "
                              "the --sizes items have (a slot per item is --sizes 1)")
    engine = getattr(args, "engine", "explorer")
    if engine == "spin":
        given = [f"--{k.replace('_', '-')}" for k in ("replay", "no_symmetry", "compare_symmetry", "restarts")
                 if getattr(args, k, None)]
        if given:
            raise CheckInputError(f"{', '.join(given)} apply to the explorer, not --engine spin")
        if getattr(args, "spin_memlim", None) is None:
            args.spin_memlim = 8192
    else:
        given = [f"--{k.replace('_', '-')}" for k in SPIN_FLAGS if getattr(args, k, None)]
        if given:
            raise CheckInputError(f"{', '.join(given)} apply only to --engine spin")
    if getattr(args, "replay", None):
        return
    for key, value in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def _load_trace(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CheckInputError(f"--replay: cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckInputError(f"--replay: {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict) or not isinstance(
            data.get("events"), list):
        raise CheckInputError(f"--replay: {path} is not a saved trace (needs a 'config' object and an "
                              f"'events' list)")
    try:
        Config(**data["config"])
    except (TypeError, ValueError) as exc:
        raise CheckInputError(f"--replay: {path} has a bad config: {exc}") from None
    return data


def _run_replay(args, out, report: dict) -> int:
    given = [f"--{k.replace('_', '-')}" for k in DEFAULTS if getattr(args, k, None) is not None]
    given += [f for f, on in (("--no-symmetry", args.no_symmetry), ("--compare-symmetry", args.compare_symmetry),
                              ("--save-traces", args.save_traces), ("--channels", getattr(args, "channels", False)),
                              ("--late-landing", getattr(args, "late_landing", False)),
                              ("--restarts", getattr(args, "restarts", 0)),
                              ("--identities", getattr(args, "identities", 1) != 1),
                              ("--pieces", getattr(args, "pieces", 1) != 1)) if on]
    if given:
        raise CheckInputError(f"--replay takes its configuration from the trace file; {', '.join(given)} "
                              f"cannot be combined with it")
    data = _load_trace(args.replay)
    spec = Spec(Config(**data["config"]))
    try:
        steps, problem = replay(data)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise CheckInputError(f"--replay: {args.replay}: {exc}") from None
    report.update(replay=args.replay, config=data["config"], steps=len(steps) - 1,
                  violation={"kind": problem[0], "detail": problem[1]} if problem else None)
    for n, (event, state) in enumerate(steps):
        out(f"  {n:2d}. {event_name(event):<22} {spec.describe(state)}")  # pragma: no mutate (report wording)
    if problem:
        out(f"violation: {problem[0]}: {problem[1]}")  # pragma: no mutate (report wording)
        return 1
    out("no violation")  # pragma: no mutate (report wording)
    return 0


def run(args, out=print, report: dict | None = None, progress=None) -> int:
    """Explore (or replay); print through `out`; fill `report` with the figures (for --json).

    `progress(label)` makes a display with `update(states, **fields)` and `close()` (the CLI's).
    """
    report = {} if report is None else report
    if args.replay:
        apply_defaults(args)
        return _run_replay(args, out, report)
    apply_defaults(args)
    try:
        cfg = Config(args.cells, args.rooms, args.receivers, args.faults, args.variant,
                     peers=getattr(args, "peers", False), sizes=args.sizes,
                     channels=getattr(args, "channels", False), late_landing=getattr(args, "late_landing", False),
                     restarts=getattr(args, "restarts", 0), identities=getattr(args, "identities", 1),
                     pieces=getattr(args, "pieces", 1))
    except ValueError as exc:  # switches that do not go together: a usage error, not a crash
        raise CheckInputError(str(exc)) from None
    if getattr(args, "engine", "explorer") == "spin":
        raise SystemExit("--engine spin starts processes: run it as `epd-ring check --engine spin`")
    report.update(config={**{k: getattr(cfg, k) for k in DEFAULTS}, "peers": cfg.peers, "channels": cfg.channels,
                          "late_landing": cfg.late_landing, **({"restarts": cfg.restarts} if cfg.restarts else {}),
                          **({"identities": cfg.identities} if cfg.identities > 1 else {}),
                          **({"pieces": cfg.pieces} if cfg.pieces > 1 else {})},
                  runs=[])
    runs = [True, False] if args.compare_symmetry else [not args.no_symmetry]
    status = 0
    for symmetry in runs:
        label = "with" if symmetry else "without"  # pragma: no mutate (report wording)
        # pragma: no mutate start (report wording)
        out(f"checking {cfg.variant}: {cfg.cells} cells, items of {'/'.join(map(str, cfg.sizes))} cells, "
            f"{cfg.rooms} rooms, {cfg.receivers} receivers per room, "
            f"{cfg.faults} fault(s), {'peers, ' if cfg.peers else ''}{'notice channels, ' if cfg.channels else ''}"
            f"{'late landings, ' if cfg.late_landing else ''}"
            f"{f'{cfg.restarts} encoder restart(s), ' if cfg.restarts else ''}"
            f"{f'{cfg.identities} identities, ' if cfg.identities > 1 else ''}"
            f"{f'items spanning up to {cfg.pieces} runs, ' if cfg.pieces > 1 else ''}{label} symmetry reduction")
        # pragma: no mutate end

        bar = progress(f"exploring ({label} symmetry)") if progress else _NoProgress()

        def on_states(states, seconds, depth, bar=bar):
            bar.update(states, states_per_s=f"{states / seconds:,.0f}", depth=depth)

        try:
            r = explore(cfg, symmetry=symmetry, progress=on_states)
        finally:
            bar.close()
        report["runs"].append({"symmetry": symmetry, "states": r.states, "transitions": r.transitions,
                               "depth": r.depth, "finals": r.finals, "seconds": r.seconds,
                               "represented": r.represented if symmetry else r.states,
                               "violations": sorted(r.violations)})
        out(f"  {r.states:,} states, {r.transitions:,} transitions, depth {r.depth}, {r.finals:,} quiescent "
            f"end states, {r.seconds:.2f} s, {r.states_per_s:,.0f} states/s")
        if symmetry:
            out(f"  they stand for {r.represented:,} states without symmetry reduction: "
                f"{r.represented_per_s:,.0f} states/s of the unreduced space")
        fair = liveness.assumptions(cfg.variant)
        # pragma: no mutate start (report wording)
        out(f"  liveness under {', '.join(fair)} (docs/formal-model.md): {r.fair_ends:,} states where no assumed-fair "
            f"event is enabled, each judged: every room that began concluded, every region released or written, "
            f"every concluded room's sender reaped")
        # pragma: no mutate end
        report["runs"][-1].update(fairness=list(fair), fair_ends=r.fair_ends)
        if liveness.checks_shares(cfg):
            # pragma: no mutate start (report wording)
            out(f"  fair shares: in every state each of the {cfg.identities} identities with a room not concluded has "
                f"an event of its own or of the encode loop assumed fair (liveness.starved: nothing assumed of the "
                f"other identities)")
            # pragma: no mutate end
        if not r.violations:
            # pragma: no mutate start (report wording)
            out("  no violation: every invariant holds in every reachable state, no deadlock, "
                "a quiescent state is reachable from every state, and every fair behaviour concludes every "
                "room, releases every region and reaps every concluded room's sender")
            # pragma: no mutate end
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
                out(f"  saved {name}")  # pragma: no mutate (report wording)
    report["violation"] = bool(status)
    return status


class _NoProgress:
    def update(self, *args, **fields) -> None:
        pass

    def close(self) -> None:
        pass


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--quiet", action="store_true")
    sys.exit(run(parser.parse_args()))
