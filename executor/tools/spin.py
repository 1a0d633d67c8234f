"""Run SPIN on the Promela that `epd_ring.models.promela` generates: spin -a, gcc, pan, spin -t.

Lives with the tools because it starts processes; everything it decides (the model,
reading trails, replaying them on the spec) is in `models/promela.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from epd_ring.models import liveness
from epd_ring.models.explore import Violation, event_name, format_trace, trace_to_json
from epd_ring.models.promela import KINDS, SpinResult, generate, pan_figure, parse_trail, rebuild
from epd_ring.models.spec import HAZARDS, PEER_VARIANTS, Config, Spec


def available() -> bool:
    return shutil.which("spin") is not None and shutil.which("gcc") is not None


def _run(cmd: list[str], cwd: Path, timeout: float | None) -> str:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if p.returncode not in (0, 1) or "error" in p.stderr.lower():
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr or p.stdout[-2000:]}")
    return p.stdout


def _parse(work: Path, timeout: float | None) -> None:
    """`spin -a`: pan.c from the model. SPIN reports a model it cannot parse on stdout ("spin:
    model.pml:681, Error: syntax error"), exits 0 and writes a pan.c all the same, which compiles
    and verifies what it did parse: that is an error here, not a verdict."""
    out = _run(["spin", "-a", "model.pml"], work, timeout)
    if re.search(r"^spin: .*\bError:", out, re.M):
        raise RuntimeError(f"spin -a model.pml: the generated model does not parse: {out[-2000:]}")


def check(cfg: Config, *, opt: str = "-O0", collapse: bool = False, hash_bits: int = 24, memlim_mb: int = 8192,
          depth: int = 200_000, drop_guard: tuple[str, str, str] | None = None, keep: str | None = None,
          timeout: float | None = None, progress=None, replay_on_spec: bool = True) -> SpinResult:
    """Verify `cfg` with SPIN, exhaustively; one run per kind of violation found, plus the clean run.

    Each trail is followed on the Python spec (raising Disagreement where SPIN steps off it) unless
    `replay_on_spec` is False; then the trace is SPIN's own, in canonical states.
    """
    if not available():
        raise RuntimeError("spin and gcc are needed: apt-get install -y spin gcc")
    spec = Spec(cfg)
    # pan: safety only; one process, so no partial-order reduction to do. The search stays exhaustive:
    # no hash compaction, no bitstate; COLLAPSE (optional) compresses states losslessly.
    flags = [opt, "-DSAFETY", "-DNOREDUCE", f"-DMEMLIM={memlim_mb}", "-DVECTORSZ=4096"]
    if collapse:
        flags.append("-DCOLLAPSE")
    result = SpinResult(cfg, options=" ".join(flags[1:]) + f" -w{hash_bits} -m{depth}")
    t0 = time.perf_counter()
    cpu0 = _children_cpu()
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="epd-spin-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        while True:
            asserted = frozenset(KINDS) - set(result.violations)
            text = generate(cfg, asserted, drop_guard)
            pan_args = [f"-m{depth}", f"-w{hash_bits}", "-c1"]
            cached = _cache_read(text, flags, pan_args)
            if cached is None:
                (work / "model.pml").write_text(text)
                _parse(work, timeout)
                _run([_compiler(), *flags, "-o", "pan", "pan.c"], work, timeout)
                before = _children_cpu()
                out = _run(["./pan", *pan_args], work, timeout)
                result.search_cpu += _children_cpu() - before
                replay = _run(["spin", "-t", "model.pml"], work, timeout) if pan_figure(r"errors: (\d+)", out) else ""
                _cache_write(text, flags, pan_args, out, replay)
            else:
                out, replay = cached
            result.runs += 1
            if "max search depth too small" in out:
                raise RuntimeError(f"pan: raise the depth bound (-m{depth})")
            if "out of memory" in out or "MEMLIM" in out:
                raise RuntimeError(f"pan ran out of memory at {memlim_mb} MB: {out[-500:]}")
            result.seconds += pan_figure(r"elapsed time ([\d.e+]+)", out, float, 0.0)
            errors = pan_figure(r"errors: (\d+)", out)
            if progress:
                progress(out)
            if not errors:
                result.states = pan_figure(r"([\d.e+]+) states, stored", out)
                result.transitions = pan_figure(r"([\d.e+]+) transitions", out)
                result.depth = pan_figure(r"depth reached (\d+)", out)
                result.memory_mb = pan_figure(r"([\d.]+)\s+total actual memory usage", out, float, 0.0)
                break
            steps, kind = parse_trail(replay)
            if kind is None:
                raise RuntimeError(f"pan reported an error SPIN's replay does not name:\n{out[-1500:]}")
            result.raw[kind] = steps
            if replay_on_spec:
                trace = rebuild(spec, steps, kind)
            else:
                trace = [(("init",), spec.initial())] + [((ev, arg), st) for ev, arg, st in steps]
            result.violations[kind] = Violation(kind, "on " + event_name(trace[-1][0]), trace,
                                                HAZARDS.get((cfg.variant, kind)))
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    result.wall = time.perf_counter() - t0
    result.cpu = _children_cpu() - cpu0
    return result


def _compiler() -> str:
    """gcc, or the C compiler EPD_RING_SPIN_CC names: the mutation runs use tcc, which builds pan in
    a tenth of a second against gcc's seconds (pan's search is the same; only its speed differs)."""
    return os.environ.get("EPD_RING_SPIN_CC") or "gcc"


def _cache_path(text: str, flags: list[str], pan_args: list[str]) -> Path | None:
    """Where SPIN's verdict on exactly this Promela text, these gcc flags and pan options is kept,
    when EPD_RING_SPIN_CACHE names a folder (the mutation runs: most mutants of the generator leave
    its text as it was, and compiling pan is seconds); None otherwise. Only SPIN's raw output is
    kept: reading it (figures, trails, the replay on the spec) still runs every time."""
    folder = os.environ.get("EPD_RING_SPIN_CACHE")
    if not folder:
        return None
    key = hashlib.sha256("\0".join([text, *flags, *pan_args]).encode()).hexdigest()
    return Path(folder) / f"{key}.json"


def _cache_read(text: str, flags: list[str], pan_args: list[str]) -> tuple[str, str] | None:
    path = _cache_path(text, flags, pan_args)
    if path is None or not path.exists():
        return None
    data = json.loads(path.read_text())
    return data["pan"], data["replay"]


def _cache_write(text: str, flags: list[str], pan_args: list[str], out: str, replay: str) -> None:
    path = _cache_path(text, flags, pan_args)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole, then renamed: two workers may verify the same text at once
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pan": out, "replay": replay}))
    os.replace(tmp, path)


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run(args, out=print) -> int:
    """`epd-ring check --engine spin`: the same report as the explorer's, from SPIN."""
    peers = bool(getattr(args, "peers", False))
    if peers and args.variant in PEER_VARIANTS:
        out(f"--engine spin does not generate the peer variant {args.variant}; check it with the explorer")
        return 2
    # Both ends by default, as the explorer; --spin-no-regions checks the encode side alone (bigger bounds).
    regions = not getattr(args, "spin_no_regions", False)
    channels, late = bool(getattr(args, "channels", False)), bool(getattr(args, "late_landing", False))
    if (channels or late) and not regions:
        out("--channels and --late-landing model the receivers' regions: drop --spin-no-regions")
        return 2
    cfg = Config(args.cells, args.rooms, args.receivers, args.faults, args.variant, regions=regions, sizes=args.sizes,
                 peers=peers, channels=channels, late_landing=late, identities=getattr(args, "identities", 1),
                 pieces=getattr(args, "pieces", 1))
    if cfg.identities > 1 and not liveness.checks_shares(cfg):
        out("--engine spin generates identities for items of one cell (--sizes 1) and a cell per identity; "
            "check other bounds with the explorer")
        return 2
    big = cfg.cells * cfg.rooms * cfg.receivers * (cfg.faults + 1) > 48
    opt = args.spin_opt or ("-O2" if big else "-O0")
    hash_bits = args.spin_hash or (27 if big else 22)
    out(f"checking {cfg.variant} with SPIN: {cfg.cells} cells, items of {'/'.join(map(str, cfg.sizes))} cells, "
        f"{cfg.rooms} rooms, {cfg.receivers} receivers per room, {cfg.faults} fault(s); "
        + ("both ends (receivers' regions too)" if regions else "encode side only (no receivers' regions)")
        + (", notice channels" if channels else "") + (", late landings" if late else "")
        + (f", {cfg.identities} identities" if cfg.identities > 1 else "")
        + (f", items spanning up to {cfg.pieces} runs" if cfg.pieces > 1 else "")
        + "; exhaustive, "
        "symmetry reduced in the model"
        + (", states compressed losslessly (COLLAPSE)" if args.spin_collapse else ""))

    def progress(text):
        if not args.quiet:
            for line in text.splitlines():
                if re.search(r"errors:|states, stored|elapsed time|total actual memory", line):
                    out("  pan: " + line.strip().removeprefix("pan: "))

    r = check(cfg, opt=opt, collapse=args.spin_collapse, hash_bits=hash_bits, memlim_mb=args.spin_memlim,
              keep=args.spin_keep, progress=progress)
    out(f"  {r.states:,} states, {r.transitions:,} transitions, depth {r.depth}, pan {r.seconds:.2f} s "
        f"({r.states_per_s:,.0f} states/s; {r.search_cpu:.2f} s CPU), {r.runs} pan run(s), "
        f"{r.wall:.1f} s with spin -a and gcc ({r.cpu:.1f} s CPU), "
        f"{r.memory_mb:,.0f} MB; pan {r.options}")
    if not r.violations:
        out("  no violation: no assertion fails and no invalid end state in any reachable state, and every state "
            f"where no event assumed fair ({', '.join(liveness.assumptions(cfg.variant))}) is enabled has every room "
            "concluded, every region released and every concluded room's sender reaped"
            + (", and no identity with a room left waits on another identity (liveness.starved)"
               if liveness.checks_shares(cfg) else ""))
        return 0
    spec = Spec(cfg)
    for kind, v in sorted(r.violations.items()):
        out(format_trace(spec, v, heading="SPIN trail, replayed on the spec"))
        if args.save_traces:
            d = Path(args.save_traces)
            d.mkdir(parents=True, exist_ok=True)
            name = d / f"{cfg.variant}--{v.hazard or kind}.spin.json"
            name.write_text(trace_to_json(cfg, v))
            out(f"  saved {name}")
    return 1
