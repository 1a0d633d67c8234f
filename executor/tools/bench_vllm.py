"""`epd-ring bench-vllm`: epd-ring's EC connector beside vLLM's own `ECMooncakeConnector`, on one
two-process workload (executor/tools/vllm_rig.py: vLLM's real Scheduler and worker connectors, the
model's forward left out), both over Mooncake (TCP, 127.0.0.1).

Throughput: `items` requests of one image of `rows` rows each, all added at once to the producer
engine; timed from then until the consumer engine has finished every request (each ran on the
bytes that arrived). A silent receiver: the consumer process is stopped (SIGSTOP) before the
producer gets its one request; timed until the producer's engine stops holding on to it
(`has_pending_push_work` false), and the producer's longest step is how long its thread was held.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MARK = "@@bench-vllm "
CONNECTORS = ("epd-ring", "ECMooncakeConnector")


def _say(obj: dict[str, Any]) -> None:
    print(MARK + json.dumps(obj), flush=True)


def _hear(stream: Any) -> dict[str, Any]:
    for line in stream:
        if line.startswith(MARK):
            return dict(json.loads(line[len(MARK):]))
    raise RuntimeError("the consumer engine died")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _settings(name: str, role: str, port: int, keys: dict[str, Any]) -> tuple[dict, dict | None, dict]:
    """(extra config, connector, more ECTransferConfig fields) of one side."""
    if name == "epd-ring":
        if role == "ec_producer":
            return ({"secret_key": keys["encoder"][1].decode(), "allowed_keys": [keys["consumer"][0].decode()],
                     "arena_bytes": 256 << 20, "write_timeout": 5, "park_timeout": 30}, None, {})
        return ({"secret_key": keys["consumer"][1].decode(), "encoder_key": keys["encoder"][0].decode(),
                 "capacity": 256 << 20, "load_timeout": 120}, None, {})
    return ({"mooncake_protocol": "tcp"}, {"ec_connector": "ECMooncakeConnector"},
            {"ec_ip": "127.0.0.1", "ec_port": port, "ec_buffer_size": 256 << 20, "ec_buffer_device": "cpu"})


def _params(name: str, endpoint: str, port: int, room: int, keys: dict[str, Any]) -> dict[str, Any]:
    if name == "epd-ring":
        host, p = endpoint.removeprefix("tcp://").rsplit(":", 1)
        return {"bootstrap_host": host, "bootstrap_port": int(p), "bootstrap_room": room,
                "receiver": keys["consumer"][0].decode()}
    return {"consumer_zmq": f"tcp://127.0.0.1:{port}"}


def serve(model: str) -> int:
    """The consumer engine, in a child process: one JSON command on stdin, its answer on stdout."""
    from .vllm_rig import Engine, failed, request
    _say({"ready": True})
    cmd = json.loads(sys.stdin.readline())
    engine = Engine(Path(model), "ec_consumer", cmd["extra"], cmd["connector"], cmd["every_step"], **cmd["ec"])
    try:
        ids = [rid for rid, _, _ in cmd["requests"]]
        for rid, images, params in cmd["requests"]:
            engine.add(request(rid, [tuple(i) for i in images], params))
        _say({"started": True})
        engine.run(lambda: all(r in engine.finished for r in ids), cmd["deadline"])
        _say({"finished": len(engine.finished), "failed": sum(1 for w in engine.finished.values() if failed(w))})
    finally:
        engine.close()
    return 0


class _Consumer:
    def __init__(self, model: Path, cmd: dict[str, Any]):
        env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_TARGET_DEVICE="cpu")
        self.proc = subprocess.Popen([sys.executable, "-m", "epd_ring.executor.tools.bench_vllm", str(model)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        _hear(self.proc.stdout)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        _hear(self.proc.stdout)  # its requests are in: its loads go out with its first steps
        self.answer: dict[str, Any] | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            self.answer = _hear(self.proc.stdout)
        except RuntimeError:
            self.answer = {"died": True}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()


def _phase(name: str, phase: str, model: Path, items: int, rows: int, hidden: int, keys: dict[str, Any],
           deadline: float, every_step: bool) -> dict[str, Any]:
    from .vllm_rig import Engine, request

    port = _free_port()
    extra, connector, ec = _settings(name, "ec_producer", port, keys)
    producer = Engine(model, "ec_producer", extra, connector, **ec)
    endpoint = getattr(producer.connector, "endpoint", None) or ""
    n = items if phase == "throughput" else 1
    reqs = [(f"{phase}{k}", [[f"{phase}-{name}-{k}", rows]], _params(name, endpoint, port, 10_000 + k, keys))
            for k in range(n)]
    c_extra, c_connector, c_ec = _settings(name, "ec_consumer", port, keys)
    consumer = _Consumer(model, {"extra": c_extra, "connector": c_connector, "ec": c_ec, "requests": reqs,
                                 "deadline": deadline, "every_step": every_step})
    try:
        if name == "epd-ring":  # its frames first, as a proxy would send the request to both at once
            manager = producer.connector._producer.manager  # read only: which rooms are announced
            producer.run(lambda: all(manager.room_status(10_000 + k) is not None for k in range(n)), deadline)
        else:
            time.sleep(2.0)  # its control server is up once its engine started; no handle to wait on
        if phase == "silent":
            consumer.proc.send_signal(signal.SIGSTOP)
        t0 = time.perf_counter()
        for rid, images, params in reqs:
            producer.add(request(rid, [tuple(i) for i in images], params))
        if phase == "throughput":
            ok = producer.run(lambda: consumer.answer is not None, deadline)
            wall = time.perf_counter() - t0
            got = consumer.answer or {}
            done = got.get("finished", 0) - got.get("failed", 0)
            return {"items": done, "failed": got.get("failed"), "wall_s": round(wall, 3),
                    "items_per_s": round(done / wall, 1) if ok else None,
                    "mb_per_s": round(done * rows * hidden * 4 / wall / 1e6, 2) if ok else None}
        # one step first: the request must be scheduled before "no push pending" means anything
        producer.step()
        ok = producer.run(lambda: not producer.connector_busy() and not producer.sched.has_requests(), deadline)
        return {"silent_unblocked_s": round(time.perf_counter() - t0, 2) if ok else f">{deadline}",
                "silent_failed": sorted(producer.room_failed), "longest_step_s": round(producer.longest_step, 3)}
    finally:
        consumer.close()
        producer.close()


def _one(name: str, model: Path, items: int, rows: int, hidden: int, keys: dict[str, Any],
         deadline: float, every_step: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in ("throughput", "silent"):
        out.update(_phase(name, phase, model, items, rows, hidden, keys, deadline, every_step))
    return out


def run(items: int = 200, rows: int = 64, hidden: int = 1024, connectors: tuple[str, ...] = CONNECTORS,
        deadline: float = 120.0, every_step: bool = False, echo: Any = print) -> dict[str, dict[str, Any]]:
    """`every_step`: the consumer's connector is entered on every step, also those vLLM's model runner
    skips (nothing scheduled); by default only where vLLM's runner enters it."""
    for what, value in (("items", items), ("rows", rows), ("hidden", hidden)):
        if value < 1:
            raise ValueError(f"{what} must be >= 1, got {value}")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    for var in ("MC_TRANSFER_TIMEOUT", "MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC"):
        os.environ.setdefault(var, "5")
    from ..drivers.control import generate_keypair
    from .vllm_rig import make_tiny_blip2

    keys = {"encoder": generate_keypair(), "consumer": generate_keypair()}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_blip2(Path(tmp) / "tiny-blip2", hidden=hidden)
        for name in connectors:
            try:
                results[name] = _one(name, model, items, rows, hidden, keys, deadline, every_step)
            except Exception as exc:  # one connector that cannot run here is a finding, not the end
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            echo(f"{name}: {json.dumps(results[name])}")
    return results


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
