"""An end-to-end forward of a tiny multimodal model under vLLM on CPU, split (encoder -> epd-ring ->
prefill) against unsplit: where it stops today.

vLLM 0.33.0 from PyPI is a CUDA build: it ships no CPU kernels (`vllm._C` / `vllm._C_AVX2`), and
vLLM's `CPUWorker.__init__` calls `torch.ops._C.init_cpu_memory_env` first thing, so
`LLM(model=<tiny BLIP-2>)` on `VLLM_TARGET_DEVICE=cpu` fails with
`AttributeError: '_OpNamespace' '_C' object has no attribute 'init_cpu_memory_env'`, before any
model is loaded. A CPU build of vLLM (from source, `VLLM_TARGET_DEVICE=cpu pip install .`) is what it
takes; this test says so while it is missing and fails as a reminder once it is not.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if not os.environ.get("EPD_RING_REQUIRE_VLLM"):
    pytest.importorskip("vllm")

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def test_a_tiny_model_forward_needs_vllms_cpu_kernels():
    import torch
    from vllm.platforms import current_platform

    assert type(current_platform).__name__ == "CpuPlatform"
    current_platform.import_kernels()  # logs and carries on when the CPU kernels are missing
    kernels = [name for name in ("vllm._C", "vllm._C_AVX2", "vllm._C_AVX512") if importlib.util.find_spec(name)]
    if not kernels:
        assert not hasattr(torch.ops._C, "init_cpu_memory_env")  # what CPUWorker calls first
        pytest.skip("vLLM's wheel has no CPU kernels (vllm._C): CPUWorker raises AttributeError on "
                    "torch.ops._C.init_cpu_memory_env, so no model runs a forward on CPU here")
    pytest.fail(f"vLLM's CPU kernels are here ({kernels}): write the split-against-unsplit run of the tiny model")
