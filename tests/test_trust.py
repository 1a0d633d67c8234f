"""The attacks found by trying the controller as another peer would, on the sans-I/O core.

Each frame carries the identity its control plane authenticated (`peer`). A room takes frames
from one peer only: the one its sender names, else the first to claim it. Another peer's frame
can neither change, fail nor learn about that room, and may name only its own sessions. Every
test also checks the victim's bytes and that nothing else was lost.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_rig  # noqa: E402

from epd_ring.executor import FrameError  # noqa: E402
from epd_ring.executor.core.frames import check_frame, frame_from_parts, frame_to_parts  # noqa: E402

VICTIM, ATTACKER = "key-victim", "key-attacker"


def victim_room(rig, room, tokens=2, *, named=True, register=True):
    rid = f"req-{room}"
    rig.executor.register(rid, "prefill-host", 8998, room, receiver=VICTIM if named else None)
    item = rig.item(tokens, room)
    if register:
        rig.manager.register_receiver(rig.frame(room, "victim:1", tokens, peer=VICTIM))
    return rid, item


def run(rig, *pairs):
    rig.executor.execute(list(pairs))
    for _ in range(4):
        rig.executor.poll()


def untouched(rig, room, session):
    main, deep, _, _ = rig.buffers[(room, session)]
    return torch.isnan(main).all() and (deep is None or torch.isnan(deep).all())


@pytest.mark.parametrize("named", [True, False], ids=["named-at-bind", "claimed-by-first-frame"])
def test_another_peer_cannot_fail_a_room_whose_id_it_knows(named):
    rig = make_rig()
    rid, item = victim_room(rig, 7, named=named)
    for bad in (dict(n_receivers=0), dict(hidden=3), dict(n_tokens=-1)):  # malformed, or against the chunk
        rig.manager.register_receiver(rig.frame(7, "attacker:1", 2, peer=ATTACKER, **bad))
    run(rig, (rid, item))
    assert rig.manager.room_status(7) == "success"
    assert rig.delivered_ok(7, "victim:1", item)
    assert rig.receiver("victim:1").statuses(7) == ["success"]
    assert rig.manager.stats["frames_foreign"] + rig.manager.stats["frames_refused"] == 3


def test_registering_first_does_not_hijack_a_room_its_sender_named():
    rig = make_rig()
    rig.manager.register_receiver(rig.frame(7, "attacker:1", 2, peer=ATTACKER))  # before the sender
    assert rig.manager.room_status(7) == "announced"
    rid, item = victim_room(rig, 7)
    run(rig, (rid, item))
    assert rig.manager.room_status(7) == "success"
    assert rig.delivered_ok(7, "victim:1", item) and rig.receiver("victim:1").statuses(7) == ["success"]
    assert untouched(rig, 7, "attacker:1")
    assert rig.receiver("attacker:1").statuses(7) == ["failed"]  # as if its sender never came
    # And after the bind, an extra seat cannot be taken either.
    rid8, item8 = victim_room(rig, 8, register=False)
    rig.manager.register_receiver(rig.frame(8, "attacker:1", 2, peer=ATTACKER, n=2))
    rig.manager.register_receiver(rig.frame(8, "victim:1", 2, peer=VICTIM))
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
    deputy = rig.frame(2, "attacker:1", 2, peer=ATTACKER)._replace(session="victim:1", dst_ptr=main.data_ptr())
    assert not rig.manager.register_receiver(deputy)
    run(rig, ("req-2", rig.item(2, 99)))
    assert rig.delivered_ok(1, "victim:1", item1)  # not overwritten
    assert rig.receiver("victim:1").statuses(2) == []  # and not addressed about the attacker's room
    assert rig.manager.stats["frames_foreign"] == 1


@pytest.mark.parametrize("poison", ["malformed", "announce-and-expire", "conflicting-frames"])
def test_a_future_room_id_cannot_be_poisoned(poison):
    rig = make_rig(park_timeout=5.0)
    if poison == "malformed":
        rig.manager.register_receiver(rig.frame(9, "attacker:1", 2, peer=ATTACKER, n_receivers=0))
        assert rig.manager.room_status(9) is None  # nothing created
    elif poison == "announce-and-expire":
        rig.manager.register_receiver(rig.frame(9, "attacker:1", 2, peer=ATTACKER))
        rig.clock.advance(6.0)
        rig.executor.poll()
        assert rig.manager.room_status(9) == "failed"
    else:
        rig.manager.register_receiver(rig.frame(9, "attacker:1", 2, peer=ATTACKER, n=2))
        rig.manager.register_receiver(rig.frame(9, "attacker:2", 2, peer=ATTACKER, n=3))
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
    rig.manager.register_receiver(rig.frame(4, "attacker:1", 2, peer=ATTACKER))
    told = rig.receiver("attacker:1").notices
    assert [(n.status, n.reason) for n in told] == [("failed", "room not open to this receiver")]


def test_per_peer_announce_cap_keeps_other_peers_early_registrations():
    # Before: 4,096 bogus early frames locked every legitimate early registration out.
    rig = make_rig(max_announced=64, max_announced_per_peer=16)
    accepted = sum(rig.manager.register_receiver(rig.frame(1000 + k, "attacker:1", 1, peer=ATTACKER))
                   for k in range(200))
    assert accepted == 16
    assert rig.manager.register_receiver(rig.frame(5, "victim:1", 2, peer=VICTIM))  # early, before its sender
    rig.executor.register("req-5", "h", 1, 5, receiver=VICTIM)
    item = rig.item(2, 5)
    run(rig, ("req-5", item))
    assert rig.manager.room_status(5) == "success" and rig.delivered_ok(5, "victim:1", item)


def test_sessions_per_peer_are_bounded_and_released_oldest_first():
    rig = make_rig(max_sessions_per_peer=4)
    for k in range(10):
        rig.manager.register_receiver(rig.frame(100 + k, f"attacker:{k}", 1, peer=ATTACKER))
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
    assert rig.manager.withdraw(6, "victim:1", peer=ATTACKER) == "refused"
    assert rig.manager.room_status(6) == "ready"
    run(rig, (rid, item))
    assert rig.manager.room_status(6) == "success" and rig.delivered_ok(6, "victim:1", item)
    assert rig.receiver("victim:1").statuses(6) == ["success"]
