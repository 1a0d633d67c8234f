"""A tiny BLIP-2 made here (no model hub): config, word-level tokenizer, PIL image processor; and
vLLM's own configuration and v1 Scheduler over it with epd-ring's EC connector. BLIP-2, not LLaVA:
vLLM's LLaVA and PaliGemma modules import torchvision, which has no CPU wheel for our torch here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

IMAGE_TOKEN = 3
WORDS = ["<unk>", "<s>", "</s>", "<image>"] + [f"w{i}" for i in range(60)]
# 28-pixel images in 14-pixel patches: 4 patches, so 4 embeddings (placeholder tokens) per image
TOKENS_PER_IMAGE = 4
CONNECTOR = {"ec_connector": "EpdRingConnector", "ec_connector_module_path": "epd_ring.executor.connectors.vllm"}


def make_tiny_blip2(path: Path) -> Path:
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
    text = OPTConfig(vocab_size=len(WORDS), hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=2,
                     word_embed_proj_dim=64, max_position_embeddings=256)
    config = Blip2Config(vision_config=vision.to_dict(), qformer_config=qformer.to_dict(),
                         text_config=text.to_dict(), num_query_tokens=TOKENS_PER_IMAGE, image_token_index=IMAGE_TOKEN)
    config.architectures = ["Blip2ForConditionalGeneration"]
    config.dtype = "float32"
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    images = BlipImageProcessor(size={"height": 28, "width": 28})
    Blip2Processor(image_processor=images, tokenizer=tokenizer, num_query_tokens=TOKENS_PER_IMAGE).save_pretrained(path)
    return path


def vllm_config(model: Path, ec_role: str, **extra: Any) -> Any:
    from vllm.config import ECTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=str(model), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128,
                      enforce_eager=True, dtype="float32", limit_mm_per_prompt={"image": 2},
                      ec_transfer_config=ECTransferConfig(ec_role=ec_role, **CONNECTOR, **extra))
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


def image_request(request_id: str, mm_hashes: list[str], params: dict[str, Any] | None, max_tokens: int = 2) -> Any:
    """A prompt `w0 <image>*4 w1 <image>*4 ...`, one image per hash, routed by `params`."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    tokens: list[int] = []
    features = []
    for i, h in enumerate(mm_hashes):
        tokens.append(4 + i)
        features.append(MultiModalFeatureSpec(data=None, modality="image", identifier=h,
                                              mm_position=PlaceholderRange(offset=len(tokens),
                                                                           length=TOKENS_PER_IMAGE)))
        tokens.extend([IMAGE_TOKEN] * TOKENS_PER_IMAGE)
    tokens.append(10)
    extra = {"ec_transfer_params": params} if params is not None else None
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, extra_args=extra), None,
                   mm_features=features)


def runner_output(scheduler_output: Any, worker_meta: Any = None) -> Any:
    """What the model runner returns for a step: one sampled token per scheduled request, and the
    connector's worker metadata."""
    from vllm.v1.outputs import ECConnectorOutput, ModelRunnerOutput
    ids = list(scheduler_output.num_scheduled_tokens)
    ec = ECConnectorOutput(ec_connector_worker_meta=worker_meta) if worker_meta is not None else None
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[11] for _ in ids], ec_connector_output=ec)
