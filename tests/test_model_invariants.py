"""Value-based invariants: each receiver keeps the outcome it was told (a value, kept after its region is
released), which must be the room's, told exactly once. Spec mutants are caught by the explorer and by
SPIN: each test patches the Python rules and the Promela text the same way, and both engines report it."""

from __future__ import annotations

import pytest

from epd_ring.executor.tools import spin as spin_tool
from epd_ring.models import promela, promela_events
from epd_ring.models.explore import explore
from epd_ring.models.rules import Rules
from epd_ring.models.spec import Config
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
