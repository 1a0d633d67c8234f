"""`epd-ring demo --transport mooncake`: the same job across processes over a real engine.

The encode worker runs here (MooncakeTransport, ZMQ control plane, the real tiny
tower); three receiver processes take the rooms, and one of them is killed a
quarter of the way through. Transport faults cannot be scripted on a real
engine, so the injections are registrations (late, partial, never), oversized
images, tower errors and the killed receiver.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections import Counter
from typing import Any

import torch

from ..core.clock import MonotonicClock
from ..core.executor import EncodeExecutor, EncodeItem
from ..core.frames import shard_rows
from ..core.manager import EncodeManager
from ..core.pump import Pump
from ..drivers.control import ZmqControlPlane, generate_keypair
from ..drivers.mooncake import MooncakeTransport
from ..drivers.receiver import ReceiverProcess
from .demo import EXPECT, PoisonableModel, drained, serve_metrics, summary
from .progress import Progress
from .timeline import TimelineRecorder
from .tower import TinyVisionTower

# Relative weights of the faults a real engine lets us inject (no scripted transport faults).
FAULTS = {"late": 6, "partial": 3, "never": 3, "oversized": 3, "receiver_killed": 3, "tower_error": 1}


def run(rooms: int = 300, extents: int = 6, batch: int = 8, fault_rate: float = 0.25, deepstack: bool = True,
        seed: int = 0, quiet: bool = False, json_out: bool = False, stop: Any = None, metrics_port: int | None = None,
        metrics_hook: Any = None, timeline: str | None = None) -> int:
    """Run the demo across processes; print its report (JSON with `json_out`); 0 if every check held."""
    for name, value in (("rooms", rooms), ("extents", extents), ("batch", batch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0.0 <= fault_rate <= 1.0:
        raise ValueError(f"fault_rate must be between 0 and 1, got {fault_rate}")
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", "5")
    os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", "5")
    torch.set_num_threads(1)
    rng = random.Random(seed)
    tower = TinyVisionTower(deepstack_layers=(0, 1) if deepstack else (), seed=seed)
    model = PoisonableModel(tower)
    hidden, deep_w = tower.hidden, tower.hidden * model.num_deepstack_embeddings
    # CURVE on: the encoder's keypair; receivers a and b are ranks of one prefill instance
    # and share its key, the doomed one has its own. Rooms name their receiver's key.
    encoder, instance, doomed = generate_keypair(), generate_keypair(), generate_keypair()
    control = ZmqControlPlane(keypair=encoder, allowed_keys=[instance[0], doomed[0]])
    transport = MooncakeTransport(notifier=control.push_status)
    manager = EncodeManager(transport, MonotonicClock(), park_timeout=3.0, quarantine_s=1.0, write_timeout=30.0)
    # The arena holds `extents` of the largest (64-token) items; smaller ones share it.
    executor = EncodeExecutor(manager, model, "cpu", arena_bytes=extents * 64 * hidden * 4,
                              max_item_bytes=64 * hidden * 4, max_deferred=8 * extents)
    pump = Pump(executor)
    control.attach(pump)  # frames are read on every tick
    serve_metrics(executor, metrics_port, metrics_hook)
    recorder = TimelineRecorder(pump, manager.clock) if timeline else None
    keys = {"a": instance, "b": instance, "doomed": doomed}
    procs = {name: ReceiverProcess(control.endpoint, encoder_key=encoder[0], keypair=keys[name])
             for name in ("a", "b", "doomed")}
    try:
        plans = []
        owner: dict[int, str] = {}
        step = tower.patch * tower.merge
        for k in range(rooms):
            fault = "none"
            if rng.random() < fault_rate:
                fault = rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
            n = 2 if fault == "partial" else rng.choice((1, 1, 2))
            shard = n == 2 and rng.random() < 0.5
            side = step * (16 if fault == "oversized" else rng.randint(1, 8))
            h, w = (side, side) if fault == "oversized" else (step * rng.randint(1, 8), step * rng.randint(1, 8))
            item = EncodeItem("image", tower.tokens_for(h, w), meta={"poison": fault == "tower_error"},
                              pixel_values=torch.randn(3, h, w, generator=torch.Generator().manual_seed(k)))
            names = ["doomed"] if fault == "receiver_killed" else (["a", "b"] if n == 2 else [rng.choice("ab")])
            room = 1_000_000 + k
            for rank, name in enumerate(names):
                procs[name].ask(cmd="expect", room=room, span=item.n_tokens, hidden=hidden, deep=deep_w,
                                n=len(names), rank=rank, shard=shard)
            regs = {"never": [], "partial": names[:1]}.get(fault, names)
            plans.append((room, item, fault, names, shard, regs))
            owner[room] = keys[names[0]][0].decode()
        expected: dict[int, torch.Tensor] = {}
        outcome: dict[int, str] = {}
        pump.on_conclude.append(lambda r, st: outcome.__setitem__(r, st))
        batch_mates: set[int] = set()
        t0 = time.perf_counter()
        progress = Progress("demo", rooms, unit="rooms concluded", enabled=not (quiet or json_out))
        for i in range(0, rooms, batch):
            if stop is not None and stop.requested is not None:
                progress.close()
                return drained(pump, stop, lambda: time.sleep(0.002), len(outcome), rooms, json_out,
                               recorder=recorder, timeline=timeline)
            chunk = plans[i:i + batch]
            for name, proc in procs.items():
                early = [p[0] for p in chunk if p[2] != "late" and name in p[5]]
                if early and proc.proc.poll() is None:
                    proc.ask(cmd="register", rooms=early)
            if i >= rooms // 4 and procs["doomed"].proc.poll() is None:
                procs["doomed"].proc.kill()
                procs["doomed"].proc.wait()
            for room, *_ in chunk:
                executor.register(f"r{room}", "127.0.0.1", 0, room, receiver=owner[room])
            pump.flush()
            # The frames registered above are on their way: wait for them (bounded), so each item meets
            # its receivers as its injection says, whatever the machine's pace (a frame late under load
            # would park its chunk, and enough parked chunks fail a room no fault was injected into).
            alive = {name for name, proc in procs.items() if proc.proc.poll() is None}
            want = {p[0]: len(p[5]) for p in chunk if p[2] != "late" and p[5] and set(p[5]) <= alive}

            def missing(want: dict[int, int] = want) -> bool:
                for r, n in want.items():
                    live = manager.rooms.get(r)
                    if (len(live.frames) < n) if live is not None else manager.room_status(r) is None:
                        return True
                return False

            until = time.monotonic() + 10
            while missing() and time.monotonic() < until:
                pump.tick()
                time.sleep(0.001)
            while not executor.can_take():  # backpressure: no tower run while the arena is full
                pump.tick()
            if any(p[2] == "tower_error" for p in chunk):
                batch_mates.update(p[0] for p in chunk if p[2] != "tower_error")
            executor.execute([(f"r{room}", item) for room, item, *_ in chunk])
            pump.flush()
            for room, item, *_ in chunk:
                if item.encoded is not None:
                    d = item.encoded_deepstack
                    expected[room] = torch.cat([item.encoded, d], 1) if d is not None else item.encoded.clone()
            for name, proc in procs.items():
                late = [p[0] for p in chunk if p[2] == "late" and name in p[5]]
                if late and proc.proc.poll() is None:
                    proc.ask(cmd="register", rooms=late)
            pump.tick()
            executor.reap_concluded_senders(set())
            if recorder is not None:
                recorder.sample()
            progress.update(len(outcome), batch=i // batch, deferred=executor.deferred_count,
                            extents=executor.ring.live)
        deadline = time.monotonic() + 60
        while len(outcome) < rooms and time.monotonic() < deadline:
            pump.tick()
            executor.reap_concluded_senders(set())
            progress.update(len(outcome))
            if recorder is not None:
                recorder.sample()
            time.sleep(0.001)
        progress.close()
        wall = time.perf_counter() - t0
        quiesce = time.monotonic() + 5
        while executor.ring.live and time.monotonic() < quiesce:
            pump.tick()
            if recorder is not None:
                recorder.sample()
            time.sleep(0.005)
        if recorder is not None:
            recorder.write(timeline, f"epd-ring demo over Mooncake: {rooms} rooms, {extents} extents, batch {batch}, "
                                     f"fault rate {fault_rate}, seed {seed} (wall time)")
        # Each receiver's report waits for the statuses of its concluded rooms: on a loaded machine a
        # notice can still be on its way when the encoder has concluded.
        told_to = {name: [p[0] for p in plans if name in p[3] and name in p[5] and p[0] in outcome] for name in procs}
        reports = {name: proc.ask(cmd="report", wait_rooms=told_to[name], timeout=30)
                   for name, proc in procs.items() if proc.proc.poll() is None}
        table: dict[str, Counter] = {}
        mismatched, told_wrong, checked, bad = [], 0, 0, 0
        for room, item, fault, names, shard, regs in plans:
            kind = "batch_mate" if room in batch_mates else fault
            got = outcome.get(room, "unconcluded")
            table.setdefault(kind, Counter())[got] += 1
            if EXPECT[kind] != "either" and got != EXPECT[kind]:
                mismatched.append((room, kind, got, manager.failure_reason(room)))
            for rank, name in enumerate(names):
                if name not in reports or name not in regs:
                    continue
                told = reports[name]["status"].get(str(room))
                if told != [got]:
                    told_wrong += 1
                if got == "success":
                    start, rows = shard_rows(item.n_tokens, rank, len(names)) if shard else (0, item.n_tokens)
                    exp = expected[room][start:start + rows]
                    hsh = hashlib.sha256(exp[:, :hidden].contiguous().numpy().tobytes())
                    if deep_w:
                        hsh.update(exp[:, hidden:].contiguous().numpy().tobytes())
                    checked += exp.numel() * 4
                    if reports[name]["digest"][str(room)] != hsh.hexdigest():
                        bad += exp.numel() * 4
        leaked = executor.ring.live  # extents whose bytes never came back
        return summary(
            f"epd-ring demo over Mooncake (TCP, 127.0.0.1): {rooms} rooms, {extents} extents, batch {batch}, "
            f"deepstack {'on' if deep_w else 'off'}, 3 receiver processes (one killed), seed {seed}",
            table, outcome, mismatched, told_wrong, checked, bad, leaked,
            {"frames_refused": control.stats["frames_refused"], "statuses_dropped": control.stats["status_dropped"]},
            rooms / wall, f"{wall:.2f} s wall", json_out=json_out)
    finally:
        for proc in procs.values():
            proc.close()
        control.close()
