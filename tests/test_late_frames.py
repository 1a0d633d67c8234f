"""A frame for a room that already concluded gets that room's outcome, counted once each
(the fast unit suites did not pin this down: tests/mutation/equivalent.md, `_tell_late`)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from helpers import ManagerRig, make_rig

from epd_ring.executor import Outcome


def submit(rig, room, n_tokens):
    rid = f"req-{room}"
    rig.executor.register(rid, "prefill-host", 8998, room)
    return rid, rig.item(n_tokens, room)


def outcomes(rig, session, room):
    return [(n.status, n.reason) for n in rig.receiver(session).notices
            if n.room == room and n.status in ("success", "failed")]


def test_late_frames_hear_the_outcome_their_room_had():
    rig = make_rig()
    rid, item = submit(rig, 1, 2)
    rig.manager.register_receiver(rig.frame(1, "p1", 2))
    rig.executor.execute([(rid, item)])
    rig.executor.poll()
    assert rig.manager.room_status(1) == "success"
    assert outcomes(rig, "p1", 1) == [("success", "")]
    late = rig.manager.stats["late_frames"]

    # the receiver the room was written to asks again: Success again
    rig.manager.register_receiver(rig.frame(1, "p1", 2))
    assert [s for s, _ in outcomes(rig, "p1", 1)] == ["success", "success"]
    # a receiver the room never had: Failed, and why
    rig.manager.register_receiver(rig.frame(1, "stranger", 2))
    assert outcomes(rig, "stranger", 1) == [("failed", "room already concluded without this receiver")]
    assert rig.manager.stats["late_frames"] == late + 2

    # a failed room: every late receiver hears Failed with the room's own reason
    submit(rig, 2, 2)
    assert not rig.manager.register_receiver(rig.frame(2, "bad", 2, n_tokens=-3))
    assert rig.manager.room_status(2) == "failed"
    reason = rig.manager.failure_reason(2)
    assert reason and "malformed" in reason
    rig.manager.register_receiver(rig.frame(2, "late", 2))
    assert outcomes(rig, "late", 2) == [("failed", reason)]
    assert rig.manager.stats["late_frames"] == late + 3


# -- answered from the tombstone ---------------------------------------------------------------

def test_late_frames_are_answered_from_the_tombstone():
    b = ManagerRig()
    m = b.m
    b.announced_failed(1, "p1", "gone")
    assert m.register_receiver(b.frame(1, "p2")) is True
    assert b.notices("p2") == [(1, "failed", "gone"), (1, "released", "")]
    assert m.stats["late_frames"] == 1 and m.rooms == {}


def test_late_frames_hear_the_outcome_they_may_know():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    # a room that failed before any frame came: nobody's, so its reason is nobody's
    rig.executor.register("req-1", "prefill-host", 8998, 1)
    m.fail_room(1, "client abort")
    m.register_receiver(rig.frame(1, "late", 2))
    assert rig.told("late", 1) == [("failed", "room already concluded without this receiver"), ("released", "")]
    # a room that failed while a write into a's region was in flight: a's frame, sent again,
    # hears the reason, and its release still waits for that write
    t.inject("hold", count=2)
    for s in ("a", "b"):
        m.register_receiver(rig.frame(2, s, 2, n=2))
    rig.send(2)
    h_a, h_b = t.held
    t.complete(h_b, Outcome.FAILED)
    m.poll()
    frame_a = rig.frame(2, "a", 2, n=2)
    assert m.register_receiver(frame_a)
    reason = "write to receiver b failed"
    assert rig.told("a", 2) == [("failed", reason), ("failed", reason)]
    t.complete(h_a, Outcome.DONE)
    m.poll()
    assert rig.told("a", 2)[-1] == ("released", "")
