"""Graceful drain: `pump.close(timeout, idle)` stops intake, tells every room, waits out writes and
quarantines, then retires the ring, unregisters it and closes the transport."""

from __future__ import annotations

import pytest
import torch
from helpers import make_rig, reason_kind

from epd_ring.executor import EncodeExecutor, Outcome
from epd_ring.executor.core.drain import DEADLINE, DRAINING, Drain, DrainReport
from epd_ring.executor.core.reasons import ReasonKind


def _told(rig, session: str, room: int) -> list[tuple[str, str]]:
    """The outcomes a receiver was told (not region notices such as `released`)."""
    return [(n.status, n.reason) for n in rig.transport.receivers[session].notices
            if n.room == room and n.status in ("success", "failed")]


def test_drain_tells_every_room_waits_out_writes_and_lets_go_of_the_ring():
    rig = make_rig(extents=3, extent_bytes=128, quarantine_s=1.0, park_timeout=10.0, write_timeout=5.0)
    ex, manager, transport, clock = rig.executor, rig.manager, rig.transport, rig.clock
    items = {}

    def start(room: int, sessions: list[str], registered: int | None = None, execute: bool = True):
        items[room] = rig.item(4, seed=room)
        ex.register(f"r{room}", "h", 1, room)
        for k, s in enumerate(sessions[:len(sessions) if registered is None else registered]):
            manager.register_receiver(rig.frame(room, s, 4, n=len(sessions), rank=k, shard=True))
        if execute:
            ex.execute([(f"r{room}", items[room])])

    transport.inject("hold", session="a")  # A: its write is in flight when the drain starts
    start(1, ["a"])
    transport.inject("timeout_land_later", session="b", delay=0.1, land_after=0.8)  # B: reports, lands later
    start(2, ["b"])
    start(3, ["c0", "c1"], registered=1)  # C: parked, one of two receivers
    start(4, ["d"])  # D: the ring is full, so its send is deferred
    assert ex.has_deferred() and manager.room_status(3) == "parked"
    start(5, ["e"], execute=False)  # E: registered and ready, its tower run not yet done
    manager.register_receiver(rig.frame(6, "f", 4))  # F: a receiver came, its sender never did
    (held,) = transport.held

    ex.begin_close(3.0)
    # Intake has stopped: a new request fails at once, a new receiver is told at the next poll.
    ex.register("r7", "h", 1, 7)
    assert manager.room_status(7) == "failed" and manager.failure_reason(7) == DRAINING
    manager.register_receiver(rig.frame(8, "g", 4))
    ex.execute([("r5", items[5])])  # the tower finished for E: nothing is written for a failed room
    landed_during_drain = []

    def idle():
        clock.advance(0.05)
        if abs(clock.now() - 0.3) < 1e-9:
            transport.complete(held)  # A's write finishes during the drain
        landed_during_drain.append(transport.late_landings)

    report = ex.close(3.0, idle)

    assert report.clean and ex.closed, report
    assert report.rooms_failed == 6 and report.rooms_finished == 2  # C D E F + the late frame G, r7; A and B
    assert manager.room_status(1) == "success" and _told(rig, "a", 1) == [("success", "")]
    assert manager.room_status(2) == "failed"
    for room, session in ((3, "c0"), (4, "d"), (5, "e"), (6, "f"), (8, "g")):
        assert manager.failure_reason(room) == DRAINING, room
        assert _told(rig, session, room) == [("failed", DRAINING)], room
    # B's write timed out, then landed during the drain: only its own room's bytes, in its own buffer.
    assert transport.late_landings == 1 and landed_during_drain[-1] == 1
    assert rig.delivered_ok(2, "b", items[2])
    assert torch.isnan(rig.buffers[(4, "d")][0]).all()  # D's deferred send was never written
    # After the drain: no extent leased, no room live, nothing registered, the transport closed.
    assert set(ex.ring.counts()) == {"retired"} and ex.ring.lease(1) is None
    assert not manager.rooms and manager.writes_in_flight == 0 and not ex.has_deferred()
    assert len(transport.local) == 0 and transport.closed
    assert transport.submitted == 2  # A and B only
    # A request after the drain fails; it never raises into the loop.
    ex.register("r9", "h", 1, 9)
    assert manager.room_status(9) == "failed"


def test_drain_deadline_fails_rooms_in_flight_and_keeps_the_ring_until_the_write_reports():
    rig = make_rig(extents=2, extent_bytes=128, quarantine_s=0.5)
    ex, manager, transport, clock = rig.executor, rig.manager, rig.transport, rig.clock
    transport.inject("hold", session="a")
    item = rig.item(4, seed=1)
    ex.register("r1", "h", 1, 1)
    manager.register_receiver(rig.frame(1, "a", 4))
    ex.execute([("r1", item)])
    (held,) = transport.held

    report = ex.close(1.0, lambda: clock.advance(0.1))

    assert not report.clean and not ex.closed
    assert report.busy_extents == {"sending": 1} and report.writes_in_flight == 1
    assert manager.failure_reason(1) == DEADLINE and _told(rig, "a", 1) == [("failed", DEADLINE)]
    assert len(transport.local) == 1 and not transport.closed  # a write may still read the ring: kept
    transport.complete(held, Outcome.TIMED_OUT)  # the write reports at last, unsure: it may still land
    ex.poll()
    assert manager.writes_in_flight == 0 and not ex.closed  # its extent serves a quarantine first
    clock.advance(0.5)
    ex.poll()
    assert ex.closed and set(ex.ring.counts()) == {"retired"} and len(transport.local) == 0


def test_close_of_an_idle_executor_is_immediate():
    rig = make_rig(extents=2, extent_bytes=128)
    calls = []
    report = rig.executor.close(5.0, lambda: calls.append(1))
    assert report.clean and not calls and rig.transport.closed


# -- what a drain counts, and when it is done --------------------------------------------------

def _send(rig, room: int, session: str, *, execute: bool = True, ex=None):
    """Register room `room` with one receiver `session` (4 rows) and, by default, run its item."""
    ex = ex or rig.executor
    item = rig.item(4, seed=room)
    ex.register(f"r{room}", "h", 1, room)
    rig.manager.register_receiver(rig.frame(room, session, 4))
    if execute:
        ex.execute([(f"r{room}", item)])
    return item


def test_a_room_that_finishes_during_the_drain_counts_as_finished_not_failed():
    rig = make_rig(extents=2, extent_bytes=128)
    ex, transport = rig.executor, rig.transport
    transport.inject("hold", session="a")
    item = _send(rig, 1, "a")
    (held,) = transport.held
    ex.begin_close(2.0)
    assert ex.closed is False  # a write is in flight: the ring is kept
    transport.complete(held)
    report = ex.close(2.0, lambda: rig.clock.advance(0.5))
    # Nothing was failed by this drain; the one room concluded on its own.
    assert report == DrainReport(clean=True, rooms_failed=0, rooms_finished=1, busy_extents={},
                                 writes_in_flight=0, live_rooms=0)
    assert ex.closed is True and rig.delivered_ok(1, "a", item)


def test_the_drain_deadline_is_reached_at_the_exact_instant():
    rig = make_rig(extents=2, extent_bytes=128, quarantine_s=0.5)
    ex, manager, transport, clock = rig.executor, rig.manager, rig.transport, rig.clock
    transport.inject("hold", session="a")
    _send(rig, 1, "a")
    ex.begin_close(1.0)
    assert manager.room_status(1) == "transferring"
    clock.advance(1.0)  # now == deadline: the deadline has passed
    ex.poll()
    assert reason_kind(manager, 1) is ReasonKind.DRAIN_DEADLINE
    report = ex.close(1.0, lambda: pytest.fail("no idle wait once the deadline is reached"))
    assert report == DrainReport(clean=False, rooms_failed=1, rooms_finished=0, busy_extents={"sending": 1},
                                 writes_in_flight=1, live_rooms=0)
    assert report.clean is False and ex.closed is False
    assert not transport.closed and len(transport.local) == 1  # the ring stays registered


def test_every_deferred_send_the_drain_drops_is_counted():
    rig = make_rig(extents=1, extent_bytes=128)
    ex, manager, transport = rig.executor, rig.manager, rig.transport
    transport.inject("hold", session="a")
    transport.inject("hold", session="c")
    _send(rig, 1, "a")  # A holds the only extent
    for room, session in ((2, "b"), (3, "c"), (4, "d")):
        _send(rig, room, session)  # B, C, D wait for the extent
    assert ex.stats["deferred"] == 3
    assert ex.fail_rooms(["r2"], "cancelled by the engine") == 1
    assert ex.reap_concluded_senders() == 1  # B's sender is gone: its deferred send will be dropped
    (held_a,) = transport.held
    transport.complete(held_a)
    ex.poll()  # A's extent is free: B's send is dropped (no sender), C's is staged and written
    assert ex.stats["deferred_dropped"] == 1 and manager.room_status(3) == "transferring"
    assert manager.room_status(4) == "ready" and ex.has_deferred()
    ex.begin_close(5.0)  # D's room fails and its deferred send is dropped too
    assert ex.stats["deferred_dropped"] == 2 and not ex.has_deferred()
    assert reason_kind(manager, 4) is ReasonKind.DRAINING and rig.receiver("d").statuses(4) == ["failed"]
    assert torch.isnan(rig.buffers[(4, "d")][0]).all()  # never written
    (held_c,) = transport.held
    transport.complete(held_c)
    report = ex.close(5.0, lambda: rig.clock.advance(0.1))
    assert report == DrainReport(clean=True, rooms_failed=1, rooms_finished=1)


def test_drain_step_is_true_exactly_once_the_ring_is_let_go_and_stays_true():
    rig = make_rig(extents=2, extent_bytes=128)
    ex, transport = rig.executor, rig.transport
    transport.inject("hold", session="a")
    _send(rig, 1, "a")
    (held,) = transport.held
    drain = Drain(ex, rig.clock.now() + 5.0, close_transport=False)
    assert drain.step() is False and drain.done is False  # the write may still read its extent
    assert drain.report() == DrainReport(clean=False, rooms_failed=0, rooms_finished=0,
                                         busy_extents={"sending": 1}, writes_in_flight=1, live_rooms=1)
    transport.complete(held)
    rig.manager.poll()
    assert drain.step() is True and drain.done is True
    assert drain.step() is True  # a later step changes nothing and still says so
    assert ex.pump.flush() == 1  # the step decided one Release (only once): the pump does it
    assert drain.report() == DrainReport(clean=True, rooms_failed=0, rooms_finished=1)
    assert set(ex.ring.counts()) == {"retired"} and len(transport.local) == 0
    assert not transport.closed  # close_transport=False: the transport is the caller's


def test_the_drain_waits_for_writes_and_rooms_of_a_shared_manager_before_closing_its_transport():
    """Two executors (two rings) on one manager and transport: the drain of one must not close the
    transport while the manager still has a live room or a write in flight on the other's ring."""
    rig = make_rig(extents=1, extent_bytes=128)
    ex1, manager, transport = rig.executor, rig.manager, rig.transport
    ex2 = EncodeExecutor(manager, rig.tower, "cpu", ring_slots=1, ring_bytes=4096)
    transport.add_receiver("slow")
    transport.inject_contact("hang", session="slow")
    _send(rig, 1, "slow", ex=ex2)  # staged on ex2's ring, waiting for its peer; no write yet
    assert manager.room_status(1) == "transferring" and manager.writes_in_flight == 0
    ex1.begin_close(5.0)
    assert ex1.closed is False and not transport.closed  # room 1 is live
    transport.answer("slow", True)
    transport.inject("hold", session="slow")
    ex2.poll()  # the peer is up: room 1's write starts and is held
    assert manager.writes_in_flight == 1
    rig.clock.advance(5.0)
    report = ex1.close(5.0, lambda: pytest.fail("no idle wait once the deadline is reached"))
    assert reason_kind(manager, 1) is ReasonKind.DRAIN_DEADLINE and not manager.rooms  # failed, its write still out
    assert report == DrainReport(clean=False, rooms_failed=1, rooms_finished=0, busy_extents={},
                                 writes_in_flight=1, live_rooms=0)
    assert ex1.closed is False and not transport.closed
    (held,) = transport.held
    transport.complete(held)
    ex1.poll()
    assert ex1.closed is True and transport.closed


# -- close: its timeout and its transport ------------------------------------------------------

def test_close_rejects_a_negative_timeout():
    rig = make_rig()
    with pytest.raises(ValueError, match=r"^timeout\b.*-1$"):
        rig.executor.begin_close(-1)


@pytest.mark.parametrize("timeout", [0, 0.5])
def test_close_with_a_short_timeout_on_an_idle_worker_is_clean(timeout):
    rig = make_rig()
    report = rig.executor.close(timeout, idle=lambda: rig.clock.advance(0.1))
    assert report.clean and rig.executor.closed and rig.transport.closed


def test_close_can_leave_the_transport_open():
    rig = make_rig()
    report = rig.executor.close(1.0, idle=lambda: rig.clock.advance(0.1), close_transport=False)
    assert report.clean and rig.executor.closed and not rig.transport.closed


def test_close_stops_polling_once_its_timeout_has_passed():
    rig = make_rig()
    ex = rig.executor
    rig.held_room(1)
    idles = []

    def idle():
        idles.append(rig.clock.now())
        rig.clock.advance(0.5)

    report = ex.close(1.0, idle)
    # Polled at 0, 0.5 and 1.0; at 1.0 the deadline has passed, so no more idling.
    assert idles == [0.0, 0.5] and rig.clock.now() == 1.0
    assert not report.clean and report.rooms_failed == 1 and report.writes_in_flight == 1
    assert report.busy_extents == {"sending": 1}


def test_a_request_registered_while_draining_fails_at_once():
    rig = make_rig()
    ex, m, t = rig.executor, rig.manager, rig.transport
    rig.held_room(1)
    ex.begin_close(10.0)
    ex.register("late", "prefill-host", 8998, 2)
    assert reason_kind(m, 2) is ReasonKind.DRAINING
    assert ex.reap_concluded_senders() == 1
    t.complete(t.held[0])
    ex.poll()
    report = ex.close(10.0, idle=lambda: rig.clock.advance(1.0))
    assert report.clean and (report.rooms_failed, report.rooms_finished) == (1, 1)


def test_demo_drains_on_sigterm_and_ctrl_c(tmp_path):
    import json
    import signal
    import subprocess
    import sys

    for sig, code, name in ((signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")):
        picture = tmp_path / f"{name}.svg"
        proc = subprocess.Popen([sys.executable, "-m", "epd_ring", "demo", "--rooms", "6000", "--json",
                                 "--log-level", "info", "--timeline", str(picture)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert "INFO" in proc.stderr.readline()  # the run is under way (a room failed by injection)
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=600)  # a hang guard only: the drain itself is bounded
        finally:
            proc.kill()
        assert proc.returncode == code, err[-2000:]
        report = json.loads(out)
        assert report["interrupted"] == name and report["drain"]["clean"] is True
        assert report["drain"]["live_rooms"] == 0 and report["drain"]["writes_in_flight"] == 0
        assert report["rooms_concluded_before"] < report["rooms"]
        svg = picture.read_text()  # the picture of the interrupted run ends with the arena retired
        assert "drained after" in svg and "arena: retired" in svg


def test_a_pump_on_a_manager_alone_has_no_ring_to_drain():
    from helpers import managed

    from epd_ring.executor import Pump

    _, t, m = managed()
    with pytest.raises(TypeError):
        Pump(m.core, t).close(1.0, lambda: None)
