"""The model at its smallest bounds, pinned: the exact size of each state space, its shortest violation
traces, the conformance walk's figures, and SPIN's agreement with the explorer there.

Each bound explores in a fraction of a second, so this file is also the detector the mutation pass runs
on models/ (tests/mutation/run_mutmut.sh): a change to a rule, a guard, the symmetry reduction, the
liveness judge or the Promela generator moves one of these figures. The larger bounds are checked in
test_model.py, test_spin.py and test_conformance.py; these are what the figures are at the bottom.

A change to the model that is meant moves them too: print the new ones with
`python tests/test_model_pins.py` and read the difference before pinning it.
"""

from __future__ import annotations

import json
import logging
import sys

import pytest

from epd_ring.executor.tools import spin as spin_tool
from epd_ring.models import liveness
from epd_ring.models.explore import explore, format_trace, replay, trace_to_json
from epd_ring.models.spec import VARIANTS, Config, Spec
from epd_ring.models.walk import walk

C = Config
# config -> (states, transitions, depth, finals, fair ends, represented), {kind: (trace length, hazard)}
SPACES: dict[Config, tuple[tuple[int, ...], dict[str, tuple[int, str | None]]]] = {
    C(1, 1, 1, 1): ((37, 68, 7, 4, 5, 37), {}),
    C(1, 2, 1, 1): ((489, 1576, 12, 7, 25, 960), {}),
    C(2, 2, 1, 1): ((1243, 4206, 12, 7, 25, 2468), {}),
    C(1, 2, 2, 1): ((1407, 5077, 16, 9, 58, 2786), {}),
    C(1, 2, 1, 2): ((816, 2854, 13, 11, 33, 1605), {}),
    C(2, 2, 1, 1, regions=False): ((1122, 3704, 12, 7, 22, 2227), {}),
    C(1, 2, 1, 1, peers=True, sizes=(1,)): ((1100, 3810, 14, 13, 39, 2164), {}),
    C(1, 2, 1, 1, channels=True): ((3372, 11201, 16, 15, 44, 6711), {}),
    C(1, 2, 1, 1, late_landing=True): ((521, 1651, 12, 7, 30, 1022), {
        "overwrite-under-late-write": (9, None), "write-into-released-region": (8, None)}),
    C(1, 2, 1, 1, variant="blocking-contact", peers=True, sizes=(1,)): ((933, 2663, 13, 13, 39, 1840), {
        "loop-waits-on-peer": (2, "blocking-first-contact")}),
    C(1, 2, 1, 1, variant="busy-wait"): ((425, 1286, 12, 7, 25, 832), {"deadlock": (5, "busy-wait-lease")}),
    C(1, 2, 1, 1, variant="no-parked-check"): ((491, 1578, 12, 7, 25, 964), {
        "overwrite-under-chunk": (6, "lease-without-parked-check")}),
    C(1, 2, 1, 1, variant="no-write-deadline"): ((489, 1576, 12, 7, 50, 960), {
        "region-never-released": (7, None), "room-never-concludes": (5, "write-never-reported")}),
    C(1, 2, 1, 1, variant="reaped-deferred-crash"): ((509, 1576, 12, 7, 25, 1000), {
        "crash": (8, "deferred-send-after-reap")}),
    C(1, 2, 1, 1, variant="reuse-when-terminal"): ((510, 1600, 12, 7, 25, 1002), {
        "overlap-of-busy-extent": (9, None), "overwrite-under-chunk": (6, None),
        "overwrite-under-late-write": (8, "extent-reuse-when-terminal"), "overwrite-under-write": (8, None)}),
    C(1, 2, 1, 1, variant="seed"): ((595, 1331, 11, 5, 29, 1176), {
        "overwrite-under-chunk": (6, "H15-extent-reuse-before-send"), "overwrite-under-late-write": (8, "H6"),
        "overwrite-under-write": (8, "H15-extent-reuse"), "receiver-not-told": (4, "H5"),
        "room-never-concludes": (2, None), "write-for-concluded-room": (6, "H15"),
        "write-into-released-region": (7, "H6-receiver-region-reuse")}),
    C(1, 2, 1, 1, variant="write-before-up", peers=True, sizes=(1,)): ((1047, 3574, 14, 13, 39, 2058), {
        "write-to-peer-not-up": (5, "write-before-peer-up")}),
}
# without the symmetry reduction: every state stands for itself
UNREDUCED = {C(1, 2, 2, 1): (2786, 10051, 16, 15, 107, 2786)}
# config -> (spec edges, spec states, states with their histories, deadlines fired through the clock, events):
# walked whole, none skipped
WALKS = {C(1, 1, 1, 1): (68, 37, 60, 6, 380), C(1, 1, 1, 1, peers=True, sizes=(1,)): (167, 79, 115, 33, 1038)}

needs_spin = pytest.mark.skipif(not spin_tool.available(), reason="needs spin and gcc (apt-get install -y spin gcc)")


def _figures(r) -> tuple[tuple[int, ...], dict[str, tuple[int, str | None]]]:
    return ((r.states, r.transitions, r.depth, r.finals, r.fair_ends, r.represented),
            {k: (len(v.trace), v.hazard) for k, v in sorted(r.violations.items())})


def test_every_variant_is_pinned():
    assert {cfg.variant for cfg in SPACES} == set(VARIANTS)


@pytest.mark.parametrize("cfg", list(SPACES), ids=str)
def test_each_small_space_has_its_pinned_size_and_shortest_traces(cfg, explored):
    assert _figures(explored(cfg)) == SPACES[cfg]


@pytest.mark.parametrize("cfg", list(UNREDUCED), ids=str)
def test_the_unreduced_space_has_its_pinned_size(cfg, explored):
    assert _figures(explored(cfg, symmetry=False)) == (UNREDUCED[cfg], {})


@pytest.mark.parametrize("cfg", [c for c, (_, bad) in SPACES.items() if bad], ids=str)
def test_each_pinned_trace_replays_to_its_violation_and_prints_one_event_per_line(cfg, explored):
    for kind, v in explored(cfg).violations.items():
        steps, found = replay(json.loads(trace_to_json(cfg, v)))
        assert len(steps) == len(v.trace)
        if kind in liveness.KINDS:
            # a behaviour stuck with only unfair events left: the judge names it in the last state
            assert found is None and liveness.judge(steps[-1][1])[0] == kind
            assert liveness.stuck(steps[-1][1], Spec(cfg).successors(steps[-1][1]),
                                  liveness.fair_events(cfg.variant)) is not None
        else:
            assert found is not None and found[0] == kind
        assert len(format_trace(Spec(cfg), v).splitlines()) >= len(v.trace)


@pytest.mark.parametrize("cfg", list(WALKS), ids=str)
def test_the_smallest_walks_cover_the_spec_through_the_clock(cfg, caplog):
    caplog.set_level(logging.CRITICAL, logger="epd_ring")  # injected tower errors are events here
    w = walk(cfg)
    assert w.failures == []
    assert (w.spec_edges, w.spec_states, w.nodes, w.deadlines["clock"], w.steps) == WALKS[cfg]
    assert (w.edges, w.states, w.deadlines["not by clock"]) == (w.spec_edges, w.spec_states, 0)


@needs_spin
@pytest.mark.parametrize("cfg", [C(1, 2, 1, 1), C(1, 2, 1, 1, peers=True, sizes=(1,)), C(1, 2, 1, 1, channels=True)],
                         ids=str)
def test_spin_stores_the_pinned_states(cfg):
    r = spin_tool.check(cfg)
    assert (r.states, r.violations) == (SPACES[cfg][0][0], {})


@needs_spin
@pytest.mark.parametrize("cfg", [C(1, 2, 1, 1, variant="busy-wait"), C(1, 2, 1, 1, late_landing=True)], ids=str)
def test_spin_finds_the_pinned_violations_and_its_trails_replay_on_the_spec(cfg):
    r = spin_tool.check(cfg)
    pinned = SPACES[cfg][1]
    assert sorted(r.violations) == sorted(pinned)
    for kind, v in r.violations.items():
        # promela.rebuild followed SPIN's trail on the spec step by step, and it ends in the same kind
        assert v.trace[0][0] == ("init",) and len(v.trace) == len(r.raw[kind]) + 1
        assert v.hazard == pinned[kind][1]


@needs_spin
def test_spin_reads_back_its_verdict_on_a_text_it_has_checked(tmp_path, monkeypatch):
    """EPD_RING_SPIN_CACHE (the mutation runs): the same Promela text is not compiled or searched again,
    and what is read back gives the same verdict."""
    monkeypatch.setenv("EPD_RING_SPIN_CACHE", str(tmp_path))
    cfg = C(1, 1, 1, 1)
    first = spin_tool.check(cfg)
    started = []
    run = spin_tool._run
    monkeypatch.setattr(spin_tool, "_run", lambda cmd, *a, **k: started.append(cmd[0]) or run(cmd, *a, **k))
    again = spin_tool.check(cfg)
    assert started == [] and len(list(tmp_path.glob("*.json"))) == first.runs == again.runs
    assert (again.states, again.transitions, again.violations) == (first.states, first.transitions, {})
    assert first.states == SPACES[cfg][0][0]


# -- the model's commands and pictures at the same bounds ----------------------------------------

def _check(argv: list[str]) -> tuple[int, dict, list[str]]:
    import argparse

    from epd_ring.models import check

    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    lines: list[str] = []
    report: dict = {}
    return check.run(parser.parse_args(argv), out=lines.append, report=report), report, lines


SMALL = ["--cells", "1", "--rooms", "2", "--receivers", "1", "--faults", "1"]


def test_the_check_command_reports_the_explorers_figures_with_and_without_symmetry():
    rc, report, lines = _check([*SMALL, "--compare-symmetry"])
    (states, transitions, depth, finals, fair_ends, represented), _ = SPACES[C(1, 2, 1, 1)]
    reduced, unreduced = report["runs"]
    assert rc == 0 and report["violation"] is False
    assert (reduced["states"], reduced["transitions"], reduced["depth"], reduced["finals"], reduced["fair_ends"],
            reduced["represented"]) == (states, transitions, depth, finals, fair_ends, represented)
    assert unreduced["symmetry"] is False and unreduced["states"] == unreduced["represented"] == represented
    assert report["config"] == {"cells": 1, "rooms": 2, "receivers": 1, "faults": 1, "variant": "project",
                                "sizes": (1, 2), "peers": False, "channels": False, "late_landing": False}
    assert sum(f"{states:,} states" in line for line in lines) == 1  # each run prints its own figures


def test_the_check_command_saves_each_violation_and_replays_it(tmp_path):
    rc, report, lines = _check([*SMALL, "--variant", "reuse-when-terminal", "--save-traces", str(tmp_path)])
    pinned = SPACES[C(1, 2, 1, 1, variant="reuse-when-terminal")][1]
    assert rc == 1 and report["violation"] is True and report["runs"][0]["violations"] == sorted(pinned)
    saved = sorted(tmp_path.glob("*.json"))
    assert len(saved) == len(pinned)
    for path in saved:
        rc, replayed, lines = _check(["--replay", str(path)])
        kind = replayed["violation"]["kind"]
        assert rc == 1 and kind in pinned and replayed["steps"] == pinned[kind][0] - 1
        assert len(lines) == replayed["steps"] + 2  # the initial state, each step, the verdict


@pytest.mark.parametrize("argv", [[*SMALL, "--slots", "2"], [*SMALL, "--spin-opt=-O2"],
                                  ["--engine", "spin", "--no-symmetry"], ["--replay", "x.json", "--cells", "2"],
                                  ["--replay", "/nonexistent/trace.json"]], ids=str)
def test_the_check_command_refuses_flags_that_do_not_go_together(argv):
    from epd_ring.models.check import CheckInputError

    with pytest.raises(CheckInputError):
        _check(argv)


def test_the_walk_command_prints_its_coverage_and_fails_below_its_floor(capsys, caplog):
    from epd_ring.models import walk as walk_command

    assert walk_command.main(["1", "1", "1", "1"]) == 0
    assert "68/68 edges (100.0%)" in capsys.readouterr().out
    assert walk_command.main(["1", "1", "1", "1", "--min-coverage", "1.01"]) == 1


@pytest.mark.parametrize("cfg, nodes, edges, bad", [(C(1, 1, 1, 1), 37, 68, 0),
                                                    (C(1, 2, 1, 1, variant="no-parked-check"), 491, 1553, 2)],
                         ids=str)
def test_the_state_graph_draws_every_state_and_edge_and_marks_the_bad_ones(cfg, nodes, edges, bad):
    import re

    from epd_ring.models.graphs import state_graph_dot

    dot = state_graph_dot(cfg)
    assert len(re.findall(r"^  n\d+ \[", dot, re.M)) == nodes and dot.count(" -> ") == edges
    assert dot.count("#f4b6b6") == bad  # a state that breaks an invariant is filled red, named by its kind
    assert sorted(set(re.findall(r'\\n([a-z-]+)"', dot))) == sorted(SPACES.get(cfg, ((), {}))[1])


def test_coverage_targets_are_reached_by_shortest_paths():
    from epd_ring.models.conformance import coverage_targets, reach

    cfg = C(1, 2, 1, 1)
    found = reach(cfg, coverage_targets(cfg))
    assert {k: len(v) for k, v in found.items()} == {
        "chunk awaiting-tower": 0, "chunk copying": 2, "chunk dropped": 2, "chunk held": 3, "chunk sent": 4,
        "region failed": 5, "region offered": 1, "region released": 2, "region withdrawing": 5, "region written": 5,
        "write in flight": 4, "write landed late": 6, "write may land": 5}


def test_the_fixtures_command_writes_the_committed_hazard_traces(tmp_path):
    from pathlib import Path

    from epd_ring.models import fixtures

    assert fixtures.main([]) == 2
    assert fixtures.main(["--write", str(tmp_path)]) == 0
    committed = Path(__file__).parent / "fixtures" / "hazards"
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {p.name: p.read_text() for p in committed.iterdir()}


def _print_figures() -> None:
    """The figures at HEAD, in the layout above (run this file with python)."""
    for cfg in SPACES:
        print(cfg, _figures(explore(cfg)))
    for cfg in UNREDUCED:
        print(cfg, "unreduced", _figures(explore(cfg, symmetry=False)))
    logging.getLogger("epd_ring").setLevel(logging.CRITICAL)
    for cfg in WALKS:
        w = walk(cfg)
        print(cfg, "walk", (w.spec_edges, w.spec_states, w.nodes, w.deadlines["clock"], w.steps))


if __name__ == "__main__":
    sys.exit(_print_figures())
