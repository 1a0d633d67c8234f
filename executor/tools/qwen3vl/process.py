"""A Qwen3-VL prefill worker in its own process, receiving over epd-ring (Mooncake + ZMQ control plane).

It builds the same checkpoint as the encode worker (here: the tiny config under
the same seed), receives through the reference receiver, and answers JSON
commands on stdin, one line each:
  {"cmd": "request", "rid": R, "meta": {...}, "place": {"rank": K, "n": N, "shard": bool}, "bad_dst": bool}
      register a frame per item of the request (bad_dst: point the frames
      outside registered memory, so the engine refuses the write: the
      demo's write fault on a real engine)
  {"cmd": "run", "rid": R, "timeout": T, "peers": [path, ...]}
      wait for the request's rooms; on success run prefill (joining the peer
      shards, saved by rank 1+ workers, in rank order) and save logits and
      greedy tokens; a shard rank > 0 saves its rows for rank 0 instead
  {"cmd": "exit"}
Results go to files (logits are megabytes), their paths in the answer.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

from epd_ring.executor import ReferenceReceiver
from epd_ring.executor.core.frames import frame_to_parts
from epd_ring.executor.drivers.receiver import ask_json_child, child_env, receiver_from_env, spawn_json_child

from . import ArrivalError, Placement, PrefillWorker, hf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def serve(encode_endpoint: str, dtype: str, seed: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    model = hf.build_model(seed=seed, dtype=DTYPES[dtype])
    rcv = receiver_from_env(encode_endpoint, capacity=256 << 20, dtype=DTYPES[dtype])
    worker = PrefillWorker(model, rcv)
    print(json.dumps({"session": rcv.session, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        kind = cmd.get("cmd")
        try:
            if kind == "request":
                worker.accept(cmd["rid"], cmd["meta"], Placement(**cmd["place"]), register=not cmd.get("bad_dst"))
                if cmd.get("bad_dst"):
                    p, _ = worker.requests[cmd["rid"]]
                    outside = rcv.buffer.data_ptr() + rcv.buffer.numel() + (1 << 30)
                    for it in p.items:
                        rcv.send_raw(frame_to_parts(rcv.frames[it.room]._replace(dst_ptr=outside)))
                answer: dict[str, Any] = {"ok": True}
            elif kind == "run":
                answer = run(worker, rcv, cmd, out_dir)
            elif kind == "exit":
                break
            else:
                answer = {"error": f"unknown command {kind!r}"}
        except (ArrivalError, KeyError, ValueError, MemoryError) as exc:
            # One bad request (or a full receive buffer) fails that request, not the worker.
            answer = {"failed": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


def run(worker: PrefillWorker, rcv: ReferenceReceiver, cmd: dict, out_dir: str) -> dict:
    rid = cmd["rid"]
    deadline = time.monotonic() + cmd.get("timeout", 10)
    while worker.outcome(rid) is None and time.monotonic() < deadline:
        rcv.poll(20)
    out = worker.outcome(rid)
    try:
        if out != "success":
            return {"failed": f"{worker.failure(rid)} (told {out or 'nothing'})"}
        _, place = worker.requests[rid]
        if place.shard and place.rank:
            path = os.path.join(out_dir, f"{rid}.shard{place.rank}.pt")
            torch.save([(m.clone(), d.clone() if d is not None else None) for m, d in worker.rows(rid)], path)
            return {"shard": path}
        peers = [torch.load(p) for p in cmd.get("peers", [])]
        t0 = time.perf_counter()
        logits, tokens = worker.run(rid, peers)
        path = os.path.join(out_dir, f"{rid}.{os.getpid()}.pt")
        torch.save((logits.clone(), tokens.clone()), path)
        return {"done": path, "prefill_s": time.perf_counter() - t0}
    finally:
        worker.forget(rid)


class PrefillProcess:
    """The parent's handle on a prefill worker process."""

    def __init__(self, encode_endpoint: str, dtype: str, seed: int, out_dir: str, *, encoder_key: Any = None,
                 keypair: Any = None):
        env, self.public_key = child_env(encoder_key, keypair)
        self.proc, hello = spawn_json_child(["epd_ring.executor.tools.qwen3vl.process", encode_endpoint, dtype,
                                             str(seed), out_dir], env, "prefill")
        self.session = hello["session"]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, **cmd: Any) -> dict:
        return ask_json_child(self.proc, cmd, "prefill")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
