"""The encode executor's own bookkeeping, pinned where mutation testing found it loose.

Each scenario drives the public surface (register, execute, send_item, poll,
close, health, dump_state) on the loopback transport with a fake clock, and
checks what a user sees: each room's outcome and reason, the bytes that land,
slot states, stats counters and observer calls.
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import Rig, TableTower, make_rig  # noqa: E402

from epd_ring.executor import (EncodeExecutor, EncodeItem, EncodeManager, FakeClock, LoopbackTransport,  # noqa: E402
                               Modality, Observer)


class Recorder(Observer):
    """Keeps the executor-level hook calls, in order, as (hook, room)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def deferred(self, room):
        self.calls.append(("deferred", room))

    def undeferred(self, room):
        self.calls.append(("undeferred", room))

    def copy_started(self, room):
        self.calls.append(("copy_started", room))

    def copy_finished(self, room):
        self.calls.append(("copy_finished", room))

    def tower_failed(self, rooms):
        self.calls.append(("tower_failed", rooms))


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


def fenced_rig(slots: int):
    """A rig whose executor fences every copy with a hand-finished `Fence`."""
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    manager = EncodeManager(transport, clock)
    tower = TableTower()
    fences = Fences()
    executor = EncodeExecutor(manager, tower, "cpu", ring_slots=slots, ring_bytes=4096, copy_fence=fences)
    return Rig(clock, transport, manager, executor, tower), fences


def zero_stats(stats, *keys):
    return {k: stats[k] for k in keys}


# ------------------------------------------------------------ bad items ---

def test_refused_items_fail_only_their_own_rooms_with_exact_reasons():
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    for rid, room in (("audio", 1), ("bare", 2), ("good", 3)):
        ex.register(rid, "prefill-host", 8998, room)
    m.register_receiver(rig.frame(3, "p3", 2))
    good = rig.item(2, 3)
    batch = [("audio", EncodeItem("audio", 2)),  # a modality the tower lacks
             ("bare", object()),  # no modality at all
             ("good", good),
             ("ghost", EncodeItem("audio", 1)),  # never registered
             (["unhashable"], EncodeItem("audio", 1))]  # cannot even name a request
    assert ex.execute(batch) == 1
    assert m.failure_reason(1) == "bad item EncodeItem: unsupported modality 'audio'"
    assert m.failure_reason(2) == "bad item object: unsupported modality '<none>'"
    assert m.room_status(3) == "transferring"
    assert ex.poll() == 1  # the one write's outcome
    assert m.room_status(3) == "success" and rig.delivered_ok(3, "p3", good)
    # The refused item was request "audio"'s one item: another is a protocol error,
    # not an item for a room that concluded meanwhile.
    ex.send_item("audio", rig.item(2, 1))
    assert m.failure_reason(1) == "bad item EncodeItem: unsupported modality 'audio'"
    assert dict(m.stats) == {"items_refused": 4, "items_without_sender": 2, "failed": 2,
                             "success": 1, "told_success": 1}
    # A batch of one takes the same path.
    ex.register("single", "prefill-host", 8998, 4)
    assert ex.execute([("single", object())]) == 0
    assert ex.execute([(["unhashable"], object())]) == 0
    assert m.failure_reason(4) == "bad item object: unsupported modality '<none>'"
    assert (m.stats["items_refused"], m.stats["items_without_sender"]) == (6, 3)


def test_tower_error_without_a_message_is_named_by_its_type():
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    obs = m.observer = Recorder()
    for r in (1, 2, 3):
        ex.register(f"r{r}", "prefill-host", 8998, r)
    rig.tower.raise_next = RuntimeError()
    batch = [("r1", rig.item(2, 1)), ("r2", rig.item(2, 2)), ("r1", rig.item(2, 1)), ("ghost", rig.item(2, 9))]
    assert ex.execute(batch) == 0
    assert [m.failure_reason(r) for r in (1, 2)] == ["RuntimeError", "RuntimeError"]
    assert obs.calls == [("tower_failed", [1, 2, 1])]  # the registered requests' rooms, as batched
    rig.tower.raise_next = ValueError("out of memory")
    assert ex.execute([("r3", rig.item(2, 3))]) == 0
    assert m.failure_reason(3) == "out of memory"
    assert (m.stats["tower_errors"], m.stats["failed"]) == (2, 3)


def meta_copy_error(shape) -> str:
    """What torch says when asked to copy an embedding that has no data."""
    try:
        torch.empty(shape).copy_(torch.empty(shape, device="meta"))
    except Exception as exc:
        return str(exc)
    raise AssertionError("copying out of a meta tensor is expected to fail")


@pytest.mark.parametrize("half", ["main", "deepstack"])
def test_embedding_without_data_fails_its_room_and_gives_the_slot_back(half):
    rig = make_rig(n_deep=2)
    ex, m = rig.executor, rig.manager
    ex.register("bad", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 2))
    item = rig.item(2, 1)
    item.encoded = torch.zeros(2, 8)
    item.encoded_deepstack = torch.zeros(2, 16)
    if half == "main":
        item.encoded = torch.empty(2, 8, device="meta")
    else:
        item.encoded_deepstack = torch.empty(2, 16, device="meta")
    ex.send_item("bad", item)
    shape = (2, 8) if half == "main" else (2, 16)
    assert m.failure_reason(1) == f"staging failed: {meta_copy_error(shape)}"
    assert ex.ring.free_count == ex.ring.n_slots  # the leased slot went back
    assert m.stats["items_refused"] == 0  # handled by staging, not the last line of defence
    # The worker carries on: the next item lands intact.
    ex.register("next", "prefill-host", 8998, 2)
    m.register_receiver(rig.frame(2, "p2", 2))
    nxt = rig.item(2, 2)
    assert ex.execute([("next", nxt)]) == 1
    ex.poll()
    assert m.room_status(2) == "success" and rig.delivered_ok(2, "p2", nxt)


@pytest.mark.parametrize("deep_width, deep_dtype", [(24, torch.float16), (20, torch.float32)])
def test_deepstack_half_no_receiver_can_take_fails_its_room(deep_width, deep_dtype):
    # Three levels of hidden 8 are 24 float32 columns; another dtype, or a width
    # that is no multiple of hidden, matches no frame's deep_levels.
    rig = make_rig(n_deep=3)
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 2))
    item = EncodeItem("image", 2, encoded=torch.ones(2, 8), encoded_deepstack=torch.ones(2, deep_width, dtype=deep_dtype))
    ex.send_item("r", item)
    assert m.failure_reason(1) == ("room 1: receiver p1 expects 3 deepstack levels, "
                                   "chunk has a width that is no multiple of hidden")
    assert m.stats["items_refused"] == 0
    assert rig.transport.submitted == 0 and ex.ring.free_count == ex.ring.n_slots


def test_zero_width_embedding_fails_on_the_hidden_mismatch():
    rig = make_rig(n_deep=3)
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 2))
    item = EncodeItem("image", 2, encoded=torch.ones(2, 0), encoded_deepstack=torch.ones(2, 24))
    ex.send_item("r", item)
    assert m.failure_reason(1) == "room 1: receiver p1 expects hidden 8, chunk has 0"
    assert m.stats["items_refused"] == 0 and ex.ring.free_count == ex.ring.n_slots


def test_zero_row_embedding_parks_until_its_deadline_and_frees_its_slot():
    # No frame may declare zero rows, so the chunk waits for receivers that cannot
    # come; its park deadline fails the room and the slot goes back.
    rig = make_rig(park_timeout=10.0)
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1)
    ex.send_item("r", EncodeItem("image", 0, encoded=torch.ones(0, 8)))
    assert m.room_status(1) == "parked" and ex.ring.free_count == ex.ring.n_slots - 1
    rig.clock.advance(10.0)
    ex.poll()
    assert m.room_status(1) == "failed" and ex.ring.free_count == ex.ring.n_slots
    assert (m.stats["expired"], m.stats["items_refused"]) == (1, 0)


# --------------------------------------------------------- deferred sends ---

def test_deferred_sends_drop_reaped_skip_concluded_and_stage_the_rest_in_one_poll():
    rig = make_rig(slots=1)
    ex, m, t = rig.executor, rig.manager, rig.transport
    obs = m.observer = Recorder()
    items = {}
    for r in (1, 2, 3, 5, 6, 4):  # the order they are offered (and deferred)
        ex.register(f"r{r}", "prefill-host", 8998, r)
        m.register_receiver(rig.frame(r, f"p{r}", 2))
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
    # Room 1's outcome frees the slot; the same poll drops 2 and 3, skips 5 and 6,
    # and stages 4 (its write is reported at the next poll).
    assert ex.poll() == 1
    assert not ex.has_deferred()
    assert m.room_status(4) == "transferring"
    assert ex.poll() == 1
    assert m.room_status(4) == "success" and rig.delivered_ok(4, "p4", items[4])
    assert rig.delivered_ok(1, "p1", items[1])
    assert zero_stats(m.stats, "deferred", "deferred_dropped", "items_for_concluded_rooms", "success") == {
        "deferred": 5, "deferred_dropped": 2, "items_for_concluded_rooms": 2, "success": 2}
    assert obs.calls == [("copy_started", 1), ("copy_finished", 1),
                         ("deferred", 2), ("deferred", 3), ("deferred", 5), ("deferred", 6), ("deferred", 4),
                         ("undeferred", 5), ("undeferred", 6), ("undeferred", 4),
                         ("copy_started", 4), ("copy_finished", 4)]


# ------------------------------------------------------------ copy fences ---

def test_fenced_copies_wait_for_their_fence_and_finish_out_of_order():
    rig, fences = fenced_rig(2)
    ex, m = rig.executor, rig.manager
    obs = m.observer = Recorder()
    items = {r: rig.item(2, r) for r in (1, 2)}
    for r in (1, 2):
        ex.register(f"r{r}", "prefill-host", 8998, r)
        m.register_receiver(rig.frame(r, f"p{r}", 2))
    assert ex.execute([("r1", items[1]), ("r2", items[2])]) == 2
    dump = ex.dump_state().splitlines()
    assert dump[1:3] == ["  slot 0: copying room=1", "  slot 1: copying room=2"]
    assert ex.health()["slots"] == {"free": 0, "copying": 2, "staged": 0, "parked": 0, "sending": 0,
                                    "quarantined": 0, "retired": 0}
    assert ex.finish_copies() == 0 and ex.poll() == 0
    assert rig.transport.submitted == 0  # no write may read a slot whose copy is pending
    fences.made[1].done = True
    assert ex.poll() == 2  # room 2's copy finished, and its write reported
    assert (m.room_status(1), m.room_status(2)) == ("ready", "success")
    fences.made[0].done = True
    assert ex.poll() == 2
    assert m.room_status(1) == "success"
    assert all(rig.delivered_ok(r, f"p{r}", items[r]) for r in (1, 2))
    assert obs.calls == [("copy_started", 1), ("copy_started", 2), ("copy_finished", 2), ("copy_finished", 1)]
    assert ex.poll() == 0


# --------------------------------------------------------------- shutdown ---

def test_close_rejects_a_negative_timeout():
    rig = make_rig()
    with pytest.raises(ValueError) as err:
        rig.executor.begin_close(-1)
    assert str(err.value) == "timeout must be >= 0, got -1"


@pytest.mark.parametrize("timeout", [0, 0.5])
def test_close_with_a_short_timeout_on_an_idle_worker_is_clean(timeout):
    rig = make_rig()
    report = rig.executor.close(timeout, idle=lambda: rig.clock.advance(0.1))
    assert report.clean and rig.executor.closed and rig.transport.closed


def test_close_can_leave_the_transport_open():
    rig = make_rig()
    report = rig.executor.close(1.0, idle=lambda: rig.clock.advance(0.1), close_transport=False)
    assert report.clean and rig.executor.closed and not rig.transport.closed


def test_close_stops_polling_once_its_timeout_has_passed():
    rig = make_rig()
    ex, m, t = rig.executor, rig.manager, rig.transport
    ex.register("r", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 2))
    t.inject("hold", session="p1")
    ex.execute([("r", rig.item(2, 1))])
    idles = []

    def idle():
        idles.append(rig.clock.now())
        rig.clock.advance(0.5)

    report = ex.close(1.0, idle)
    # Polled at 0, 0.5 and 1.0; at 1.0 the deadline has passed, so no more idling.
    assert idles == [0.0, 0.5] and rig.clock.now() == 1.0
    assert not report.clean and report.rooms_failed == 1 and report.writes_in_flight == 1
    assert report.busy_slots == {"sending": 1}


# --------------------------------------------------------------- reaping ---

def test_a_sender_concluded_twice_through_a_shared_manager_is_reaped_once():
    # Two executors on one manager: a request bound to peer A's failed room 5 is concluded
    # again when peer B's new room 5 (opened by the other executor) fails too.
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    ex2 = EncodeExecutor(m, TableTower(), "cpu", ring_slots=2, ring_bytes=4096)
    assert m.register_receiver(rig.frame(5, "a1", 2, peer="A"))
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


# ------------------------------------------------------- health and dumps ---

def test_health_counts_every_slot_state_and_live_room():
    rig = make_rig()
    ex, m, t = rig.executor, rig.manager, rig.transport
    ex.register("r", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 2))
    ex.register("waiting", "prefill-host", 8998, 2)
    t.inject("fail", session="p1")
    ex.execute([("r", rig.item(2, 1))])
    ex.poll()  # the write failed: its slot is quarantined, the room failed
    h = ex.health()
    assert h["slots"] == {"free": 3, "copying": 0, "staged": 0, "parked": 0, "sending": 0,
                          "quarantined": 1, "retired": 0}
    assert (h["quarantined"], h["rooms"], h["deferred"], h["writes_in_flight"]) == (1, 1, 0, 0)


def test_dump_state_lists_slots_rooms_and_peers():
    rig = make_rig(peer_fail_threshold=1)
    ex, m, t = rig.executor, rig.manager, rig.transport
    # room 1: its write is held in flight
    ex.register("r1", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 2))
    t.inject("hold", session="p1")
    ex.execute([("r1", rig.item(2, 1))])
    # room 2: a sender and no receiver yet
    ex.register("r2", "prefill-host", 8998, 2)
    # room 3: one of its two receivers, so its chunk parks
    ex.register("r3", "prefill-host", 8998, 3)
    m.register_receiver(rig.frame(3, "p3", 2, n=2))
    ex.execute([("r3", rig.item(2, 3))])
    # room 4: its write fails, and re-contacting the peer is refused
    ex.register("r4", "prefill-host", 8998, 4)
    m.register_receiver(rig.frame(4, "p4", 2))
    t.inject("fail", session="p4")
    t.inject_contact("refuse", session="p4")
    ex.execute([("r4", rig.item(2, 4))])
    ex.poll()
    assert ex.dump_state() == "\n".join([
        "ring: 4 slots x 4096 B, 1 free, 0 deferred",
        "  slot 0: sending room=1 writes=1",
        "  slot 1: parked room=3",
        "  slot 2: quarantined room=4",
        "  slot 3: free",
        "  room 1: transferring receivers=1/1",
        "  room 2: registered receivers=0/?",
        "  room 3: parked receivers=1/2 slot=1",
        "  peer p1: up rooms=1",
        "  peer p3: up rooms=1",
        "  peer p4: down rooms=0 fails=1 (contact failed (refused))",
    ])
    with pytest.raises(ValueError) as err:
        ex.dump_state("svg")
    assert str(err.value) == "format must be 'text' or 'dot', got 'svg'"


# ---------------------------------------------------------- construction ---

class PlainTower:
    """A tower with only the encoders: no deepstack attribute, no splitter."""

    def __init__(self, hidden: int = 8, batch_dim: bool = False):
        self.hidden = hidden
        self.batch_dim = batch_dim

    def image_encoder(self, items):
        rows = sum(tokens(i) for i in items)
        out = torch.arange(rows * self.hidden, dtype=torch.float32).reshape(rows, self.hidden)
        return out.unsqueeze(0) if self.batch_dim else out  # some towers keep a batch dimension

    get_video_feature = image_encoder


def tokens(item) -> int:
    """The rows a tower makes for an item: n_tokens, else its inclusive token ranges, else 1."""
    if getattr(item, "n_tokens", None) is not None:
        return item.n_tokens
    return sum(e - s + 1 for s, e in item.offsets) if hasattr(item, "offsets") else 1


def plain_rig(**kw):
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    manager = EncodeManager(transport, clock)
    ex = EncodeExecutor(manager, PlainTower(**kw), "cpu", ring_slots=2, ring_bytes=4096)
    return Rig(clock, transport, manager, ex, TableTower())


@pytest.mark.parametrize("kw, n_deep, message", [
    (dict(ring_slots=0), 0, "ring_slots must be >= 1, got 0"),
    (dict(ring_slots=2.0), 0, "ring_slots must be an integer, got 2.0"),
    (dict(ring_bytes=0), 0, "ring_bytes must be >= 1, got 0"),
    (dict(ring_bytes="4096"), 0, "ring_bytes must be an integer, got '4096'"),
    (dict(ring_bytes=1), 0, "slot bytes must be a positive multiple of 64, got 1"),  # the ring's own check
    (dict(max_deferred=-1), 0, "max_deferred must be >= 0, got -1"),
    (dict(max_deferred=True), 0, "max_deferred must be an integer, got True"),
    (dict(), -1, "model.num_deepstack_embeddings must be >= 0, got -1"),
    (dict(), 1.5, "model.num_deepstack_embeddings must be an integer, got 1.5"),
])
def test_constructor_refuses_bad_sizes_naming_the_setting(kw, n_deep, message):
    clock = FakeClock()
    manager = EncodeManager(LoopbackTransport(clock), clock)
    tower = TableTower()
    tower.num_deepstack_embeddings = n_deep
    with pytest.raises(ValueError) as err:
        EncodeExecutor(manager, tower, "cpu", **{"ring_bytes": 4096, **kw})
    assert str(err.value) == message


def test_constructor_defaults_and_smallest_sizes():
    clock = FakeClock()
    manager = EncodeManager(LoopbackTransport(clock), clock)
    ex = EncodeExecutor(manager, TableTower(), "cpu", ring_bytes=4096)
    assert (ex.ring.n_slots, ex.max_deferred) == (64, 8 * 64)
    assert ex.ring.deep is None
    ex = EncodeExecutor(manager, TableTower(n_deep=3), "cpu", ring_slots=1, ring_bytes=64, max_deferred=0)
    assert (ex.ring.n_slots, ex.ring.slot_bytes, ex.ring.deep_slot_bytes, ex.max_deferred) == (1, 64, 3 * 64, 0)


def test_a_full_ring_with_no_deferral_allowed_fails_the_send_at_once():
    rig = make_rig(slots=1, max_deferred=0)
    ex, m, t = rig.executor, rig.manager, rig.transport
    t.inject("hold", session="p1")
    for r in (1, 2):
        ex.register(f"r{r}", "prefill-host", 8998, r)
        m.register_receiver(rig.frame(r, f"p{r}", 2))
        ex.execute([(f"r{r}", rig.item(2, r))])
    assert m.room_status(1) == "transferring"
    assert m.failure_reason(2) == "deferred queue full (0 sends)"
    assert m.stats["deferred"] == 0 and not ex.has_deferred()


def test_the_deferred_queue_is_bounded_by_max_deferred():
    rig = make_rig(slots=1, max_deferred=2)
    ex, m, t = rig.executor, rig.manager, rig.transport
    t.inject("hold", session="p1")
    for r in (1, 2, 3, 4):
        ex.register(f"r{r}", "prefill-host", 8998, r)
        ex.execute([(f"r{r}", rig.item(2, r))])
    assert ex.max_deferred == 2 and ex.health()["deferred"] == 2
    assert [m.room_status(r) for r in (2, 3)] == ["registered", "registered"]
    assert m.failure_reason(4) == "deferred queue full (2 sends)"
    assert m.stats["deferred"] == 2


def test_a_model_without_deepstack_needs_no_deepstack_members():
    rig = plain_rig()
    ex, m = rig.executor, rig.manager
    assert ex.ring.deep is None
    ex.register("r", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 3))
    item = EncodeItem("image", 3)
    assert ex.execute([("r", item)]) == 1
    assert item.encoded_deepstack is None
    ex.poll()
    assert m.room_status(1) == "success"
    assert torch.equal(rig.buffers[(1, "p1")][0], torch.arange(24, dtype=torch.float32).reshape(3, 8))
    # An item that brings deepstack rows anyway has nowhere to put them.
    ex.register("deep", "prefill-host", 8998, 2)
    ex.send_item("deep", EncodeItem("image", 2, encoded=torch.ones(2, 8), encoded_deepstack=torch.ones(2, 8)))
    assert m.failure_reason(2) == "staging failed: item has deepstack rows but the model declares no deepstack ring"


def test_a_tower_output_with_a_batch_dimension_is_flattened_to_rows():
    rig = plain_rig(batch_dim=True)
    ex, m = rig.executor, rig.manager
    items = [EncodeItem("image", 2), EncodeItem("image", 3)]
    for r, item in zip((1, 2), items):
        ex.register(f"r{r}", "prefill-host", 8998, r)
        m.register_receiver(rig.frame(r, f"p{r}", item.n_tokens))
    assert ex.execute([("r1", items[0]), ("r2", items[1])]) == 2
    rows = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    assert torch.equal(items[0].encoded, rows[:2]) and torch.equal(items[1].encoded, rows[2:])
    ex.poll()
    assert [m.room_status(r) for r in (1, 2)] == ["success", "success"]
    assert torch.equal(rig.buffers[(2, "p2")][0], rows[2:])


def test_one_deepstack_level_is_split_off_and_shipped():
    rig = make_rig(n_deep=1)
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 3))
    item = rig.item(3, 1)
    assert ex.execute([("r", item)]) == 1
    assert item.encoded.shape == (3, 8) and item.encoded_deepstack.shape == (3, 8)
    ex.poll()
    assert m.room_status(1) == "success" and rig.delivered_ok(1, "p1", item)


# ------------------------------------------------------- engine item types ---

class EngineItem:
    """An engine's own item: token ranges instead of n_tokens (inclusive (start, end))."""

    def __init__(self, modality, offsets):
        self.modality = modality
        self.offsets = offsets
        self.encoded = None
        self.encoded_deepstack = None


def test_engine_items_count_tokens_from_their_offsets():
    rig = plain_rig()
    ex, m = rig.executor, rig.manager
    a = EngineItem("image", [(0, 3), (10, 11)])  # 4 + 2 tokens
    b = EngineItem("video", [(5, 5)])  # 1 token
    for r, n in ((1, 6), (2, 1)):
        ex.register(f"r{r}", "prefill-host", 8998, r)
        m.register_receiver(rig.frame(r, f"p{r}", n))
    assert ex.execute([("r1", a), ("r2", b)]) == 2
    assert a.encoded.shape == (6, 8) and b.encoded.shape == (1, 8)
    ex.poll()
    assert [m.room_status(r) for r in (1, 2)] == ["success", "success"]


def test_an_item_without_a_token_count_fails_its_batch_naming_its_type():
    rig = plain_rig()
    ex, m = rig.executor, rig.manager

    class Uncounted:
        modality = "image"
        encoded = encoded_deepstack = None

    ex.register("r", "prefill-host", 8998, 1)
    assert ex.execute([("r", Uncounted())]) == 0
    assert m.failure_reason(1) == "cannot count tokens of Uncounted: no n_tokens or offsets"


class EngineModality(enum.Enum):
    IMAGE = "Image"
    VIDEO = "Video"


def test_modalities_are_matched_by_value_and_case_insensitively():
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    items = {1: EncodeItem(Modality.VIDEO, 2, meta={"seed": 1}), 2: EncodeItem("IMAGE", 2, meta={"seed": 2}),
             3: EncodeItem(Modality.IMAGE, 2, meta={"seed": 3})}
    for r in items:
        ex.register(f"r{r}", "prefill-host", 8998, r)
    assert ex.execute([(f"r{r}", items[r]) for r in items]) == 3
    assert sorted(rig.tower.calls) == [("image", 2), ("video", 1)]
    assert ex.execute([("r9", EncodeItem(Modality.IMAGE, 2, meta={"seed": 9}))]) == 1  # a batch of one
    assert rig.tower.calls[-1] == ("image", 1)

    class Unprintable:
        def __str__(self):
            raise RuntimeError("no name")

        def __repr__(self):
            return "<unprintable>"

    # An engine's own enum (not a str): matched by its value, whatever modality strings
    # this process has seen before.
    ex.register("engine", "prefill-host", 8998, 5)
    assert ex.execute([("engine", EncodeItem(EngineModality.VIDEO, 2, meta={"seed": 5}))]) == 1
    assert rig.tower.calls[-1] == ("video", 1)

    ex.register("odd", "prefill-host", 8998, 4)
    assert ex.execute([("odd", EncodeItem(Unprintable(), 2))]) == 0
    assert m.failure_reason(4) == "bad item EncodeItem: unsupported modality <unprintable>"


# ------------------------------------------------------------ staging ---

@pytest.mark.parametrize("encoded, deep, reason", [
    (None, None, "item.encoded must be a 2-D tensor, got NoneType"),
    (torch.ones(8), None, "item.encoded must be a 2-D tensor, got Tensor(8,)"),
    (torch.ones(1, 2, 8), None, "item.encoded must be a 2-D tensor, got Tensor(1, 2, 8)"),
    (torch.ones(129, 8), None, "embedding of 4128 B exceeds the ring slot of 4096 B; raise ring_bytes"),
    (torch.ones(2, 8), torch.ones(3, 24), "deepstack shape (3, 24) does not match 2 rows"),
    (torch.ones(2, 8), torch.ones(2), "deepstack shape (2,) does not match 2 rows"),
    (torch.ones(2, 8), torch.ones(2, 4, 6), "deepstack shape (2, 4, 6) does not match 2 rows"),
    (torch.ones(128, 8), torch.ones(128, 32),
     "deepstack embedding of 16384 B exceeds the deepstack slot of 12288 B"),
])
def test_items_that_cannot_be_staged_fail_their_room_with_the_reason(encoded, deep, reason):
    rig = make_rig(n_deep=3)  # slots of 4096 B (128 rows of 8 float32), deepstack slots 3x that
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1)
    ex.send_item("r", EncodeItem("image", 2, encoded=encoded, encoded_deepstack=deep))
    assert m.failure_reason(1) == f"staging failed: {reason}"
    assert m.stats["items_refused"] == 0 and ex.ring.free_count == ex.ring.n_slots


def test_an_embedding_that_fills_its_slots_exactly_is_shipped():
    rig = make_rig(n_deep=3)
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 128))
    item = rig.item(128, 1)
    assert ex.execute([("r", item)]) == 1  # 128 x 8 x 4 B = 4096 B, deepstack 3x that
    ex.poll()
    assert m.room_status(1) == "success" and rig.delivered_ok(1, "p1", item)


def test_a_lazily_negated_embedding_ships_its_values_not_its_storage():
    # torch keeps some negations as a flag on a view of the same storage; raw bytes would be
    # the un-negated numbers
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 2))
    lazy = torch._neg_view(torch.arange(16.0).reshape(2, 8))
    assert lazy.is_neg() and lazy.is_contiguous()
    ex.send_item("r", EncodeItem("image", 2, encoded=lazy))
    ex.poll()
    assert m.room_status(1) == "success"
    assert torch.equal(rig.buffers[(1, "p1")][0], -torch.arange(16.0).reshape(2, 8))


def test_an_empty_deepstack_half_counts_as_none():
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 2))
    ex.send_item("r", EncodeItem("image", 2, encoded=torch.full((2, 8), 7.0), encoded_deepstack=torch.ones(2, 0)))
    ex.poll()
    assert m.room_status(1) == "success"
    assert torch.equal(rig.buffers[(1, "p1")][0], torch.full((2, 8), 7.0))


def test_a_deferred_send_keeps_its_bytes_when_the_tower_reuses_its_buffers():
    rig = make_rig(slots=1, n_deep=2)
    ex, m, t = rig.executor, rig.manager, rig.transport
    t.inject("hold", session="p1")
    for r in (1, 2):
        ex.register(f"r{r}", "prefill-host", 8998, r)
        m.register_receiver(rig.frame(r, f"p{r}", 2))
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


class ReadOnlyItem:
    """An engine item that refuses writes once encoded."""

    modality = "image"
    encoded_deepstack = None

    def __init__(self, encoded):
        object.__setattr__(self, "encoded", encoded)

    def __setattr__(self, name, value):
        raise AttributeError(f"read-only item: {name}")


def test_an_item_that_breaks_the_send_path_fails_only_its_room():
    rig = make_rig(slots=1)
    ex, m, t = rig.executor, rig.manager, rig.transport
    t.inject("hold", session="p1")
    for r in (1, 2, 3):
        ex.register(f"r{r}", "prefill-host", 8998, r)
        m.register_receiver(rig.frame(r, f"p{r}", 2))
    ex.execute([("r1", rig.item(2, 1))])
    # Deferring clones the embedding into the item, which this item refuses.
    ex.send_item("r2", ReadOnlyItem(torch.ones(2, 8)))
    assert m.failure_reason(2) == "item could not be sent: AttributeError: read-only item: encoded"
    ex.send_item(["unhashable"], ReadOnlyItem(torch.ones(2, 8)))
    item3 = rig.item(2, 3)
    assert ex.execute([("r3", item3)]) == 1  # deferred, as the ring is still full
    t.complete(t.held[0])
    ex.poll()
    ex.poll()
    assert m.room_status(3) == "success" and rig.delivered_ok(3, "p3", item3)
    assert zero_stats(m.stats, "items_refused", "items_without_sender", "deferred") == {
        "items_refused": 2, "items_without_sender": 1, "deferred": 1}


# ------------------------------------------------- registration and items ---

def test_registration_and_the_one_item_rule():
    rig = make_rig()
    ex, m, t = rig.executor, rig.manager, rig.transport
    ex.register("r", "prefill-host", 8998, 1)
    sender = ex.senders["r"]
    assert (sender.request_id, sender.room, sender.bootstrap_host, sender.bootstrap_port) == ("r", 1, "prefill-host", 8998)
    with pytest.raises(ValueError) as err:
        ex.register("r", "prefill-host", 8998, 2)
    assert str(err.value) == "request 'r' is already registered"
    assert m.room_status(2) is None
    m.register_receiver(rig.frame(1, "p1", 2))
    t.inject("hold", session="p1")
    ex.execute([("r", rig.item(2, 1))])
    assert m.room_status(1) == "transferring"
    ex.execute([("r", rig.item(2, 1))])
    assert m.failure_reason(1) == "request 'r' sent a second item; a room carries exactly one"
    # Items for requests never registered, or whose room already failed, are counted and dropped.
    ex.register("late", "prefill-host", 8998, 2)
    m.fail_room(2, "aborted")
    ex.register("late2", "prefill-host", 8998, 3)
    m.fail_room(3, "aborted")
    for rid in ("nobody", "nobody-else", "late", "late2"):
        ex.execute([(rid, rig.item(2, 7))])
    assert zero_stats(m.stats, "items_without_sender", "items_for_concluded_rooms", "items_refused") == {
        "items_without_sender": 2, "items_for_concluded_rooms": 2, "items_refused": 0}


def test_a_named_receiver_owns_the_room_of_its_sender():
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1, receiver="alice")
    assert not m.register_receiver(rig.frame(1, "p1", 2, peer="mallory"))
    assert m.room_status(1) == "registered"
    assert m.register_receiver(rig.frame(1, "p2", 2, peer="alice"))
    assert m.room_status(1) == "ready"


def test_a_request_registered_while_draining_fails_at_once():
    rig = make_rig()
    ex, m, t = rig.executor, rig.manager, rig.transport
    ex.register("r", "prefill-host", 8998, 1)
    m.register_receiver(rig.frame(1, "p1", 2))
    t.inject("hold", session="p1")
    ex.execute([("r", rig.item(2, 1))])
    ex.begin_close(10.0)
    ex.register("late", "prefill-host", 8998, 2)
    assert m.failure_reason(2) == "encode worker is draining (shutting down); no new transfers"
    assert ex.reap_concluded_senders() == 1
    t.complete(t.held[0])
    ex.poll()
    report = ex.close(10.0, idle=lambda: rig.clock.advance(1.0))
    assert report.clean and (report.rooms_failed, report.rooms_finished) == (1, 1)
