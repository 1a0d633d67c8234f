"""Ring bytes each allocation policy needs to carry one seeded trace of embeddings.

Four policies place the same trace's extents in one ring, each simulated here:

- fixed extents: the seed's ring, N equal extents each sized to the trace's largest item;
- vLLM next fit: vLLM's `EncoderCacheTransferBuffer`, a write head that skips live extents and
  retries once from 0 (`NextFit`);
- buddy (older): the power-of-two buddy pool vLLM's older EC connector staged into (`Buddy`);
- ours: `epd_ring.executor.core.arena.Arena`.

Every policy holds an extent from its allocation until its write's outcome, and a failed write's
extent for the quarantine after it (the safety rule: a write that failed may still land), so they
differ in where they put extents and in what an item that does not fit does. Fixed extents and ours
defer it: it waits in one FIFO (deferred-first: an item arriving while others wait queues behind
them) and is served when a release makes room for the queue's head. vLLM's two skip it: the buffer
raises, the connector does not send the item, and the consumer encodes it locally; the bench
counts those items skipped. Every simulated allocation is checked against the live extents: one
that overlaps raises `SimulationError`.

For each policy the bench reports the ring bytes that carry the trace with nothing deferred or
skipped twice: the binary search's answer (it carries, one unit less does not) and the robust size,
the least size from which every larger size the scan tries carries too. Carrying is not monotonic
in the capacity, so the search's answer alone can overstate what a ring sized by it carries.

The trace, its distributions stated in `TraceSpec.describe()`, is drawn from one seed; `MIXES`
names the mixes it can stress (bimodal sizes, growing sizes, long holds, a failure storm, late
frames). Each item's random draws are made in a fixed order whatever the settings, so changing one
knob (the failure share, say) changes only what that knob governs.
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
    mix: str = "realistic"  # one of MIXES: what the trace stresses on top of the distributions above

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
            f"mix       {self.mix}: {MIXES[self.mix]}",
        ]


@dataclass(frozen=True)
class Item:
    arrival: float  # seconds
    nbytes: int  # in this ring
    hold: float  # seconds its extent is held once placed: park, write, and quarantine when it failed
    video: bool
    failed: bool


MIXES = {
    "realistic": "the distributions above as they are",
    "bimodal": "90% images log-uniform 256-1,024 tokens, 10% 16,384 tokens (the sizes above are not used)",
    "increasing": "each item's tokens scaled by 2^(3 (i/n - 1)): items grow from 1/8 to the full size over the "
                  "trace, so the holes early items leave are too small for later ones",
    "long-lived": "10% of items held 10-60 s longer (uniform): a receiver slow to answer",
    "failure-storm": "half the writes of the trace's fifth tenth fail, each quarantined",
    "late-frame": "50% of items park (exponential, mean 2 s): receivers' frames arrive late",
}


def make_trace(spec: TraceSpec) -> list[Item]:
    """The seeded trace, in arrival order."""
    if spec.ring not in ("main", "deepstack"):
        raise ValueError(f"ring must be main or deepstack, got {spec.ring!r}")
    if spec.mix not in MIXES:
        raise ValueError(f"mix must be one of {', '.join(MIXES)}, got {spec.mix!r}")
    rng = random.Random(spec.seed)
    # The mixes draw from their own stream, so the realistic trace is the same with or without them.
    extra = random.Random(f"{spec.seed}/mix")
    row = spec.hidden * spec.dtype_bytes
    scale = 1 if spec.ring == "main" else spec.levels
    log_lo, log_hi = math.log(spec.image_tokens[0]), math.log(spec.image_tokens[1])
    mu = math.log(spec.write_median_s)
    trace, now = [], 0.0
    for index in range(spec.items):
        # Every draw happens for every item, in this order, so one knob changes only its own part.
        now += rng.expovariate(spec.rate)
        video = rng.random() < spec.video_share
        image_tokens = round(math.exp(rng.uniform(log_lo, log_hi)))
        video_tokens = rng.randint(*spec.video_tokens)
        parks = rng.random() < spec.park_share
        park = min(rng.expovariate(1 / spec.park_mean_s), spec.park_timeout_s)
        overhead = rng.lognormvariate(mu, spec.write_sigma)
        fails = rng.random() < spec.fail_share
        u, v = extra.random(), extra.random()
        tokens = video_tokens if video else image_tokens
        longer = 0.0
        if spec.mix == "bimodal":
            video = u < 0.1
            tokens = 16384 if video else round(math.exp(math.log(256) + v * math.log(4)))
        elif spec.mix == "increasing":
            tokens = max(1, round(tokens * 2 ** (3 * (index / spec.items - 1))))
        elif spec.mix == "long-lived":
            longer = 10 + 50 * v if u < 0.1 else 0.0
        elif spec.mix == "failure-storm":
            fails = fails or (0.4 <= index / spec.items < 0.5 and u < 0.5)
        elif spec.mix == "late-frame":
            parks, park = u < 0.5, min(-2.0 * math.log(1 - v), spec.park_timeout_s)
        if parks and park >= spec.park_timeout_s:
            hold, failed = park, False  # the room failed in park: no write was issued
        else:
            write = tokens * row * (1 + spec.levels) / (spec.write_gb_s * 1e9) + overhead
            hold = (park if parks else 0.0) + write + longer + (spec.quarantine_s if fails else 0.0)
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


class FixedExtents:
    """The seed's ring: `capacity // extent_bytes` equal extents, reused oldest-freed first."""

    def __init__(self, capacity: int, extent_bytes: int):
        self.extent_bytes = extent_bytes
        self.capacity = capacity // extent_bytes * extent_bytes
        self._free = deque(range(capacity // extent_bytes))

    def alloc(self, nbytes: int) -> int | None:
        if nbytes > self.extent_bytes or not self._free:
            return None
        return self._free.popleft() * self.extent_bytes

    def free(self, offset: int) -> None:
        self._free.append(offset // self.extent_bytes)


class NextFit:
    """vLLM's `EncoderCacheTransferBuffer` (its Mooncake EC connector's transfer buffer), modelled.

    A write head: an allocation starts at the head (at 0 once the head has reached the end) and
    moves past every live extent in its way (vLLM's pinned extents; ours: in flight, parked or
    quarantined) until the item fits before the ring's end; if it does not, it tries once more
    from 0. It places the item there and moves the head to the item's end. Freed bytes need no
    bookkeeping: the head passes over them. When nothing fits, vLLM raises and its connector
    skips the item (the consumer encodes it locally), so the bench counts it skipped, not waiting.
    """

    def __init__(self, capacity: int, align: int = ALIGN):
        self.capacity, self.align, self.head = capacity, align, 0
        self._starts: list[int] = []  # live extents' offsets, sorted
        self._ends: dict[int, int] = {}

    def _from(self, at: int, size: int) -> int | None:
        i = bisect_left(self._starts, at)
        if i and self._ends[self._starts[i - 1]] > at:  # the extent before `at` reaches past it
            at = self._ends[self._starts[i - 1]]
        while at + size <= self.capacity:
            if i == len(self._starts) or self._starts[i] >= at + size:
                return at
            at = max(at, self._ends[self._starts[i]])
            i += 1
        return None

    def alloc(self, nbytes: int) -> int | None:
        size = _aligned(nbytes, self.align)
        if size > self.capacity:
            return None
        start = self.head if self.head < self.capacity else 0
        at = self._from(start, size)
        if at is None and start:
            at = self._from(0, size)
        if at is None:
            return None
        insort(self._starts, at)
        self._ends[at] = at + size
        self.head = at + size
        return at

    def free(self, offset: int) -> None:
        del self._ends[offset]
        del self._starts[bisect_left(self._starts, offset)]


class Buddy:
    """The buddy pool vLLM's older EC connector staged embeddings in (`TensorMemoryPool`), modelled.

    The pool is a power of two (here the largest that fits the budget); a request is rounded up
    to a power of two (at least `min_block` bytes), taken from the smallest size whose free list
    is not empty (that list's most recently filed block), and split down, the upper halves
    filed free. A free merges the block with its free buddy, repeatedly. When nothing fits the
    pool raises; as with next fit the item is counted skipped.
    """

    def __init__(self, capacity: int, min_block: int = 512):
        self.capacity = 1 << (capacity.bit_length() - 1) if capacity > 0 else 0
        self.min_block = min_block
        self._free: dict[int, dict[int, None]] = {}  # block size -> free offsets, in filing order
        self._size: dict[int, int] = {}  # live offset -> block size
        if self.capacity >= min_block:
            self._free[self.capacity] = {0: None}

    def alloc(self, nbytes: int) -> int | None:
        need = 1 << (max(nbytes, self.min_block) - 1).bit_length()
        size = need
        while size <= self.capacity and not self._free.get(size):
            size *= 2
        if size > self.capacity:
            return None
        at, _ = self._free[size].popitem()
        while size > need:
            size //= 2
            self._free.setdefault(size, {})[at + size] = None
        self._size[at] = need
        return at

    def free(self, offset: int) -> None:
        size = self._size.pop(offset)
        while size < self.capacity:
            buddy = offset ^ size
            blocks = self._free.get(size)
            if not blocks or buddy not in blocks:
                break
            del blocks[buddy]
            offset, size = min(offset, buddy), size * 2
        self._free.setdefault(size, {})[offset] = None


def _ours(capacity: int) -> Allocator:
    from epd_ring.executor.core.arena import Arena

    return Arena(capacity, align=ALIGN)


class Spanning:
    """Ours, with an item spanning up to `most` pieces when no single free extent fits it: the core's
    own `Arena.span`, as a ring with `max_pieces` leases (the largest free extents whole while the
    rest fits none, then the best fit for the rest; nothing is taken when more pieces are needed).
    An item is freed whole.
    """

    def __init__(self, capacity: int, most: int = 4):
        from epd_ring.executor.core.arena import Arena, span

        self.arena, self._span = Arena(capacity, align=ALIGN), span
        self.capacity, self.most = self.arena.capacity, most
        self._pieces: dict[int, list[tuple[int, int]]] = {}  # first piece's offset -> (offset, bytes) of each
        self.spanned = 0  # items placed in more than one piece

    def alloc(self, nbytes: int) -> int | None:
        at = self.arena.alloc(nbytes)  # as `Ring.lease`: one free extent if any holds it, else a span
        pieces = [(at, nbytes)] if at is not None else self._span(self.arena, nbytes, self.most)
        if pieces is None:
            return None
        self.spanned += len(pieces) > 1
        self._pieces[pieces[0][0]] = pieces
        return pieces[0][0]

    def pieces(self, offset: int) -> list[tuple[int, int]]:
        return self._pieces[offset]

    def free(self, offset: int) -> None:
        for at, _ in self._pieces.pop(offset):
            self.arena.free(at)


DEFER, SKIP = "defer", "skip"


@dataclass(frozen=True)
class Policy:
    name: str
    make: Callable[[int], Allocator]  # capacity -> a fresh allocator
    unit: int  # capacities are multiples of it
    full: str = DEFER  # what an item that does not fit does: waits (DEFER) or is skipped (SKIP)
    pow2: bool = False  # capacities are powers of two


NEXT_FIT, BUDDY, OURS, SPANNING = "vLLM next fit", "buddy (older)", "ours (arena)", "ours, spanning"


def policies(trace: Sequence[Item], spanning: bool = True) -> list[Policy]:
    """The bench's policies; with `spanning` (the core's default, `max_pieces=4`), ours with items spanning
    up to 4 pieces after ours with one run per item."""
    extent = _aligned(max(it.nbytes for it in trace))
    return [Policy("fixed extents", lambda cap: FixedExtents(cap, extent), extent),
            Policy(NEXT_FIT, NextFit, ALIGN, full=SKIP),
            Policy(BUDDY, Buddy, ALIGN, full=SKIP, pow2=True),
            Policy(OURS, _ours, ALIGN)] + ([Policy(SPANNING, Spanning, ALIGN)] if spanning else [])


# the simulation ---------------------------------------------------------------

@dataclass
class Run:
    policy: str
    capacity: int
    items: int
    deferred: int = 0  # items that waited in the queue
    skipped: int = 0  # items a skipping policy did not place (the consumer encodes them locally)
    refused: int = 0  # items larger than the whole ring: their room fails at once
    waits: list[float] = field(default_factory=list)  # seconds each deferred item waited
    starts: list[float] = field(default_factory=list)  # when each item was placed (refused, skipped: nan)
    peak_used: int = 0  # most bytes live at once

    @property
    def deferral_rate(self) -> float:
        carried = self.items - self.refused
        return self.deferred / carried if carried else 0.0

    @property
    def skip_rate(self) -> float:
        carried = self.items - self.refused
        return self.skipped / carried if carried else 0.0

    @property
    def miss_rate(self) -> float:
        """Items not placed on arrival (deferred or skipped), over the items the ring could hold."""
        return self.deferral_rate + self.skip_rate

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

    With `until_deferral` it stops at the first item that must wait, is skipped or is refused
    (enough to say the capacity does not carry the trace with no deferral).
    """
    ring = policy.make(capacity)
    run = Run(policy.name, getattr(ring, "capacity", capacity), len(trace), starts=[math.nan] * len(trace))
    live = _Live(policy.name, run.capacity)
    releases: list[tuple[float, int, int]] = []  # (time, item, offset)
    queue: deque[int] = deque()

    pieces = getattr(ring, "pieces", None)  # an allocator whose items may span several extents

    def place(i: int, offset: int, now: float) -> None:
        item = trace[i]
        if pieces is None:
            live.add(offset, item.nbytes)
        else:
            for at, nbytes in pieces(offset):
                live.add(at, nbytes)
        run.peak_used = max(run.peak_used, live.used)
        run.starts[i] = now
        heapq.heappush(releases, (now + item.hold, i, offset))

    def release_until(now: float) -> None:
        while releases and releases[0][0] <= now:
            at = releases[0][0]
            while releases and releases[0][0] == at:  # all releases of one instant, then serve
                _, _, offset = heapq.heappop(releases)
                if pieces is None:
                    live.remove(offset)
                else:
                    for piece, _ in pieces(offset):  # not `at`: the release's time, which placing reads below
                        live.remove(piece)
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
        if offset is None and policy.full == SKIP:
            run.skipped += 1
            if until_deferral:
                return run
            continue
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
    """Whether a ring of `capacity` bytes carries the trace with no deferral, skip or refusal."""
    run = simulate(trace, policy, capacity, until_deferral=True)
    return run.deferred == 0 and run.skipped == 0 and run.refused == 0


def needed_capacity(trace: Sequence[Item], policy: Policy, peak: int) -> int:
    """The least capacity (in the policy's units) the search finds to carry the trace.

    Below the peak in-flight bytes nothing can; from there the capacity doubles until it
    carries, then a binary search (for a power-of-two policy: the least power of two from the
    peak up that carries). Carrying is not monotonic in the capacity (a larger ring places items
    elsewhere, and may fragment worse), so what is promised is local: the answer carries, one
    unit less does not. `robust_capacity` says from where every larger size carries.
    """
    if policy.pow2:
        size = 1 << max(0, peak - 1).bit_length()
        while not carries(trace, policy, size):
            size *= 2
        return size
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


SCAN_TO, SCAN_STEP = 1.5, 0.01  # the robust scan: up to 1.5x the search's answer, in steps of 1% of it


@dataclass(frozen=True)
class Robust:
    """The sizes scanned above the search's answer, and from where every one of them carries."""

    searched: int  # the search's answer
    robust: int | None  # the least size tried from which every larger size tried carries; None: not within the scan
    tried: int  # sizes simulated
    top: int  # the largest size tried
    defers_above: int | None  # the largest size tried, above the answer, that does not carry (None: none)


def scan_sizes(policy: Policy, searched: int, scan_to: float = SCAN_TO, scan_step: float = SCAN_STEP) -> list[int]:
    """The sizes the robust scan tries, smallest first: the answer, then steps up to scan_to x it."""
    if policy.pow2:
        sizes, size = [searched], searched
        while size < searched * scan_to:
            size *= 2
            sizes.append(size)
        return sizes
    unit = policy.unit
    step = max(1, math.ceil(searched * scan_step / unit)) * unit
    return list(range(searched, int(searched * scan_to) + 1, step))


def robust_capacity(trace: Sequence[Item], policy: Policy, searched: int, scan_to: float = SCAN_TO,
                    scan_step: float = SCAN_STEP) -> Robust:
    """Scan sizes above the search's answer, from the top down, for the least from which all carry.

    The search's answer carries, but a larger ring may not (best fit, next fit and the rest place
    differently with more room), so a ring sized by the search alone can defer when given more
    bytes. The scan stops at the first size from the top that does not carry.
    """
    sizes = scan_sizes(policy, searched, scan_to, scan_step)
    robust: int | None = None
    tried = 0
    for size in reversed(sizes):
        tried += 1
        if not carries(trace, policy, size):
            return Robust(searched, robust, tried, sizes[-1], size)
        robust = size
    return Robust(searched, robust, tried, sizes[-1], None)


# the report --------------------------------------------------------------------

DEFAULT_BUDGETS = (512 * MiB, GiB, 2 * GiB, 4 * GiB)


def size_text(nbytes: float) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / MiB:.1f} MiB"


def _policy_figures(trace: Sequence[Item], pol: Policy, peak: int, scan_to: float,
                    scan_step: float) -> dict[str, Any]:
    need = needed_capacity(trace, pol, peak)
    rob = robust_capacity(trace, pol, need, scan_to, scan_step)
    return {"needed_bytes": need, "x_peak": need / peak, "robust_bytes": rob.robust,
            "robust_x_peak": None if rob.robust is None else rob.robust / peak, "scan_top_bytes": rob.top,
            "scan_tried": rob.tried, "misses_above_bytes": rob.defers_above, "on_full": pol.full}


def _at(r: Run) -> dict[str, Any]:
    return {"capacity_bytes": r.capacity, "deferral_rate": r.deferral_rate, "deferred": r.deferred,
            "skip_rate": r.skip_rate, "skipped": r.skipped, "miss_rate": r.miss_rate, "refused": r.refused,
            "p99_wait_s": r.wait_quantile(0.99), "max_wait_s": max(r.waits, default=0.0)}


def _x(x: float | None) -> str:
    return "  (none)" if x is None else f"{x:.2f}x"


def run(spec: TraceSpec = TraceSpec(), budget: int = 2 * GiB, budgets: Sequence[int] = DEFAULT_BUDGETS,
        seeds: int = 1, quiet: bool = False, echo: Callable[..., None] = print, mixes: Sequence[str] = (),
        scan_to: float = SCAN_TO, scan_step: float = SCAN_STEP, spanning: bool = True) -> dict[str, Any]:
    """Print (through `echo`) the figures and return them as a dict (the `--json` object).

    With `spanning` (the default, as the core's `max_pieces=4`), one more policy: ours with items spanning
    up to 4 pieces (`Spanning`), on which the goal is judged; without, ours with one run per item.

    With `seeds` > 1 the bytes ours needs (search and robust) are also found on the traces of
    the next seeds, and the goal of at most `GOAL_X_PEAK` x the peak is judged on the robust
    sizes of all of them. `mixes` adds one table: every policy on each named mix's trace.
    """
    from .progress import Progress

    budget = budget // ALIGN * ALIGN  # a ring's bytes are whole alignment units
    budgets = [b // ALIGN * ALIGN for b in budgets]
    if min(budgets, default=budget) < ALIGN or budget < ALIGN:
        raise ValueError(f"every budget must be at least {ALIGN} bytes")
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if scan_to < 1 or not 0 < scan_step <= 1:
        raise ValueError(f"the scan must reach at least the answer (scan_to >= 1, got {scan_to}) in steps "
                         f"of a share of it in (0, 1] (got {scan_step})")
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        raise ValueError(f"unknown mix {', '.join(unknown)}; the mixes are {', '.join(MIXES)}")
    trace = make_trace(spec)
    peak, peak_items = peak_in_flight(trace)
    pols = policies(trace, spanning)
    judged = SPANNING if spanning else OURS  # the core's default placement: what the goal is about
    table_budgets = sorted(set(budgets) | {budget})
    report: dict[str, Any] = {
        "trace": {**asdict(spec), "distributions": spec.describe()},
        "peak_in_flight_bytes": peak, "peak_in_flight_items": peak_items,
        "largest_item_bytes": max(it.nbytes for it in trace),
        "mean_item_bytes": sum(it.nbytes for it in trace) / len(trace),
        "failed_writes": sum(it.failed for it in trace), "videos": sum(it.video for it in trace),
        "budget_bytes": budget, "scan": {"to_x_answer": scan_to, "step_x_answer": scan_step},
        "policies": {}, "budgets": {},
    }
    echo(f"arena bench: one seeded trace through {len(pols)} allocation policies ({spec.ring} ring)")
    for line in spec.describe():
        echo("  " + line)
    echo(f"  this trace: {report['videos']:,} videos, {report['failed_writes']:,} failed writes; mean item "
         f"{size_text(report['mean_item_bytes'])}, largest {size_text(report['largest_item_bytes'])}; peak in "
         f"flight {size_text(peak)} ({peak_items} items)")
    total = len(pols) * (1 + len(table_budgets)) + (seeds - 1) + len(mixes) * len(pols)
    with Progress("bench-arena", total, unit="runs", enabled=not quiet) as progress:
        done = 0
        for pol in pols:
            figures = _policy_figures(trace, pol, peak, scan_to, scan_step)
            done += 1
            progress.update(done, policy=pol.name)
            per_budget = {}
            for b in table_budgets:
                per_budget[b] = _at(simulate(trace, pol, b))
                done += 1
                progress.update(done, policy=pol.name, budget=size_text(b))
            report["policies"][pol.name] = {**figures, "at_budget": per_budget[budget]}
            for b, at in per_budget.items():
                report["budgets"].setdefault(str(b), {})[pol.name] = at

        echo("")
        echo(f"{'policy':<14} {'when full':>9} {'search':>10} {'x peak':>7} {'robust':>10} {'x peak':>7} "
             f"{'not placed at ' + size_text(budget):>22} {'p99 wait':>9} {'refused':>8}")
        for name, p in report["policies"].items():
            at = p["at_budget"]
            robust = "(none)" if p["robust_bytes"] is None else size_text(p["robust_bytes"])
            echo(f"{name:<14} {p['on_full']:>9} {size_text(p['needed_bytes']):>10} {p['x_peak']:>6.2f}x "
                 f"{robust:>10} {_x(p['robust_x_peak']):>7} {at['miss_rate']:>22.2%} "
                 f"{at['p99_wait_s'] * 1e3:>7.0f}ms {at['refused']:>8}")
        echo(f"(search: the binary search's answer, which carries while one unit less does not; robust: the least "
             f"size from which every size tried up to {scan_to:g}x the answer, in steps of {scan_step:.0%} of it, "
             f"carries; not placed: deferred, or skipped where the policy skips)")
        for name, p in report["policies"].items():
            if p["misses_above_bytes"] is not None:
                echo(f"  {name}: the search's {size_text(p['needed_bytes'])} carries, but "
                     f"{size_text(p['misses_above_bytes'])} does not")
        echo("")
        echo("items not placed on arrival by budget (deferred or skipped; refused items, larger than the whole "
             "ring, in brackets):")
        names = [p.name for p in pols]
        echo(f"{'budget':>10} " + " ".join(f"{n:>14}" for n in names))
        for b in table_budgets:
            cells = []
            for n in names:
                f = report["budgets"][str(b)][n]
                cells.append(f"{f['miss_rate']:>9.2%}" + (f" ({f['refused']})" if f["refused"] else ""))
            echo(f"{size_text(b):>10} " + " ".join(f"{c:>14}" for c in cells))

        # The same draws with no write failing: how much of each figure the quarantine accounts for.
        calm = make_trace(replace(spec, fail_share=0.0))
        calm_peak, _ = peak_in_flight(calm)
        calm_need = {pol.name: needed_capacity(calm, pol, calm_peak) for pol in policies(calm, spanning)}
        report["without_failures"] = {"peak_in_flight_bytes": calm_peak, "needed_bytes": calm_need}
        echo("")
        echo(f"the same draws with no write failing: peak in flight {size_text(calm_peak)}; the search's bytes: "
             + ", ".join(f"{n} {size_text(b)} ({b / calm_peak:.2f}x)" for n, b in calm_need.items()))

        # One seed is one draw: ours on the seeds after it says how far the figure can be trusted.
        first = report["policies"][judged]
        by_seed = {spec.seed: (first["x_peak"], first["robust_x_peak"])}
        ours = next(p for p in pols if p.name == judged)
        for seed in range(spec.seed + 1, spec.seed + seeds):
            other = make_trace(replace(spec, seed=seed))
            other_peak, _ = peak_in_flight(other)
            f = _policy_figures(other, ours, other_peak, scan_to, scan_step)
            by_seed[seed] = (f["x_peak"], f["robust_x_peak"])
            done += 1
            progress.update(done, seed=seed)
        robust_xs = [math.inf if r is None else r for _, r in by_seed.values()]
        ranked = sorted(robust_xs)
        within = sum(x <= GOAL_X_PEAK for x in ranked)
        report["ours_x_peak_by_seed"] = {str(k): v for k, (v, _) in by_seed.items()}
        report["ours_robust_x_peak_by_seed"] = {str(k): r for k, (_, r) in by_seed.items()}
        if seeds > 1:
            echo("")
            echo(f"{judged} over seeds {spec.seed}-{spec.seed + seeds - 1}, robust bytes / peak in flight: min "
                 f"{ranked[0]:.2f}x, median {ranked[len(ranked) // 2]:.2f}x, max {ranked[-1]:.2f}x; within "
                 f"{GOAL_X_PEAK}x on {within} of {seeds} (search / robust: "
                 + ", ".join(f"{k}: {v:.2f}x / {_x(r).strip()}" for k, (v, r) in by_seed.items()) + ")")

        report["mixes"] = {}
        for mix in mixes:
            mixed = make_trace(replace(spec, mix=mix))
            mix_peak, _ = peak_in_flight(mixed)
            at_goal = int(mix_peak * GOAL_X_PEAK) // ALIGN * ALIGN
            rows = {}
            for pol in policies(mixed, spanning):
                f = _policy_figures(mixed, pol, mix_peak, scan_to, scan_step)
                f["at_goal_x_peak"] = _at(simulate(mixed, pol, at_goal))
                rows[pol.name] = f
                done += 1
                progress.update(done, mix=mix, policy=pol.name)
            report["mixes"][mix] = {"peak_in_flight_bytes": mix_peak, "policies": rows}
    if mixes:
        echo("")
        echo(f"every policy on each mix (seed {spec.seed}): search / robust bytes as x the mix's peak in flight; "
             f"items not placed at a ring of {GOAL_X_PEAK}x that peak")
        echo(f"{'mix':<14} {'peak':>10} " + " ".join(f"{n:>30}" for n in names))
        for mix, row in report["mixes"].items():
            cells = [f"{_x(p['x_peak']).strip()} / {_x(p['robust_x_peak']).strip()}, "
                     f"{p['at_goal_x_peak']['miss_rate']:.2%}" for p in row["policies"].values()]
            echo(f"{mix:<14} {size_text(row['peak_in_flight_bytes']):>10} " + " ".join(f"{c:>30}" for c in cells))

    ours_row, nf = report["policies"][judged], report["policies"][NEXT_FIT]
    # Below the peak nothing carries the trace, and a deferral there queues every later arrival behind it
    # while a skip costs one item, so the two are compared only from the peak up.
    worse = [size_text(int(b)) for b, row in report["budgets"].items()
             if int(b) >= peak and row[judged]["miss_rate"] > row[NEXT_FIT]["miss_rate"]]
    mixes_missed = [m for m, row in report["mixes"].items()
                    if (row["policies"][judged]["robust_x_peak"] or math.inf) > GOAL_X_PEAK]
    goal = {"policy": judged, "x_peak_limit": GOAL_X_PEAK, "within_x_peak": within == len(ranked),
            "seeds_within": within,
            "no_worse_than_next_fit": not worse and ours_row["needed_bytes"] <= nf["needed_bytes"],
            "budgets_worse_than_next_fit": worse, "mixes_missed": mixes_missed}
    goal["met"] = goal["within_x_peak"] and goal["no_worse_than_next_fit"] and not mixes_missed
    report["goal"] = goal
    echo("")
    seeds_text = (f"{_x(ours_row['robust_x_peak']).strip()}" if seeds == 1
                  else f"{within} of {seeds} seeds, worst {ranked[-1]:.2f}x")
    echo(f"goal: {judged}'s robust size <= {GOAL_X_PEAK}x peak in flight: "
         f"{'met' if goal['within_x_peak'] else 'MISSED'} "
         f"({seeds_text})"
         + (f"; on every mix: {'MISSED on ' + ', '.join(mixes_missed) if mixes_missed else 'met'}" if mixes else "")
         + f"; no worse than vLLM's next fit (the search's bytes, items not placed at every budget from the peak "
         f"up): "
         f"{'met' if goal['no_worse_than_next_fit'] else 'MISSED'}"
         + (f" (worse at {', '.join(worse)})" if worse else ""))
    return report


def spec_with(**overrides: Any) -> TraceSpec:
    """The default spec with the given fields replaced (None leaves a field as it is)."""
    return replace(TraceSpec(), **{k: v for k, v in overrides.items() if v is not None})
