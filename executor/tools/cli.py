"""The `epd-ring` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd-ring", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the controller on the loopback transport with a real tower")
    demo.add_argument("--rooms", type=int, default=2000)
    demo.add_argument("--slots", type=int, default=6)
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--fault-rate", type=float, default=0.25)
    demo.add_argument("--no-deepstack", action="store_true")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quiet", action="store_true")
    demo.add_argument("--transport", choices=["loopback", "mooncake"], default="loopback")
    demo.add_argument("--model", choices=["tiny-tower", "qwen3-vl-tiny"], default="tiny-tower",
                      help="qwen3-vl-tiny: a real Qwen3-VL split at the tower (needs the `qwen` extra)")
    demo.add_argument("--requests", type=int, default=16, help="qwen3-vl-tiny: prefill requests")
    demo.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="qwen3-vl-tiny only")

    bench = sub.add_parser("bench", help="per-item cost of the controller cycle at several ring sizes")
    bench.add_argument("--items", type=int, default=10000)
    bench.add_argument("--sizes", type=int, nargs="+", default=None,
                       help="ring sizes (loopback) or embedding sizes in MiB (mooncake)")
    bench.add_argument("--transport", choices=["loopback", "mooncake"], default="loopback")
    bench.add_argument("--model", choices=["tiny-tower", "qwen3-vl-tiny"], default="tiny-tower",
                       help="qwen3-vl-tiny: requests/s of the split model's loop beside the unsplit model")
    bench.add_argument("--requests", type=int, default=24, help="qwen3-vl-tiny: requests")
    bench.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="qwen3-vl-tiny only")
    bench.add_argument("--seed", metavar="PATH", default=None,
                       help="also run the seed's executor from this file on the same cycle (loopback only)")

    diagrams = sub.add_parser("diagrams", help="render the state diagrams into diagrams/")
    diagrams.add_argument("--check", action="store_true", help="exit 1 naming stale files instead of writing")
    diagrams.add_argument("--dir", default="diagrams")

    check = sub.add_parser("check", help="explore the formal model exhaustively (exit 1 on a violation)")
    from epd_ring.models.check import add_arguments
    add_arguments(check)

    args = parser.parse_args(argv)
    # Injected faults log errors by design; the demo reports them in its summary.
    level = logging.CRITICAL if args.command == "demo" else logging.ERROR
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo" and args.model == "qwen3-vl-tiny":
        from . import demo_qwen
        run_qwen = demo_qwen.run_mooncake if args.transport == "mooncake" else demo_qwen.run_loopback
        return run_qwen(requests=args.requests, dtype=args.dtype, seed=args.seed, slots=args.slots,
                        quiet=args.quiet)
    if args.command == "demo" and args.transport == "mooncake":
        from .demo_mooncake import run as mc_demo
        return mc_demo(rooms=min(args.rooms, 300) if args.rooms == 2000 else args.rooms, slots=args.slots,
                       batch=args.batch, deepstack=not args.no_deepstack, seed=args.seed, quiet=args.quiet)
    if args.command == "demo":
        from .demo import run
        return run(rooms=args.rooms, slots=args.slots, batch=args.batch, fault_rate=args.fault_rate,
                   deepstack=not args.no_deepstack, seed=args.seed, quiet=args.quiet)
    if args.command == "bench" and args.model == "qwen3-vl-tiny":
        from .bench_qwen import run as qwen_bench
        qwen_bench(requests=args.requests, dtype=args.dtype, transports=(args.transport,))
        return 0
    if args.command == "bench":
        if args.transport == "mooncake":
            from .bench_mooncake import run as mc_run
            mc_run(sizes=tuple(s << 20 for s in (args.sizes or [1, 16])))
            return 0
        from .bench import run as bench_run
        bench_run(items=args.items, sizes=tuple(args.sizes or [64, 1024, 4096]), seed_path=args.seed)
        return 0
    if args.command == "check" and args.engine == "spin":
        from .spin import run as spin_run
        return spin_run(args)
    if args.command == "check":
        from epd_ring.models.check import run as check_run
        return check_run(args)
    if args.command == "diagrams":
        from epd_ring.executor.tools.diagrams import main as render_main
        return render_main(args.dir, check=args.check)
    return 2


if __name__ == "__main__":
    sys.exit(main())
