"""Registration frame checks and the fanout contract."""

from __future__ import annotations

import pytest

from epd_ring.executor import FrameError, ReceiverFrame, shard_rows
from epd_ring.executor.core.frames import check_frame, check_frames_agree, check_tiling

BASE = ReceiverFrame(7, "127.0.0.1:1234", 0x1000, 0, 10, 0, 10, 64, "torch.bfloat16", False, 1)


def test_valid_frame_passes_and_round_trips_high_pointers():
    check_frame(BASE)
    check_frame(BASE._replace(dst_ptr=0xFFFF_FFFF_FFFF_F000, dst_deep_ptr=0xFFFF_FFFF_FFFF_0000,
                              has_deepstack=True, deep_levels=3))


@pytest.mark.parametrize("change, needle", [
    (dict(room=-1), "room"),
    (dict(room="7"), "room"),
    (dict(room=True), "room"),
    (dict(session=""), "session"),
    (dict(dst_ptr=1 << 64), "dst_ptr"),
    (dict(dst_ptr=-5), "dst_ptr"),
    (dict(n_tokens=-1), "n_tokens"),
    (dict(n_tokens=2.5), "n_tokens"),
    (dict(span=0, n_tokens=0), "span"),
    (dict(hidden=0), "hidden"),
    (dict(n_receivers=0), "n_receivers"),
    (dict(n_receivers=5000), "n_receivers"),
    (dict(row_start=5, n_tokens=6), "exceed span"),
    (dict(dtype="float32"), "dtype"),
    (dict(has_deepstack=1), "has_deepstack"),
    (dict(dst_ptr=0), "null destination"),
    (dict(has_deepstack=True, deep_levels=1), "deepstack destination"),
    (dict(has_deepstack=True), "deep_levels"),
    (dict(deep_levels=2), "deep_levels"),
    (dict(has_deepstack=True, dst_deep_ptr=0x2000, deep_levels=65), "deep_levels"),
])
def test_malformed_fields_are_named(change, needle):
    with pytest.raises(FrameError, match=needle):
        check_frame(BASE._replace(**change))


def test_frames_of_a_room_must_agree():
    check_frames_agree(BASE, BASE._replace(session="b", dst_ptr=0x2000))
    for change in (dict(n_receivers=2), dict(span=11), dict(hidden=32), dict(dtype="torch.float16"),
                   dict(has_deepstack=True, deep_levels=1, dst_deep_ptr=0x2000)):
        with pytest.raises(FrameError, match="disagree"):
            check_frames_agree(BASE, BASE._replace(session="b", **change))


def shards(*ranges, span=10):
    return [BASE._replace(session=f"s{i}", row_start=a, n_tokens=n, span=span, n_receivers=len(ranges))
            for i, (a, n) in enumerate(ranges)]


def test_tiling_accepts_identity_and_contiguous_shards():
    check_tiling(shards((0, 10), (0, 10)))
    check_tiling(shards((0, 5), (5, 5)))
    check_tiling(shards((5, 5), (0, 5)))  # order of arrival does not matter
    check_tiling(shards((2, 3), (5, 4)))  # an encode rank may serve a block not starting at 0
    check_tiling(shards((0, 1), (1, 0), span=1))  # span smaller than the shard count


@pytest.mark.parametrize("ranges, needle", [
    (((0, 4), (5, 5)), "gap"),
    (((0, 6), (5, 5)), "overlap"),
    (((0, 10), (0, 5)), "overlap"),  # identity beside a shard
])
def test_tiling_rejects_gaps_and_overlaps(ranges, needle):
    with pytest.raises(FrameError, match=needle):
        check_tiling(shards(*ranges))


@pytest.mark.parametrize("span", [1, 2, 3, 7, 8, 128, 129])
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_shard_rows_tile_the_span_exactly(span, size):
    parts = [shard_rows(span, r, size) for r in range(size)]
    pos = 0
    for start, n in parts:
        assert start == pos
        pos += n
    assert pos == span
    assert max(n for _, n in parts) - min(n for _, n in parts) <= 1
