"""Edges of the core that the main suites pass by: the withdraw wire format, the region book's
bookkeeping, the drain's counts and its step contract, the deadline heap's tokens, and the
defaults of the transport seam."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import TableTower, make_rig  # noqa: E402

from epd_ring.executor import (EncodeExecutor, EncodeItem, EncodeManager, FakeClock, Outcome,  # noqa: E402
                               ReceiverFrame)
from epd_ring.executor.core.drain import DEADLINE, DRAINING, Drain, DrainReport  # noqa: E402
from epd_ring.executor.core.regions import (RELEASED, WITHDRAW_MAGIC, WITHDRAWN, RegionBook,  # noqa: E402
                                            Reply, WithdrawError, withdraw_from_parts, withdraw_to_parts)
from epd_ring.executor.core.timers import Deadlines  # noqa: E402
from epd_ring.executor.core.transport import Transport  # noqa: E402


# -- the withdraw message (receiver -> encoder) -------------------------------------------------

def test_withdraw_parts_are_the_magic_the_decimal_room_and_the_two_strings():
    assert withdraw_to_parts(7, "10.0.0.2:17000", "tcp://10.0.0.2:5555") == [
        WITHDRAW_MAGIC, b"7", b"10.0.0.2:17000", b"tcp://10.0.0.2:5555"]
    assert withdraw_to_parts(1234, "s") == [WITHDRAW_MAGIC, b"1234", b"s", b""]  # no status endpoint


def test_withdraw_round_trips_to_a_reply_with_every_field():
    reply = withdraw_from_parts(withdraw_to_parts(7, "10.0.0.2:17000", "tcp://10.0.0.2:5555"))
    assert reply == Reply(7, "10.0.0.2:17000", "tcp://10.0.0.2:5555", "")
    assert type(reply.room) is int and reply.peer == ""  # the peer is the control plane's to fill in
    assert withdraw_from_parts(withdraw_to_parts(0, "s")) == Reply(0, "s", "", "")
    # Parts arrive as zmq frames or memoryviews as often as bytes.
    parts = [memoryview(p) for p in withdraw_to_parts(42, "a:1", "e")]
    assert withdraw_from_parts(parts) == Reply(42, "a:1", "e")


def test_withdraw_bounds_are_inclusive_at_their_limits():
    # A room of 20 decimal digits (a u64 fits in 20) is the longest accepted.
    assert withdraw_from_parts([WITHDRAW_MAGIC, b"9" * 20, b"s", b""]).room == int("9" * 20)
    # Session and status endpoint: at most 256 ASCII bytes each.
    top = withdraw_from_parts([WITHDRAW_MAGIC, b"1", b"s" * 256, b"e" * 256])
    assert top == Reply(1, "s" * 256, "e" * 256)


@pytest.mark.parametrize("parts, message", [
    ([WITHDRAW_MAGIC, b"1", b"s"], "not a withdraw message"),
    ([WITHDRAW_MAGIC, b"1", b"s", b"", b""], "not a withdraw message"),
    ([b"epd-ring/withdraw/2", b"1", b"s", b""], "not a withdraw message"),
    ([b"epd-ring/frame/1", WITHDRAW_MAGIC, b"s", b""], "not a withdraw message"),
    ([WITHDRAW_MAGIC, b"", b"s", b""], "room must be a decimal integer, got b''"),
    ([WITHDRAW_MAGIC, b"-8", b"s", b""], "room must be a decimal integer, got b'-8'"),
    ([WITHDRAW_MAGIC, b"x" * 30, b"s", b""], f"room must be a decimal integer, got {b'x' * 24!r}"),
    ([WITHDRAW_MAGIC, b"1" * 21, b"s", b""], f"room must be a decimal integer, got {b'1' * 21!r}"),
    ([WITHDRAW_MAGIC, b"1", b"s" * 257, b""], "session must be ASCII of at most 256 bytes"),
    ([WITHDRAW_MAGIC, b"1", "s\u00e9".encode(), b""], "session must be ASCII of at most 256 bytes"),
    ([WITHDRAW_MAGIC, b"1", b"s", b"e" * 257], "status_endpoint must be ASCII of at most 256 bytes"),
    ([WITHDRAW_MAGIC, b"1", b"s", b"\xff"], "status_endpoint must be ASCII of at most 256 bytes"),
    ([WITHDRAW_MAGIC, b"1", b"", b"e"], "session must not be empty"),
])
def test_each_bad_withdraw_is_refused_with_its_own_message(parts, message):
    with pytest.raises(WithdrawError) as err:
        withdraw_from_parts(parts)
    assert str(err.value) == message
    assert isinstance(err.value, ValueError)  # callers that catch ValueError refuse it too


# -- the deadline heap ----------------------------------------------------------------------------

class _Waiter:
    def __init__(self):
        self.timer = 0
        self.due = 0.0


def test_a_fired_deadline_leaves_its_object_unarmed_like_a_fresh_one():
    d = Deadlines()
    a, b = _Waiter(), _Waiter()
    d.arm(1.0, "park", a)
    d.arm(2.0, "write", b)
    assert list(d.due(1.5)) == [("park", a)]
    # The token is unarmed again, as on a fresh or cancelled object (readers only test its truth).
    assert not a.timer and b.timer and len(d) == 1
    d.cancel(b)
    assert not b.timer and len(d) == 0


# -- the transport seam's defaults ------------------------------------------------------------------

class _InProcess(Transport):
    """A transport with nothing to open: it overrides only what the seam requires."""

    def __init__(self):
        self.writes: list[tuple[str, list]] = []
        self.done: list[tuple[int, Outcome]] = []
        self.told: list[tuple[int, str, str]] = []

    def register_memory(self, regions, owner=None):
        pass

    def submit_write(self, session, bufs):
        self.writes.append((session, list(bufs)))
        self.done.append((len(self.writes), Outcome.DONE))
        return len(self.writes)

    def poll(self):
        out, self.done = self.done, []
        return out

    def notify(self, frame, room, status, reason=""):
        self.told.append((room, status, reason))


def test_a_transport_that_does_not_implement_connect_reaches_its_peers_at_once():
    t = _InProcess()
    assert t.connect("a:1", 1) is True and t.peer_reports() == []
    clock = FakeClock()
    manager = EncodeManager(t, clock)
    ex = EncodeExecutor(manager, TableTower(), "cpu", ring_slots=1, ring_bytes=4096)
    ex.register("r1", "h", 1, 1)
    dst = torch.zeros(2, 8)
    manager.register_receiver(ReceiverFrame(room=1, session="a:1", dst_ptr=dst.data_ptr(), dst_deep_ptr=0,
                                            n_tokens=2, row_start=0, span=2, hidden=8, dtype="torch.float32",
                                            has_deepstack=False, n_receivers=1))
    ex.execute([("r1", EncodeItem(modality="image", n_tokens=2, meta={"seed": 3}))])
    ex.poll()
    assert [s for s, _ in t.writes] == ["a:1"]  # written without waiting for any contact report
    assert manager.room_status(1) == "success" and (1, "success", "") in t.told



# -- the drain ------------------------------------------------------------------------------------

def _send(rig, room: int, session: str, *, execute: bool = True, ex=None):
    """Register room `room` with one receiver `session` (4 rows) and, by default, run its item."""
    ex = ex or rig.executor
    item = rig.item(4, seed=room)
    ex.register(f"r{room}", "h", 1, room)
    rig.manager.register_receiver(rig.frame(room, session, 4))
    if execute:
        ex.execute([(f"r{room}", item)])
    return item


def test_a_room_that_finishes_during_the_drain_counts_as_finished_not_failed():
    rig = make_rig(slots=2)
    ex, transport = rig.executor, rig.transport
    transport.inject("hold", session="a")
    item = _send(rig, 1, "a")
    (held,) = transport.held
    ex.begin_close(2.0)
    assert ex.closed is False  # a write is in flight: the ring is kept
    transport.complete(held)
    report = ex.close(2.0, lambda: rig.clock.advance(0.5))
    # Nothing was failed by this drain; the one room concluded on its own.
    assert report == DrainReport(clean=True, rooms_failed=0, rooms_finished=1, busy_slots={},
                                 writes_in_flight=0, live_rooms=0)
    assert ex.closed is True and rig.delivered_ok(1, "a", item)


def test_the_drain_deadline_is_reached_at_the_exact_instant():
    rig = make_rig(slots=2, quarantine_s=0.5)
    ex, manager, transport, clock = rig.executor, rig.manager, rig.transport, rig.clock
    transport.inject("hold", session="a")
    _send(rig, 1, "a")
    ex.begin_close(1.0)
    assert manager.room_status(1) == "transferring"
    clock.advance(1.0)  # now == deadline: the deadline has passed
    ex.poll()
    assert manager.failure_reason(1) == DEADLINE
    report = ex.close(1.0, lambda: pytest.fail("no idle wait once the deadline is reached"))
    assert report == DrainReport(clean=False, rooms_failed=1, rooms_finished=0, busy_slots={"sending": 1},
                                 writes_in_flight=1, live_rooms=0)
    assert report.clean is False and ex.closed is False
    assert not transport.closed and len(transport.local) == 2  # the ring stays registered


def test_every_deferred_send_the_drain_drops_is_counted():
    rig = make_rig(slots=1)
    ex, manager, transport = rig.executor, rig.manager, rig.transport
    transport.inject("hold", session="a")
    transport.inject("hold", session="c")
    _send(rig, 1, "a")  # A holds the only slot
    for room, session in ((2, "b"), (3, "c"), (4, "d")):
        _send(rig, room, session)  # B, C, D wait for the slot
    assert ex.stats["deferred"] == 3
    assert ex.fail_rooms(["r2"], "cancelled by the engine") == 1
    assert ex.reap_concluded_senders() == 1  # B's sender is gone: its deferred send will be dropped
    (held_a,) = transport.held
    transport.complete(held_a)
    ex.poll()  # A's slot is free: B's send is dropped (no sender), C's is staged and written
    assert ex.stats["deferred_dropped"] == 1 and manager.room_status(3) == "transferring"
    assert manager.room_status(4) == "ready" and ex.has_deferred()
    ex.begin_close(5.0)  # D's room fails and its deferred send is dropped too
    assert ex.stats["deferred_dropped"] == 2 and not ex.has_deferred()
    assert manager.failure_reason(4) == DRAINING and rig.receiver("d").statuses(4) == ["failed"]
    assert torch.isnan(rig.buffers[(4, "d")][0]).all()  # never written
    (held_c,) = transport.held
    transport.complete(held_c)
    report = ex.close(5.0, lambda: rig.clock.advance(0.1))
    assert report == DrainReport(clean=True, rooms_failed=1, rooms_finished=1)


def test_drain_step_is_true_exactly_once_the_ring_is_let_go_and_stays_true():
    rig = make_rig(slots=2)
    ex, transport = rig.executor, rig.transport
    transport.inject("hold", session="a")
    _send(rig, 1, "a")
    (held,) = transport.held
    drain = Drain(ex, rig.clock.now() + 5.0, close_transport=False)
    assert drain.step() is False and drain.done is False  # the write may still read its slot
    assert drain.report() == DrainReport(clean=False, rooms_failed=0, rooms_finished=0,
                                         busy_slots={"sending": 1}, writes_in_flight=1, live_rooms=1)
    transport.complete(held)
    rig.manager.poll()
    assert drain.step() is True and drain.done is True
    assert drain.step() is True  # a later step changes nothing and still says so
    assert drain.report() == DrainReport(clean=True, rooms_failed=0, rooms_finished=1)
    assert set(ex.ring.counts()) == {"retired"} and len(transport.local) == 0
    assert not transport.closed  # close_transport=False: the transport is the caller's


def test_the_drain_waits_for_writes_and_rooms_of_a_shared_manager_before_closing_its_transport():
    """Two executors (two rings) on one manager and transport: the drain of one must not close the
    transport while the manager still has a live room or a write in flight on the other's ring."""
    rig = make_rig(slots=1)
    ex1, manager, transport = rig.executor, rig.manager, rig.transport
    ex2 = EncodeExecutor(manager, rig.tower, "cpu", ring_slots=1, ring_bytes=4096)
    transport.add_receiver("slow")
    transport.inject_contact("hang", session="slow")
    _send(rig, 1, "slow", ex=ex2)  # staged on ex2's ring, waiting for its peer; no write yet
    assert manager.room_status(1) == "transferring" and manager.writes_in_flight == 0
    ex1.begin_close(5.0)
    assert ex1.closed is False and not transport.closed  # room 1 is live
    transport.answer("slow", True)
    transport.inject("hold", session="slow")
    ex2.poll()  # the peer is up: room 1's write starts and is held
    assert manager.writes_in_flight == 1
    rig.clock.advance(5.0)
    report = ex1.close(5.0, lambda: pytest.fail("no idle wait once the deadline is reached"))
    assert manager.failure_reason(1) == DEADLINE and not manager.rooms  # failed, its write still out
    assert report == DrainReport(clean=False, rooms_failed=1, rooms_finished=0, busy_slots={},
                                 writes_in_flight=1, live_rooms=0)
    assert ex1.closed is False and not transport.closed
    (held,) = transport.held
    transport.complete(held)
    ex1.poll()
    assert ex1.closed is True and transport.closed


# -- the deadline heap's bounds and order ------------------------------------------------------------

def test_deadlines_at_the_same_instant_fire_in_the_order_they_were_armed():
    d = Deadlines()
    objs = [_Waiter() for _ in range(4)]
    for k, o in enumerate(objs):
        d.arm(1.0, f"k{k}", o)
    assert [o for _, o in d.due(1.0)] == objs


def test_the_heap_is_rebuilt_only_past_the_floor_once_dead_entries_outnumber_live_ones_four_to_one():
    from epd_ring.executor.core.timers import _COMPACT_FLOOR as floor

    d = Deadlines()
    live = [_Waiter() for _ in range(floor // 4 + 1)]  # 1025 live deadlines
    for o in live:
        d.arm(10.0, "park", o)
    # Re-arming leaves the earlier entry dead in the heap: the heap grows, the live count does not.
    while d.heap_size < 4 * len(live):
        d.arm(5.0, "park", live[0])
    assert d.heap_size == 4 * len(live) and len(d) == len(live)  # past the floor, but not past 4x live
    d.arm(5.0, "park", live[0])  # one more dead entry: now over 4x live, so only live entries remain
    assert d.heap_size == len(live) and len(d) == len(live)
    assert len(list(d.due(10.0))) == len(live)  # every live deadline survived the rebuild

    small = Deadlines()
    one = _Waiter()
    while small.heap_size < floor:  # 4096 entries, 1 live: at the floor, not past it
        small.arm(1.0, "park", one)
    assert small.heap_size == floor
    small.arm(1.0, "park", one)
    assert small.heap_size == 1 and list(small.due(1.0)) == [("park", one)]


# -- configuration numbers -------------------------------------------------------------------------

def test_seconds_accepts_every_finite_non_negative_number_as_a_float():
    from epd_ring.executor.core.settings import seconds

    for value, want in ((0, 0.0), (0.5, 0.5), (3, 3.0), (1e9, 1e9)):
        got = seconds("park_timeout", value)
        assert got == want and type(got) is float


@pytest.mark.parametrize("value, message", [
    (True, "park_timeout must be a number of seconds, got True"),
    ("5", "park_timeout must be a number of seconds, got '5'"),
    (None, "park_timeout must be a number of seconds, got None"),
    (float("nan"), "park_timeout must be finite and >= 0 seconds, got nan"),
    (float("inf"), "park_timeout must be finite and >= 0 seconds, got inf"),
    (-0.001, "park_timeout must be finite and >= 0 seconds, got -0.001"),
    (-1, "park_timeout must be finite and >= 0 seconds, got -1"),
])
def test_seconds_refuses_with_a_message_naming_the_setting(value, message):
    from epd_ring.executor.core.settings import seconds

    with pytest.raises(ValueError) as err:
        seconds("park_timeout", value)
    assert str(err.value) == message


def test_count_accepts_integers_at_or_above_the_minimum_which_defaults_to_zero():
    from epd_ring.executor.core.settings import count

    assert count("max_deferred", 0) == 0 and count("max_deferred", 7) == 7
    assert count("max_tombstones", 1, 1) == 1


@pytest.mark.parametrize("value, minimum, message", [
    (False, 0, "max_deferred must be an integer, got False"),
    ("3", 0, "max_deferred must be an integer, got '3'"),
    (2.0, 0, "max_deferred must be an integer, got 2.0"),
    (-1, 0, "max_deferred must be >= 0, got -1"),
    (0, 1, "max_deferred must be >= 1, got 0"),
])
def test_count_refuses_with_a_message_naming_the_setting(value, minimum, message):
    from epd_ring.executor.core.settings import count

    with pytest.raises(ValueError) as err:
        count("max_deferred", value, minimum)
    assert str(err.value) == message


# -- the fake clock --------------------------------------------------------------------------------

def test_a_fake_clock_starts_at_zero_and_moves_only_forward_by_what_it_is_told():
    clock = FakeClock()
    assert clock.now() == 0.0 and type(clock.now()) is float
    assert clock.advance(0.25) == 0.25 and clock.advance(0.5) == 0.75 and clock.now() == 0.75
    assert clock.advance(0) == 0.75  # standing still is allowed
    assert FakeClock(3).now() == 3.0 and type(FakeClock(3).now()) is float
    with pytest.raises(ValueError, match=r"^a clock cannot go back \(-0\.5 s\)$"):
        clock.advance(-0.5)
    assert clock.now() == 0.75


# -- tenancy: who owns which receiver session --------------------------------------------------------

def test_a_session_belongs_to_the_first_peer_that_names_it():
    from epd_ring.executor.core.tenancy import Tenancy

    t = Tenancy()
    assert t.session_owner("a:1") is None and len(t) == 0
    assert t.claim("alice", "a:1") == "" and t.session_owner("a:1") == "alice"
    assert t.claim("alice", "a:1") == ""  # already hers: fine
    assert t.claim("bob", "a:1") == "session belongs to another receiver"
    assert t.session_owner("a:1") == "alice" and len(t) == 1
    assert t.claim("bob", "b:1") == "" and t.session_owner("b:1") == "bob" and len(t) == 2


def test_a_peer_at_its_session_cap_gives_up_its_own_least_recently_named_session():
    from epd_ring.executor.core.tenancy import Tenancy

    t = Tenancy(max_sessions_per_peer=2)
    assert t.claim("alice", "a:1") == "" and t.claim("alice", "a:2") == "" and t.claim("bob", "b:1") == ""
    assert t.claim("alice", "a:1") == ""  # named again: a:2 is now her least recently named
    assert t.claim("alice", "a:3") == ""
    assert [t.session_owner(s) for s in ("a:1", "a:2", "a:3", "b:1")] == ["alice", None, "alice", "bob"]
    assert len(t) == 3
    assert t.claim("bob", "a:2") == ""  # released, so anyone may claim it now
    assert t.claim("alice", "a:4") == ""  # her oldest is a:1 now; bob's sessions are never touched
    assert [t.session_owner(s) for s in ("a:1", "a:2", "a:3", "a:4", "b:1")] == [None, "bob", "alice", "alice", "bob"]


def test_sessions_in_all_are_bounded_and_a_claim_past_the_bound_is_refused():
    from epd_ring.executor.core.tenancy import Tenancy

    t = Tenancy(max_sessions_per_peer=10, max_sessions=2)
    assert t.claim("alice", "a:1") == "" and t.claim("bob", "b:1") == ""
    assert t.claim("carol", "c:1") == "too many receiver sessions (2)"
    assert t.session_owner("c:1") is None and len(t) == 2
    assert t.claim("alice", "a:1") == ""  # an existing session is still fine


def test_tenancy_default_bounds():
    from epd_ring.executor.core.tenancy import Tenancy

    t = Tenancy()  # 256 sessions per peer: the 257th releases the peer's first
    for k in range(257):
        assert t.claim("alice", f"a:{k}") == ""
    assert t.session_owner("a:0") is None and t.session_owner("a:1") == "alice" and len(t) == 256
    t.announced["alice"] = 1023  # 1024 rooms announced per peer
    assert t.may_announce("alice") and t.may_announce("bob")
    t.announced["alice"] += 1
    assert not t.may_announce("alice") and t.may_announce("bob")
    # 65536 sessions in all: the bound enforced as shown above (filling it here would take too long).
    assert t.max_sessions == 65536
