"""The loopback transport's fault injector, the ring's views and close, and the peer table's
counters and write reports, pinned exactly (written against surviving mutants of
executor/core/loopback.py, ring.py and peers.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import loopback_setup, make_rig  # noqa: E402

from epd_ring.executor import EncodeManager, FakeClock, LoopbackTransport, Outcome, Ring, TransportError  # noqa: E402
from epd_ring.executor.core.loopback import CONTACT_FAULTS, FAULT_KINDS, Fault, Notice, Regions  # noqa: E402
from epd_ring.executor.core.peers import Peer  # noqa: E402
from epd_ring.fsm.core import InvalidTransition  # noqa: E402


setup = loopback_setup


def whole(src, dst):
    return [(src.data_ptr(), dst.data_ptr(), 64)]


# -- loopback: bad input ------------------------------------------------------------------

def test_unknown_fault_kinds_are_refused_naming_the_known_ones():
    assert FAULT_KINDS == ("fail", "delay", "timeout", "timeout_land_later", "hold")
    assert CONTACT_FAULTS == ("hang", "refuse", "slow")
    msg = "unknown fault 'explode'; expected one of ('fail', 'delay', 'timeout', 'timeout_land_later', 'hold')"
    with pytest.raises(ValueError) as e:
        Fault("explode")
    assert str(e.value) == msg
    t = LoopbackTransport()
    with pytest.raises(ValueError) as e:
        t.inject("explode")
    assert str(e.value) == msg
    with pytest.raises(ValueError) as e:
        t.inject_contact("explode")
    assert str(e.value) == "unknown contact fault 'explode'; expected one of ('hang', 'refuse', 'slow')"


def test_a_closed_transport_refuses_writes_with_a_clear_error():
    _, t, src, dst, _ = setup()
    t.close()
    with pytest.raises(TransportError) as e:
        t.submit_write("r", whole(src, dst))
    assert str(e.value) == "transport is closed"
    assert t.submitted == 0 and not dst.any()


# -- loopback: regions ----------------------------------------------------------------------

def test_removing_an_owner_drops_exactly_its_regions():
    regions = Regions()
    a, b = object(), object()
    regions.add(0x1000, 0x100, a)
    regions.add(0x2000, 0x100, b)
    regions.add(0x3000, 0x100, a)
    assert regions.remove_owner(a) == 2 and len(regions) == 1
    assert regions.covers(0x2000, 0x100) and regions.covers(0x2080, 0x80)
    assert not regions.covers(0x2080, 0x81)  # one past b's end
    assert not regions.covers(0x1000, 1) and not regions.covers(0x3000, 1)
    regions.add(0x1000, 0x100, a)  # a's old range is free to register again
    assert regions.remove_owner(object()) == 0
    assert regions.remove_owner(b) == 1 and len(regions) == 1
    assert regions.covers(0x1000, 0x100) and not regions.covers(0x2000, 1)


# -- loopback: the data path ------------------------------------------------------------------

def test_writes_count_landed_bytes_and_writes_to_sessions_never_reached():
    _, t, src, dst, _ = setup()
    empty = (src.data_ptr(), dst.data_ptr(), 0)  # a zero-length part lands nothing
    h1 = t.submit_write("r", [*whole(src, dst), empty])
    h2 = t.submit_write("r", whole(src, dst))
    assert t.poll() == [(h1, Outcome.DONE), (h2, Outcome.DONE)]
    assert t.bytes_landed == 128 and t.submitted == 2
    # No contact answered ok for "r" yet: a real engine would open the segment in each submit.
    assert t.unreached_writes == 2
    assert t.connect("r", 1) is True and t.reached == {"r"}
    t.submit_write("r", whole(src, dst))
    assert t.unreached_writes == 2 and t.bytes_landed == 192 and t.contacts == 1


def test_a_dead_receiver_fails_writes_and_contact_until_it_revives():
    _, t, src, dst, rcv = setup()
    rcv.kill()
    h1 = t.submit_write("r", whole(src, dst))
    assert t.connect("r", 1) is False and t.reached == set()
    rcv.revive()
    assert rcv.alive is True
    h2 = t.submit_write("r", whole(src, dst))
    assert t.poll() == [(h1, Outcome.FAILED), (h2, Outcome.DONE)]
    assert torch.equal(dst, src)
    assert t.connect("r", 2) is True and t.reached == {"r"}


def test_a_policy_sees_each_write_without_a_scripted_rule():
    _, t, src, dst, _ = setup()
    seen = []

    def policy(session, bufs):
        seen.append((session, list(bufs)))
        return Fault("fail") if session == "r" else None

    t.policy = policy
    h1 = t.submit_write("r", whole(src, dst))
    t.inject("delay", delay=1.0)  # a scripted rule comes first: the policy is not asked
    h2 = t.submit_write("r", whole(src, dst))
    assert seen == [("r", whole(src, dst))]
    assert t.poll() == [(h1, Outcome.FAILED)] and not dst.any()
    t.clock.advance(1.0)
    assert t.poll() == [(h2, Outcome.DONE)] and torch.equal(dst, src)


def test_an_injected_failure_reports_after_its_delay_and_writes_nothing():
    clock, t, src, dst, _ = setup(at=10.0)
    t.inject("fail", delay=2.0)
    h = t.submit_write("r", whole(src, dst))
    assert t.poll() == [] and t.in_flight == 1
    clock.advance(1.5)
    assert t.poll() == []
    clock.advance(0.5)
    assert t.poll() == [(h, Outcome.FAILED)] and t.in_flight == 0
    assert not dst.any() and t.bytes_landed == 0


def test_a_delayed_write_lands_when_it_reports_and_fails_if_the_receiver_died_meanwhile():
    clock, t, src, dst, rcv = setup(at=10.0)
    t.inject("delay", delay=1.0, count=2)
    h1 = t.submit_write("r", whole(src, dst))
    assert t.poll() == [] and not dst.any()
    clock.advance(1.0)
    assert t.poll() == [(h1, Outcome.DONE)] and torch.equal(dst, src)
    dst.zero_()
    h2 = t.submit_write("r", whole(src, dst))
    rcv.kill()
    clock.advance(1.0)
    assert t.poll() == [(h2, Outcome.FAILED)] and not dst.any()
    assert t.late_landings == 0 and t.bytes_landed == 64


def test_an_injected_timeout_reports_after_its_delay_and_never_lands():
    clock, t, src, dst, _ = setup(at=10.0)
    t.inject("timeout", delay=2.0)
    h = t.submit_write("r", whole(src, dst))
    assert t.poll() == [] and t.held == [] and t.in_flight == 1
    clock.advance(1.5)
    assert t.poll() == []
    clock.advance(0.5)
    assert t.poll() == [(h, Outcome.TIMED_OUT)]
    clock.advance(100.0)
    assert t.poll() == [] and t.in_flight == 0 and t.held == []
    assert not dst.any() and t.late_landings == 0


def test_timeout_land_later_lands_at_once_by_default_and_reports_after_its_delay():
    clock, t, src, dst, _ = setup()
    t.inject("timeout_land_later", delay=2.0)  # land_after defaults to 0: the bytes land now
    h = t.submit_write("r", whole(src, dst))
    assert t.poll() == []  # the timeout is not reported before its delay
    assert torch.equal(dst, src) and t.late_landings == 1 and t.bytes_landed == 64
    clock.advance(2.0)
    assert t.poll() == [(h, Outcome.TIMED_OUT)] and t.in_flight == 0


def test_completing_held_writes_by_hand():
    _, t, src, dst, _ = setup()
    t.inject("hold", count=5)
    failed, not_landed, done, ghost1, ghost2 = (t.submit_write("r", whole(src, dst)) for _ in range(5))
    assert t.held == [failed, not_landed, done, ghost1, ghost2] and t.poll() == []
    t.complete(failed, Outcome.FAILED)  # by default a failed write neither lands nor lands later
    t.complete(not_landed, Outcome.DONE, land=False)  # reported done, nothing landed: failed
    assert t.poll() == [(failed, Outcome.FAILED), (not_landed, Outcome.FAILED)]
    assert not dst.any() and t.ghosts == []
    t.complete(done, Outcome.DONE, land_later=True)  # a done write has nothing left to land
    assert t.poll() == [(done, Outcome.DONE)] and torch.equal(dst, src) and t.ghosts == []
    dst.zero_()
    t.complete(ghost1, Outcome.TIMED_OUT, land_later=True)
    t.complete(ghost2, Outcome.FAILED, land_later=True)
    assert t.poll() == [(ghost1, Outcome.TIMED_OUT), (ghost2, Outcome.FAILED)]
    assert t.ghosts == [ghost1, ghost2] and not dst.any() and t.held == []
    # The bytes are read from the source when they land, not when the write was submitted.
    src.add_(100)
    assert t.land_ghost(ghost1) is True and torch.equal(dst, src)
    assert t.late_landings == 1 and t.ghosts == [ghost2]
    assert t.land_ghost(ghost2) is True and t.late_landings == 2 and t.ghosts == []
    # A ghost whose receiver died meanwhile does not land and is not counted.
    t.inject("hold")
    h = t.submit_write("r", whole(src, dst))
    t.complete(h, Outcome.FAILED, land_later=True)
    t.receivers["r"].kill()
    assert t.land_ghost(h) is False and t.late_landings == 2 and t.ghosts == []
    with pytest.raises(KeyError):
        t.land_ghost(h)


def test_notices_reach_live_receivers_only():
    clock, t, _, _, rcv = setup(at=3.0)
    dead = t.add_receiver("dead")
    dead.kill()
    t.notify(SimpleNamespace(session="r"), 5, "success")
    t.notify(SimpleNamespace(session="r"), 6, "failed", "peer x is down")
    t.notify(SimpleNamespace(session="dead"), 5, "failed")
    t.notify(SimpleNamespace(session="nobody"), 5, "failed")  # not a receiver here: dropped
    assert rcv.notices == [Notice(5, "success", "", 3.0), Notice(6, "failed", "peer x is down", 3.0)]
    assert dead.notices == []


# -- loopback: first contact ----------------------------------------------------------------

def test_contact_faults_apply_to_their_session_for_their_count():
    _, t, _, _, _ = setup()
    t.add_receiver("a")
    t.inject_contact("refuse", session="a", count=2)
    assert t.connect("r", 1) is True  # another session is not affected
    assert [t.connect("a", n) for n in (1, 2, 3)] == [False, False, True]
    assert t.reached == {"r", "a"} and t.contacts == 4
    t.inject_contact("refuse")  # no session: the next contact with anyone
    assert t.connect("r", 2) is False and t.connect("r", 3) is True
    assert t.peer_reports() == []


def test_a_slow_contact_without_delay_answers_at_once():
    _, t, src, dst, rcv = setup()
    t.inject_contact("slow", session="r")
    assert t.connect("r", 1) is True and t.reached == {"r"}
    t.submit_write("r", whole(src, dst))
    assert t.unreached_writes == 0
    rcv.kill()
    t.inject_contact("slow", session="r")
    assert t.connect("r", 2) is False


def test_a_hung_contact_answers_by_hand_with_the_receivers_liveness_by_default():
    _, t, _, _, _ = setup()
    t.add_receiver("dead").kill()
    t.inject_contact("hang", count=4)
    assert t.connect("r", 1) is None and t.connect("dead", 2) is None
    assert t.connect("nobody", 3) is None and t.connect("told", 4) is None
    assert t.hung == {"r": 1, "dead": 2, "nobody": 3, "told": 4}
    assert t.answer("r") is True and t.reached == {"r"}
    assert t.answer("dead") is True and t.answer("nobody") is True
    assert t.answer("told", ok=True) is True  # told explicitly: no receiver needed
    assert t.answer("r") is False  # nothing hangs for it any more
    assert t.hung == {} and t.reached == {"r", "told"}
    assert t.peer_reports() == [("r", 1, True, ""), ("dead", 2, False, "refused"),
                                ("nobody", 3, False, "refused"), ("told", 4, True, "")]
    assert t.peer_reports() == []
    t.inject_contact("hang")
    t.connect("r", 5)
    assert t.answer("r", ok=False) is True
    assert t.peer_reports() == [("r", 5, False, "refused")]


def test_late_contact_answers_come_back_in_time_order():
    clock, t, _, _, _ = setup()
    t.add_receiver("b")
    t.inject_contact("refuse", session="b", delay=2.0)
    t.inject_contact("slow", session="r", delay=1.0)
    assert t.connect("b", 1) is None and t.connect("r", 7) is None
    assert t.peer_reports() == [] and t.reached == set()
    clock.advance(1.0)
    assert t.peer_reports() == [("r", 7, True, "")] and t.reached == {"r"}
    clock.advance(1.0)
    assert t.peer_reports() == [("b", 1, False, "refused")] and t.reached == {"r"}


# -- ring ---------------------------------------------------------------------------------

def test_slot_views_cover_exactly_their_slot():
    t = LoopbackTransport()
    ring = Ring(t, 3, 64, deep_slot_bytes=128)
    ring.main.zero_()
    ring.deep.zero_()
    slot = ring.slots[2]
    main = ring.main_view(slot, 32)
    assert main.numel() == 32 and main.data_ptr() == ring.main_ptr(slot) == ring.main_base + 2 * 64
    main.fill_(7)
    assert ring.main[128:160].eq(7).all() and not ring.main[:128].any() and not ring.main[160:].any()
    deep = ring.deep_view(slot, 100)
    assert deep.numel() == 100 and deep.data_ptr() == ring.deep_ptr(slot) == ring.deep_base + 2 * 128
    deep.fill_(9)
    assert ring.deep[256:356].eq(9).all() and not ring.deep[:256].any() and not ring.deep[356:].any()


def test_a_slot_back_on_the_free_list_forgets_its_room_and_is_reused_last():
    ring = Ring(LoopbackTransport(), 2, 64)
    a = ring.lease()
    a.room = 7  # the executor names the room a leased slot holds
    assert ring.fire(a, "abandon") == "free"
    assert a.room is None and ring.free_count == 2
    b = ring.lease()
    assert b is ring.slots[1] and ring.lease() is a  # FIFO: the slot freed longest ago first
    b.room, b.unsure, b.writes_in_flight = 8, True, 0  # its write failed: it may still land
    for event in ("copied", "send"):
        ring.fire(b, event)
    assert ring.fire(b, "settle") == "quarantined" and b.room == 8 and ring.free_count == 0
    assert ring.fire(b, "release") == "free"
    assert b.room is None and b.unsure is False and ring.free_count == 1
    assert ring.lease() is b
    for event in ("copied", "send"):
        ring.fire(b, event)
    assert ring.fire(b, "settle") == "free"  # its next, clean write needs no quarantine


def test_close_retires_free_slots_and_counts_the_busy_ones():
    ring = Ring(LoopbackTransport(), 3, 64)
    busy = ring.lease()
    assert ring.close() == 1
    assert ring.counts() == {"retired": 2, busy.state: 1} and busy.state != "retired"
    assert Ring(LoopbackTransport(), 2, 64).close() == 0


# -- peers --------------------------------------------------------------------------------

def table(**kw):
    clock, t, manager = managed(**kw)
    return clock, t, manager.peers


def managed(**kw):
    clock = FakeClock()
    t = LoopbackTransport(clock)
    return clock, t, EncodeManager(t, clock, **kw)


def test_idle_peers_forgotten_to_stay_bounded_are_counted():
    _, t, peers = table(max_peers=2)
    for s in ("p0", "p1", "p2", "p3"):
        t.add_receiver(s)
        assert peers.contact(s).state == "up"
    assert list(peers.by_session) == ["p2", "p3"]
    assert dict(peers.stats) == {"contacts": 4, "connected": 4, "peers_forgotten": 2}


def test_each_refused_contact_puts_the_peer_down_once():
    clock, t, peers = table(peer_backoff=1.0)
    t.add_receiver("x")
    t.inject_contact("refuse", session="x", count=2)
    peer = peers.contact("x")
    assert peer.state == "down" and peer.reason == "contact failed (refused)"
    assert peers.snapshot() == {"x": {"state": "down", "fails": 0, "rooms": 0, "reason": "contact failed (refused)"}}
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


def test_a_full_table_of_busy_peers_refuses_new_ones_and_counts_each():
    _, t, peers = table(max_peers=1)
    t.inject_contact("hang", session="p0")  # a peer being contacted is never forgotten
    assert peers.contact("p0").state == "connecting"
    assert peers.contact("p1") is None and peers.contact("p2") is None
    assert list(peers.by_session) == ["p0"]
    assert dict(peers.stats) == {"contacts": 1, "peers_refused": 2}


def test_one_contact_at_a_time_each_attempt_numbered_and_one_deadline_armed():
    clock, t, m = managed(connect_timeout=2.0, peer_backoff=1.0)
    peers = m.peers
    t.add_receiver("x")
    t.inject_contact("hang", session="x")
    peer = peers.contact("x")
    assert peer.state == "connecting" and t.hung == {"x": 1} and len(peers.deadlines) == 1
    assert peers.snapshot() == {"x": {"state": "connecting", "fails": 0, "rooms": 0, "reason": ""}}
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


def test_a_refusal_reported_without_detail_reads_refused():
    _, t, peers = table()
    t.inject_contact("hang", session="y")
    peer = peers.contact("y")
    peers.report("y", 1, False)
    assert peer.state == "down" and peer.reason == "contact failed (refused)"


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
    assert str(e.value) == "peer machine (peer z): event 'write_ok' is not allowed in state 'unknown'"


# -- construction: settings, defaults, fresh objects ---------------------------------------

def test_peer_table_settings_are_checked_by_name_and_default_like_the_manager():
    from epd_ring.executor.core.peers import PeerTable
    from epd_ring.executor.core.timers import Deadlines

    clock = FakeClock()
    t = LoopbackTransport(clock)
    plain = PeerTable(t, clock, Deadlines())
    m = EncodeManager(LoopbackTransport(clock), clock).peers
    # one set of defaults, whether the table is built alone or by the manager
    assert (plain.connect_timeout, plain.backoff, plain.fail_threshold, plain.max_peers) == \
        (m.connect_timeout, m.backoff, m.fail_threshold, m.max_peers) == (5.0, 5.0, 3, 4096)
    bad = [(dict(connect_timeout=0), "connect_timeout must be > 0 seconds, got 0"),
           (dict(connect_timeout="soon"), "connect_timeout must be a number of seconds, got 'soon'"),
           (dict(backoff=-1.0), "peer_backoff must be finite and >= 0 seconds, got -1.0"),
           (dict(fail_threshold=0), "peer_fail_threshold must be >= 1, got 0"),
           (dict(max_peers=0), "max_peers must be >= 1, got 0")]
    for kw, msg in bad:
        with pytest.raises(ValueError) as e:
            PeerTable(t, clock, Deadlines(), **kw)
        assert str(e.value) == msg
    one = PeerTable(t, clock, Deadlines(), fail_threshold=1, max_peers=1)  # 1 is allowed for both
    assert (one.fail_threshold, one.max_peers) == (1, 1)


def test_a_fresh_peer_is_idle():
    _, _, peers = table()
    peer = Peer("z", peers)
    # timer, due and retry_at are read only once armed or down; a fresh peer has no deadline
    assert (peer.state, peer.fails, peer.attempt, peer.reason) == ("unknown", 0, 0, "")
    assert not peer.timer and peer.rooms == set()


def test_ring_settings_are_checked_with_clear_errors():
    t = LoopbackTransport()
    bad = [((0, 64), {}, "a ring needs at least one slot, got 0"),
           ((1, 0), {}, "slot bytes must be a positive multiple of 64, got 0"),
           ((1, 100), {}, "slot bytes must be a positive multiple of 64, got 100"),
           ((1, 64), dict(deep_slot_bytes=32), "deepstack slot bytes must be a multiple of 64, got 32")]
    for args, kw, msg in bad:
        with pytest.raises(ValueError) as e:
            Ring(t, *args, **kw)
        assert str(e.value) == msg
    assert len(t.local) == 0  # nothing registered by a refused ring


def test_a_ring_without_deepstack_registers_one_byte_region_per_slot_on_its_device():
    t = LoopbackTransport()
    ring = Ring(t, 3, 128)
    assert ring.device == torch.device("cpu") and ring.main.device == ring.device
    assert ring.main.dtype == torch.uint8 and ring.main.numel() == 3 * 128
    assert ring.deep is None and ring.deep_base == 0 and ring.deep_slot_bytes == 0
    assert len(t.local) == 3 and all(t.local.covers(ring.main_ptr(s), 128) for s in ring.slots)
    assert not t.local.covers(ring.main_base, 129)  # one region per slot, never one across two
    deep = Ring(t, 2, 64, deep_slot_bytes=192)
    assert deep.deep.dtype == torch.uint8 and deep.deep.numel() == 2 * 192 and deep.deep.device == deep.device
    assert len(t.local) == 3 + 4 and all(t.local.covers(deep.deep_ptr(s), 192) for s in deep.slots)
    # the meta device holds no memory but keeps placement visible: the ring lives where asked
    anywhere = SimpleNamespace(register_memory=lambda regions, owner=None: None)  # meta pointers are all 0
    meta = Ring(anywhere, 2, 64, device="meta", deep_slot_bytes=64)
    assert meta.device.type == meta.main.device.type == meta.deep.device.type == "meta"


def test_fresh_slots_are_free_empty_and_have_no_deadline():
    from epd_ring.executor.core.timers import Deadlines

    ring = Ring(LoopbackTransport(), 2, 64)
    for s in ring.slots:
        assert (s.state, s.room, s.unsure, s.writes_in_flight) == ("free", None, False, 0) and not s.timer
    deadlines = Deadlines()
    deadlines.arm(1.0, "quarantine", ring.slots[0])
    assert len(deadlines) == 1 and list(deadlines.due(1.0)) == [("quarantine", ring.slots[0])]


def room_for(rig, room, session, n_tokens=3):
    rig.executor.register(f"req-{room}", "prefill", 1, room)
    rig.manager.register_receiver(rig.frame(room, session, n_tokens))
    return f"req-{room}", rig.item(n_tokens, room)


@pytest.mark.parametrize("outcome", [Outcome.DONE, Outcome.FAILED])
def test_a_write_reported_while_its_peer_is_contacted_again_leaves_the_contact_to_decide(outcome):
    # Bug found here: the report of a write submitted before the peer went down, arriving while a
    # later frame's contact with it was in flight, raised InvalidTransition out of poll().
    rig = make_rig(slots=8, peer_fail_threshold=1, peer_backoff=1.0)
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


def test_a_fresh_loopback_transport_and_its_registrations():
    t = LoopbackTransport()
    assert (t.policy, t.closed, t.bytes_landed, t.late_landings, t.submitted, t.contacts, t.unreached_writes) == \
        (None, False, 0, 0, 0, 0, 0)
    rcv = t.add_receiver("r")
    assert rcv.session == "r" and t.receivers == {"r": rcv}
    with pytest.raises(ValueError) as e:
        t.add_receiver("r")
    assert str(e.value) == "receiver session 'r' already exists"
    assert rcv.register(0x5000, 1) == 0x5000  # one byte is a region
    assert rcv.register(0x5001, 63) == 0x5001  # adjacent: allowed
    with pytest.raises(TransportError) as e:
        rcv.register(0x6000, 0)
    assert str(e.value) == "cannot register 0 bytes at 0x6000"
    buf = torch.zeros(4)
    assert rcv.register(buf) == buf.data_ptr()
    assert rcv.regions.covers(0x5000, 64) is False and rcv.regions.covers(0x5001, 63)
    assert rcv.regions.remove_owner(buf) == 1 and len(rcv.regions) == 2  # a tensor owns its region
    src = torch.ones(4)
    t.register_memory([(src.data_ptr(), 16)], owner=src)
    assert t.submit_write("r", [(src.data_ptr(), 0x5000, 0)]) == 1  # handles count from 1
