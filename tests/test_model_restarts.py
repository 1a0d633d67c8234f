"""Encoder restarts in the model (Config.restarts, `epd-ring check --restarts N`; issue 29).

A restart loses everything the encoder held; every room that had begun becomes an orphan, and its
receivers do what executor/drivers/receiver.py does on a new incarnation: a room not told success is
failed there, once, an `offered` region is withdrawn towards the new incarnation, and every held
region is reclaimed after the receiver's reclaim delay, which outlasts the dead incarnation's writes.
Checked: every region comes back (liveness under F7), no receiver is told two outcomes for one room,
no write of the dead incarnation lands in a region reclaimed (and so reused); each check is shown to
have teeth by a spec mutant the explorer catches. Tiny bounds only: the file runs in about a second.
"""

from __future__ import annotations

import json

import pytest
from helpers import reachable_states
from test_model_invariants import _mutated

from epd_ring.executor.tools.cli import main as cli_main
from epd_ring.models import liveness
from epd_ring.models.events_restarts import Restarts
from epd_ring.models.explore import explore, replay, trace_to_json
from epd_ring.models.spec import EXTENTI, RCV, RS, SIZE, SND, Config, Spec
from epd_ring.models.state import SND_DEAD, TOLD_NONE, TOLD_TWICE, W_GHOST, told_after

C = Config
# One room, one receiver, one fault, one restart: at the restart its region may be offered, failed with
# a write that may still land, withdrawing, written or released.
ONE = C(cells=1, rooms=1, receivers=1, faults=1, sizes=(1,), restarts=1)
# config -> (states, transitions, depth, finals, fair ends, represented), laid out as test_model_pins.SPACES
PINNED = {
    C(1, 2, 1, 1, restarts=1): (824, 3015, 13, 25, 49, 1624),
    C(1, 2, 1, 1, restarts=2): (875, 3421, 13, 22, 63, 1716),
}


def _orphans(state: tuple) -> list[tuple]:
    return [r for r in state[0] if r[SND] == SND_DEAD]


def test_restarts_off_leave_the_state_as_it_was():
    # Off is the default: the state keeps its six parts (the pinned counts are test_model_pins.py's).
    cfg = C(1, 2, 1, 1)
    assert cfg == C(1, 2, 1, 1, restarts=0)
    assert all(len(st) == 6 and not _orphans(st) for st in reachable_states(cfg))
    assert not any(st.event[0] == "restart" for st in Spec(cfg).successors(Spec(cfg).initial()))


@pytest.mark.parametrize("cfg", list(PINNED), ids=str)
def test_the_restart_switch_has_its_pinned_size_and_no_violation(cfg, explored):
    r = explored(cfg)
    assert (r.states, r.transitions, r.depth, r.finals, r.fair_ends, r.represented) == PINNED[cfg]
    assert r.violations == {}


def test_a_second_restart_orphans_the_rooms_of_the_second_incarnation():
    # A restart needs a room that began since the last one: the second comes only once the other room began
    # in the second incarnation, and it orphans that one too.
    second = [st for st in reachable_states(C(1, 2, 1, 1, restarts=2)) if st[6] == 0]
    assert second and all(len(_orphans(st)) == 2 for st in second)


def test_after_a_restart_every_region_comes_back_and_each_room_was_told_once():
    spec = Spec(ONE)
    seen_at_restart = set()
    for st in reachable_states(ONE):
        for step in spec.successors(st):
            if step.event[0] != "restart":
                continue
            (before,), (after,) = st[0], step.state[0]
            for x, y in zip(before[RCV], after[RCV]):
                seen_at_restart.add((x[0], x[2], y[0], y[2]))
            assert after[RS] == ("success" if before[RS] == "success" else "failed")
    # offered: withdrawn and failed here; told failed by the dead encoder (region held for a write that may
    # land): failed, not told again; written: untouched; released: untouched
    assert {("offered", TOLD_NONE, "withdrawing", "failed"), ("failed", "failed", "failed", "failed"),
            ("written", "success", "written", "success"), ("released", "failed", "released", "failed")} \
        <= seen_at_restart
    ends = [st for st in reachable_states(ONE) if _orphans(st) and not spec.successors(st)]
    assert ends and all(spec.is_final(st) for st in ends)
    assert all(x[0] in ("written", "released") and x[2] == st[0][0][RS] for st in ends for x in st[0][0][RCV])


def test_a_dead_write_may_land_until_its_region_is_reclaimed():
    # A write in flight at the restart is the dead incarnation's: it may land, in the region still held.
    spec = Spec(ONE)
    landed = [(st, s) for st in reachable_states(ONE) for s in spec.successors(st)
              if s.event[0] == "late_landing" and _orphans(st)]
    assert landed and all(st[0][0][RCV][0][1] == W_GHOST and st[0][0][RCV][0][0] != "released"
                          for st, _ in landed)


# -- teeth: each check catches a mutant of the receivers' side ------------------------------------------------
def test_a_receiver_that_never_reclaims_a_failed_region_is_caught(monkeypatch):
    # The region told `failed` by the dead encoder waited for its release, which never comes.
    monkeypatch.setattr(Restarts, "reclaims", _mutated(Restarts, "reclaims", '("failed", "withdrawing")',
                                                        '("withdrawing",)'))
    v = explore(ONE).violations
    # kept forever with only a dead write left to land (the liveness judge), or with nothing at all (deadlock)
    assert set(v) == {"region-never-released", "deadlock"}
    assert "stays failed" in v["region-never-released"].detail
    assert "restart" in [e[0] for e, _ in v["region-never-released"].trace]


def test_a_reclaim_before_the_dead_writes_are_over_is_caught(monkeypatch):
    # The region is reused while a write of the dead incarnation may still land in it.
    monkeypatch.setattr(Restarts, "_dead_write_at_reclaim", _mutated(
        Restarts, "_dead_write_at_reclaim", "W_STRAY if self.late_landing else W_IDLE",
        "W_STRAY if self.late_landing else W_GHOST"))
    v = explore(ONE).violations
    assert "write-into-released-region" in v
    events = [e[0] for e, _ in v["write-into-released-region"].trace]
    assert events[-3:] == ["restart", "reclaim", "late_landing"]


def test_a_transport_that_outlives_the_reclaim_delay_is_found_by_the_late_landing_switch():
    # No fault: no write is ever reported unsure, so only a dead incarnation's write can be late.
    cfg = C(cells=1, rooms=1, receivers=1, faults=0, sizes=(1,), restarts=1)
    assert explore(cfg).violations == {}
    late = explore(C(cells=1, rooms=1, receivers=1, faults=0, sizes=(1,), restarts=1, late_landing=True))
    assert set(late.violations) == {"write-into-released-region"}
    events = [e[0] for e, _ in late.violations["write-into-released-region"].trace]
    assert events[-3:] == ["restart", "reclaim", "late_landing"]


@pytest.mark.parametrize("rule", ["_concluded_here", "_repeated"])
def test_a_second_failed_for_one_room_is_caught(rule, monkeypatch):
    # `_concluded_here`: the receiver fails a room the dead encoder already told `failed`; `_repeated`: it
    # takes the new incarnation's `failed` for a room concluded here as an outcome.
    wrong = {"_concluded_here": lambda told: told_after(told, "failed"), "_repeated": told_after}[rule]
    monkeypatch.setattr(Restarts, rule, staticmethod(wrong))
    v = explore(ONE).violations
    assert set(v) == {"told-twice"}
    assert v["told-twice"].trace[-1][1][0][0][RCV][0][2] == TOLD_TWICE


def test_the_reclaim_assumption_is_needed(monkeypatch):
    monkeypatch.setitem(liveness.DROPPED, ONE.variant, ("F7",))
    assert set(explore(ONE).violations) == {"region-never-released"}


# -- the command ------------------------------------------------------------------------------------------
def test_the_check_command_takes_restarts_and_refuses_them_where_they_are_not_modelled(capsys):
    small = ["check", "--cells", "1", "--rooms", "1", "--receivers", "1", "--sizes", "1", "--restarts", "1"]
    assert cli_main(small) == 0
    assert "1 encoder restart(s)" in capsys.readouterr().out
    for extra in (["--channels"], ["--peers"], ["--engine", "spin"]):
        assert cli_main([*small, *extra]) == 2  # a usage error, not a crash
    with pytest.raises(ValueError):
        C(1, 1, 1, 1, variant="seed", restarts=1)


def test_a_saved_restart_trace_replays_with_its_switch():
    cfg = C(cells=1, rooms=1, receivers=1, faults=0, sizes=(1,), restarts=1, late_landing=True)
    data = json.loads(trace_to_json(cfg, explore(cfg).violations["write-into-released-region"]))
    assert data["config"]["restarts"] == 1
    assert replay(data)[1][0] == "write-into-released-region"
    data["config"].pop("restarts")  # without the switch there is no restart to take
    with pytest.raises(ValueError):
        replay(data)


def test_a_receivers_region_state_says_what_it_was_told():
    # offered: nothing yet; written: success; failed, withdrawing or released: failed. The orphaning of a
    # dead incarnation's rooms (events_restarts.py) relies on it: only an offered region has no outcome yet.
    expected = {"offered": TOLD_NONE, "written": "success", "failed": "failed", "withdrawing": "failed",
                "released": "failed"}
    seen = set()
    for st in reachable_states(C(1, 2, 1, 1, restarts=1)):
        for room in st[0]:
            for region, _, told, *_ in room[RCV]:
                assert told == expected[region], (region, told)
                seen.add(region)
    assert seen == set(expected)


def test_with_two_receivers_each_reclaims_its_own_region_and_an_orphan_holds_no_extent():
    # the second receiver's region is reclaimed whatever the first one's is (one room, the smallest space)
    cfg = C(1, 1, 2, 1, sizes=(1,), restarts=1)
    r = explore(cfg)
    assert (r.states, r.violations) == (107, {})
    orphans = [o for st in reachable_states(cfg) for o in _orphans(st)]
    assert orphans and all(o[EXTENTI] == -1 and o[SIZE] == 0 for o in orphans)
