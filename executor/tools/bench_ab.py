"""The controller cycle of this tree against another checkout's, in interleaved blocks.

On a shared or virtual machine the speed of one process drifts by tens of percent over
seconds, so two benches run one after the other compare the machine's moods, not the code.
Here both trees' cycles (the `bench` cycle: 64 extents, all but 4 held) run at once in two
processes, and take turns: one block of `items` items each, the order swapped every round.
Each block's time is what either side got in the same few hundred milliseconds; the lowest
block (noise only adds time) and the median are printed for both, and their ratios.

The other tree is named by its Python (`--against .../.venv/bin/python`), whose `epd_ring`
is that checkout's. Trees from before the arena (a ring of `ring_slots` x `ring_bytes`) run
too, so a change can be measured against the tree it started from.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections.abc import Callable

# Run by each side's Python: build the bench's cycle with the API that tree has, then time
# one block per line read from stdin (the items in it) and print microseconds per item.
SERVE = r"""
import gc, inspect, sys, time, torch
torch.set_num_threads(1)
from epd_ring.executor.tools import bench
from epd_ring.executor.core.clock import FakeClock
from epd_ring.executor.core.executor import EncodeExecutor, EncodeItem
from epd_ring.executor.core.frames import ReceiverFrame
from epd_ring.executor.core.loopback import LoopbackTransport
from epd_ring.executor.core.manager import EncodeManager
from epd_ring.executor.core.pump import Pump
T, H, EXTENTS, FREE = bench.TOKENS, bench.HIDDEN, int(sys.argv[1]), 4
# One item's bytes, as bench's helper has them; worked out here, since that helper's name differs across trees.
NBYTES = T * H * 4 + (-(T * H * 4)) % 64
clock = FakeClock()
transport = LoopbackTransport(clock)
manager = EncodeManager(transport, clock, max_tombstones=4096)
params = inspect.signature(EncodeExecutor).parameters
if "arena_bytes" in params:  # held writes fill the arena on purpose: no per-peer share where there is one
    share = {"peer_ring_share": 1.0} if "peer_ring_share" in params else {}
    executor = EncodeExecutor(manager, bench.FixedTower(), "cpu", arena_bytes=EXTENTS * NBYTES, **share)
else:  # a tree from before the arena
    executor = EncodeExecutor(manager, bench.FixedTower(), "cpu", ring_slots=EXTENTS, ring_bytes=NBYTES)
pump = Pump(executor)
dst = torch.empty(T, H)
transport.add_receiver("prefill:0").register(dst)
ptr = dst.data_ptr()
held = torch.empty(T, H)
transport.add_receiver("prefill:held").register(held)
transport.inject("hold", session="prefill:held", count=EXTENTS - FREE)
room = 0
for _ in range(EXTENTS - FREE):
    room += 1
    executor.register(("held", room), "h", 1, room)
    manager.register_receiver(ReceiverFrame(room, "prefill:held", held.data_ptr(), 0, T, 0, T, H, "torch.float32",
                                            False, 1))
    executor.execute([(("held", room), EncodeItem("image", T))])
    pump.flush()
pending = set()

def cycle(n):
    global room
    for _ in range(n):
        room += 1
        executor.register(room, "h", 1, room)
        manager.register_receiver(ReceiverFrame(room, "prefill:0", ptr, 0, T, 0, T, H, "torch.float32", False, 1))
        pump.flush()
        executor.execute([(room, EncodeItem("image", T))])
        pump.flush()
        pump.tick()
        executor.reap_concluded_senders(pending)

cycle(500)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    cycle(n)
    dt = time.perf_counter() - t0
    gc.enable()
    print(dt / n * 1e6, flush=True)
assert torch.equal(dst, executor.model.out)
"""


def run(against: str, blocks: int = 60, items: int = 2000, extents: int = 64,
        echo: Callable[[str], None] = print) -> dict[str, float]:
    """Interleave `blocks` rounds of both cycles; return the figures (us/item and ratios, this tree / other)."""
    if blocks < 1 or items < 1 or extents < 5:
        raise ValueError(f"blocks and items must be >= 1 and extents >= 5, got {blocks}, {items}, {extents}")
    sides = {"this": sys.executable, "other": against}
    procs = {name: subprocess.Popen([py, "-c", SERVE, str(extents)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True) for name, py in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    ok = False
    try:
        for name, p in procs.items():
            if p.stdout is None or p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the {name} tree's cycle did not start ({sides[name]})")
        for k in range(blocks):
            for name in (("this", "other") if k % 2 == 0 else ("other", "this")):
                p = procs[name]
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write(f"{items}\n")
                p.stdin.flush()
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"the {name} tree's cycle stopped ({sides[name]})")
                times[name].append(float(line))
        ok = True
    finally:
        for p in procs.values():
            if p.stdin is not None:
                p.stdin.close()
            if not ok:
                p.kill()  # neither side outlives a failed run
        failed = [name for name, p in procs.items() if p.wait(timeout=60) != 0]
    if failed:
        where = ", ".join(sides[n] for n in failed)
        raise RuntimeError(f"the cycle of {' and '.join(failed)} failed its check ({where})")
    this, other = times["this"], times["other"]
    out = {"this_min": min(this), "this_median": statistics.median(this),
           "other_min": min(other), "other_median": statistics.median(other)}
    out["ratio_min"] = out["this_min"] / out["other_min"]
    out["ratio_median"] = out["this_median"] / out["other_median"]
    echo(f"controller cycle, {extents} extents (all but 4 held), {blocks} interleaved blocks of {items} items")
    echo(f"{'':>6} {'min us':>8} {'median us':>10}")
    echo(f"{'this':>6} {out['this_min']:>8.2f} {out['this_median']:>10.2f}")
    echo(f"{'other':>6} {out['other_min']:>8.2f} {out['other_median']:>10.2f}")
    echo(f"this / other: {out['ratio_min']:.3f}x (min), {out['ratio_median']:.3f}x (median)")
    return out


__all__ = ["run"]
