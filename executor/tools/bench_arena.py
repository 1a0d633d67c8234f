"""Ring bytes each allocation policy needs to carry one seeded trace of embeddings.

Three policies place the same trace's extents in one ring, each simulated here:

- fixed slots: the seed's ring, N equal slots each sized to the trace's largest item;
- write head: a vLLM-style transfer buffer, a head that allocates contiguously, wraps to 0 when
  the item does not fit before the end, and stops at the first busy extent (it never skips one);
  with nothing live it restarts at 0;
- ours: `epd_ring.executor.core.arena.Arena`.

Every policy holds an extent from its allocation until its write's outcome, and a failed write's
extent for the quarantine after it (the safety rule: a write that failed may still land), so the
three differ only in where they put extents. For each the bench finds the ring bytes that carry
the trace with no deferral (a binary search over the capacity) and the deferral rate at fixed
budgets. An item that does not fit waits in one FIFO (deferred-first: an item arriving while
others wait queues behind them) and is served when a release makes room for the queue's head.
Every simulated allocation is checked against the live extents: one that overlaps raises
`SimulationError`.

The trace, its distributions stated in `TraceSpec.describe()`, is drawn from one seed. Each
item's random draws are made in a fixed order whatever the settings, so changing one knob (the
failure share, say) changes only what that knob governs.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

ALIGN = 64
MiB, GiB = 1 << 20, 1 << 30
GOAL_X_PEAK = 1.25


class SimulationError(RuntimeError):
    """A policy handed out bytes that a live extent holds, or bytes outside its ring."""


@dataclass(frozen=True)
class TraceSpec:
    """The trace's distributions; the defaults are the bench's stated figures."""

    items: int = 12000
    seed: int = 0
    rate: float = 100.0  # Poisson arrivals, items per second (one encode worker's tower)
    video_share: float = 0.05
    image_tokens: tuple[int, int] = (64, 2048)  # log-uniform
    video_tokens: tuple[int, int] = (2048, 16384)  # uniform
    hidden: int = 4096
    levels: int = 3  # deepstack levels
    dtype_bytes: int = 2  # bf16
    ring: str = "main"  # or "deepstack": the same items, `levels` times the bytes
    park_share: float = 0.25  # items whose receivers are not all registered when the chunk is staged
    park_mean_s: float = 0.2  # exponential
    park_timeout_s: float = 120.0  # the core's default: past it the room fails and the extent frees unwritten
    write_gb_s: float = 20.0  # the item's main and deepstack bytes over one link
    write_median_s: float = 0.001  # log-normal overhead on top of the bytes' time
    write_sigma: float = 1.0
    fail_share: float = 0.005  # writes that report failure after their latency
    quarantine_s: float = 30.0  # the core's default quarantine_s

    def describe(self) -> list[str]:
        """The distributions, one line each, as the bench prints them."""
        lo, hi = self.image_tokens
        vlo, vhi = self.video_tokens
        row = self.hidden * self.dtype_bytes
        duration = self.items / self.rate
        return [
            f"arrivals  Poisson, {self.rate:g} items/s (exponential gaps, mean {1e3 / self.rate:g} ms); "
            f"{self.items:,} items, about {duration:,.0f} s; seed {self.seed}",
            f"sizes     images {1 - self.video_share:.0%}: tokens log-uniform {lo:,}-{hi:,}; videos "
            f"{self.video_share:.0%}: tokens uniform {vlo:,}-{vhi:,}; bytes = tokens x {self.hidden} x "
            f"{self.dtype_bytes} (bf16) main, x{self.levels} deepstack; this run: the {self.ring} ring",
            f"park      {self.park_share:.0%} of items, exponential, mean {self.park_mean_s * 1e3:g} ms "
            f"(a park past {self.park_timeout_s:g} s fails its room and frees the extent unwritten)",
            f"write     (main + deepstack bytes) / {self.write_gb_s:g} GB/s + log-normal (median "
            f"{self.write_median_s * 1e3:g} ms, sigma {self.write_sigma:g}); row = {row:,} bytes",
            f"failures  {self.fail_share:.1%} of writes fail after that latency; their extent is then "
            f"quarantined {self.quarantine_s:g} s",
        ]


@dataclass(frozen=True)
class Item:
    arrival: float  # seconds
    nbytes: int  # in this ring
    hold: float  # seconds its extent is held once placed: park, write, and quarantine when it failed
    video: bool
    failed: bool


def make_trace(spec: TraceSpec) -> list[Item]:
    """The seeded trace, in arrival order."""
    if spec.ring not in ("main", "deepstack"):
        raise ValueError(f"ring must be main or deepstack, got {spec.ring!r}")
    rng = random.Random(spec.seed)
    row = spec.hidden * spec.dtype_bytes
    scale = 1 if spec.ring == "main" else spec.levels
    log_lo, log_hi = math.log(spec.image_tokens[0]), math.log(spec.image_tokens[1])
    mu = math.log(spec.write_median_s)
    trace, now = [], 0.0
    for _ in range(spec.items):
        # Every draw happens for every item, in this order, so one knob changes only its own part.
        now += rng.expovariate(spec.rate)
        video = rng.random() < spec.video_share
        image_tokens = round(math.exp(rng.uniform(log_lo, log_hi)))
        video_tokens = rng.randint(*spec.video_tokens)
        parks = rng.random() < spec.park_share
        park = min(rng.expovariate(1 / spec.park_mean_s), spec.park_timeout_s)
        overhead = rng.lognormvariate(mu, spec.write_sigma)
        fails = rng.random() < spec.fail_share
        tokens = video_tokens if video else image_tokens
        if parks and park >= spec.park_timeout_s:
            hold, failed = park, False  # the room failed in park: no write was issued
        else:
            write = tokens * row * (1 + spec.levels) / (spec.write_gb_s * 1e9) + overhead
            hold = (park if parks else 0.0) + write + (spec.quarantine_s if fails else 0.0)
            failed = fails
        trace.append(Item(now, tokens * row * scale, hold, video, failed))
    return trace


def peak_in_flight(trace: Sequence[Item]) -> tuple[int, int]:
    """(bytes, items) in flight at the trace's busiest instant, each item placed on arrival.

    No policy carries the trace with no deferral in fewer bytes. A release at the same instant
    as an arrival counts first, as the simulation frees before it places.
    """
    events = sorted([(it.arrival, 1, it.nbytes) for it in trace] + [(it.arrival + it.hold, 0, -it.nbytes)
                                                                     for it in trace])
    live = count = peak = peak_count = 0
    for _, arrives, delta in events:
        live += delta
        count += 1 if arrives else -1
        peak, peak_count = max(peak, live), max(peak_count, count)
    return peak, peak_count


# the policies: alloc(nbytes) -> offset or None, free(offset) ------------------

class Allocator(Protocol):
    def alloc(self, nbytes: int) -> int | None: ...

    def free(self, offset: int) -> None: ...


def _aligned(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


class FixedSlots:
    """The seed's ring: `capacity // slot_bytes` equal slots, reused oldest-freed first."""

    def __init__(self, capacity: int, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self.capacity = capacity // slot_bytes * slot_bytes
        self._free = deque(range(capacity // slot_bytes))

    def alloc(self, nbytes: int) -> int | None:
        if nbytes > self.slot_bytes or not self._free:
            return None
        return self._free.popleft() * self.slot_bytes

    def free(self, offset: int) -> None:
        self._free.append(offset // self.slot_bytes)


class WriteHead:
    """A vLLM-style transfer buffer with our quarantine rule applied.

    The head allocates at itself, or at 0 when the item would run past the end (the tail is
    skipped for this lap), and fails if a live extent (in flight, parked or quarantined) lies in
    the way: it stops at the first busy extent instead of searching past it. With nothing live it
    restarts at 0, as vLLM's buffer does once empty.
    """

    def __init__(self, capacity: int, align: int = ALIGN):
        self.capacity, self.align, self.head = capacity, align, 0
        self._starts: list[int] = []  # live extents' offsets, sorted
        self._ends: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int | None:
        size = _aligned(nbytes, self.align)
        if size > self.capacity:
            return None
        if not self._starts:
            self.head = 0
        at = self.head if self.head + size <= self.capacity else 0
        i = bisect_left(self._starts, at + size)
        if i and self._ends[self._starts[i - 1]] > at:  # the last extent starting before our end reaches in
            return None
        insort(self._starts, at)
        self._ends[at] = at + size
        self.head = at + size
        return at

    def free(self, offset: int) -> None:
        del self._ends[offset]
        del self._starts[bisect_left(self._starts, offset)]


def _ours(capacity: int) -> Allocator:
    from epd_ring.executor.core.arena import Arena

    return Arena(capacity, align=ALIGN)


@dataclass(frozen=True)
class Policy:
    name: str
    make: Callable[[int], Allocator]  # capacity -> a fresh allocator
    unit: int  # capacities are multiples of it


def policies(trace: Sequence[Item]) -> list[Policy]:
    slot = _aligned(max(it.nbytes for it in trace))
    return [Policy("fixed slots", lambda cap: FixedSlots(cap, slot), slot),
            Policy("write head", WriteHead, ALIGN),
            Policy("ours (arena)", _ours, ALIGN)]


# the simulation ---------------------------------------------------------------

@dataclass
class Run:
    policy: str
    capacity: int
    items: int
    deferred: int = 0  # items that waited in the queue
    refused: int = 0  # items larger than the whole ring: their room fails at once
    waits: list[float] = field(default_factory=list)  # seconds each deferred item waited
    starts: list[float] = field(default_factory=list)  # when each item was placed (refused: nan)
    peak_used: int = 0  # most bytes live at once

    @property
    def deferral_rate(self) -> float:
        carried = self.items - self.refused
        return self.deferred / carried if carried else 0.0

    def wait_quantile(self, q: float) -> float:
        """Seconds waited at quantile q over every carried item (one served at once waited 0)."""
        rank = int((self.items - self.refused) * (1 - q))  # items that waited longer
        waits = sorted(self.waits, reverse=True)
        return waits[rank] if rank < len(waits) else 0.0


class _Live:
    """The live extents, to check that no allocation overlaps one (the safety rule, in bytes)."""

    def __init__(self, policy: str, capacity: int):
        self.policy, self.capacity = policy, capacity
        self.starts: list[int] = []
        self.ends: dict[int, int] = {}
        self.used = 0

    def add(self, offset: int, nbytes: int) -> None:
        end = offset + nbytes
        if offset < 0 or end > self.capacity:
            raise SimulationError(f"{self.policy}: [{offset}, {end}) lies outside the ring of {self.capacity} bytes")
        i = bisect_left(self.starts, end)
        if i and self.ends[self.starts[i - 1]] > offset:
            other = self.starts[i - 1]
            raise SimulationError(f"{self.policy}: [{offset}, {end}) overlaps the live extent "
                                  f"[{other}, {self.ends[other]})")
        insort(self.starts, offset)
        self.ends[offset] = end
        self.used += nbytes

    def remove(self, offset: int) -> None:
        self.used -= self.ends.pop(offset) - offset
        del self.starts[bisect_left(self.starts, offset)]


def simulate(trace: Sequence[Item], policy: Policy, capacity: int, *, until_deferral: bool = False) -> Run:
    """Run the trace through one policy's ring of `capacity` bytes.

    With `until_deferral` it stops at the first item that must wait or is refused (enough to
    say the capacity does not carry the trace with no deferral).
    """
    ring = policy.make(capacity)
    run = Run(policy.name, getattr(ring, "capacity", capacity), len(trace), starts=[math.nan] * len(trace))
    live = _Live(policy.name, run.capacity)
    releases: list[tuple[float, int, int]] = []  # (time, item, offset)
    queue: deque[int] = deque()

    def place(i: int, offset: int, now: float) -> None:
        item = trace[i]
        live.add(offset, item.nbytes)
        run.peak_used = max(run.peak_used, live.used)
        run.starts[i] = now
        heapq.heappush(releases, (now + item.hold, i, offset))

    def release_until(now: float) -> None:
        while releases and releases[0][0] <= now:
            at = releases[0][0]
            while releases and releases[0][0] == at:  # all releases of one instant, then serve
                _, _, offset = heapq.heappop(releases)
                live.remove(offset)
                ring.free(offset)
            while queue:
                offset = ring.alloc(trace[queue[0]].nbytes)
                if offset is None:
                    break
                i = queue.popleft()
                run.waits.append(at - trace[i].arrival)
                place(i, offset, at)

    for i, item in enumerate(trace):
        release_until(item.arrival)
        if item.nbytes > run.capacity:
            run.refused += 1
            if until_deferral:
                return run
            continue
        offset = None if queue else ring.alloc(item.nbytes)
        if offset is None:
            run.deferred += 1
            queue.append(i)
            if until_deferral:
                return run
            continue
        place(i, offset, item.arrival)
    release_until(math.inf)
    if queue:  # cannot happen: with nothing live every policy fits any item no larger than its ring
        raise SimulationError(f"{policy.name}: {len(queue)} items still deferred with the ring empty")
    return run


def carries(trace: Sequence[Item], policy: Policy, capacity: int) -> bool:
    """Whether a ring of `capacity` bytes carries the trace with no deferral and no refusal."""
    run = simulate(trace, policy, capacity, until_deferral=True)
    return run.deferred == 0 and run.refused == 0


def needed_capacity(trace: Sequence[Item], policy: Policy, peak: int) -> int:
    """The least capacity (in the policy's units) found to carry the trace with no deferral.

    Below the peak in-flight bytes nothing can; from there the capacity doubles until it
    carries, then a binary search. Carrying need not be monotonic in the capacity for every
    policy, so what is promised is local: the answer carries, one unit less does not.
    """
    unit = policy.unit
    lo = max(0, -(-peak // unit) - 1)  # lo units do not carry
    hi = max(1, lo + 1)
    while not carries(trace, policy, hi * unit):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if carries(trace, policy, mid * unit):
            hi = mid
        else:
            lo = mid
    return hi * unit


# the report --------------------------------------------------------------------

DEFAULT_BUDGETS = (512 * MiB, GiB, 2 * GiB, 4 * GiB)


def size_text(nbytes: float) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / MiB:.1f} MiB"


def run(spec: TraceSpec = TraceSpec(), budget: int = 2 * GiB, budgets: Sequence[int] = DEFAULT_BUDGETS,
        seeds: int = 1, quiet: bool = False, echo: Callable[..., None] = print) -> dict[str, Any]:
    """Print (through `echo`) the figures and return them as a dict (the `--json` object).

    With `seeds` > 1 the bytes ours needs are also found on the traces of the next seeds, and the
    goal of at most `GOAL_X_PEAK` x the peak is judged on all of them.
    """
    from .progress import Progress

    budget = budget // ALIGN * ALIGN  # a ring's bytes are whole alignment units
    budgets = [b // ALIGN * ALIGN for b in budgets]
    if min(budgets, default=budget) < ALIGN or budget < ALIGN:
        raise ValueError(f"every budget must be at least {ALIGN} bytes")
    trace = make_trace(spec)
    peak, peak_items = peak_in_flight(trace)
    pols = policies(trace)
    table_budgets = sorted(set(budgets) | {budget})
    report: dict[str, Any] = {
        "trace": {**asdict(spec), "distributions": spec.describe()},
        "peak_in_flight_bytes": peak, "peak_in_flight_items": peak_items,
        "largest_item_bytes": max(it.nbytes for it in trace),
        "mean_item_bytes": sum(it.nbytes for it in trace) / len(trace),
        "failed_writes": sum(it.failed for it in trace), "videos": sum(it.video for it in trace),
        "budget_bytes": budget, "policies": {}, "budgets": {},
    }
    echo(f"arena bench: one seeded trace through three allocation policies ({spec.ring} ring)")
    for line in spec.describe():
        echo("  " + line)
    echo(f"  this trace: {report['videos']:,} videos, {report['failed_writes']:,} failed writes; mean item "
         f"{size_text(report['mean_item_bytes'])}, largest {size_text(report['largest_item_bytes'])}; peak in "
         f"flight {size_text(peak)} ({peak_items} items)")
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    total = len(pols) * (1 + len(table_budgets))
    with Progress("bench-arena", total, unit="runs", enabled=not quiet) as progress:
        done = 0
        for pol in pols:
            need = needed_capacity(trace, pol, peak)
            done += 1
            progress.update(done, policy=pol.name)
            per_budget = {}
            for b in table_budgets:
                r = simulate(trace, pol, b)
                per_budget[b] = {"capacity_bytes": r.capacity, "deferral_rate": r.deferral_rate,
                                 "deferred": r.deferred, "refused": r.refused,
                                 "p99_wait_s": r.wait_quantile(0.99), "max_wait_s": max(r.waits, default=0.0)}
                done += 1
                progress.update(done, policy=pol.name, budget=size_text(b))
            report["policies"][pol.name] = {"needed_bytes": need, "x_peak": need / peak,
                                            "at_budget": per_budget[budget]}
            for b, figures in per_budget.items():
                report["budgets"].setdefault(str(b), {})[pol.name] = figures

    echo("")
    echo(f"{'policy':<14} {'bytes for no deferral':>22} {'x peak':>7} {'deferred at ' + size_text(budget):>20} "
         f"{'p99 wait':>9} {'refused':>8}")
    for name, p in report["policies"].items():
        at = p["at_budget"]
        echo(f"{name:<14} {size_text(p['needed_bytes']):>22} {p['x_peak']:>6.2f}x {at['deferral_rate']:>19.2%} "
             f"{at['p99_wait_s'] * 1e3:>7.0f}ms {at['refused']:>8}")
    echo("")
    echo("deferral rate by budget (refused items, larger than the whole ring, in brackets):")
    names = [p.name for p in pols]
    echo(f"{'budget':>10} " + " ".join(f"{n:>14}" for n in names))
    for b in table_budgets:
        cells = []
        for n in names:
            f = report["budgets"][str(b)][n]
            cells.append(f"{f['deferral_rate']:>9.2%}" + (f" ({f['refused']})" if f["refused"] else "") )
        echo(f"{size_text(b):>10} " + " ".join(f"{c:>14}" for c in cells))

    # The same draws with no write failing: how much of each figure the quarantine accounts for.
    calm = make_trace(replace(spec, fail_share=0.0))
    calm_peak, _ = peak_in_flight(calm)
    calm_need = {pol.name: needed_capacity(calm, pol, calm_peak) for pol in policies(calm)}
    report["without_failures"] = {"peak_in_flight_bytes": calm_peak, "needed_bytes": calm_need}
    echo("")
    echo(f"the same draws with no write failing: peak in flight {size_text(calm_peak)}; bytes for no deferral: "
         + ", ".join(f"{n} {size_text(b)} ({b / calm_peak:.2f}x)" for n, b in calm_need.items()))

    # One seed is one draw: the figure for ours on the seeds after it says how far it can be trusted.
    xs = {spec.seed: report["policies"]["ours (arena)"]["x_peak"]}
    for seed in range(spec.seed + 1, spec.seed + seeds):
        other = make_trace(replace(spec, seed=seed))
        other_peak, _ = peak_in_flight(other)
        xs[seed] = needed_capacity(other, pols[-1], other_peak) / other_peak
    ranked = sorted(xs.values())
    within = sum(x <= GOAL_X_PEAK for x in ranked)
    report["ours_x_peak_by_seed"] = {str(k): v for k, v in xs.items()}
    if seeds > 1:
        echo("")
        echo(f"ours over seeds {spec.seed}-{spec.seed + seeds - 1}: bytes for no deferral / peak in flight "
             f"min {ranked[0]:.2f}x, median {ranked[len(ranked) // 2]:.2f}x, max {ranked[-1]:.2f}x; "
             f"within {GOAL_X_PEAK}x on {within} of {seeds} ("
             + ", ".join(f"{k}: {v:.2f}x" for k, v in xs.items()) + ")")

    ours, head = report["policies"]["ours (arena)"], report["policies"]["write head"]
    worse = [size_text(int(b)) for b, row in report["budgets"].items()
             if row["ours (arena)"]["deferral_rate"] > row["write head"]["deferral_rate"]]
    goal = {"x_peak_limit": GOAL_X_PEAK, "within_x_peak": within == len(ranked), "seeds_within": within,
            "no_worse_than_write_head": not worse and ours["needed_bytes"] <= head["needed_bytes"],
            "budgets_worse_than_write_head": worse}
    goal["met"] = goal["within_x_peak"] and goal["no_worse_than_write_head"]
    report["goal"] = goal
    echo("")
    seeds_text = f"{ours['x_peak']:.2f}x" if seeds == 1 else f"{within} of {seeds} seeds, worst {ranked[-1]:.2f}x"
    echo(f"goal: ours <= {GOAL_X_PEAK}x peak in flight: {'met' if goal['within_x_peak'] else 'MISSED'} "
         f"({seeds_text}); no worse than the write head (bytes for no deferral, deferral rate at "
         f"every budget): {'met' if goal['no_worse_than_write_head'] else 'MISSED'}"
         + (f" (worse at {', '.join(worse)})" if worse else ""))
    return report


def spec_with(**overrides: Any) -> TraceSpec:
    """The default spec with the given fields replaced (None leaves a field as it is)."""
    return replace(TraceSpec(), **{k: v for k, v in overrides.items() if v is not None})
