"""Peers on the loopback transport with a fake clock: first contact off the loop, rooms
waiting for a contacted peer, a dead peer failing its rooms at once, backoff and recovery."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import Calls, ManagerRig, TableTower, drive, make_rig, managed, reason_kind, reason_text

from epd_ring.executor import (
    EncodeExecutor,
    EncodeItem,
    EncodeManager,
    FakeClock,
    LoopbackTransport,
    Outcome,
    ReceiverFrame,
)
from epd_ring.executor.core.peers import Peer, PeerTable
from epd_ring.executor.core.reasons import ReasonKind
from epd_ring.executor.core.ring import Ring
from epd_ring.executor.core.shares import Shares
from epd_ring.executor.core.timers import Deadlines
from epd_ring.executor.core.transport import Transport
from epd_ring.fsm import InvalidTransition


def room_for(rig, room, session, n_tokens=3):
    """Register the encode request and the receiver's frame; return (request id, item)."""
    rid = f"req-{room}"
    rig.executor.register(rid, "prefill", 1, room)
    rig.manager.register_receiver(rig.frame(room, session, n_tokens))
    return rid, rig.item(n_tokens, room)


def run(rig, *rooms):
    rig.executor.execute(list(rooms))
    rig.executor.poll()


# The per-peer bound counts arena bytes: a rig whose arena holds exactly `n` of room_for's
# three-token items, so "half the ring" is half of those items.
ITEM_COST = Ring.extent_cost(3 * 8 * 4)


def items_rig(n: int, **kw):
    return make_rig(arena_bytes=n * ITEM_COST, **kw)


def test_unknown_session_is_contacted_once_and_written_when_up():
    rig = make_rig()
    a = room_for(rig, 1, "a")
    b = room_for(rig, 2, "a")
    assert rig.transport.contacts == 1  # the second frame finds the peer up
    assert rig.manager.peers.get("a").state == "up"
    run(rig, a, b)
    assert rig.manager.room_status(1) == rig.manager.room_status(2) == "success"
    assert rig.delivered_ok(1, "a", a[1])


def test_hung_contact_holds_only_its_rooms_and_fails_them_at_the_connect_deadline():
    rig = make_rig(extents=8, connect_timeout=2.0)
    rig.receiver("hung")
    rig.transport.inject_contact("hang", session="hung")
    stuck = room_for(rig, 1, "hung")
    assert rig.manager.peers.get("hung").state == "connecting"
    fine = [room_for(rig, 10 + k, "ok") for k in range(5)]
    run(rig, stuck, *fine)
    rig.executor.poll()  # "ok" may hold half the ring: its fifth room waited a tick for the first writes
    assert all(rig.manager.room_status(10 + k) == "success" for k in range(5))
    # The stuck room's chunk waits in its staged extent; nothing was written to the peer.
    assert rig.manager.room_status(1) == "transferring"
    assert rig.executor.ring.counts()["staged"] == 1
    rig.clock.advance(1.9)
    rig.executor.poll()
    assert rig.manager.room_status(1) == "transferring"
    rig.clock.advance(0.2)
    rig.executor.poll()
    assert rig.manager.room_status(1) == "failed"
    reason = rig.manager.failure_reason(1)
    assert "peer hung is down" in reason and "connect deadline" in reason
    assert rig.receiver("hung").statuses(1) == ["failed"]
    assert rig.manager.peers.get("hung").state == "down"
    assert rig.executor.ring.live == 0
    # The answer that finally comes is stale: it cannot revive the peer.
    rig.transport.answer("hung", ok=True)
    rig.executor.poll()
    assert rig.manager.peers.get("hung").state == "down"
    assert rig.manager.peers.stats["reports_stale"] == 1


def test_no_write_is_submitted_to_a_peer_that_is_not_up():
    rig = make_rig(connect_timeout=5.0)
    rig.receiver("slow")
    rig.transport.inject_contact("slow", session="slow", delay=1.0)
    sent = []
    orig = rig.transport.submit_write

    def spy(session, bufs):
        sent.append((session, rig.manager.peers.get(session).state))
        return orig(session, bufs)

    rig.transport.submit_write = spy
    r = room_for(rig, 1, "slow")
    run(rig, r)
    assert sent == [] and rig.manager.room_status(1) == "transferring"
    rig.clock.advance(1.0)
    rig.executor.poll()  # the contact answers; the waiting room starts its write
    rig.executor.poll()
    assert sent == [("slow", "up")]
    assert rig.manager.room_status(1) == "success" and rig.delivered_ok(1, "slow", r[1])


def test_refused_contact_fails_the_room_at_once_and_backoff_gates_the_retry():
    rig = make_rig(peer_backoff=3.0)
    rig.receiver("x")
    rig.transport.inject_contact("refuse", session="x")
    room_for(rig, 1, "x")
    assert rig.manager.room_status(1) == "failed"
    assert "peer x is down" in rig.manager.failure_reason(1)
    assert rig.receiver("x").statuses(1) == ["failed"]
    # A frame during the backoff fails its room without a new contact.
    contacts = rig.transport.contacts
    room_for(rig, 2, "x")
    assert rig.manager.room_status(2) == "failed" and rig.transport.contacts == contacts
    # After the backoff a new frame contacts the peer again; this time it answers.
    rig.clock.advance(3.0)
    r = room_for(rig, 3, "x")
    assert rig.transport.contacts == contacts + 1
    assert rig.manager.peers.get("x").state == "up"
    run(rig, r)
    assert rig.manager.room_status(3) == "success"


def test_consecutive_write_failures_make_the_peer_suspect_then_down_and_fail_its_queued_rooms():
    rig = items_rig(8, peer_fail_threshold=3, write_timeout=30.0)
    rcv = rig.receiver("b")
    rooms = [room_for(rig, k, "b") for k in range(20)]
    others = [room_for(rig, 100 + k, "a") for k in range(4)]
    rcv.kill()
    run(rig, *rooms[:8])  # b may hold half the arena's 8 items: the rest wait
    # Three failed writes: suspect, the re-check is refused (dead), down: every room fails now.
    assert rig.manager.peers.get("b").state == "down"
    assert all(rig.manager.room_status(k) == "failed" for k in range(20))
    # The re-check is answered after the tick's batch of write reports, so a room whose write was in
    # flight may fail on its own write first; every room still waiting fails because the peer is down.
    assert all(reason_kind(rig.manager, k) in (ReasonKind.WRITE_FAILED, ReasonKind.PEER_DOWN) for k in range(8))
    assert all(reason_kind(rig.manager, k) is ReasonKind.PEER_DOWN for k in range(8, 20))
    assert rig.clock.now() == 0.0  # no room waited for a timeout
    run(rig, *rooms[8:], *others)
    rig.clock.advance(5.0)  # the extents of the 8 failed writes serve their quarantine
    rig.executor.poll()
    rig.executor.poll()
    assert all(rig.manager.room_status(100 + k) == "success" for k in range(4))
    assert rig.transport.submitted == 4 + 4  # no write to b after it went down


def test_a_write_success_resets_the_count_and_a_suspect_peer_recovers_through_contact():
    rig = make_rig(peer_fail_threshold=2)
    rig.receiver("b")
    rig.transport.inject("fail", session="b")
    run(rig, room_for(rig, 1, "b"))
    peer = rig.manager.peers.get("b")
    assert peer.state == "up" and peer.fails == 1
    run(rig, room_for(rig, 2, "b"))
    assert peer.fails == 0
    rig.transport.inject("fail", session="b", count=2)
    rig.transport.inject_contact("hang", session="b")
    run(rig, room_for(rig, 3, "b"), room_for(rig, 4, "b"))
    assert peer.state == "suspect"
    waiting = room_for(rig, 5, "b")
    run(rig, waiting)
    assert rig.manager.room_status(5) == "transferring"  # waits for the re-check
    rig.transport.answer("b", ok=True)
    rig.executor.poll()
    rig.executor.poll()
    assert peer.state == "up" and rig.manager.room_status(5) == "success"


def test_peer_table_is_bounded_and_forgets_idle_peers_first():
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    for s in ("p0", "p1", "p2"):
        transport.add_receiver(s)
    m = drive(EncodeManager(transport, clock, max_peers=2))
    assert m.peers.contact("p0").state == "up"
    assert m.peers.contact("p1").state == "up"
    m.peers.get("p1").rooms.add(7)
    assert m.peers.contact("p2").state == "up"
    assert m.peers.get("p0") is None and len(m.peers.by_session) == 2
    m.peers.get("p2").rooms.add(8)
    assert m.peers.contact("p3") is None  # nothing idle to forget


def test_peer_settings_are_checked():
    with pytest.raises(ValueError, match="connect_timeout"):
        EncodeManager(LoopbackTransport(), connect_timeout=0)
    with pytest.raises(ValueError, match="fail_threshold"):
        EncodeManager(LoopbackTransport(), peer_fail_threshold=0)
    with pytest.raises(ValueError, match="peer_backoff"):
        EncodeManager(LoopbackTransport(), peer_backoff=float("nan"))
    with pytest.raises(ValueError, match="connect_timeout"):
        EncodeManager(LoopbackTransport(), connect_timeout=float("inf"))


def test_the_first_overdue_write_makes_the_peer_suspect_and_its_late_report_counts_no_more():
    rig = make_rig(peer_fail_threshold=3, write_timeout=1.0)
    rig.receiver("b")
    rig.transport.inject("hold", session="b")
    rig.transport.inject_contact("hang", session="b", count=1)
    rig.receiver("b")
    r1 = room_for(rig, 1, "b")  # first contact hangs: answered by hand below
    rig.transport.answer("b", ok=True)
    rig.executor.poll()
    peer = rig.manager.peers.get("b")
    assert peer.state == "up"
    run(rig, r1)
    contacts = rig.transport.contacts
    rig.transport.inject_contact("hang", session="b")
    rig.clock.advance(1.0)
    rig.executor.poll()
    # One overdue write, far below the threshold of reported failures: suspect at once, re-checked.
    assert rig.manager.room_status(1) == "failed" and reason_kind(rig.manager, 1) is ReasonKind.WRITE_DEADLINE
    assert peer.state == "suspect" and peer.fails == 1 and rig.transport.contacts == contacts + 1
    # A room for the suspect peer gets no write until the re-check answers.
    submitted = rig.transport.submitted
    run(rig, room_for(rig, 2, "b"))
    assert rig.manager.room_status(2) == "transferring" and rig.transport.submitted == submitted
    rig.transport.complete(rig.transport.held[0], Outcome.TIMED_OUT)
    rig.executor.poll()
    assert peer.fails == 1 and peer.state == "suspect"  # counted at its deadline, not again
    rig.transport.answer("b", ok=True)
    rig.executor.poll()
    rig.executor.poll()
    assert peer.state == "up" and rig.manager.room_status(2) == "success"


def test_health_reports_lag_oldest_write_peers_extents_and_dump_shows_peers():
    rig = make_rig(extents=4, connect_timeout=2.0)
    assert rig.executor.health()["loop_lag_s"] is None  # never polled
    rig.receiver("hung")
    rig.transport.inject_contact("hang", session="hung")
    room_for(rig, 1, "hung")
    rig.transport.inject("hold", session="a")
    run(rig, room_for(rig, 2, "a"))
    rig.clock.advance(1.5)
    h = rig.executor.health()
    assert h["loop_lag_s"] == 1.5 and h["oldest_write_age_s"] == 1.5 and h["writes_in_flight"] == 1
    assert h["peers"] == {"unknown": 0, "connecting": 1, "up": 1, "suspect": 0, "down": 0}
    assert h["extents"]["sending"] == 1 and h["quarantined"] == 0 and h["deferred"] == 0
    rig.executor.poll()
    assert rig.executor.health()["loop_lag_s"] == 0.0
    text = rig.executor.dump_state()
    assert "peer hung: connecting rooms=1" in text and "peer a: up rooms=1" in text
    rig.clock.advance(1.0)
    rig.executor.poll()
    assert "peer hung: down rooms=0 (no answer to contact within the connect deadline of 2.0 s)" \
        in rig.executor.dump_state()
    assert 'label="peer hung\\ndown"' in rig.executor.dump_state("dot")


# -- first contact, and rooms that wait for it -------------------------------------------------

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
    assert reason_text(m, 1) == reason
    assert rig.told("a", 1) == [("failed", reason), ("released", "")]


def test_frames_to_unreachable_or_too_many_peers_fail_their_room():
    b = ManagerRig(max_peers=1)
    m = b.m
    assert m.register_receiver(b.frame(1, "p1", n=2))
    assert m.register_receiver(b.frame(1, "p2", n=2)) is False  # p1 still has a live room
    assert reason_kind(m, 1) is ReasonKind.CAPACITY
    assert b.notices("p2") == [(1, "failed", "too many peers to add p2"), (1, "released", "")]

    b = ManagerRig()
    m = b.m
    b.t.inject_contact("refuse", session="dead")
    # Refused at first contact: the frame is taken, and the refusal, answered in the flush after it,
    # fails the room.
    assert m.register_receiver(b.frame(2, "dead"))
    assert m.room_status(2) == "failed"
    reason = reason_text(m, 2)
    assert reason is not None and reason.startswith("peer dead is down: ")
    assert b.notices("dead") == [(2, "failed", reason), (2, "released", "")]
    assert m.register_receiver(b.frame(3, "dead")) is False  # down and backing off: fails at once
    assert reason_text(m, 3) == reason


def test_a_down_peer_is_contacted_again_once_its_backoff_is_over():
    b = ManagerRig(peer_backoff=5.0)
    m = b.m
    b.t.inject_contact("refuse", session="p1")  # the first contact only
    assert m.register_receiver(b.frame(1, "p1"))  # taken; the refusal answered in the flush fails it
    assert m.room_status(1) == "failed"
    reason = reason_text(m, 1)
    b.clock.advance(1.0)
    assert m.register_receiver(b.frame(2, "p1")) is False  # still backing off: no new contact
    assert reason_text(m, 2) == reason and b.t.contacts == 1
    b.clock.advance(4.0)
    assert m.register_receiver(b.frame(3, "p1"))  # contacted again, and it answers now
    assert m.room_status(3) == "announced" and b.t.contacts == 2


def test_chunks_wait_for_a_peer_in_contact_and_observers_see_their_writes():
    rig = make_rig(write_timeout=30.0)
    m, t, clock = rig.manager, rig.transport, rig.clock
    rec = m.observer = Calls("writes_started", "write_reported")
    t.inject_contact("hang", session="slow")
    for room in (1, 2):
        m.register_receiver(rig.frame(room, "slow", 2))
        rig.send(room)
    assert m.room_status(1) == m.room_status(2) == "transferring"
    assert m.stats["waits_for_peer"] == 2 and t.submitted == 0 and rec.calls == []
    clock.advance(2.0)
    assert t.answer("slow", ok=True)
    m.poll()  # the peer is up: both rooms submit their writes now, at t=2
    assert rec.calls == [("writes_started", 1), ("writes_started", 2)] and t.submitted == 2
    clock.advance(1.5)
    m.poll()
    assert rec.calls[2:] == [("write_reported", 1, Outcome.DONE, 2.0), ("write_reported", 2, Outcome.DONE, 2.0)]
    assert m.room_status(1) == m.room_status(2) == "success"


def test_a_parked_room_does_not_write_when_its_peer_comes_up():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    t.inject_contact("hang", session="p")
    m.register_receiver(rig.frame(1, "p", 2, n=2, rank=0, shard=True))
    rig.send(1)
    assert m.room_status(1) == "parked"
    assert t.answer("p", ok=True)
    m.poll()
    assert m.peers.get("p").state == "up"
    assert m.room_status(1) == "parked" and t.submitted == 0  # it still waits for its second receiver
    m.register_receiver(rig.frame(1, "q", 2, n=2, rank=1, shard=True))
    m.poll()
    assert m.room_status(1) == "success"
    assert rig.delivered_ok(1, "p", rig.item(2, 1)) and rig.delivered_ok(1, "q", rig.item(2, 1))


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
    ex = drive(EncodeExecutor(EncodeManager(t, clock), TableTower(), "cpu", ring_slots=1, ring_bytes=4096))
    manager = ex.manager
    ex.register("r1", "h", 1, 1)
    dst = torch.zeros(2, 8)
    manager.register_receiver(ReceiverFrame(room=1, session="a:1", dst_ptr=dst.data_ptr(), dst_deep_ptr=0,
                                            n_tokens=2, row_start=0, span=2, hidden=8, dtype="torch.float32",
                                            has_deepstack=False, n_receivers=1))
    ex.execute([("r1", EncodeItem(modality="image", n_tokens=2, meta={"seed": 3}))])
    ex.poll()
    assert [s for s, _ in t.writes] == ["a:1"]  # written without waiting for any contact report
    assert manager.room_status(1) == "success" and (1, "success", "") in t.told


# -- the peer table ----------------------------------------------------------------------------

def table(**kw):
    clock, t, manager = managed(**kw)
    return clock, t, manager.peers


def test_a_fresh_peer_is_idle():
    _, _, peers = table()
    peer = Peer("z", peers)
    # timer, due and retry_at are read only once armed or down; a fresh peer has no deadline
    assert (peer.state, peer.fails, peer.attempt, peer.reason) == ("unknown", 0, 0, "")
    assert not peer.timer and peer.rooms == set()
    assert not peer.waiting and not peer.held and peer.identity == ""  # no contact awaited, nobody's share


def test_idle_peers_forgotten_to_stay_bounded_are_counted():
    _, t, peers = table(max_peers=2)
    for s in ("p0", "p1", "p2", "p3"):
        t.add_receiver(s)
        assert peers.contact(s).state == "up"
    assert list(peers.by_session) == ["p2", "p3"]
    assert dict(peers.stats) == {"contacts": 4, "connected": 4, "peers_forgotten": 2}


def test_a_full_table_of_busy_peers_refuses_new_ones_and_counts_each():
    _, t, peers = table(max_peers=1)
    t.inject_contact("hang", session="p0")  # a peer being contacted is never forgotten
    assert peers.contact("p0").state == "connecting"
    assert peers.contact("p1") is None and peers.contact("p2") is None
    assert list(peers.by_session) == ["p0"]
    assert dict(peers.stats) == {"contacts": 1, "peers_refused": 2}


def test_each_refused_contact_puts_the_peer_down_once():
    clock, t, peers = table(peer_backoff=1.0)
    t.add_receiver("x")
    t.inject_contact("refuse", session="x", count=2)
    peer = peers.contact("x")
    assert peer.state == "down" and peer.reason == "contact failed (refused)"
    assert peers.snapshot() == {"x": {"state": "down", "fails": 0, "rooms": 0, "reason": "contact failed (refused)",
                                      "held": 0}}
    clock.advance(1.0)
    assert peers.contact("x").state == "down"
    clock.advance(1.0)
    assert peers.contact("x").state == "up"
    assert dict(peers.stats) == {"contacts": 3, "down": 2, "connected": 1}


def test_a_transport_that_raises_on_contact_counts_as_a_refusal():
    _, t, peers = table()

    def connect(session, attempt):
        raise RuntimeError("boom")

    t.connect = connect
    peer = peers.contact("x")
    assert peer.state == "down" and peer.reason == "contact failed (RuntimeError: boom)"
    assert peers.snapshot()["x"]["fails"] == 0
    assert dict(peers.stats) == {"contacts": 1, "down": 1}


def test_a_refusal_reported_without_detail_reads_refused():
    _, t, peers = table()
    t.inject_contact("hang", session="y")
    peer = peers.contact("y")
    peers.report("y", 1, False)
    assert peer.state == "down" and peer.reason == "contact failed (refused)"


def test_the_manager_counts_every_contact_answer_it_takes():
    _, t, m = managed()
    for s in ("x", "y"):
        t.inject_contact("hang", session=s)
        m.peers.contact(s)
    assert m.contacts_reported([("x", 1, True, ""), ("y", 1, False, "refused")]) == 2
    assert m.peers.get("x").state == "up" and m.peers.get("y").state == "down"


def test_one_contact_at_a_time_each_attempt_numbered_and_one_deadline_armed():
    clock, t, m = managed(connect_timeout=2.0, peer_backoff=1.0)
    peers = m.peers
    t.add_receiver("x")
    t.inject_contact("hang", session="x")
    peer = peers.contact("x")
    assert peer.state == "connecting" and t.hung == {"x": 1} and len(peers.deadlines) == 1
    assert peers.snapshot() == {"x": {"state": "connecting", "fails": 0, "rooms": 0, "reason": "", "held": 0}}
    assert peers.contact("x") is peer  # a second frame while contacting starts nothing new
    assert t.contacts == 1 and t.hung == {"x": 1} and len(peers.deadlines) == 1
    clock.advance(2.0)
    m.poll()
    assert peer.state == "down" and len(peers.deadlines) == 0
    assert peer.reason == "no answer to contact within the connect deadline of 2.0 s"
    t.answer("x", ok=True)  # answers attempt 1, whose deadline passed: stale
    m.poll()
    assert peer.state == "down"
    clock.advance(1.0)
    t.inject_contact("hang", session="x")
    assert peers.contact("x").state == "connecting" and t.hung == {"x": 2}
    peers.report("x", 1, True)  # the old attempt again, now while attempt 2 is in flight: stale
    peers.report("nobody", 1, True)  # a session the table does not know: stale
    assert peer.state == "connecting" and len(peers.deadlines) == 1
    t.answer("x")
    m.poll()
    assert peer.state == "up" and peer.reason == "" and len(peers.deadlines) == 0
    assert dict(peers.stats) == {"contacts": 2, "down": 1, "reports_stale": 3, "connected": 1}


# -- write reports and the peer ----------------------------------------------------------------

def test_threshold_failures_make_an_up_peer_suspect_and_recheck_it_each_time():
    _, t, peers = table(peer_fail_threshold=2)
    t.add_receiver("b")
    peer = peers.contact("b")
    for _ in range(2):
        peers.write_failed(peer)
        assert peer.state == "up" and peer.fails == 1
        peers.write_failed(peer)  # at the threshold: suspect, re-checked, answers at once
        assert peer.state == "up" and peer.fails == 0
    assert dict(peers.stats) == {"contacts": 3, "connected": 3, "suspect": 2}


def test_write_reports_never_move_a_peer_that_is_not_up():
    _, t, peers = table(peer_fail_threshold=1)
    t.add_receiver("b")
    peer = peers.contact("b")
    t.inject_contact("hang", session="b")
    peers.write_failed(peer)
    assert peer.state == "suspect" and peer.fails == 1
    peers.write_ok(peer)  # a write that lands does not replace the re-check
    assert peer.state == "suspect" and peer.fails == 0
    peers.write_failed(peer)
    assert peer.state == "suspect" and peer.fails == 1
    peers.expired(peer)
    assert peer.state == "down"
    peers.write_ok(peer)
    assert peer.state == "down" and peer.fails == 0
    peers.write_failed(peer)
    assert peer.state == "down" and peer.fails == 1
    assert dict(peers.stats) == {"contacts": 2, "connected": 1, "suspect": 1, "down": 1}


def test_a_write_report_for_a_peer_never_contacted_is_an_undeclared_transition():
    _, _, peers = table()
    with pytest.raises(InvalidTransition) as e:
        peers.write_ok(Peer("z", peers))
    assert (e.value.machine, e.value.state, e.value.event) == ("peer", "unknown", "write_ok")


@pytest.mark.parametrize("outcome", [Outcome.DONE, Outcome.FAILED])
def test_a_write_reported_while_its_peer_is_contacted_again_leaves_the_contact_to_decide(outcome):
    # Bug found here: the report of a write submitted before the peer went down, arriving while a
    # later frame's contact with it was in flight, raised InvalidTransition out of poll().
    rig = make_rig(extents=8, peer_fail_threshold=1, peer_backoff=1.0)
    rig.receiver("b")
    rig.transport.inject("hold", session="b")
    rig.transport.inject("fail", session="b")
    first, second = room_for(rig, 1, "b"), room_for(rig, 2, "b")
    rig.transport.inject_contact("refuse", session="b")  # the re-check after the failure
    rig.executor.execute([first, second])
    rig.executor.poll()
    peer = rig.manager.peers.get("b")
    assert peer.state == "down" and len(rig.transport.held) == 1
    rig.clock.advance(1.0)
    rig.transport.inject_contact("hang", session="b")
    third = room_for(rig, 3, "b")
    assert peer.state == "connecting"
    rig.transport.complete(rig.transport.held[0], outcome)
    rig.executor.poll()
    assert peer.state == "connecting"
    assert rig.manager.room_status(1) == rig.manager.room_status(2) == "failed"
    rig.transport.answer("b", ok=True)
    rig.executor.poll()
    assert peer.state == "up" and peer.fails == 0
    rig.executor.execute([third])
    rig.executor.poll()
    assert rig.manager.room_status(3) == "success" and rig.delivered_ok(3, "b", third[1])


# -- one stuck receiver cannot take the ring (issue 22) ------------------------------------------

def stuck(rig, session):
    """From now on `session`'s writes never report and contacts with it never answer (a partition)."""
    rig.transport.inject("hold", session=session, count=1 << 30)
    rig.transport.inject_contact("hang", session=session, count=1 << 30)


def extents_of(rig, rooms):
    """Extents not free whose bytes belong to one of `rooms`."""
    return sum(1 for s in rig.executor.ring.extents.values() if s.state != "free" and s.room in rooms)


def test_a_partitioned_peer_never_fills_the_ring_and_the_healthy_peers_rooms_keep_succeeding():
    rig = items_rig(8, write_timeout=2.0, connect_timeout=1.0, peer_backoff=1.0, quarantine_s=1.0)
    rig.receiver("b")
    rig.receiver("c")
    run(rig, room_for(rig, 0, "b"))  # b answers at first
    assert rig.manager.room_status(0) == "success"
    stuck(rig, "b")
    b_rooms, c_rooms = set(), set()
    for step in range(1, 60):  # 15 s of the cut, a room to each receiver every 0.25 s
        b, c = 2 * step, 2 * step + 1
        b_rooms.add(b)
        c_rooms.add(c)
        rig.executor.register(f"req-{b}", "prefill", 1, b)
        rig.manager.register_receiver(rig.frame(b, "b", 3))
        run(rig, (f"req-{b}", rig.item(3, b)), room_for(rig, c, "c"))
        rig.executor.poll()
        assert extents_of(rig, b_rooms) <= 8 // 2  # b holds at most its half
        rig.clock.advance(0.25)
    for _ in range(16):  # the last of b's rooms meet their deadlines too
        rig.clock.advance(0.25)
        rig.executor.poll()
    assert all(rig.manager.room_status(c) == "success" for c in c_rooms)
    assert all(rig.delivered_ok(c, "c", rig.item(3, c)) for c in sorted(c_rooms)[-3:])
    # b's rooms fail on the encoder's own deadlines and peer checks; none of its writes ever reported.
    assert all(rig.manager.room_status(b) == "failed" for b in b_rooms)
    kinds = {reason_kind(rig.manager, b) for b in b_rooms}
    assert kinds <= {ReasonKind.WRITE_DEADLINE, ReasonKind.PEER_DOWN, ReasonKind.CAPACITY}
    assert ReasonKind.WRITE_DEADLINE in kinds and ReasonKind.PEER_DOWN in kinds
    assert rig.transport.held and all(rig.transport.session_of(h) == "b" for h in rig.transport.held)
    assert len(rig.transport.held) <= 8 // 2


def test_the_first_overdue_write_stops_new_writes_to_the_peer():
    rig = make_rig(extents=8, write_timeout=1.0, connect_timeout=5.0)
    rig.receiver("b")
    run(rig, room_for(rig, 0, "b"))
    stuck(rig, "b")
    run(rig, room_for(rig, 1, "b"))
    rig.clock.advance(1.0)
    rig.executor.poll()
    assert rig.manager.peers.get("b").state == "suspect"
    submitted = rig.transport.submitted
    for k in range(2, 6):
        run(rig, room_for(rig, k, "b"))
    assert rig.transport.submitted == submitted  # waits for the re-check, which hangs
    rig.clock.advance(5.0)
    rig.executor.poll()
    assert rig.manager.peers.get("b").state == "down"
    assert all(reason_kind(rig.manager, k) is ReasonKind.PEER_DOWN for k in range(2, 6))
    assert rig.transport.submitted == submitted


def test_a_stuck_peers_deferred_send_does_not_block_the_queue_head_for_the_others():
    rig = items_rig(4, write_timeout=30.0)
    for s in ("b", "c"):
        rig.receiver(s)
    rig.transport.inject("hold", session="b", count=1 << 30)
    run(rig, room_for(rig, 1, "b"), room_for(rig, 2, "b"))  # b holds its half: 2 of 4 extents
    assert extents_of(rig, {1, 2}) == 2
    rig.transport.inject("delay", session="c", delay=1.0, count=2)
    head = room_for(rig, 3, "b")
    rig.executor.execute([head, room_for(rig, 4, "c"), room_for(rig, 5, "c"), room_for(rig, 6, "c")])
    # b's send waits without an extent; c's took the two free items' bytes and the third waits.
    assert rig.executor.deferred_requests() == ["req-3", "req-6"]
    assert rig.executor.ring.live == 4  # the arena is full
    rig.clock.advance(1.0)
    rig.executor.poll()
    rig.executor.poll()
    assert [rig.manager.room_status(k) for k in (4, 5, 6)] == ["success"] * 3
    assert rig.executor.deferred_requests() == ["req-3"]  # still first in line, still waiting
    assert rig.manager.room_status(3) == "registered" or rig.manager.room_status(3) == "ready"
    # Room 3 waited on b's bound and room 6 on c's: the bound counts bytes, and c's two writes in
    # flight are its half of the arena too.
    assert rig.manager.stats["held_back"] == 2


def test_a_send_held_back_by_its_peers_bound_fails_after_the_write_timeout():
    """A peer that answers probes while its old writes stay stuck keeps its bound: the wait is bounded."""
    rig = items_rig(4, write_timeout=2.0, connect_timeout=5.0)
    rig.receiver("b")
    rig.transport.inject("hold", session="b", count=2)
    run(rig, room_for(rig, 1, "b"), room_for(rig, 2, "b"))
    rig.clock.advance(1.0)
    run(rig, room_for(rig, 3, "b"))
    assert rig.executor.deferred_requests() == ["req-3"]
    rig.clock.advance(1.0)
    rig.executor.poll()  # rooms 1 and 2 overdue: b suspect, re-checked, and it answers
    rig.executor.poll()
    assert rig.manager.peers.get("b").state == "up" and rig.manager.peers.get("b").held
    assert rig.manager.room_status(3) in ("registered", "ready")
    rig.clock.advance(1.0)
    rig.executor.poll()
    assert reason_kind(rig.manager, 3) is ReasonKind.CAPACITY
    assert rig.receiver("b").statuses(3) == ["failed"]
    assert not rig.executor.deferred_requests()
    # Once b's writes report its bytes are let go and its rooms take ring space again.
    for h in rig.transport.held:
        rig.transport.complete(h, Outcome.DONE)
    rig.executor.poll()
    assert rig.manager.peers.get("b").held == 0
    run(rig, room_for(rig, 4, "b"))
    assert rig.manager.room_status(4) == "success"


def test_a_chunk_parked_for_a_receiver_not_yet_registered_is_charged_to_no_peer():
    """Parked chunks wait on receivers that never registered, not on the registered one's peer."""
    rig = make_rig(extents=4, park_timeout=10.0)
    rig.receiver("a")
    for k in range(3):  # two receivers declared, only a registers: parked
        rig.executor.register(f"req-{k}", "prefill", 1, k)
        rig.manager.register_receiver(rig.frame(k, "a", 3, n=2, rank=0, shard=True))
        rig.executor.execute([(f"req-{k}", rig.item(3, k))])
    assert all(rig.manager.is_parked(k) for k in range(3)) and rig.manager.peers.get("a").held == 0
    run(rig, room_for(rig, 9, "a"))
    assert rig.manager.room_status(9) == "success"


# -- chunks parked for unregistered receivers hold a bounded share of the ring (issue 22) ----------

def unregistered(rig, room, *, n=1):
    """Register room's encode request and run its item; none of its `n` receivers registers."""
    rid = f"req-{room}"
    rig.executor.register(rid, "prefill", 1, room)
    rig.executor.execute([(rid, rig.item(3, room))])
    return rid


def test_a_stream_of_unregistered_rooms_takes_no_more_than_the_parked_share_and_registered_rooms_pass_them():
    rig = items_rig(8, park_timeout=30.0)
    rig.receiver("c")
    cap = rig.manager.max_parked_bytes
    assert cap == 4 * ITEM_COST  # half the ring by default
    waiting = []
    for k in range(12):  # a partitioned receiver's rooms: their frames never come
        waiting.append(unregistered(rig, k))
        rig.executor.poll()
        assert rig.manager.parked_bytes <= cap
    assert [k for k in range(12) if rig.manager.is_parked(k)] == [0, 1, 2, 3]
    assert rig.executor.deferred_requests() == waiting[4:]  # in their order, waiting without ring space
    assert rig.executor.ring.live == 4
    # A registered room's item is served while they wait, and again and again as its extents free.
    for k in range(100, 108):
        run(rig, room_for(rig, k, "c"))
        assert rig.manager.room_status(k) == "success" and rig.delivered_ok(k, "c", rig.item(3, k))
    assert rig.executor.deferred_requests() == waiting[4:]  # they kept their place
    assert rig.manager.stats["parked_held_back"] == 8


def test_a_waiting_unregistered_item_is_served_once_its_receivers_register():
    rig = items_rig(8, park_timeout=30.0)
    for k in range(6):
        unregistered(rig, k)
    assert rig.executor.deferred_requests() == ["req-4", "req-5"]
    rig.clock.advance(5.0)
    rig.manager.register_receiver(rig.frame(5, "c", 3))  # room 5's one receiver: it parks no more
    rig.executor.poll()
    rig.executor.poll()
    assert rig.manager.room_status(5) == "success" and rig.delivered_ok(5, "c", rig.item(3, 5))
    assert rig.executor.deferred_requests() == ["req-4"]
    # A parked room's receiver registers: its writes start (their bytes are its peer's now, however long
    # they take), and the parked bytes it held let room 4 park.
    rig.receiver("d")
    rig.transport.inject("hold", session="d")
    rig.manager.register_receiver(rig.frame(0, "d", 3))
    rig.executor.poll()
    assert rig.manager.room_status(0) == "transferring" and rig.manager.is_parked(4)
    assert not rig.executor.deferred_requests() and rig.manager.parked_bytes == 4 * ITEM_COST
    assert rig.manager.peers.get("d").held == ITEM_COST


def test_an_unregistered_item_that_waits_past_the_park_timeout_fails_as_a_parked_one_would():
    """The wait is bounded: a large item that the parked bound keeps out (small parked chunks take each
    bit of room that frees) fails with the parked room's own deadline kind."""
    rig = items_rig(8, park_timeout=10.0)
    for k in range(4):
        unregistered(rig, k)
    rig.executor.register("req-big", "prefill", 1, 50)
    rig.executor.execute([("req-big", rig.item(9, 50))])  # costs more than one small chunk
    assert rig.executor.deferred_requests() == ["req-big"]
    rig.clock.advance(1.0)
    for k in range(3):  # one parked room at a time registers; a new small one parks in its place
        rig.manager.register_receiver(rig.frame(k, "c", 3))
        unregistered(rig, 10 + k)
        rig.executor.poll()
        assert rig.manager.room_status(k) == "success" and rig.manager.is_parked(10 + k)
    assert rig.executor.deferred_requests() == ["req-big"]
    rig.clock.advance(9.0)
    rig.executor.poll()  # t=10: room 3's park deadline, and room 50 has waited as long
    assert reason_kind(rig.manager, 3) is ReasonKind.PARK_TIMEOUT
    assert reason_kind(rig.manager, 50) is ReasonKind.PARK_TIMEOUT
    assert not rig.executor.deferred_requests()
    assert all(rig.manager.is_parked(10 + k) for k in range(3)) and rig.manager.parked_bytes == 3 * ITEM_COST


def test_the_parked_bound_passes_one_chunk_to_a_ring_holding_nothing_parked_and_one_means_no_bound():
    # A bound smaller than one chunk still lets one park at a time.
    rig = items_rig(8, max_parked_bytes=1)
    for k in range(3):
        unregistered(rig, k)
    assert rig.manager.is_parked(0) and rig.executor.deferred_requests() == ["req-1", "req-2"]
    free = make_rig(arena_bytes=8 * ITEM_COST, parked_ring_share=1.0)
    assert free.manager.max_parked_bytes is None
    for k in range(8):
        unregistered(free, k)
    assert all(free.manager.is_parked(k) for k in range(8)) and free.executor.ring.live == 8


def test_a_partly_registered_rooms_receiver_still_counts_against_its_peers_share():
    """The parked bound adds to the per-peer one: a room with some receivers here is held by both."""
    rig = items_rig(8, park_timeout=30.0, write_timeout=30.0)
    rig.receiver("b")
    rig.transport.inject("hold", session="b", count=1 << 30)
    run(rig, *(room_for(rig, k, "b") for k in range(4)))  # b holds its half
    assert rig.manager.peers.get("b").held == 4 * ITEM_COST
    rig.executor.register("req-9", "prefill", 1, 9)
    rig.manager.register_receiver(rig.frame(9, "b", 3, n=2, rank=0, shard=True))  # one of two
    run(rig, ("req-9", rig.item(3, 9)))
    assert rig.executor.deferred_requests() == ["req-9"] and rig.manager.stats["held_back"] == 1
    assert rig.manager.stats["parked_held_back"] == 0


def test_ring_share_is_checked_and_one_means_no_bound():
    clock = FakeClock()
    t = LoopbackTransport(clock)
    with pytest.raises(ValueError, match="peer_ring_share"):
        EncodeExecutor(EncodeManager(t, clock), TableTower(), "cpu", arena_bytes=4096, peer_ring_share=0)
    m = EncodeManager(t, clock)
    # an arena of exactly four two-token items
    ex = drive(EncodeExecutor(m, TableTower(), "cpu", arena_bytes=4 * Ring.extent_cost(2 * 8 * 4), peer_ring_share=1.0))
    assert m.peers.max_bytes is None
    t.add_receiver("b")
    t.inject("hold", session="b", count=4)
    bufs = []
    for k in range(4):
        ex.register(f"r{k}", "prefill", 1, k)
        buf = torch.zeros(2, 8)
        bufs.append(buf)
        t.receivers["b"].register(buf)
        ex.manager.register_receiver(ReceiverFrame(room=k, session="b", dst_ptr=buf.data_ptr(), dst_deep_ptr=0,
                                                   n_tokens=2, row_start=0, span=2, hidden=8,
                                                   dtype="torch.float32", has_deepstack=False, n_receivers=1))
    ex.execute([(f"r{k}", EncodeItem(modality="image", n_tokens=2, meta={"seed": k})) for k in range(4)])
    assert ex.ring.live == 4 and not ex.deferred_requests()  # one receiver may take the whole ring


# -- the heartbeat (issue 22) ---------------------------------------------------------------------

def test_a_wedged_peer_with_work_pending_goes_down_within_twice_the_connect_deadline():
    rig = make_rig(write_timeout=60.0, connect_timeout=1.0)
    rig.receiver("w")
    run(rig, room_for(rig, 0, "w"))
    wedged_at = rig.clock.now()
    stuck(rig, "w")  # alive to TCP, answers nothing: its writes would hang for a minute
    run(rig, room_for(rig, 1, "w"))
    peer = rig.manager.peers.get("w")
    while peer.state == "up":
        rig.clock.advance(0.125)
        rig.executor.poll()
        assert rig.clock.now() - wedged_at <= 2 * 1.0
    assert peer.state == "down" and reason_kind(rig.manager, 1) is ReasonKind.PEER_DOWN
    assert "probe" in rig.manager.failure_reason(1)
    assert rig.manager.peers.stats["probes"] >= 1


def test_a_write_overdue_while_the_probe_is_under_way_leaves_the_heartbeats_bound():
    """The probe under way is the suspect's re-check: a second contact would push the connect deadline back."""
    rig = make_rig(write_timeout=1.5, connect_timeout=1.0)  # the write goes overdue while the probe waits
    rig.receiver("w")
    run(rig, room_for(rig, 0, "w"))
    wedged_at = rig.clock.now()
    stuck(rig, "w")
    run(rig, room_for(rig, 1, "w"))
    peer = rig.manager.peers.get("w")
    while peer.state != "down":
        rig.clock.advance(0.125)
        rig.executor.poll()
        assert rig.clock.now() - wedged_at <= 2 * 1.0, f"still {peer.state}"
    assert rig.manager.peers.stats["suspect"] == 1 and rig.manager.peers.stats["probes"] == 1


def test_busy_peers_are_probed_and_stay_up_idle_peers_are_not_probed():
    rig = make_rig(write_timeout=60.0, connect_timeout=1.0)
    rig.receiver("busy")
    rig.receiver("idle")
    run(rig, room_for(rig, 0, "idle"))
    assert rig.manager.room_status(0) == "success"
    rig.transport.inject("hold", session="busy")
    run(rig, room_for(rig, 1, "busy"))
    contacts = rig.transport.contacts
    for _ in range(40):  # 5 s
        rig.clock.advance(0.125)
        rig.executor.poll()
    assert rig.manager.peers.get("busy").state == "up"
    assert rig.transport.contacts - contacts == rig.manager.peers.stats["probes"] >= 4
    # the heartbeat asks the edge only whether the peer answers; first contacts were full ones
    assert rig.transport.probes == rig.manager.peers.stats["probes"]
    assert not rig.manager.peers.get("idle").beat.timer
    rig.transport.complete(rig.transport.held[0], Outcome.DONE)
    rig.executor.poll()
    assert rig.manager.room_status(1) == "success"
    # Its work is done: a probe still armed fires once, finds it idle and arms no other.
    probes, contacts = rig.manager.peers.stats["probes"], rig.transport.contacts
    rig.clock.advance(10.0)
    rig.executor.poll()
    assert rig.manager.peers.stats["probes"] == probes and rig.transport.contacts == contacts
    assert not rig.manager.peers.get("busy").beat.timer
    rig.clock.advance(10.0)
    rig.executor.poll()
    assert rig.manager.peers.stats["probes"] == probes


def test_a_slow_receiver_whose_writes_land_is_alive_though_its_probe_is_unanswered():
    """Over a slow link the heartbeat's answer can wait behind the receiver's own writes. Before, the
    probe's connect deadline took a working receiver down and failed its rooms; now a write that
    lands while the probe is under way answers it, and the next probe is armed as usual."""
    rig = make_rig(write_timeout=60.0, connect_timeout=1.0)
    rig.receiver("slow")
    run(rig, room_for(rig, 0, "slow"))
    assert rig.manager.room_status(0) == "success"
    rig.transport.inject_contact("hang", session="slow", count=1000)  # every probe goes unanswered
    rig.transport.inject("delay", session="slow", delay=0.5, count=40)  # each write lands in 0.5 s
    peer = rig.manager.peers.get("slow")
    for k in range(1, 41):  # 10 s of rooms, one every 0.25 s: ten connect deadlines
        run(rig, room_for(rig, k, "slow"))
        rig.clock.advance(0.25)
        rig.executor.poll()
        assert peer.state == "up", (k, peer.reason)
    rig.clock.advance(1.0)
    rig.executor.poll()
    assert all(rig.manager.room_status(k) == "success" for k in range(41))
    assert rig.manager.peers.stats["probes"] >= 5
    assert rig.manager.peers.stats["probes_answered_by_writes"] == rig.manager.peers.stats["probes"]
    # Its writes stop landing (wedged, this time): the unanswered probe takes it down as before.
    stuck(rig, "slow")
    run(rig, room_for(rig, 99, "slow"))
    wedged_at = rig.clock.now()
    while peer.state == "up":
        rig.clock.advance(0.125)
        rig.executor.poll()
        assert rig.clock.now() - wedged_at <= 2 * 1.0
    assert reason_kind(rig.manager, 99) is ReasonKind.PEER_DOWN


def test_a_refused_probe_takes_the_peer_down_and_fails_its_rooms():
    rig = make_rig(write_timeout=60.0, connect_timeout=1.0)
    rig.receiver("r")
    rig.transport.inject("hold", session="r")
    run(rig, room_for(rig, 1, "r"))
    rig.receiver("r").kill()
    rig.clock.advance(1.0)
    rig.executor.poll()
    assert rig.manager.peers.get("r").state == "down"
    assert reason_kind(rig.manager, 1) is ReasonKind.PEER_DOWN and "probe failed" in rig.manager.failure_reason(1)


def test_probe_interval_is_checked():
    with pytest.raises(ValueError, match="peer_probe_interval"):
        EncodeManager(LoopbackTransport(), peer_probe_interval=0)


# Survivors of the mutation pass (issue 32): a peer table on its own, driven through its reports
# and a FakeClock, so each rule shows without a manager around it.
def bare(**kw):
    """A bare peer table: its effects land in `outbox`, its time is the clock's, and the manager's
    actions on entering a state are recorded in `entered` as (action, session)."""
    clock, outbox, entered = FakeClock(), [], []
    actions = {a: (lambda p, a=a: entered.append((a, p.session))) for a in ("resume_rooms", "fail_rooms")}
    return clock, outbox, PeerTable(outbox, clock, Deadlines(), actions=actions, **kw), entered


def bring_up(peers, outbox, session, identity="", room=None, owner=None):
    """First contact with `session`, answered yes; with `room`, the peer has work pending."""
    peer = peers.contact(session, identity)
    if room is not None:
        peer.rooms.add(room)
    peers.report(session, outbox[-1].attempt, True, owner=owner)
    assert peer.state == "up"
    return peer


def test_a_bare_tables_max_bytes_bounds_what_a_peer_may_hold_and_one_byte_is_a_bound():
    _, outbox, peers, _ = bare(max_bytes=100)
    peer = bring_up(peers, outbox, "r")
    peers.hold(1, 60, ["r"])
    assert peers.over_bound(["r"], 40) is None
    assert peers.over_bound(["r"], 41) is peer
    _, outbox, peers, _ = bare(max_bytes=1)
    peer = bring_up(peers, outbox, "r")
    peers.hold(1, 1, ["r"])
    assert peers.over_bound(["r"], 1) is peer
    with pytest.raises(ValueError):
        bare(max_bytes=0)


def test_each_identity_has_256_peers_by_default_and_each_refusal_is_counted():
    _, _, peers, _ = bare()
    for k in range(256):  # each still waits for its contact: none is idle, none forgotten
        assert peers.contact(f"a:{k}", "a") is not None
    assert peers.contact("a:256", "a") is None and peers.contact("a:257", "a") is None
    assert peers.stats["peers_refused_identity"] == 2
    assert peers.contact("b:0", "b") is not None  # the share is a's alone
    assert managed()[2].peers.max_peers_per_identity == 256  # a manager's default is the same
    _, _, peers, _ = bare(max_peers_per_identity=1)
    assert peers.contact("a:0", "a") is not None and peers.contact("a:1", "a") is None
    with pytest.raises(ValueError):
        bare(max_peers_per_identity=0)


def test_a_contact_names_its_identity_and_each_proven_owner_is_recorded_and_counted():
    _, outbox, peers, _ = bare()  # no admission: nobody to call back, the table still records the owner
    for s in ("r0", "r1"):
        assert bring_up(peers, outbox, s, identity="k", owner="k").owner == "k"
    assert [(c.session, c.identity) for c in outbox] == [("r0", "k"), ("r1", "k")]
    assert peers.stats["owners_proven"] == 2


def test_beat_probes_each_busy_up_peer_whose_probe_is_due_and_returns_how_many():
    clock, outbox, peers, entered = bare(probe_interval=1.0)
    assert peers.beat(clock.now()) == 0
    for k, s in enumerate(("a", "b", "c")):
        bring_up(peers, outbox, s, room=k)
    assert len(peers.beats) == 3  # one probe armed for each
    peers.get("c").rooms.clear()  # its work ended: its armed probe finds it idle
    clock.advance(1.0)
    assert peers.beat(clock.now()) == 2
    assert [(c.session, c.probe) for c in outbox[3:]] == [("a", True), ("b", True)]
    assert peers.stats["probes"] == 2
    # a state's actions run on entering it, once: a probe of an up peer leaves it up
    assert entered == [("resume_rooms", "a"), ("resume_rooms", "b"), ("resume_rooms", "c")]


def test_a_room_held_twice_for_a_peer_gives_back_both_when_let_go():
    _, outbox, peers, _ = bare()
    peer = bring_up(peers, outbox, "r")
    peers.hold(1, 10, ["r"])
    peers.hold(1, 5, ["r"])
    assert (peer.held, peers.held_total) == (15, 15)
    peers.let_go(peer, 1)
    assert (peer.held, peers.held_total) == (0, 0)
    peers.let_go(peer, 1)  # nothing left for that room
    assert (peer.held, peers.held_total) == (0, 0)


def test_an_overdue_write_after_a_failed_one_counts_both_failures():
    _, outbox, peers, _ = bare(fail_threshold=3)
    peer = bring_up(peers, outbox, "r")
    peers.write_failed(peer)
    assert peer.state == "up"
    peers.write_overdue(peer)
    assert peer.state == "suspect" and peers.snapshot()["r"]["fails"] == 2


def test_a_peer_that_went_down_is_idle_and_may_be_forgotten_for_a_new_one():
    _, outbox, peers, _ = bare(max_peers=1)
    peers.contact("a")
    peers.report("a", outbox[-1].attempt, False, "refused")
    assert peers.get("a").state == "down"
    assert peers.contact("b") is not None and peers.get("a") is None
    assert peers.stats["peers_forgotten"] == 1


def test_a_late_refusal_of_a_probe_that_writes_answered_leaves_the_peer_up():
    clock, outbox, peers, _ = bare(probe_interval=1.0)
    peer = bring_up(peers, outbox, "r", room=1)
    clock.advance(1.0)
    assert peers.beat(clock.now()) == 1
    peers.write_ok(peer)  # a write landed: the probe is answered
    peers.report("r", outbox[-1].attempt, False, "refused")
    assert peer.state == "up" and peers.stats["reports_stale"] == 1


def test_a_peer_that_got_work_while_its_contact_ran_is_first_probed_an_interval_after_it_came_up():
    clock, outbox, peers, _ = bare(probe_interval=1.0)
    peer = peers.contact("r")
    peer.rooms.add(1)
    peers.schedule(peer)  # as a frame's room does: no probe is armed while the contact is awaited
    assert len(peers.beats) == 0 and not peer.beat.timer
    clock.advance(0.9)
    peers.report("r", outbox[-1].attempt, True)
    clock.advance(0.2)
    assert peers.beat(clock.now()) == 0
    clock.advance(0.8)
    assert peers.beat(clock.now()) == 1


def test_an_idle_up_peer_is_first_probed_an_interval_after_a_frame_brings_it_work():
    b = ManagerRig(connect_timeout=1.0)
    m = b.m
    b.t.add_receiver("r")
    m.peers.contact("r")
    m.poll()
    assert m.peers.get("r").state == "up" and len(m.peers.beats) == 0  # idle: nothing to probe
    b.clock.advance(0.5)
    assert m.register_receiver(b.frame(1, "r"))  # the room waits for its sender: work pending
    b.clock.advance(0.6)
    m.poll()
    assert m.peers.stats["probes"] == 0
    b.clock.advance(0.4)
    m.poll()
    assert m.peers.stats["probes"] == 1


def test_a_down_peer_with_work_pending_is_never_probed():
    _, outbox, peers, _ = bare()
    peer = peers.contact("r")
    peer.rooms.add(1)
    peers.report("r", outbox[-1].attempt, False, "refused")
    assert peers.probe_due(peer) == 0
    assert peer.state == "down" and len(outbox) == 1 and not peers.stats["probes"]


# -- a wait's start is its own: a room that passed its bound and waits again is timed afresh -------

def _frame(room: int, session: str, n: int = 1) -> ReceiverFrame:
    return ReceiverFrame(room, session, 4096, 0, 2, 0, 2, 8, "torch.float32", False, n)


def _bounded(**kw):
    """A bare manager whose peers may hold 100 B each, with rooms 1 and 2 on peer a and room 3 on b."""
    clock, _t, m = managed(max_peer_bytes=100, write_timeout=10.0, **kw)
    for room, session in ((1, "a"), (2, "a"), (3, "b")):
        m.register_receiver(_frame(room, session))
    return clock, m, m.holds


def test_a_room_that_passed_its_peers_bound_and_is_held_back_again_waits_from_then():
    clock, m, holds = _bounded()
    a = m.peers.get("a")
    m.peers.hold(2, 60, ["a"])
    assert holds.held_back(1, 50)
    assert not holds.held_back(3, 40)  # another room passes while room 1 waits (every peer together: 100)
    m.peers.hold(2, 40, ["a"])  # room 2's write holds a's whole bound
    assert holds.held_back(1, 50)
    clock.advance(6.0)
    m.peers.let_go(a, 2)
    assert not holds.held_back(1, 50)  # a's bytes are back: room 1 may lease (and, say, defers for bytes)
    m.peers.hold(2, 100, ["a"])
    clock.advance(6.0)  # 12 s after the first wait began, 6 s into this one
    assert holds.held_back(1, 50)
    assert m.room_status(1) == "announced"  # not failed (no sender yet: announced)
    clock.advance(4.0)
    assert holds.held_back(1, 50)  # 16 s after the first wait began, still within this one
    clock.advance(6.0)  # this wait's whole write timeout
    assert not holds.held_back(1, 50)
    assert reason_kind(m, 1) is ReasonKind.CAPACITY


def test_a_room_whose_own_peers_are_under_their_bound_passes_and_keeps_no_wait():
    # Every peer together holds more than one bound, but not room 3's: it passes, whenever asked.
    clock, m, holds = _bounded()
    m.peers.hold(1, 100, ["a"])
    m.peers.hold(9, 30, ["b"])
    assert not holds.held_back(3, 50)
    m.peers.hold(8, 60, ["b"])  # now b holds its bound too
    assert holds.held_back(3, 50)
    clock.advance(6.0)
    m.peers.let_go(m.peers.get("b"), 8)
    assert not holds.held_back(3, 50)
    m.peers.hold(8, 60, ["b"])
    clock.advance(6.0)
    assert holds.held_back(3, 50)  # timed from this wait, not the first
    assert m.room_status(3) == "announced"


def test_a_peer_at_exactly_its_bound_holds_a_room_back_and_one_byte_under_does_not():
    _clock, m, holds = _bounded()
    m.peers.hold(2, 60, ["a"])
    m.peers.hold(9, 40, ["b"])  # every peer together at 100: the slow path decides
    assert not holds.held_back(1, 40)  # a would hold exactly its bound
    assert holds.held_back(1, 41)


def test_a_room_that_passed_the_parked_bound_and_is_held_back_again_waits_from_then():
    clock, _t, m = managed(max_parked_bytes=100, park_timeout=10.0)
    holds = m.holds
    for room in (1, 2, 3):  # two receivers declared, one registered, the sender bound: the chunks would park
        m.register_receiver(_frame(room, "a", n=2))
        m.bind_sender(room)
    holds.hold(2, 80)  # room 2's chunk parks
    assert holds.held_back(1, 50)
    assert not holds.held_back(3, 20)  # another room passes while room 1 waits
    clock.advance(6.0)
    holds.unpark(m.rooms[2])
    assert not holds.held_back(1, 50)
    holds.hold(2, 80)
    clock.advance(6.0)
    assert holds.held_back(1, 50)  # 12 s after the first wait began, 6 s into this one
    assert m.room_status(1) == "registered"
    clock.advance(10.0)
    assert not holds.held_back(1, 50)
    assert reason_kind(m, 1) is ReasonKind.PARK_TIMEOUT


@pytest.mark.parametrize("bound", ["identity share", "parked bytes"])
def test_a_wait_that_ends_while_identity_shares_bound_the_ring_is_over_too(bound):
    # With a share per identity every check takes the slow path; a wait that ends there is forgotten
    # as on the fast path, so the room's next wait is timed from its own start.
    clock, _t, m = managed(max_parked_bytes=100, park_timeout=10.0, write_timeout=10.0)
    holds = m.holds
    holds.shares = Shares(10_000, 8, 0.5)  # as the executor sizes it: each identity may hold 5,000 B
    for room in (1, 2):  # two receivers declared, one registered: a chunk would park
        m.register_receiver(_frame(room, "a", n=2))
        m.bind_sender(room)
    share = holds.shares.of(m.rooms[1].owner)

    def block() -> None:
        if bound == "identity share":
            share.charge(4_990)
        else:
            holds.hold(2, 80)  # room 2's chunk parks

    def unblock() -> None:
        if bound == "identity share":
            share.charge(-4_990)
        else:
            holds.unpark(m.rooms[2])

    block()
    assert holds.held_back(1, 50)
    clock.advance(6.0)
    unblock()
    assert not holds.held_back(1, 50)
    block()
    clock.advance(6.0)
    assert holds.held_back(1, 50)  # 12 s after the first wait began, 6 s into this one
    assert m.room_status(1) == "registered"


def test_a_room_failed_by_a_bound_is_told_whose_bytes_held_it_back():
    # The failure names what an operator must look at: the receiver whose peer held its bound, or the
    # identity that held its share (names that came from the frames, not our wording).
    clock, _t, m = managed(max_peer_bytes=100, write_timeout=10.0)
    m.register_receiver(_frame(1, "stuck-receiver-7"))
    m.peers.hold(9, 100, ["stuck-receiver-7"])
    assert m.holds.held_back(1, 50)
    clock.advance(10.0)
    assert not m.holds.held_back(1, 50)
    assert reason_kind(m, 1) is ReasonKind.CAPACITY and "stuck-receiver-7" in reason_text(m, 1)
    clock, _t, m = managed(write_timeout=10.0)
    m.holds.shares = Shares(10_000, 8, 0.5)
    m.bind_sender(2, "greedy-key")
    m.holds.shares.of("greedy-key").charge(4_990)
    assert m.holds.held_back(2, 50)
    clock.advance(10.0)
    assert not m.holds.held_back(2, 50)
    assert reason_kind(m, 2) is ReasonKind.CAPACITY and "greedy-key" in reason_text(m, 2)


def test_identity_shares_without_a_peer_bound_deliver():
    # Shares by identity alone (every peer may hold the whole ring): the bound checks skip the peers'.
    rig = make_rig(arena_bytes=8 * ITEM_COST, identity_ring_share=0.5, peer_ring_share=1.0)
    assert rig.manager.peers.max_bytes is None and rig.executor.shares.cap is not None
    rig.receiver("a")
    run(rig, room_for(rig, 1, "a"))
    assert rig.manager.room_status(1) == "success"


def test_a_room_that_ends_while_waiting_on_a_bound_leaves_no_wait_behind():
    # Rooms failed by the engine while held back: their waits end with them (nothing grows per room).
    _, m, holds = _bounded()
    m.peers.hold(2, 100, ["a"])
    assert holds.held_back(1, 50)
    assert m.fail_room(1, "the engine gave up")
    assert holds.held_since == {}
    _clock, _t, m = managed(max_parked_bytes=100)
    for room in (1, 2):
        m.register_receiver(_frame(room, "a", n=2))
        m.bind_sender(room)
    m.holds.hold(2, 80)
    assert m.holds.held_back(1, 50)
    assert m.fail_room(1, "the engine gave up")
    assert m.holds.parked_since == {}


def test_a_room_that_fails_while_its_chunk_waits_for_its_peer_gives_the_peer_its_bytes_back():
    rig = make_rig(write_timeout=30.0)
    m, t = rig.manager, rig.transport
    t.inject_contact("hang", session="slow")
    m.register_receiver(rig.frame(1, "slow", 2))
    rig.send(1)
    peer = m.peers.get("slow")
    assert m.room_status(1) == "transferring" and peer.held > 0  # held for it, no write yet
    assert m.fail_room(1, "the engine gave up")
    assert peer.held == 0 and m.peers.held_total == 0
