"""Every call into transformers' Qwen3-VL, in one place.

The rest of the adapter speaks tensors and grids; only this module knows
transformers' classes, their keyword names and the internals prefill needs
(`get_rope_index`, the text model's `visual_pos_masks` /
`deepstack_visual_embeds`, the cache keyword). `check_surface()` names each of
them, and the test suite calls it, so an upgrade that renames or reshapes one
fails loudly there instead of silently changing logits.

Tested with transformers 5.24.0 (the `qwen` extra pins the 5.x series).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

TESTED_VERSION = "5.24.0"

# The tiny model: real Qwen3-VL architecture (vision blocks with 2-D rotary and
# learned position grid, patch merger, two deepstack mergers; text decoder with
# interleaved M-RoPE), small enough for a forward in tens of milliseconds on CPU.
TINY = {
    "vision": dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                   temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                   num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
    "text": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                  "mrope_interleaved": True}),
    "tokens": dict(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503),
}


@dataclass(frozen=True)
class Spec:
    """What the adapter needs to know about a model, read once from its config."""

    hidden: int  # text hidden size = rows' width on the wire
    levels: int  # deepstack levels
    patch: int
    temporal_patch: int
    merge: int
    image_token: int
    video_token: int
    vision_start: int
    vision_end: int
    vocab: int


def build_model(name: str = "qwen3-vl-tiny", *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A Qwen3VLForConditionalGeneration with random weights from `seed`; nothing is downloaded."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if name != "qwen3-vl-tiny":
        raise ValueError(f"unknown model {name!r}; this adapter builds only 'qwen3-vl-tiny' (no downloads)")
    cfg = Qwen3VLConfig(vision_config=dict(TINY["vision"]), text_config=dict(TINY["text"]), **TINY["tokens"])
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    return model.to(dtype)


def spec(model: Any) -> Spec:
    c = model.config
    v, t = c.vision_config, c.text_config
    return Spec(hidden=t.hidden_size, levels=len(v.deepstack_visual_indexes), patch=v.patch_size,
                temporal_patch=v.temporal_patch_size, merge=v.spatial_merge_size, image_token=c.image_token_id,
                video_token=c.video_token_id, vision_start=c.vision_start_token_id,
                vision_end=c.vision_end_token_id, vocab=t.vocab_size)


def image_processor(s: Spec, *, max_pixels: int = 1280 * 736) -> Any:
    """The Qwen2-VL image processor (PIL backend) built from arguments, not from a hub config."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=s.patch, temporal_patch_size=s.temporal_patch, merge_size=s.merge,
                                    min_pixels=(s.patch * s.merge) ** 2, max_pixels=max_pixels)


def process_images(processor: Any, images: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """HWC uint8 images -> (pixel_values [patches, C*T*P*P], grid_thw [n, 3])."""
    out = processor(images=list(images), return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


# -- encode ------------------------------------------------------------------------------
def encode(model: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The vision tower on packed patches: (merged rows [N, H], deepstack levels L x [N, H])."""
    visual = model.model.visual
    out = visual(pixel_values.to(visual.dtype), grid_thw=grid_thw, return_dict=True)
    return out.pooler_output, list(out.deepstack_features)


# -- prefill -----------------------------------------------------------------------------
def embed_tokens(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    return model.model.language_model.embed_tokens(input_ids)


def rope_index(model: Any, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor,
               image_grid_thw: torch.Tensor | None,
               video_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE positions [3, 1, S] and the delta decode positions add, from the grids."""
    return model.model.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw,
                                      video_grid_thw=video_grid_thw)


def language_model(model: Any, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: Any,
                   visual_pos_masks: torch.Tensor | None = None,
                   deepstack: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
    """Decoder plus lm_head: (logits [1, S, vocab], the cache to decode from)."""
    out = model.model.language_model(inputs_embeds=inputs_embeds, position_ids=position_ids, cache=cache,
                                     use_cache=True, visual_pos_masks=visual_pos_masks,
                                     deepstack_visual_embeds=None if deepstack is None else list(deepstack))
    return model.lm_head(out.last_hidden_state), out.cache


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config.text_config)


def decode_step(model: Any, token: torch.Tensor, cache: Any, delta: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """One greedy decode step from `cache`, with positions as `generate` builds them.

    `generate` passes four rows (text positions, then the three M-RoPE rows,
    which for text tokens are the text position plus the prompt's rope delta).
    """
    past = cache.get_seq_length()
    text = torch.tensor([[past]], dtype=torch.long)
    position_ids = torch.cat([text[None], (text + delta)[None].expand(3, -1, -1)], dim=0)
    return language_model(model, embed_tokens(model, token.view(1, 1)), position_ids, cache)


# -- the monolithic reference ----------------------------------------------------------------
def monolithic(model: Any, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, *,
               pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
               pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
               new_tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsplit model, as a user would call it: (prefill logits [1, S, V], greedy tokens [new_tokens])."""
    kw = dict(input_ids=input_ids, mm_token_type_ids=mm_token_type_ids, pixel_values=pixel_values,
              image_grid_thw=image_grid_thw, pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw)
    kw = {k: v for k, v in kw.items() if v is not None}  # generate() encodes any modality key it is given
    model.model.rope_deltas = None  # a cached delta from another prompt must not leak in
    logits = model(**kw).logits
    model.model.rope_deltas = None
    gen = model.generate(**kw, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return logits, gen[0, input_ids.shape[1]:]


# -- the surface this module relies on --------------------------------------------------------
def _params(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


def check_surface() -> list[str]:
    """Each transformers name and keyword this module calls, checked; returns the problems found.

    A tiny forward is run too: the shapes and fields read here must still exist.
    """
    import transformers
    from transformers import DynamicCache, Qwen3VLForConditionalGeneration
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m

    problems = []
    if not transformers.__version__.startswith("5."):
        problems.append(f"transformers {transformers.__version__} is outside the 5.x series this adapter pins")

    def need(fn: Any, names: Sequence[str], where: str) -> None:
        missing = set(names) - _params(fn)
        if missing:
            problems.append(f"{where} lost keyword(s) {sorted(missing)}")

    need(m.Qwen3VLModel.get_rope_index, ["input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw"],
         "Qwen3VLModel.get_rope_index")
    need(m.Qwen3VLTextModel.forward, ["inputs_embeds", "position_ids", "cache", "use_cache", "visual_pos_masks",
                                      "deepstack_visual_embeds"], "Qwen3VLTextModel.forward")
    need(m.Qwen3VLVisionModel.forward, ["hidden_states", "grid_thw"], "Qwen3VLVisionModel.forward")
    need(Qwen3VLForConditionalGeneration.forward, ["input_ids", "mm_token_type_ids", "pixel_values",
                                                   "image_grid_thw", "pixel_values_videos", "video_grid_thw"],
         "Qwen3VLForConditionalGeneration.forward")
    need(DynamicCache.__init__, ["config"], "DynamicCache")
    if not hasattr(m.Qwen3VLTextModel, "_deepstack_process"):
        problems.append("Qwen3VLTextModel no longer adds deepstack rows in _deepstack_process")
    try:
        _check_run(problems)
    except Exception as exc:  # a changed call raises somewhere in here: name it, do not crash the check
        problems.append(f"a tiny encode + prefill through this module failed: {type(exc).__name__}: {exc}")
    return problems


def _check_run(problems: list[str]) -> None:
    model = build_model()
    s = spec(model)
    if s.levels < 1:
        problems.append("the tiny config has no deepstack levels")
    with torch.inference_mode():
        pv = torch.zeros(16, 3 * s.temporal_patch * s.patch * s.patch)
        main, deep = encode(model, pv, torch.tensor([[1, 4, 4]]))
        if tuple(main.shape) != (4, s.hidden) or [tuple(d.shape) for d in deep] != [(4, s.hidden)] * s.levels:
            problems.append(f"vision output changed shape: pooler {tuple(main.shape)}, "
                            f"deepstack {[tuple(d.shape) for d in deep]}")
        ids = torch.tensor([[1, s.vision_start] + [s.image_token] * 4 + [s.vision_end, 2]])
        types = (ids == s.image_token).int()
        pos, delta = rope_index(model, ids, types, torch.tensor([[1, 4, 4]]), None)
        if tuple(pos.shape) != (3, 1, ids.shape[1]) or tuple(delta.shape) != (1, 1):
            problems.append(f"get_rope_index changed shape: {tuple(pos.shape)}, {tuple(delta.shape)}")
        logits, cache = language_model(model, embed_tokens(model, ids), pos, new_cache(model))
        if tuple(logits.shape) != (1, ids.shape[1], s.vocab) or cache.get_seq_length() != ids.shape[1]:
            problems.append("the text model's output or cache changed")

