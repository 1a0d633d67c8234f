"""Liveness under named fairness (models/liveness.py, docs/formal-model.md): every room that began concludes,
every region is released and every concluded room's sender is reaped on every fair behaviour, in the explorer and
in SPIN; dropping an assumption gives a counterexample (a room, region or sender stuck forever) in both."""

from __future__ import annotations

from dataclasses import replace

import pytest

from epd_ring.executor.tools import spin as spin_tool
from epd_ring.models import liveness
from epd_ring.models.explore import explore
from epd_ring.models.spec import CONCLUDED, INFL, RS, SND, Config, Spec
from epd_ring.models.state import Step

CFG = Config(cells=1, rooms=2, receivers=2, faults=1, sizes=(1,))
# The smallest bound that shows a write never reported: one room, one receiver, no faults.
NO_DEADLINE = Config(cells=1, rooms=1, receivers=1, faults=0, sizes=(1,), variant="no-write-deadline")
needs_spin = pytest.mark.skipif(not spin_tool.available(), reason="needs spin and gcc (apt-get install -y spin gcc)")


def _stuck_room(trace) -> tuple:
    """The room the counterexample leaves unconcluded, in its last state."""
    return next(r for r in trace[-1][1][0] if liveness.began(r) and r[RS] not in CONCLUDED)


def test_every_fair_behaviour_concludes_every_room_in_the_explorer():
    r = explore(CFG)
    assert r.violations == {}
    assert r.fair_ends > 0  # states where only unfair events (a withdraw, a late landing ...) can happen were judged


@needs_spin
def test_every_fair_behaviour_concludes_every_room_in_spin():
    r = spin_tool.check(CFG)
    assert r.violations == {}
    assert r.states == explore(CFG).states  # the liveness arm adds no state


@pytest.mark.parametrize("engine", ["explorer", pytest.param("spin", marks=needs_spin)])
def test_with_notice_channels_every_fair_behaviour_still_concludes_and_releases(engine):
    """Notices and withdraws in flight (Config.channels) are delivered under F6: nothing is left stuck."""
    cfg = Config(cells=1, rooms=1, receivers=2, faults=1, sizes=(1,), channels=True)
    r = explore(cfg) if engine == "explorer" else spin_tool.check(cfg)
    assert r.violations == {}


def test_without_a_write_deadline_the_explorer_shows_a_room_that_never_concludes():
    r = explore(NO_DEADLINE)
    assert sorted(r.violations) == ["room-never-concludes"]
    v = r.violations["room-never-concludes"]
    assert v.hazard == "write-never-reported"
    room = _stuck_room(v.trace)
    assert room[RS] == "transferring" and room[INFL] == 1  # its write was never reported
    assert [e[0] for e, _ in v.trace[1:]] == ["register", "frame", "tower", "copied"]  # shortest: 4 events


@needs_spin
def test_without_a_write_deadline_spin_shows_a_room_that_never_concludes():
    r = spin_tool.check(NO_DEADLINE)  # SPIN's trail is replayed on the spec (promela.rebuild)
    assert sorted(r.violations) == ["room-never-concludes"]
    room = _stuck_room(r.violations["room-never-concludes"].trace)
    assert room[RS] == "transferring" and room[INFL] == 1


def test_with_peers_the_variant_arms_no_write_deadline():
    """With peers the project fails an overdue room by its write deadline; the variant has none to fire."""
    cfg = Config(cells=1, rooms=1, receivers=1, faults=1, sizes=(1,), peers=True)
    assert explore(cfg).violations == {}
    r = explore(replace(cfg, variant="no-write-deadline"))
    assert "room-never-concludes" in r.violations
    assert not any(e[0] == "write_deadline" for v in r.violations.values() for e, _ in v.trace)


@pytest.mark.parametrize("name, cfg", [
    ("F1", CFG), ("F2", CFG), ("F3", CFG), ("F4", CFG),
    ("F5", Config(cells=1, rooms=1, receivers=1, faults=0, sizes=(1,), peers=True)),
    ("F6", Config(cells=1, rooms=1, receivers=1, faults=0, sizes=(1,), channels=True)),
])
def test_each_named_assumption_is_needed(name, cfg, monkeypatch):
    """No assumption is idle: without any one of them some fair behaviour leaves a room or a region stuck."""
    monkeypatch.setitem(liveness.DROPPED, cfg.variant, (name,))
    r = explore(cfg)
    assert set(r.violations) & set(liveness.KINDS), sorted(r.violations)


@pytest.mark.parametrize("engine", ["explorer", pytest.param("spin", marks=needs_spin)])
def test_without_reap_in_f4_a_concluded_rooms_sender_is_never_reaped(engine, monkeypatch):
    """F4's `reap` is what ends a concluded room's sender: with F4 serving deferred sends alone, a fair
    behaviour keeps one forever (every room concluded, every region settled), in both engines."""
    text, events = liveness.FAIRNESS["F4"]
    assert "reap" in events
    monkeypatch.setitem(liveness.FAIRNESS, "F4", (text, tuple(e for e in events if e != "reap")))
    cfg = Config(cells=1, rooms=1, receivers=1, faults=0, sizes=(1,))
    r = explore(cfg) if engine == "explorer" else spin_tool.check(cfg)
    assert sorted(r.violations) == ["sender-never-reaped"]
    last = r.violations["sender-never-reaped"].trace[-1][1]
    assert liveness.judge(last)[0] == "sender-never-reaped"
    assert all(room[RS] in CONCLUDED for room in last[0]) and any(room[SND] == 1 for room in last[0])


# -- fair shares: whose an event is, and which identity is starved (liveness.subject, liveness.starved) --------
SHARES = Config(cells=2, rooms=3, receivers=1, faults=0, sizes=(1,), identities=2)  # rooms 0, 1: identity 0; 2: 1


def _shares_state(began=(), cells=None):
    """SHARES' initial state with the rooms in `began` registered, and the cells given."""
    state = Spec(SHARES).initial()
    rooms = tuple(r[:RS] + ("registered", 1) + r[SND + 1:] if i in began else r for i, r in enumerate(state[0]))
    return (rooms, state[1] if cells is None else cells, *state[2:])


def test_a_quarantines_end_belongs_to_the_identity_its_cell_is_charged_to_and_a_rooms_event_to_its_owner():
    state = _shares_state(cells=(("quarantined", -3, True, 1), ("quarantined", 2, True, 1)))
    assert liveness.subject(state, ("release", 0)) == 1  # no room covers it: charged to identity 1 (-2 - 1)
    assert liveness.subject(state, ("release", 1)) == 1  # room 2's bytes: its owner's
    state = _shares_state(cells=(("quarantined", -2, True, 1), ("quarantined", 0, True, 1)))
    assert liveness.subject(state, ("release", 0)) == liveness.subject(state, ("release", 1)) == 0
    assert [liveness.subject(state, ("tower", i, 1)) for i in range(3)] == [0, 0, 1]
    assert liveness.subject(state, ("serve",)) is None  # the encode loop's: everyone's


def test_an_identity_is_starved_whatever_the_identities_judged_before_it():
    fair = liveness.fair_events("project")
    # identity 0 has no room that began: identity 1's room, with no fair event of its own, is starved
    state = _shares_state(began=(2,))
    steps = [Step(("frame", 0), state), Step(("register", 1), state), Step(("frame", 2), state)]
    assert liveness.starved(state, steps, fair, 2)[0] == "identity-starved"
    # identity 0's room has a fair event of its own; identity 1's has none
    state = _shares_state(began=(0, 2))
    steps = [Step(("tower", 0, 1), state), Step(("frame", 2), state)]
    assert liveness.starved(state, steps, fair, 2)[0] == "identity-starved"
    # each has one (the encode loop's events are everyone's): nobody is starved
    assert liveness.starved(state, [*steps, Step(("tower", 2, 1), state)], fair, 2) is None
    assert liveness.starved(state, [*steps, Step(("serve",), state)], fair, 2) is None
