"""Per-item cost of the controller's hot cycle, at several ring sizes.

The cycle, per item: register the request, a receiver frame arrives, `execute`
one 16 x 64 float32 image through a tower that returns a fixed tensor, the
pump's `flush` (the write goes out and lands at once), the pump's `tick` (its
outcome comes back; the room concludes), reap. The transport is the least one
that does this (`BenchTransport`, as the seed's stand-in sender); one figure is
also taken on the loopback transport the tests use. The arena holds
"extents" items of this size; all but 4 of them are held by rooms whose writes never
complete, so any scan over busy extents or senders shows up as a cost that grows
with the ring.

With `--seed PATH` the seed's executor runs the same cycle in the same process
(see `seed_bench`), so the two figures come from one run.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.clock import FakeClock
from ..core.executor import EncodeExecutor, EncodeItem
from ..core.frames import ReceiverFrame
from ..core.loopback import LoopbackTransport
from ..core.manager import EncodeManager
from ..core.pump import Pump
from ..core.transport import Buf, Outcome, Transport
from . import seed_bench
from .progress import Progress

TOKENS, HIDDEN = 16, 64


class FixedTower:
    num_deepstack_embeddings = 0

    def __init__(self) -> None:
        self.out = torch.randn(TOKENS, HIDDEN)
        self._outs = {1: self.out}  # by items in the batch: the same rows for each, made once

    def image_encoder(self, items):
        n = len(items)
        out = self._outs.get(n)
        if out is None:
            out = self._outs[n] = self.out.repeat(n, 1)
        return out

    get_video_feature = image_encoder


class BenchTransport(Transport):
    """The least a transport must do on the cycle, as `seed_bench`'s stand-in sender does for the
    seed: a write is one memmove per buffer and reports done at the next poll; the writes to the
    held receiver's session never report. So the controller, ours or the seed's, is charged only
    for its own work (the loopback's checks of every write's bounds, its fault rules and its
    notice log are a test transport's, not the controller's: one line of `run` prices them)."""

    def __init__(self, held: str) -> None:
        self.held = held
        self._ids = itertools.count(1)
        self._ready: list[tuple[int, Outcome]] = []
        self.told = 0

    def register_memory(self, regions: Sequence[tuple[int, int]], owner: Any = None) -> None:
        pass

    def submit_write(self, session: str, bufs: Sequence[Buf]) -> int:
        handle = next(self._ids)
        if session != self.held:
            for src, dst, n in bufs:
                ctypes.memmove(dst, src, n)
            self._ready.append((handle, Outcome.DONE))
        return handle

    def poll(self) -> list[tuple[int, Outcome]]:
        out, self._ready = self._ready, []
        return out

    def notify(self, frame: Any, room: int, status: str, reason: str = "") -> None:
        self.told += 1


def compiled_core() -> list[str]:
    """The core's modules this process runs compiled (setup.py's `EPD_RING_COMPILE=1` build), by name."""
    import importlib.machinery
    import pkgutil
    import sys

    from .. import core

    for info in pkgutil.iter_modules(core.__path__, core.__name__ + "."):
        __import__(info.name)
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return sorted(name.rsplit(".", 1)[1] for name, module in list(sys.modules.items())
                  if name.startswith(core.__name__ + ".") and str(getattr(module, "__file__", "")).endswith(suffixes))


def _best_of(cycle, items: int, repeats: int) -> float:
    """Best seconds for `items` cycles over several runs, as timeit does: noise only adds time."""
    cycle(500)  # warm up
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            cycle(items)
            best = min(best, time.perf_counter() - t0)
        finally:
            gc.enable()
    return best


def _extent_bytes() -> int:
    nbytes = TOKENS * HIDDEN * 4
    return nbytes + (-nbytes) % 64


def our_cycle(ring_slots: int, free_extents: int = 4, batch: int = 1, loopback: bool = False
              ) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """Our cycle on an arena of `ring_slots` items, all but `free_extents` held: (cycle(n), check(n cycled)).

    With `batch` > 1 a turn takes that many items: their requests and frames, one `execute` of
    all of them, one flush and one tick (an engine's loop turn with several images ready).
    """
    if not 1 <= batch <= free_extents:
        raise ValueError(f"a batch must fit the free extents: 1 <= batch <= {free_extents}, got {batch}")
    clock = FakeClock()
    dst = torch.empty(TOKENS, HIDDEN)
    held_dst = torch.empty(TOKENS, HIDDEN)
    transport: Transport
    if loopback:
        transport = LoopbackTransport(clock)
        transport.add_receiver("prefill:0").register(dst)
        transport.add_receiver("prefill:held").register(held_dst)
        if ring_slots > free_extents:
            transport.inject("hold", session="prefill:held", count=ring_slots - free_extents)
    else:
        transport = BenchTransport(held="prefill:held")
    manager = EncodeManager(transport, clock, max_tombstones=4096)
    # An arena of `ring_slots` items: every item has the same size, so it holds exactly that many. One
    # receiver's held writes occupy the arena on purpose here: no per-peer share (peer_ring_share=1.0).
    executor = EncodeExecutor(manager, FixedTower(), "cpu", arena_bytes=ring_slots * _extent_bytes(),
                              peer_ring_share=1.0)
    pump = Pump(executor)
    ptr = dst.data_ptr()
    room = 0
    for _ in range(ring_slots - free_extents):
        room += 1
        executor.register(("held", room), "h", 1, room)
        manager.register_receiver(ReceiverFrame(room, "prefill:held", held_dst.data_ptr(), 0, TOKENS, 0,
                                                TOKENS, HIDDEN, "torch.float32", False, 1))
        executor.execute([(("held", room), EncodeItem("image", TOKENS))])
        pump.flush()  # the held writes go out (and never complete)
    assert executor.ring.main_arena.free_bytes == free_extents * _extent_bytes()
    pending: set = set()
    base = manager.stats["success"]

    def cycle(n: int, _alive: tuple = (dst, held_dst)) -> None:  # the receivers' memory lives while the cycle does
        nonlocal room
        if batch == 1:
            for _ in range(n):
                room += 1
                executor.register(room, "h", 1, room)
                manager.register_receiver(ReceiverFrame(room, "prefill:0", ptr, 0, TOKENS, 0, TOKENS, HIDDEN,
                                                        "torch.float32", False, 1))
                pump.flush()  # as after a control plane's frames
                executor.execute([(room, EncodeItem("image", TOKENS))])
                pump.flush()  # as a real loop does after execute: the write is submitted here
                pump.tick()
                executor.reap_concluded_senders(pending)
            return
        while n > 0:
            turn = []
            for _ in range(min(batch, n)):
                room += 1
                executor.register(room, "h", 1, room)
                manager.register_receiver(ReceiverFrame(room, "prefill:0", ptr, 0, TOKENS, 0, TOKENS, HIDDEN,
                                                        "torch.float32", False, 1))
                turn.append((room, EncodeItem("image", TOKENS)))
            executor.execute(turn)
            pump.flush()  # the frames' effects and the turn's writes go out together
            pump.tick()
            executor.reap_concluded_senders(pending)
            n -= len(turn)

    def check(cycled: int) -> None:
        assert manager.stats["success"] == base + cycled, manager.stats
        assert executor.ring.main_arena.free_bytes == free_extents * _extent_bytes()
        assert len(executor.senders) == ring_slots - free_extents  # reaped: only the held rooms remain
        assert torch.equal(dst, executor.model.out)

    return cycle, check


def seed_cycle(seed: Any, ring_slots: int, free_extents: int = 4, batch: int = 1) -> tuple[Callable[[int], None],
                                                                                         Callable[[int], None]]:
    """The seed's executor on the same cycle (see `seed_bench`): (cycle(n), check(n cycled)).

    With `batch` > 1, as ours: that many requests and frames, then one `execute` of them all.
    """
    manager = seed_bench.SeedManager()
    tower = FixedTower()
    executor = seed.DisaggEncodeExecutor(manager, tower, "cpu", ring_slots=ring_slots, ring_bytes=_extent_bytes())
    dst = torch.empty(TOKENS, HIDDEN)
    held_dst = torch.empty(TOKENS, HIDDEN)
    image = seed_bench.Modality.IMAGE
    item_type = seed_bench.MultimodalDataItem
    room = 0
    for _ in range(ring_slots - free_extents):
        room += 1
        executor.register(("held", room), "h", 1, room)
        manager.register_receiver(room, held_dst.data_ptr(), held=True)
        executor.execute([(("held", room), item_type(image, TOKENS))])
    ptr = dst.data_ptr()
    pending: set = set()
    base = manager.success

    def cycle(n: int, _alive: tuple = (dst, held_dst)) -> None:  # the receivers' memory lives while the cycle does
        nonlocal room
        while n > 0:
            turn = []
            for _ in range(min(batch, n)):
                room += 1
                executor.register(room, "h", 1, room)
                manager.register_receiver(room, ptr)
                turn.append((room, item_type(image, TOKENS)))
            executor.execute(turn)
            executor.reap_concluded_senders(pending)
            n -= len(turn)

    def check(cycled: int) -> None:
        assert manager.success == base + cycled, manager.success
        assert not executor.has_deferred()
        assert len(executor.senders) == ring_slots - free_extents
        assert torch.equal(dst, tower.out)

    return cycle, check


def measure(ring_slots: int, items: int = 10000, free_extents: int = 4, repeats: int = 3) -> float:
    """Microseconds per item for our cycle at this ring size."""
    cycle, check = our_cycle(ring_slots, free_extents)
    best = _best_of(cycle, items, repeats)
    check(repeats * items + 500)
    return best / items * 1e6


def measure_seed(seed: Any, ring_slots: int, items: int = 10000, free_extents: int = 4, repeats: int = 3) -> float:
    """Microseconds per item for the seed's executor on the same cycle (see `seed_bench`)."""
    cycle, check = seed_cycle(seed, ring_slots, free_extents)
    best = _best_of(cycle, items, repeats)
    check(repeats * items + 500)
    return best / items * 1e6


def interleaved(ours: Callable[[int], None], theirs: Callable[[int], None], blocks: int = 20,
                block: int = 1000) -> dict[str, float]:
    """CPU time per item of two cycles in alternating blocks, and their ratio.

    One process timed after the other drifts with the machine's load; alternating blocks of
    both in one process puts the two under the same load, and CPU time leaves out the time the
    process waited. Each pair gives a ratio; the median pair is the figure, the extremes its spread.
    """
    ours(200)
    theirs(200)
    ratios, our_s, their_s = [], 0.0, 0.0
    for i in range(blocks):
        gc.collect()
        gc.disable()
        try:
            order = (ours, theirs) if i % 2 == 0 else (theirs, ours)  # neither always runs first
            times = {}
            for cycle in order:
                t0 = time.process_time()
                cycle(block)
                times[cycle] = time.process_time() - t0
        finally:
            gc.enable()
        our_s, their_s = our_s + times[ours], their_s + times[theirs]
        ratios.append(times[ours] / times[theirs] if times[theirs] > 0 else float("inf"))
    ratios.sort()
    items = blocks * block
    return {"ours_us": our_s / items * 1e6, "seed_us": their_s / items * 1e6, "ratio": our_s / their_s,
            "median_ratio": ratios[len(ratios) // 2], "min_ratio": ratios[0], "max_ratio": ratios[-1],
            "cycled": items + 200}


def per_item_counts(cycle: Callable[[int], None], items: int = 200) -> dict[str, float]:
    """Calls and bytecode ops per item of one cycle (the calls deterministic; the opcodes within a
    fraction, as a branch on the clock may go either way).

    "calls": Python functions entered; "builtin_calls": C functions and methods called from
    Python (cProfile's count is the two together).
    """
    import gc
    import sys

    cycle(50)  # warm: first-time imports and caches do not count
    calls = builtin = ops = 0

    def profile(frame, event, arg):
        nonlocal calls, builtin
        if event == "call":
            calls += 1
        elif event == "c_call":
            builtin += 1

    def trace(frame, event, arg):
        nonlocal ops
        if event == "call":
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
        elif event == "opcode":
            ops += 1
        return trace

    # A collection inside a measured run would count the finalizers of whatever else the process
    # left behind (another test's generators, sockets): collect first, then none while counting.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        sys.setprofile(profile)
        try:
            cycle(items)
        finally:
            sys.setprofile(None)
        sys.settrace(trace)
        try:
            cycle(items)
        finally:
            sys.settrace(None)
    finally:
        if was_enabled:
            gc.enable()
    return {"calls": calls / items, "builtin_calls": builtin / items, "opcodes": ops / items}


def run(items: int = 10000, sizes=(64, 1024, 4096), seed_path: str | Path | None = None, quiet: bool = False,
        echo=print, figures: dict | None = None) -> dict:
    """Print (through `echo`) and return {extents: (our us/item, seed us/item or None)}.

    `figures`, when given, gets the per-item call and bytecode counts ("per_item") and, with a
    seed, the interleaved CPU-time figures by rooms held ("interleaved").
    """
    if items < 1 or not sizes or min(sizes) < 1:
        raise ValueError(f"items and every ring size must be >= 1, got items={items}, sizes={sizes}")
    torch.set_num_threads(1)
    seed = seed_bench.load_seed(seed_path) if seed_path else None
    results: dict[int, tuple[float, float | None]] = {}
    echo(f"controller cycle: {TOKENS}x{HIDDEN} float32 per item, all but 4 extents held, best of 3 x {items} items")
    compiled = compiled_core()
    echo(f"core: compiled by mypyc ({len(compiled)} modules: setup.py)" if compiled else
         "core: Python (EPD_RING_COMPILE=1 at install compiles it: setup.py)")
    if figures is not None:
        figures["compiled"] = compiled
    if seed is not None:
        echo(f"seed: {seed_path} (same cycle, same run, stand-ins for its engine modules)")
    echo(f"{'extents':>6} {'us/item':>9} {'seed us':>8} {'vs seed':>8} {'vs own ' + str(sizes[0]):>10}")
    runs = len(sizes) * (1 if seed is None else 2) + (2 if seed is not None else 0)
    with Progress("bench", runs, unit="measurements", enabled=not quiet) as progress:
        for n in sizes:
            us = measure(n, items, free_extents=min(4, n))
            progress.update(len(results) * (1 if seed is None else 2) + 1, extents=n)
            seed_us = measure_seed(seed, n, items, free_extents=min(4, n)) if seed is not None else None
            results[n] = (us, seed_us)
            progress.update(len(results) * (1 if seed is None else 2), extents=n)
            base = results[sizes[0]][0]
            seed_cols = f"{seed_us:>8.1f} {us / seed_us:>7.2f}x" if seed_us else f"{'-':>8} {'-':>8}"
            echo(f"{n:>6} {us:>9.1f} {seed_cols} {us / base:>9.2f}x")
        if seed is not None:
            # The seed's best case: nothing held, so its lease and reap scans find a free extent at once.
            n = sizes[0]
            us, seed_us = measure(n, items, free_extents=n), measure_seed(seed, n, items, free_extents=n)
            progress.update(runs)
            echo(f"no extent held, {n} extents: {us:.1f} us/item, seed {seed_us:.1f} us/item, {us / seed_us:.2f}x")
    n = sizes[0]
    held = min(4, n)
    counts = per_item_counts(our_cycle(n, held)[0])
    batched = per_item_counts(our_cycle(n, held, held)[0])
    seed_counts = per_item_counts(seed_cycle(seed, n, held)[0]) if seed is not None else None

    def counted(c: dict[str, float]) -> str:
        return (f"{c['calls']:.0f} Python calls (+{c['builtin_calls']:.0f} built-in), {c['opcodes']:,.0f} "
                f"bytecode ops")

    echo(f"per item, {n} extents, {n - held} held: " + counted(counts)
         + (f"; the seed: {counted(seed_counts)}" if seed_counts else ""))
    echo(f"per item, {held} items a turn: " + counted(batched))
    if seed is not None:
        blocks = max(4, min(20, items // 500))
        block = min(500, max(10, items // blocks))
        echo(f"interleaved CPU time ({blocks} alternating blocks of {block} items each, in this process):")
        for free, turn, loopback in ((held, 1, False), (n, 1, False), (held, held, False), (held, 1, True)):
            f = interleaved(our_cycle(n, free, turn, loopback)[0], seed_cycle(seed, n, free, turn)[0], blocks=blocks,
                            block=block)
            on = ", ours on the loopback" if loopback else ""
            echo(f"  {n - free:>4} of {n} held, {turn} item{'s' if turn > 1 else ''} a turn{on}: ours "
                 f"{f['ours_us']:.1f} us/item, seed {f['seed_us']:.1f}; {f['median_ratio']:.2f}x the seed (median "
                 f"block; {f['min_ratio']:.2f}-{f['max_ratio']:.2f}x)")
            if figures is not None:
                figures.setdefault("interleaved", {})[f"{n - free} held, {turn} a turn{on}"] = f
    if figures is not None:
        figures["per_item"] = {"ours": counts, "ours_batched": batched, "seed": seed_counts}
    return results
