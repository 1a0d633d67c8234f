"""The attacks found by trying the controller as another peer would, on the sans-I/O core.

Each frame carries the identity its control plane authenticated (`peer`). A room takes frames
from one peer only: the one its sender names, else the first to claim it. Another peer's frame
can neither change, fail nor learn about that room, and may name only its own sessions. Every
test also checks the victim's bytes and that nothing else was lost.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import Calls, ManagerRig, log_lines, make_rig, run, untouched

from epd_ring.executor import FrameError, RoomConflict
from epd_ring.executor.core.frames import check_frame, frame_from_parts, frame_to_parts
from epd_ring.executor.core.tenancy import Tenancy

VICTIM, ATTACKER = "key-victim", "key-attacker"


def victim_room(rig, room, tokens=2, *, named=True, register=True):
    rid = f"req-{room}"
    rig.executor.register(rid, "prefill-host", 8998, room, receiver=VICTIM if named else None)
    item = rig.item(tokens, room)
    if register:
        rig.manager.register_receiver(rig.frame(room, "victim:1", tokens, identity=VICTIM))
    return rid, item


@pytest.mark.parametrize("named", [True, False], ids=["named-at-bind", "claimed-by-first-frame"])
def test_another_peer_cannot_fail_a_room_whose_id_it_knows(named):
    rig = make_rig()
    rid, item = victim_room(rig, 7, named=named)
    for bad in (dict(n_receivers=0), dict(hidden=3), dict(n_tokens=-1)):  # malformed, or against the chunk
        rig.manager.register_receiver(rig.frame(7, "attacker:1", 2, identity=ATTACKER, **bad))
    run(rig, (rid, item))
    assert rig.manager.room_status(7) == "success"
    assert rig.delivered_ok(7, "victim:1", item)
    assert rig.receiver("victim:1").statuses(7) == ["success"]
    assert rig.manager.stats["frames_foreign"] + rig.manager.stats["frames_refused"] == 3


def test_registering_first_does_not_hijack_a_room_its_sender_named():
    rig = make_rig()
    rig.manager.register_receiver(rig.frame(7, "attacker:1", 2, identity=ATTACKER))  # before the sender
    assert rig.manager.room_status(7) == "announced"
    rid, item = victim_room(rig, 7)
    run(rig, (rid, item))
    assert rig.manager.room_status(7) == "success"
    assert rig.delivered_ok(7, "victim:1", item) and rig.receiver("victim:1").statuses(7) == ["success"]
    assert untouched(rig, 7, "attacker:1")
    assert rig.receiver("attacker:1").statuses(7) == ["failed"]  # as if its sender never came
    # And after the bind, an extra seat cannot be taken either.
    rid8, item8 = victim_room(rig, 8, register=False)
    rig.manager.register_receiver(rig.frame(8, "attacker:1", 2, identity=ATTACKER, n=2))
    rig.manager.register_receiver(rig.frame(8, "victim:1", 2, identity=VICTIM))
    run(rig, (rid8, item8))
    assert rig.manager.room_status(8) == "success" and rig.delivered_ok(8, "victim:1", item8)
    assert untouched(rig, 8, "attacker:1")


def test_a_frame_may_not_name_another_peers_session():
    # Before: a frame naming the victim's session and another room's pointer made the encoder
    # overwrite the victim's delivered rows.
    rig = make_rig()
    rid1, item1 = victim_room(rig, 1)
    run(rig, (rid1, item1))
    assert rig.delivered_ok(1, "victim:1", item1)
    main, _, _, _ = rig.buffers[(1, "victim:1")]
    rig.executor.register("req-2", "h", 1, 2, receiver=ATTACKER)
    deputy = rig.frame(2, "attacker:1", 2, identity=ATTACKER)._replace(session="victim:1", dst_ptr=main.data_ptr())
    assert not rig.manager.register_receiver(deputy)
    run(rig, ("req-2", rig.item(2, 99)))
    assert rig.delivered_ok(1, "victim:1", item1)  # not overwritten
    assert rig.receiver("victim:1").statuses(2) == []  # and not addressed about the attacker's room
    assert rig.manager.stats["frames_foreign"] == 1


@pytest.mark.parametrize("poison", ["malformed", "announce-and-expire", "conflicting-frames"])
def test_a_future_room_id_cannot_be_poisoned(poison):
    rig = make_rig(park_timeout=5.0)
    if poison == "malformed":
        rig.manager.register_receiver(rig.frame(9, "attacker:1", 2, identity=ATTACKER, n_receivers=0))
        assert rig.manager.room_status(9) is None  # nothing created
    elif poison == "announce-and-expire":
        rig.manager.register_receiver(rig.frame(9, "attacker:1", 2, identity=ATTACKER))
        rig.clock.advance(6.0)
        rig.executor.poll()
        assert rig.manager.room_status(9) == "failed"
    else:
        rig.manager.register_receiver(rig.frame(9, "attacker:1", 2, identity=ATTACKER, n=2))
        rig.manager.register_receiver(rig.frame(9, "attacker:2", 2, identity=ATTACKER, n=3))
        assert rig.manager.room_status(9) == "failed"
    rid, item = victim_room(rig, 9)
    assert rig.manager.room_status(9) == "ready"  # bound and its receiver registered: not failed
    run(rig, (rid, item))
    assert rig.manager.room_status(9) == "success" and rig.delivered_ok(9, "victim:1", item)


@pytest.mark.parametrize("outcome", ["success", "failed"])
def test_another_peer_learns_nothing_of_a_concluded_room(outcome):
    rig = make_rig()
    rid, item = victim_room(rig, 4)
    if outcome == "failed":
        rig.transport.inject("fail", session="victim:1")
    run(rig, (rid, item))
    assert rig.manager.room_status(4) == outcome
    rig.manager.register_receiver(rig.frame(4, "attacker:1", 2, identity=ATTACKER))
    told = rig.receiver("attacker:1").notices
    assert [(n.status, n.reason) for n in told] == [("failed", "room not open to this receiver")]


def test_per_identity_announce_cap_keeps_other_identities_early_registrations():
    # Before: 4,096 bogus early frames locked every legitimate early registration out.
    rig = make_rig(max_announced=64, max_announced_per_identity=16)
    accepted = sum(rig.manager.register_receiver(rig.frame(1000 + k, "attacker:1", 1, identity=ATTACKER))
                   for k in range(200))
    assert accepted == 16
    assert rig.manager.register_receiver(rig.frame(5, "victim:1", 2, identity=VICTIM))  # early, before its sender
    rig.executor.register("req-5", "h", 1, 5, receiver=VICTIM)
    item = rig.item(2, 5)
    run(rig, ("req-5", item))
    assert rig.manager.room_status(5) == "success" and rig.delivered_ok(5, "victim:1", item)


def test_sessions_per_identity_are_bounded_and_released_oldest_first():
    rig = make_rig(max_sessions_per_identity=4)
    for k in range(10):
        rig.manager.register_receiver(rig.frame(100 + k, f"attacker:{k}", 1, identity=ATTACKER))
    assert len(rig.manager.tenancy) == 4
    assert rig.manager.tenancy.session_owner("attacker:9") == ATTACKER
    assert rig.manager.tenancy.session_owner("attacker:0") is None


@pytest.mark.parametrize("session", ["victim:1\nWARNING forged line", "a\rb", "tab\there", "sp ace", "x\x1b[2J"])
def test_session_strings_with_control_characters_are_refused(session):
    rig = make_rig()
    frame = rig.frame(3, "p3", 2)._replace(session=session)
    with pytest.raises(FrameError, match="session"):
        check_frame(frame)
    parts = frame_to_parts(frame)
    with pytest.raises(FrameError):
        check_frame(frame_from_parts(parts))
    assert not rig.manager.register_receiver(frame)


def test_status_endpoint_must_be_tcp():
    rig = make_rig()
    for endpoint in ("ipc:///tmp/x", "inproc://zeromq.zap.01", "tcp://a\nb"):
        with pytest.raises(FrameError, match="status_endpoint"):
            check_frame(rig.frame(3, "p3", 2, status_endpoint=endpoint))


def test_refusal_warnings_are_rate_limited_with_counts(caplog):
    rig = make_rig()
    caplog.set_level(logging.WARNING, logger="epd_ring.manager")
    for k in range(5000):
        rig.manager.register_receiver(rig.frame(k, "p", 1, n_receivers=0))
    lines = [r for r in caplog.records if r.name == "epd_ring.manager"]
    assert len(lines) == 1  # one second of the (fake) clock
    rig.clock.advance(1.5)
    rig.manager.register_receiver(rig.frame(1, "p", 1, n_receivers=0))
    lines = [r.getMessage() for r in caplog.records if r.name == "epd_ring.manager"]
    assert len(lines) == 2 and "and 4999 more like it" in lines[1]
    assert rig.manager.stats["frames_refused"] == 5001


def test_a_withdraw_from_another_peer_touches_nothing():
    rig = make_rig()
    rid, item = victim_room(rig, 6)
    assert rig.manager.withdraw(6, "victim:1", identity=ATTACKER) == "refused"
    assert rig.manager.room_status(6) == "ready"
    run(rig, (rid, item))
    assert rig.manager.room_status(6) == "success" and rig.delivered_ok(6, "victim:1", item)
    assert rig.receiver("victim:1").statuses(6) == ["success"]


# -- which identity a room belongs to ----------------------------------------------------------

def test_a_sender_binds_to_its_own_peers_failure_and_its_room():
    b = ManagerRig()
    m = b.m
    ev = m.observer = Calls("room_opened")
    b.announced_failed(1, "a1", "bad frame", identity="A")
    assert m.bind_sender(1, receiver="A") == "failed"  # A's own failure binds its request
    assert m.bind_sender(1) == "failed"  # unnamed: whatever failed the room, it stays failed
    assert m.register_receiver(b.frame(2, "a2", n=2, identity="A"))
    assert m.bind_sender(2, receiver="A") == "registered"  # A's announced room is A's to bind
    assert m.register_receiver(b.frame(3, "a3", n=1, identity="A"))
    assert m.bind_sender(3) == "ready"  # unnamed binds to whoever announced
    assert m.stats["foreign_announcements"] == 0 and m.stats["failed"] == 1
    assert ev.calls == [("room_opened", 1), ("room_opened", 2), ("room_opened", 3)]  # binding opens no second record


def test_a_room_announced_by_another_peer_fails_for_it_and_opens_anew():
    b = ManagerRig()
    m = b.m
    ev = m.observer = Calls("room_opened")
    assert m.register_receiver(b.frame(3, "a3", n=2, identity="A"))
    assert m.bind_sender(3, receiver="B") == "registered"
    why = "room not open to this receiver"
    assert b.notices("a3", 3) == [(3, "failed", why), (3, "released", "")]
    assert m.stats["foreign_announcements"] == 1 and m.stats["failed"] == 1
    assert m.room_status(3) == "registered" and ev.calls == [("room_opened", 3), ("room_opened", 3)]
    assert m.register_receiver(b.frame(3, "b3", n=1, identity="B"))  # B's frame now completes the room
    assert m.room_status(3) == "ready"
    assert m.register_receiver(b.frame(3, "a4", n=1, identity="A")) is False  # and A is out
    # a room that already has its sender is not taken over, whoever binds it
    assert m.bind_sender(4, receiver="A") == "registered"
    with pytest.raises(RoomConflict):
        m.bind_sender(4, receiver="B")
    assert m.stats["foreign_announcements"] == 1
    assert m.register_receiver(b.frame(8, "a8", n=2, identity="A"))
    assert m.bind_sender(8, receiver="C") == "registered"  # each such room is counted
    assert m.stats["foreign_announcements"] == 2 and m.stats["failed"] == 2


def test_a_named_receiver_owns_the_room_of_its_sender():
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1, receiver="alice")
    assert not m.register_receiver(rig.frame(1, "p1", 2, identity="mallory"))
    assert m.room_status(1) == "registered"
    assert m.register_receiver(rig.frame(1, "p2", 2, identity="alice"))
    assert m.room_status(1) == "ready"


def test_frames_for_a_room_of_another_peer_live_or_concluded_are_told_the_same():
    b = ManagerRig()
    m = b.m
    assert m.bind_sender(1, receiver="A") == "registered"
    b.announced_failed(2, "a2", "secret", identity="A")
    why = "room not open to this receiver"
    assert m.register_receiver(b.frame(1, "b1", identity="B")) is False
    assert m.register_receiver(b.frame(2, "b1", identity="B")) is False
    assert b.notices("b1") == [(1, "failed", why), (2, "failed", why)]
    assert m.stats["frames_foreign"] == 2 and m.stats["late_frames"] == 0
    assert m.room_status(1) == "registered"


def test_foreign_frames_are_told_failed_counted_and_warned_once_a_second(caplog):
    caplog.set_level(logging.WARNING, logger="epd_ring.manager")
    b = ManagerRig()
    m = b.m
    assert m.bind_sender(1, receiver="A") == "registered"
    assert m.register_receiver(b.frame(1, "b1", identity="B")) is False
    assert m.register_receiver(b.frame(1, "b2", identity="B")) is False
    assert m.stats["frames_foreign"] == 2
    why = "room not open to this receiver"
    assert b.notices("b1") == [(1, "failed", why)] and b.notices("b2") == [(1, "failed", why)]
    assert m.room_status(1) == "registered"
    b.clock.advance(0.5)
    assert m.withdraw(1, "b3", identity="B") == "refused"  # same key: held back too
    b.clock.advance(0.5)
    assert m.register_receiver(b.frame(1, "b4", identity="B")) is False
    # frames and withdraws from another identity share one line a second; the next counts those held back
    lines = log_lines(caplog)
    assert len(lines) == 2 and "another identity" in lines[0] and re.search(r"\b2 more\b", lines[1])
    b.clock.advance(1.0)
    assert m.withdraw(1, "b5", identity="B") == "refused"
    lines = log_lines(caplog)
    assert len(lines) == 3 and "withdraw" in lines[-1] and re.search(r"\broom 1\b", lines[-1])


def test_withdraw_of_another_peers_session_or_room_is_refused_and_counted(caplog):
    caplog.set_level(logging.WARNING, logger="epd_ring.manager")
    b = ManagerRig()
    m = b.m
    assert m.register_receiver(b.frame(1, "a1", n=2, identity="A"))  # A claims session a1 and room 1
    told = len(b.t.told)
    assert m.withdraw(2, "a1", identity="B") == "refused"  # A's session, no room
    assert m.withdraw(1, "b1", identity="B") == "refused"  # B's fresh session, A's room
    assert m.stats["withdraws"] == 2 and m.stats["withdraws_foreign"] == 2
    assert len(b.t.told) == told and m.room_status(1) == "announced"
    # one line per second for what a peer can provoke at will
    (line,) = log_lines(caplog)
    assert "withdraw" in line and re.search(r"\broom 2\b", line)
    assert m.withdraw(1, "a1", identity="A") == "failed"
    assert m.stats["withdraws"] == 3 and m.stats["withdraws_foreign"] == 2


# -- sessions: which identity names which ------------------------------------------------------

def test_frames_from_another_peers_session_get_no_answer(caplog):
    caplog.set_level(logging.WARNING, logger="epd_ring.manager")
    b = ManagerRig()
    m = b.m
    assert m.register_receiver(b.frame(1, "s1", n=2, identity="A"))
    told = list(b.t.told)
    assert m.register_receiver(b.frame(2, "s1", identity="B")) is False
    assert m.register_receiver(b.frame(1, "s1", n=2, identity="B")) is False
    assert b.t.told == told and m.room_status(2) is None and m.stats["frames_foreign"] == 2
    (line,) = log_lines(caplog)
    assert "session" in line


def test_a_frame_that_cannot_claim_its_session_is_told_why():
    b = ManagerRig()
    m = b.m
    m.tenancy.max_sessions = 1  # the bound on sessions in all, lowered to reach it
    assert m.register_receiver(b.frame(1, "a1", identity="A"))
    assert m.register_receiver(b.frame(2, "b1", identity="B")) is False
    assert b.notices("b1") == [(2, "failed", "too many receiver sessions (1)")]
    assert m.room_status(2) is None and m.stats["frames_foreign"] == 1


def test_a_session_belongs_to_the_first_peer_that_names_it():
    t = Tenancy()
    assert t.session_owner("a:1") is None and len(t) == 0
    assert t.claim("alice", "a:1") == "" and t.session_owner("a:1") == "alice"
    assert t.claim("alice", "a:1") == ""  # already hers: fine
    assert t.claim("bob", "a:1") == "session belongs to another receiver"
    assert t.session_owner("a:1") == "alice" and len(t) == 1
    assert t.claim("bob", "b:1") == "" and t.session_owner("b:1") == "bob" and len(t) == 2


def test_a_proven_owner_takes_one_session_and_the_first_claimant_keeps_its_others():
    t = Tenancy(max_sessions_per_identity=2)
    assert t.claim("alice", "a:1") == "" and t.claim("alice", "a:2") == ""
    assert t.claim("bob", "a:1", take=True) == ""  # a:1's memory proved it is bob's
    assert [t.session_owner(s) for s in ("a:1", "a:2")] == ["bob", "alice"] and len(t) == 2
    assert t.claim("alice", "a:2") == ""  # still hers, named again
    assert t.claim("alice", "a:3") == ""  # under her cap again: nothing of hers given up
    assert [t.session_owner(s) for s in ("a:1", "a:2", "a:3")] == ["bob", "alice", "alice"]
    assert t.claim("bob", "a:2", take=True) == "" and t.claim("bob", "a:3", take=True) == ""
    assert t.claim("alice", "a:4") == "" and t.session_owner("a:4") == "alice"  # her last one went: a fresh start


def test_a_peer_at_its_session_cap_gives_up_its_own_least_recently_named_session():
    t = Tenancy(max_sessions_per_identity=2)
    assert t.claim("alice", "a:1") == "" and t.claim("alice", "a:2") == "" and t.claim("bob", "b:1") == ""
    assert t.claim("alice", "a:1") == ""  # named again: a:2 is now her least recently named
    assert t.claim("alice", "a:3") == ""
    assert [t.session_owner(s) for s in ("a:1", "a:2", "a:3", "b:1")] == ["alice", None, "alice", "bob"]
    assert len(t) == 3
    assert t.claim("bob", "a:2") == ""  # released, so anyone may claim it now
    assert t.claim("alice", "a:4") == ""  # her oldest is a:1 now; bob's sessions are never touched
    assert [t.session_owner(s) for s in ("a:1", "a:2", "a:3", "a:4", "b:1")] == [None, "bob", "alice", "alice", "bob"]


def test_sessions_in_all_are_bounded_and_a_claim_past_the_bound_is_refused():
    t = Tenancy(max_sessions_per_identity=10, max_sessions=2)
    assert t.claim("alice", "a:1") == "" and t.claim("bob", "b:1") == ""
    assert t.claim("carol", "c:1") == "too many receiver sessions (2)"
    assert t.session_owner("c:1") is None and len(t) == 2
    assert t.claim("alice", "a:1") == ""  # an existing session is still fine


def test_tenancy_default_bounds():
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
