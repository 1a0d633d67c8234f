"""`epd-ring demo --model qwen3-vl-tiny`: a real VLM split at the tower, checked bit for bit.

The encode worker runs the Qwen3-VL vision tower under the executor; two
prefill workers receive each item's rows (main ring and deepstack ring) and run
the language model on them. Requests mix images of several sizes and a video;
each goes to one prefill worker, to both as full copies (fanout), or to both as
row shards that rank 0 joins before prefill (as a context-parallel group would
all-gather them). Every delivered request's logits and 8 greedy tokens are
compared with the unsplit model on the same pixels: `torch.equal`.

Faults: one write fails (loopback: the transport fails it; Mooncake: the
receiver registers a destination outside its registered memory, so the engine
refuses the write), and prefill worker `b` is killed after registering its
frames for one wave (its later requests never register, so their rooms expire
parked). Exactly those requests must be reported failed, by every worker that
took part, and all others must be equal.

With `--transport loopback` everything runs in this process on the loopback
transport; with `--transport mooncake` the two prefill workers are processes
receiving over Mooncake (TCP) with frames and statuses on the ZMQ control plane.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from epd_ring.executor import EncodeExecutor, EncodeManager, Pump

from .qwen3vl import MMItem, Placement, Prompt, Qwen3VLTower, build_prompt, hf, monolithic, patchify_video

IMAGE_SIZES = ((224, 224), (448, 448), (480, 640), (720, 1280))
VIDEO_SHAPE = (4, 256, 320)  # frames, height, width: 2 temporal groups of 8 x 10 merged tokens
ROUTES = ("a", "b", "ab", "ab-shard")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Request:
    rid: str
    prompt: Prompt
    workers: list[str]
    shard: bool
    fault: str = "none"  # "write_fail" | "killed" (its worker b died first) | "none"
    reference: tuple[torch.Tensor, torch.Tensor] | None = None
    verdicts: dict[str, str] = field(default_factory=dict)  # worker -> "equal" | "differs: ..." | "failed: ..."
    encode_failures: list[str] = field(default_factory=list)  # the encode side's reason per failed room

    @property
    def expect(self) -> str:
        return "success" if self.fault == "none" else "failed"

    def placement(self, worker: str) -> Placement:
        return Placement(self.workers.index(worker), len(self.workers), self.shard)


def arena_bytes(extents: int, largest: int) -> int:
    """An arena for `extents` of the largest item, whole 64-byte units each."""
    return extents * (largest + (-largest) % 64)


def plan(n_requests: int, spec: hf.Spec, seed: int, first_room: int = 2_000_000) -> list[Request]:
    """Requests of one or two images of mixed sizes, every third with a video, over the four routes."""
    rng = np.random.default_rng(seed)
    processor = hf.image_processor(spec)
    room = first_room
    reqs = []
    for r in range(n_requests):
        items = []
        for _ in range(1 + (r % 2)):
            h, w = IMAGE_SIZES[int(rng.integers(len(IMAGE_SIZES)))]
            pv, grid = hf.process_images(processor, [rng.integers(0, 256, (h, w, 3), dtype=np.uint8)])
            items.append(MMItem("image", tuple(grid[0].tolist()), pixel_values=pv))
        if r % 3 == 2:
            pv, grid = patchify_video(rng.integers(0, 256, (*VIDEO_SHAPE, 3), dtype=np.uint8), spec)
            items.insert(int(rng.integers(len(items) + 1)), MMItem("video", grid, pixel_values=pv))
        for it in items:
            it.room, room = room, room + 1
        route = ROUTES[r % len(ROUTES)]
        reqs.append(Request(f"req-{r}", build_prompt(spec, items, rng), list(route[:2].strip("-")),
                            route.endswith("shard")))
    return reqs


def references(model: Any, reqs: list[Request]) -> float:
    """The unsplit model's logits and greedy tokens per request; returns the seconds spent."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for r in reqs:
            r.reference = monolithic(model, r.prompt)
    return time.perf_counter() - t0


def verdict(r: Request, logits: torch.Tensor, tokens: torch.Tensor) -> str:
    ref_logits, ref_tokens = r.reference
    if logits.dtype == ref_logits.dtype and logits.shape == ref_logits.shape and torch.equal(logits, ref_logits) \
            and torch.equal(tokens, ref_tokens):
        return "equal"
    diff = (logits.float() - ref_logits.float()).abs().max().item() if logits.shape == ref_logits.shape else "shape"
    return f"differs: max |logit diff| {diff}, tokens {tokens.tolist()} vs {ref_tokens.tolist()}"


def report(title: str, reqs: list[Request], extra: list[str]) -> int:
    """Print one line per request and the totals; 0 if every request came out as injected."""
    print(f"\n{title}")
    print(f"{'request':<8} {'items':<34} {'route':<9} {'fault':<11} verdicts")
    wrong = 0
    for r in reqs:
        items = " ".join(f"{i.modality[0]}{'x'.join(map(str, i.grid_thw))}" for i in r.prompt.items)
        route = "+".join(r.workers) + (" shard" if r.shard else "")
        v = ", ".join(f"{w}: {r.verdicts.get(w, 'no verdict')}" for w in r.workers)
        if r.expect == "success":
            ok = len(r.verdicts) == len(r.workers) and all(x == "equal" for x in r.verdicts.values())
        else:
            ok = bool(r.verdicts) and all(x.startswith("failed") for x in r.verdicts.values())
        wrong += not ok
        print(f"{r.rid:<8} {items:<34} {route:<9} {r.fault:<11} {'' if ok else 'WRONG '}{v}")
    n_ok = sum(r.expect == "success" for r in reqs)
    equal = sum(r.expect == "success" and all(x == "equal" for x in r.verdicts.values())
                and len(r.verdicts) == len(r.workers) for r in reqs)
    faulted = [r for r in reqs if r.expect == "failed"]
    reported = sum(all(x.startswith("failed") for x in r.verdicts.values()) and bool(r.verdicts) for r in faulted)
    print(f"requests equal to the monolithic model (logits and 8 greedy tokens): {equal}/{n_ok}")
    print(f"faulted requests reported failed: {reported}/{len(faulted)}")
    for r in faulted:
        print(f"  {r.rid} ({r.fault}) on the encode side: {'; '.join(r.encode_failures) or 'delivered'}")
    for line in extra:
        print(line)
    print("RESULT:", "ok" if not wrong else f"FAILED ({wrong} requests not as injected)")
    return 0 if not wrong else 1


def encode_wave(pump: Pump, wave: list[Request], merge: int, step: Callable[[], None], timeout_s: float,
                host: str = "127.0.0.1") -> dict[int, str]:
    """Register every room of the wave, run the tower once, then step (tick) until each room concluded."""
    executor, manager = pump.executor, pump.manager
    assert executor is not None
    items = [(it.room, it) for r in wave for it in r.prompt.items]
    outcome: dict[int, str] = {}

    def concluded(room: int, state: str) -> None:
        outcome[room] = state

    pump.on_conclude.append(concluded)
    try:
        for room, _ in items:
            executor.register(f"room-{room}", host, 0, room)
        executor.execute([(f"room-{room}", it.encode_item(merge)) for room, it in items])
        pump.flush()  # the writes go out
        deadline = time.monotonic() + timeout_s
        while len(outcome) < len(items) and time.monotonic() < deadline:
            step()
        executor.reap_concluded_senders(())
        for r in wave:
            r.encode_failures = [f"room {it.room}: {manager.failure_reason(it.room) or outcome.get(it.room)}"
                                 for it in r.prompt.items if outcome.get(it.room) != "success"]
    finally:
        pump.on_conclude.remove(concluded)
    return outcome


# -- loopback: everything in this process -----------------------------------------------------
class LoopbackPrefillReceiver:
    """The reference receiver's surface over a loopback receiver: frames go straight to the pump's manager."""

    def __init__(self, transport: Any, pump: Pump, session: str, dtype: torch.dtype):
        from epd_ring.executor import ReceiverFrame, shard_rows

        self._frame, self._shard_rows = ReceiverFrame, shard_rows
        self.rcv = transport.add_receiver(session)
        self.pump, self.session, self.dtype = pump, session, dtype
        self.frames: dict[int, Any] = {}
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.bad_rooms: set[int] = set()

    def expect(self, room: int, *, span: int, hidden: int, deep_width: int = 0, n: int = 1, rank: int = 0,
               shard: bool = False) -> Any:
        start, rows = self._shard_rows(span, rank, n) if shard else (0, span)
        main = torch.full((max(rows, 1), hidden), float("nan"), dtype=self.dtype)
        deep = torch.full((max(rows, 1), deep_width), float("nan"), dtype=self.dtype) if deep_width else None
        for t in (main, deep):
            if t is not None:
                self.rcv.register(t)
        self.frames[room] = self._frame(room, self.session, main.data_ptr(), deep.data_ptr() if deep is not None else 0,
                                        rows, start, span, hidden, str(self.dtype), bool(deep_width), n,
                                        deep_levels=deep_width // hidden)
        self.views[room] = (main[:rows], deep[:rows] if deep is not None else None)
        return self.frames[room]

    def register(self, room: int) -> None:
        if self.rcv.alive:
            self.pump.manager.register_receiver(self.frames[room])
            self.pump.flush()

    def result(self, room: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.views[room]

    @property
    def status(self) -> dict[int, list[str]]:
        told: dict[int, list[str]] = {}
        for n in self.rcv.notices:
            told.setdefault(n.room, []).append(n.status)
        return told


def loopback_session(requests: int = 16, dtype: str = "float32", seed: int = 0, extents: int = 4,
                     kill_wave: int = 2, wave_size: int = 4, quiet: bool = False,
                     tower: Callable[[Any], Any] = Qwen3VLTower) -> tuple[list[Request], dict]:
    """Run the split model in this process on the loopback transport: (requests with verdicts, figures)."""
    from epd_ring.executor import FakeClock, Fault, LoopbackTransport

    from .qwen3vl import PrefillWorker

    model = hf.build_model(seed=seed, dtype=DTYPES[dtype])
    spec = hf.spec(model)
    reqs = plan(requests, spec, seed)
    ref_s = references(model, reqs)
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    manager = EncodeManager(transport, clock, park_timeout=1.0, write_timeout=2.0, quarantine_s=0.5)
    es = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    max_rows = max(it.rows(spec.merge) for r in reqs for it in r.prompt.items)
    # The arena holds `extents` of the largest items (a video); images and videos share it by their bytes.
    executor = EncodeExecutor(manager, tower(model), "cpu",
                              arena_bytes=arena_bytes(extents, max_rows * spec.hidden * es), max_deferred=8 * extents)
    pump = Pump(executor)
    receivers = {w: LoopbackPrefillReceiver(transport, pump, f"prefill-{w}:0", DTYPES[dtype]) for w in "ab"}
    # Each worker runs the same checkpoint (here: the same seed) as the encode worker's full model.
    workers = {w: PrefillWorker(model, receivers[w]) for w in "ab"}
    fail_ptrs: set[int] = set()
    transport.policy = lambda session, bufs: Fault("fail") if bufs[0][1] in fail_ptrs else None
    inject_write_fault(reqs)
    kill_wave = min(kill_wave, (len(reqs) - 1) // wave_size)
    alive = {"a": True, "b": True}

    def step() -> None:
        pump.tick()
        clock.advance(0.01)

    t0 = time.perf_counter()
    for w0 in range(0, len(reqs), wave_size):
        wave = reqs[w0:w0 + wave_size]
        killing = w0 // wave_size == kill_wave
        for r in wave:
            if not all(alive[w] for w in r.workers) or (killing and "b" in r.workers):
                r.fault = "killed"
            for w in r.workers:
                if alive[w]:
                    workers[w].accept(r.rid, r.prompt.meta(), r.placement(w))
            if r.fault == "write_fail":
                fail_ptrs.add(receivers["a"].frames[r.prompt.items[0].room].dst_ptr)
        if killing:  # after b registered this wave's frames, before any byte is written
            receivers["b"].rcv.kill()
            alive["b"] = False
        encode_wave(pump, wave, spec.merge, step, timeout_s=60)
        for r in wave:
            collect(r, {w: workers[w] for w in r.workers if alive[w]}, dead=[w for w in r.workers if not alive[w]])
        if not quiet:
            print(f"  wave {w0 // wave_size}: {sum(v == 'equal' for r in wave for v in r.verdicts.values())} "
                  f"equal verdicts, {executor.ring.live} extents live", flush=True)
    wall = time.perf_counter() - t0
    for _ in range(300):  # let every quarantine pass
        step()
    leaked = executor.ring.live  # extents whose bytes never came back
    return reqs, {"leaked": leaked, "reference_s": ref_s, "wall_s": wall, "levels": spec.levels,
                  "kill_wave": kill_wave}


def inject_write_fault(reqs: list[Request]) -> None:
    """The write of the first later request that goes to worker a alone fails."""
    for r in reqs[1:]:
        if r.workers == ["a"]:
            r.fault = "write_fail"
            return


def run_loopback(requests: int = 16, dtype: str = "float32", seed: int = 0, extents: int = 4,
                 quiet: bool = False) -> int:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    reqs, fig = loopback_session(requests, dtype, seed, extents, quiet=quiet)
    rc = report(f"epd-ring demo --model qwen3-vl-tiny (loopback, {dtype}, deepstack {fig['levels']} levels): "
                f"{len(reqs)} requests, 2 prefill workers (b killed in wave {fig['kill_wave']}), {extents} extents, "
                f"seed {seed}", reqs,
                [f"monolithic reference: {fig['reference_s']:.2f} s; split run: {fig['wall_s']:.2f} s; "
                 f"extents leaked: {fig['leaked']}"])
    return rc or int(fig["leaked"] > 0)


def collect(r: Request, workers: dict[str, Any], dead: list[str]) -> None:
    """Each live worker's verdict on an in-process request; a dead one is a failure of its request."""
    for w in dead:
        r.verdicts[w] = "failed: prefill worker killed"
    shard_rows_of = {}
    if r.shard:
        for w, wk in workers.items():
            if wk.outcome(r.rid) == "success":
                shard_rows_of[w] = wk.rows(r.rid)
    for w in sorted(workers, key=r.workers.index):  # rank 0 first: a shard peer's verdict is rank 0's
        wk = workers[w]
        out = wk.outcome(r.rid)
        if out != "success":
            r.verdicts[w] = f"failed: {wk.failure(r.rid)} (told {out or 'nothing'})"
        elif r.shard and r.workers.index(w) != 0:
            # Its rows were checked as part of rank 0's joined prefill.
            r.verdicts[w] = r.verdicts.get(r.workers[0], "failed: rank 0 absent")
        else:
            peers = [shard_rows_of[p] for p in r.workers[1:] if p in shard_rows_of] if r.shard else ()
            try:
                r.verdicts[w] = verdict(r, *wk.run(r.rid, peers))
            except Exception as exc:  # a refused arrival is that request's failure, reported
                r.verdicts[w] = f"failed: {exc}"
        wk.forget(r.rid)


# -- Mooncake: prefill workers in their own processes ----------------------------------------
def mooncake_session(requests: int = 16, dtype: str = "float32", seed: int = 0, extents: int = 4,
                     kill_wave: int = 2, wave_size: int = 4, quiet: bool = False) -> tuple[list[Request], dict]:
    """The same over Mooncake, the prefill workers in their own processes: (requests with verdicts, figures)."""
    import os
    import tempfile

    from epd_ring.executor import MonotonicClock, MooncakeTransport, ZmqControlPlane
    from epd_ring.executor.drivers.control import generate_keypair

    from .qwen3vl.process import PrefillProcess

    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", "5")
    os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", "5")
    torch.set_num_threads(1)
    model = hf.build_model(seed=seed, dtype=DTYPES[dtype])
    spec = hf.spec(model)
    reqs = plan(requests, spec, seed)
    ref_s = references(model, reqs)
    # CURVE on: the prefill workers are ranks of one instance and share its key.
    encoder_keys, instance = generate_keypair(), generate_keypair()
    control = ZmqControlPlane(keypair=encoder_keys, allowed_keys=[instance[0]])
    transport = MooncakeTransport(notifier=control.push_status)
    manager = EncodeManager(transport, MonotonicClock(), park_timeout=3.0, quarantine_s=1.0, write_timeout=30.0)
    es = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    max_rows = max(it.rows(spec.merge) for r in reqs for it in r.prompt.items)
    executor = EncodeExecutor(manager, Qwen3VLTower(model), "cpu",
                              arena_bytes=arena_bytes(extents, max_rows * spec.hidden * es), max_deferred=8 * extents)
    pump = Pump(executor)
    control.attach(pump)  # frames are read on every tick
    inject_write_fault(reqs)
    kill_wave = min(kill_wave, (len(reqs) - 1) // wave_size)
    with tempfile.TemporaryDirectory(prefix="epd-ring-qwen-") as out_dir:
        procs = {w: PrefillProcess(control.endpoint, dtype, seed, out_dir, encoder_key=encoder_keys[0],
                                   keypair=instance) for w in "ab"}
        try:
            t0 = time.perf_counter()
            for w0 in range(0, len(reqs), wave_size):
                wave = reqs[w0:w0 + wave_size]
                killing = w0 // wave_size == kill_wave
                for r in wave:
                    if not all(procs[w].alive for w in r.workers) or (killing and "b" in r.workers):
                        r.fault = "killed"
                    for w in r.workers:
                        if procs[w].alive:
                            ans = procs[w].ask(cmd="request", rid=r.rid, meta=r.prompt.meta(),
                                               place=vars(r.placement(w)), bad_dst=r.fault == "write_fail")
                            if "failed" in ans:
                                r.verdicts[w] = f"failed: {ans['failed']}"
                if killing:  # after b registered this wave's frames, before any byte is written
                    procs["b"].kill()

                def step() -> None:
                    pump.tick()
                    time.sleep(0.001)

                encode_wave(pump, wave, spec.merge, step, timeout_s=60)
                for r in wave:
                    collect_remote(r, procs)
                if not quiet:
                    print(f"  wave {w0 // wave_size}: {sum(v == 'equal' for r in wave for v in r.verdicts.values())} "
                          f"equal verdicts, {executor.ring.live} extents live", flush=True)
            wall = time.perf_counter() - t0
            quiesce = time.monotonic() + 5
            while executor.ring.live and time.monotonic() < quiesce:
                pump.tick()
                time.sleep(0.005)
            leaked = executor.ring.live  # extents whose bytes never came back
        finally:
            for p in procs.values():
                p.close()
            control.close()
    return reqs, {"leaked": leaked, "reference_s": ref_s, "wall_s": wall, "levels": spec.levels,
                  "kill_wave": kill_wave, "frames_refused": control.stats["frames_refused"]}


def run_mooncake(requests: int = 16, dtype: str = "float32", seed: int = 0, extents: int = 4,
                 quiet: bool = False) -> int:
    reqs, fig = mooncake_session(requests, dtype, seed, extents, quiet=quiet)
    rc = report(f"epd-ring demo --model qwen3-vl-tiny --transport mooncake ({dtype}, deepstack {fig['levels']} "
                f"levels): {len(reqs)} requests, encode worker + 2 prefill processes (b killed in wave "
                f"{fig['kill_wave']}), {extents} extents, seed {seed}", reqs,
                [f"monolithic reference: {fig['reference_s']:.2f} s; split run: {fig['wall_s']:.2f} s wall; "
                 f"extents leaked: {fig['leaked']}; frames refused: {fig['frames_refused']}"])
    return rc or int(fig["leaked"] > 0)


def collect_remote(r: Request, procs: dict[str, Any]) -> None:
    """Ask each worker of the request for its outcome; rank 0 of a shard group joins the others' rows."""
    peers = []
    for w in sorted(r.workers, key=r.workers.index, reverse=r.shard):  # shard ranks > 0 first
        if w in r.verdicts:
            continue
        if not procs[w].alive:
            r.verdicts[w] = "failed: prefill process killed"
            continue
        try:
            ans = procs[w].ask(cmd="run", rid=r.rid, timeout=10, peers=peers)
        except RuntimeError as exc:
            r.verdicts[w] = f"failed: {exc}"
            continue
        if "failed" in ans:
            r.verdicts[w] = f"failed: {ans['failed']}"
        elif "shard" in ans:
            peers.append(ans["shard"])
        else:
            logits, tokens = torch.load(ans["done"])
            r.verdicts[w] = verdict(r, logits, tokens)
    if r.shard:
        for w in r.workers[1:]:  # a shard rank's rows were checked inside rank 0's prefill
            r.verdicts.setdefault(w, r.verdicts.get(r.workers[0], "failed: rank 0 absent"))
