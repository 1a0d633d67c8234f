"""Tombstones: what is kept of a concluded room, how a live sender pins it out of the cap and the
TTL, and how the cap and the TTL age the rest out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers import ManagerRig, drive, make_rig, reason_text

from epd_ring.executor import EncodeManager

# -- pins --------------------------------------------------------------------------------------

def test_pinned_tombstone_is_found_before_the_capped_ones():
    b = ManagerRig(max_tombstones=1)
    m = b.m
    b.announced_failed(1, "p1", "first")
    assert m.bind_sender(1) == "failed"  # the sender binds to the failure: its record is pinned
    b.announced_failed(2, "p2", "second")  # fills the cap of one
    assert m.tombstone(1).state == "failed" and reason_text(m, 1) == "first"
    assert m.tombstone(2).state == "failed" and reason_text(m, 2) == "second"


def test_a_pinned_failure_leaves_the_cap_to_the_others():
    b = ManagerRig(max_tombstones=2)
    m = b.m
    b.announced_failed(0, "p0")
    b.announced_failed(1, "p1")
    assert m.bind_sender(1) == "failed"  # pinned: out of the cap while the sender lives
    b.announced_failed(2, "p2")
    # the cap of two holds rooms 0 and 2; room 1 is held by its sender
    assert [m.room_status(r) for r in (0, 1, 2)] == ["failed"] * 3


def test_a_failure_pinned_twice_stays_until_both_let_go():
    b = ManagerRig(max_tombstones=2)
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
    b = ManagerRig(max_tombstones=2)
    m = b.m
    b.announced_failed(5, "a1", "by A", identity="A")
    b.announced_failed(6, "a2", identity="A")
    # peer A's failure does not poison the room for peer B's request: a new room 5
    assert m.bind_sender(5, receiver="B") == "registered"
    assert m.fail_room(5, "by B")
    m.unbind_sender(5)
    b.announced_failed(7, "a3", identity="A")  # the cap evicts the oldest record: room 6, not the new 5
    assert m.room_status(6) is None
    assert reason_text(m, 5) == "by B" and m.tombstone(5).owner == "B"
    assert m.room_status(7) == "failed"


# -- the cap and the TTL -----------------------------------------------------------------------

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


def test_first_poll_trims_aged_tombstones():
    b = ManagerRig(tombstone_ttl=0.5)
    m = b.m
    b.announced_failed(1, "p1")
    b.clock.advance(0.6)
    m.poll()  # the first poll trims, whatever the time
    assert m.room_status(1) is None
    assert m.polled_at == 0.6


def test_default_tombstone_lifetime():
    b = ManagerRig()
    m = drive(EncodeManager(b.t, b.clock))  # the default lifetime
    b.m = m
    b.announced_failed(1, "p1")
    b.clock.advance(0.5)
    b.announced_failed(2, "p2")
    m.poll()
    b.clock.advance(600.0)  # room 1 is 600.5 s old, room 2 exactly 600 s
    m.poll()
    assert m.room_status(1) is None and m.room_status(2) == "failed"


def test_a_rooms_record_says_whether_a_sender_ever_came():
    """`has_sender` outlives the executor's sender: a reaped one is still on its room's tombstone."""
    b = ManagerRig()
    m = b.m
    assert not m.has_sender(7)  # no such room
    b.announced_failed(1, "p1")  # only a receiver came
    assert not m.has_sender(1)
    assert m.bind_sender(1) == "failed" and m.has_sender(1)  # a sender bound to the failure
    b.succeed(2, "p2")  # bound while open, then concluded
    assert m.has_sender(2)
    m.unbind_sender(2)  # reaped: the record lets go of it but remembers it came
    assert m.has_sender(2) and m.room_status(2) == "success"
    assert m.bind_sender(3) == "registered" and m.has_sender(3)  # live
