"""The tiny BLIP-2 and vLLM's configuration and Scheduler over it (executor/tools/vllm_rig.py), and the
pieces test_vllm_scheduler.py drives the scheduler with by hand."""

from __future__ import annotations

from typing import Any

from epd_ring.executor.tools.vllm_rig import (  # noqa: F401  (re-exported for the tests)
    CONNECTOR,
    IMAGE_TOKEN,
    TOKENS_PER_IMAGE,
    make_tiny_blip2,
    scheduler,
    vllm_config,
)


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
