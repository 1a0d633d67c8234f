"""Graceful drain: `executor.close(timeout, idle)` stops intake, tells every room, waits out writes and
quarantines, then retires the ring, unregisters it and closes the transport."""

from __future__ import annotations

import torch

from epd_ring.executor import Outcome
from epd_ring.executor.core.drain import DEADLINE, DRAINING

from helpers import make_rig


def _told(rig, session: str, room: int) -> list[tuple[str, str]]:
    """The outcomes a receiver was told (not region notices such as `released`)."""
    return [(n.status, n.reason) for n in rig.transport.receivers[session].notices
            if n.room == room and n.status in ("success", "failed")]


def test_drain_tells_every_room_waits_out_writes_and_lets_go_of_the_ring():
    rig = make_rig(slots=3, quarantine_s=1.0, park_timeout=10.0, write_timeout=5.0)
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
    # After the drain: no slot leased, no room live, nothing registered, the transport closed.
    assert set(ex.ring.counts()) == {"retired"} and not ex.ring.has_free()
    assert not manager.rooms and manager.writes_in_flight == 0 and not ex.has_deferred()
    assert len(transport.local) == 0 and transport.closed
    assert transport.submitted == 2  # A and B only
    # A request after the drain fails; it never raises into the loop.
    ex.register("r9", "h", 1, 9)
    assert manager.room_status(9) == "failed"


def test_drain_deadline_fails_rooms_in_flight_and_keeps_the_ring_until_the_write_reports():
    rig = make_rig(slots=2, quarantine_s=0.5)
    ex, manager, transport, clock = rig.executor, rig.manager, rig.transport, rig.clock
    transport.inject("hold", session="a")
    item = rig.item(4, seed=1)
    ex.register("r1", "h", 1, 1)
    manager.register_receiver(rig.frame(1, "a", 4))
    ex.execute([("r1", item)])
    (held,) = transport.held

    report = ex.close(1.0, lambda: clock.advance(0.1))

    assert not report.clean and not ex.closed
    assert report.busy_slots == {"sending": 1} and report.writes_in_flight == 1
    assert manager.failure_reason(1) == DEADLINE and _told(rig, "a", 1) == [("failed", DEADLINE)]
    assert len(transport.local) == 2 and not transport.closed  # a write may still read the ring: kept
    transport.complete(held, Outcome.TIMED_OUT)  # the write reports at last, unsure: it may still land
    ex.poll()
    assert manager.writes_in_flight == 0 and not ex.closed  # its slot serves a quarantine first
    clock.advance(0.5)
    ex.poll()
    assert ex.closed and set(ex.ring.counts()) == {"retired"} and len(transport.local) == 0


def test_close_of_an_idle_executor_is_immediate():
    rig = make_rig(slots=2)
    calls = []
    report = rig.executor.close(5.0, lambda: calls.append(1))
    assert report.clean and not calls and rig.transport.closed


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
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == code, err[-2000:]
        report = json.loads(out)
        assert report["interrupted"] == name and report["drain"]["clean"] is True
        assert report["drain"]["live_rooms"] == 0 and report["drain"]["writes_in_flight"] == 0
        assert report["rooms_concluded_before"] < report["rooms"]
        svg = picture.read_text()  # the picture of the interrupted run ends with every slot retired
        assert "drained after" in svg and "slot 0: retired" in svg
