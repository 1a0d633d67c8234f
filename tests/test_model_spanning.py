"""The model's cells when an extent may span runs of them (`Config.pieces`, the ring's `max_pieces`; issue 33):
where the spec may place an item, that every invariant still holds, and that the core keeps in lockstep."""

from __future__ import annotations

import logging

import pytest
from helpers import reachable_states

from epd_ring.executor.tools import spin as spin_tool
from epd_ring.models import promela
from epd_ring.models.conformance import Harness
from epd_ring.models.explore import canonical, explore
from epd_ring.models.spec import EXTENTI, LEN, SIZE, SS, Config, Spec, extent, room_cells

SPANS = Config(3, 3, 1, 0, pieces=2)  # three rooms: the core itself spans (two must hold cells to split the free ones)
# room 0 (one cell) and room 2 (one cell) take cells 0 and 1; room 0 succeeds, so cells 0 and 2 are free and room
# 1's item of two cells spans them
TO_SPAN = [("register", 0), ("tower", 0, 1), ("register", 2), ("tower", 2, 1), ("copied", 0), ("frame", 0),
           ("write_done", 0, 0), ("register", 1), ("tower", 1, 2)]


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.CRITICAL, logger="epd_ring")


def _cells(*states: str) -> list[list]:
    return [[ss, -1, False, 1] for ss in states]


def test_an_item_spans_runs_only_where_no_run_holds_it_and_within_its_pieces():
    one, two, three = (Spec(Config(5, 2, 1, 0, sizes=(1, 2, 3), pieces=p)).ring for p in (1, 2, 3))
    rooms = [("registered",) * 11] * 2
    gap = _cells("free", "sending", "free", "sending", "free")  # free runs of one cell at 0, 2 and 4
    assert one.placements(rooms, gap, 2) == []
    assert two.placements(rooms, gap, 2) == [(0, 2), (0, 4), (2, 4)]  # the spec: any of them
    assert two.placements(rooms, gap, 3) == []  # three runs would be needed
    assert three.placements(rooms, gap, 3) == [(0, 2, 4)]
    run = _cells("free", "free", "sending", "free", "sending")
    assert two.placements(rooms, run, 2) == [(0, 1)]  # a run holds it: no span


def test_pieces_are_a_setting_of_the_project_rules():
    from epd_ring.executor.tools.cli import main

    for bad in (dict(pieces=0), dict(pieces=2, variant="seed"), dict(pieces=2, variant="reuse-when-terminal")):
        with pytest.raises(ValueError, match="pieces"):
            Config(3, 2, 1, 0, **bad)
    small = ["check", "--cells", "3", "--rooms", "2", "--receivers", "1", "--faults", "0", "--quiet"]
    assert main([*small, "--pieces", "2"]) == 0
    assert main([*small, "--pieces", "1"]) == 0  # one piece: the least there is, and the default
    with pytest.raises(SystemExit) as refused:
        main([*small, "--pieces", "0"])
    assert refused.value.code == 2  # a usage error, before any state is explored


@pytest.mark.skipif(not spin_tool.available(), reason="needs spin and gcc (apt-get install -y spin gcc)")
@pytest.mark.parametrize("cfg, states", [(Config(3, 3, 1, 1, pieces=2), 28518),
                                         # a span around a run of another extent: cells 0 and 3-4 around 1-2
                                         (Config(5, 2, 1, 0, sizes=(2, 3), pieces=2), 650),
                                         (Config(5, 3, 1, 0, sizes=(1, 3), pieces=3), 11402)], ids=str)
def test_spin_stores_exactly_the_explorers_states_with_spans(cfg, states):
    spin, ours = spin_tool.check(cfg), explore(cfg)
    assert spin.violations == ours.violations == {}
    assert spin.states == ours.states == states
    assert promela.span_places(cfg) and "lm >>" in promela.generate(cfg) and "lm >>" not in promela.generate(
        Config(cfg.cells, cfg.rooms, cfg.receivers, cfg.faults, sizes=cfg.sizes))  # spans only where asked


def test_the_spec_with_spanning_holds_every_invariant_and_reaches_spans_the_arena_could_not_place():
    plain, spanning = explore(Config(3, 3, 1, 1)), explore(Config(3, 3, 1, 1, pieces=2))
    assert plain.violations == {} == spanning.violations
    assert (plain.states, spanning.states) == (24798, 28518)  # the spans are states of their own
    spans = set()
    for st in reachable_states(SPANS):
        for cell, c in enumerate(st[1]):
            if c[LEN] > 1 and list(extent(st[1], cell)) != list(range(cell, cell + c[LEN])):
                spans.add(tuple(extent(st[1], cell)))
                # every cell of a spanning extent carries its state, and names its first cell
                assert all(st[1][x][SS] == c[SS] and st[1][x][LEN] == -1 - cell for x in extent(st[1], cell)[1:])
        for r in st[0]:
            if r[EXTENTI] >= 0:  # a room's cells are its extent's, wherever they lie
                assert list(room_cells(st[1], r[EXTENTI], r[SIZE])) == list(extent(st[1], r[EXTENTI]))
    assert spans == {(0, 2)}


def test_a_spin_trail_reads_back_a_spanning_extents_cells():
    from epd_ring.models.promela import EXTENT_STATES, NONE, _parse_state

    copying, free = EXTENT_STATES.index("copying") + 1, EXTENT_STATES.index("free") + 1
    lines = ["ST 0 0 0", f"SL {copying} 0 0 2", f"SL {free} {NONE} 0 1",
             f"SL {copying} 0 0 128"]  # cells 0 and 2: room 0's extent, cell 2 marked with its first
    cells = _parse_state(lines)[1]
    assert [c[LEN] for c in cells] == [2, 1, -1] and list(extent(cells, 0)) == [0, 2]


def test_the_core_spans_in_lockstep_with_the_spec():
    h = Harness(SPANS)
    for ev in TO_SPAN:
        h.step(ev)  # the core's state is one of the spec's successors after every event
    (spanning,) = [e for e in h.executor.ring.extents.values() if e.pieces]
    assert [offset // h.cell_bytes for offset, _ in spanning.pieces] == [0, 2]
    assert h.state[1][0][LEN] == 2 and h.state[1][2][LEN] == -1  # the spec's cells: 0 first, 2 names it
    assert "cells0+2" in h.spec.describe(h.state)
    for ev in [("copied", 1), ("frame", 1), ("write_done", 1, 0)]:
        h.step(ev)
    assert h.manager.room_status(h.room(1)) == "success" and spanning.state == "free"


def test_a_core_that_does_not_span_leaves_the_spec(monkeypatch):
    from epd_ring.executor.core import ring

    monkeypatch.setattr(ring, "span", lambda arena, nbytes, most: None)
    h = Harness(SPANS)
    for ev in TO_SPAN[:-1]:
        h.step(ev)
    with pytest.raises(AssertionError):
        h.step(TO_SPAN[-1])  # the spec stages the item across cells 0 and 2; this core defers it


def test_the_walk_takes_every_spec_edge_the_core_can_and_spans_on_the_way(monkeypatch):
    from epd_ring.models import walk as walk_module

    reached = []
    history = walk_module.with_history
    monkeypatch.setattr(walk_module, "with_history", lambda state, h: reached.append(state) or history(state, h))
    w = walk_module.walk(SPANS)
    assert w.failures == [] and w.edges > 5000
    assert any(c[LEN] < 0 for st in reached for c in st[1])  # the core spanned on the walk


@pytest.mark.parametrize("cfg", [Config(4, 2, 1, 0, sizes=(1, 3), pieces=2),  # one cell taken at 1: 0 and 2-3
                                 Config(5, 2, 1, 0, sizes=(2, 3), pieces=2),  # a run of two beside a span
                                 # rooms with an owner: a field after the extent's, which the mirror keeps
                                 Config(4, 2, 1, 0, sizes=(1, 3), pieces=2, identities=2)],
                         ids=str)
def test_reading_the_arena_from_its_other_end_mirrors_a_spanning_extent(cfg):
    from epd_ring.models.walk import _reflect_spanning, reflect

    spec, moved = Spec(cfg), 0
    for st in reachable_states(cfg):
        image = reflect(st)
        assert reflect(image) == st
        assert _reflect_spanning(st) == image  # the general mirror agrees with the one-run loop everywhere
        assert {canonical(reflect(t.state)) for t in spec.successors(st)} == \
            {canonical(t.state) for t in spec.successors(image)}
        moved += any(c[LEN] < 0 for c in st[1]) and image != st
    assert moved > 0  # spanning states were mirrored


def test_the_room_view_reads_a_spanning_extent_in_every_cell_it_holds():
    """`epd-ring diagram --room-view`'s projection: a spanning extent is its room's wherever its cells lie,
    and another room's content in any of them shows as an overlap."""
    from epd_ring.models.graphs import room_view
    from epd_ring.models.spec import CONTENT

    h = Harness(SPANS)
    for ev in TO_SPAN:
        h.step(ev)
    state = h.state
    cells = state[1]
    assert cells[0][LEN] == 2 and cells[2][LEN] == -1  # room 1's item in cells 0 and 2
    assert room_view(state, 1)[7] == (cells[0][SS], True)
    for c in (0, 2):  # either piece holding room 0's bytes is an overlap
        bad = list(cells)
        bad[c] = (*cells[c][:CONTENT], 0, *cells[c][CONTENT + 1:])
        assert room_view((state[0], tuple(bad), *state[2:]), 1)[7] == (cells[0][SS], False)
