"""The `epd-ring` command line (also `python -m epd_ring`).

Exit codes:
  0   ok
  1   a finding: the model has a violation, a demo's checks failed, diagrams are stale
  2   usage or input error (a bad flag value, an unreadable or malformed trace file)
  3   environment: a missing program or optional extra (the message names the install command)
  70  internal error (a bug in epd-ring: rerun with -v for the traceback and report it)
  130 interrupted (Ctrl-C)
"""

from __future__ import annotations

# Only the standard library loads here: `--version` and `--help` answer without torch (seconds
# to import) or the model (the machines, and with them transitions), and every usage error is
# found before a command's module is loaded. `check` loads the model's flags when it is chosen.
import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

EXIT_OK, EXIT_FINDING, EXIT_USAGE, EXIT_ENV, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 70, 130
# bench_arena.MIXES' names, spelled here so `--help` does not import the bench (a test keeps them equal)
ARENA_MIXES = ("realistic", "bimodal", "increasing", "long-lived", "failure-storm", "late-frame")
PROG = "epd-ring"

MOONCAKE_EXTRA = "pip install 'epd-ring[mooncake]' (and apt-get install libibverbs1)"
METRICS_EXTRA = "pip install 'epd-ring[metrics]'"
# Optional module -> how to get it; a missing one is an environment problem, not a crash.
EXTRAS = {"zmq": MOONCAKE_EXTRA, "mooncake": MOONCAKE_EXTRA, "prometheus_client": METRICS_EXTRA,
          "transformers": "pip install 'epd-ring[qwen]'", "PIL": "pip install 'epd-ring[qwen]'",
          "vllm": "pip install --no-deps vllm==0.33.0 && pip install 'epd-ring[vllm]' (docs/vllm.md)"}


class UsageError(Exception):
    """Bad input from the user: exit 2."""


class EnvironmentProblem(Exception):
    """Something missing from the machine: exit 3."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("epd-ring")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


# argument types: each refuses a bad value with a one-line reason -------------
def _int_at_least(low: int) -> Callable[[str], int]:
    # as epd_ring.models.check.count_at_least, which `check`'s flags use; not imported from there,
    # since that would load the model for every command
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def byte_size(text: str) -> int:
    """A ring's bytes such as 2GiB, 512MiB or 1048576, refused below 1 MiB (no embedding fits in less)."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 512MiB or a number of bytes, got {text!r}")
    value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value < _UNITS["mib"]:
        raise argparse.ArgumentTypeError(f"must be at least 1MiB, got {text!r}")
    return value


def port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line (and exit 2, as argparse does).

    `later`: adds the rest of this parser's arguments when it is first used (to parse or to show
    its help), so a command whose flags come from a heavy module loads it only when chosen."""

    def __init__(self, *args: Any, later: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._later = later

    def _complete(self) -> None:
        if self._later is not None:
            later, self._later = self._later, None
            later(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._complete()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._complete()
        return super().format_help()

    def format_usage(self) -> str:
        self._complete()
        return super().format_usage()

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _OldName(argparse.Action):
    """A flag's old name, kept for one release: it sets the new flag's value and says on stderr
    which name to use (the deprecated names are listed in docs/glossary.md)."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated and goes in the next release; use {self.new}",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help with each flag's default, unless it has none worth naming (off, unset, or already said)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def _common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # Accepted before or after the sub-command; SUPPRESS keeps a sub-command's
    # unset flag from overwriting one given before it.
    d = {} if top else {"default": argparse.SUPPRESS}
    g = parser.add_argument_group("output")
    g.add_argument("-v", "--verbose", action="count", help="more log output (-vv: debug); tracebacks on errors",
                   **({"default": 0} if top else d))
    g.add_argument("-q", "--quiet", action="store_true", help="no progress, only the result and errors",
                   **({"default": False} if top else d))
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error", "critical"], type=str.lower,
                   help="log level of the epd_ring loggers (default: warning; critical for demo, whose "
                        "injected faults log errors by design)", **({"default": None} if top else d))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"{PROG} {version()}")
    _common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(name: str, help: str, description: str | None = None, **later: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=description or help, formatter_class=_Help, **later)
        _common(p, top=False)
        return p

    demo = command("demo", "run the controller with a real tower under ring pressure and injected faults",
                   "Run the controller on the loopback transport (or Mooncake across processes) with a real "
                   "tiny torch tower, inject faults, and check every delivered byte and every room's outcome. "
                   "Exit 1 if any check fails.")
    demo.add_argument("--rooms", type=positive_int, default=None,
                      help="rooms to run (default: 2000 on loopback, 300 on mooncake)")
    demo.add_argument("--extents", type=positive_int, default=6, help="ring extents")
    demo.add_argument("--slots", dest="extents", type=positive_int, action=_OldName, new="--extents")  # deprecated
    demo.add_argument("--batch", type=positive_int, default=None, help="images per tower batch (default: 8)")
    demo.add_argument("--fault-rate", type=probability, default=None,
                      help="share of rooms that get an injected fault, 0 to 1 (default: 0.25)")
    demo.add_argument("--no-deepstack", action="store_true", help="a tower without deepstack layers")
    demo.add_argument("--seed", type=int, default=0, help="seed of the room plan and the tower weights")
    demo.add_argument("--transport", choices=["loopback", "mooncake"], default="loopback",
                      help="loopback (in-process, simulated clock) or mooncake (TCP on 127.0.0.1, 3 receiver "
                           "processes)")
    demo.add_argument("--json", action="store_true", help="print the report as one JSON object")
    demo.add_argument("--model", choices=["tiny-tower", "qwen3-vl-tiny"], default="tiny-tower",
                      help="qwen3-vl-tiny: a real Qwen3-VL split at the tower (needs the `qwen` extra)")
    demo.add_argument("--requests", type=positive_int, default=None,
                      help="qwen3-vl-tiny only: prefill requests (default: 16)")
    demo.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                      help="qwen3-vl-tiny only (default: float32)")
    demo.add_argument("--metrics-port", type=port, default=None,
                      help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics during the run (0: any free "
                           "port, printed on stderr; needs the metrics extra)")
    demo.add_argument("--timeline", metavar="FILE", default=None,
                      help="draw extent occupancy over time, coloured by extent state, with failures and quarantines "
                           "marked, into this SVG file")

    bench = command("bench", "per-item cost of the controller cycle (loopback) or throughput (mooncake)")
    bench.add_argument("--items", type=positive_int, default=None,
                       help="items per measurement (default: 10000 on loopback; on mooncake about 2 s of "
                            "writes per size)")
    bench.add_argument("--sizes", type=positive_int, nargs="+", default=None,
                       help="ring sizes in extents (loopback; default 64 1024 4096) or embedding sizes in MiB "
                            "(mooncake; default 1 16)")
    bench.add_argument("--transport", choices=["loopback", "mooncake", "nixl"], default="loopback",
                       help="what to measure (nixl: the controller over NIXL beside raw NIXL and the controller "
                            "over Mooncake, item sizes in KiB with --sizes, default 1 KiB to 64 MiB)")
    bench.add_argument("--model", choices=["tiny-tower", "qwen3-vl-tiny"], default="tiny-tower",
                       help="qwen3-vl-tiny: requests/s of the split model's loop beside the unsplit model")
    bench.add_argument("--requests", type=positive_int, default=None, help="qwen3-vl-tiny only: requests (default: 24)")
    bench.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                       help="qwen3-vl-tiny only (default: float32)")
    bench.add_argument("--seed", metavar="PATH", default=None,
                       help="also run the seed's executor from this file on the same cycle (loopback only)")
    bench.add_argument("--against", metavar="PYTHON", default=None,
                       help="another checkout's Python (its .venv/bin/python): run both trees' cycles at once in "
                            "interleaved blocks and print their ratio (loopback, one ring size)")
    bench.add_argument("--blocks", type=positive_int, default=None,
                       help="--against only: rounds of one block per tree (default: 60)")
    bench.add_argument("--startup", action="store_true",
                       help="instead: how long `epd-ring --version` and `--help` take, each in fresh processes")
    bench.add_argument("--runs", type=positive_int, default=None,
                       help="--startup only: processes per command (default: 5)")
    bench.add_argument("--json", action="store_true", help="print the figures as one JSON object")

    arena = command("bench-arena", "ring bytes each allocation policy needs for one seeded trace of images and videos",
                    "Simulate one seeded trace of Qwen3-VL-sized embeddings (images and videos, parks, writes, "
                    "failed writes held in quarantine) through four allocation policies on one ring: the seed's "
                    "fixed extents, vLLM's next-fit transfer buffer (it skips an item that does not fit), the buddy "
                    "pool of vLLM's older connector, and our arena. Print the ring bytes each needs to carry the "
                    "trace with nothing deferred or skipped (the binary search's answer, and the robust size from "
                    "which every larger size tried carries), the items not placed at a few budgets, and the "
                    "trace's distributions; with --mixes, every policy on each mix.")
    arena.add_argument("--items", type=positive_int, default=12000, help="items in the trace")
    arena.add_argument("--seed", type=int, default=0, help="seed of the trace")
    arena.add_argument("--seeds", type=positive_int, default=1,
                       help="also find the bytes ours needs on the traces of the next seeds, and judge the goal "
                            "on all of them")
    arena.add_argument("--budget", type=byte_size, default="2GiB", help="the ring bytes the headline deferral "
                                                                        "rate is measured at")
    arena.add_argument("--budgets", type=byte_size, nargs="+", default=None,
                       help="ring bytes of the deferral table (default: 512MiB 1GiB 2GiB 4GiB; --budget is added)")
    arena.add_argument("--ring", choices=["main", "deepstack"], default="main",
                       help="which ring: deepstack items are 3x the main bytes")
    arena.add_argument("--rate", type=positive_float, default=100.0, help="Poisson arrivals, items per second")
    arena.add_argument("--fail-rate", type=probability, default=0.005, help="share of writes that fail")
    arena.add_argument("--quarantine", type=positive_float, default=30.0,
                       help="seconds a failed write's extent is held (the core's quarantine_s)")
    arena.add_argument("--mix", choices=list(ARENA_MIXES), default="realistic", help="the trace's mix")
    arena.add_argument("--mixes", choices=list(ARENA_MIXES), nargs="*", default=None,
                       help="also every policy on each of these mixes' traces (no names: all of them)")
    arena.add_argument("--no-spanning", dest="spanning", action="store_false",
                       help="judge ours with one run per item, as a ring with max_pieces=1 (default: ours with an "
                            "item spanning up to 4 pieces when no free run holds it, as the core does, beside it)")
    arena.add_argument("--spanning", action="store_true", default=True,
                       help=argparse.SUPPRESS)  # the default now; taken so that scripts written before still run
    arena.add_argument("--scan-to", type=positive_float, default=1.5,
                       help="the robust scan tries sizes up to this many times the search's answer")
    arena.add_argument("--scan-step", type=probability, default=0.01,
                       help="the robust scan's step, as a share of the search's answer")
    arena.add_argument("--json", action="store_true", help="print the figures as one JSON object")

    fair = command("bench-fairness", "what one identity's stuck, failing, parking or slow receivers cost others",
                   "Replay the cases of issue 30 on the loopback with a fake clock: a victim identity and an "
                   "attacker sharing one encode worker, each case with and without the attacker on the same "
                   "arrivals. Print the victim's failed-room share, its p50/p99 wait from arrival (against the "
                   "attacker-free p99) and the peak arena use.")
    fair.add_argument("--cases", nargs="+", choices=["stuck", "timeout", "fail", "sessions", "parked", "parked+held",
                                                     "slow"], default=None, help="which cases (default: all)")
    fair.add_argument("--seconds", type=positive_float, default=30.0, help="seconds of arrivals (simulated)")
    fair.add_argument("--items", type=positive_int, default=64, help="items the arena holds")
    fair.add_argument("--rate", type=positive_float, default=20.0, help="the victim's rooms per second (the "
                                                                       "attacker sends half that)")
    fair.add_argument("--seed", type=int, default=0, help="seed of the arrivals")
    fair.add_argument("--json", action="store_true", help="print the figures as one JSON object")

    bvllm = command("bench-vllm", "epd-ring's vLLM EC connector beside vLLM's ECMooncakeConnector, two engines",
                    "Two vLLM engines (producer here, consumer in a child process; vLLM's real scheduler and "
                    "worker connectors, the model's forward left out) over Mooncake on 127.0.0.1, once per "
                    "connector: items/s and MB/s for a batch of one-image requests, and with the consumer "
                    "stopped, the seconds until the producer's engine stops waiting and its longest step.")
    bvllm.add_argument("--items", type=positive_int, default=200, help="requests of one image each")
    bvllm.add_argument("--rows", type=positive_int, default=64, help="rows (embeddings) per image")
    bvllm.add_argument("--hidden", type=positive_int, default=1024, help="the tiny model's width: float32 per row")
    bvllm.add_argument("--connectors", nargs="+", choices=["epd-ring", "ECMooncakeConnector"], default=None,
                       help="which (default: both)")
    bvllm.add_argument("--every-step", action="store_true",
                       help="enter the consumer's connector on every step, also those vLLM's runner skips "
                            "(nothing scheduled): vLLM's own connector needs it here")
    bvllm.add_argument("--json", action="store_true", help="print the figures as one JSON object")

    diagrams = command("diagrams", "render the state diagrams into a folder (needs graphviz's dot)")
    diagrams.add_argument("--check", action="store_true", help="exit 1 naming stale files instead of writing")
    diagrams.add_argument("--dir", default="diagrams",
                          help="the folder, from the repository root (the docs site shows them from there)")

    command("check", "explore the formal model exhaustively (exit 1 on a violation), or replay a trace",
            later=_check_arguments)
    return parser


def _check_arguments(check: argparse.ArgumentParser) -> None:
    from epd_ring.models.check import add_arguments  # the model: loaded only once `check` is chosen

    add_arguments(check)
    check.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _log_level(args: argparse.Namespace) -> int:
    if args.log_level:
        return getattr(logging, args.log_level.upper())
    if args.verbose >= 2:
        return logging.DEBUG
    if args.verbose == 1:
        return logging.INFO
    if args.quiet or args.command == "demo":
        # Injected faults log errors by design; the demo reports them in its summary.
        return logging.CRITICAL if args.command == "demo" else logging.ERROR
    return logging.WARNING


def _missing_extra(exc: ImportError) -> str | None:
    name = (getattr(exc, "name", None) or "").split(".")[0]
    return EXTRAS.get(name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose = getattr(args, "verbose", 0) or 0
    logging.basicConfig(level=_log_level(args), format="%(levelname)s %(name)s: %(message)s", force=True)
    try:
        return _dispatch(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except EnvironmentProblem as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_ENV
    except ImportError as exc:
        hint = _missing_extra(exc)
        if hint is None:
            return _internal(exc, args)
        print(f"{PROG}: error: {exc}; install it with: {hint}", file=sys.stderr)
        return EXIT_ENV
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `epd-ring ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:
        if type(exc).__name__ == "ExecutableNotFound":  # graphviz without `dot`
            print(f"{PROG}: error: graphviz's `dot` is not on PATH; install it with: apt-get install graphviz",
                  file=sys.stderr)
            return EXIT_ENV
        from epd_ring.executor.core.transport import TransportError

        if isinstance(exc, TransportError):
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return EXIT_ENV
        return _internal(exc, args)


def _internal(exc: BaseException, args: argparse.Namespace) -> int:
    if args.verbose:
        import traceback

        traceback.print_exception(exc)
    print(f"{PROG}: internal error: {type(exc).__name__}: {exc} (rerun with -v for the traceback)",
          file=sys.stderr)
    return EXIT_INTERNAL


def _emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=None, sort_keys=True, default=str))


def _dispatch(args: argparse.Namespace) -> int:
    quiet = args.quiet
    if args.command == "demo":
        from .shutdown import DrainOnSignal

        if args.timeline is not None:
            _writable(args.timeline, "--timeline")
        if args.metrics_port is not None:
            import importlib.util

            if importlib.util.find_spec("prometheus_client") is None:
                raise EnvironmentProblem(f"--metrics-port needs prometheus_client; install it with: {METRICS_EXTRA}")

        tiny_only = {"--rooms": args.rooms, "--batch": args.batch, "--fault-rate": args.fault_rate,
                     "--no-deepstack": args.no_deepstack or None, "--json": args.json or None,
                     "--metrics-port": args.metrics_port, "--timeline": args.timeline}
        qwen_only = {"--requests": args.requests, "--dtype": args.dtype}
        if args.model == "qwen3-vl-tiny":
            given = [flag for flag, v in tiny_only.items() if v is not None]
            if given:
                raise UsageError(f"{', '.join(given)} apply to the tiny-tower demo, not --model qwen3-vl-tiny")
            from . import demo_qwen

            run_qwen = demo_qwen.run_mooncake if args.transport == "mooncake" else demo_qwen.run_loopback
            return run_qwen(requests=args.requests or 16, dtype=args.dtype or "float32", seed=args.seed,
                            extents=args.extents, quiet=quiet)
        given = [flag for flag, v in qwen_only.items() if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} apply only to --model qwen3-vl-tiny")
        common = dict(extents=args.extents, batch=args.batch or 8,
                      fault_rate=0.25 if args.fault_rate is None else args.fault_rate,
                      deepstack=not args.no_deepstack,
                      seed=args.seed, quiet=quiet, json_out=args.json, metrics_port=args.metrics_port,
                      timeline=args.timeline)
        if args.transport == "mooncake":
            for module in ("zmq", "mooncake"):
                import importlib.util

                if importlib.util.find_spec(module) is None:
                    raise EnvironmentProblem(f"--transport mooncake needs {module}; install it with: {MOONCAKE_EXTRA}")
            from .demo_mooncake import run as mc_demo
            from .enginelog import engine_log_filtered

            with engine_log_filtered(quiet), DrainOnSignal() as stop:
                return mc_demo(rooms=args.rooms or 300, stop=stop, **common)
        from .demo import run
        with DrainOnSignal() as stop:
            return run(rooms=args.rooms or 2000, stop=stop, **common)
    if args.command == "bench" and args.startup:
        given = [f for f, v in (("--items", args.items), ("--sizes", args.sizes), ("--seed", args.seed),
                                ("--against", args.against), ("--blocks", args.blocks),
                                ("--requests", args.requests), ("--dtype", args.dtype)) if v is not None]
        given += [f"--{name} {getattr(args, name)}" for name, default in (("transport", "loopback"),
                                                                           ("model", "tiny-tower"))
                  if getattr(args, name) != default]
        if given:
            raise UsageError(f"{', '.join(given)} apply to the controller bench, not --startup")
        from .bench_startup import run as startup_run

        figures = startup_run(runs=args.runs or 5, echo=_silent if args.json else print)
        if args.json:
            _emit_json({"startup": figures})
        return EXIT_OK
    if args.command == "bench" and args.runs is not None:
        raise UsageError("--runs applies only to --startup")
    if args.command == "bench" and args.model == "qwen3-vl-tiny":
        given = [f for f, v in (("--items", args.items), ("--sizes", args.sizes), ("--seed", args.seed),
                                ("--json", args.json or None)) if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} apply to the controller bench, not --model qwen3-vl-tiny")
        from .bench_qwen import run as qwen_bench
        qwen_bench(requests=args.requests or 24, dtype=args.dtype or "float32", transports=(args.transport,))
        return EXIT_OK
    if args.command == "bench":
        given = [f for f, v in (("--requests", args.requests), ("--dtype", args.dtype)) if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} apply only to --model qwen3-vl-tiny")
        if args.transport == "nixl":
            import importlib.util

            if importlib.util.find_spec("nixl_cu12") is None:
                raise EnvironmentProblem("--transport nixl needs nixl_cu12; install it with: pip install "
                                         "'epd-ring[nixl]'")
            if args.seed is not None or args.against is not None:
                raise UsageError("--seed and --against apply to the loopback cycle, not --transport nixl")
            from .bench_nixl import SIZES, run as nixl_run
            from .enginelog import engine_log_filtered

            with engine_log_filtered(quiet):
                got = nixl_run(sizes=tuple(s << 10 for s in args.sizes) if args.sizes else SIZES, items=args.items,
                               mooncake=importlib.util.find_spec("mooncake") is not None,
                               echo=_silent if args.json else print)
            if args.json:
                _emit_json({"transport": "nixl", "sizes_kib": {str(k >> 10): {p: {"mb_s": m, "items_s": i}
                                                                              for p, (m, i) in v.items()}
                                                               for k, v in got.items()}})
            return EXIT_OK
        if args.transport == "mooncake":
            if args.seed is not None:
                raise UsageError("--seed runs the seed's executor on the loopback cycle; it cannot be "
                                 "combined with --transport mooncake")
            if any(s > 1024 for s in args.sizes or ()):
                raise UsageError("--sizes on mooncake are MiB per embedding, at most 1024")
            from .bench_mooncake import run as mc_run
            from .enginelog import engine_log_filtered

            with engine_log_filtered(quiet):
                out = mc_run(sizes=tuple(s << 20 for s in (args.sizes or [1, 16])), items=args.items,
                             quiet=quiet or args.json, echo=_silent if args.json else print)
            if args.json:
                _emit_json({"transport": "mooncake", "sizes_mib": {str(k >> 20): {"ctrl_gb_s": c, "raw_gb_s": r}
                                                                   for k, (c, r) in out.items()}})
            return EXIT_OK
        if args.blocks is not None and args.against is None:
            raise UsageError("--blocks applies only to --against")
        if args.against is not None:
            if args.transport != "loopback" or args.seed is not None or len(args.sizes or [64]) != 1:
                raise UsageError("--against compares the loopback cycle at one ring size, without --seed")
            if not os.access(args.against, os.X_OK):
                raise UsageError(f"--against: not an executable Python: {args.against}")
            from .bench_ab import run as ab_run

            ab = ab_run(args.against, blocks=args.blocks or 60, items=args.items or 2000,
                        extents=(args.sizes or [64])[0], echo=_silent if args.json else print)
            if args.json:
                _emit_json({"transport": "loopback", "against": args.against, **ab})
            return EXIT_OK
        if args.seed is not None and not os.path.isfile(args.seed):
            raise UsageError(f"--seed: no such file: {args.seed}")
        from .bench import run as bench_run
        figures: dict[str, Any] = {}
        results = bench_run(items=args.items or 10000, sizes=tuple(args.sizes or [64, 1024, 4096]),
                            seed_path=args.seed, quiet=quiet or args.json, echo=_silent if args.json else print,
                            figures=figures)
        if args.json:
            _emit_json({"transport": "loopback", "items": args.items or 10000,
                        "us_per_item": {str(n): {"ours": us, "seed": seed} for n, (us, seed) in results.items()},
                        **figures})
        return EXIT_OK
    if args.command == "bench-arena":
        from .bench_arena import DEFAULT_BUDGETS, run as arena_run, spec_with

        spec = spec_with(items=args.items, seed=args.seed, ring=args.ring, rate=args.rate,
                         fail_share=args.fail_rate, quarantine_s=args.quarantine, mix=args.mix)
        mixes = () if args.mixes is None else tuple(args.mixes or ARENA_MIXES)
        try:
            report = arena_run(spec, budget=args.budget, budgets=args.budgets or DEFAULT_BUDGETS, seeds=args.seeds,
                               quiet=quiet or args.json, echo=_silent if args.json else print, mixes=mixes,
                               scan_to=args.scan_to, scan_step=args.scan_step, spanning=args.spanning)
        except ValueError as exc:
            print(f"epd-ring bench-arena: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if args.json:
            _emit_json(report)
        return EXIT_OK
    if args.command == "bench-vllm":
        from .bench_vllm import CONNECTORS, run as vllm_run

        out = vllm_run(items=args.items, rows=args.rows, hidden=args.hidden,
                       connectors=tuple(args.connectors or CONNECTORS), every_step=args.every_step,
                       echo=_silent if args.json else print)
        if args.json:
            _emit_json(out)
        return EXIT_OK
    if args.command == "bench-fairness":
        from .bench_fairness import CASES, run as fairness_run

        fairness_run(tuple(args.cases or CASES), as_json=args.json, seconds=args.seconds, items=args.items,
                     victim_rate=args.rate, seed=args.seed)
        return EXIT_OK
    if args.command == "check" and args.engine == "spin":
        from epd_ring.models.check import CheckInputError, apply_defaults

        from .spin import run as spin_run

        try:
            apply_defaults(args)
        except CheckInputError as exc:
            raise UsageError(str(exc)) from None
        if args.json:
            raise UsageError("--json applies to the explorer, not --engine spin")
        return spin_run(args)
    if args.command == "check":
        from epd_ring.models.check import CheckInputError, run as check_run

        report: dict = {}
        try:
            from .progress import Progress

            status = check_run(args, out=_silent if args.json else print, report=report,
                               progress=lambda label: Progress(label, None, unit="states",
                                                               enabled=not (quiet or args.json)))
        except CheckInputError as exc:
            raise UsageError(str(exc)) from None
        if args.json:
            _emit_json(report)
        return status
    if args.command == "diagrams":
        from epd_ring.executor.tools.diagrams import main as render_main
        return render_main(args.dir, check=args.check)
    raise AssertionError(f"unknown command {args.command!r}")  # argparse allows only the ones above


def _silent(*_: Any, **__: Any) -> None:
    pass


def _writable(path: str, flag: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag}: no such folder: {folder}")
    if os.path.isdir(path):
        raise UsageError(f"{flag}: {path} is a folder")


if __name__ == "__main__":
    sys.exit(main())
