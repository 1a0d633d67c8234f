"""What one identity's attack costs another's rooms: the cases of issue 30, replayed on the loopback.

Two identities share one encode worker (an arena of `items` items, default settings otherwise): the
victim ("V", one receiver whose writes land in `victim_write_s`) sends `victim_rate` rooms a second,
the attacker ("A") half that, both Poisson from one seed. Each case runs twice on the same arrivals,
with the attacker and without (the baseline); the clock is a fake one stepped by `step_s`, so a
minute of traffic takes seconds and every run is repeatable. The loop is the one docs/embedding.md
teaches (requests, frames, `pump.tick()`, then the tower while `executor.can_take()`), and a room's
wait counts from its request's arrival to its conclusion, the gate included.

The cases (the attacker's receivers, or its rooms):

- stuck: its receiver's writes never report;
- timeout: its writes time out after 120 s (past the 60 s write deadline; 30 s quarantine after);
- fail: its writes fail at once (30 s quarantine each);
- sessions: four receiver sessions of one key, writes never reporting;
- parked: its rooms' receivers never register, and the victim's frames come 100 ms after its items;
- parked+held: half its rooms park, half go to a receiver whose writes never report, victim as in parked;
- slow: its receiver takes 2 s per write.

Run against a checkout without identity shares (`python -m epd_ring.executor.tools.bench_fairness`
with that checkout first on the path) it gates on `has_deferred()`, as the loop did then, to give
today's figures.
"""

from __future__ import annotations

import inspect
import json
import random
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from epd_ring.executor import (
    EncodeExecutor,
    EncodeItem,
    EncodeManager,
    FakeClock,
    LoopbackTransport,
    Pump,
    ReceiverFrame,
)

HIDDEN = 64
TOKENS = 64
ITEM_BYTES = TOKENS * HIDDEN * 4
CASES = ("stuck", "timeout", "fail", "sessions", "parked", "parked+held", "slow")
GOAL_P99_X = 1.2


class _Tower:
    """Embeddings of zeros: the bench measures the controller, not a tower."""

    num_deepstack_embeddings = 0

    def image_encoder(self, items: list[Any]) -> torch.Tensor:
        return torch.zeros(sum(i.n_tokens for i in items), HIDDEN)

    get_video_feature = image_encoder

    def separate_deepstack_embeds(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return emb, emb[:, :0]


@dataclass
class Run:
    case: str
    attacker: bool
    victim_rooms: int
    victim_failed: int
    p50_ms: float
    p99_ms: float
    peak_arena: float  # the highest share of the main arena in use at once
    attacker_rooms: int = 0
    attacker_failed: int = 0

    @property
    def failed_share(self) -> float:
        return self.victim_failed / self.victim_rooms if self.victim_rooms else 0.0


def _arrivals(rng: random.Random, rate: float, seconds: float) -> list[float]:
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(t)


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def simulate(case: str, attacker: bool, *, seconds: float = 30.0, items: int = 64, victim_rate: float = 20.0,
             victim_write_s: float = 0.003, step_s: float = 0.001, seed: int = 0, tail_s: float = 200.0) -> Run:
    if case not in CASES:
        raise ValueError(f"case must be one of {', '.join(CASES)}, got {case!r}")
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    manager = EncodeManager(transport, clock)
    executor = EncodeExecutor(manager, _Tower(), "cpu", arena_bytes=items * ITEM_BYTES)
    pump = Pump(executor)
    # The loop's gate: `can_take` where the executor has it, else the gate the loop had before it.
    gate: Callable[[], bool] = getattr(executor, "can_take", None) or (lambda: not executor.has_deferred())
    concluded: dict[int, tuple[str, float]] = {}
    pump.on_conclude.append(lambda room, state: concluded.setdefault(room, (state, clock.now())))

    buffers: dict[str, torch.Tensor] = {}

    def frame(room: int, session: str, key: str) -> ReceiverFrame:
        buf = buffers.get(session)
        if buf is None:
            buf = buffers[session] = torch.zeros(TOKENS, HIDDEN)
            transport.add_receiver(session).register(buf)
        return ReceiverFrame(room=room, session=session, dst_ptr=buf.data_ptr(), dst_deep_ptr=0, n_tokens=TOKENS,
                             row_start=0, span=TOKENS, hidden=HIDDEN, dtype="torch.float32", has_deepstack=False,
                             n_receivers=1, identity=key)

    forever = 1 << 30
    transport.inject("delay", session="v", delay=victim_write_s, count=forever)
    a_sessions = [f"a{k}" for k in range(4)] if case == "sessions" else ["a"]
    for s in a_sessions:
        if case in ("stuck", "sessions", "parked+held"):
            transport.inject("hold", session=s, count=forever)
        elif case == "timeout":
            transport.inject("timeout", session=s, delay=120.0, count=forever)
        elif case == "fail":
            transport.inject("fail", session=s, count=forever)
        elif case == "slow":
            transport.inject("delay", session=s, delay=2.0, count=forever)
    late_victim = case.startswith("parked")

    rng = random.Random(seed)
    v_times = _arrivals(rng, victim_rate, seconds)
    a_times = _arrivals(rng, victim_rate / 2, seconds) if attacker else []
    # (time, room, key); victim rooms are even, the attacker's odd.
    events = sorted([(t, 2 * k, "V") for k, t in enumerate(v_times)]
                    + [(t, 2 * k + 1, "A") for k, t in enumerate(a_times)])
    arrivals: dict[int, float] = {}
    pending: deque[tuple[float, int, str]] = deque(events)
    frames_due: deque[tuple[float, ReceiverFrame]] = deque()
    queue: deque[tuple[str, EncodeItem]] = deque()
    peak = 0
    arena = executor.ring.main_arena
    end = seconds + tail_s
    while clock.now() < end:
        now = clock.now()
        while pending and pending[0][0] <= now:
            t, room, key = pending.popleft()
            arrivals[room] = t
            rid = f"r{room}"
            executor.register(rid, "prefill", 1, room, receiver=key)
            if key == "V":
                f = frame(room, "v", key)
                if late_victim:
                    frames_due.append((t + 0.1, f))
                else:
                    manager.register_receiver(f)
            elif case == "parked" or (case == "parked+held" and room % 4 == 1):
                pass  # its receivers never register
            else:
                manager.register_receiver(frame(room, a_sessions[(room // 2) % len(a_sessions)], key))
            queue.append((rid, EncodeItem("image", TOKENS)))
        while frames_due and frames_due[0][0] <= now:
            manager.register_receiver(frames_due.popleft()[1])
        pump.flush()
        pump.tick()
        executor.reap_concluded_senders({rid for rid, _ in queue})
        if queue and gate():
            executor.execute([queue.popleft()])
            pump.flush()
        peak = max(peak, arena.in_use)
        if not pending and all(r in concluded for r in arrivals if r % 2 == 0):
            break
        clock.advance(step_s)
    waits, failed = [], 0
    for room, t in arrivals.items():
        if room % 2:
            continue
        state, at = concluded.get(room, ("unfinished", end))
        if state != "success":
            failed += 1
        else:
            waits.append(at - t)
    a_rooms = [r for r in arrivals if r % 2]
    return Run(case, attacker, len(v_times), failed, 1000 * _quantile(waits, 0.5), 1000 * _quantile(waits, 0.99),
               peak / arena.capacity, len(a_rooms),
               sum(1 for r in a_rooms if concluded.get(r, ("",))[0] != "success"))


def run(cases: tuple[str, ...] = CASES, *, as_json: bool = False, **kw: Any) -> list[dict[str, Any]]:
    """Each case with and without the attacker; print a table (or JSON); return the rows."""
    shares = "identity_ring_share" in inspect.signature(EncodeExecutor).parameters
    rows = []
    for case in cases:
        base = simulate(case, False, **kw)
        hit = simulate(case, True, **kw)
        ratio = hit.p99_ms / base.p99_ms if base.p99_ms else float("nan")
        rows.append({"case": case, "victim_failed": hit.failed_share, "p50_ms": hit.p50_ms, "p99_ms": hit.p99_ms,
                     "baseline_p99_ms": base.p99_ms, "p99_x": ratio, "peak_arena": hit.peak_arena,
                     "baseline_peak_arena": base.peak_arena, "attacker_failed": hit.attacker_failed,
                     "attacker_rooms": hit.attacker_rooms, "victim_rooms": hit.victim_rooms,
                     "goal_met": hit.victim_failed == 0 and ratio <= GOAL_P99_X,
                     "runs": [asdict(base), asdict(hit)]})
    if as_json:
        print(json.dumps({"identity_shares": shares, "rows": [{k: v for k, v in r.items() if k != "runs"}
                                                              for r in rows]}))
        return rows
    print(f"victim {kw.get('victim_rate', 20.0):g} rooms/s, attacker half that, {kw.get('seconds', 30.0):g} s, "
          f"arena of {kw.get('items', 64)} items; identity shares: {'yes' if shares else 'no (has_deferred gate)'}")
    print(f"{'case':<12} {'failed':>7} {'p50 ms':>8} {'p99 ms':>9} {'base p99':>9} {'p99 x':>7} {'peak':>6} "
          f"{'A failed':>9}  goal")
    for r in rows:
        print(f"{r['case']:<12} {r['victim_failed']:>7.1%} {r['p50_ms']:>8.1f} {r['p99_ms']:>9.1f} "
              f"{r['baseline_p99_ms']:>9.1f} {r['p99_x']:>7.2f} {r['peak_arena']:>6.0%} "
              f"{r['attacker_failed']:>4}/{r['attacker_rooms']:<4}  {'met' if r['goal_met'] else 'MISSED'}")
    return rows


if __name__ == "__main__":
    run()
