"""Prometheus metrics for an encode worker (the `metrics` extra: prometheus_client).

    from epd_ring.executor.drivers.metrics import instrument
    metrics = instrument(executor)          # registers on prometheus_client's default REGISTRY
    metrics.serve(9400)                     # or expose REGISTRY from the engine's own /metrics

The core only calls an `Observer` (see `core/observe.py`); this module is that
observer plus a collector. On the encode loop's thread the observer does plain
Python bookkeeping (a dict entry, a bucket increment); prometheus_client reads
it, together with extent and room counts by state, only when scraped, from its
own thread (the reads are of whole lists and counters, which the GIL keeps
consistent enough for monitoring).

Failed rooms are labelled by their reason's kind (`ReasonKind`, a closed
set), never by its text, so the label set stays bounded.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable
from typing import Any

from ..core.observe import Observer
from ..core.reasons import ReasonKind
from ..core.transport import Outcome

_perf_counter = time.perf_counter
_DONE = Outcome.DONE

# Failed rooms are counted by their reason's kind: a closed set, so the label set stays bounded.
REASON_KINDS = tuple(k.value for k in ReasonKind)

# Seconds; one set for every histogram, from a copy (tens of microseconds) to a park (minutes).
BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0,
           120.0, 300.0)


class _Histogram:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, n in zip(BUCKETS + (float("inf"),), list(self.counts), strict=True):
            acc += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), acc))
        return out


HISTOGRAMS = {
    "defer_wait": "time an item waited in the deferred queue for a free extent",
    "copy": "time to copy an embedding into its ring extent (wall clock)",
    "park_wait": "time a staged chunk waited parked for its receivers (until sent or failed)",
    "write_latency": "time from submitting a write to its reported outcome",
    "room_lifetime": "time from a room's first event to its conclusion",
}


class RingMetrics(Observer):
    """The observer the core calls, and the figures the collector exports."""

    def __init__(self, executor: Any):
        self.executor = executor
        self.manager = executor.manager
        self.clock = self.manager.clock
        self.outcomes: Counter = Counter()  # success / failed
        self.reasons: Counter = Counter()  # reason kind -> failed rooms
        self.write_outcomes: Counter = Counter()
        self.hist = {name: _Histogram() for name in HISTOGRAMS}
        # Bound once: these run inside the per-item cycle.
        self._now = self.clock.now
        self._defer_wait = self.hist["defer_wait"].observe
        self._copy = self.hist["copy"].observe
        self._park_wait = self.hist["park_wait"].observe
        self._write_latency = self.hist["write_latency"].observe
        self._lifetime = self.hist["room_lifetime"].observe
        self._opened: dict[int, float] = {}
        self._deferred: dict[int, float] = {}
        self._copying: dict[int, float] = {}
        self._parked: dict[int, float] = {}
        self._writes_done = 0

    def attach(self) -> RingMetrics:
        if self.manager.observer is not None and self.manager.observer is not self:
            raise RuntimeError("the manager already has an observer")
        self.manager.observer = self
        self.manager.on_conclude.append(self._concluded)
        return self

    def detach(self) -> None:
        if self.manager.observer is self:
            self.manager.observer = None
        if self._concluded in self.manager.on_conclude:
            self.manager.on_conclude.remove(self._concluded)

    # the observer (loop thread) ---------------------------------------------
    def room_opened(self, room: int) -> None:
        self._opened[room] = self._now()

    def deferred(self, room: int) -> None:
        self._deferred[room] = self._now()

    def undeferred(self, room: int) -> None:
        t = self._deferred.pop(room, None)
        if t is not None:
            self._defer_wait(self._now() - t)

    def copy_started(self, room: int) -> None:
        self._copying[room] = _perf_counter()

    def copy_finished(self, room: int) -> None:
        t = self._copying.pop(room, None)
        if t is not None:
            self._copy(_perf_counter() - t)

    def parked(self, room: int) -> None:
        self._parked[room] = self._now()

    def writes_started(self, room: int) -> None:
        if self._parked:
            t = self._parked.pop(room, None)
            if t is not None:
                self._park_wait(self._now() - t)

    def write_reported(self, room: int, outcome: Any, submitted_at: float) -> None:
        if outcome is _DONE:  # an Enum key hashes in Python: count the common case apart
            self._writes_done += 1
        else:
            self.write_outcomes[outcome] += 1
        self._write_latency(self._now() - submitted_at)

    def _concluded(self, room: int, state: str) -> None:
        now = self._now()
        self.outcomes[state] += 1
        if state == "failed":
            reason = self.manager.failure_reason(room)
            self.reasons[reason.kind.value if reason is not None else ReasonKind.CALLER.value] += 1
        t = self._opened.pop(room, None)
        if t is not None:
            self._lifetime(now - t)
        if self._parked:
            t = self._parked.pop(room, None)
            if t is not None:  # failed while parked: that wait ended too
                self._park_wait(now - t)
        if self._deferred:
            self._deferred.pop(room, None)
        if self._copying:
            self._copying.pop(room, None)

    # the collector (scrape thread) --------------------------------------------
    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        rooms = CounterMetricFamily("epd_ring_rooms_concluded", "rooms concluded, by outcome", labels=["outcome"])
        for outcome in ("success", "failed"):
            rooms.add_metric([outcome], self.outcomes.get(outcome, 0))
        yield rooms
        failures = CounterMetricFamily("epd_ring_room_failures", "failed rooms, by kind of reason",
                                       labels=["reason"])
        for kind in REASON_KINDS:
            failures.add_metric([kind], self.reasons.get(kind, 0))
        yield failures
        writes = CounterMetricFamily("epd_ring_writes_reported", "writes reported by the transport, by outcome",
                                     labels=["outcome"])
        for outcome in Outcome:
            n = self._writes_done if outcome is _DONE else self.write_outcomes.get(outcome, 0)
            writes.add_metric([outcome.value], n)
        yield writes
        ex = self.executor
        ring = ex.ring
        extents = GaugeMetricFamily("epd_ring_extents", "live ring extents, by state", labels=["state"])
        counts = Counter(s.state for s in list(ring.extents.values()))
        from epd_ring.fsm import EXTENT

        for state in EXTENT.states:
            if state != "free":  # a free extent's bytes are back in the arena: it is not counted
                extents.add_metric([state], counts.get(state, 0))
        yield extents
        in_use = GaugeMetricFamily("epd_ring_arena_bytes_in_use", "arena bytes held by live extents",
                                   labels=["arena"])
        largest = GaugeMetricFamily("epd_ring_arena_largest_free_bytes", "the largest free extent of the arena",
                                    labels=["arena"])
        frag = GaugeMetricFamily("epd_ring_arena_fragmentation", "1 - largest free extent / free bytes",
                                 labels=["arena"])
        for name, arena in (("main", ring.main_arena), ("deep", ring.deep_arena)):
            if arena is not None:
                in_use.add_metric([name], arena.in_use)
                largest.add_metric([name], arena.largest_free)
                frag.add_metric([name], arena.fragmentation)
        yield in_use
        yield largest
        yield frag
        room_states = Counter(r.state for r in list(self.manager.rooms.values()))
        live = GaugeMetricFamily("epd_ring_rooms", "live rooms, by state", labels=["state"])
        from epd_ring.fsm import ROOM

        for state in ROOM.states:
            if state not in ("success", "failed"):
                live.add_metric([state], room_states.get(state, 0))
        yield live
        yield GaugeMetricFamily("epd_ring_deferred", "items waiting for room in the arena", value=ex.deferred_count)
        yield GaugeMetricFamily("epd_ring_parked", "rooms whose chunk is parked waiting for receivers",
                                value=room_states.get("parked", 0))
        yield GaugeMetricFamily("epd_ring_writes_in_flight", "writes submitted and not yet reported",
                                value=self.manager.writes_in_flight)
        for name, doc in HISTOGRAMS.items():
            h = self.hist[name]
            buckets = h.buckets()
            yield HistogramMetricFamily(f"epd_ring_{name}_seconds", doc, buckets=buckets, sum_value=h.total)


class _Collector:
    def __init__(self, metrics: RingMetrics):
        self.metrics = metrics

    def collect(self) -> Iterable[Any]:
        return self.metrics.collect()


class Instrumented:
    """What `instrument` returns: the observer, its registry, and `serve(port)`."""

    def __init__(self, metrics: RingMetrics, registry: Any):
        self.metrics = metrics
        self.registry = registry
        self.server: Any = None
        self.port: int | None = None

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP from a thread; return the port (0 picks a free one)."""
        from prometheus_client import start_http_server

        self.server, _ = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self.server.server_port
        return self.port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        self.registry.unregister(self._collector)
        self.metrics.detach()


def instrument(executor: Any, registry: Any = None) -> Instrumented:
    """Attach Prometheus metrics to an executor; register them on `registry` (default: the global one)."""
    from prometheus_client import REGISTRY

    registry = REGISTRY if registry is None else registry
    metrics = RingMetrics(executor).attach()
    out = Instrumented(metrics, registry)
    out._collector = _Collector(metrics)
    registry.register(out._collector)
    return out
