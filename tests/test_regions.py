"""Receive regions: the region machine, and when the encoder releases a region or acks a withdraw."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_rig  # noqa: E402

from epd_ring.executor import Outcome  # noqa: E402
from epd_ring.fsm import REGION, InvalidTransition  # noqa: E402


class Region:
    def __init__(self):
        self.state = REGION.initial


def walk(*events):
    r = Region()
    for e in events:
        REGION.step(r, e)
    return r.state


def test_region_machine_paths():
    assert walk("success", "consume") == "released"
    assert walk("failure", "release") == "released"
    assert walk("withdraw", "failure", "ack") == "released"
    assert walk("withdraw", "success", "ack") == "released"
    assert walk("withdraw", "release", "ack") == "released"  # a release that crossed the withdraw
    assert REGION.states_tagged("free") == ("released",)


@pytest.mark.parametrize("events", [("success", "success"), ("success", "failure"), ("failure", "success"),
                                    ("failure", "consume"), ("success", "release"), ("offered", "ack")[1:],
                                    ("failure", "withdraw")])
def test_region_machine_refuses_a_second_outcome_and_early_reuse(events):
    with pytest.raises(InvalidTransition, match="region machine"):
        walk(*events)


def _one(rig, room, session="p", n=1, fault=None, **kw):
    rid = f"req-{room}"
    rig.executor.register(rid, "h", 1, room)
    if fault:
        rig.transport.inject(fault, session=session, **kw)
    rig.manager.register_receiver(rig.frame(room, session, 2, n=n))
    rig.executor.execute([(rid, rig.item(2, room))])
    return rid


def test_success_releases_by_itself():
    rig = make_rig()
    _one(rig, 1)
    rig.executor.poll()
    assert rig.receiver("p").statuses(1) == ["success"] and rig.receiver("p").releases(1) == []


def test_failure_before_any_write_releases_at_once():
    rig = make_rig()
    rig.executor.register("r", "h", 1, 1)
    rig.manager.register_receiver(rig.frame(1, "p", 2))
    rig.executor.fail_rooms(["r"], "client abort")
    assert rig.receiver("p").notices[0].status == "failed"
    assert rig.receiver("p").releases(1) == ["released"]


def test_timed_out_write_releases_only_when_its_slots_quarantine_ends():
    rig = make_rig(quarantine_s=5.0)
    _one(rig, 1, fault="timeout_land_later", delay=1.0, land_after=3.0)
    rig.clock.advance(1.0)
    rig.executor.poll()
    p = rig.receiver("p")
    assert p.statuses(1) == ["failed"] and p.releases(1) == []  # the write may still land
    rig.clock.advance(4.9)
    rig.executor.poll()
    assert p.releases(1) == []
    rig.clock.advance(0.2)
    rig.executor.poll()
    assert p.releases(1) == ["released"]
    assert p.notices[-1].time >= 1.0 + 5.0  # not before the quarantine's value


def test_overdue_write_releases_after_it_reports_and_its_quarantine():
    rig = make_rig(write_timeout=2.0, quarantine_s=5.0)
    _one(rig, 1, fault="hold")
    (h,) = rig.transport.held
    rig.clock.advance(2.0)
    rig.executor.poll()
    p = rig.receiver("p")
    assert p.statuses(1) == ["failed"] and p.releases(1) == []
    rig.clock.advance(100.0)
    rig.executor.poll()
    assert p.releases(1) == []  # still in flight: it may land whenever it reports
    rig.transport.complete(h, Outcome.TIMED_OUT)
    rig.executor.poll()
    assert p.releases(1) == []
    rig.clock.advance(5.0)
    rig.executor.poll()
    assert p.releases(1) == ["released"]


def test_done_write_of_a_failed_room_releases_when_it_reports():
    rig = make_rig(write_timeout=2.0)
    _one(rig, 1, fault="hold")
    (h,) = rig.transport.held
    rig.clock.advance(2.0)
    rig.executor.poll()
    rig.transport.complete(h, Outcome.DONE)
    rig.executor.poll()
    assert rig.receiver("p").releases(1) == ["released"]


def test_other_receivers_region_released_at_once_when_one_write_fails():
    rig = make_rig(quarantine_s=5.0)
    rig.executor.register("r", "h", 1, 1)
    rig.transport.inject("fail", session="a")
    for k, s in enumerate("ab"):
        rig.manager.register_receiver(rig.frame(1, s, 2, n=2))
    rig.executor.execute([("r", rig.item(2, 1))])
    rig.executor.poll()
    assert rig.receiver("a").statuses(1) == ["failed"] == rig.receiver("b").statuses(1)
    assert rig.receiver("b").releases(1) == ["released"] and rig.receiver("a").releases(1) == []
    rig.clock.advance(5.0)
    rig.executor.poll()
    assert rig.receiver("a").releases(1) == ["released"]


def test_withdraw_fails_a_live_room_and_is_acked_once_nothing_can_land():
    rig = make_rig(quarantine_s=5.0)
    rig.executor.register("r", "h", 1, 1)
    rig.transport.inject("hold", count=2)
    for s in "ab":
        rig.manager.register_receiver(rig.frame(1, s, 2, n=2))
    rig.executor.execute([("r", rig.item(2, 1))])
    held = rig.transport.held
    assert rig.manager.withdraw(1, "a") == "failed"
    a, b = rig.receiver("a"), rig.receiver("b")
    assert a.statuses(1) == ["failed"] == b.statuses(1) and a.releases(1) == [] == b.releases(1)
    rig.transport.complete(held[0], Outcome.DONE)
    rig.transport.complete(held[1], Outcome.TIMED_OUT)
    rig.executor.poll()
    assert a.releases(1) == ["withdrawn"] and b.releases(1) == []  # b's write may still land
    rig.clock.advance(5.0)
    rig.executor.poll()
    assert b.releases(1) == ["released"] and a.releases(1) == ["withdrawn"]


def test_withdraw_of_a_concluded_or_unknown_region_is_acked_at_once():
    rig = make_rig()
    _one(rig, 1)
    rig.executor.poll()
    assert rig.manager.withdraw(1, "p") == "acked"
    assert rig.receiver("p").statuses(1) == ["success"] and rig.receiver("p").releases(1) == ["withdrawn"]
    rig.receiver("q")
    assert rig.manager.withdraw(7, "q") == "acked" and rig.receiver("q").releases(7) == ["withdrawn"]


def test_withdraw_of_an_open_region_replaces_its_release_by_the_ack():
    rig = make_rig(quarantine_s=5.0)
    _one(rig, 1, fault="fail")
    rig.executor.poll()
    assert rig.manager.withdraw(1, "p") == "deferred"
    rig.clock.advance(5.0)
    rig.executor.poll()
    assert rig.receiver("p").releases(1) == ["withdrawn"]


def test_a_room_with_a_region_a_write_may_land_in_keeps_its_record():
    """Past the cap and its sender, the record stays until the last release: a re-sent frame finds it."""
    rig = make_rig(quarantine_s=5.0, max_tombstones=1)
    _one(rig, 1, fault="fail")
    rig.executor.poll()
    rig.executor.reap_concluded_senders(set())
    for r in (2, 3):
        rig.executor.register(f"req-{r}", "h", 1, r)
        rig.executor.fail_rooms([f"req-{r}"], "client abort")
        rig.executor.reap_concluded_senders(set())
    assert rig.manager.room_status(1) == "failed" and 1 in rig.manager.pinned
    rig.manager.register_receiver(rig.frame(1, "p", 2))  # re-sent while a write may still land
    p = rig.receiver("p")
    assert p.statuses(1) == ["failed", "failed"] and p.releases(1) == []
    rig.clock.advance(5.0)
    rig.executor.poll()
    assert p.releases(1) == ["released"] and 1 not in rig.manager.pinned


def test_reference_receiver_reuses_memory_only_once_released():
    """The receiver's bookkeeping without its engine: notices step regions; memory returns on release."""
    pytest.importorskip("zmq")
    from epd_ring.executor.drivers.receiver import Extents, ReferenceReceiver, Region

    ext = Extents(256)
    a, b = ext.take(64), ext.take(100)
    assert (a, b) == (0, 64) and ext.take(64) == 192
    with pytest.raises(MemoryError):
        ext.take(1)
    ext.give(b, 100)
    ext.give(a, 64)
    assert ext.free == [(0, 192)] and ext.take(192) == 0

    r = object.__new__(ReferenceReceiver)
    r._extents, r.regions, r.status, r.notices, r.protocol_errors = Extents(1024), {}, {}, {}, []
    for room in (1, 2, 3):
        r.regions[room] = Region(room, [(r._extents.take(64), 64)])
    r.on_notice(1, "failed")
    assert r.regions[1].state == "failed" and r._extents.take(64) == 192  # not 0: region 1 still held
    r.on_notice(1, "released")
    assert 1 not in r.regions and r._extents.take(64) == 0
    r.on_notice(2, "success")
    r.on_notice(2, "success")  # told twice: recorded, not obeyed
    assert r.regions[2].state == "written" and "success" in r.protocol_errors[0]
    r.regions[3].state = "withdrawing"
    r.on_notice(3, "failed")
    r.on_notice(3, "withdrawn")
    assert 3 not in r.regions and r.status == {1: ["failed"], 2: ["success", "success"], 3: ["failed"]}
