"""The manager's tick, deadlines, write outcomes and conclusions, pinned down exactly.

Written against the surviving mutants of executor/core/manager.py (poll, the drivers' `*_now`
calls, _start_writes, outcomes, failing, expiring, concluding, peers, tombstones, dumps): each
test is a small deterministic scenario on the loopback transport and a fake clock whose
counts, reasons and notices are what the controller promises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_rig  # noqa: E402

from epd_ring.executor import Observer, Outcome  # noqa: E402


def start(rig, room, n_tokens=2, **register):
    """Register the room's sender and run its item through the tower (the chunk is submitted)."""
    rid = f"req-{room}"
    rig.executor.register(rid, "prefill-host", 8998, room, **register)
    rig.executor.execute([(rid, rig.item(n_tokens, room))])
    return rid


def notices(rig, session, room):
    return [(n.status, n.reason) for n in rig.receiver(session).notices if n.room == room]


def slot_of(rig, room):
    return next(s for s in rig.executor.ring.slots if s.room == room)


# ------------------------------------------------------------------------- poll ---

def test_poll_counts_every_input_it_took():
    rig = make_rig(park_timeout=10.0, announce_timeout=7.0)
    m, t, clock = rig.manager, rig.transport, rig.clock
    assert m.poll() == 0  # nothing happened
    m.sources += [lambda: 2, lambda: 3]  # a control plane's sockets, say: each says how many frames it took
    assert m.poll() == 5
    # two writes that land at once: their outcomes are taken by the next poll
    m.register_receiver(rig.frame(1, "a", 2, n=2))
    m.register_receiver(rig.frame(1, "b", 2, n=2))
    start(rig, 1)
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


def test_poll_takes_the_outcomes_of_writes_the_transport_refused_with_its_own():
    rig = make_rig(quarantine_s=5.0)
    m, t, clock = rig.manager, rig.transport, rig.clock
    refused = {"b", "c", "d"}
    submit = t.submit_write

    def refusing(session, bufs):  # a transport must not raise here; one that does fails that write only
        if session in refused:
            raise RuntimeError("engine refused the write")
        return submit(session, bufs)

    t.submit_write = refusing
    for s in ("a", "b", "c"):
        m.register_receiver(rig.frame(1, s, 2, n=3))
    start(rig, 1)
    slot = slot_of(rig, 1)
    assert m.writes_in_flight == 3
    assert m.poll() == 3  # a's real outcome and the two refused ones
    assert m.room_status(1) == "failed"
    assert m.failure_reason(1) == "write to receiver b failed"  # a reported done first, then b
    assert m.writes_in_flight == 0
    assert m.stats["completions_unknown"] == 0 and m.stats["completions_dropped"] == 1  # c's, after the failure
    assert slot.state == "quarantined" and slot.writes_in_flight == 0
    # a's write landed: its region is free at once; b's and c's wait out the quarantine
    assert notices(rig, "a", 1) == [("failed", "write to receiver b failed"), ("released", "")]
    assert rig.receiver("b").releases(1) == [] and rig.receiver("c").releases(1) == []
    clock.advance(5.0)
    m.poll()
    assert slot.state == "free"
    assert rig.receiver("b").releases(1) == ["released"] and rig.receiver("c").releases(1) == ["released"]
    # and again, for a later room
    m.register_receiver(rig.frame(2, "d", 2))
    start(rig, 2)
    assert m.poll() == 1
    assert m.failure_reason(2) == "write to receiver d failed"
    assert m.writes_in_flight == 0


def test_a_refused_contact_fails_the_room_with_the_edges_detail():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    t.inject_contact("hang", session="a")
    m.register_receiver(rig.frame(1, "a", 2))
    attempt = t.hung.pop("a")
    reports = [[("a", attempt, False, "segment open failed: ENOENT")]]
    t.peer_reports = lambda: reports.pop() if reports else []
    assert m.poll() == 1
    assert m.peers.get("a").state == "down"
    reason = "peer a is down: contact failed (segment open failed: ENOENT)"
    assert m.failure_reason(1) == reason
    assert notices(rig, "a", 1) == [("failed", reason), ("released", "")]


def test_each_deadline_fails_its_room_with_its_own_reason():
    rig = make_rig(park_timeout=10.0, announce_timeout=7.0)
    m, clock = rig.manager, rig.clock
    m.register_receiver(rig.frame(1, "a", 2))  # receivers, no sender: announce deadline at 7
    m.register_receiver(rig.frame(2, "b", 2, n=2))  # 1 of 2, then the chunk: park deadline at 10
    start(rig, 2)
    start(rig, 3)  # the chunk, no receiver at all: park deadline at 10
    assert m.room_status(2) == m.room_status(3) == "parked"
    clock.advance(7.0)
    m.poll()
    announce = "sender never registered within 7.0 s"
    assert m.failure_reason(1) == announce
    assert notices(rig, "a", 1) == [("failed", announce), ("released", "")]
    assert m.room_status(2) == "parked"
    clock.advance(3.0)
    m.poll()
    assert m.failure_reason(2) == "only 1 of 2 receivers registered within 10.0 s of parking"
    assert notices(rig, "b", 2)[0] == ("failed", "only 1 of 2 receivers registered within 10.0 s of parking")
    assert m.failure_reason(3) == "no receivers registered within 10.0 s of parking"
    assert m.stats["expired"] == 3 and m.stats["failed"] == 3
    assert rig.executor.ring.free_count == rig.executor.ring.n_slots  # the parked chunks' slots came back


# ---------------------------------------------------------------- tombstones ---

def test_tombstones_age_out_at_the_first_trim_past_their_ttl():
    rig = make_rig(tombstone_ttl=10.0)  # trims run every tenth of the TTL: each 1 s of the clock
    m, clock = rig.manager, rig.clock

    def conclude(room):  # a room no sender holds: its record is free to age from now
        m.register_receiver(rig.frame(room, f"s{room}", 2))
        m.fail_room(room, "aborted")

    m.poll()  # t=0: a trim; the next one is due at 1
    conclude(1)  # at 0
    clock.advance(1.5)
    conclude(2)  # at 1.5
    clock.advance(8.5)
    m.poll()  # t=10: a trim; room 1 is exactly 10 s old, not older: kept; next trim at 11
    assert m.room_status(1) == m.room_status(2) == "failed"
    clock.advance(0.95)
    m.poll()  # t=10.95: room 1 is past its TTL, but no trim is due before 11
    assert m.room_status(1) == "failed"
    clock.advance(0.05)
    m.poll()  # t=11: the trim drops room 1 (11 s old) and only it: room 2 is 9.5 s old
    assert m.room_status(1) is None
    assert m.room_status(2) == "failed"
    clock.advance(1.0)
    m.poll()  # t=12: room 2 is 10.5 s old
    assert m.room_status(2) is None
    assert len(m.tombstones) == 0


def test_the_tombstone_cap_keeps_the_newest():
    rig = make_rig(tombstone_ttl=10.0, max_tombstones=3)
    m, clock = rig.manager, rig.clock
    for room in (1, 2, 3):
        m.register_receiver(rig.frame(room, f"s{room}", 2))
        m.fail_room(room, "aborted")
    m.poll()  # at the cap, not over it: all kept
    assert [m.room_status(r) for r in (1, 2, 3)] == ["failed"] * 3
    m.max_tombstones = 1  # a cap lowered at run time holds from the next trim on, oldest dropped first
    clock.advance(1.0)
    m.poll()
    assert [m.room_status(r) for r in (1, 2, 3)] == [None, None, "failed"]


# ------------------------------------------------------------- drivers' *_now ---

def test_a_driver_fires_room_deadlines_early_and_only_pending_ones():
    rig = make_rig(park_timeout=10.0, announce_timeout=7.0)
    m = rig.manager
    assert not m.expire_room_now(99)  # no such room
    m.register_receiver(rig.frame(1, "a", 2))  # announced
    m.register_receiver(rig.frame(2, "b", 2, n=2))
    start(rig, 2)  # parked
    rig.executor.register("req-3", "prefill-host", 8998, 3)  # registered: no deadline
    assert not m.expire_room_now(3)
    assert m.room_status(3) == "registered"
    assert len(m.deadlines) == 2
    assert m.expire_room_now(1)
    assert m.expire_room_now(2)
    assert len(m.deadlines) == 0  # both deadlines are gone: neither fires again
    assert m.failure_reason(1) == "deadline fired early by the driver (announced)"
    assert m.failure_reason(2) == "deadline fired early by the driver (parked)"
    assert notices(rig, "b", 2)[0] == ("failed", "deadline fired early by the driver (parked)")
    assert m.stats["expired"] == 2
    assert rig.executor.ring.free_count == rig.executor.ring.n_slots
    assert not m.expire_room_now(1)  # concluded


def test_a_driver_fires_a_peers_connect_deadline_early():
    rig = make_rig(connect_timeout=5.0)
    m, t = rig.manager, rig.transport
    t.inject_contact("hang", session="p")
    m.register_receiver(rig.frame(1, "p", 2))
    m.register_receiver(rig.frame(2, "a", 2))  # a answers at once: up, no deadline
    assert not m.expire_peer_now("nobody")
    assert not m.expire_peer_now("a")
    assert m.expire_peer_now("p")
    assert m.peers.get("p").state == "down"
    assert m.failure_reason(1) == "peer p is down: no answer to contact within the connect deadline of 5.0 s"
    assert m.room_status(2) == "announced"
    assert not m.expire_peer_now("p")  # its deadline is spent
    assert len(m.deadlines) == 1  # room 2's announce deadline only


def test_a_driver_ends_a_slots_quarantine_early():
    rig = make_rig(quarantine_s=5.0)
    m, t = rig.manager, rig.transport
    t.inject("fail", session="q")
    m.register_receiver(rig.frame(1, "q", 2))
    start(rig, 1)
    m.poll()
    assert m.failure_reason(1) == "write to receiver q failed"
    slot = slot_of(rig, 1)
    free = next(s for s in rig.executor.ring.slots if s.state == "free")
    assert slot.state == "quarantined"
    assert rig.receiver("q").releases(1) == []  # the failed write may still land
    assert not m.release_slot_now(free)
    assert m.release_slot_now(slot)
    assert slot.state == "free"
    assert rig.receiver("q").releases(1) == ["released"]
    assert not m.release_slot_now(slot)
    assert len(m.deadlines) == 0


# ------------------------------------------------------------------- writes ---

def test_a_zero_row_shard_is_skipped_not_the_end_of_the_writes():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    # one row over two receivers: rank 1 takes none; it registers first
    m.register_receiver(rig.frame(1, "r1", 1, n=2, rank=1, shard=True))
    m.register_receiver(rig.frame(1, "r0", 1, n=2, rank=0, shard=True))
    start(rig, 1, n_tokens=1)
    m.poll()
    assert m.room_status(1) == "success"
    assert t.submitted == 1
    assert rig.delivered_ok(1, "r0", rig.item(1, 1))


def test_deepstack_shards_take_their_own_rows_of_the_deep_slot():
    rig = make_rig(n_deep=2)
    m = rig.manager
    for rank in (0, 1):
        m.register_receiver(rig.frame(1, f"r{rank}", 4, n=2, rank=rank, shard=True))
    start(rig, 1, n_tokens=4)
    m.poll()
    assert m.room_status(1) == "success"
    for rank in (0, 1):
        assert rig.delivered_ok(1, f"r{rank}", rig.item(4, 1))


def test_a_room_whose_receivers_take_no_rows_succeeds_without_a_write():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    m.register_receiver(rig.frame(1, "a", 2, n_tokens=0))  # an empty row range of a 2-row chunk
    start(rig, 1)
    assert m.room_status(1) == "success"  # at once: nothing to wait for
    assert t.submitted == 0
    assert rig.executor.ring.free_count == rig.executor.ring.n_slots
    assert notices(rig, "a", 1) == [("success", "")]
    assert m.stats["success"] == 1


class Recorder(Observer):
    def __init__(self):
        self.started, self.reported = [], []

    def writes_started(self, room):
        self.started.append(room)

    def write_reported(self, room, outcome, submitted_at):
        self.reported.append((room, outcome, submitted_at))


def test_chunks_wait_for_a_peer_in_contact_and_observers_see_their_writes():
    rig = make_rig(write_timeout=30.0)
    m, t, clock = rig.manager, rig.transport, rig.clock
    rec = m.observer = Recorder()
    t.inject_contact("hang", session="slow")
    for room in (1, 2):
        m.register_receiver(rig.frame(room, "slow", 2))
        start(rig, room)
    assert m.room_status(1) == m.room_status(2) == "transferring"
    assert m.stats["waits_for_peer"] == 2 and t.submitted == 0 and rec.started == []
    clock.advance(2.0)
    assert t.answer("slow", ok=True)
    m.poll()  # the peer is up: both rooms submit their writes now, at t=2
    assert rec.started == [1, 2] and t.submitted == 2
    clock.advance(1.5)
    m.poll()
    assert rec.reported == [(1, Outcome.DONE, 2.0), (2, Outcome.DONE, 2.0)]
    assert m.room_status(1) == m.room_status(2) == "success"


def test_a_parked_room_does_not_write_when_its_peer_comes_up():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    t.inject_contact("hang", session="p")
    m.register_receiver(rig.frame(1, "p", 2, n=2, rank=0, shard=True))
    start(rig, 1)
    assert m.room_status(1) == "parked"
    assert t.answer("p", ok=True)
    m.poll()
    assert m.peers.get("p").state == "up"
    assert m.room_status(1) == "parked" and t.submitted == 0  # it still waits for its second receiver
    m.register_receiver(rig.frame(1, "q", 2, n=2, rank=1, shard=True))
    m.poll()
    assert m.room_status(1) == "success"
    assert rig.delivered_ok(1, "p", rig.item(2, 1)) and rig.delivered_ok(1, "q", rig.item(2, 1))


def test_write_deadlines_fail_live_rooms_and_are_counted_for_concluded_ones():
    rig = make_rig(write_timeout=30.0, peer_fail_threshold=10)
    m, t, clock = rig.manager, rig.transport, rig.clock
    t.inject("hold", count=3)
    m.register_receiver(rig.frame(1, "a", 2, n=2))
    m.register_receiver(rig.frame(1, "b", 2, n=2))
    start(rig, 1)
    m.register_receiver(rig.frame(2, "c", 2))
    start(rig, 2)
    h_a, h_b, h_c = t.held
    t.complete(h_a, Outcome.FAILED)
    m.poll()
    assert m.failure_reason(1) == "write to receiver a failed"
    clock.advance(30.0)
    m.poll()  # b's write (its room already failed) and c's reach their deadline unreported
    assert m.stats["write_deadlines"] == 2
    assert m.failure_reason(2) == "write to receiver c got no report within 30.0 s"
    assert slot_of(rig, 2).state == "sending"  # the transport may still read it
    t.complete(h_b, Outcome.DONE)
    t.complete(h_c, Outcome.DONE)
    m.poll()
    assert m.stats["completions_dropped"] == 2


def test_reports_of_writes_that_are_not_ours_are_counted_and_ignored():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    poll = t.poll
    t.poll = lambda: poll() + [(10_000, Outcome.DONE)]  # an engine reporting a handle twice, say
    m.poll()
    m.poll()
    assert m.stats["completions_unknown"] == 2
    m.register_receiver(rig.frame(1, "a", 2))
    start(rig, 1)
    m.poll()
    assert m.room_status(1) == "success"
    assert m.stats["completions_unknown"] == 3


def test_late_write_reports_while_its_peer_is_contacted_again_do_not_stop_the_loop():
    """A write issued before its peer went down may report while a later frame re-contacts the peer.

    It used to raise an undeclared `write_ok`/`write_failed` in `connecting` out of `poll()`."""
    rig = make_rig(peer_fail_threshold=1, peer_backoff=5.0)
    m, t, clock = rig.manager, rig.transport, rig.clock
    t.inject("hold", count=3)
    for room in (1, 2, 3):
        m.register_receiver(rig.frame(room, "p", 2))
        start(rig, room)
    h1, h2, h3 = t.held
    t.inject_contact("refuse", session="p")
    t.complete(h1, Outcome.FAILED)  # p becomes suspect, its re-check is refused: down, its rooms fail
    m.poll()
    assert m.peers.get("p").state == "down"
    assert [m.room_status(r) for r in (1, 2, 3)] == ["failed"] * 3
    clock.advance(5.0)
    t.inject_contact("hang", session="p")
    m.register_receiver(rig.frame(4, "p", 2))  # after the backoff: contacted again
    assert m.peers.get("p").state == "connecting"
    t.complete(h2, Outcome.DONE)
    t.complete(h3, Outcome.FAILED)
    m.poll()
    assert m.peers.get("p").state == "connecting"  # only the contact decides
    assert t.answer("p", ok=True)
    m.poll()
    assert m.peers.get("p").state == "up"
    start(rig, 4)
    m.poll()
    assert m.room_status(4) == "success"


# ------------------------------------------------------------ failing, telling ---

def test_a_frame_beyond_n_is_told_why_the_room_failed():
    rig = make_rig()
    m = rig.manager
    m.register_receiver(rig.frame(1, "a", 2, n=2))
    m.register_receiver(rig.frame(1, "b", 2, n=2))
    assert not m.register_receiver(rig.frame(1, "c", 2, n=2))
    reason = "room 1: receiver c is beyond the N=2 declared"
    assert m.failure_reason(1) == reason
    for s in ("a", "b", "c"):
        assert notices(rig, s, 1) == [("failed", reason), ("released", "")]


@pytest.mark.parametrize("cap", ["max_announced", "max_announced_per_peer"])
def test_a_room_leaves_the_announce_count_once(cap):
    rig = make_rig(**{cap: 3})
    m = rig.manager
    for room in (1, 2, 3):
        assert m.register_receiver(rig.frame(room, f"s{room}", 2, peer="x"))
    rig.executor.register("req-1", "prefill-host", 8998, 1)  # its sender came: 2 rooms wait for theirs
    assert m.register_receiver(rig.frame(4, "s4", 2, peer="x"))
    assert not m.register_receiver(rig.frame(5, "s5", 2, peer="x"))
    assert notices(rig, "s5", 5) == [("failed", "too many rooms waiting for their sender"), ("released", "")]
    m.fail_room(1, "aborted")  # it had left the count when its sender came
    assert not m.register_receiver(rig.frame(6, "s6", 2, peer="x"))
    m.fail_room(2, "aborted")  # still announced: leaves it now
    assert m.register_receiver(rig.frame(6, "s7", 2, peer="x"))


def test_conclusions_are_counted_told_and_forgotten_by_their_peers():
    rig = make_rig()
    m = rig.manager
    seen = []
    m.on_conclude.append(lambda room, state: seen.append((room, state)))
    for s in ("a", "b"):
        m.register_receiver(rig.frame(1, s, 2, n=2))
    start(rig, 1)
    m.register_receiver(rig.frame(2, "a", 2))
    start(rig, 2)
    m.register_receiver(rig.frame(3, "b", 2))
    assert m.peers.snapshot()["a"]["rooms"] == 2 and m.peers.snapshot()["b"]["rooms"] == 2
    m.poll()
    m.fail_room(3, "aborted")
    assert seen == [(1, "success"), (2, "success"), (3, "failed")]
    assert m.stats["success"] == 2 and m.stats["failed"] == 1
    assert {s: p["rooms"] for s, p in m.peers.snapshot().items()} == {"a": 0, "b": 0}


def test_late_frames_hear_the_outcome_they_may_know():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    # a room that failed before any frame came: nobody's, so its reason is nobody's
    rig.executor.register("req-1", "prefill-host", 8998, 1)
    m.fail_room(1, "client abort")
    m.register_receiver(rig.frame(1, "late", 2))
    assert notices(rig, "late", 1) == [("failed", "room already concluded without this receiver"), ("released", "")]
    # a room that failed while a write into a's region was in flight: a's frame, sent again,
    # hears the reason, and its release still waits for that write
    t.inject("hold", count=2)
    for s in ("a", "b"):
        m.register_receiver(rig.frame(2, s, 2, n=2))
    start(rig, 2)
    h_a, h_b = t.held
    t.complete(h_b, Outcome.FAILED)
    m.poll()
    frame_a = rig.frame(2, "a", 2, n=2)
    assert m.register_receiver(frame_a)
    reason = "write to receiver b failed"
    assert notices(rig, "a", 2) == [("failed", reason), ("failed", reason)]
    t.complete(h_a, Outcome.DONE)
    m.poll()
    assert notices(rig, "a", 2)[-1] == ("released", "")


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
    start(rig, 1)
    m.poll()
    for s in ("gone", "a"):
        m.register_receiver(rig.frame(2, s, 2, n=2))
    m.fail_room(2, "aborted")
    rig.receiver("w")
    assert m.withdraw(3, "w") == "acked"  # nothing of room 3 here: acked at once
    assert notices(rig, "a", 2) == [("failed", "aborted"), ("released", "")]
    assert notices(rig, "w", 3) == [("withdrawn", "")]
    counted = {k: v for k, v in m.stats.items() if k.startswith("told_") or k == "notify_errors"}
    assert counted == {"told_success": 2, "told_failed": 1, "told_released": 1, "told_withdrawn": 1,
                       "notify_errors": 2}


# ------------------------------------------------------------------- dumps ---

def test_oldest_write_age_counts_from_the_oldest_submit():
    rig = make_rig(write_timeout=30.0)
    m, t, clock = rig.manager, rig.transport, rig.clock
    assert m.oldest_write_age() == 0.0
    t.inject("hold", count=2)
    clock.advance(1.0)
    m.register_receiver(rig.frame(1, "a", 2))
    start(rig, 1)  # submitted at 1
    assert m.oldest_write_age() == 0.0
    clock.advance(2.0)
    m.register_receiver(rig.frame(2, "b", 2))
    start(rig, 2)  # submitted at 3
    clock.advance(1.5)
    assert m.oldest_write_age() == 3.5
    t.complete(t.held[0], Outcome.DONE)
    m.poll()
    assert m.oldest_write_age() == 1.5


def test_snapshot_shows_each_rooms_slot_and_pending_deadline():
    rig = make_rig(park_timeout=10.0, announce_timeout=7.0)
    m, t, clock = rig.manager, rig.transport, rig.clock
    t.inject("hold")
    m.register_receiver(rig.frame(1, "a", 2))  # announced at 0: due at 7, then its sender came
    start(rig, 1)  # transferring: no deadline, its chunk is with the transport
    clock.advance(1.0)
    m.register_receiver(rig.frame(2, "b", 2, n=2))
    start(rig, 2)  # parked at 1: due at 11
    clock.advance(1.0)
    m.register_receiver(rig.frame(3, "c", 2))  # announced at 2: due at 9
    assert m.snapshot() == {
        1: {"state": "transferring", "receivers": ["a"], "n": 1, "slot": None, "deadline": None},
        2: {"state": "parked", "receivers": ["b"], "n": 2, "slot": slot_of(rig, 2).index, "deadline": 11.0},
        3: {"state": "announced", "receivers": ["c"], "n": 1, "slot": None, "deadline": 9.0},
    }
