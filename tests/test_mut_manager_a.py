"""The encode manager's rooms, tombstones, configuration and refusals, pinned down exactly.

Written against the surviving mutants of `executor/core/manager.py` (issue 13): the
queries, sender binding, chunk submission, withdraws, registration frames, refusals of
foreign and malformed frames, the rate-limited warnings, and the constructor's checks and
defaults. Each test drives the manager through its public calls on a loopback transport
and a fake clock, and checks what a user sees: return values, room states and reasons,
notices (with the address they were sent to), stats, deadlines, log lines.
"""

from __future__ import annotations

import logging

import pytest
import torch

from epd_ring.executor import (Chunk, EncodeManager, FakeClock, LoopbackTransport, MonotonicClock, Observer,
                               ReceiverFrame, Ring, RoomConflict)
from epd_ring.executor.core.regions import Reply

HIDDEN = 8
DTYPE = "torch.float32"


class Recorder(LoopbackTransport):
    """Loopback that also keeps what each notice was addressed to (the frame or the reply)."""

    def __init__(self, clock):
        super().__init__(clock)
        self.told: list[tuple] = []

    def notify(self, frame, room, status, reason=""):
        self.told.append((frame, room, status, reason))
        super().notify(frame, room, status, reason)


class Events(Observer):
    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def room_opened(self, room):
        self.calls.append(("opened", room))

    def parked(self, room):
        self.calls.append(("parked", room))


class Bench:
    """A manager on a loopback transport and fake clock, with a 4-slot ring to stage chunks in."""

    def __init__(self, **kw):
        self.clock = FakeClock()
        self.t = Recorder(self.clock)
        kw = {"park_timeout": 10.0, "quarantine_s": 5.0, "write_timeout": 30.0, **kw}
        self.m = EncodeManager(self.t, self.clock, **kw)
        self.ring = Ring(self.t, 4, 4096)
        self.keep: list[torch.Tensor] = []

    def frame(self, room: int, session: str, rows: int = 2, n: int = 1, peer: str = "", **over) -> ReceiverFrame:
        r = self.t.receivers.get(session) or self.t.add_receiver(session)
        buf = torch.zeros(max(rows, 1), HIDDEN)
        r.register(buf)
        self.keep.append(buf)
        fields = dict(room=room, session=session, dst_ptr=buf.data_ptr(), dst_deep_ptr=0, n_tokens=rows,
                      row_start=0, span=rows, hidden=HIDDEN, dtype=DTYPE, has_deepstack=False, n_receivers=n,
                      peer=peer)
        fields.update(over)
        return ReceiverFrame(**fields)

    def chunk(self, rows: int = 2) -> Chunk:
        slot = self.ring.lease()
        self.ring.fire(slot, "copied")
        return Chunk(slot, rows, HIDDEN, DTYPE, HIDDEN * 4, self.ring.main_ptr(slot))

    def notices(self, session: str, room: int | None = None) -> list[tuple]:
        return [(n.room, n.status, n.reason) for n in self.t.receivers[session].notices
                if room is None or n.room == room]

    def announced_failed(self, room: int, session: str, reason: str = "gone", peer: str = "") -> None:
        """A room only a receiver announced, failed before any sender came (nobody pins it)."""
        assert self.m.register_receiver(self.frame(room, session, peer=peer))
        assert self.m.fail_room(room, reason)

    def succeed(self, room: int, session: str) -> None:
        assert self.m.bind_sender(room) == "registered"
        assert self.m.register_receiver(self.frame(room, session))
        assert self.m.submit_chunk(room, self.chunk())
        self.m.poll()
        assert self.m.room_status(room) == "success"


# queries ------------------------------------------------------------------------------------
def test_queries_on_unknown_live_and_concluded_rooms():
    b = Bench()
    m = b.m
    for q in (m.room_status, m.tombstone, m.failure_reason, m.deadline_of):
        assert q(7) is None
    assert not m.accepts_chunk(7) and not m.is_parked(7)

    b.succeed(1, "p1")
    # a room that succeeded has a tombstone, no failure reason (its reason is empty) and no deadline
    assert m.tombstone(1).state == "success" and m.failure_reason(1) is None and m.deadline_of(1) is None
    assert b.notices("p1", 1) == [(1, "success", "")]

    assert m.bind_sender(2) == "registered"
    assert m.accepts_chunk(2) and not m.is_parked(2) and m.deadline_of(2) is None
    assert m.room_status(2) == "registered"
    # staged with no receiver yet: parked, and the park deadline runs from now
    b.clock.advance(3.0)
    assert m.submit_chunk(2, b.chunk()) is True
    assert m.is_parked(2) and not m.accepts_chunk(2) and m.deadline_of(2) == 13.0
    assert m.room_status(2) == "parked" and m.tombstone(2) is None


def test_pinned_tombstone_is_found_before_the_capped_ones():
    b = Bench(max_tombstones=1)
    m = b.m
    b.announced_failed(1, "p1", "first")
    assert m.bind_sender(1) == "failed"  # the sender binds to the failure: its record is pinned
    b.announced_failed(2, "p2", "second")  # fills the cap of one
    assert m.tombstone(1).reason == "first" and m.failure_reason(1) == "first"
    assert m.tombstone(2).reason == "second" and m.room_status(2) == "failed"


def test_park_deadline_fails_the_room_with_its_own_reason_and_observer_sees_it():
    b = Bench()
    m = b.m
    ev = m.observer = Events()
    assert m.bind_sender(4) == "registered"
    assert m.submit_chunk(4, b.chunk()) is True
    assert ev.calls == [("opened", 4), ("parked", 4)]
    assert len(m.deadlines) == 1
    b.clock.advance(9.999)
    m.poll()
    assert m.is_parked(4)
    b.clock.advance(0.001)
    m.poll()
    assert m.room_status(4) == "failed"
    assert m.failure_reason(4) == "no receivers registered within 10.0 s of parking"
    assert m.stats["expired"] == 1 and len(m.deadlines) == 0
    assert b.ring.free_count == 4  # no write was issued from the parked slot


def test_live_deadlines_are_counted_exactly_through_announce_park_write():
    b = Bench()
    m = b.m
    assert m.register_receiver(b.frame(1, "p1"))  # announce deadline
    assert len(m.deadlines) == 1 and m.deadline_of(1) == 10.0
    assert m.bind_sender(1) == "ready"  # the sender came: the announce deadline is off
    assert len(m.deadlines) == 0 and m.deadline_of(1) is None
    assert m.bind_sender(2) == "registered"
    assert m.submit_chunk(2, b.chunk()) and len(m.deadlines) == 1  # park deadline
    assert m.submit_chunk(1, b.chunk())  # one write, its deadline armed
    assert m.writes_in_flight == 1 and len(m.deadlines) == 2
    m.poll()
    assert m.room_status(1) == "success" and len(m.deadlines) == 1
    assert m.fail_room(2, "stop")
    assert len(m.deadlines) == 0


# submit_chunk --------------------------------------------------------------------------------
def test_chunks_for_rooms_that_take_none_are_dropped_and_their_slots_freed():
    b = Bench()
    m = b.m
    assert m.submit_chunk(9, b.chunk()) is False  # nobody bound room 9
    assert m.stats["chunks_dropped"] == 1 and b.ring.free_count == 4

    assert m.register_receiver(b.frame(3, "p3", n=2))  # announced: no sender, so no chunk either
    assert m.submit_chunk(3, b.chunk()) is False
    assert m.room_status(3) == "announced" and m.stats["chunks_dropped"] == 2

    b.succeed(5, "p5")
    assert m.submit_chunk(5, b.chunk()) is False  # concluded
    assert m.room_status(5) == "success" and m.stats["chunks_dropped"] == 3
    assert b.ring.free_count == 4 and m.stats["failed"] == 0


@pytest.mark.parametrize("state", ["parked", "transferring"])
def test_a_second_chunk_fails_its_room(state):
    b = Bench()
    m = b.m
    assert m.bind_sender(1) == "registered"
    if state == "transferring":
        b.t.inject("hold")
        assert m.register_receiver(b.frame(1, "p1"))
    assert m.submit_chunk(1, b.chunk()) is True
    assert m.room_status(1) == state
    assert m.submit_chunk(1, b.chunk()) is False
    reason = "room 1 got a second chunk; a room carries exactly one"
    assert m.room_status(1) == "failed" and m.failure_reason(1) == reason
    assert m.stats["chunks_dropped"] == 1 and m.stats["failed"] == 1
    if state == "parked":
        assert b.ring.free_count == 4  # both slots: the second dropped, the parked one abandoned
    else:
        assert b.notices("p1", 1) == [(1, "failed", reason)]  # its release waits for the held write
        assert b.ring.free_count == 2 + 1  # the sending slot stays until its write reports


def test_a_chunk_its_receivers_do_not_expect_fails_the_room():
    b = Bench()
    m = b.m
    assert m.bind_sender(1) == "registered"
    assert m.register_receiver(b.frame(1, "p1", rows=3))
    assert m.submit_chunk(1, b.chunk(rows=2)) is False
    reason = "room 1: receiver p1 expects 3 rows, chunk has 2"
    assert m.failure_reason(1) == reason
    assert b.notices("p1", 1) == [(1, "failed", reason), (1, "released", "")]
    assert b.ring.free_count == 4 and m.stats["chunks_dropped"] == 0


# fail_room -----------------------------------------------------------------------------------
def test_fail_room_changes_nothing_once_concluded():
    b = Bench()
    m = b.m
    assert m.fail_room(3, "never existed") is False
    assert m.room_status(3) is None
    b.succeed(1, "p1")
    assert m.fail_room(1, "too late") is False
    assert m.room_status(1) == "success" and m.failure_reason(1) is None
    b.announced_failed(2, "p2", "first reason")
    assert m.fail_room(2, "second reason") is False
    assert m.failure_reason(2) == "first reason"
    assert m.stats["failed"] == 1 and m.stats["success"] == 1


# tombstones: pins and the cap -------------------------------------------------------------------
def test_a_pinned_failure_leaves_the_cap_to_the_others():
    b = Bench(max_tombstones=2)
    m = b.m
    b.announced_failed(0, "p0")
    b.announced_failed(1, "p1")
    assert m.bind_sender(1) == "failed"  # pinned: out of the cap while the sender lives
    b.announced_failed(2, "p2")
    # the cap of two holds rooms 0 and 2; room 1 is held by its sender
    assert [m.room_status(r) for r in (0, 1, 2)] == ["failed"] * 3


def test_a_failure_pinned_twice_stays_until_both_let_go():
    b = Bench(max_tombstones=2)
    m = b.m
    b.announced_failed(0, "p0")
    b.announced_failed(1, "p1")
    assert m.bind_sender(1) == "failed"
    assert m.bind_sender(1) == "failed"  # a second sender for the failed room binds to it too
    m.unbind_sender(1)
    b.announced_failed(2, "p2")
    b.announced_failed(3, "p3")
    assert m.room_status(0) is None  # aged out by the cap
    assert m.room_status(1) == "failed"  # one sender still holds it
    m.unbind_sender(1)  # the last: buried as the newest, evicting the oldest (room 2)
    assert [m.room_status(r) for r in (1, 2, 3)] == ["failed", None, "failed"]


def test_a_room_id_concluded_again_is_buried_as_the_newest():
    b = Bench(max_tombstones=2)
    m = b.m
    b.announced_failed(5, "a1", "by A", peer="A")
    b.announced_failed(6, "a2", peer="A")
    # peer A's failure does not poison the room for peer B's request: a new room 5
    assert m.bind_sender(5, receiver="B") == "registered"
    assert m.fail_room(5, "by B")
    m.unbind_sender(5)
    b.announced_failed(7, "a3", peer="A")  # the cap evicts the oldest record: room 6, not the new 5
    assert m.room_status(6) is None
    assert m.failure_reason(5) == "by B" and m.tombstone(5).owner == "B"
    assert m.room_status(7) == "failed"


# withdraw ------------------------------------------------------------------------------------
def test_withdraw_of_another_peers_session_or_room_is_refused_and_counted(caplog):
    caplog.set_level(logging.WARNING, logger="epd_ring.manager")
    b = Bench()
    m = b.m
    assert m.register_receiver(b.frame(1, "a1", n=2, peer="A"))  # A claims session a1 and room 1
    told = len(b.t.told)
    assert m.withdraw(2, "a1", peer="B") == "refused"  # A's session, no room
    assert m.withdraw(1, "b1", peer="B") == "refused"  # B's fresh session, A's room
    assert m.stats["withdraws"] == 2 and m.stats["withdraws_foreign"] == 2
    assert len(b.t.told) == told and m.room_status(1) == "announced"
    # one line per second for what a peer can provoke at will
    assert [r.getMessage() for r in caplog.records] == ["refused a withdraw from another peer for room 2"]
    assert m.withdraw(1, "a1", peer="A") == "failed"
    assert m.stats["withdraws"] == 3 and m.stats["withdraws_foreign"] == 2


def test_a_receivers_withdraw_fails_its_room_for_everyone():
    b = Bench()
    m = b.m
    assert m.register_receiver(b.frame(1, "p1", n=2))
    assert m.register_receiver(b.frame(1, "p2", n=2))
    assert m.withdraw(1, "p1") == "failed"
    reason = "receiver p1 withdrew"
    assert m.failure_reason(1) == reason
    assert b.notices("p1", 1) == [(1, "failed", reason), (1, "withdrawn", "")]
    assert b.notices("p2", 1) == [(1, "failed", reason), (1, "released", "")]


def test_withdraw_of_an_unknown_region_is_acked_to_the_address_given():
    b = Bench()
    m = b.m
    assert m.withdraw(9, "x1", "tcp://10.0.0.1:7000", "C") == "acked"
    assert b.t.told[-1] == (Reply(9, "x1", "tcp://10.0.0.1:7000", "C"), 9, "withdrawn", "")
    assert m.withdraw(9, "x2") == "acked"
    reply = b.t.told[-1][0]
    assert (reply.room, reply.session, reply.status_endpoint, reply.peer) == (9, "x2", "", "")
    assert m.stats["withdraws"] == 2 and m.stats["told_withdrawn"] == 2
    # a live room the session has no frame in: acked too, and the room is untouched
    assert m.register_receiver(b.frame(4, "p4", n=2))
    assert m.withdraw(4, "x3", "tcp://10.0.0.1:7001") == "acked"
    assert b.t.told[-1] == (Reply(4, "x3", "tcp://10.0.0.1:7001", ""), 4, "withdrawn", "")
    assert m.room_status(4) == "announced"


# foreign frames and the shared warning key ------------------------------------------------------
def test_foreign_frames_are_told_failed_counted_and_warned_once_a_second(caplog):
    caplog.set_level(logging.WARNING, logger="epd_ring.manager")
    b = Bench()
    m = b.m
    assert m.bind_sender(1, receiver="A") == "registered"
    assert m.register_receiver(b.frame(1, "b1", peer="B")) is False
    assert m.register_receiver(b.frame(1, "b2", peer="B")) is False
    assert m.stats["frames_foreign"] == 2
    why = "room not open to this receiver"
    assert b.notices("b1") == [(1, "failed", why)] and b.notices("b2") == [(1, "failed", why)]
    assert m.room_status(1) == "registered"
    b.clock.advance(0.5)
    assert m.withdraw(1, "b3", peer="B") == "refused"  # same key: held back too
    b.clock.advance(0.5)
    assert m.register_receiver(b.frame(1, "b4", peer="B")) is False
    assert [r.getMessage() for r in caplog.records] == [
        f"refused a frame from another peer: {why}",
        f"refused a frame from another peer: {why} (and 2 more like it)",
    ]
    b.clock.advance(1.0)
    assert m.withdraw(1, "b5", peer="B") == "refused"
    assert caplog.records[-1].getMessage() == "refused a withdraw from another peer for room 1"


# configuration: exact errors, and what the defaults do -------------------------------------------
DURATIONS = ["park_timeout", "announce_timeout", "write_timeout", "quarantine_s", "tombstone_ttl"]
BOUNDS = ["max_tombstones", "max_announced", "max_announced_per_peer", "max_sessions_per_peer"]


@pytest.mark.parametrize("name", DURATIONS)
def test_a_bad_duration_is_refused_naming_its_setting(name):
    t = LoopbackTransport(FakeClock())
    for bad, msg in [(-1, f"{name} must be finite and >= 0 seconds, got -1"),
                     (float("nan"), f"{name} must be finite and >= 0 seconds, got nan"),
                     ("5", f"{name} must be a number of seconds, got '5'"),
                     (None if name != "announce_timeout" else "x",
                      f"{name} must be a number of seconds, got {None if name != 'announce_timeout' else 'x'!r}")]:
        with pytest.raises(ValueError) as e:
            EncodeManager(t, **{name: bad})
        assert str(e.value) == msg
    assert getattr(EncodeManager(t, **{name: 0}), name) == 0.0  # zero is a valid duration


@pytest.mark.parametrize("name", BOUNDS)
def test_a_bad_bound_is_refused_naming_its_setting(name):
    t = LoopbackTransport(FakeClock())
    for bad, msg in [(0, f"{name} must be >= 1, got 0"), (-5, f"{name} must be >= 1, got -5"),
                     (2.0, f"{name} must be an integer, got 2.0"), (None, f"{name} must be an integer, got None")]:
        with pytest.raises(ValueError) as e:
            EncodeManager(t, **{name: bad})
        assert str(e.value) == msg
    m = EncodeManager(t, **{name: 1})  # one is the smallest bound that still lets work through
    assert (m.max_tombstones, m.max_announced, m.tenancy.max_announced_per_peer,
            m.tenancy.max_sessions_per_peer)[BOUNDS.index(name)] == 1


def test_peer_settings_reach_the_peer_table():
    t = LoopbackTransport(FakeClock())
    m = EncodeManager(t, connect_timeout=2.5, peer_backoff=7.0, peer_fail_threshold=2, max_peers=9)
    assert (m.peers.connect_timeout, m.peers.backoff, m.peers.fail_threshold, m.peers.max_peers) == (2.5, 7.0, 2, 9)
    with pytest.raises(ValueError, match="^connect_timeout must be > 0 seconds, got 0$"):
        EncodeManager(t, connect_timeout=0)


def test_defaults():
    clock = FakeClock()
    t = LoopbackTransport(clock)
    m = EncodeManager(t)
    assert m.clock is clock  # the transport's clock when none is given
    assert (m.park_timeout, m.announce_timeout, m.write_timeout, m.quarantine_s, m.tombstone_ttl) == (
        120.0, 120.0, 60.0, 30.0, 600.0)
    assert (m.max_tombstones, m.max_announced) == (65536, 4096)
    assert (m.tenancy.max_sessions_per_peer, m.tenancy.max_announced_per_peer) == (256, 1024)
    assert (m.peers.connect_timeout, m.peers.backoff, m.peers.fail_threshold, m.peers.max_peers) == (5.0, 5.0, 3, 4096)
    assert m.polled_at is None and m.observer is None and len(m.deadlines) == 0
    assert m.rooms == {} and len(m.tombstones) == 0 and m.pinned == {} and not m.stats
    assert m.oldest_write_age() == 0.0 and m.writes_in_flight == 0 and m.snapshot() == {}


def test_default_timeouts_at_work():
    b = Bench(park_timeout=120.0, write_timeout=60.0, quarantine_s=30.0)
    m = EncodeManager(b.t, b.clock)  # all defaults, on the bench's transport and ring
    b.m = m
    assert m.register_receiver(b.frame(1, "p1"))
    assert m.deadline_of(1) == 120.0  # announce waits as long as park unless told otherwise
    assert m.bind_sender(2) == "registered" and m.submit_chunk(2, b.chunk())
    assert m.deadline_of(2) == 120.0
    assert m.bind_sender(1) == "ready"
    b.t.inject("timeout")
    assert m.submit_chunk(1, b.chunk())
    m.poll()  # the write timed out: its slot waits out the quarantine
    assert m.failure_reason(1) == "write to receiver p1 timed_out"
    assert b.ring.counts()["quarantined"] == 1
    b.clock.advance(29.999)
    m.poll()
    assert b.ring.counts()["quarantined"] == 1
    b.clock.advance(0.001)
    m.poll()
    assert b.ring.counts()["quarantined"] == 0
    b.clock.advance(90.0)  # t = 120: room 2's park deadline
    m.poll()
    assert m.failure_reason(2) == "no receivers registered within 120.0 s of parking"
    # a write with no report fails its room at the default write deadline
    assert m.bind_sender(3) == "registered" and m.register_receiver(b.frame(3, "p3"))
    b.t.inject("hold")
    assert m.submit_chunk(3, b.chunk())
    b.clock.advance(59.999)
    m.poll()
    assert m.room_status(3) == "transferring" and m.oldest_write_age() == pytest.approx(59.999)
    b.clock.advance(0.001)
    m.poll()
    assert m.failure_reason(3) == "write to receiver p3 got no report within 60.0 s"


def test_default_tombstone_lifetime():
    b = Bench()
    m = EncodeManager(b.t, b.clock)
    b.m = m
    b.announced_failed(1, "p1")
    b.clock.advance(0.5)
    b.announced_failed(2, "p2")
    m.poll()
    b.clock.advance(600.0)  # room 1 is 600.5 s old, room 2 exactly 600 s
    m.poll()
    assert m.room_status(1) is None and m.room_status(2) == "failed"


def test_announce_timeout_is_its_own_when_given():
    b = Bench(park_timeout=50.0, announce_timeout=3.0)
    m = b.m
    assert m.register_receiver(b.frame(1, "p1"))
    assert m.deadline_of(1) == 3.0
    b.clock.advance(3.0)
    m.poll()
    assert m.failure_reason(1) == "sender never registered within 3.0 s"
    assert m.bind_sender(2) == "registered" and m.submit_chunk(2, b.chunk()) and m.deadline_of(2) == 53.0


def test_clock_comes_from_the_caller_then_the_transport_then_the_system():
    from epd_ring.executor import Transport

    class Bare(Transport):
        def register_memory(self, regions, owner=None):
            pass

        def submit_write(self, session, bufs):
            return 1

        def poll(self):
            return []

        def notify(self, frame, room, status, reason=""):
            pass

    assert EncodeManager(LoopbackTransport(FakeClock(100.0)), FakeClock(5.0)).clock.now() == 5.0
    assert EncodeManager(LoopbackTransport(FakeClock(100.0))).clock.now() == 100.0
    assert isinstance(EncodeManager(Bare()).clock, MonotonicClock)
    t = Bare()
    assert EncodeManager(t).transport is t


def test_first_poll_trims_aged_tombstones():
    b = Bench(tombstone_ttl=0.5)
    m = b.m
    b.announced_failed(1, "p1")
    b.clock.advance(0.6)
    m.poll()  # the first poll trims, whatever the time
    assert m.room_status(1) is None
    assert m.polled_at == 0.6


def test_announce_limits_count_from_zero_in_all_and_per_peer(caplog):
    caplog.set_level(logging.WARNING, logger="epd_ring.manager")
    b = Bench(max_announced=2, max_announced_per_peer=1)
    m = b.m
    assert m.register_receiver(b.frame(1, "a1", peer="A"))
    assert m.register_receiver(b.frame(2, "a1", peer="A")) is False  # A's one announcement is used
    why = "too many rooms waiting for their sender"
    assert b.notices("a1", 2) == [(2, "failed", why), (2, "released", "")]
    assert m.register_receiver(b.frame(3, "b1", peer="B"))  # B has its own
    assert m.register_receiver(b.frame(4, "c1", peer="C")) is False  # two in all
    assert m.stats["frames_refused"] == 2 and m.room_status(2) is None and m.room_status(4) is None
    assert [r.getMessage() for r in caplog.records] == [
        "refused frames: announce limit reached (2 in all, 1 per peer)"]
    assert m.bind_sender(1) == "ready"  # a sender came: A may announce again
    assert m.register_receiver(b.frame(5, "a1", peer="A"))
    assert m.register_receiver(b.frame(6, "a1", peer="A")) is False
    assert m.stats["frames_refused"] == 3


def test_a_sender_alone_uses_no_announcement():
    b = Bench(max_announced=1)
    m = b.m
    assert m.bind_sender(7) == "registered"
    assert m.register_receiver(b.frame(1, "p1"))
    assert m.register_receiver(b.frame(2, "p2")) is False


def test_synthetic_handles_never_collide_with_a_transports_handle_zero():
    class ZeroBased(Recorder):
        """Handles from 0, and a receiver whose writes the transport refuses outright."""

        def submit_write(self, session, bufs):
            if session == "bad":
                raise RuntimeError("no route")
            return super().submit_write(session, bufs) - 1

        def poll(self):
            return [(h - 1, o) for h, o in super().poll()]

    b = Bench()
    b.t = ZeroBased(b.clock)
    b.m = EncodeManager(b.t, b.clock)
    b.ring = Ring(b.t, 2, 4096)
    m = b.m
    assert m.bind_sender(1) == "registered"
    assert m.register_receiver(b.frame(1, "good", n=2))
    assert m.register_receiver(b.frame(1, "bad", n=2))
    assert m.submit_chunk(1, b.chunk())
    m.poll()
    assert m.failure_reason(1) == "write to receiver bad failed"
    assert m.stats["completions_unknown"] == 0 and m.writes_in_flight == 0


def test_snapshot_of_a_fresh_room():
    b = Bench()
    m = b.m
    assert m.bind_sender(1) == "registered"
    assert m.snapshot() == {1: {"state": "registered", "receivers": [], "n": None, "slot": None, "deadline": None}}
    assert m.register_receiver(b.frame(1, "p1", n=2))
    assert m.snapshot()[1] == {"state": "registered", "receivers": ["p1"], "n": 2, "slot": None, "deadline": None}


# bind_sender ----------------------------------------------------------------------------------
def test_bind_sender_refuses_bad_room_ids_and_receivers():
    m = Bench().m
    for bad in (-1, "3", True, 2.0, None):
        with pytest.raises(ValueError) as e:
            m.bind_sender(bad)
        assert str(e.value) == f"room must be a non-negative integer, got {bad!r}"
    for bad in (5, b"A", ["A"]):
        with pytest.raises(ValueError) as e:
            m.bind_sender(1, receiver=bad)
        assert str(e.value) == f"receiver must be a peer identity string, got {bad!r}"
    assert m.rooms == {}
    assert m.bind_sender(0) == "registered"  # zero is a room id like any other
    assert m.bind_sender(1, receiver="") == "registered"  # "" is the unauthenticated peer


def test_bind_sender_twice_or_after_conclusion_is_a_conflict():
    b = Bench()
    m = b.m
    assert m.bind_sender(1) == "registered"
    with pytest.raises(RoomConflict) as e:
        m.bind_sender(1)
    assert str(e.value) == "room 1 already has a sender"
    b.succeed(2, "p2")
    for receiver in (None, "", "A"):
        with pytest.raises(RoomConflict) as e:
            m.bind_sender(2, receiver=receiver)
        assert str(e.value) == "room 2 already concluded success; room ids must not be reused"
    assert m.room_status(2) == "success" and m.room_status(1) == "registered"


def test_a_sender_binds_to_its_own_peers_failure_and_its_room():
    b = Bench()
    m = b.m
    ev = m.observer = Events()
    b.announced_failed(1, "a1", "bad frame", peer="A")
    assert m.bind_sender(1, receiver="A") == "failed"  # A's own failure binds its request
    assert m.bind_sender(1) == "failed"  # unnamed: whatever failed the room, it stays failed
    assert m.register_receiver(b.frame(2, "a2", n=2, peer="A"))
    assert m.bind_sender(2, receiver="A") == "registered"  # A's announced room is A's to bind
    assert m.register_receiver(b.frame(3, "a3", n=1, peer="A"))
    assert m.bind_sender(3) == "ready"  # unnamed binds to whoever announced
    assert m.stats["foreign_announcements"] == 0 and m.stats["failed"] == 1
    assert ev.calls == [("opened", 1), ("opened", 2), ("opened", 3)]  # binding opens no second record


def test_a_room_announced_by_another_peer_fails_for_it_and_opens_anew():
    b = Bench()
    m = b.m
    ev = m.observer = Events()
    assert m.register_receiver(b.frame(3, "a3", n=2, peer="A"))
    assert m.bind_sender(3, receiver="B") == "registered"
    why = "room not open to this receiver"
    assert b.notices("a3", 3) == [(3, "failed", why), (3, "released", "")]
    assert m.stats["foreign_announcements"] == 1 and m.stats["failed"] == 1
    assert m.room_status(3) == "registered" and ev.calls == [("opened", 3), ("opened", 3)]
    assert m.register_receiver(b.frame(3, "b3", n=1, peer="B"))  # B's frame now completes the room
    assert m.room_status(3) == "ready"
    assert m.register_receiver(b.frame(3, "a4", n=1, peer="A")) is False  # and A is out
    # a room that already has its sender is not taken over, whoever binds it
    assert m.bind_sender(4, receiver="A") == "registered"
    with pytest.raises(RoomConflict):
        m.bind_sender(4, receiver="B")
    assert m.stats["foreign_announcements"] == 1
    assert m.register_receiver(b.frame(8, "a8", n=2, peer="A"))
    assert m.bind_sender(8, receiver="C") == "registered"  # each such room is counted
    assert m.stats["foreign_announcements"] == 2 and m.stats["failed"] == 2


# register_receiver ---------------------------------------------------------------------------
def test_malformed_frames_are_refused_and_fail_only_what_their_sender_may(caplog):
    caplog.set_level(logging.WARNING, logger="epd_ring.manager")
    b = Bench()
    m = b.m
    bad = b.frame(0, "p0", span=0)
    why = "room 0: span and hidden must be at least 1"
    assert m.register_receiver(bad) is False
    assert m.room_status(0) is None  # never creates a room
    assert b.notices("p0") == [(0, "failed", f"malformed receiver frame: {why}"), (0, "released", "")]
    assert m.stats["frames_refused"] == 1
    assert [r.getMessage() for r in caplog.records] == [f"refused receiver frame: {why}"]

    assert m.bind_sender(1) == "registered"  # nobody's yet: the malformed frame claims and fails it
    assert m.register_receiver(b.frame(1, "p1", hidden=0, peer="A")) is False
    reason = "malformed receiver frame: room 1: span and hidden must be at least 1"
    assert m.failure_reason(1) == reason and m.tombstone(1).owner == "A"
    assert b.notices("p1") == [(1, "failed", reason), (1, "released", "")]  # the room had no receiver yet

    assert m.bind_sender(2, receiver="A") == "registered"  # A's: B's malformed frame cannot touch it
    assert m.register_receiver(b.frame(2, "b2", span=0, peer="B")) is False
    assert m.room_status(2) == "registered"
    assert b.notices("b2") == [(2, "failed", "malformed receiver frame: room 2: span and hidden must be at least 1"),
                               (2, "released", "")]
    assert m.register_receiver(b.frame(9, "a9", n=2, peer="A"))  # A claims session a9
    assert m.register_receiver(b.frame(2, "a9", span=0, peer="B")) is False  # A's session: no reply
    assert b.notices("a9") == []
    assert m.stats["frames_refused"] == 4 and m.stats["frames_foreign"] == 0
    b.clock.advance(1.0)
    assert m.register_receiver(b.frame(-1, "p9")) is False  # no room id to answer about
    assert b.notices("p9") == [] and m.stats["frames_refused"] == 5
    assert caplog.records[-1].getMessage() == (
        "refused receiver frame: room must be a non-negative integer, got -1 (and 3 more like it)")


def test_a_frame_with_a_bool_room_id_is_refused_without_an_answer():
    b = Bench()
    m = b.m
    assert m.register_receiver(b.frame(True, "p1")) is False
    assert b.notices("p1") == [] and m.stats["frames_refused"] == 1 and m.rooms == {}


def test_frames_from_another_peers_session_get_no_answer(caplog):
    caplog.set_level(logging.WARNING, logger="epd_ring.manager")
    b = Bench()
    m = b.m
    assert m.register_receiver(b.frame(1, "s1", n=2, peer="A"))
    told = list(b.t.told)
    assert m.register_receiver(b.frame(2, "s1", peer="B")) is False
    assert m.register_receiver(b.frame(1, "s1", n=2, peer="B")) is False
    assert b.t.told == told and m.room_status(2) is None and m.stats["frames_foreign"] == 2
    assert [r.getMessage() for r in caplog.records] == [
        "refused a frame from another peer: session belongs to another receiver"]


def test_a_frame_that_cannot_claim_its_session_is_told_why():
    b = Bench()
    m = b.m
    m.tenancy.max_sessions = 1  # the bound on sessions in all, lowered to reach it
    assert m.register_receiver(b.frame(1, "a1", peer="A"))
    assert m.register_receiver(b.frame(2, "b1", peer="B")) is False
    assert b.notices("b1") == [(2, "failed", "too many receiver sessions (1)")]
    assert m.room_status(2) is None and m.stats["frames_foreign"] == 1


def test_frames_for_a_room_of_another_peer_live_or_concluded_are_told_the_same():
    b = Bench()
    m = b.m
    assert m.bind_sender(1, receiver="A") == "registered"
    b.announced_failed(2, "a2", "secret", peer="A")
    why = "room not open to this receiver"
    assert m.register_receiver(b.frame(1, "b1", peer="B")) is False
    assert m.register_receiver(b.frame(2, "b1", peer="B")) is False
    assert b.notices("b1") == [(1, "failed", why), (2, "failed", why)]
    assert m.stats["frames_foreign"] == 2 and m.stats["late_frames"] == 0
    assert m.room_status(1) == "registered"


def test_late_frames_are_answered_from_the_tombstone():
    b = Bench()
    m = b.m
    b.announced_failed(1, "p1", "gone")
    assert m.register_receiver(b.frame(1, "p2")) is True
    assert b.notices("p2") == [(1, "failed", "gone"), (1, "released", "")]
    assert m.stats["late_frames"] == 1 and m.rooms == {}


def test_duplicate_and_conflicting_frames():
    b = Bench()
    m = b.m
    f = b.frame(1, "p1", n=2)
    assert m.register_receiver(f) and m.register_receiver(f) and m.register_receiver(f)
    assert m.stats["duplicate_frames"] == 2 and m.room_status(1) == "announced"
    other = f._replace(dst_ptr=f.dst_ptr + 4)
    assert m.register_receiver(other) is False
    reason = "receiver p1 registered twice with different frames"
    assert m.failure_reason(1) == reason
    # told once as the room's receiver, and once more for the frame no write was issued to
    assert b.notices("p1", 1) == [(1, "failed", reason), (1, "released", ""), (1, "failed", reason),
                                  (1, "released", "")]


def test_frames_must_agree_fit_n_and_fit_the_chunk():
    b = Bench()
    m = b.m
    assert m.register_receiver(b.frame(1, "p1", n=2))
    assert m.register_receiver(b.frame(1, "p2", n=3)) is False
    reason = "room 1: receivers disagree on n_receivers (2 from p1 vs 3 from p2)"
    assert m.failure_reason(1) == reason
    assert b.notices("p2") == [(1, "failed", reason), (1, "released", "")]

    assert m.register_receiver(b.frame(2, "p1", n=2))
    assert m.register_receiver(b.frame(2, "p2", n=2))
    assert m.register_receiver(b.frame(2, "p3", n=2)) is False
    assert m.failure_reason(2) == "room 2: receiver p3 is beyond the N=2 declared"

    for room, over, why in [
        (3, dict(rows=3), "room 3: receiver p1 expects 3 rows, chunk has 2"),
        (4, dict(hidden=4), "room 4: receiver p1 expects hidden 4, chunk has 8"),
        (5, dict(dtype="torch.float16"), "room 5: receiver p1 expects torch.float16, chunk is torch.float32"),
        (6, dict(has_deepstack=True, deep_levels=1, dst_deep_ptr=64),
         "room 6: receiver p1 expects deepstack rows the chunk lacks"),
    ]:
        assert m.bind_sender(room) == "registered" and m.submit_chunk(room, b.chunk())
        assert m.register_receiver(b.frame(room, "p1", **over)) is False
        assert m.failure_reason(room) == why
        assert b.notices("p1", room) == [(room, "failed", why), (room, "released", "")]
    assert b.ring.free_count == 4


def test_the_last_frame_of_a_parked_room_starts_its_writes():
    b = Bench()
    m = b.m
    assert m.bind_sender(1) == "registered" and m.submit_chunk(1, b.chunk())
    assert m.register_receiver(b.frame(1, "p1", n=2))
    assert m.is_parked(1) and m.writes_in_flight == 0 and m.deadline_of(1) == 10.0
    b.clock.advance(4.0)
    assert m.register_receiver(b.frame(1, "p2", n=2))
    assert m.room_status(1) == "transferring" and m.writes_in_flight == 2 and m.deadline_of(1) is None
    m.poll()
    assert m.room_status(1) == "success"
    assert b.notices("p1") == [(1, "success", "")] and b.notices("p2") == [(1, "success", "")]
    assert m.stats["told_success"] == 2 and b.ring.free_count == 4


def test_frames_to_unreachable_or_too_many_peers_fail_their_room():
    b = Bench(max_peers=1)
    m = b.m
    assert m.register_receiver(b.frame(1, "p1", n=2))
    assert m.register_receiver(b.frame(1, "p2", n=2)) is False  # p1 still has a live room
    assert m.failure_reason(1) == "too many peers to add p2"
    assert b.notices("p2") == [(1, "failed", "too many peers to add p2"), (1, "released", "")]

    b = Bench()
    m = b.m
    b.t.inject_contact("refuse", session="dead")
    assert m.register_receiver(b.frame(2, "dead")) is False  # refused at first contact
    reason = m.failure_reason(2)
    assert reason is not None and reason.startswith("peer dead is down: ")
    assert b.notices("dead") == [(2, "failed", reason), (2, "released", "")]
    assert m.register_receiver(b.frame(3, "dead")) is False  # down and backing off: fails at once
    assert m.failure_reason(3) == reason


def test_a_down_peer_is_contacted_again_once_its_backoff_is_over():
    b = Bench(peer_backoff=5.0)
    m = b.m
    b.t.inject_contact("refuse", session="p1")  # the first contact only
    assert m.register_receiver(b.frame(1, "p1")) is False
    reason = m.failure_reason(1)
    b.clock.advance(1.0)
    assert m.register_receiver(b.frame(2, "p1")) is False  # still backing off: no new contact
    assert m.failure_reason(2) == reason and b.t.contacts == 1
    b.clock.advance(4.0)
    assert m.register_receiver(b.frame(3, "p1"))  # contacted again, and it answers now
    assert m.room_status(3) == "announced" and b.t.contacts == 2


def test_announcements_are_counted_per_peer():
    b = Bench(max_announced_per_peer=2)
    m = b.m
    assert m.register_receiver(b.frame(1, "a1", peer="A"))
    assert m.register_receiver(b.frame(2, "a1", peer="A"))
    assert m.register_receiver(b.frame(3, "a1", peer="A")) is False
    assert m.register_receiver(b.frame(4, "b1", peer="B"))
    assert m.fail_room(1, "x")  # concluding gives the announcement back
    assert m.register_receiver(b.frame(5, "a1", peer="A"))
    assert m.register_receiver(b.frame(6, "a1", peer="A")) is False


def test_a_malformed_frame_with_no_valid_address_gets_no_reply():
    b = Bench()
    m = b.m
    f = b.frame(3, "p3")
    assert m.register_receiver(f._replace(session=5)) is False
    assert m.register_receiver(f._replace(status_endpoint=7)) is False
    assert m.register_receiver(f._replace(status_endpoint="ipc:///tmp/x")) is False  # a string: answered
    assert [x[2:] for x in b.t.told] == [
        ("failed", "malformed receiver frame: room 3: status_endpoint must be a printable tcp:// address, "
                   "got 'ipc:///tmp/x'"), ("released", "")]
    assert m.stats["frames_refused"] == 3 and m.rooms == {}


def test_a_reopened_room_releases_regions_it_never_wrote_at_once():
    # Room 5 fails with A's write still in flight; A's session s1 is then released (A's
    # session cap of one) and claimed by B, whose request reopens room 5. When that room
    # fails before any write of its own, s1's region is free at once: the old write in
    # flight belongs to the previous room, not to this one.
    b = Bench(max_sessions_per_peer=1)
    m = b.m
    assert m.bind_sender(5, receiver="A") == "registered"
    b.t.inject("hold")
    assert m.register_receiver(b.frame(5, "s1", peer="A"))
    assert m.submit_chunk(5, b.chunk()) and m.writes_in_flight == 1
    assert m.fail_room(5, "x")
    assert b.notices("s1") == [(5, "failed", "x")]  # its release waits for the write
    assert m.register_receiver(b.frame(6, "s2", n=2, peer="A"))  # A's oldest session, s1, is let go
    assert m.bind_sender(5, receiver="B") == "registered"
    assert m.register_receiver(b.frame(5, "s1", peer="B"))
    assert m.fail_room(5, "y")
    assert b.notices("s1") == [(5, "failed", "x"), (5, "failed", "y"), (5, "released", "")]
