"""The consumer side of a two-engine vLLM run with epd-ring's EC connector (the engine:
executor/tools/vllm_rig.py).

Run as a process (`python tests/vllm_peer.py MODEL_DIR`) it is the consumer engine: one JSON
command per line on stdin, one JSON answer per line on stdout:
  {"cmd": "run", "extra": {...ec_connector_extra_config}, "requests": [[id, [[hash, rows], ...], params]],
   "deadline": S, "abort": [ids to abort once their loads are asked for]}
answers (a line after MARK) {"loaded": {mm_hash: sha256}, "failed": [ids], "finished": [ids],
"unfinished": [ids], "regions_left": [rooms whose region
never came back]}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from epd_ring.executor.tools.vllm_rig import Engine, digest, failed, request

HIDDEN = 64  # the tiny BLIP-2's text width: what vLLM's encoder cache holds per row


MARK = "@@epd-ring "  # vLLM logs to stdout too: answers are the lines that start with this


def say(obj: dict) -> None:
    print(MARK + json.dumps(obj), flush=True)


def hear(stream: Any) -> dict:
    """The next answer on a child's stdout, past vLLM's log lines."""
    for line in stream:
        if line.startswith(MARK):
            return dict(json.loads(line[len(MARK):]))
    raise EOFError("the consumer engine died")


class Watched(dict):
    """vLLM's encoder cache, with a sha256 of each entry as it is put (vLLM frees an entry once used)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, str] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        self.digests.setdefault(key, digest(value))
        super().__setitem__(key, value)


def consume(model: Path, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.request import RequestStatus

    engine = Engine(model, "ec_consumer", cmd["extra"])
    try:
        engine.encoder_cache = cache = Watched()
        ids = []
        hashes = {}
        for rid, images, params in cmd["requests"]:
            engine.add(request(rid, [tuple(i) for i in images], params))
            ids.append(rid)
            hashes[rid] = [h for h, _ in images]
        deadline = cmd.get("deadline", 60)
        aborted = set(cmd.get("abort", ()))
        if aborted:  # aborted once their loads were asked for: the loads are cancelled, the regions withdrawn
            state = engine.sched.ec_connector._state
            engine.run(lambda: all(state.get(h) == "loading" for r in aborted for h in hashes[r]), deadline)
            engine.sched.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
        rest = [r for r in ids if r not in aborted]
        engine.run(lambda: all(r in engine.finished for r in rest), deadline)
        # every region comes back: consumed, released after a failure, or acknowledged after a withdraw
        receivers = engine.connector._consumer.receivers
        engine.run(lambda: not any(list(rcv.regions) for rcv in list(receivers.values())), deadline)
        return {"loaded": cache.digests,
                "failed": sorted(r for r, why in engine.finished.items() if failed(why)),
                "finished": sorted(engine.finished),
                "unfinished": sorted(r for r in rest if r not in engine.finished),
                "regions_left": sorted(room for rcv in list(receivers.values()) for room in list(rcv.regions))}
    finally:
        engine.close()


def main() -> int:
    model = Path(sys.argv[1])
    import vllm.v1.core.sched.scheduler  # noqa: F401  (vLLM's import is most of a run's start-up)
    say({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            return 0
        say(consume(model, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
