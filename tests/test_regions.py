"""Receive regions: the region machine, and when the encoder releases a region or acks a withdraw."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import ManagerRig, make_rig, reason_text

from epd_ring.executor import Outcome
from epd_ring.executor.core.regions import WITHDRAW_MAGIC, Reply, WithdrawError, withdraw_from_parts, withdraw_to_parts
from epd_ring.fsm import REGION, InvalidTransition


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


def test_timed_out_write_releases_only_when_its_extents_quarantine_ends():
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
    for _k, s in enumerate("ab"):
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


# -- withdraws in the manager ------------------------------------------------------------------

def test_a_receivers_withdraw_fails_its_room_for_everyone():
    b = ManagerRig()
    m = b.m
    assert m.register_receiver(b.frame(1, "p1", n=2))
    assert m.register_receiver(b.frame(1, "p2", n=2))
    assert m.withdraw(1, "p1") == "failed"
    reason = "receiver p1 withdrew"
    assert reason_text(m, 1) == reason
    assert b.notices("p1", 1) == [(1, "failed", reason), (1, "withdrawn", "")]
    assert b.notices("p2", 1) == [(1, "failed", reason), (1, "released", "")]


def test_withdraw_of_an_unknown_region_is_acked_to_the_address_given():
    b = ManagerRig()
    m = b.m
    assert m.withdraw(9, "x1", "tcp://10.0.0.1:7000", "C") == "acked"
    assert b.t.told[-1] == (Reply(9, "x1", "tcp://10.0.0.1:7000", "C"), 9, "withdrawn", "")
    assert m.withdraw(9, "x2") == "acked"
    reply = b.t.told[-1][0]
    assert (reply.room, reply.session, reply.status_endpoint, reply.identity) == (9, "x2", "", "")
    assert m.stats["withdraws"] == 2 and m.stats["told_withdrawn"] == 2
    # a live room the session has no frame in: acked too, and the room is untouched
    assert m.register_receiver(b.frame(4, "p4", n=2))
    assert m.withdraw(4, "x3", "tcp://10.0.0.1:7001") == "acked"
    assert b.t.told[-1] == (Reply(4, "x3", "tcp://10.0.0.1:7001", ""), 4, "withdrawn", "")
    assert m.room_status(4) == "announced"


def test_a_reopened_room_releases_regions_it_never_wrote_at_once():
    # Room 5 fails with A's write still in flight; A's session s1 is then released (A's
    # session cap of one) and claimed by B, whose request reopens room 5. When that room
    # fails before any write of its own, s1's region is free at once: the old write in
    # flight belongs to the previous room, not to this one.
    b = ManagerRig(max_sessions_per_identity=1)
    m = b.m
    assert m.bind_sender(5, receiver="A") == "registered"
    b.t.inject("hold")
    assert m.register_receiver(b.frame(5, "s1", identity="A"))
    assert m.submit_chunk(5, b.chunk()) and m.writes_in_flight == 1
    assert m.fail_room(5, "x")
    assert b.notices("s1") == [(5, "failed", "x")]  # its release waits for the write
    assert m.register_receiver(b.frame(6, "s2", n=2, identity="A"))  # A's oldest session, s1, is let go
    assert m.bind_sender(5, receiver="B") == "registered"
    assert m.register_receiver(b.frame(5, "s1", identity="B"))
    assert m.fail_room(5, "y")
    assert b.notices("s1") == [(5, "failed", "x"), (5, "failed", "y"), (5, "released", "")]


# -- the withdraw message (receiver -> encoder) ------------------------------------------------

def test_withdraw_parts_are_the_magic_the_decimal_room_and_the_two_strings():
    assert withdraw_to_parts(7, "10.0.0.2:17000", "tcp://10.0.0.2:5555") == [
        WITHDRAW_MAGIC, b"7", b"10.0.0.2:17000", b"tcp://10.0.0.2:5555"]
    assert withdraw_to_parts(1234, "s") == [WITHDRAW_MAGIC, b"1234", b"s", b""]  # no status endpoint


def test_withdraw_round_trips_to_a_reply_with_every_field():
    reply = withdraw_from_parts(withdraw_to_parts(7, "10.0.0.2:17000", "tcp://10.0.0.2:5555"))
    assert reply == Reply(7, "10.0.0.2:17000", "tcp://10.0.0.2:5555", "")
    assert type(reply.room) is int and reply.identity == ""  # the peer is the control plane's to fill in
    assert withdraw_from_parts(withdraw_to_parts(0, "s")) == Reply(0, "s", "", "")
    # Parts arrive as zmq frames or memoryviews as often as bytes.
    parts = [memoryview(p) for p in withdraw_to_parts(42, "a:1", "tcp://10.0.0.3:1")]
    assert withdraw_from_parts(parts) == Reply(42, "a:1", "tcp://10.0.0.3:1")


def test_withdraw_bounds_are_inclusive_at_their_limits():
    # A room of 20 decimal digits (a u64 fits in 20) is the longest accepted.
    assert withdraw_from_parts([WITHDRAW_MAGIC, b"9" * 20, b"s", b""]).room == int("9" * 20)
    # Session: at most 256 ASCII bytes; a status endpoint is numeric (no name lookup), so shorter.
    longest = b"tcp://[ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255]:65535"
    top = withdraw_from_parts([WITHDRAW_MAGIC, b"1", b"s" * 256, longest])
    assert top == Reply(1, "s" * 256, longest.decode())


@pytest.mark.parametrize("parts, field, echoed", [
    ([WITHDRAW_MAGIC, b"1", b"s"], "withdraw message", None),
    ([WITHDRAW_MAGIC, b"1", b"s", b"", b""], "withdraw message", None),
    ([b"epd-ring/withdraw/2", b"1", b"s", b""], "withdraw message", None),
    ([b"epd-ring/frame/1", WITHDRAW_MAGIC, b"s", b""], "withdraw message", None),
    ([WITHDRAW_MAGIC, b"", b"s", b""], "room", b""),
    ([WITHDRAW_MAGIC, b"-8", b"s", b""], "room", b"-8"),
    ([WITHDRAW_MAGIC, b"x" * 30, b"s", b""], "room", b"x" * 24),  # at most 24 bytes of it echoed
    ([WITHDRAW_MAGIC, b"1" * 21, b"s", b""], "room", b"1" * 21),
    ([WITHDRAW_MAGIC, b"1", b"s" * 257, b""], "session", None),
    ([WITHDRAW_MAGIC, b"1", "s\u00e9".encode(), b""], "session", None),
    ([WITHDRAW_MAGIC, b"1", b"s", b"e" * 257], "status_endpoint", None),
    ([WITHDRAW_MAGIC, b"1", b"s", b"\xff"], "status_endpoint", None),
    ([WITHDRAW_MAGIC, b"1", b"", b"e"], "session", None),
    # a host name would be looked up on libzmq's I/O thread (issue 21, attack 5)
    ([WITHDRAW_MAGIC, b"1", b"s", b"tcp://localhost:5555"], "status_endpoint", None),
    ([WITHDRAW_MAGIC, b"1", b"s", b"ipc:///tmp/x"], "status_endpoint", None),
])
def test_each_bad_withdraw_is_refused_naming_what_is_wrong(parts, field, echoed):
    with pytest.raises(WithdrawError) as err:
        withdraw_from_parts(parts)
    message = str(err.value)
    assert message.startswith(f"{field} ") or message.endswith(field)  # the bad part first, or the whole message
    if echoed is not None:
        assert message.endswith(repr(echoed))
    assert isinstance(err.value, ValueError)  # callers that catch ValueError refuse it too
