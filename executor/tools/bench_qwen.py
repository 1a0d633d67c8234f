"""`epd-ring bench --model qwen3-vl-tiny`: the split model's real loop beside the unsplit model.

Requests (the demo's mix: images of 224x224 to 1280x720, a video in every third)
run through tower -> controller -> transfer -> prefill (+ 8 greedy tokens), and,
on the same inputs, through the unsplit model's `generate` (tower, prefill and
the same 8 tokens). Time is split by where it is spent:

- tower: inside the vision tower;
- controller: inside `EncodeExecutor.execute` and the pump's `flush` / `tick`
  less the tower and the transport calls (scatter, lease, staging copy into the
  ring extent, rooms, frames, effects);
- transfer: inside the transport's calls, plus (Mooncake) the wait for writes in flight;
- prefill: the language model on what arrived, and the decode steps.

Loopback: one process, one request at a time, so the shares add up to the wall
time. Mooncake: the prefill worker is another process and runs request k while
the encode worker encodes request k+1, as in a deployment; requests/s is then
end to end and prefill shows as the prefill process's own time.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from epd_ring.executor import EncodeExecutor, EncodeManager, Pump

from .demo_qwen import DTYPES, Request, arena_bytes, plan
from .qwen3vl import PrefillWorker, Qwen3VLTower, hf


class _Timer:
    def __init__(self) -> None:
        self.s: Counter = Counter()

    def wrap(self, key: str, fn: Callable) -> Callable:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[key] += time.perf_counter() - t0
        return timed


def _single_worker(reqs: list[Request]) -> None:
    for r in reqs:
        r.workers, r.shard = ["a"], False


def monolithic_s(model: Any, reqs: list[Request]) -> float:
    """Seconds for the unsplit model to answer every request (tower, prefill, 8 greedy tokens)."""
    s = hf.spec(model)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for r in reqs:
            p = r.prompt
            imgs = [i.pixel_values for i in p.items if i.modality == "image"]
            vids = [i.pixel_values for i in p.items if i.modality == "video"]
            kw = dict(input_ids=p.input_ids, mm_token_type_ids=p.mm_token_type_ids(s),
                      pixel_values=torch.cat(imgs) if imgs else None, image_grid_thw=p.grids("image"),
                      pixel_values_videos=torch.cat(vids) if vids else None, video_grid_thw=p.grids("video"))
            model.model.rope_deltas = None
            model.generate(**{k: v for k, v in kw.items() if v is not None},
                           attention_mask=torch.ones_like(p.input_ids), max_new_tokens=8, min_new_tokens=8,
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


class _Encode:
    """The encode side as the benchmark drives it: the executor, its pump, and the pump's calls timed."""

    def __init__(self, ex: EncodeExecutor, timer: _Timer):
        self.ex = ex
        self.pump = Pump(ex)
        # Timed here, not on the pump: `tick` calls `flush` itself, which must not count twice.
        self.tick = timer.wrap("executor", self.pump.tick)
        self.flush = timer.wrap("executor", self.pump.flush)
        # Wrapped here, not on the executor: a compiled executor's methods cannot be replaced (setup.py).
        self.execute = timer.wrap("executor", ex.execute)


def _encode_side(model: Any, transport: Any, manager: EncodeManager, reqs: list[Request], extents: int,
                 timer: _Timer) -> _Encode:
    spec = hf.spec(model)
    tower = Qwen3VLTower(model)
    tower.image_encoder = timer.wrap("tower", tower.image_encoder)
    tower.get_video_feature = timer.wrap("tower", tower.get_video_feature)
    for name in ("submit_write", "poll", "notify", "connect", "peer_reports"):
        setattr(transport, name, timer.wrap("transport", getattr(transport, name)))
    es = torch.tensor([], dtype=model.lm_head.weight.dtype).element_size()
    max_rows = max(it.rows(spec.merge) for r in reqs for it in r.prompt.items)
    ex = EncodeExecutor(manager, tower, "cpu", arena_bytes=arena_bytes(extents, max_rows * spec.hidden * es),
                        max_deferred=8 * extents)
    return _Encode(ex, timer)


def _start(enc: _Encode, r: Request, merge: int) -> list[int]:
    rooms = [it.room for it in r.prompt.items]
    for it in r.prompt.items:
        enc.ex.register(f"room-{it.room}", "127.0.0.1", 0, it.room)
    enc.execute([(f"room-{it.room}", it.encode_item(merge)) for it in r.prompt.items])
    enc.flush()  # the writes go out
    return rooms


def _row(name: str, n: int, wall: float, s: Counter, prefill: float, mono: float) -> list[str]:
    ctrl = s["executor"] - s["tower"] - s["transport"]
    transfer = s["transport"] + s["wait"]
    share = lambda x: f"{100 * x / wall:.1f}%"  # noqa: E731
    return [name, f"{n / wall:.2f}", f"{n / mono:.2f}", f"{1e3 * s['tower'] / n:.1f}", f"{1e3 * ctrl / n:.2f}",
            share(ctrl), f"{1e3 * transfer / n:.2f}", f"{1e3 * prefill / n:.1f}"]


def run_loopback(model: Any, reqs: list[Request], extents: int) -> tuple[float, Counter, float]:
    from epd_ring.executor import FakeClock, LoopbackTransport

    from .demo_qwen import LoopbackPrefillReceiver

    spec = hf.spec(model)
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    manager = EncodeManager(transport, clock, park_timeout=1.0, write_timeout=2.0, quarantine_s=0.5)
    timer = _Timer()
    enc = _encode_side(model, transport, manager, reqs, extents, timer)
    worker = PrefillWorker(model, LoopbackPrefillReceiver(transport, enc.pump, "prefill-a:0", model.dtype))
    prefill_s = 0.0
    t0 = time.perf_counter()
    for r in reqs:
        worker.accept(r.rid, r.prompt.meta(), r.placement("a"))
        _start(enc, r, spec.merge)
        while worker.outcome(r.rid) is None:
            enc.tick()
        if worker.outcome(r.rid) != "success":
            raise RuntimeError(f"{r.rid} failed during the benchmark: {worker.failure(r.rid)}")
        t1 = time.perf_counter()
        worker.run(r.rid)
        prefill_s += time.perf_counter() - t1
        worker.forget(r.rid)
        enc.ex.reap_concluded_senders(())
    return time.perf_counter() - t0, timer.s, prefill_s


def run_mooncake(model: Any, reqs: list[Request], extents: int, dtype: str, seed: int) -> tuple[float, Counter, float]:
    import json
    import tempfile

    from epd_ring.executor import MonotonicClock, MooncakeTransport, ZmqControlPlane

    from .qwen3vl.process import PrefillProcess

    spec = hf.spec(model)
    from epd_ring.executor.drivers.control import generate_keypair

    encoder_keys, instance = generate_keypair(), generate_keypair()  # CURVE on, as in production
    control = ZmqControlPlane(keypair=encoder_keys, allowed_keys=[instance[0]])
    transport = MooncakeTransport(notifier=control.push_status)
    manager = EncodeManager(transport, MonotonicClock(), park_timeout=5.0, quarantine_s=1.0, write_timeout=30.0)
    timer = _Timer()
    enc = _encode_side(model, transport, manager, reqs, extents, timer)
    control.attach(enc.pump)  # frames are read on every tick
    outcome: dict[int, str] = {}
    enc.pump.on_conclude.append(lambda room, state: outcome.__setitem__(room, state))
    prefill_s = 0.0
    with tempfile.TemporaryDirectory(prefix="epd-ring-bench-") as out_dir:
        proc = PrefillProcess(control.endpoint, dtype, seed, out_dir, encoder_key=encoder_keys[0], keypair=instance)
        try:
            for r in reqs:  # frames first, as a scheduler routes requests ahead of encoding
                proc.ask(cmd="request", rid=r.rid, meta=r.prompt.meta(), place=vars(r.placement("a")))
            pending = None
            t0 = time.perf_counter()
            for r in reqs:
                rooms = _start(enc, r, spec.merge)
                w0, polled = time.perf_counter(), 0.0
                while not all(room in outcome for room in rooms):
                    p0 = time.perf_counter()
                    enc.tick()
                    polled += time.perf_counter() - p0
                    time.sleep(0.0002)  # leave the cores to the prefill process while writes fly
                timer.s["wait"] += time.perf_counter() - w0 - polled
                if any(outcome[room] != "success" for room in rooms):
                    raise RuntimeError(f"{r.rid} failed during the benchmark")
                if pending is not None:
                    prefill_s += _answer(proc)
                proc.proc.stdin.write(json.dumps({"cmd": "run", "rid": r.rid, "timeout": 30}) + "\n")
                proc.proc.stdin.flush()
                pending = r
                enc.ex.reap_concluded_senders(())
            if pending is not None:
                prefill_s += _answer(proc)
            wall = time.perf_counter() - t0
        finally:
            proc.close()
            control.close()
    return wall, timer.s, prefill_s


def _answer(proc: Any) -> float:
    import json
    import os

    ans = json.loads(proc.proc.stdout.readline())
    if "done" not in ans:
        raise RuntimeError(f"prefill failed during the benchmark: {ans}")
    os.unlink(ans["done"])
    return float(ans["prefill_s"])


def run(requests: int = 24, dtype: str = "float32", transports: tuple[str, ...] = ("loopback", "mooncake"),
        seed: int = 0, extents: int = 4, repeat: int = 2) -> list[list[str]]:
    torch.set_num_threads(1)
    model = hf.build_model(seed=seed, dtype=DTYPES[dtype])
    reqs = plan(requests, hf.spec(model), seed)
    _single_worker(reqs)
    # Best of `repeat`, interleaved, so load from other jobs on the machine hits both sides alike.
    mono = float("inf")
    best: dict[str, tuple] = {}
    for _ in range(repeat):
        for kind in transports:
            if kind == "loopback":
                res = run_loopback(model, reqs, extents)
            else:
                res = run_mooncake(model, reqs, extents, dtype, seed)
            if kind not in best or res[0] < best[kind][0]:
                best[kind] = res
        mono = min(mono, monolithic_s(model, reqs))
    rows = [_row(kind, len(reqs), *best[kind], mono) for kind in transports]
    head = ["transport", "split req/s", "monolithic req/s", "tower ms/req", "controller ms/req",
            "controller share", "transfer ms/req", "prefill ms/req"]
    print(f"epd-ring bench --model qwen3-vl-tiny ({dtype}, {requests} requests: images 224x224..1280x720, "
          f"a video in every third; 1 torch thread)")
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join("---" for _ in head) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return rows
