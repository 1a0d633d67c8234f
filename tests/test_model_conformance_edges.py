"""The conformance harness's deadline planning and its read-back, at their edges (issue 32's survivors of
models/conformance.py, conformance_clock.py and conformance_reads.py that the walks leave alive).

The walks only ever take the harness's happy path through time: every deadline they fire is foreseen, so
the planning's arithmetic, the replans and the clock's slices are reached but never told apart. Here
`Timing` runs on stand-ins (a fake clock and a core that reports the deadlines it is given), so each
timeout, each due time and each pick of the clock's next deadline is checked for its value; the harness
itself is driven along short event lists for its replans and its set-up. Each test is small: the
mutation pass runs them for every mutant of these modules."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from epd_ring.executor.core import FakeClock
from epd_ring.models.conformance import Harness
from epd_ring.models.conformance_clock import FAR, OFFSET, PROBE_CONTACT, STEP, NotByClock, Timing
from epd_ring.models.spec import Config


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.CRITICAL, logger="epd_ring")  # injected tower errors are events here


# -- Timing on stand-ins ---------------------------------------------------------------------------
BASE = 500


def _timing(clock: FakeClock, pending: list, beats: list | None = None, plan=(), arms=()) -> Timing:
    """A `Timing` over a core that reports `pending` (and, with peers, `beats`) as its deadlines."""
    core = SimpleNamespace(deadlines=SimpleNamespace(pending=lambda: list(pending)),
                           peers=SimpleNamespace(beats=SimpleNamespace(pending=lambda: list(beats or []))),
                           rooms={}, writes=SimpleNamespace(by_handle={}), quarantine_s=30.0)
    pump = SimpleNamespace(ticks=0)

    def tick() -> None:
        pump.ticks += 1

    pump.tick = tick
    return Timing(beats is not None, core, clock, pump, lambda e: e.offset, BASE, list(plan), list(arms))


def room(i: int) -> SimpleNamespace:
    return SimpleNamespace(id=BASE + i)


def write(i: int) -> SimpleNamespace:
    return SimpleNamespace(room=BASE + i)


def test_pass_time_takes_a_second_or_a_64th_of_the_gap_to_the_next_deadline():
    clock = FakeClock(100.0)
    pending: list = []
    t = _timing(clock, pending)
    t.pass_time()  # nothing pending: a second
    assert clock.now() == 101.0
    pending.append((1e6, "park", room(0)))
    t.pass_time()  # the next deadline far away: still a second
    assert clock.now() == 102.0
    pending[:] = [(102.5, "park", room(0))]
    t.pass_time()  # half a second away: a slice of the gap, so the deadline is still ahead
    assert clock.now() == pytest.approx(102.0 + 0.5 / 64, rel=0, abs=1e-12)
    assert clock.now() < 102.5


def test_the_core_and_the_heartbeats_deadlines_are_pending_earliest_first():
    a, b = write(0), SimpleNamespace(peer=None)
    t = _timing(FakeClock(), [(1.0, "write", a)], beats=[(5.0, "probe", b)])
    assert [obj for _, _, obj in t.pending()] == [a, b]


def test_fire_takes_the_clock_to_the_deadlines_of_one_event_and_ticks_once():
    clock = FakeClock(1.0)
    a, b = room(0), write(1)
    t = _timing(clock, [(5.0, "park", a), (5.0, "write", b)])
    with pytest.raises(NotByClock):  # b is due at the same time: firing a alone is not by the clock
        t.fire([a])
    assert clock.now() == 1.0 and t.pump.ticks == 0
    t.fire([a, b])
    assert (clock.now(), t.pump.ticks, t.fired["clock"]) == (5.0, 1, 1)


@pytest.mark.parametrize("objs", [[], [object()]], ids=["none", "not pending"])
def test_fire_refuses_an_event_without_pending_deadlines(objs):
    t = _timing(FakeClock(), [(5.0, "park", room(0))])
    with pytest.raises(AssertionError):
        t.fire(objs)


def test_fire_time_is_when_the_events_deadlines_are_due_if_nothing_else_is_due_by_then():
    t = _timing(FakeClock(), [(7.0, "park", room(0)), (9.0, "announce", room(1))])
    assert t.fire_time(("expire", 0)) == 7.0
    assert t.fire_time(("expire", 1)) is None  # room 0's is due first
    assert t.fire_time(("register", 0)) is None  # fires no deadline
    tie = _timing(FakeClock(), [(7.0, "park", room(0)), (7.0, "write", write(1))])
    assert tie.fire_time(("expire", 0)) is None  # another deadline due at the same time


def test_a_quarantine_recorded_for_a_cell_that_was_let_go_is_recorded_afresh_when_it_comes_back():
    clock = FakeClock()
    t = _timing(clock, [])
    e = SimpleNamespace(state="quarantined", offset=1)
    t.record([e], 1)
    assert t.armed[("extent", 1, "quarantine")] == 30.0
    clock.advance(5.0)
    e.state = "free"
    t.record([e], 1)
    assert ("extent", 1, "quarantine") not in t.armed
    clock.advance(5.0)
    e.state = "quarantined"
    t.record([e], 1)
    assert t.armed[("extent", 1, "quarantine")] == 40.0


def _timeouts(t: Timing) -> dict[str, float]:
    m = t.manager
    return {"park": m.park_timeout, "announce": m.announce_timeout, "write": m.write_timeout,
            "quarantine": m.quarantine_s, "connect": m.peers.connect_timeout, "probe": m.peers.probe_interval}


def test_a_deadline_the_plan_fires_is_armed_due_when_its_event_comes_and_every_other_far_away():
    plan = [("register", 0), ("frame", 0), ("expire", 0)]
    clock = FakeClock(10.0)
    t = _timing(clock, [], plan=plan, arms=[frozenset({("announce", ("room", 0))})])
    t.set_timeouts(0)
    want = {kind: FAR + OFFSET[kind] for kind in OFFSET}
    want["announce"] = STEP * 3 + OFFSET["announce"] - 10.0  # fired by the plan's third event
    assert _timeouts(t) == want
    clock.advance(want["announce"] - 0.5)  # half a second before: still due, not FAR
    t.set_timeouts(0)
    assert _timeouts(t)["announce"] == pytest.approx(0.5)
    t.set_timeouts(len(plan))  # past the plan: nothing foreseen
    assert _timeouts(t) == {kind: FAR + OFFSET[kind] for kind in OFFSET}


def test_what_an_event_that_fires_a_deadline_arms_is_timed_from_that_deadline():
    plan = [("expire", 0), ("register", 1), ("write_deadline", 1)]
    t = _timing(FakeClock(10.0), [(50.0, "announce", room(0))], plan=plan,
                arms=[frozenset({("write", ("write", 1))})])
    t.set_timeouts(0)
    assert _timeouts(t)["write"] == STEP * 3 + OFFSET["write"] - 50.0


def test_a_probe_left_unanswered_has_its_contact_due_at_once():
    t = _timing(FakeClock(10.0), [], beats=[], plan=[("probe_expired", 0)])
    t.set_timeouts(0)
    assert _timeouts(t)["connect"] == pytest.approx(PROBE_CONTACT + OFFSET["connect"] / 1000, rel=1e-12)


# -- the harness: replans, its set-up ----------------------------------------------------------------
ONE_CELL = Config(1, 2, 1, 1, sizes=(1,))
PEERS = Config(1, 2, 1, 1, peers=True, sizes=(1,))
PROBE = [("register", 0), ("frame", 0), ("connected", 0), ("tower", 0, 1), ("probe_expired", 0)]


def test_a_deadline_that_is_the_clocks_next_fires_without_a_replan():
    h = Harness(ONE_CELL)
    for ev in [("frame", 0), ("frame", 1), ("expire", 0)]:  # room 0 was announced first: its deadline is next
        h.step(ev)
    assert (h.replans, h.fired["clock"]) == (0, 1)


def test_an_unforeseen_probe_left_unanswered_replans_and_a_foreseen_one_does_not():
    """A probe left unanswered arms a contact and fires it within the event: unforeseen, the harness
    rebuilds itself with it foreseen; taken along a plan that foresaw it, it needs no rebuild."""
    h = Harness(PEERS)
    for ev in PROBE:
        h.step(ev)
    assert h.replans == 1
    again = Harness(PEERS, plan=PROBE, arms=h.arms_made)
    for ev in PROBE:
        again.step(ev)
    assert again.replans == 0 and again.state == h.state


def test_a_replan_follows_only_the_events_taken_and_keeps_the_harness_room_sizes():
    """The harness's plan foresaw room 0's expiry; the spec expires room 1 first instead. The rebuilt
    harness takes the events taken so far (not the rest of the old plan) and keeps its rooms' sizes."""
    cfg = Config(2, 2, 1, 1, sizes=(1, 2))
    h = Harness(cfg, room_sizes=(2, 1), plan=[("frame", 0), ("frame", 1), ("expire", 0)])
    for ev in [("frame", 0), ("frame", 1), ("expire", 1)]:
        h.step(ev)
    assert h.replans == 1
    assert h.manager.room_status(h.room(0)) == "announced" and h.manager.room_status(h.room(1)) == "failed"
    h.step(("register", 0))
    assert [ev for ev in h.enabled() if ev[0] == "tower"] == [("tower", 0, 2)]  # room 0's item is still 2 cells
    h.step(("tower", 0, 2))


def test_an_invariant_the_spec_finds_broken_on_the_implementation_fails_the_step():
    h = Harness(ONE_CELL)
    h.step(("register", 0))
    h.spec.invariant = lambda state: ("a-broken-invariant", "on every state")
    with pytest.raises(AssertionError):
        h.step(("frame", 0))


def test_without_peers_each_rooms_receivers_are_sessions_of_their_own_and_with_peers_they_share_one():
    assert len(Harness(Config(1, 2, 2, 1, sizes=(1,))).transport.receivers) == 4
    assert len(Harness(Config(1, 2, 2, 1, peers=True, sizes=(1,))).transport.receivers) == 2


# -- the harness's events: which write, which room ------------------------------------------------------
# Both rooms' items copied, their writes in flight (with peers: once the one peer `p.0` is up).
BOTH_SENT = [("register", 0), ("frame", 0), ("tower", 0, 1), ("copied", 0), ("register", 1), ("frame", 1),
             ("tower", 1, 1), ("copied", 1)]


def _walked(cfg: Config, events: list) -> Harness:
    h = Harness(cfg)
    for ev in events:
        h.step(ev)
    return h


def test_with_two_rooms_on_one_peer_a_write_done_completes_the_rooms_own_write():
    h = _walked(Config(2, 2, 1, 1, peers=True, sizes=(1,)), [*BOTH_SENT, ("connected", 0)])
    h.step(("write_done", 1, 0))  # room 0's write on the same session is held with a lower handle
    assert h.manager.room_status(h.room(1)) == "success"
    assert h.manager.room_status(h.room(0)) == "transferring"


def test_with_two_rooms_on_one_peer_a_late_landing_lands_the_rooms_own_write():
    cfg = Config(2, 2, 1, 2, peers=True, sizes=(1,))
    h = _walked(cfg, [*BOTH_SENT, ("connected", 0), ("write_unsure", 0, 0), ("write_unsure", 1, 0)])
    h.step(("late_landing", 1, 0))
    assert set(h.buffers[(1, 0)].unique().tolist()) == {float(h.room(1))}
    assert set(h.buffers[(0, 0)].unique().tolist()) == {-1.0}


def test_a_write_deadline_fires_only_its_rooms_writes():
    # the peer up first: room 0's write is armed an event before room 1's, so it is the clock's next
    h = _walked(Config(2, 2, 1, 1, peers=True, sizes=(1,)), [*BOTH_SENT[:2], ("connected", 0), *BOTH_SENT[2:]])
    assert len(h.manager.writes.by_handle) == 2
    h.step(("write_deadline", 0))
    assert h.manager.room_status(h.room(0)) == "failed"
    assert h.manager.room_status(h.room(1)) == "transferring"


def test_a_partial_registration_that_re_arms_a_parked_rooms_deadline_is_caught_by_the_event_itself(monkeypatch):
    """`apply` checks the park deadline of a parked room across a partial registration (not only
    `check_full_state` after the step): a core that re-arms it is caught on `follow` and replays too."""
    from epd_ring.executor.core import EncodeManager

    h = _walked(Config(1, 1, 2, 1, sizes=(1,)), [("register", 0), ("tower", 0, 1), ("copied", 0)])
    assert h.manager.room_status(h.room(0)) == "parked"
    h.apply(("frame", 0))  # a core that keeps the deadline passes
    h2 = _walked(Config(1, 1, 2, 1, sizes=(1,)), [("register", 0), ("tower", 0, 1), ("copied", 0)])
    register = EncodeManager.register_receiver

    def re_arming(self, frame):
        out = register(self, frame)
        room = self.rooms.get(frame.room)
        if room is not None and room.state == "parked":
            self.deadlines.arm(room.due + 1.0, "park", room)
        return out

    monkeypatch.setattr(EncodeManager, "register_receiver", re_arming)
    with pytest.raises(AssertionError):
        h2.apply(("frame", 0))


# -- reading the receivers back ---------------------------------------------------------------------
def test_each_receiver_that_landed_before_its_outcome_counts():
    cfg = Config(1, 1, 2, 1, sizes=(1,))
    h = _walked(cfg, [("register", 0), ("frame", 0), ("frame", 0), ("tower", 0, 1), ("copied", 0),
                      ("write_done", 0, 0)])
    assert h.reads.written(0) == 1  # room 0 is still transferring: no outcome told yet
    h.step(("write_done", 0, 1))
    assert h.manager.room_status(h.room(0)) == "success" and h.reads.written(0) == 2


def test_another_rooms_outcome_told_first_on_a_shared_session_does_not_end_the_count():
    """With peers one session takes both rooms' notices: room 1's failure told before room 0's write
    lands does not make that landing late."""
    cfg = Config(2, 2, 1, 1, peers=True, sizes=(1,))
    h = _walked(cfg, [*BOTH_SENT, ("connected", 0), ("abort", 1)])
    h.step(("write_done", 0, 0))
    assert h.manager.room_status(h.room(0)) == "success" and h.reads.written(0) == 1


def test_a_write_anywhere_inside_a_receive_buffer_is_a_write_into_it_and_one_just_past_it_is_not():
    h = Harness(Config(1, 1, 1, 1, sizes=(1,)))
    buf = h.buffers[(0, 0)]
    lo = buf.data_ptr()
    hi = lo + buf.numel() * buf.element_size()
    h.transport.receivers[h.session(0, 0)].submitted.extend([(7, lo + (hi - lo) // 2, 4), (8, hi, 4)])
    assert h.reads._writes_into(0, 0) == {7}
