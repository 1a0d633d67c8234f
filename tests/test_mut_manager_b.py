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
