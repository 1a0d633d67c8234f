"""A real Qwen3-VL split at the tower: prefill's logits equal the unsplit model's, bit for bit.

Runs whenever the `qwen` extra (transformers, pillow) is installed; CI sets
EPD_RING_REQUIRE_QWEN=1 so a missing extra fails instead of skipping.
"""

from __future__ import annotations

import os

import pytest
import torch

if not os.environ.get("EPD_RING_REQUIRE_QWEN"):
    pytest.importorskip("transformers")
    pytest.importorskip("PIL")

from epd_ring.executor.tools import demo_qwen
from epd_ring.executor.tools.qwen3vl import (
    ArrivalError,
    MMItem,
    Prompt,
    Qwen3VLTower,
    build_prompt,
    hf,
    monolithic,
    placeholder_spans,
    prefill,
)


@pytest.fixture(autouse=True)
def _few_threads():
    # Two cores shared with other jobs; one thread also keeps float sums in one order.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_transformers_internals_the_adapter_calls_are_unchanged():
    assert hf.check_surface() == []


def test_the_surface_check_names_a_changed_internal(monkeypatch):
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m

    original = m.Qwen3VLModel.get_rope_index

    def renamed(self, input_ids, mm_token_type_ids, image_grid_thw=None, videos_grid_thw=None, **kw):
        return original(self, input_ids, mm_token_type_ids, image_grid_thw, videos_grid_thw)

    monkeypatch.setattr(m.Qwen3VLModel, "get_rope_index", renamed)
    problems = hf.check_surface()
    assert any("get_rope_index lost keyword(s) ['video_grid_thw']" in p for p in problems), problems


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_model_equals_monolithic_and_faults_fail_only_their_requests(dtype):
    # Eight requests: images of four sizes, videos, the four routes (a, b, fanout,
    # row shards), a failed write and prefill worker b killed in wave 1.
    reqs, fig = demo_qwen.loopback_session(requests=8, dtype=dtype, kill_wave=1, quiet=True)
    assert fig["levels"] == 2 and fig["leaked"] == 0
    kinds = {(i.modality, i.grid_thw[1:]) for r in reqs for i in r.prompt.items}
    assert {"image", "video"} == {k for k, _ in kinds} and len(kinds) >= 4
    faults = {r.fault for r in reqs}
    assert {"none", "write_fail", "killed"} <= faults
    for r in reqs:
        assert set(r.verdicts) == set(r.workers), r
        if r.fault == "none":
            assert all(v == "equal" for v in r.verdicts.values()), (r.rid, r.verdicts)
        else:
            assert all(v.startswith("failed") for v in r.verdicts.values()), (r.rid, r.verdicts)
            assert r.encode_failures, r.rid
    assert any(r.shard and r.fault == "none" for r in reqs)
    assert any(len(r.workers) == 2 and not r.shard and r.fault == "none" for r in reqs)


class _NoDeepstackTower(Qwen3VLTower):
    """An encode worker that ships the main rows only."""

    def __init__(self, model):
        super().__init__(model)
        self.num_deepstack_embeddings = 0

    def get_image_feature(self, items):
        return super().get_image_feature(items)[:, :self.hidden]

    image_encoder = get_video_feature = get_image_feature


def test_dropping_deepstack_rows_on_the_encode_side_fails_every_request():
    reqs, fig = demo_qwen.loopback_session(requests=2, kill_wave=9, quiet=True, tower=_NoDeepstackTower)
    assert fig["leaked"] == 0
    for r in reqs:
        assert r.verdicts and all(v.startswith("failed") for v in r.verdicts.values()), r.verdicts
        assert any("deepstack" in reason for reason in r.encode_failures), r.encode_failures


class _OneLevelTower(Qwen3VLTower):
    """An encode worker whose model has one deepstack level where prefill expects two."""

    def __init__(self, model):
        super().__init__(model)
        self.num_deepstack_embeddings = 1

    def get_image_feature(self, items):
        return super().get_image_feature(items)[:, :2 * self.hidden]

    image_encoder = get_video_feature = get_image_feature


def test_a_deepstack_level_mismatch_fails_the_rooms_before_any_write():
    reqs, fig = demo_qwen.loopback_session(requests=2, kill_wave=9, quiet=True, tower=_OneLevelTower)
    assert fig["leaked"] == 0
    for r in reqs:
        assert r.verdicts and all(v.startswith("failed") for v in r.verdicts.values()), r.verdicts
        assert any("deepstack levels" in reason for reason in r.encode_failures), r.encode_failures


@pytest.fixture(scope="module")
def split_request():
    """One request (a non-square image and a video) encoded by the tower, and the unsplit model's answer."""
    import numpy as np

    torch.set_num_threads(1)
    model = hf.build_model()
    s = hf.spec(model)
    rng = np.random.default_rng(3)
    pv, grid = hf.process_images(hf.image_processor(s), [rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)])
    from epd_ring.executor.tools.qwen3vl import patchify_video
    vpv, vgrid = patchify_video(rng.integers(0, 256, (4, 128, 192, 3), dtype=np.uint8), s)
    items = [MMItem("image", tuple(grid[0].tolist()), 1, pv), MMItem("video", vgrid, 2, vpv)]
    p = build_prompt(s, items, rng)
    tower = Qwen3VLTower(model)
    with torch.inference_mode():
        rows = [tower.separate_deepstack_embeds(tower.image_encoder([it.encode_item(s.merge)])) for it in items]
        ref = monolithic(model, p)
    return model, s, p, rows, ref


def _prefill(model, p, rows):
    with torch.inference_mode():
        return prefill(model, p, rows)


def test_prefill_needs_the_deepstack_rows(split_request):
    model, s, p, rows, (ref_logits, ref_tokens) = split_request
    logits, tokens = _prefill(model, p, rows)
    assert torch.equal(logits, ref_logits) and torch.equal(tokens, ref_tokens)
    # Deepstack rows that never landed (the buffer left zeroed): prefill runs, the logits are wrong.
    zeroed = [(m, torch.zeros_like(d)) for m, d in rows]
    assert not torch.equal(_prefill(model, p, zeroed)[0], ref_logits)
    # No deepstack rows at all, or too few levels: refused on arrival, naming the item.
    with pytest.raises(ArrivalError, match="deepstack"):
        _prefill(model, p, [(m, None) for m, _ in rows])
    with pytest.raises(ArrivalError, match="2 deepstack levels"):
        _prefill(model, p, [(m, d[:, :s.hidden]) for m, d in rows])


def test_prefill_needs_the_grid(split_request):
    model, s, p, rows, (ref_logits, _) = split_request
    img = p.items[0]
    t, h, w = img.grid_thw
    assert h != w
    # The same rows under a transposed grid: same token count, different positions, wrong logits.
    swapped = Prompt(p.input_ids, [MMItem("image", (t, w, h), img.room), p.items[1]])
    swapped.spans = placeholder_spans(swapped, s)
    assert not torch.equal(_prefill(model, swapped, rows)[0], ref_logits)
    # A grid whose token count differs from the rows that arrived: refused, not scattered.
    meta = p.meta()
    meta["items"][0]["grid_thw"] = [t, h + 2, w]
    with pytest.raises(ArrivalError, match="placeholders"):
        Prompt.from_meta(meta, s)
    bigger = Prompt(p.input_ids, [MMItem("image", (t, h, w), img.room), p.items[1]])
    with pytest.raises(ArrivalError, match="expected"):
        _prefill(model, bigger, [(rows[0][0][:-4], rows[0][1][:-4]), rows[1]])
    # A request without grids cannot be accepted at all.
    del meta["items"][0]["grid_thw"]
    with pytest.raises(ArrivalError, match="grid_thw"):
        Prompt.from_meta(meta, s)


def test_rows_in_the_wrong_dtype_are_refused(split_request):
    model, _s, p, rows, _ = split_request
    with pytest.raises(ArrivalError, match="bfloat16"):
        _prefill(model, p, [(m.bfloat16(), d.bfloat16()) for m, d in rows])


def test_split_model_across_processes_over_mooncake():
    if not os.environ.get("EPD_RING_REQUIRE_MOONCAKE"):
        pytest.importorskip("mooncake.engine")
        pytest.importorskip("zmq")
    # Two prefill processes; the write fault is a destination outside registered memory,
    # and process b is killed after registering wave 1's frames.
    reqs, fig = demo_qwen.mooncake_session(requests=8, kill_wave=1, quiet=True)
    assert fig["leaked"] == 0
    assert {"none", "write_fail", "killed"} <= {r.fault for r in reqs}
    for r in reqs:
        assert set(r.verdicts) == set(r.workers), r
        want = "equal" if r.fault == "none" else "failed"
        assert all(v.startswith(want) for v in r.verdicts.values()), (r.rid, r.fault, r.verdicts)


def test_bench_runs_the_split_loop_and_accounts_for_the_controller(capsys):
    from epd_ring.executor.tools import bench_qwen

    (row,) = bench_qwen.run(requests=3, transports=("loopback",), repeat=1)
    assert row[0] == "loopback" and float(row[1]) > 0 and float(row[2]) > 0
    assert float(row[3]) > 0 and float(row[4]) > 0 and row[5].endswith("%") and float(row[7]) > 0
    assert "controller share" in capsys.readouterr().out
