"""A reference receiver (the prefill role), for tests, the demo and integrators.

It registers one receive buffer once, carves a region per room out of it,
sends registration frames to the encode worker's control endpoint, collects
the status pushes and hands back the received embeddings.

Run as a process, it takes JSON commands on stdin, one per line, and answers
one JSON line each (used by the end-to-end tests):
  {"cmd": "expect", "room": R, "span": S, "hidden": H, "deep": D, "n": N, "rank": K, "shard": bool}
  {"cmd": "register", "rooms": [R, ...]}       send those rooms' frames now
  {"cmd": "raw", "parts_hex": [...]}           send arbitrary multipart (hostile frames)
  {"cmd": "report", "wait_rooms": [...], "timeout": T}   statuses and sha256 of received bytes
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any

import torch
import zmq

from ..core.frames import ReceiverFrame, frame_to_parts, shard_rows
from .mooncake import load_engine

_ALIGN = 64


class ReferenceReceiver:
    def __init__(self, encode_endpoint: str, *, capacity: int = 64 << 20, hostname: str = "127.0.0.1",
                 dtype: torch.dtype = torch.float32):
        self.engine, self.session = load_engine(hostname)
        self.dtype = dtype
        self.buffer = torch.zeros(capacity, dtype=torch.uint8)
        rc = self.engine.register_memory(self.buffer.data_ptr(), capacity)
        if rc != 0:
            raise RuntimeError(f"registering the receive buffer failed: rc={rc}")
        self._next = 0
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(encode_endpoint)
        self.status_sock = self.ctx.socket(zmq.PULL)
        self.status_sock.setsockopt(zmq.LINGER, 0)
        port = self.status_sock.bind_to_random_port(f"tcp://{hostname}")
        self.status_endpoint = f"tcp://{hostname}:{port}"
        self.frames: dict[int, ReceiverFrame] = {}
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.status: dict[int, list[str]] = {}

    def _carve(self, nbytes: int) -> torch.Tensor:
        start = self._next
        self._next = start + ((max(nbytes, 1) + _ALIGN - 1) // _ALIGN) * _ALIGN
        if self._next > self.buffer.numel():
            raise MemoryError("receive buffer exhausted")
        return self.buffer[start:start + nbytes]

    def expect(self, room: int, *, span: int, hidden: int, deep_width: int = 0, n: int = 1, rank: int = 0,
               shard: bool = False) -> ReceiverFrame:
        if deep_width % hidden:
            raise ValueError(f"deepstack width {deep_width} is no multiple of hidden {hidden}")
        row_start, rows = shard_rows(span, rank, n) if shard else (0, span)
        es = torch.tensor([], dtype=self.dtype).element_size()
        main = self._carve(rows * hidden * es).view(self.dtype).view(rows, hidden)
        deep = self._carve(rows * deep_width * es).view(self.dtype).view(rows, deep_width) if deep_width else None
        frame = ReceiverFrame(room, self.session, main.data_ptr() if rows else self.buffer.data_ptr(),
                              (deep.data_ptr() if rows else self.buffer.data_ptr()) if deep_width else 0,
                              rows, row_start, span, hidden, str(self.dtype), bool(deep_width), n,
                              self.status_endpoint, deep_width // hidden)
        self.frames[room] = frame
        self.views[room] = (main, deep)
        return frame

    def register(self, room: int) -> None:
        self.push.send_multipart(frame_to_parts(self.frames[room]))

    def send_raw(self, parts: list[bytes]) -> None:
        self.push.send_multipart(parts)

    def poll(self, timeout_ms: int = 0) -> int:
        n = 0
        while self.status_sock.poll(timeout_ms if n == 0 else 0):
            room, status, _session, _reason = self.status_sock.recv_multipart()
            self.status.setdefault(int(room), []).append(status.decode())
            n += 1
        return n

    def result(self, room: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.views[room]

    def digest(self, room: int) -> str:
        main, deep = self.views[room]
        h = hashlib.sha256(main.contiguous().numpy().tobytes())
        if deep is not None:
            h.update(deep.contiguous().numpy().tobytes())
        return h.hexdigest()


def serve(encode_endpoint: str) -> None:
    r = ReferenceReceiver(encode_endpoint)
    print(json.dumps({"session": r.session, "status_endpoint": r.status_endpoint}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        kind = cmd["cmd"]
        if kind == "expect":
            r.expect(cmd["room"], span=cmd["span"], hidden=cmd["hidden"], deep_width=cmd.get("deep", 0),
                     n=cmd.get("n", 1), rank=cmd.get("rank", 0), shard=cmd.get("shard", False))
            print(json.dumps({"ok": True}), flush=True)
        elif kind == "register":
            for room in cmd["rooms"]:
                r.register(room)
            print(json.dumps({"ok": True}), flush=True)
        elif kind == "raw":
            r.send_raw([bytes.fromhex(p) for p in cmd["parts_hex"]])
            print(json.dumps({"ok": True}), flush=True)
        elif kind == "report":
            deadline = time.monotonic() + cmd.get("timeout", 0)
            wait = set(cmd.get("wait_rooms", []))
            while True:
                r.poll(20)
                if all(r.status.get(room) for room in wait) or time.monotonic() > deadline:
                    break
            print(json.dumps({"status": {str(k): v for k, v in r.status.items()},
                              "digest": {str(k): r.digest(k) for k in r.views}}), flush=True)
        elif kind == "exit":
            break


if __name__ == "__main__":
    serve(sys.argv[1])


class ReceiverProcess:
    """A receiver in its own process, driven by the JSON-line commands of `serve`."""

    def __init__(self, encode_endpoint: str):
        import os
        import subprocess

        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "epd_ring.executor.drivers.receiver", encode_endpoint],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("receiver process failed to start")
        self.session = json.loads(line)["session"]

    def ask(self, **cmd: Any) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("receiver process died")
        return json.loads(line)

    def close(self) -> None:
        import signal

        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
