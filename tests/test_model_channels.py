"""Notices that travel (Config.channels) and writes that outlive their quarantine (Config.late_landing).

With channels a FIFO per receiver carries the encoder's outcome, release and ack, and the
receiver's withdraw travels the other way, so the two can cross; the invariants must still hold
and both engines must store the same states. With late landings a ghost write may land after its
extent's quarantine ended: the hazard the quarantine's duration guards against, found by both
engines. Small bounds only: each test runs in seconds.
"""

from __future__ import annotations

import json

import pytest
from helpers import reachable_states

from epd_ring.executor.tools import spin as spin_tool
from epd_ring.executor.tools.cli import main as cli_main
from epd_ring.models.explore import replay, trace_to_json
from epd_ring.models.spec import CONCLUDED, RCV, RS, Config, Spec
from epd_ring.models.state import CHAN, WD, WD_SENT, chan_notices

needs_spin = pytest.mark.skipif(not spin_tool.available(), reason="needs spin and gcc (apt-get install -y spin gcc)")

ONE = dict(cells=1, rooms=1, receivers=1, faults=1, sizes=(1,))
TWO_ROOMS = dict(cells=1, rooms=2, receivers=1, faults=1, sizes=(1,))


def test_channels_off_leave_the_state_space_as_it_was(explored):
    # Off is the default, and a receiver stays the three-field tuple the conformance walk reads.
    cfg = Config(**TWO_ROOMS)
    assert cfg == Config(**TWO_ROOMS, channels=False, late_landing=False)
    assert all(len(x) == 3 for st in reachable_states(cfg) for r in st[0] for x in r[RCV])


@pytest.mark.parametrize("bound", [TWO_ROOMS, dict(TWO_ROOMS, receivers=2)], ids=["1-receiver", "2-receivers"])
def test_with_channels_the_invariants_hold_in_a_larger_space(bound, explored):
    off, on = explored(Config(**bound)), explored(Config(**bound, channels=True))
    assert on.violations == {} and off.violations == {}
    assert on.states > off.states  # notices in flight are states of their own
    assert on.finals > 0


@pytest.mark.parametrize("bound", [ONE, TWO_ROOMS, dict(TWO_ROOMS, receivers=2)],
                         ids=["1-room", "2-rooms", "2-receivers"])
@needs_spin
def test_with_channels_spin_stores_exactly_the_explorers_states(bound, explored):
    cfg = Config(**bound, channels=True)
    spin, ours = spin_tool.check(cfg), explored(cfg)
    assert spin.violations == ours.violations == {}
    assert spin.states == ours.states


def test_a_withdraw_crosses_an_outcome_and_a_release_notice():
    """Reached: the receiver withdrew (its withdraw not yet heard) while the outcome is on its way to
    it; and while a release notice is on its way. The invariants hold there (they are checked in every
    state by the explorer tests above); here the states themselves are asserted to exist."""
    states = reachable_states(Config(**ONE, channels=True))
    crossings = [(r, x) for st in states for r in st[0] for x in r[RCV] if x[WD] == WD_SENT and x[CHAN]]
    on_way = [set(chan_notices(x[CHAN])) for _, x in crossings]
    assert any(n & {"success"} for n in on_way), "a withdraw never crossed a Success"
    assert any(n & {"failed"} for n in on_way), "a withdraw never crossed a Failed"
    assert any(n & {"released"} for n in on_way), "a withdraw never crossed a release notice"
    # In each crossing the room already concluded (the encoder sent the outcome before it heard)
    # and the receiver's region is withdrawing: the outcome it takes will not make it read the bytes.
    assert all(r[RS] in CONCLUDED and x[0] == "withdrawing" for r, x in crossings)


def test_after_a_crossing_the_receiver_is_told_the_rooms_outcome_once_and_its_region_released():
    spec = Spec(Config(**ONE, channels=True))
    finals = [st for st in reachable_states(spec.cfg) if spec.is_final(st)]
    withdrawn_success = [x for st in finals for r in st[0] for x in r[RCV] if r[RS] == "success" and x[WD]]
    # a receiver that withdrew while Success was on its way: told success once, acked, released
    assert withdrawn_success and all(x[0] == "released" and x[2] == "success" for x in withdrawn_success)


@pytest.mark.parametrize("engine", ["explorer", pytest.param("spin", marks=needs_spin)])
def test_late_landing_finds_the_overwrite_and_the_write_into_a_released_region(engine, explored):
    cfg = Config(**TWO_ROOMS, late_landing=True)
    found = spin_tool.check(cfg).violations if engine == "spin" else explored(cfg).violations
    assert {"overwrite-under-late-write", "write-into-released-region"} <= set(found)
    assert not explored(Config(**TWO_ROOMS)).violations  # the same bound with the quarantine's bound kept
    # The shortest overwrite: room 0's write is unsure, its quarantine ends, room 1 leases the cell.
    events = [e[0] for e, _ in explored(cfg).violations["overwrite-under-late-write"].trace]
    assert events.index("write_unsure") < events.index("release") < len(events) - 1
    assert events[-1] == "tower"


def test_check_flags_reach_the_model(capsys):
    common = ["check", "--cells", "1", "--rooms", "1", "--receivers", "1", "--sizes", "1"]
    assert cli_main([*common, "--channels"]) == 0
    assert "notice channels" in capsys.readouterr().out
    assert cli_main([*common, "--late-landing"]) == 1
    assert "write-into-released-region" in capsys.readouterr().out


def test_a_saved_late_landing_trace_replays_with_its_switch(explored):
    # The trace file carries the switch: replayed without it, the stray could not land.
    cfg = Config(**TWO_ROOMS, late_landing=True)
    v = explored(cfg).violations["write-into-released-region"]
    data = json.loads(trace_to_json(cfg, v))
    assert data["config"]["late_landing"] is True
    _, problem = replay(data)
    assert problem is not None and problem[0] == "write-into-released-region"
