"""A room's life in the manager: queries and the tick, binding its sender, its one chunk, the frames
the manager refuses, admission of rooms waiting for their sender, park and announce deadlines,
failing and concluding (what each receiver is told). Ownership between identities is in
test_trust.py, tombstones in test_tombstones.py, writes in test_writes.py."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import Calls, ManagerRig, log_lines, make_rig, reason_kind, reason_text

from epd_ring.executor import RoomConflict
from epd_ring.executor.core.reasons import ReasonKind

# -- queries and the tick ----------------------------------------------------------------------

def test_queries_on_unknown_live_and_concluded_rooms():
    b = ManagerRig()
    m = b.m
    for q in (m.room_status, m.tombstone, m.failure_reason, m.deadline_of):
        assert q(7) is None
    assert not m.accepts_chunk(7) and not m.is_parked(7)

    b.succeed(1, "p1")
    # a room that succeeded has a tombstone, no failure reason (its reason is empty) and no deadline
    assert m.tombstone(1).state == "success" and reason_text(m, 1) is None and m.deadline_of(1) is None
    assert b.notices("p1", 1) == [(1, "success", "")]

    assert m.bind_sender(2) == "registered"
    assert m.accepts_chunk(2) and not m.is_parked(2) and m.deadline_of(2) is None
    assert m.room_status(2) == "registered"
    # staged with no receiver yet: parked, and the park deadline runs from now
    b.clock.advance(3.0)
    assert m.submit_chunk(2, b.chunk()) is True
    assert m.is_parked(2) and not m.accepts_chunk(2) and m.deadline_of(2) == 13.0
    assert m.room_status(2) == "parked" and m.tombstone(2) is None


def test_snapshot_of_a_fresh_room():
    b = ManagerRig()
    m = b.m
    assert m.bind_sender(1) == "registered"
    assert m.snapshot() == {1: {"state": "registered", "receivers": [], "n": None, "extent": None, "deadline": None}}
    assert m.register_receiver(b.frame(1, "p1", n=2))
    assert m.snapshot()[1] == {"state": "registered", "receivers": ["p1"], "n": 2, "extent": None, "deadline": None}


def test_snapshot_shows_each_rooms_extent_and_pending_deadline():
    rig = make_rig(park_timeout=10.0, announce_timeout=7.0)
    m, t, clock = rig.manager, rig.transport, rig.clock
    t.inject("hold")
    m.register_receiver(rig.frame(1, "a", 2))  # announced at 0: due at 7, then its sender came
    rig.send(1)  # transferring: no deadline, its chunk is with the transport
    clock.advance(1.0)
    m.register_receiver(rig.frame(2, "b", 2, n=2))
    rig.send(2)  # parked at 1: due at 11
    clock.advance(1.0)
    m.register_receiver(rig.frame(3, "c", 2))  # announced at 2: due at 9
    assert m.snapshot() == {
        1: {"state": "transferring", "receivers": ["a"], "n": 1, "extent": None, "deadline": None},
        2: {"state": "parked", "receivers": ["b"], "n": 2, "extent": rig.extent_of(2).index, "deadline": 11.0},
        3: {"state": "announced", "receivers": ["c"], "n": 1, "extent": None, "deadline": 9.0},
    }


def test_poll_counts_every_input_it_took():
    rig = make_rig(park_timeout=10.0, announce_timeout=7.0)
    m, t, clock = rig.manager, rig.transport, rig.clock
    assert m.poll() == 0  # nothing happened
    # A control plane's sockets, say: each says how many frames it took.
    rig.executor.pump.sources += [lambda: 2, lambda: 3]
    assert m.poll() == 5
    # two writes that land at once: their outcomes are taken by the next poll
    m.register_receiver(rig.frame(1, "a", 2, n=2))
    m.register_receiver(rig.frame(1, "b", 2, n=2))
    rig.send(1)
    # a contact that answers one second later (a peer report)
    t.inject_contact("slow", session="c", delay=1.0)
    m.register_receiver(rig.frame(2, "c", 2))  # announced: due at 7
    m.register_receiver(rig.frame(3, "d", 2))  # announced: due at 7
    assert m.poll() == 5 + 2
    assert m.room_status(1) == "success"
    clock.advance(1.0)
    assert m.poll() == 5 + 1
    assert m.peers.get("c").state == "up"
    clock.advance(6.0)
    assert m.poll() == 5 + 2  # both announce deadlines
    assert m.room_status(2) == m.room_status(3) == "failed"
    assert m.poll() == 5


def test_live_deadlines_are_counted_exactly_through_announce_park_write():
    b = ManagerRig()
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


# -- binding a sender --------------------------------------------------------------------------

def test_bind_sender_refuses_bad_room_ids_and_receivers():
    m = ManagerRig().m
    for bad in (-1, "3", True, 2.0, None):
        with pytest.raises(ValueError, match=r"^room\b.*" + re.escape(repr(bad))):
            m.bind_sender(bad)
    for bad in (5, b"A", ["A"]):
        with pytest.raises(ValueError, match=r"^receiver\b.*" + re.escape(repr(bad))):
            m.bind_sender(1, receiver=bad)
    assert m.rooms == {}
    assert m.bind_sender(0) == "registered"  # zero is a room id like any other
    assert m.bind_sender(1, receiver="") == "registered"  # "" is the unauthenticated peer


def test_bind_sender_twice_or_after_conclusion_is_a_conflict():
    b = ManagerRig()
    m = b.m
    assert m.bind_sender(1) == "registered"
    with pytest.raises(RoomConflict, match=r"\broom 1\b.*\bsender\b"):
        m.bind_sender(1)
    b.succeed(2, "p2")
    for receiver in (None, "", "A"):
        with pytest.raises(RoomConflict, match=r"\broom 2\b.*\bconcluded success\b"):
            m.bind_sender(2, receiver=receiver)
    assert m.room_status(2) == "success" and m.room_status(1) == "registered"


# -- a room's one chunk ------------------------------------------------------------------------

def test_chunks_for_rooms_that_take_none_are_dropped_and_their_extents_freed():
    b = ManagerRig()
    m = b.m
    assert m.submit_chunk(9, b.chunk()) is False  # nobody bound room 9
    assert m.stats["chunks_dropped"] == 1 and b.ring.live == 0

    assert m.register_receiver(b.frame(3, "p3", n=2))  # announced: no sender, so no chunk either
    assert m.submit_chunk(3, b.chunk()) is False
    assert m.room_status(3) == "announced" and m.stats["chunks_dropped"] == 2

    b.succeed(5, "p5")
    assert m.submit_chunk(5, b.chunk()) is False  # concluded
    assert m.room_status(5) == "success" and m.stats["chunks_dropped"] == 3
    assert b.ring.live == 0 and m.stats["failed"] == 0


@pytest.mark.parametrize("state", ["parked", "transferring"])
def test_a_second_chunk_fails_its_room(state):
    b = ManagerRig()
    m = b.m
    assert m.bind_sender(1) == "registered"
    if state == "transferring":
        b.t.inject("hold")
        assert m.register_receiver(b.frame(1, "p1"))
    assert m.submit_chunk(1, b.chunk()) is True
    assert m.room_status(1) == state
    assert m.submit_chunk(1, b.chunk()) is False
    reason = "room 1 got a second chunk; a room carries exactly one"
    assert m.room_status(1) == "failed" and reason_text(m, 1) == reason
    assert m.stats["chunks_dropped"] == 1 and m.stats["failed"] == 1
    if state == "parked":
        assert b.ring.live == 0  # both extents: the second dropped, the parked one abandoned
    else:
        assert b.notices("p1", 1) == [(1, "failed", reason)]  # its release waits for the held write
        assert b.ring.live == 1  # the sending extent stays until its write reports


def test_a_chunk_its_receivers_do_not_expect_fails_the_room():
    b = ManagerRig()
    m = b.m
    assert m.bind_sender(1) == "registered"
    assert m.register_receiver(b.frame(1, "p1", rows=3))
    assert m.submit_chunk(1, b.chunk(rows=2)) is False
    reason = "room 1: receiver p1 expects 3 rows, chunk has 2"
    assert reason_text(m, 1) == reason
    assert b.notices("p1", 1) == [(1, "failed", reason), (1, "released", "")]
    assert b.ring.live == 0 and m.stats["chunks_dropped"] == 0


def test_the_last_frame_of_a_parked_room_starts_its_writes():
    b = ManagerRig()
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
    assert m.stats["told_success"] == 2 and b.ring.live == 0


# -- frames the manager refuses ----------------------------------------------------------------

def test_malformed_frames_are_refused_and_fail_only_what_their_sender_may(caplog):
    caplog.set_level(logging.WARNING, logger="epd_ring.manager")
    b = ManagerRig()
    m = b.m
    bad = b.frame(0, "p0", span=0)
    why = "room 0: span and hidden must be at least 1"
    assert m.register_receiver(bad) is False
    assert m.room_status(0) is None  # never creates a room
    assert b.notices("p0") == [(0, "failed", f"malformed receiver frame: {why}"), (0, "released", "")]
    assert m.stats["frames_refused"] == 1
    (line,) = log_lines(caplog)
    assert "room 0" in line and "span" in line

    assert m.bind_sender(1) == "registered"  # nobody's yet: the malformed frame claims and fails it
    assert m.register_receiver(b.frame(1, "p1", hidden=0, identity="A")) is False
    reason = "malformed receiver frame: room 1: span and hidden must be at least 1"
    assert reason_text(m, 1) == reason and m.tombstone(1).owner == "A"
    assert b.notices("p1") == [(1, "failed", reason), (1, "released", "")]  # the room had no receiver yet

    assert m.bind_sender(2, receiver="A") == "registered"  # A's: B's malformed frame cannot touch it
    assert m.register_receiver(b.frame(2, "b2", span=0, identity="B")) is False
    assert m.room_status(2) == "registered"
    assert b.notices("b2") == [(2, "failed", "malformed receiver frame: room 2: span and hidden must be at least 1"),
                               (2, "released", "")]
    assert m.register_receiver(b.frame(9, "a9", n=2, identity="A"))  # A claims session a9
    assert m.register_receiver(b.frame(2, "a9", span=0, identity="B")) is False  # A's session: no reply
    assert b.notices("a9") == []
    assert m.stats["frames_refused"] == 4 and m.stats["frames_foreign"] == 0
    b.clock.advance(1.0)
    assert m.register_receiver(b.frame(-1, "p9")) is False  # no room id to answer about
    assert b.notices("p9") == [] and m.stats["frames_refused"] == 5
    # one line a second: this one names the last refusal and how many were held back since
    lines = log_lines(caplog)
    assert len(lines) == 2 and "-1" in lines[-1] and re.search(r"\b3 more\b", lines[-1])


def test_a_frame_with_a_bool_room_id_is_refused_without_an_answer():
    b = ManagerRig()
    m = b.m
    assert m.register_receiver(b.frame(True, "p1")) is False
    assert b.notices("p1") == [] and m.stats["frames_refused"] == 1 and m.rooms == {}


def test_a_malformed_frame_with_no_valid_address_gets_no_reply():
    b = ManagerRig()
    m = b.m
    f = b.frame(3, "p3")
    assert m.register_receiver(f._replace(session=5)) is False
    assert m.register_receiver(f._replace(status_endpoint=7)) is False
    assert m.register_receiver(f._replace(status_endpoint="ipc:///tmp/x")) is False  # a string: answered
    assert [x[2:] for x in b.t.told] == [
        ("failed", "malformed receiver frame: room 3: status_endpoint must be a numeric tcp://ADDRESS:PORT, "
                   "got 'ipc:///tmp/x'"), ("released", "")]
    assert m.stats["frames_refused"] == 3 and m.rooms == {}


def test_duplicate_and_conflicting_frames():
    b = ManagerRig()
    m = b.m
    f = b.frame(1, "p1", n=2)
    assert m.register_receiver(f) and m.register_receiver(f) and m.register_receiver(f)
    assert m.stats["duplicate_frames"] == 2 and m.room_status(1) == "announced"
    other = f._replace(dst_ptr=f.dst_ptr + 4)
    assert m.register_receiver(other) is False
    reason = "receiver p1 registered twice with different frames"
    assert reason_text(m, 1) == reason
    # told once as the room's receiver, and once more for the frame no write was issued to
    assert b.notices("p1", 1) == [(1, "failed", reason), (1, "released", ""), (1, "failed", reason),
                                  (1, "released", "")]


def test_frames_must_agree_fit_n_and_fit_the_chunk():
    b = ManagerRig()
    m = b.m
    assert m.register_receiver(b.frame(1, "p1", n=2))
    assert m.register_receiver(b.frame(1, "p2", n=3)) is False
    reason = "room 1: receivers disagree on n_receivers (2 from p1 vs 3 from p2)"
    assert reason_text(m, 1) == reason
    assert b.notices("p2") == [(1, "failed", reason), (1, "released", "")]

    assert m.register_receiver(b.frame(2, "p1", n=2))
    assert m.register_receiver(b.frame(2, "p2", n=2))
    assert m.register_receiver(b.frame(2, "p3", n=2)) is False
    assert reason_kind(m, 2) is ReasonKind.FRAME

    for room, over, why in [
        (3, dict(rows=3), "room 3: receiver p1 expects 3 rows, chunk has 2"),
        (4, dict(hidden=4), "room 4: receiver p1 expects hidden 4, chunk has 8"),
        (5, dict(dtype="torch.float16"), "room 5: receiver p1 expects torch.float16, chunk is torch.float32"),
        (6, dict(has_deepstack=True, deep_levels=1, dst_deep_ptr=64),
         "room 6: receiver p1 expects deepstack rows the chunk lacks"),
    ]:
        assert m.bind_sender(room) == "registered" and m.submit_chunk(room, b.chunk())
        assert m.register_receiver(b.frame(room, "p1", **over)) is False
        assert reason_text(m, room) == why
        assert b.notices("p1", room) == [(room, "failed", why), (room, "released", "")]
    assert b.ring.live == 0


def test_a_frame_beyond_n_is_told_why_the_room_failed():
    rig = make_rig()
    m = rig.manager
    m.register_receiver(rig.frame(1, "a", 2, n=2))
    m.register_receiver(rig.frame(1, "b", 2, n=2))
    assert not m.register_receiver(rig.frame(1, "c", 2, n=2))
    reason = "room 1: receiver c is beyond the N=2 declared"
    assert reason_text(m, 1) == reason
    for s in ("a", "b", "c"):
        assert rig.told(s, 1) == [("failed", reason), ("released", "")]


# -- admission: rooms waiting for their sender -------------------------------------------------

def test_announce_limits_count_from_zero_in_all_and_per_identity(caplog):
    caplog.set_level(logging.WARNING, logger="epd_ring.manager")
    b = ManagerRig(max_announced=2, max_announced_per_identity=1)
    m = b.m
    assert m.register_receiver(b.frame(1, "a1", identity="A"))
    assert m.register_receiver(b.frame(2, "a1", identity="A")) is False  # A's one announcement is used
    why = "too many rooms waiting for their sender"
    assert b.notices("a1", 2) == [(2, "failed", why), (2, "released", "")]
    assert m.register_receiver(b.frame(3, "b1", identity="B"))  # B has its own
    assert m.register_receiver(b.frame(4, "c1", identity="C")) is False  # two in all
    assert m.stats["frames_refused"] == 2 and m.room_status(2) is None and m.room_status(4) is None
    (line,) = log_lines(caplog)  # one line, naming both limits
    assert "announce" in line and re.search(r"\b2 in all\b.*\b1 per identity\b", line)
    assert m.bind_sender(1) == "ready"  # a sender came: A may announce again
    assert m.register_receiver(b.frame(5, "a1", identity="A"))
    assert m.register_receiver(b.frame(6, "a1", identity="A")) is False
    assert m.stats["frames_refused"] == 3


def test_announcements_are_counted_per_identity():
    b = ManagerRig(max_announced_per_identity=2)
    m = b.m
    assert m.register_receiver(b.frame(1, "a1", identity="A"))
    assert m.register_receiver(b.frame(2, "a1", identity="A"))
    assert m.register_receiver(b.frame(3, "a1", identity="A")) is False
    assert m.register_receiver(b.frame(4, "b1", identity="B"))
    assert m.fail_room(1, "x")  # concluding gives the announcement back
    assert m.register_receiver(b.frame(5, "a1", identity="A"))
    assert m.register_receiver(b.frame(6, "a1", identity="A")) is False


def test_a_sender_alone_uses_no_announcement():
    b = ManagerRig(max_announced=1)
    m = b.m
    assert m.bind_sender(7) == "registered"
    assert m.register_receiver(b.frame(1, "p1"))
    assert m.register_receiver(b.frame(2, "p2")) is False


@pytest.mark.parametrize("cap", ["max_announced", "max_announced_per_identity"])
def test_a_room_leaves_the_announce_count_once(cap):
    rig = make_rig(**{cap: 3})
    m = rig.manager
    for room in (1, 2, 3):
        assert m.register_receiver(rig.frame(room, f"s{room}", 2, identity="x"))
    rig.executor.register("req-1", "prefill-host", 8998, 1)  # its sender came: 2 rooms wait for theirs
    assert m.register_receiver(rig.frame(4, "s4", 2, identity="x"))
    assert not m.register_receiver(rig.frame(5, "s5", 2, identity="x"))
    assert rig.told("s5", 5) == [("failed", "too many rooms waiting for their sender"), ("released", "")]
    m.fail_room(1, "aborted")  # it had left the count when its sender came
    assert not m.register_receiver(rig.frame(6, "s6", 2, identity="x"))
    m.fail_room(2, "aborted")  # still announced: leaves it now
    assert m.register_receiver(rig.frame(6, "s7", 2, identity="x"))


# -- park and announce deadlines ---------------------------------------------------------------

def test_park_deadline_fails_the_room_with_its_own_reason_and_observer_sees_it():
    b = ManagerRig()
    m = b.m
    ev = m.observer = Calls("room_opened", "parked")
    assert m.bind_sender(4) == "registered"
    assert m.submit_chunk(4, b.chunk()) is True
    assert ev.calls == [("room_opened", 4), ("parked", 4)]
    assert len(m.deadlines) == 1
    b.clock.advance(9.999)
    m.poll()
    assert m.is_parked(4)
    b.clock.advance(0.001)
    m.poll()
    assert m.room_status(4) == "failed"
    assert reason_kind(m, 4) is ReasonKind.PARK_TIMEOUT
    assert m.stats["expired"] == 1 and len(m.deadlines) == 0
    assert b.ring.live == 0  # no write was issued from the parked extent


def test_each_deadline_fails_its_room_with_its_own_reason():
    rig = make_rig(park_timeout=10.0, announce_timeout=7.0)
    m, clock = rig.manager, rig.clock
    m.register_receiver(rig.frame(1, "a", 2))  # receivers, no sender: announce deadline at 7
    m.register_receiver(rig.frame(2, "b", 2, n=2))  # 1 of 2, then the chunk: park deadline at 10
    rig.send(2)
    rig.send(3)  # the chunk, no receiver at all: park deadline at 10
    assert m.room_status(2) == m.room_status(3) == "parked"
    clock.advance(7.0)
    m.poll()
    announce = "sender never registered within 7.0 s"
    assert reason_text(m, 1) == announce
    assert rig.told("a", 1) == [("failed", announce), ("released", "")]
    assert m.room_status(2) == "parked"
    clock.advance(3.0)
    m.poll()
    assert reason_kind(m, 2) is ReasonKind.PARK_TIMEOUT
    assert rig.told("b", 2)[0] == ("failed", "only 1 of 2 receivers registered within 10.0 s of parking")
    assert reason_kind(m, 3) is ReasonKind.PARK_TIMEOUT
    assert m.stats["expired"] == 3 and m.stats["failed"] == 3
    assert rig.executor.ring.live == 0  # the parked chunks' extents came back


def test_announce_timeout_is_its_own_when_given():
    b = ManagerRig(park_timeout=50.0, announce_timeout=3.0)
    m = b.m
    assert m.register_receiver(b.frame(1, "p1"))
    assert m.deadline_of(1) == 3.0
    b.clock.advance(3.0)
    m.poll()
    assert reason_kind(m, 1) is ReasonKind.ANNOUNCE_TIMEOUT
    assert m.bind_sender(2) == "registered" and m.submit_chunk(2, b.chunk()) and m.deadline_of(2) == 53.0


# -- failing and concluding --------------------------------------------------------------------

def test_fail_room_changes_nothing_once_concluded():
    b = ManagerRig()
    m = b.m
    assert m.fail_room(3, "never existed") is False
    assert m.room_status(3) is None
    b.succeed(1, "p1")
    assert m.fail_room(1, "too late") is False
    assert m.room_status(1) == "success" and reason_text(m, 1) is None
    b.announced_failed(2, "p2", "first reason")
    assert m.fail_room(2, "second reason") is False
    assert reason_kind(m, 2) is ReasonKind.CALLER
    assert m.stats["failed"] == 1 and m.stats["success"] == 1


def test_conclusions_are_counted_told_and_forgotten_by_their_peers():
    rig = make_rig()
    m = rig.manager
    seen = []
    rig.executor.pump.on_conclude.append(lambda room, state: seen.append((room, state)))
    for s in ("a", "b"):
        m.register_receiver(rig.frame(1, s, 2, n=2))
    rig.send(1)
    m.register_receiver(rig.frame(2, "a", 2))
    rig.send(2)
    m.register_receiver(rig.frame(3, "b", 2))
    assert m.peers.snapshot()["a"]["rooms"] == 2 and m.peers.snapshot()["b"]["rooms"] == 2
    m.poll()
    m.fail_room(3, "aborted")
    assert seen == [(1, "success"), (2, "success"), (3, "failed")]
    assert m.stats["success"] == 2 and m.stats["failed"] == 1
    assert {s: p["rooms"] for s, p in m.peers.snapshot().items()} == {"a": 0, "b": 0}


def test_every_notice_is_counted_and_an_unreachable_receiver_stops_no_other():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    notify = t.notify

    def flaky(frame, room, status, reason=""):
        if frame.session == "gone":
            raise ConnectionError("status socket closed")
        notify(frame, room, status, reason)

    t.notify = flaky
    for s in ("a", "b"):
        m.register_receiver(rig.frame(1, s, 2, n=2))
    rig.send(1)
    m.poll()
    for s in ("gone", "a"):
        m.register_receiver(rig.frame(2, s, 2, n=2))
    m.fail_room(2, "aborted")
    rig.receiver("w")
    assert m.withdraw(3, "w") == "acked"  # nothing of room 3 here: acked at once
    assert rig.told("a", 2) == [("failed", "aborted"), ("released", "")]
    assert rig.told("w", 3) == [("withdrawn", "")]
    counted = {k: v for k, v in m.stats.items() if k.startswith("told_") or k == "notify_errors"}
    assert counted == {"told_success": 2, "told_failed": 1, "told_released": 1, "told_withdrawn": 1,
                       "notify_errors": 2}


def test_a_coupling_on_a_room_event_runs_on_a_guarded_step_as_on_a_compiled_one(monkeypatch):
    # fsm/couplings.py may name actions on a room event (today only the extent's `release` has one):
    # a guarded step (add_receiver, waiting for all receivers) must run them as an unguarded one does.
    from epd_ring.executor.core.lifecycle import Lifecycle
    from epd_ring.fsm import couplings

    seen: list[tuple[int, str]] = []
    actions = Lifecycle.coupling_actions
    monkeypatch.setattr(Lifecycle, "coupling_actions",
                        lambda self: {**actions(self), "noted": lambda room: seen.append((room.id, room.state))})
    monkeypatch.setitem(couplings.ON_EVENT, ("room", "add_receiver"), ("noted",))
    rig = make_rig()
    rig.executor.register("req-1", "prefill-host", 8998, 1)
    rig.manager.register_receiver(rig.frame(1, "rcv:0", 2, n_receivers=2, row_start=0, n_tokens=1))
    rig.manager.register_receiver(rig.frame(1, "rcv:1", 2, n_receivers=2, row_start=1, n_tokens=1))
    assert seen == [(1, "registered"), (1, "ready")]  # each add_receiver's, after its step
