"""Value-based invariants: each receiver keeps the outcome it was told (a value, kept after its region is
released), which must be the room's, told exactly once. Spec mutants are caught by the explorer and by
SPIN: each test patches the Python rules and the Promela text the same way, and both engines report it."""

from __future__ import annotations
import __future__

import inspect
import textwrap

import pytest

from epd_ring.executor.tools import spin as spin_tool
from epd_ring.models import promela, promela_events
from epd_ring.models.explore import explore
from epd_ring.models.rules import Rules
from epd_ring.models.spec import Config, Spec
from epd_ring.models.state import RS, TOLD, receivers

# The bound the issue names: one cell, two rooms, two receivers, one fault.
CFG = Config(cells=1, rooms=2, receivers=2, faults=1, sizes=(1,))
CONCLUDE_GUARD = "room[ax].rg[gj] == G_offered || room[ax].rg[gj] == G_withdrawing"


def _wrong_outcome_released(self, d, i, cause):
    """A successful room tells its first receiver Failed and releases that region at once."""
    ro = d.rooms[i]
    ro[TOLD] = len(receivers(ro))
    for k, (g, _, _) in enumerate(receivers(ro)):
        if g in ("offered", "withdrawing"):
            if ro[RS] == "success" and k == 0:
                self._notice(ro, k, "failed")
                self._notice(ro, k, "released")
            else:
                self._notice(ro, k, "success" if ro[RS] == "success" else "failed")
    if ro[RS] != "success":
        self._release_settled(ro)


def _guard_dropped(self, d, i, cause):
    """Conclude tells only withdrawing regions (the `offered` half of its guard dropped); the count still
    says every receiver was told."""
    ro = d.rooms[i]
    ro[TOLD] = len(receivers(ro))
    for k, (g, _, _) in enumerate(receivers(ro)):
        if g == "withdrawing":
            self._notice(ro, k, "success" if ro[RS] == "success" else "failed")
    if ro[RS] != "success":
        self._release_settled(ro)


MUTANTS = {
    # (python rule, (Promela ACTIONS key or None for the event text, old text, new text), kind expected)
    "wrong-outcome-then-release": (
        _wrong_outcome_released,
        ("conclude", "if :: room[ax].rs == R_success -> notice_success(ax, gj)",
         "if :: room[ax].rs == R_success && gj == 0 -> notice_failed(ax, gj); notice_released(ax, gj)\n"
         "              :: room[ax].rs == R_success && gj > 0 -> notice_success(ax, gj)"),
        "wrong-outcome"),
    "conclude-guard-dropped": (
        _guard_dropped,
        ("conclude", CONCLUDE_GUARD, "room[ax].rg[gj] == G_withdrawing"),
        "receiver-not-told"),
}


def test_the_project_is_clean_under_the_value_invariants():
    assert explore(CFG).violations == {}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_spec_mutant_is_caught_by_the_explorer(name, monkeypatch):
    rule, _, kind = MUTANTS[name]
    monkeypatch.setattr(Rules, "_conclude", rule)
    r = explore(CFG)
    assert kind in r.violations, sorted(r.violations)


@pytest.mark.skipif(not spin_tool.available(), reason="needs spin and gcc (apt-get install -y spin gcc)")
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_spec_mutant_is_caught_by_spin(name, monkeypatch):
    _, (action, old, new), kind = MUTANTS[name]
    actions = dict(promela.ACTIONS)
    assert actions[action].count(old) == 1, "the mutant's Promela text moved"
    actions[action] = actions[action].replace(old, new)
    monkeypatch.setattr(promela, "ACTIONS", actions)
    assert promela_events.TEXT  # the event families stay as generated
    r = spin_tool.check(CFG, replay_on_spec=False)
    assert kind in r.violations, sorted(r.violations)


# -- mutants of models/ source: a copy of a method's text with one edit, and the Promela text edited alike ----------
def _mutated(cls, name: str, old: str, new: str):
    """`cls.name` compiled from its own source with `old` replaced by `new` (exactly one occurrence)."""
    func = getattr(cls, name)
    src = inspect.getsource(func)
    assert src.count(old) == 1, f"the mutant's text moved in {cls.__name__}.{name}"
    code = compile(textwrap.dedent(src.replace(old, new)), f"<mutant of {cls.__name__}.{name}>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    ns: dict = {}
    exec(code, func.__globals__, ns)
    return ns[name]


def _promela_conclude(old: str, new: str) -> dict:
    actions = dict(promela.ACTIONS)
    assert actions["conclude"].count(old) == 1, "the mutant's Promela text moved"
    actions["conclude"] = actions["conclude"].replace(old, new)
    return actions


# A weakened invariant: the told outcome is compared only while the region is not released, so a release erases
# it again (the weakness value-based outcomes removed). Killed with a witness the full invariant names: the
# wrong-outcome-then-release rule above.
WEAK_PY = ("if t != TOLD_NONE and t != r[RS]:", 'if t != TOLD_NONE and t != r[RS] and g != "released":')
WEAK_PML = ("room[k].rt[gj] != TOLD_OF(room[k].rs) -> kind = K_WRONG_OUTCOME",
            "room[k].rt[gj] != TOLD_OF(room[k].rs) && room[k].rg[gj] != G_released -> kind = K_WRONG_OUTCOME")
# One room, one receiver, no fault: its success tells the receiver Failed and releases it.
WITNESS_CFG = Config(cells=1, rooms=1, receivers=1, faults=0, sizes=(1,))

# A notice reordered: a failed room releases its settled regions before it sends their outcome. A withdrawing
# receiver gets its ack and is never told; an offered one is told Failed after the release pass, so nothing
# releases its region (the liveness check, models/liveness.py, names it). One room, one receiver, one fault.
REORDER_PY = ("""        for k, x in enumerate(receivers(ro)):
            # with channels the encoder cannot see a region: it tells every receiver (none was told yet)
            if self.channels or x[0] in ("offered", "withdrawing"):
                self._notice(ro, k, outcome)
        if outcome == "failed":
            self._release_settled(ro)""", """        if outcome == "failed":
            self._release_settled(ro)
        for k, x in enumerate(receivers(ro)):
            if self.channels or x[0] in ("offered", "withdrawing"):
                self._notice(ro, k, outcome)""")
REORDER_PML = ("""     :: REGIONS ->
        gj = 0;
        do""", """     :: REGIONS ->
        if :: room[ax].rs != R_success -> release_settled(ax) :: else -> skip fi;
        gj = 0;
        do""")
REORDER_PML_TAIL = ("""        gj = 0;
        if :: room[ax].rs != R_success -> release_settled(ax) :: else -> skip fi
""", """        gj = 0
""")
REORDER_CFG = Config(cells=1, rooms=1, receivers=1, faults=1, sizes=(1,))
REORDER_KINDS = {"receiver-not-told", "region-never-released"}


def test_a_weakened_told_outcome_invariant_is_killed_by_the_explorer(monkeypatch):
    monkeypatch.setattr(Rules, "_conclude", _wrong_outcome_released)
    assert "wrong-outcome" in explore(WITNESS_CFG).violations
    monkeypatch.setattr(Spec, "invariant", _mutated(Spec, "invariant", *WEAK_PY))
    weak = explore(WITNESS_CFG)
    # the kind the suite asserts is gone: the mutant is killed; the end state still is not quiescent (the
    # receiver keeps a wrong value), which only the deadlock check sees, without naming the outcome
    assert sorted(weak.violations) == ["deadlock"]


@pytest.mark.skipif(not spin_tool.available(), reason="needs spin and gcc (apt-get install -y spin gcc)")
def test_a_weakened_told_outcome_invariant_is_killed_by_spin(monkeypatch):
    old, new = MUTANTS["wrong-outcome-then-release"][1][1:]
    monkeypatch.setattr(promela, "ACTIONS", _promela_conclude(old, new))
    assert promela.SEARCH.count(WEAK_PML[0]) == 1, "the mutant's Promela text moved"
    monkeypatch.setattr(promela, "SEARCH", promela.SEARCH.replace(*WEAK_PML))
    weak = spin_tool.check(WITNESS_CFG, replay_on_spec=False)
    assert sorted(weak.violations) == ["deadlock"]


def test_a_release_notice_before_the_outcome_is_caught_by_the_explorer(monkeypatch):
    assert explore(REORDER_CFG).violations == {}
    monkeypatch.setattr(Rules, "_conclude", _mutated(Rules, "_conclude", *REORDER_PY))
    assert set(explore(REORDER_CFG).violations) >= REORDER_KINDS


@pytest.mark.skipif(not spin_tool.available(), reason="needs spin and gcc (apt-get install -y spin gcc)")
def test_a_release_notice_before_the_outcome_is_caught_by_spin(monkeypatch):
    actions = _promela_conclude(*REORDER_PML)
    assert actions["conclude"].count(REORDER_PML_TAIL[0]) == 1, "the mutant's Promela text moved"
    actions["conclude"] = actions["conclude"].replace(*REORDER_PML_TAIL)
    monkeypatch.setattr(promela, "ACTIONS", actions)
    assert set(spin_tool.check(REORDER_CFG, replay_on_spec=False).violations) >= REORDER_KINDS
