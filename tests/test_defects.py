"""Defects found by trying the controller as an attacker would: each bad item, frame or setting
fails only its own room with a reason (or is refused at construction), and the rooms beside it
still deliver the tower's bytes."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_rig

from epd_ring.executor import EncodeExecutor, EncodeManager, FakeClock, LoopbackTransport


def _room(rig, room, tokens=2):
    rid = f"req-{room}"
    rig.executor.register(rid, "prefill-host", 8998, room)
    rig.manager.register_receiver(rig.frame(room, f"p{room}", tokens))
    return rid, rig.item(tokens, room)


def _settle(rig):
    for _ in range(5):
        rig.executor.poll()


def _assert_delivered(rig, rooms):
    for room, (_rid, item) in rooms.items():
        assert rig.manager.room_status(room) == "success", (room, rig.manager.failure_reason(room))
        assert rig.delivered_ok(room, f"p{room}", item)


class _NoModality:
    n_tokens = 2
    encoded = None
    encoded_deepstack = None


@pytest.mark.parametrize("bad", [None, _NoModality(), "modality:image"], ids=["none", "no-modality", "a-string"])
def test_a_bad_item_in_a_batch_fails_only_its_own_room(bad):
    rig = make_rig()
    good = {r: _room(rig, r) for r in (1, 3)}
    rid_bad, _ = _room(rig, 2)
    batch = [good[1], (rid_bad, bad), good[3]]
    assert rig.executor.execute(batch) == 2
    _settle(rig)
    assert rig.manager.room_status(2) == "failed"
    assert "bad item" in rig.manager.failure_reason(2)
    assert rig.receiver("p2").statuses(2) == ["failed"]
    _assert_delivered(rig, good)


def test_a_batch_of_one_bad_item_fails_its_room_and_returns_zero():
    rig = make_rig()
    rid, _ = _room(rig, 1)
    assert rig.executor.execute([(rid, None)]) == 0
    assert rig.manager.room_status(1) == "failed" and rig.receiver("p1").statuses(1) == ["failed"]
    assert rig.manager.deadline_of(1) is None  # concluded, not left registered without a deadline


def test_send_item_of_none_fails_its_room_with_a_reason():
    rig = make_rig()
    rid, _ = _room(rig, 1)
    rig.executor.send_item(rid, None)
    assert rig.manager.room_status(1) == "failed"
    assert "staging failed" in rig.manager.failure_reason(1)
    good = {2: _room(rig, 2)}
    rig.executor.execute([good[2]])
    _settle(rig)
    _assert_delivered(rig, good)


def test_deferred_item_whose_embedding_was_dropped_fails_its_room_not_the_loop():
    rig = make_rig(extents=1, extent_bytes=64)  # one 2-row item fills the arena
    first = {1: _room(rig, 1)}
    rid2, item2 = _room(rig, 2)
    rig.transport.inject("hold", session="p1")
    rig.executor.execute([first[1]])
    rig.executor.execute([(rid2, item2)])
    assert rig.executor.has_deferred()
    item2.encoded = None  # the caller reused its item after `execute`
    rig.transport.complete(rig.transport.held[0])
    rig.executor.poll()  # must not raise
    assert rig.manager.room_status(2) == "failed"
    assert "deferred" in rig.manager.failure_reason(2)
    assert rig.receiver("p2").statuses(2) == ["failed"]
    _assert_delivered(rig, first)
    later = {3: _room(rig, 3)}
    rig.executor.execute([later[3]])
    _settle(rig)
    _assert_delivered(rig, later)


@pytest.mark.parametrize("setting", ["park_timeout", "quarantine_s", "write_timeout", "tombstone_ttl",
                                     "announce_timeout"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, "5"], ids=["nan", "inf", "negative", "text"])
def test_manager_settings_must_be_finite_and_in_range(setting, value):
    clock = FakeClock()
    with pytest.raises(ValueError, match=setting):
        EncodeManager(LoopbackTransport(clock), clock, **{setting: value})


@pytest.mark.parametrize("setting, value", [("max_announced", 0), ("max_announced", -3), ("max_tombstones", 0),
                                            ("max_announced", 2.5)])
def test_manager_bounds_must_be_positive_integers(setting, value):
    clock = FakeClock()
    with pytest.raises(ValueError, match=setting):
        EncodeManager(LoopbackTransport(clock), clock, **{setting: value})


@pytest.mark.parametrize("setting, value", [("max_deferred", -1), ("ring_slots", 0), ("ring_bytes", -64),
                                            ("max_deferred", math.nan)])
def test_executor_settings_are_checked(setting, value):
    rig = make_rig()
    with pytest.raises(ValueError, match=setting):
        EncodeExecutor(rig.manager, rig.tower, "cpu", **{setting: value})


def test_nan_park_timeout_can_no_longer_park_a_room_forever():
    # Before: NaN was accepted, the park deadline never fired and the extent was held for good.
    clock = FakeClock()
    with pytest.raises(ValueError, match="park_timeout must be finite"):
        EncodeManager(LoopbackTransport(clock), clock, park_timeout=float("nan"))


# ------------------------------------------------------------- the contract ---

@pytest.mark.parametrize("registered_first", [True, False], ids=["frame-first", "chunk-first"])
def test_deepstack_width_mismatch_fails_the_room_and_writes_nothing(registered_first):
    # Before: an encoder at 3 deepstack levels wrote 3-level rows into a region sized for 1,
    # over the next room's rows, and both rooms reported success.
    import torch

    rig = make_rig(n_deep=3, extent_bytes=8192)
    rid1 = "req-1"
    rig.executor.register(rid1, "h", 1, 1)
    item1 = rig.item(4, 1)
    narrow = rig.frame(1, "p1", 4, deep_levels=1)
    if registered_first:
        rig.manager.register_receiver(narrow)
    good = {2: _room(rig, 2, 4)}
    rig.executor.execute([(rid1, item1), good[2]])
    if not registered_first:
        rig.manager.register_receiver(narrow)
    _settle(rig)
    assert rig.manager.room_status(1) == "failed"
    assert "expects 1 deepstack levels, chunk has 3" in rig.manager.failure_reason(1)
    assert rig.receiver("p1").statuses(1) == ["failed"]
    main, deep, _, _ = rig.buffers[(1, "p1")]
    assert torch.isnan(main).all() and torch.isnan(deep).all()  # nothing written
    _assert_delivered(rig, good)


def test_frames_of_one_room_must_agree_on_deepstack_levels():
    rig = make_rig(n_deep=2, extent_bytes=8192)
    rig.executor.register("r", "h", 1, 5)
    rig.manager.register_receiver(rig.frame(5, "a", 2, n=2))
    rig.manager.register_receiver(rig.frame(5, "b", 2, n=2, deep_levels=1))
    assert rig.manager.room_status(5) == "failed"
    assert "disagree on deep_levels" in rig.manager.failure_reason(5)
