"""The controller end to end on the loopback transport with a fake clock."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import Calls, Rig, TableTower, counters, drive, make_rig, reason_kind

from epd_ring.executor import (
    EncodeExecutor,
    EncodeItem,
    EncodeManager,
    FakeClock,
    LoopbackTransport,
    Outcome,
    Pump,
    RoomConflict,
    TransportError,
    assign_encoded_embeddings,
)
from epd_ring.executor.core.reasons import ReasonKind


def submit(rig, room, n_tokens, seed=None, rid=None):
    rid = rid if rid is not None else f"req-{room}"
    rig.executor.register(rid, "prefill-host", 8998, room)
    item = rig.item(n_tokens, room if seed is None else seed)
    return rid, item


# ---------------------------------------------------------------- scatter ---

def test_scatter_splits_rows_and_deepstack_columns():
    tower = TableTower(hidden=4, n_deep=3)
    items = [EncodeItem("image", 2), EncodeItem("image", 3)]
    output = torch.arange(5 * 16, dtype=torch.float32).reshape(5, 16)
    assign_encoded_embeddings(items, output, tower)
    assert items[0].encoded.shape == (2, 4) and items[0].encoded_deepstack.shape == (2, 12)
    assert items[1].encoded.shape == (3, 4) and items[1].encoded_deepstack.shape == (3, 12)
    assert torch.equal(items[1].encoded, output[2:5, :4])
    assert torch.equal(items[1].encoded_deepstack, output[2:5, 4:])
    assert all(t.is_contiguous() for i in items for t in (i.encoded, i.encoded_deepstack))


def test_scatter_without_deepstack_leaves_deepstack_none():
    items = [EncodeItem("image", 2)]
    assign_encoded_embeddings(items, torch.ones(2, 8), TableTower(hidden=8))
    assert items[0].encoded_deepstack is None and items[0].encoded.shape == (2, 8)


def test_row_count_mismatch_raises_value_error():
    with pytest.raises(ValueError, match="5 rows but .* sum to 2"):
        assign_encoded_embeddings([EncodeItem("image", 2)], torch.zeros(5, 8), TableTower())


def test_image_and_video_dispatch_to_their_encoders():
    rig = make_rig()
    rid_a, a = submit(rig, 1, 2)
    rid_b, b = submit(rig, 2, 3)
    b.modality = "video"
    rig.executor.execute([(rid_a, a), (rid_b, b)])
    assert sorted(rig.tower.calls) == [("image", 1), ("video", 1)]  # one call per modality, each its own seam


# --------------------------------------------------------- failure isolation ---

def test_tower_error_fails_every_room_of_the_batch_and_keeps_running():
    rig = make_rig()
    batch = [submit(rig, r, 2) for r in (1, 2, 3)]
    for r in (1, 2, 3):
        rig.manager.register_receiver(rig.frame(r, f"p{r}", 2))
    rig.tower.raise_next = RuntimeError("CUDA error: device-side assert")
    assert rig.executor.execute(batch) == 0
    for r in (1, 2, 3):
        assert rig.manager.room_status(r) == "failed"
        assert rig.receiver(f"p{r}").statuses(r) == ["failed"]
        assert "device-side assert" in rig.manager.failure_reason(r)
    # The executor still works for the next batch.
    rid, item = submit(rig, 4, 2)
    rig.manager.register_receiver(rig.frame(4, "p4", 2))
    assert rig.executor.execute([(rid, item)]) == 1
    rig.executor.poll()
    assert rig.manager.room_status(4) == "success" and rig.delivered_ok(4, "p4", item)


def test_scatter_mismatch_fails_the_batch_rooms():
    rig = make_rig()
    rid, item = submit(rig, 1, 2)
    item.n_tokens = 3  # the tower returns 2 rows for it
    rig.tower.expected = lambda it: torch.zeros(2, rig.tower.hidden)
    assert rig.executor.execute([(rid, item)]) == 0
    assert rig.manager.room_status(1) == "failed"


def test_oversized_item_fails_only_its_own_room():
    rig = make_rig(extent_bytes=256)  # 8 rows of 8 float32
    bad_rid, bad = submit(rig, 1, 64)
    ok_rid, ok = submit(rig, 2, 3)
    for r, n in ((1, 64), (2, 3)):
        rig.manager.register_receiver(rig.frame(r, f"p{r}", n))
    assert rig.executor.execute([(bad_rid, bad), (ok_rid, ok)]) == 2
    rig.executor.poll()
    assert rig.manager.room_status(1) == "failed"
    assert reason_kind(rig.manager, 1) is ReasonKind.TOO_LARGE
    assert rig.receiver("p1").statuses(1) == ["failed"]
    assert rig.manager.room_status(2) == "success" and rig.delivered_ok(2, "p2", ok)
    assert rig.executor.ring.live == 0


def test_oversized_cache_hit_does_not_escape():
    rig = make_rig(extent_bytes=256)
    rid, item = submit(rig, 1, 64)
    item.encoded = torch.zeros(64, 8)
    rig.executor.send_item(rid, item)  # must not raise
    assert rig.manager.room_status(1) == "failed"


def test_cache_hit_send_skips_the_tower_and_ships():
    rig = make_rig()
    rid, item = submit(rig, 7, 4)
    rig.manager.register_receiver(rig.frame(7, "p7", 4))
    item.encoded = rig.tower.expected(item)
    rig.executor.send_item(rid, item)
    rig.executor.poll()
    assert rig.tower.calls == []
    assert rig.manager.room_status(7) == "success" and rig.delivered_ok(7, "p7", item)


def test_fail_rooms_deduplicates_and_counts_rooms_it_failed():
    rig = make_rig()
    submit(rig, 1, 2, rid="a")
    submit(rig, 2, 2, rid="b")
    assert rig.executor.fail_rooms(["a", "a", "b", "unknown"], ValueError("bad batch")) == 2
    assert rig.executor.fail_rooms(["a"], ValueError("again")) == 0  # already failed: sticky
    assert rig.manager.failure_reason(1) == "bad batch"
    # an exception without a message: the reason names what was raised, not nothing
    submit(rig, 3, 2, rid="c")
    assert rig.executor.fail_rooms(["c"], TimeoutError()) == 1
    assert rig.manager.failure_reason(3) == "TimeoutError"


def test_a_cuda_copy_fence_is_an_event_recorded_on_the_current_stream(monkeypatch):
    # the fence a CUDA executor takes by default: `done` is the event's query (no GPU here: torch's Event stood in)
    from epd_ring.executor.core import executor as executor_module

    recorded = []

    class Event:
        def record(self):
            recorded.append(self)

        def query(self):
            return True

    monkeypatch.setattr(torch.cuda, "Event", Event)
    fence = executor_module._cuda_fence()
    assert isinstance(fence, Event) and recorded == [fence]


# ------------------------------------------------------------ ring and defer ---

def test_full_ring_defers_then_serves_in_order():
    # An arena of two 2-row items, which parked chunks may fill (no bound on them: tests/test_peers.py has it).
    rig = make_rig(extents=2, extent_bytes=64, parked_ring_share=1.0)
    items = [submit(rig, r, 2) for r in range(5)]
    # Rooms 0 and 1 park (no receivers yet) and hold both extents.
    rig.executor.execute(items)
    assert rig.executor.has_deferred()
    assert rig.executor.deferred_requests() == ["req-2", "req-3", "req-4"]
    assert rig.executor.ring.main_arena.free_bytes == 0
    order = []
    rig.executor.pump.on_conclude.append(lambda room, state: order.append(room))  # the driver hears of each
    for r in range(5):
        rig.manager.register_receiver(rig.frame(r, f"p{r}", 2))
        rig.executor.poll()
    for _ in range(3):
        rig.executor.poll()
    assert order == [0, 1, 2, 3, 4]
    assert not rig.executor.has_deferred()
    for rid, item in items:
        room = int(rid.split("-")[1])
        assert rig.delivered_ok(room, f"p{room}", item)


def test_deferred_sends_are_served_before_new_ones():
    rig = make_rig(extents=1, extent_bytes=64)
    a = submit(rig, 1, 2)
    b = submit(rig, 2, 2)
    rig.executor.execute([a, b])  # a parks in the only extent, b defers
    rig.manager.register_receiver(rig.frame(1, "p1", 2))
    rig.executor.manager.poll()  # frees the extent, but no deferred send is served yet
    c = submit(rig, 3, 2)
    rig.executor.execute([c])  # the new send must queue behind b
    assert rig.manager.room_status(2) == "parked"
    assert rig.manager.room_status(3) == "registered"
    assert rig.executor.deferred_requests() == ["req-3"]


def test_deferred_send_after_its_sender_was_reaped_is_dropped():
    rig = make_rig(extents=1, extent_bytes=64)
    a = submit(rig, 1, 2)
    b = submit(rig, 2, 2)
    rig.executor.execute([a, b])
    rig.executor.fail_rooms(["req-2"], RuntimeError("client went away"))
    rig.executor.reap_concluded_senders(set())
    assert "req-2" not in rig.executor.senders
    rig.manager.register_receiver(rig.frame(1, "p1", 2))
    rig.executor.poll()  # serves the deferred sends: must drop req-2 quietly
    rig.executor.poll()
    assert not rig.executor.has_deferred()
    assert rig.manager.stats["deferred_dropped"] == 1
    assert rig.executor.ring.live == 0


def test_chunk_of_a_failed_room_is_never_written():
    rig = make_rig(extents=1, extent_bytes=64)
    a = submit(rig, 1, 2)
    b = submit(rig, 2, 2)
    rig.manager.register_receiver(rig.frame(2, "p2", 2))
    rig.executor.execute([a, b])  # b deferred behind a
    rig.executor.fail_rooms(["req-2"], RuntimeError("aborted"))
    before = rig.transport.submitted
    rig.manager.register_receiver(rig.frame(1, "p1", 2))
    rig.executor.poll()
    rig.executor.poll()
    assert rig.transport.submitted == before + 1  # only room 1's write
    main, *_ = rig.buffers[(2, "p2")]
    assert torch.isnan(main).all()


def test_deferred_queue_is_bounded():
    clock = FakeClock()
    ex = drive(EncodeExecutor(EncodeManager(LoopbackTransport(clock), clock), TableTower(), "cpu", ring_slots=1,
                              ring_bytes=64, max_deferred=2))
    manager = ex.manager
    for r in range(5):
        ex.register(f"q{r}", "h", 1, r)
    ex.execute([(f"q{r}", EncodeItem("image", 2, meta={"seed": r})) for r in range(5)])
    assert ex.deferred_count == 2
    assert [manager.room_status(r) for r in range(5)] == ["parked", "registered", "registered", "failed", "failed"]


def test_lease_never_hands_out_busy_bytes():
    rig = make_rig(extents=3, extent_bytes=4096)
    ring = rig.executor.ring
    leased = [ring.lease(4096) for _ in range(3)]
    assert ring.lease(1) is None
    assert len({s.offset for s in leased}) == 3 and all(s.state == "copying" for s in leased)
    ring.fire(leased[1], "abandon")
    assert leased[1].state == "free" and ring.lease(4097) is None  # only its 4096 bytes came back
    again = ring.lease(4096)
    assert again is not leased[1] and again.offset == leased[1].offset  # new extent, same bytes


def test_ring_registers_each_arena_once_and_refuses_overlap():
    transport = LoopbackTransport()
    manager = EncodeManager(transport)
    ex = EncodeExecutor(manager, TableTower(n_deep=3), "cpu", arena_bytes=4096)
    assert len(transport.local) == 2  # one main and one deepstack arena, however many items
    assert transport.local.covers(ex.ring.main_base, 4096) and transport.local.covers(ex.ring.deep_base, 3 * 4096)
    with pytest.raises(TransportError, match="overlaps"):
        transport.register_memory([(ex.ring.main_base + 64, 64)])


def test_deepstack_arena_holds_as_many_tokens_as_the_main_arena():
    rig = make_rig(extents=1, extent_bytes=512, hidden=8, n_deep=3)  # 16 rows of 8 float32 in the main arena
    ring = rig.executor.ring
    assert ring.deep_bytes == 3 * ring.arena_bytes
    rid, item = submit(rig, 1, 16)  # fills the main arena exactly; deepstack is 3x wider
    rig.manager.register_receiver(rig.frame(1, "p1", 16))
    rig.executor.execute([(rid, item)])
    rig.executor.poll()
    assert rig.manager.room_status(1) == "success" and rig.delivered_ok(1, "p1", item)


# ---------------------------------------------------- registration and parking ---

def test_late_registration_parks_then_sends_on_the_nth_receiver():
    rig = make_rig()
    rid, item = submit(rig, 5, 6)
    rig.executor.execute([(rid, item)])
    assert rig.manager.room_status(5) == "parked"
    extent = rig.extent_of(5)
    assert extent.state == "parked"
    rig.manager.register_receiver(rig.frame(5, "pa", 6, n=2, rank=0, shard=True))
    assert rig.manager.room_status(5) == "parked"
    rig.manager.register_receiver(rig.frame(5, "pb", 6, n=2, rank=1, shard=True))
    assert rig.manager.room_status(5) == "transferring"
    rig.executor.poll()
    assert rig.manager.room_status(5) == "success"
    assert rig.delivered_ok(5, "pa", item) and rig.delivered_ok(5, "pb", item)
    assert rig.receiver("pa").statuses(5) == ["success"] and rig.receiver("pb").statuses(5) == ["success"]
    assert extent.state == "free"


def test_identity_fanout_gives_each_receiver_a_full_copy():
    rig = make_rig(n_deep=2)
    for s in ("pa", "pb"):
        rig.manager.register_receiver(rig.frame(9, s, 4, n=2))
    rid, item = submit(rig, 9, 4)
    rig.executor.execute([(rid, item)])
    rig.executor.poll()
    assert rig.delivered_ok(9, "pa", item) and rig.delivered_ok(9, "pb", item)


def test_receivers_before_sender_are_announced_then_sent():
    rig = make_rig()
    rig.manager.register_receiver(rig.frame(3, "p3", 2))
    assert rig.manager.room_status(3) == "announced"
    rid, item = submit(rig, 3, 2)
    assert rig.manager.room_status(3) == "ready"
    rig.executor.execute([(rid, item)])
    rig.executor.poll()
    assert rig.manager.room_status(3) == "success"


def test_park_deadline_tells_registered_and_later_receivers_failed():
    rig = make_rig(park_timeout=10.0)
    rid, item = submit(rig, 4, 4)
    rig.executor.execute([(rid, item)])
    rig.manager.register_receiver(rig.frame(4, "early", 4, n=2))
    rig.clock.advance(9.0)
    rig.executor.poll()
    assert rig.manager.room_status(4) == "parked"
    rig.clock.advance(1.5)
    rig.executor.poll()
    assert rig.manager.room_status(4) == "failed"
    assert rig.receiver("early").statuses(4) == ["failed"]
    assert rig.executor.ring.live == 0  # abandoned: no write was issued
    rig.manager.register_receiver(rig.frame(4, "late", 4, n=2))
    assert rig.receiver("late").statuses(4) == ["failed"]
    assert rig.transport.submitted == 0


def test_partial_registrations_do_not_extend_the_park_deadline():
    rig = make_rig(park_timeout=10.0)
    rid, item = submit(rig, 4, 6)
    rig.executor.execute([(rid, item)])
    for t, rank in ((4.0, 0), (4.0, 1)):
        rig.clock.advance(t)
        rig.manager.register_receiver(rig.frame(4, f"p{rank}", 6, n=3, rank=rank, shard=True))
        rig.executor.poll()
    rig.clock.advance(2.5)  # 10.5 s after parking, 2.5 s after the last registration
    rig.executor.poll()
    assert rig.manager.room_status(4) == "failed"
    assert rig.receiver("p0").statuses(4) == ["failed"] and rig.receiver("p1").statuses(4) == ["failed"]


def test_receivers_without_a_sender_expire_and_are_told():
    rig = make_rig(park_timeout=5.0)
    rig.manager.register_receiver(rig.frame(8, "p8", 2))
    rig.clock.advance(6.0)
    rig.executor.poll()
    assert rig.manager.room_status(8) == "failed"
    assert rig.receiver("p8").statuses(8) == ["failed"]
    # A sender arriving afterwards binds to the failure; its chunk is never written.
    rid, item = submit(rig, 8, 2)
    rig.executor.execute([(rid, item)])
    assert rig.transport.submitted == 0
    assert rig.executor.reap_concluded_senders(set()) == 1


# -------------------------------------------------------------- validation ---

@pytest.mark.parametrize("span, override, reason", [
    (5, dict(hidden=16), "hidden"),
    (5, dict(dtype="torch.bfloat16"), "torch.bfloat16"),
    (7, dict(), "expects 7 rows"),
    (5, dict(has_deepstack=True, dst_deep_ptr=0x1000, deep_levels=1), "deepstack"),
])
@pytest.mark.parametrize("frame_first", [False, True], ids=["chunk-first", "frame-first"])
def test_fanout_mismatch_fails_the_room_with_a_reason(span, override, reason, frame_first):
    # either order: the frame checked against a staged chunk, or the chunk against the frames it finds
    rig = make_rig()
    rid, item = submit(rig, 2, 5)
    if frame_first:
        rig.manager.register_receiver(rig.frame(2, "p2", span, **override))
    rig.executor.execute([(rid, item)])
    if not frame_first:
        rig.manager.register_receiver(rig.frame(2, "p2", span, **override))
    assert rig.manager.room_status(2) == "failed"
    assert reason in rig.manager.failure_reason(2)
    assert rig.receiver("p2").statuses(2) == ["failed"]
    assert rig.executor.ring.live == 0


def test_shard_gap_fails_the_room_and_tells_every_receiver():
    rig = make_rig()
    rid, item = submit(rig, 2, 6)
    rig.executor.execute([(rid, item)])
    rig.manager.register_receiver(rig.frame(2, "a", 6, n=2, row_start=0, n_tokens=2))
    rig.manager.register_receiver(rig.frame(2, "b", 6, n=2, row_start=3, n_tokens=3))
    assert rig.manager.room_status(2) == "failed" and "gap" in rig.manager.failure_reason(2)
    assert rig.receiver("a").statuses(2) == ["failed"] and rig.receiver("b").statuses(2) == ["failed"]
    assert rig.transport.submitted == 0


def test_malformed_frame_fails_only_its_own_room():
    rig = make_rig()
    good_rid, good = submit(rig, 1, 2)
    submit(rig, 2, 2)
    rig.manager.register_receiver(rig.frame(1, "p1", 2))
    assert not rig.manager.register_receiver(rig.frame(2, "p2", 2, n_tokens=-3))
    assert not rig.manager.register_receiver(rig.frame(2, "p2b", 2)._replace(room="two"))
    assert rig.manager.stats["frames_refused"] == 2
    assert rig.manager.room_status(2) == "failed"
    assert rig.receiver("p2").statuses(2) == ["failed"]
    rig.executor.execute([(good_rid, good)])
    rig.executor.poll()
    assert rig.manager.room_status(1) == "success"


def test_duplicate_frame_is_idempotent_and_conflicting_one_fails_the_room():
    rig = make_rig()
    submit(rig, 1, 2)
    f = rig.frame(1, "p1", 2, n=2)
    assert rig.manager.register_receiver(f)
    assert rig.manager.register_receiver(f)
    assert rig.manager.stats["duplicate_frames"] == 1 and rig.manager.room_status(1) == "registered"
    assert not rig.manager.register_receiver(rig.frame(1, "p1", 2, n=2, dst_ptr=f.dst_ptr + 64))
    assert rig.manager.room_status(1) == "failed"


def test_more_receivers_than_declared_fails_the_room():
    rig = make_rig()
    submit(rig, 1, 2)
    rig.manager.register_receiver(rig.frame(1, "a", 2, n=1))
    rig.manager.register_receiver(rig.frame(1, "b", 2, n=1))
    assert rig.manager.room_status(1) == "failed"
    assert "beyond the N=1" in rig.manager.failure_reason(1)


def test_room_id_reuse_after_success_is_refused():
    rig = make_rig()
    rid, item = submit(rig, 1, 2)
    rig.manager.register_receiver(rig.frame(1, "p1", 2))
    rig.executor.execute([(rid, item)])
    rig.executor.poll()
    with pytest.raises(RoomConflict):
        rig.executor.register("other", "h", 1, 1)
    with pytest.raises(ValueError, match="already registered"):
        rig.executor.register(rid, "h", 1, 99)


def test_second_item_for_a_room_fails_it():
    rig = make_rig()
    rid, a = submit(rig, 1, 2)
    b = rig.item(2, 99)
    rig.executor.execute([(rid, a), (rid, b)])
    assert rig.manager.room_status(1) == "failed"
    assert "exactly one" in rig.manager.failure_reason(1)


def test_room_status_query():
    rig = make_rig()
    assert rig.manager.room_status(42) is None
    submit(rig, 42, 2)
    assert rig.manager.room_status(42) == "registered"


# -------------------------------------------------------- transfer outcomes ---

def test_write_failure_quarantines_the_extent_until_the_deadline():
    rig = make_rig(extents=1, extent_bytes=64, quarantine_s=5.0)  # one 2-row item fills the arena
    rig.transport.inject("fail", session="p1")
    rid, item = submit(rig, 1, 2)
    rig.manager.register_receiver(rig.frame(1, "p1", 2))
    rig.executor.execute([(rid, item)])
    extent = rig.extent_of(1)
    rig.executor.poll()
    assert rig.manager.room_status(1) == "failed"
    assert rig.receiver("p1").statuses(1) == ["failed"]
    assert extent.state == "quarantined" and rig.executor.ring.lease(1) is None
    rig.clock.advance(4.9)
    rig.executor.poll()
    assert extent.state == "quarantined"
    rig.clock.advance(0.2)
    rig.executor.poll()
    assert extent.state == "free"


def test_timed_out_write_that_lands_later_corrupts_no_other_room():
    rig = make_rig(extents=1, extent_bytes=128, quarantine_s=5.0)  # one 4-row item fills the arena
    rig.transport.inject("timeout_land_later", session="slow", delay=1.0, land_after=4.0)
    rid, item = submit(rig, 1, 4, seed=11)
    rig.manager.register_receiver(rig.frame(1, "slow", 4))
    rig.executor.execute([(rid, item)])
    rig.clock.advance(1.0)
    rig.executor.poll()
    assert rig.manager.room_status(1) == "failed"
    # The next room must wait for the extent instead of overwriting it.
    rid2, item2 = submit(rig, 2, 4, seed=22)
    rig.manager.register_receiver(rig.frame(2, "fast", 4))
    rig.executor.execute([(rid2, item2)])
    assert rig.executor.has_deferred()
    rig.clock.advance(3.5)
    rig.executor.poll()  # the stale write lands now, from the untouched extent
    assert rig.transport.late_landings == 1
    assert rig.delivered_ok(1, "slow", item)  # it read room 1's own bytes
    rig.clock.advance(2.0)
    rig.executor.poll()
    rig.executor.poll()
    assert rig.manager.room_status(2) == "success" and rig.delivered_ok(2, "fast", item2)


def test_write_without_any_report_hits_its_own_deadline():
    rig = make_rig(write_timeout=3.0, quarantine_s=1.0)
    rig.transport.inject("hold", session="p1")
    rid, item = submit(rig, 1, 2)
    rig.manager.register_receiver(rig.frame(1, "p1", 2))
    rig.executor.execute([(rid, item)])
    rig.clock.advance(3.0)
    rig.executor.poll()
    assert rig.manager.room_status(1) == "failed" and "no report within 3.0 s" in rig.manager.failure_reason(1)
    assert rig.receiver("p1").statuses(1) == ["failed"]
    # The transport may still be reading the extent: it is not reusable, however long we wait.
    extent = next(iter(rig.executor.ring.extents.values()))
    rig.clock.advance(100.0)
    rig.executor.poll()
    assert extent.state == "sending"
    # Its late report (even a success) only starts the quarantine; the room stays failed.
    rig.transport.complete(rig.transport.held[0], Outcome.DONE)
    rig.executor.poll()
    assert extent.state == "quarantined" and rig.manager.stats["completions_dropped"] == 1
    rig.clock.advance(1.0)
    rig.executor.poll()
    assert extent.state == "free" and rig.manager.room_status(1) == "failed"


def test_one_failed_receiver_fails_the_room_for_all_and_late_completion_is_dropped():
    rig = make_rig()
    rig.transport.inject("hold", session="b")
    rid, item = submit(rig, 1, 4)
    rig.manager.register_receiver(rig.frame(1, "a", 4, n=2))
    rig.manager.register_receiver(rig.frame(1, "b", 4, n=2))
    rig.transport.inject("fail", session="a")  # too late for a: its write already went
    rig.executor.execute([(rid, item)])
    rig.receiver("a").kill()
    rig.executor.poll()
    # a's write landed before the kill; b's is held. Now b fails.
    rig.transport.complete(rig.transport.held[0], Outcome.FAILED)
    rig.executor.poll()
    assert rig.manager.room_status(1) == "failed"
    assert rig.receiver("b").statuses(1) == ["failed"]
    extent = rig.extent_of(1)
    assert extent.state == "quarantined"


def test_completion_for_a_concluded_room_is_dropped():
    rig = make_rig()
    rig.transport.inject("hold", session="a")
    rid, item = submit(rig, 1, 4)
    rig.manager.register_receiver(rig.frame(1, "a", 4, n=2))
    rig.manager.register_receiver(rig.frame(1, "b", 4, n=2))
    rig.transport.inject("fail", session="b")
    rig.executor.execute([(rid, item)])
    rig.executor.poll()  # b fails the room while a is still in flight
    assert rig.manager.room_status(1) == "failed"
    rig.transport.complete(rig.transport.held[0], Outcome.DONE)
    rig.executor.poll()
    assert rig.manager.stats["completions_dropped"] == 1
    assert rig.receiver("a").statuses(1) == ["failed"]  # never told success


def _fence() -> type:
    """A copy fence: every copy it stands for finishes once the class's `done` is set."""

    class Fence:
        done = False

        def query(self):
            return Fence.done

    return Fence


def test_async_copy_gates_the_write_until_the_fence_completes():
    Fence = _fence()
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    tower = TableTower()
    ex = drive(EncodeExecutor(EncodeManager(transport, clock), tower, "cpu", ring_slots=2, ring_bytes=1024,
                              copy_fence=Fence))
    manager = ex.manager
    rcv = transport.add_receiver("p")
    buf = torch.zeros(2, 8)
    rcv.register(buf)
    from epd_ring.executor import ReceiverFrame
    manager.register_receiver(ReceiverFrame(1, "p", buf.data_ptr(), 0, 2, 0, 2, 8, "torch.float32", False, 1))
    ex.register("r", "h", 1, 1)
    item = EncodeItem("image", 2, meta={"seed": 3})
    ex.execute([("r", item)])
    assert [e.state for e in ex.ring.extents.values()] == ["copying"] and transport.submitted == 0
    ex.poll()
    assert transport.submitted == 0
    Fence.done = True
    ex.poll()
    ex.poll()
    assert manager.room_status(1) == "success" and torch.equal(buf, tower.expected(item))


def test_the_cores_poll_counts_the_copies_it_finished_and_the_deadlines_it_fired():
    # A caller without a pump reads the core's poll (the seed's loop did): its count is both.
    Fence = _fence()
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    ex = EncodeExecutor(EncodeManager(transport, clock, announce_timeout=5.0), TableTower(), "cpu", ring_slots=2,
                        ring_bytes=1024, copy_fence=Fence)
    manager = ex.manager
    from epd_ring.executor import ReceiverFrame
    manager.register_receiver(ReceiverFrame(2, "q", 4096, 0, 2, 0, 2, 8, "torch.float32", False, 1))  # no sender
    ex.register("r", "h", 1, 1)
    assert ex.poll() == 0  # no copy, nothing due
    ex.execute([("r", EncodeItem("image", 2, meta={"seed": 3}))])
    assert ex.poll() == 0  # the copy is under way, nothing is due
    Fence.done = True
    clock.advance(6.0)  # room 2's announce deadline passes
    assert ex.poll() == 2  # one copy handed on, one deadline fired
    assert manager.room_status(2) == "failed"


def _send_one(transport, ex) -> None:
    """Room 1 with one receiver "p" on `transport`, its request "r" registered and its item executed."""
    rcv = transport.add_receiver("p")
    buf = torch.zeros(2, 8)
    rcv.register(buf)
    from epd_ring.executor import ReceiverFrame
    ex.manager.register_receiver(ReceiverFrame(1, "p", buf.data_ptr(), 0, 2, 0, 2, 8, "torch.float32", False, 1))
    ex.register("r", "h", 1, 1)
    ex.execute([("r", EncodeItem("image", 2, meta={"seed": 3}))])


def test_a_pump_given_its_own_transport_does_every_effect_and_poll_through_it():
    # A driver may hand the pump a wrapper of the manager's transport (one that counts, times or guards
    # each call): the writes, notices and polls then all go through the wrapper, none around it.
    clock = FakeClock()
    inner = LoopbackTransport(clock)
    calls: dict[str, int] = {}

    class Counting:
        def __getattr__(self, name):
            attr = getattr(inner, name)
            if not callable(attr):
                return attr

            def call(*args, **kw):
                calls[name] = calls.get(name, 0) + 1
                return attr(*args, **kw)
            return call

    ex = drive(EncodeExecutor(EncodeManager(inner, clock), TableTower(), "cpu", ring_slots=2, ring_bytes=1024),
               Counting())
    _send_one(inner, ex)
    ex.poll()
    assert ex.manager.room_status(1) == "success"
    assert calls.get("submit_write") == 1 and calls.get("poll", 0) >= 1 and calls.get("notify", 0) >= 1


def test_a_ticks_count_adds_its_sources_the_copies_it_finished_and_the_outcomes_it_took():
    # A driver's loop reads the tick's count to know whether anything moved: every part of it counts.
    Fence = _fence()
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    ex = EncodeExecutor(EncodeManager(transport, clock), TableTower(), "cpu", ring_slots=2, ring_bytes=1024,
                        copy_fence=Fence)
    pump = Pump(ex)
    pump.sources.append(lambda: 3)  # a control plane that handled three frames
    _send_one(transport, ex)
    pump.flush()
    assert pump.tick() == 3  # the sources' only: the copy is under way
    Fence.done = True
    assert pump.tick() == 3 + 1 + 1  # the sources', the copy handed on, and its write's outcome
    assert ex.manager.room_status(1) == "success"


# ------------------------------------------------------------- under load ---

def test_bytes_match_tower_output_under_ring_pressure_and_faults():
    rig = make_rig(extents=3, quarantine_s=2.0, park_timeout=50.0, max_deferred=64)
    rooms = {}
    g = torch.Generator().manual_seed(0)
    for r in range(60):
        n = int(torch.randint(1, 9, (1,), generator=g))
        rid, item = submit(rig, r, n, seed=1000 + r)
        rooms[r] = (rid, item, n)
        if r % 7 == 3:
            rig.transport.inject("timeout_land_later", session=f"p{r}", delay=0.5, land_after=1.5)
        if r % 2 == 0:  # early registration; odd rooms register late
            rig.manager.register_receiver(rig.frame(r, f"p{r}", n))
    for r in range(0, 60, 4):
        rig.executor.execute([(rooms[i][0], rooms[i][1]) for i in range(r, r + 4)])
        for i in range(r, r + 4):
            if i % 2 == 1:
                rig.manager.register_receiver(rig.frame(i, f"p{i}", rooms[i][2]))
        rig.clock.advance(0.5)
        rig.executor.poll()
    for _ in range(40):
        rig.clock.advance(0.5)
        rig.executor.poll()
    for r, (_rid, item, _n) in rooms.items():
        status = rig.manager.room_status(r)
        if r % 7 == 3:
            assert status == "failed"
        else:
            assert status == "success", (r, status)
            assert rig.delivered_ok(r, f"p{r}", item), r
    assert rig.executor.ring.live == 0
    assert rig.transport.late_landings == len([r for r in rooms if r % 7 == 3])


def test_senders_and_tombstones_stay_bounded_over_10000_rooms():
    rig = make_rig(extents=8, max_tombstones=512, tombstone_ttl=5.0)
    ex, m = rig.executor, rig.manager
    rcv = rig.receiver("p")
    buf = torch.zeros(2, 8)
    rcv.register(buf)
    from epd_ring.executor import ReceiverFrame
    peak_senders = peak_tombs = 0
    for r in range(10_000):
        ex.register(r, "h", 1, r)
        if r % 10 == 9:
            ex.fail_rooms([r], RuntimeError("client abort"))
        else:
            m.register_receiver(ReceiverFrame(r, "p", buf.data_ptr(), 0, 2, 0, 2, 8, "torch.float32", False, 1))
            ex.execute([(r, EncodeItem("image", 2, meta={"seed": r}))])
        ex.poll()
        ex.reap_concluded_senders(set())
        rig.clock.advance(0.001)
        peak_senders = max(peak_senders, len(ex.senders))
        peak_tombs = max(peak_tombs, len(m.tombstones))
    assert m.stats["success"] == 9000 and m.stats["failed"] == 1000
    assert peak_senders <= 1 and peak_tombs <= 512
    assert len(m.rooms) == 0 and m.deadlines.heap_size < 8192
    rig.clock.advance(10.0)
    ex.poll()
    assert len(m.tombstones) == 0


def test_a_live_senders_room_record_outlives_the_tombstone_cap():
    """The deep profile's case: a room failed by a bad frame while its sender waits for the tower.

    The cap evicts records only once no sender holds them, so the later cache hit still
    finds the failure; after the sender is reaped the record ages out like any other.
    """
    rig = make_rig(max_tombstones=1)
    ex, m = rig.executor, rig.manager
    rid, item = submit(rig, 1, 2)
    m.register_receiver(rig.frame(1, "p1", 2)._replace(dtype="float32"))  # malformed: fails room 1
    for r in (2, 3, 4):
        ex.register(f"req-{r}", "h", 1, r)
        ex.fail_rooms([f"req-{r}"], RuntimeError("client abort"))
        ex.reap_concluded_senders({rid})
    assert len(m.tombstones) == 1 and list(m.pinned) == [1]
    item.encoded = torch.zeros(2, rig.tower.hidden)
    ex.send_item(rid, item)
    assert m.room_status(1) == "failed" and m.failure_reason(1).startswith("malformed")
    ex.reap_concluded_senders(set())
    assert not m.pinned and list(m.tombstones) == [1]


# -- deferred sends ----------------------------------------------------------------------------

def test_deferred_sends_drop_reaped_skip_concluded_and_stage_the_rest_in_one_poll():
    rig = make_rig(extents=1, extent_bytes=64)
    ex, m, t = rig.executor, rig.manager, rig.transport
    obs = m.observer = Calls("deferred", "undeferred", "copy_started", "copy_finished")
    items = {}
    for r in (1, 2, 3, 5, 6, 4):  # the order they are offered (and deferred)
        rig.open_room(r)
    t.inject("hold", session="p1")
    for r in (1, 2, 3, 5, 6, 4):
        items[r] = rig.item(2, r)
        assert ex.execute([(f"r{r}", items[r])]) == 1
    assert ex.has_deferred() and ex.health()["deferred"] == 5
    for r in (2, 3):
        m.fail_room(r, "aborted")
    assert ex.reap_concluded_senders() == 2  # r2 and r3: their deferred items have no sender now
    for r in (5, 6):
        m.fail_room(r, "aborted")  # concluded, sender kept
    t.complete(t.held[0])
    # Room 1's outcome frees the extent; the same poll drops 2 and 3, skips 5 and 6,
    # and stages 4 (its write is reported at the next poll).
    assert ex.poll() == 1
    assert not ex.has_deferred()
    assert m.room_status(4) == "transferring"
    assert ex.poll() == 1
    assert m.room_status(4) == "success" and rig.delivered_ok(4, "p4", items[4])
    assert rig.delivered_ok(1, "p1", items[1])
    assert counters(m.stats, "deferred", "deferred_dropped", "items_for_concluded_rooms", "success") == {
        "deferred": 5, "deferred_dropped": 2, "items_for_concluded_rooms": 2, "success": 2}
    assert obs.calls == [("copy_started", 1), ("copy_finished", 1),
                         ("deferred", 2), ("deferred", 3), ("deferred", 5), ("deferred", 6), ("deferred", 4),
                         ("undeferred", 5), ("undeferred", 6), ("undeferred", 4),
                         ("copy_started", 4), ("copy_finished", 4)]


def test_a_large_deferred_item_is_served_before_any_later_small_one():
    """Strict FIFO: while the head of the deferred queue does not fit, nothing behind it is served,
    though the small items behind it would fit; it goes first as soon as its bytes are free."""
    rig = make_rig(arena_bytes=256)  # 8 rows of 8 float32
    ex, m, t = rig.executor, rig.manager, rig.transport
    obs = m.observer = Calls("copy_started")
    for r in (1, 2):
        rig.held_room(r)  # two small items in flight: 128 of 256 bytes
    rig.open_room(3, rows=8)
    t.inject("hold", session="p3")
    ex.execute([("r3", rig.item(8, 3))])  # the big item needs the whole arena: deferred
    for r in (4, 5):
        rig.open_room(r)
        ex.execute([(f"r{r}", rig.item(2, r))])  # small, and 128 bytes are free: still they queue behind it
    assert ex.deferred_requests() == ["r3", "r4", "r5"] and ex.ring.main_arena.largest_free == 128
    t.complete(t.held[0])  # room 1's bytes come back: 192 free, the big item still does not fit
    ex.poll()
    ex.poll()
    assert m.room_status(1) == "success" and ex.deferred_requests() == ["r3", "r4", "r5"]
    t.complete(t.held[0])  # room 2's too: the big item fits and goes first
    ex.poll()
    assert ex.deferred_requests() == ["r4", "r5"] and m.room_status(3) == "transferring"
    t.complete(t.held[0])
    ex.poll()
    ex.poll()
    assert [m.room_status(r) for r in (3, 4, 5)] == ["success"] * 3 and not ex.has_deferred()
    assert [room for _, room in obs.calls] == [1, 2, 3, 4, 5]


def test_an_item_larger_than_the_arena_fails_at_once_and_never_blocks_the_queue():
    rig = make_rig(arena_bytes=128)
    ex, m = rig.executor, rig.manager
    rig.held_room(1)  # 64 of 128 bytes in flight
    rig.open_room(2, rows=5)
    ex.execute([("r2", rig.item(5, 2))])  # 160 bytes: more than the whole arena
    assert reason_kind(m, 2) is ReasonKind.TOO_LARGE and not ex.has_deferred()
    rig.open_room(3)
    ex.execute([("r3", rig.item(2, 3))])
    assert m.room_status(3) == "transferring"  # the small one is not held up behind it


def test_a_full_ring_with_no_deferral_allowed_fails_the_send_at_once():
    rig = make_rig(extents=1, extent_bytes=64, max_deferred=0)
    ex, m, t = rig.executor, rig.manager, rig.transport
    t.inject("hold", session="p1")
    for r in (1, 2):
        rig.open_room(r)
        ex.execute([(f"r{r}", rig.item(2, r))])
    assert m.room_status(1) == "transferring"
    assert reason_kind(m, 2) is ReasonKind.DEFERRED_FULL
    assert m.stats["deferred"] == 0 and not ex.has_deferred()


def test_the_deferred_queue_is_bounded_by_max_deferred():
    rig = make_rig(extents=1, extent_bytes=64, max_deferred=2)
    ex, m, t = rig.executor, rig.manager, rig.transport
    t.inject("hold", session="p1")
    for r in (1, 2, 3, 4):
        ex.register(f"r{r}", "prefill-host", 8998, r)
        ex.execute([(f"r{r}", rig.item(2, r))])
    assert ex.max_deferred == 2 and ex.health()["deferred"] == 2
    assert [m.room_status(r) for r in (2, 3)] == ["registered", "registered"]
    assert reason_kind(m, 4) is ReasonKind.DEFERRED_FULL
    assert m.stats["deferred"] == 2


def test_a_deferred_send_keeps_its_bytes_when_the_tower_reuses_its_buffers():
    rig = make_rig(extents=1, extent_bytes=64, n_deep=2)
    ex, m, t = rig.executor, rig.manager, rig.transport
    t.inject("hold", session="p1")
    for r in (1, 2):
        rig.open_room(r)
    ex.execute([("r1", rig.item(2, 1))])
    main, deep = torch.full((2, 8), 2.0), torch.full((2, 16), 3.0)
    ex.send_item("r2", EncodeItem("image", 2, encoded=main, encoded_deepstack=deep))  # a cache hit, deferred
    assert ex.has_deferred()
    main.fill_(-1.0)  # the buffers are reused for the next batch
    deep.fill_(-1.0)
    t.complete(t.held[0])
    ex.poll()
    ex.poll()
    assert m.room_status(2) == "success"
    got_main, got_deep = rig.buffers[(2, "p2")][:2]
    assert torch.equal(got_main, torch.full((2, 8), 2.0)) and torch.equal(got_deep, torch.full((2, 16), 3.0))


# -- copy fences -------------------------------------------------------------------------------

class Fence:
    """A copy fence finished by hand (as a CUDA event would finish on its own)."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


class Fences:
    def __init__(self):
        self.made: list[Fence] = []

    def __call__(self) -> Fence:
        self.made.append(Fence())
        return self.made[-1]


def fenced_rig(extents: int):
    """A rig whose executor fences every copy with a hand-finished `Fence`."""
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    manager = EncodeManager(transport, clock)
    tower = TableTower()
    fences = Fences()
    executor = drive(EncodeExecutor(manager, tower, "cpu", ring_slots=extents, ring_bytes=4096, copy_fence=fences))
    return Rig(clock, transport, executor.manager, executor, tower), fences


def test_fenced_copies_wait_for_their_fence_and_finish_out_of_order():
    rig, fences = fenced_rig(2)
    ex, m = rig.executor, rig.manager
    obs = m.observer = Calls("deferred", "undeferred", "copy_started", "copy_finished")
    items = {r: rig.item(2, r) for r in (1, 2)}
    for r in (1, 2):
        rig.open_room(r)
    assert ex.execute([("r1", items[1]), ("r2", items[2])]) == 2
    dump = ex.dump_state().splitlines()
    assert dump[1:3] == ["  extent 1 @0+64: copying room=1", "  extent 2 @64+64: copying room=2"]
    assert ex.health()["extents"] == {"free": 0, "copying": 2, "staged": 0, "parked": 0, "sending": 0,
                                      "quarantined": 0, "retired": 0}
    assert ex.finish_copies() == 0 and ex.poll() == 0
    assert rig.transport.submitted == 0  # no write may read an extent whose copy is pending
    fences.made[1].done = True
    assert ex.poll() == 2  # room 2's copy finished, and its write reported
    assert (m.room_status(1), m.room_status(2)) == ("ready", "success")
    fences.made[0].done = True
    assert ex.poll() == 2
    assert m.room_status(1) == "success"
    assert all(rig.delivered_ok(r, f"p{r}", items[r]) for r in (1, 2))
    assert obs.calls == [("copy_started", 1), ("copy_started", 2), ("copy_finished", 2), ("copy_finished", 1)]
    assert ex.poll() == 0


# -- senders: registration, the one item rule, reaping -----------------------------------------

def test_registration_and_the_one_item_rule():
    rig = make_rig()
    ex, m, t = rig.executor, rig.manager, rig.transport
    ex.register("r", "prefill-host", 8998, 1)
    sender = ex.senders["r"]
    assert (sender.request_id, sender.room, sender.bootstrap_host, sender.bootstrap_port) == \
        ("r", 1, "prefill-host", 8998)
    with pytest.raises(ValueError, match="'r'"):
        ex.register("r", "prefill-host", 8998, 2)
    assert m.room_status(2) is None
    m.register_receiver(rig.frame(1, "p1", 2))
    t.inject("hold", session="p1")
    ex.execute([("r", rig.item(2, 1))])
    assert m.room_status(1) == "transferring"
    ex.execute([("r", rig.item(2, 1))])
    assert reason_kind(m, 1) is ReasonKind.PROTOCOL
    # Items for requests never registered, or whose room already failed, are counted and dropped.
    ex.register("late", "prefill-host", 8998, 2)
    m.fail_room(2, "aborted")
    ex.register("late2", "prefill-host", 8998, 3)
    m.fail_room(3, "aborted")
    for rid in ("nobody", "nobody-else", "late", "late2"):
        ex.execute([(rid, rig.item(2, 7))])
    assert counters(m.stats, "items_without_sender", "items_for_concluded_rooms", "items_refused") == {
        "items_without_sender": 2, "items_for_concluded_rooms": 2, "items_refused": 0}


def test_a_sender_concluded_twice_through_a_shared_manager_is_reaped_once():
    # Two executors on one manager: a request bound to peer A's failed room 5 is concluded
    # again when peer B's new room 5 (opened by the other executor) fails too.
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    ex2 = EncodeExecutor(m, TableTower(), "cpu", ring_slots=2, ring_bytes=4096)
    assert m.register_receiver(rig.frame(5, "a1", 2, identity="A"))
    assert m.fail_room(5, "a fails")
    ex.register("x", "prefill-host", 8998, 5)
    ex2.register("y", "prefill-host", 8998, 5, receiver="B")
    m.fail_room(5, "b fails")
    assert ex.reap_concluded_senders() == 1 and "x" not in ex.senders
    assert ex2.reap_concluded_senders() == 1 and "y" not in ex2.senders


def test_a_reused_request_id_is_not_reaped_when_an_old_room_id_concludes_again():
    rig = make_rig(max_tombstones=1, announce_timeout=5.0)
    ex, m = rig.executor, rig.manager
    ex.register("old", "prefill-host", 8998, 5)
    m.fail_room(5, "aborted")
    assert ex.reap_concluded_senders() == 1
    # A sender for a room that already failed binds to the failure; it is reaped too.
    ex.register("late", "prefill-host", 8998, 5)
    assert ex.reap_concluded_senders() == 1
    ex.register("other", "prefill-host", 8998, 6)
    m.fail_room(6, "aborted")  # with one tombstone kept, room 5's record goes
    assert ex.reap_concluded_senders() == 1
    assert m.room_status(5) is None
    # Room id 5 comes back through a receiver's frame, and its announcement expires.
    m.register_receiver(rig.frame(5, "p5", 2))
    ex.register("late", "prefill-host", 8998, 7)  # the request id is used again, for room 7
    m.register_receiver(rig.frame(7, "p7", 2))
    rig.clock.advance(5.0)
    ex.poll()
    assert m.room_status(5) == "failed"
    assert ex.reap_concluded_senders() == 0  # room 7's sender is live
    item = rig.item(2, 7)
    assert ex.execute([("late", item)]) == 1
    ex.poll()
    assert m.room_status(7) == "success" and rig.delivered_ok(7, "p7", item)


# -- health and dumps --------------------------------------------------------------------------

def test_health_counts_every_extent_state_live_room_and_arena_bytes():
    rig = make_rig()
    ex, t = rig.executor, rig.transport
    rig.open_room(1, rid="r")
    ex.register("waiting", "prefill-host", 8998, 2)
    t.inject("fail", session="p1")
    ex.execute([("r", rig.item(2, 1))])
    ex.poll()  # the write failed: its extent is quarantined, the room failed
    h = ex.health()
    assert h["extents"] == {"free": 0, "copying": 0, "staged": 0, "parked": 0, "sending": 0,
                            "quarantined": 1, "retired": 0}
    assert h["main_bytes_in_use"] == 64 and h["main_largest_free"] == 4 * 4096 - 64  # the extent is at offset 0
    assert h["main_fragmentation"] == 0.0
    assert (h["quarantined"], h["rooms"], h["deferred"], h["writes_in_flight"]) == (1, 1, 0, 0)


def test_dump_state_lists_extents_rooms_and_peers():
    rig = make_rig(peer_fail_threshold=1)
    ex, t = rig.executor, rig.transport
    rig.held_room(1)  # room 1: its write is held in flight
    # room 2: a sender and no receiver yet
    ex.register("r2", "prefill-host", 8998, 2)
    # room 3: one of its two receivers, so its chunk parks
    rig.open_room(3, n=2)
    ex.execute([("r3", rig.item(2, 3))])
    # room 4: its write fails, and re-contacting the peer is refused
    rig.open_room(4)
    t.inject("fail", session="p4")
    t.inject_contact("refuse", session="p4")
    ex.execute([("r4", rig.item(2, 4))])
    ex.poll()
    assert ex.dump_state() == "\n".join([
        "ring: arena of 16384 B, 192 B in 3 extents, largest free 16192 B, 0 deferred",
        "  extent 1 @0+64: sending room=1 writes=1",
        "  extent 2 @64+64: parked room=3",
        "  extent 3 @128+64: quarantined room=4",
        "  room 1: transferring receivers=1/1",
        "  room 2: registered receivers=0/?",
        "  room 3: parked receivers=1/2 extent=2",
        "  peer p1: up rooms=1",
        "  peer p3: up rooms=1",
        "  peer p4: down rooms=0 fails=1 (contact failed (refused))",
    ])
    with pytest.raises(ValueError, match=r"^format\b.*'svg'$"):
        ex.dump_state("svg")


def test_a_deepstack_arena_size_given_for_a_model_without_deepstack_makes_no_deepstack_arena():
    # Such a model's items carry no deepstack rows: one that does is refused as a bad item (kind
    # `item`), not measured against an arena that holds nothing.
    clock = FakeClock()
    ex = drive(EncodeExecutor(EncodeManager(LoopbackTransport(clock), clock), TableTower(), "cpu",
                              arena_bytes=4096, deep_arena_bytes=4096))
    assert ex.ring.deep is None
    ex.register("r", "prefill-host", 8998, 1)
    ex.send_item("r", EncodeItem("image", 2, encoded=torch.ones(2, 8), encoded_deepstack=torch.ones(2, 8)))
    assert reason_kind(ex.manager, 1) is ReasonKind.ITEM and ex.ring.live == 0


def test_fail_rooms_with_an_exception_that_says_nothing_still_gives_a_reason():
    rig = make_rig()
    submit(rig, 1, 2, rid="a")
    assert rig.executor.fail_rooms(["a"], RuntimeError()) == 1
    assert reason_kind(rig.manager, 1) is ReasonKind.CALLER and rig.manager.failure_reason(1)
