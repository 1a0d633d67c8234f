"""vLLM engines over a tiny BLIP-2 made here (no model hub), with an encoder-cache connector, for the
tests and `epd-ring bench-vllm`: vLLM's real v1 Scheduler, the worker connector vLLM's own
`ensure_ec_transfer_initialized` builds, each step's connector calls made by vLLM's own model-runner
mixin (`ECConnectorModelRunnerMixin`); only the model's forward is left out (an item's encoder output
is a tensor seeded by its hash, the sampler gives a fixed token).

BLIP-2, not LLaVA: vLLM's LLaVA and PaliGemma modules import torchvision, which has no CPU wheel for
our torch here. The connector is named by module path (as a user configures it), never imported:
tools do not import the engine adapters.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

IMAGE_TOKEN = 3
WORDS = ["<unk>", "<s>", "</s>", "<image>"] + [f"w{i}" for i in range(60)]
# 28-pixel images in 14-pixel patches: 4 patches, so 4 embeddings (placeholder tokens) per image
TOKENS_PER_IMAGE = 4
CONNECTOR = {"ec_connector": "EpdRingConnector", "ec_connector_module_path": "epd_ring.executor.connectors.vllm"}


def make_tiny_blip2(path: Path, hidden: int = 64) -> Path:
    """The model's files in `path`; `hidden`: the text width, so the encoder-cache entries' width."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        Blip2Config,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        BlipImageProcessor,
        OPTConfig,
        PreTrainedTokenizerFast,
    )
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    vision = Blip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               image_size=28, patch_size=14)
    qformer = Blip2QFormerConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 encoder_hidden_size=32)
    text = OPTConfig(vocab_size=len(WORDS), hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=2,
                     num_attention_heads=2, word_embed_proj_dim=hidden, max_position_embeddings=256)
    config = Blip2Config(vision_config=vision.to_dict(), qformer_config=qformer.to_dict(),
                         text_config=text.to_dict(), num_query_tokens=TOKENS_PER_IMAGE, image_token_index=IMAGE_TOKEN)
    config.architectures = ["Blip2ForConditionalGeneration"]
    config.dtype = "float32"
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    images = BlipImageProcessor(size={"height": 28, "width": 28})
    Blip2Processor(image_processor=images, tokenizer=tokenizer, num_query_tokens=TOKENS_PER_IMAGE).save_pretrained(path)
    return path


def vllm_config(model: Path, ec_role: str, connector: dict[str, Any] | None = None, **extra: Any) -> Any:
    """vLLM's configuration over the tiny model; `connector` replaces epd-ring's (vLLM's own, say)."""
    from vllm.config import ECTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=str(model), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128,
                      enforce_eager=True, dtype="float32", limit_mm_per_prompt={"image": 2},
                      ec_transfer_config=ECTransferConfig(ec_role=ec_role, **(connector or CONNECTOR), **extra))
    return args.create_engine_config()


def scheduler(config: Any) -> Any:
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    config.cache_config.num_gpu_blocks = 64
    return Scheduler(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                     block_size=16, log_stats=False)


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
    """vLLM's scheduler and worker connector in this process, stepped as its engine core would.

    `connector`: vLLM's `ec_connector` settings (epd-ring's by default); `ec`: more `ECTransferConfig`
    fields (`ec_ip`, `ec_port`, ... for vLLM's own connector). `every_step`: enter a consumer's
    connector on every step, also those vLLM's runner skips (nothing scheduled)."""

    def __init__(self, model: Path, role: str, extra: dict[str, Any], connector: dict[str, Any] | None = None,
                 every_step: bool = False, **ec: Any):
        self.every_step = every_step
        from vllm.distributed.ec_transfer import ec_transfer_state

        self.config = vllm_config(model, role, connector, ec_connector_extra_config=extra, **ec)
        hidden = self.config.model_config.get_inputs_embeds_size()
        self.width = hidden * (1 + int(extra.get("deepstack_levels", 0)))
        # what vLLM's start-up measures with a dummy encode (its own connector sizes pushes by it)
        self.config.ec_transfer_config.mm_encoder_output_widths = {"image": self.width}
        ec_transfer_state.ensure_ec_transfer_initialized(self.config)
        self.connector = ec_transfer_state.get_ec_transfer()
        self.connector.start_worker_services()  # vLLM's worker does this once its model is loaded
        self.sched = scheduler(self.config)
        self.encoder_cache: dict[str, Any] = {}
        self.finished: dict[str, Any] = {}  # request id -> finish reason
        # what the workers told the scheduler over the run (epd-ring's producer: rooms concluded or failed)
        self.concluded: set[str] = set()
        self.room_failed: dict[str, str] = {}
        self.longest_step = 0.0  # seconds: the engine's thread is held this long at worst

    def add(self, req: Any) -> None:
        self.sched.add_request(req)

    def step(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin as Mixin

        t0 = time.perf_counter()
        out = self.sched.schedule()
        # as vLLM's model runner: the connector's context on every producer step, on a consumer's only
        # when tokens are scheduled (an empty step returns before it)
        consumer_only = self.connector.is_consumer and not self.connector.is_producer
        if consumer_only and not out.total_num_scheduled_tokens and not self.every_step:
            ctx: Any = contextlib.nullcontext()
        else:
            ctx = Mixin.maybe_get_ec_connector_output(out, self.encoder_cache)
        with ctx as ec_out:
            for rid, inputs in out.scheduled_encoder_inputs.items():
                req = self.sched.requests[rid]
                for i in inputs:
                    h = req.mm_features[i].identifier
                    self.encoder_cache[h] = encoder_output(h, req.get_num_encoder_embeds(i), self.width)
                    Mixin.maybe_save_ec_to_connector(self.encoder_cache, h)
        meta = ec_out.ec_connector_worker_meta if ec_out is not None else None
        if meta is not None and hasattr(meta, "concluded"):
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
        self.longest_step = max(self.longest_step, time.perf_counter() - t0)

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


__all__ = ["CONNECTOR", "IMAGE_TOKEN", "TOKENS_PER_IMAGE", "Engine", "digest", "encoder_output", "failed",
           "make_tiny_blip2", "request", "scheduler", "vllm_config"]
