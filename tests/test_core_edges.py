"""Edges of the small core pieces that the controller suites pass through without pinning down:
live-deadline counts, a clock that may stand still, and where deepstack extents live in the ring.
(Found by the mutation run: tests/mutation/equivalent.md.)"""

from __future__ import annotations

import pytest

from epd_ring.executor import FakeClock, LoopbackTransport
from epd_ring.executor.core.ring import Ring
from epd_ring.executor.core.timers import Deadlines


class Timed:
    def __init__(self) -> None:
        self.timer = 0
        self.due = 0.0


def test_pending_deadlines_are_listed_earliest_first_whatever_the_order_they_were_armed():
    d = Deadlines()
    timed = {kind: Timed() for kind in ("quarantine", "park", "announce")}
    for due, kind in ((3.0, "quarantine"), (1.0, "park"), (2.0, "announce")):
        d.arm(due, kind, timed[kind])
    d.cancel(timed["announce"])
    assert d.pending() == [(1.0, "park", timed["park"]), (3.0, "quarantine", timed["quarantine"])]


def test_deadlines_count_only_live_ones_through_arm_cancel_and_due():
    d = Deadlines()
    a, b, c = Timed(), Timed(), Timed()
    d.arm(1.0, "park", a)
    d.arm(2.0, "announce", b)
    d.arm(3.0, "quarantine", c)
    assert len(d) == 3
    d.cancel(b)
    assert len(d) == 2 and not b.timer
    d.cancel(b)  # cancelling a disarmed object changes nothing
    assert len(d) == 2
    assert list(d.due(1.0)) == [("park", a)]
    assert len(d) == 1 and not a.timer
    d.arm(1.5, "park", a)  # a popped deadline can be armed again
    d.arm(5.0, "announce", b)
    assert len(d) == 3 and a.timer and b.timer
    # b's cancelled entry is still in the heap at 2.0: it must not fire
    assert list(d.due(10.0)) == [("park", a), ("quarantine", c), ("announce", b)]
    assert len(d) == 0 and not (a.timer or b.timer or c.timer)
    assert list(d.due(100.0)) == []


def test_rearming_replaces_the_earlier_deadline():
    d = Deadlines()
    a = Timed()
    d.arm(1.0, "park", a)
    d.arm(4.0, "park", a)
    assert len(d) == 1 and a.due == 4.0
    assert list(d.due(3.0)) == []
    assert list(d.due(4.0)) == [("park", a)]


def test_fake_clock_may_stand_still_but_never_go_back():
    clock = FakeClock(5.0)
    assert clock.advance(0) == 5.0 and clock.now() == 5.0
    assert clock.advance(1.5) == 6.5
    with pytest.raises(ValueError, match=r"a clock cannot go back \(-1 s\)"):
        clock.advance(-1)
    assert clock.now() == 6.5


def test_every_extent_lies_inside_its_arena_without_overlap():
    ring = Ring(LoopbackTransport(), 1024, deep_bytes=3 * 1024)
    extents = [ring.lease(n, 3 * n) for n in (100, 64, 300, 1, 400)]  # fills the main arena exactly
    assert all(e is not None for e in extents)
    for buf, ptr_of, size in ((ring.main, ring.main_ptr, lambda e: e.nbytes),
                              (ring.deep, ring.deep_ptr, lambda e: e.deep_nbytes)):
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
        spans = sorted((ptr_of(e), ptr_of(e) + size(e)) for e in extents)
        assert all(lo <= a and b <= hi for a, b in spans), (lo, hi, spans)
        assert all(b <= a2 for (_, b), (a2, _) in zip(spans, spans[1:]))  # no two extents overlap


# -- the deadline heap: tokens, order, compaction ----------------------------------------------

def test_a_fired_deadline_leaves_its_object_unarmed_like_a_fresh_one():
    d = Deadlines()
    a, b = Timed(), Timed()
    d.arm(1.0, "park", a)
    d.arm(2.0, "write", b)
    assert list(d.due(1.5)) == [("park", a)]
    # The token is unarmed again, as on a fresh or cancelled object (readers only test its truth).
    assert not a.timer and b.timer and len(d) == 1
    d.cancel(b)
    assert not b.timer and len(d) == 0


def test_deadlines_at_the_same_instant_fire_in_the_order_they_were_armed():
    d = Deadlines()
    objs = [Timed() for _ in range(4)]
    for k, o in enumerate(objs):
        d.arm(1.0, f"k{k}", o)
    assert [o for _, o in d.due(1.0)] == objs


def test_the_heap_is_rebuilt_only_past_the_floor_once_dead_entries_outnumber_live_ones_four_to_one():
    from epd_ring.executor.core.timers import _COMPACT_FLOOR as floor

    d = Deadlines()
    live = [Timed() for _ in range(floor // 4 + 1)]  # 1025 live deadlines
    for o in live:
        d.arm(10.0, "park", o)
    # Re-arming leaves the earlier entry dead in the heap: the heap grows, the live count does not.
    while d.heap_size < 4 * len(live):
        d.arm(5.0, "park", live[0])
    assert d.heap_size == 4 * len(live) and len(d) == len(live)  # past the floor, but not past 4x live
    d.arm(5.0, "park", live[0])  # one more dead entry: now over 4x live, so only live entries remain
    assert d.heap_size == len(live) and len(d) == len(live)
    assert len(list(d.due(10.0))) == len(live)  # every live deadline survived the rebuild

    small = Deadlines()
    one = Timed()
    while small.heap_size < floor:  # 4096 entries, 1 live: at the floor, not past it
        small.arm(1.0, "park", one)
    assert small.heap_size == floor
    small.arm(1.0, "park", one)
    assert small.heap_size == 1 and list(small.due(1.0)) == [("park", one)]


def test_first_is_never_later_than_the_earliest_live_deadline_and_a_tick_skips_nothing_due():
    # `first` lets a tick skip `due` without a call: it must never be later than a live deadline
    d = Deadlines()
    assert not d.any_due(1e9)
    a, b = Timed(), Timed()
    d.arm(5.0, "park", a)
    d.arm(2.0, "park", b)
    assert d.first == 2.0 and not d.any_due(1.9) and d.any_due(2.0)
    d.cancel(b)  # a cancelled entry may leave `first` early (an idle call), never late
    assert list(d.due(2.0)) == [] and d.first == 5.0
    assert list(d.due(5.0)) == [("park", a)] and not d.any_due(1e9)


def test_an_effect_equals_only_an_effect_of_its_own_kind_with_equal_fields():
    from epd_ring.executor.core.effects import Concluded, Notify, Release, Submit

    assert Submit(1, "s:1", ()) == Submit(1, "s:1", ()) and hash(Submit(1, "s:1", ())) == hash(Submit(1, "s:1", ()))
    assert Submit(1, "s:1", ()) != Submit(2, "s:1", ())
    assert (Submit(1, "s:1", ()) != Submit(1, "s:1", ())) is False  # `!=` is `==`'s negation, field by field
    assert Submit(1, "s:1", ()) != (1, "s:1", ())  # never a plain tuple
    assert Concluded(7, "success") != Release(7, "success")  # nor another kind with the same fields
    assert Notify("r", 7, "failed") == Notify("r", 7, "failed", "")
    with pytest.raises(AttributeError):
        Submit(1, "s:1", ()).write = 2  # immutable, as the frozen dataclasses were


# -- the fake clock ----------------------------------------------------------------------------

def test_a_fake_clock_starts_at_zero_and_moves_only_forward_by_what_it_is_told():
    clock = FakeClock()
    assert clock.now() == 0.0 and type(clock.now()) is float
    assert clock.advance(0.25) == 0.25 and clock.advance(0.5) == 0.75 and clock.now() == 0.75
    assert clock.advance(0) == 0.75  # standing still is allowed
    assert FakeClock(3).now() == 3.0 and type(FakeClock(3).now()) is float
    with pytest.raises(ValueError, match=r"-0\.5"):
        clock.advance(-0.5)
    assert clock.now() == 0.75


# ------------------------------------------------------------------ the pump ---

class _Core:
    """The least a pump drives: an outbox, stats, and the contact answers it reports back."""

    def __init__(self, transport) -> None:
        from collections import Counter

        self.transport = transport
        self.stats: Counter[str] = Counter()
        self.outbox: list = []
        self.reported: list = []

    def contacts_reported(self, answers) -> int:
        from epd_ring.executor.core.effects import Concluded

        if not self.reported:  # doing an effect may decide more: the first answer concludes a room
            self.outbox.append(Concluded(7, "failed"))
        self.reported += answers
        return len(answers)


class _Edge:
    """A transport that records how the pump calls `connect` and answers from a table."""

    def __init__(self, answers) -> None:
        self.answers = answers
        self.calls: list = []

    def connect(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        answer = self.answers[args[0]]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_the_pump_hands_each_contact_its_identity_and_probe_flag_and_reports_every_answer():
    from epd_ring.executor.core.effects import Contact
    from epd_ring.executor.core.pump import Pump

    edge = _Edge({"a": True, "b": False, "c": True, "d": None, "e": OSError("unreachable")})
    core = _Core(edge)
    concluded = []
    pump = Pump(core, edge)
    pump.on_conclude.append(lambda room, state: concluded.append((room, state)))
    core.outbox += [Contact("a", 1), Contact("b", 2, "key-b"), Contact("c", 3, "key-c", probe=True), Contact("d", 4),
                    Contact("e", 5, "key-e")]
    # every effect counts, those that doing the first ones decided (the concluded room) too
    assert pump.flush() == 6
    assert concluded == [(7, "failed")]
    # A transport written before identities takes two arguments: it gets two where there is none.
    assert edge.calls == [(("a", 1), {}), (("b", 2, "key-b"), {}), (("c", 3, "key-c"), {"probe": True}),
                          (("d", 4), {}), (("e", 5, "key-e"), {})]
    # an answer now is reported at once; None (answered later) is not; a raise is a refusal
    assert [(s, a, ok) for s, a, ok, _ in core.reported] == [("a", 1, True), ("b", 2, False), ("c", 3, True),
                                                            ("e", 5, False)]
    # a refusal carries a reason for the peer's record, whatever refused it
    assert all(isinstance(why, str) and why for s, _, ok, why in core.reported if not ok)


def test_a_rate_limited_warning_says_how_many_it_held_back_per_key():
    import logging

    from epd_ring.executor.core.ratelog import RateLimitedLog

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("test_ratelog")  # outside "epd_ring", which the suite quiets
    logger.propagate = False
    logger.setLevel(logging.WARNING)
    logger.addHandler(Keep())
    clock = FakeClock()
    log = RateLimitedLog(logger, clock.now, interval=1.0)
    assert log.suppressed == 0
    log.warning("k", "frame %s", 1)
    log.warning("k", "frame %s", 2)
    log.warning("k", "frame %s", 3)
    log.warning("j", "other %s", 1)  # another key is not held back by this one
    assert [r.args for r in records] == [(1,), (1,)]
    assert log.suppressed == 2
    clock.advance(1.0)
    log.warning("k", "frame %s", 4)  # the next line carries the count held back since the last
    clock.advance(1.0)
    log.warning("k", "frame %s", 5)  # and the count starts again
    assert [r.args for r in records[2:]] == [(4, 2), (5,)]
    assert log.suppressed == 2


def test_take_effects_hands_over_everything_decided_once_and_in_order():
    """The call a driver without the pump makes (the pump empties the outbox in place)."""
    from helpers import make_rig

    rig = make_rig()
    m = rig.manager._core  # not driven: what the calls decide stays in the outbox
    m.register_receiver(rig.frame(1, "a", 2))
    m.fail_room(1, "aborted")
    decided = list(m.outbox)
    assert decided
    assert m.take_effects() == decided
    assert m.take_effects() == [] and m.outbox == []
