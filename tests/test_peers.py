"""Peers on the loopback transport with a fake clock: first contact off the loop, rooms
waiting for a contacted peer, a dead peer failing its rooms at once, backoff and recovery."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_rig  # noqa: E402

from epd_ring.executor import EncodeManager, FakeClock, LoopbackTransport, Outcome  # noqa: E402


def room_for(rig, room, session, n_tokens=3):
    """Register the encode request and the receiver's frame; return (request id, item)."""
    rid = f"req-{room}"
    rig.executor.register(rid, "prefill", 1, room)
    rig.manager.register_receiver(rig.frame(room, session, n_tokens))
    return rid, rig.item(n_tokens, room)


def run(rig, *rooms):
    rig.executor.execute(list(rooms))
    rig.executor.poll()


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
    rig = make_rig(slots=8, connect_timeout=2.0)
    rig.receiver("hung")
    rig.transport.inject_contact("hang", session="hung")
    stuck = room_for(rig, 1, "hung")
    assert rig.manager.peers.get("hung").state == "connecting"
    fine = [room_for(rig, 10 + k, "ok") for k in range(5)]
    run(rig, stuck, *fine)
    assert all(rig.manager.room_status(10 + k) == "success" for k in range(5))
    # The stuck room's chunk waits in its staged slot; nothing was written to the peer.
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
    assert rig.executor.ring.free_count == rig.executor.ring.n_slots
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
    rig = make_rig(slots=8, peer_fail_threshold=3, write_timeout=30.0)
    rcv = rig.receiver("b")
    rooms = [room_for(rig, k, "b") for k in range(20)]
    others = [room_for(rig, 100 + k, "a") for k in range(4)]
    rcv.kill()
    run(rig, *rooms[:8])  # the ring holds 8: the rest are deferred
    # Three failed writes: suspect, the re-check is refused (dead), down: every room fails now.
    assert rig.manager.peers.get("b").state == "down"
    assert all(rig.manager.room_status(k) == "failed" for k in range(20))
    assert sum("peer b is down" in (rig.manager.failure_reason(k) or "") for k in range(20)) >= 17
    assert rig.clock.now() == 0.0  # no room waited for a timeout
    run(rig, *rooms[8:], *others)
    rig.clock.advance(5.0)  # the slots of the 8 failed writes serve their quarantine
    rig.executor.poll()
    rig.executor.poll()
    assert all(rig.manager.room_status(100 + k) == "success" for k in range(4))
    assert rig.transport.submitted == 8 + 4  # no write to b after it went down


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
    m = EncodeManager(transport, clock, max_peers=2)
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


def test_overdue_writes_count_once_toward_the_threshold():
    rig = make_rig(peer_fail_threshold=2, write_timeout=1.0)
    rig.receiver("b")
    rig.transport.inject("hold", session="b")
    run(rig, room_for(rig, 1, "b"))
    rig.clock.advance(1.0)
    rig.executor.poll()
    peer = rig.manager.peers.get("b")
    assert rig.manager.room_status(1) == "failed" and peer.fails == 1
    rig.transport.complete(rig.transport.held[0], Outcome.TIMED_OUT)
    rig.executor.poll()
    assert peer.fails == 1 and peer.state == "up"


def test_health_reports_lag_oldest_write_peers_slots_and_dump_shows_peers():
    rig = make_rig(slots=4, connect_timeout=2.0)
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
    assert h["slots"]["sending"] == 1 and h["quarantined"] == 0 and h["deferred"] == 0
    rig.executor.poll()
    assert rig.executor.health()["loop_lag_s"] == 0.0
    text = rig.executor.dump_state()
    assert "peer hung: connecting rooms=1" in text and "peer a: up rooms=1" in text
    rig.clock.advance(1.0)
    rig.executor.poll()
    assert "peer hung: down rooms=0 (no answer to contact within the connect deadline of 2.0 s)" \
        in rig.executor.dump_state()
    assert 'label="peer hung\\ndown"' in rig.executor.dump_state("dot")
