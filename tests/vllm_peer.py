"""One side of a two-engine vLLM run with epd-ring's EC connector: vLLM's real v1 Scheduler, the
worker connector built by vLLM's own `ensure_ec_transfer_initialized`, and each step's connector
calls made by vLLM's own model-runner mixin (`ECConnectorModelRunnerMixin`); only the model's
forward is left out (the encoder's output is a seeded tensor per item, the sampler a fixed token).

Run as a process (`python tests/vllm_peer.py MODEL_DIR`) it is the consumer engine: one JSON
command per line on stdin, one JSON answer per line on stdout:
  {"cmd": "run", "extra": {...ec_connector_extra_config}, "requests": [[id, [[hash, rows], ...], params]],
   "deadline": S}
answers (a line after MARK) {"loaded": {mm_hash: sha256}, "failed": [ids], "finished": [ids],
"unfinished": [ids]}.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm_tiny import IMAGE_TOKEN, scheduler, vllm_config

HIDDEN = 64  # the tiny BLIP-2's text width: what vLLM's encoder cache holds per row


def encoder_output(mm_hash: str, rows: int, width: int) -> Any:
    """The 'encoder output' of an item: seeded by its hash, so both sides know what must arrive."""
    import torch
    seed = int.from_bytes(hashlib.sha256(mm_hash.encode()).digest()[:8], "big") >> 1
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


def digest(t: Any) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def request(request_id: str, images: list[tuple[str, int]], params: dict[str, Any] | None, max_tokens: int = 1) -> Any:
    """A prompt `w0 <image>*rows0 w1 <image>*rows1 ... w`: one image per (hash, rows)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    tokens: list[int] = []
    features = []
    for i, (h, rows) in enumerate(images):
        tokens.append(4 + i)
        features.append(MultiModalFeatureSpec(data=None, modality="image", identifier=h,
                                              mm_position=PlaceholderRange(offset=len(tokens), length=rows)))
        tokens.extend([IMAGE_TOKEN] * rows)
    tokens.append(10)
    extra = {"ec_transfer_params": params} if params is not None else None
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, extra_args=extra), None,
                   mm_features=features)


class Engine:
    """vLLM's scheduler and worker connector in this process, stepped as its engine core would."""

    def __init__(self, model: Path, role: str, extra: dict[str, Any]):
        from vllm.distributed.ec_transfer import ec_transfer_state

        self.config = vllm_config(model, role, ec_connector_extra_config=extra)
        ec_transfer_state.ensure_ec_transfer_initialized(self.config)
        self.connector = ec_transfer_state.get_ec_transfer()
        self.sched = scheduler(self.config)
        self.width = HIDDEN * (1 + int(extra.get("deepstack_levels", 0)))
        self.encoder_cache: dict[str, Any] = {}
        self.finished: dict[str, Any] = {}  # request id -> finish reason
        # what the workers told the scheduler, over the run (producer: rooms concluded or failed)
        self.concluded: set[str] = set()
        self.room_failed: dict[str, str] = {}

    def add(self, req: Any) -> None:
        self.sched.add_request(req)

    def step(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin as Mixin

        out = self.sched.schedule()
        # vLLM's model runner calls the mixin on every producer step; on a consumer's only where tokens
        # are scheduled (see docs/vllm.md): here on every step, so loads start while requests wait.
        with Mixin.maybe_get_ec_connector_output(out, self.encoder_cache) as ec_out:
            for rid, inputs in out.scheduled_encoder_inputs.items():
                req = self.sched.requests[rid]
                for i in inputs:
                    h = req.mm_features[i].identifier
                    self.encoder_cache[h] = encoder_output(h, req.get_num_encoder_embeds(i), self.width)
                    Mixin.maybe_save_ec_to_connector(self.encoder_cache, h)
        meta = ec_out.ec_connector_worker_meta if ec_out is not None else None
        if meta is not None:
            self.concluded |= meta.concluded
            self.room_failed.update(meta.failed)
        for h in out.free_encoder_mm_hashes:
            self.encoder_cache.pop(h, None)
        ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[[11] for _ in ids], ec_connector_output=ec_out)
        for eco in self.sched.update_from_output(out, runner).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason

    def connector_busy(self) -> bool:
        return bool(self.sched.ec_connector.has_pending_push_work())

    def run(self, until: Any, deadline: float) -> bool:
        """Step until `until()` or `deadline` seconds pass; whether `until()` held."""
        end = time.monotonic() + deadline
        while not until():
            if time.monotonic() > end:
                return False
            self.step()
            time.sleep(0.002)
        return True

    def close(self) -> None:
        from vllm.distributed.ec_transfer import ec_transfer_state
        ec_transfer_state.ensure_ec_transfer_shutdown()


def failed(reason: Any) -> bool:
    from vllm.v1.engine import FinishReason
    return bool(reason == FinishReason.ERROR)  # what vLLM gives a request it took as unavailable


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
    engine = Engine(model, "ec_consumer", cmd["extra"])
    try:
        engine.encoder_cache = cache = Watched()
        ids = []
        for rid, images, params in cmd["requests"]:
            engine.add(request(rid, [tuple(i) for i in images], params))
            ids.append(rid)
        engine.run(lambda: all(r in engine.finished for r in ids), cmd.get("deadline", 60))
        return {"loaded": cache.digests,
                "failed": sorted(r for r, why in engine.finished.items() if failed(why)),
                "finished": sorted(engine.finished),
                "unfinished": sorted(r for r in ids if r not in engine.finished)}
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
