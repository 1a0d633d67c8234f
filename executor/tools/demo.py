"""`epd-ring demo`: the controller under ring pressure, late registrations and faults.

A real (tiny) torch vision tower encodes images of varied sizes; an encode loop
drives the executor on the loopback transport with a simulated clock, so park,
write and quarantine deadlines pass in simulated time while the work is real.
At the end every delivered byte is compared with the tower's output, and every
room's outcome with what was injected into it.
"""

from __future__ import annotations

import json
import random
import sys
import time
import warnings
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..core.clock import FakeClock
from ..core.executor import EncodeExecutor, EncodeItem
from ..core.frames import ReceiverFrame, shard_rows
from ..core.loopback import Fault, LoopbackTransport
from ..core.manager import EncodeManager
from ..core.pump import Pump
from .progress import Progress
from .timeline import TimelineRecorder
from .tower import TinyVisionModel, TinyVisionTower

FAULTS = ("none", "late", "partial", "never", "write_fail", "timeout_land_later", "oversized",
          "tower_error", "receiver_killed")
EXPECT = {"none": "success", "late": "success", "partial": "failed", "never": "failed",
          "write_fail": "failed", "timeout_land_later": "failed", "oversized": "failed",
          "tower_error": "failed", "batch_mate": "failed", "receiver_killed": "either"}


@dataclass
class RoomPlan:
    room: int
    rid: str
    item: EncodeItem
    fault: str
    sessions: list[str]
    shard: bool
    register_at: list[int | None]  # tick of each receiver's frame; None: never
    arrive_at: int
    expected: torch.Tensor | None = None
    buffers: dict = field(default_factory=dict)  # session -> (main, deep, row_start, rows)


class PoisonableModel(TinyVisionModel):
    """Raises inside the tower when a batch holds an item marked as poison."""

    def get_image_feature(self, items):
        if any(i.meta.get("poison") for i in items):
            raise RuntimeError("injected tower failure (poisoned image)")
        return super().get_image_feature(items)

    image_encoder = get_image_feature


def plan_rooms(n_rooms: int, rng: random.Random, tower: TinyVisionTower, fault_rate: float,
               deepstack: bool) -> list[RoomPlan]:
    plans = []
    step = tower.patch * tower.merge
    for r in range(n_rooms):
        fault = "none"
        if rng.random() < fault_rate:
            # A tower error fails its whole batch, so it is kept rare.
            fault = rng.choices(FAULTS[1:], weights=[4, 3, 2, 3, 3, 2, 0.3, 1])[0]
        n = rng.choice((1, 1, 2))
        shard = n > 1 and rng.random() < 0.5
        if fault == "partial" and n == 1:
            n = 2
        h = step * rng.randint(1, 8)
        w = step * rng.randint(1, 8)
        if fault == "oversized":
            h = w = step * 16
        pixels = torch.randn(3, h, w, generator=torch.Generator().manual_seed(10_000 + r))
        item = EncodeItem("image", tower.tokens_for(h, w), pixel_values=pixels, meta={"poison": fault == "tower_error"})
        arrive = r // 2
        sessions = (["prefill-doomed:0"] if fault == "receiver_killed"
                    else [f"prefill-{k}:{rng.randint(0, 3)}" for k in range(n)])
        if fault == "receiver_killed":
            n, shard = 1, False
        if fault == "late":
            register_at = [arrive + rng.randint(1, 40) for _ in range(n)]
        elif fault == "never":
            register_at = [None] * n
        elif fault == "partial":
            register_at = [arrive] + [None] * (n - 1)
        else:
            register_at = [arrive - rng.randint(0, 2) if rng.random() < 0.7 else arrive + rng.randint(0, 3)
                           for _ in range(n)]
        plans.append(RoomPlan(1_000_000 + r, f"req-{r}", item, fault, sessions, shard, register_at, arrive))
    return plans


def _renamed(extents: int, deprecated: dict[str, int]) -> int:
    """`extents`, or what `run` was given under its deprecated name `slots` (with a warning)."""
    unknown = sorted(set(deprecated) - {"slots"})  # the only deprecated name
    if unknown:
        raise TypeError(f"run() got unexpected keyword arguments: {', '.join(unknown)}")
    if "slots" in deprecated:
        warnings.warn("demo.run(slots=) is deprecated and goes in the next release; use extents=",
                      DeprecationWarning, stacklevel=3)
        return deprecated["slots"]
    return extents


def run(rooms: int = 2000, extents: int = 6, batch: int = 8, fault_rate: float = 0.25, deepstack: bool = True,
        seed: int = 0, tick_s: float = 0.01, quiet: bool = False, json_out: bool = False, stop: Any = None,
        metrics_port: int | None = None, metrics_hook: Any = None, timeline: str | None = None,
        **deprecated: int) -> int:
    """Run the demo; print its report (JSON with `json_out`); 0 if every check held, 1 if not.

    `stop.requested` (see `shutdown.DrainOnSignal`) set mid-run drains the executor and reports that.
    With `metrics_port`, Prometheus metrics are served from the start (see `serve_metrics`); with
    `timeline`, extent occupancy over time is drawn into that SVG file at the end.
    `slots` is the deprecated name of `extents`, kept for one release.
    """
    extents = _renamed(extents, deprecated)
    for name, value in (("rooms", rooms), ("extents", extents), ("batch", batch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0.0 <= fault_rate <= 1.0:
        raise ValueError(f"fault_rate must be between 0 and 1, got {fault_rate}")
    torch.set_num_threads(1)
    rng = random.Random(seed)
    tower = TinyVisionTower(deepstack_layers=(0, 1) if deepstack else (), seed=seed)
    model = PoisonableModel(tower)
    n_deep = model.num_deepstack_embeddings
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    manager = EncodeManager(transport, clock, park_timeout=1.0, write_timeout=2.0, quarantine_s=0.5)
    max_tokens = 8 * 8  # plan_rooms draws images of up to 8 x 8 merged tokens; larger ones are "oversized"
    extent_bytes = max_tokens * tower.hidden * 4
    # The arena holds `extents` of the largest items; smaller ones share it (an item takes its own bytes).
    executor = EncodeExecutor(manager, model, "cpu", arena_bytes=extents * extent_bytes, max_item_bytes=extent_bytes,
                              max_deferred=8 * extents)
    pump = Pump(executor)  # does what the executor decides: writes, notices, contacts
    plans = plan_rooms(rooms, rng, tower, fault_rate, deepstack)
    serve_metrics(executor, metrics_port, metrics_hook)
    recorder = TimelineRecorder(pump, clock) if timeline else None

    # Receivers and their buffers; a fault policy keyed by destination pointer.
    write_faults: dict[int, Fault] = {}
    for p in plans:
        n = len(p.sessions)
        for k, session in enumerate(p.sessions):
            rcv = transport.receivers.get(session) or transport.add_receiver(session)
            span = p.item.n_tokens
            row_start, rows = shard_rows(span, k, n) if p.shard else (0, span)
            main = torch.full((max(rows, 1), tower.hidden), float("nan"))
            rcv.register(main)
            deep = None
            if n_deep:
                deep = torch.full((max(rows, 1), tower.hidden * n_deep), float("nan"))
                rcv.register(deep)
            p.buffers[session] = (main, deep, row_start, rows)
        first = p.buffers[p.sessions[0]][0].data_ptr()
        if p.fault == "write_fail":
            write_faults[first] = Fault("fail")
        elif p.fault == "timeout_land_later":
            write_faults[first] = Fault("timeout_land_later", delay=0.05, land_after=0.3)
    transport.policy = lambda session, bufs: write_faults.get(bufs[0][1])

    def frame_for(p: RoomPlan, k: int) -> ReceiverFrame:
        session = p.sessions[k]
        main, deep, row_start, rows = p.buffers[session]
        return ReceiverFrame(p.room, session, main.data_ptr(), deep.data_ptr() if deep is not None else 0, rows,
                             row_start, p.item.n_tokens, tower.hidden, "torch.float32", bool(n_deep),
                             len(p.sessions), deep_levels=n_deep)

    frames_at: dict[int, list[tuple[RoomPlan, int]]] = {}
    for p in plans:
        for k, t in enumerate(p.register_at):
            if t is not None:
                frames_at.setdefault(max(t, 0), []).append((p, k))
    arrivals = deque(sorted(plans, key=lambda p: p.arrive_at))
    queue: deque[RoomPlan] = deque()
    batch_mates: set[int] = set()
    kill_tick = rooms // 4
    last_frame_tick = max(frames_at) if frames_at else 0
    outcome: dict[int, str] = {}
    pump.on_conclude.append(lambda room, state: outcome.__setitem__(room, state))

    t0 = time.perf_counter()
    progress = Progress("demo", rooms, unit="rooms concluded", enabled=not (quiet or json_out))
    tick = 0
    while True:
        if stop is not None and stop.requested is not None:
            progress.close()
            return drained(pump, stop, lambda: clock.advance(tick_s), len(outcome), rooms, json_out,
                           recorder=recorder, timeline=timeline)
        for p, k in frames_at.pop(tick, ()):
            manager.register_receiver(frame_for(p, k))
        while arrivals and arrivals[0].arrive_at <= tick:
            p = arrivals.popleft()
            executor.register(p.rid, "prefill-bootstrap", 8998, p.room)
            queue.append(p)
        pump.flush()  # what the frames and registrations decided goes out before the tower runs
        if tick == kill_tick:
            doomed = transport.receivers.get("prefill-doomed:0")
            if doomed is not None:
                doomed.kill()
        if queue and executor.can_take():  # backpressure: no tower run while the arena is full
            run_now = [queue.popleft() for _ in range(min(batch, len(queue)))]
            if any(p.item.meta["poison"] for p in run_now):
                # a room that already concluded (its receiver's peer went down first) is not failed by the batch
                batch_mates.update(p.room for p in run_now if not p.item.meta["poison"] and p.room not in outcome)
            executor.execute([(p.rid, p.item) for p in run_now])
            pump.flush()
            if recorder is not None:
                recorder.sample()  # after the writes went out, before their outcomes
            for p in run_now:
                if p.item.encoded is not None:
                    enc, deep = p.item.encoded, p.item.encoded_deepstack
                    p.expected = torch.cat([enc, deep], dim=1) if deep is not None else enc.clone()
        pump.tick()
        executor.reap_concluded_senders({p.rid for p in queue})
        if recorder is not None:
            recorder.sample()
        clock.advance(tick_s)
        tick += 1
        progress.update(len(outcome), tick=tick, queued=len(queue), deferred=executor.deferred_count,
                        arena_used=f"{executor.ring.main_arena.in_use * 100 // executor.ring.main_arena.capacity}%")
        if len(outcome) == rooms and not queue and tick > last_frame_tick:
            break
        if tick > 100_000:
            progress.close()
            print(f"demo did not converge: {len(outcome)} of {rooms} rooms concluded after {tick} ticks",
                  file=sys.stderr)
            return 1
    progress.close()
    wall = time.perf_counter() - t0
    # Quiesce: let every quarantine and late landing pass.
    for _ in range(int(3.0 / tick_s)):
        clock.advance(tick_s)
        pump.tick()
        if recorder is not None:
            recorder.sample()
    if recorder is not None:
        recorder.write(timeline, f"epd-ring demo: {rooms} rooms, {extents} extents, batch {batch}, "
                                 f"fault rate {fault_rate}, seed {seed} (simulated time)")

    # Check every byte and every outcome.
    table: dict[str, Counter] = {}
    mismatched = []
    checked_bytes = 0
    bad_bytes = 0
    told_wrong = 0
    for p in plans:
        fault = "batch_mate" if p.room in batch_mates else p.fault
        got = outcome.get(p.room, "unconcluded")
        table.setdefault(fault, Counter())[got] += 1
        want = EXPECT[fault]
        if want != "either" and got != want:
            mismatched.append((p.room, fault, got, manager.failure_reason(p.room)))
        for session, (main, deep, row_start, rows) in p.buffers.items():
            rcv = transport.receivers[session]
            told = rcv.statuses(p.room)
            if rcv.alive and p.register_at[p.sessions.index(session)] is not None and told[-1:] != [got]:
                told_wrong += 1
            landed = got == "success" or (fault == "timeout_land_later" and not torch.isnan(main).all())
            if landed and rows:
                exp = p.expected[row_start:row_start + rows]
                full = torch.cat([main[:rows], deep[:rows]], dim=1) if deep is not None else main[:rows]
                checked_bytes += full.numel() * 4
                if not torch.equal(full, exp):
                    bad_bytes += full.numel() * 4
    leaked = executor.ring.live  # extents whose bytes never came back

    return summary(
        f"epd-ring demo: {rooms} rooms, {extents} extents, batch {batch}, deepstack {'on' if n_deep else 'off'}, "
        f"seed {seed}", table, outcome, mismatched, told_wrong, checked_bytes, bad_bytes, leaked,
        {"late_landings": transport.late_landings, "deferred_sends": manager.stats["deferred"]},
        rooms / wall, f"{wall:.2f} s wall, {tick} ticks", json_out=json_out)


def serve_metrics(executor: EncodeExecutor, port: int | None, hook: Any = None) -> Any:
    """Serve the executor's Prometheus metrics on `port` (0: any free port) for the rest of the process.

    The URL goes to stderr; `hook(instrumented)` gets the handle (tests scrape and close it).
    """
    if port is None:
        return None
    from prometheus_client import CollectorRegistry

    from ..drivers.metrics import instrument

    inst = instrument(executor, registry=CollectorRegistry())
    bound = inst.serve(port)
    print(f"metrics: http://127.0.0.1:{bound}/metrics", file=sys.stderr, flush=True)
    if hook is not None:
        hook(inst)
    return inst


def drained(pump: Pump, stop: Any, idle: Any, concluded: int, rooms: int, json_out: bool,
            timeout: float = 10.0, recorder: Any = None, timeline: str | None = None) -> int:
    """Drain `pump`'s executor after SIGTERM or Ctrl-C, report what the drain did, and exit as the signal asks."""
    if recorder is not None:
        def idle_and_sample(idle=idle) -> None:
            idle()
            recorder.sample()
        idle = idle_and_sample
    report = pump.close(timeout, idle)
    if recorder is not None:
        recorder.sample()  # the arena retired
        recorder.write(timeline, f"epd-ring demo, drained after {concluded} of {rooms} rooms concluded")
    name = {130: "Ctrl-C", 143: "SIGTERM"}.get(stop.exit_code, "signal")
    if json_out:
        print(json.dumps({"interrupted": name, "rooms_concluded_before": concluded, "rooms": rooms,
                          "drain": asdict(report)}, sort_keys=True))
    else:
        print(f"\n{name}: drained after {concluded} of {rooms} rooms concluded: "
              f"{report.rooms_failed} rooms failed and told, {report.rooms_finished} finished their writes; "
              + ("ring retired and unregistered, transport closed" if report.clean
                 else f"NOT clean: extents still live {report.busy_extents}, "
                      f"{report.writes_in_flight} writes in flight"))
    return stop.exit_code if report.clean else 1


def summary(title: str, table: dict, outcome: dict, mismatched: list, told_wrong: int, checked: int, bad: int,
            leaked: int, extra: dict, items_per_s: float, timing: str, json_out: bool = False) -> int:
    """Print the demo's closing report (or one JSON object); 0 if every check held, 1 if not."""
    ok = not mismatched and not bad and not leaked and not told_wrong
    if json_out:
        print(json.dumps({
            "title": title, "ok": ok, "outcomes": dict(Counter(outcome.values())),
            "by_injection": {f: dict(c) for f, c in sorted(table.items())},
            "mismatched": [{"room": r, "injected": f, "got": g, "reason": why} for r, f, g, why in mismatched],
            "told_wrong": told_wrong, "bytes_checked": checked, "bytes_differing": bad, "extents_leaked": leaked,
            "items_per_s": items_per_s, **extra}, sort_keys=True))
        return 0 if ok else 1
    print(f"\n{title}")
    print(f"{'injected':<20} {'rooms':>6} {'success':>8} {'failed':>7}   expected")
    for fault in sorted(table, key=lambda f: (f != "none", f)):
        c = table[fault]
        print(f"{fault:<20} {sum(c.values()):>6} {c['success']:>8} {c['failed']:>7}   {EXPECT[fault]}")
    total = Counter(outcome.values())
    print(f"{'total':<20} {sum(sum(c.values()) for c in table.values()):>6} {total['success']:>8} "
          f"{total['failed']:>7}")
    print(f"outcomes differing from the injection: {len(mismatched)}")
    for room, fault, got, reason in mismatched[:10]:
        print(f"  room {room} ({fault}): {got}: {reason}")
    print(f"receivers told a wrong or no outcome:  {told_wrong}")
    print(f"delivered bytes checked: {checked}, differing from the tower output: {bad}")
    print(", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in extra.items()))
    print(f"extents leaked: {leaked}")
    print(f"throughput: {items_per_s:.0f} items/s ({timing})")
    print("RESULT:", "ok" if ok else "FAILED")
    return 0 if ok else 1
