"""Writes: how a room's chunk becomes writes (shards, deepstack rows, receivers that take no rows),
their outcomes (refused submits, reports that are not ours, handles), write deadlines, and the
quarantine of an extent whose write may still land."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers import AddressedLoopback, ManagerRig, drive, make_rig, reason_kind, reason_text

from epd_ring.executor import EncodeManager, LoopbackTransport, Outcome, Ring
from epd_ring.executor.core.reasons import ReasonKind
from epd_ring.executor.core.transport import Transport

# -- from a chunk to writes --------------------------------------------------------------------

def test_a_zero_row_shard_is_skipped_not_the_end_of_the_writes():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    # one row over two receivers: rank 1 takes none; it registers first
    m.register_receiver(rig.frame(1, "r1", 1, n=2, rank=1, shard=True))
    m.register_receiver(rig.frame(1, "r0", 1, n=2, rank=0, shard=True))
    rig.send(1, n_tokens=1)
    m.poll()
    assert m.room_status(1) == "success"
    assert t.submitted == 1
    assert rig.delivered_ok(1, "r0", rig.item(1, 1))


def test_deepstack_shards_take_their_own_rows_of_the_deep_extent():
    rig = make_rig(n_deep=2)
    m = rig.manager
    for rank in (0, 1):
        m.register_receiver(rig.frame(1, f"r{rank}", 4, n=2, rank=rank, shard=True))
    rig.send(1, n_tokens=4)
    m.poll()
    assert m.room_status(1) == "success"
    for rank in (0, 1):
        assert rig.delivered_ok(1, f"r{rank}", rig.item(4, 1))


def test_a_room_whose_receivers_take_no_rows_succeeds_without_a_write():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    m.register_receiver(rig.frame(1, "a", 2, n_tokens=0))  # an empty row range of a 2-row chunk
    rig.send(1)
    assert m.room_status(1) == "success"  # at once: nothing to wait for
    assert t.submitted == 0
    assert rig.executor.ring.live == 0
    assert rig.told("a", 1) == [("success", "")]
    assert m.stats["success"] == 1


# -- outcomes ----------------------------------------------------------------------------------

def test_poll_takes_the_outcomes_of_writes_the_transport_refused_with_its_own():
    rig = make_rig(quarantine_s=5.0)
    m, t, clock = rig.manager, rig.transport, rig.clock
    refused = {"b", "c", "d"}
    submit = t.submit_write

    def refusing(session, bufs):  # a transport must not raise here; one that does fails that write only
        if session in refused:
            raise RuntimeError("engine refused the write")
        return submit(session, bufs)

    t.submit_write = refusing
    for s in ("a", "b", "c"):
        m.register_receiver(rig.frame(1, s, 2, n=3))
    rig.send(1)
    extent = rig.extent_of(1)
    assert m.writes_in_flight == 3
    assert m.poll() == 3  # a's real outcome and the two refused ones
    assert m.room_status(1) == "failed"
    # a reported done first, then b
    assert reason_kind(m, 1) is ReasonKind.WRITE_FAILED and "b" in reason_text(m, 1).split()
    assert m.writes_in_flight == 0
    assert m.stats["completions_unknown"] == 0 and m.stats["completions_dropped"] == 1  # c's, after the failure
    assert extent.state == "quarantined" and extent.writes_in_flight == 0
    # a's write landed: its region is free at once; b's and c's wait out the quarantine
    assert rig.told("a", 1) == [("failed", reason_text(m, 1)), ("released", "")]
    assert rig.receiver("b").releases(1) == [] and rig.receiver("c").releases(1) == []
    clock.advance(5.0)
    m.poll()
    assert extent.state == "free"
    assert rig.receiver("b").releases(1) == ["released"] and rig.receiver("c").releases(1) == ["released"]
    # and again, for a later room
    m.register_receiver(rig.frame(2, "d", 2))
    rig.send(2)
    assert m.poll() == 1
    assert reason_kind(m, 2) is ReasonKind.WRITE_FAILED and "d" in reason_text(m, 2).split()
    assert m.writes_in_flight == 0


def test_synthetic_handles_never_collide_with_a_transports_handle_zero():
    class ZeroBased(AddressedLoopback):
        """Handles from 0, and a receiver whose writes the transport refuses outright."""

        def submit_write(self, session, bufs):
            if session == "bad":
                raise RuntimeError("no route")
            return super().submit_write(session, bufs) - 1

        def poll(self):
            return [(h - 1, o) for h, o in super().poll()]

    b = ManagerRig()
    b.t = ZeroBased(b.clock)
    b.m = drive(EncodeManager(b.t, b.clock))
    b.ring = Ring(b.t, 2 * 4096)
    m = b.m
    assert m.bind_sender(1) == "registered"
    assert m.register_receiver(b.frame(1, "good", n=2))
    assert m.register_receiver(b.frame(1, "bad", n=2))
    assert m.submit_chunk(1, b.chunk())
    m.poll()
    assert reason_kind(m, 1) is ReasonKind.WRITE_FAILED and "bad" in reason_text(m, 1).split()
    assert m.stats["completions_unknown"] == 0 and m.writes_in_flight == 0


def test_reports_of_writes_that_are_not_ours_are_counted_and_ignored():
    rig = make_rig()
    m, t = rig.manager, rig.transport
    poll = t.poll
    t.poll = lambda: poll() + [(10_000, Outcome.DONE)]  # an engine reporting a handle twice, say
    m.poll()
    m.poll()
    assert m.stats["completions_unknown"] == 2
    m.register_receiver(rig.frame(1, "a", 2))
    rig.send(1)
    m.poll()
    assert m.room_status(1) == "success"
    assert m.stats["completions_unknown"] == 3


# -- write deadlines ---------------------------------------------------------------------------

def test_write_deadlines_fail_live_rooms_and_are_counted_for_concluded_ones():
    rig = make_rig(write_timeout=30.0, peer_fail_threshold=10)
    m, t, clock = rig.manager, rig.transport, rig.clock
    t.inject("hold", count=3)
    m.register_receiver(rig.frame(1, "a", 2, n=2))
    m.register_receiver(rig.frame(1, "b", 2, n=2))
    rig.send(1)
    m.register_receiver(rig.frame(2, "c", 2))
    rig.send(2)
    h_a, h_b, h_c = t.held
    t.complete(h_a, Outcome.FAILED)
    m.poll()
    assert reason_kind(m, 1) is ReasonKind.WRITE_FAILED and "a" in reason_text(m, 1).split()
    clock.advance(30.0)
    m.poll()  # b's write (its room already failed) and c's reach their deadline unreported
    assert m.stats["write_deadlines"] == 2
    assert reason_kind(m, 2) is ReasonKind.WRITE_DEADLINE and "c" in reason_text(m, 2).split()
    assert rig.extent_of(2).state == "sending"  # the transport may still read it
    t.complete(h_b, Outcome.DONE)
    t.complete(h_c, Outcome.DONE)
    m.poll()
    assert m.stats["completions_dropped"] == 2


def test_a_write_the_transport_names_overdue_fails_its_room_now_and_keeps_its_extent_until_it_reports():
    """NIXL while a contact holds its agent: past its own deadline, a write it cannot release yet."""
    named: list[int] = []

    class Naming(LoopbackTransport):
        def overdue(self) -> list[int]:
            return [named.pop()] if named else []

    rig = make_rig(write_timeout=30.0, quarantine_s=5.0, transport_cls=Naming)
    m, t, clock = rig.manager, rig.transport, rig.clock
    t.inject("hold", count=1)
    m.register_receiver(rig.frame(1, "a", 2))
    rig.send(1)
    (handle,) = t.held
    rig.executor.pump.sources.append(lambda: 3)  # a control plane's three frames: the tick counts more than one part
    named += [handle, handle]  # named twice: the core acts once
    assert m.poll() == 3 + 1  # the frames and the write named overdue
    assert reason_kind(m, 1) is ReasonKind.WRITE_TIMED_OUT and "a" in reason_text(m, 1).split()
    assert m.poll() == 3  # named again: already overdue, not counted again
    clock.advance(30.0)
    m.poll()  # the core's own deadline does not fire again
    assert m.stats["write_deadlines"] == 1
    extent = rig.extent_of(1)
    assert extent.state == "sending" and rig.receiver("a").releases(1) == []  # the engine may still read it
    t.complete(handle, Outcome.TIMED_OUT)
    m.poll()
    assert extent.state == "quarantined" and rig.receiver("a").releases(1) == []
    clock.advance(5.0)
    m.poll()
    assert extent.state == "free" and rig.receiver("a").releases(1) == ["released"]


def test_a_transport_with_the_seams_empty_overdue_is_not_asked_every_tick(monkeypatch):
    """Only a transport that can name overdue writes is asked each tick: a call a tick is a call an
    item on a busy loop (issue 33's per-item count)."""
    asked = []
    monkeypatch.setattr(Transport, "overdue", lambda self: asked.append(self) or [])
    rig = make_rig()
    rig.manager.register_receiver(rig.frame(1, "a", 2))
    rig.send(1)
    rig.manager.poll()
    assert rig.manager.room_status(1) == "success" and asked == []


def test_oldest_write_age_counts_from_the_oldest_submit():
    rig = make_rig(write_timeout=30.0)
    m, t, clock = rig.manager, rig.transport, rig.clock
    assert m.oldest_write_age() == 0.0
    t.inject("hold", count=2)
    clock.advance(1.0)
    m.register_receiver(rig.frame(1, "a", 2))
    rig.send(1)  # submitted at 1
    assert m.oldest_write_age() == 0.0
    clock.advance(2.0)
    m.register_receiver(rig.frame(2, "b", 2))
    rig.send(2)  # submitted at 3
    clock.advance(1.5)
    assert m.oldest_write_age() == 3.5
    t.complete(t.held[0], Outcome.DONE)
    m.poll()
    assert m.oldest_write_age() == 1.5


# -- quarantine --------------------------------------------------------------------------------


def test_the_pump_maps_transport_handles_to_the_cores_write_ids_until_each_reports():
    rig = make_rig()
    rig.transport.inject("hold", count=2)
    rig.open_room(1), rig.open_room(2)
    rig.executor.execute([("r1", rig.item(2, 1)), ("r2", rig.item(2, 2))])
    pump, m = rig.executor.pump, rig.manager
    handles = pump.handles()
    assert sorted(handles.values()) == sorted(m.writes.by_handle) and len(handles) == 2
    h1 = min(handles)
    assert pump.write_of(h1) == handles[h1] and pump.write_of(max(handles) + 1) is None
    rig.transport.complete(h1, Outcome.DONE)
    rig.executor.poll()
    assert pump.write_of(h1) is None and h1 not in pump.handles() and len(m.writes.by_handle) == 1


def test_the_managers_own_report_calls_act_on_the_writes_they_name_and_count_what_they_did():
    """`writes_reported` and `writes_overdue`, the calls a driver without the pump makes."""
    rig = make_rig()
    rig.transport.inject("hold", count=2)
    rig.open_room(1), rig.open_room(2)
    rig.executor.execute([("r1", rig.item(2, 1)), ("r2", rig.item(2, 2))])
    m = rig.manager
    w1, w2 = sorted(m.writes.by_handle)
    assert m.writes_reported([(w1, Outcome.DONE)]) == 1
    assert m.room_status(1) == "success" and m.room_status(2) == "transferring"
    assert m.writes_overdue([w2, w2, 999]) == 1  # once for its write; an id not in flight is not counted
    assert reason_kind(m, 2) is ReasonKind.WRITE_TIMED_OUT


def test_an_outcome_for_a_write_the_core_never_issued_is_counted_and_changes_nothing():
    rig = make_rig()
    m = rig.manager
    assert m.writes_reported([(999, Outcome.DONE), (998, Outcome.FAILED)]) == 2
    assert m.stats["completions_unknown"] == 2 and not m.rooms
    assert rig.executor.ring.live == 0
