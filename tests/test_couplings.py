"""The couplings between machines are read from fsm/couplings.py by the spec and the Promela generator:
each implements exactly the table's actions, and a change to the table changes what both explore."""

from __future__ import annotations

import re

import pytest

from epd_ring.executor.tools import spin as spin_tool
from epd_ring.fsm import couplings
from epd_ring.models import promela
from epd_ring.models.explore import explore
from epd_ring.models.rules import Rules
from epd_ring.models.spec import Config, Spec

TINY = Config(cells=1, rooms=2, receivers=1, faults=1)


def _table_actions(machines) -> set[str]:
    table = (*couplings.ON_ENTER.items(), *couplings.ON_EVENT.items())
    return {a for (m, _), acts in table if m in machines for a in acts}


def test_every_action_has_its_doc_and_every_deadline_is_an_action():
    assert set(couplings.ACTION_DOCS) == couplings.actions()
    assert set(couplings.DEADLINES) <= couplings.actions()


def test_the_spec_implements_exactly_the_tables_actions():
    assert couplings.actions() == Rules.ACTIONS
    spec = Spec(TINY)
    for action in couplings.actions():
        assert callable(getattr(spec, "_" + action))


def test_the_generator_implements_exactly_the_actions_on_the_machines_it_moves():
    assert set(promela.ACTIONS) == promela.coupled_actions() == _table_actions(promela.COUPLED)
    # the generator moves every machine the table couples, peers included (models/promela_peers.py)
    assert couplings.actions() == promela.coupled_actions()
    text = promela.generate(TINY)
    for action in promela.ACTIONS:
        assert len(re.findall(rf"^inline {action}\(", text, re.MULTILINE)) == 1, action


def test_the_generated_entries_follow_the_table_in_order():
    text = promela.generate(TINY)
    enter_room = text.split("inline enter_room(", 1)[1].split("\n}", 1)[0]
    for (machine, state), acts in couplings.ON_ENTER.items():
        if machine == "room":
            assert f"== R_{state} -> " + "; ".join(f"{a}(ex, cause)" for a in acts) in enter_room
    release = text.split("inline move_extent_release(", 1)[1].split("\n}", 1)[0]
    assert release.rstrip().endswith("; release_regions(sx, C_release)")


def test_an_action_the_implementations_lack_is_refused(monkeypatch):
    monkeypatch.setitem(couplings.ON_ENTER, ("room", "success"), ("conclude", "celebrate"))
    with pytest.raises(AssertionError, match="celebrate"):
        Spec(TINY)
    with pytest.raises(KeyError, match="celebrate"):
        promela.generate(TINY)


def test_dropping_abandon_extent_from_failed_rooms_strands_their_extents(monkeypatch):
    """Without abandon_extent a room that fails with a parked chunk keeps its extent: nothing frees it, and a
    room whose item waits for an extent never concludes (the liveness check, models/liveness.py)."""
    assert explore(TINY).violations == {}
    monkeypatch.setitem(couplings.ON_ENTER, ("room", "failed"), ("conclude",))
    broken = explore(TINY)
    assert sorted(broken.violations) == ["deadlock", "room-never-concludes"]
    stuck = broken.violations["deadlock"].trace[-1][1]
    assert any(sl[0] == "parked" for sl in stuck[1])


def _walk(spec: Spec, events: list[tuple]) -> tuple:
    state = spec.initial()
    for event in events:
        state = next(step.state for step in spec.successors(state) if step.event == event)
    return state


def test_dropping_the_park_deadline_changes_what_the_spec_explores(monkeypatch):
    parked_room = [("register", 0), ("tower", 0, 1), ("copied", 0)]  # staged before its receiver registered
    state = _walk(Spec(TINY), parked_room)
    assert state[0][0][0] == "parked"
    assert ("expire", 0) in [step.event for step in Spec(TINY).successors(state)]
    before = explore(TINY).states
    monkeypatch.setitem(couplings.ON_ENTER, ("room", "parked"), ("park_extent",))
    assert ("expire", 0) not in [step.event for step in Spec(TINY).successors(state)]
    assert explore(TINY).states < before


def test_dropping_release_regions_leaves_failed_rooms_regions_and_writes(monkeypatch):
    monkeypatch.delitem(couplings.ON_EVENT, ("extent", "release"))
    assert "deadlock" in explore(TINY).violations


@pytest.mark.skipif(not spin_tool.available(), reason="needs spin and gcc (apt-get install -y spin gcc)")
def test_spin_follows_a_changed_table_as_the_explorer_does(monkeypatch):
    cfg = Config(cells=1, rooms=2, receivers=1, faults=1, regions=False)
    monkeypatch.setitem(couplings.ON_ENTER, ("room", "failed"), ("conclude",))
    spin, ours = spin_tool.check(cfg), explore(cfg)  # SPIN's trail is replayed on the spec (promela.rebuild)
    assert sorted(spin.violations) == sorted(ours.violations) == ["deadlock", "room-never-concludes"]
