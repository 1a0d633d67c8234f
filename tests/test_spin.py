"""SPIN on Promela generated from the same declarations and rules agrees with the Python explorer,
over the same arena of cells and extents of mixed sizes; a generator with one guard dropped makes
the two engines disagree."""

from __future__ import annotations

import pytest

from epd_ring.executor.tools import spin as spin_tool
from epd_ring.models import promela
from epd_ring.models.spec import PEER_VARIANTS, RCV, VARIANTS, Config

pytestmark = pytest.mark.skipif(not spin_tool.available(), reason="needs spin and gcc (apt-get install -y spin gcc)")


@pytest.mark.parametrize("regions", [False, True], ids=["encode-side", "both-ends"])
def test_spin_stores_exactly_the_explorers_canonical_states(regions, explored):
    """Same symmetry reduction, one atomic step per event: the two state spaces are the same set."""
    cfg = Config(cells=3, rooms=2, receivers=2, faults=1, regions=regions)
    spin, ours = spin_tool.check(cfg), explored(cfg)
    assert spin.violations == ours.violations == {}
    assert spin.states == ours.states
    print(f"{cfg}: {spin.states} states in both engines; SPIN {spin.transitions} transitions "
          f"(its count includes the quiescent states' idle step and one per alike receiver), "
          f"explorer {ours.transitions}")


@pytest.mark.parametrize("regions", [False, True], ids=["encode-side", "both-ends"])
@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - PEER_VARIANTS))  # the peer variants: explorer only
def test_spin_and_explorer_find_the_same_violations(variant, regions, explored):
    cfg = Config(cells=1, rooms=2, receivers=2, faults=1, variant=variant, regions=regions)
    spin, ours = spin_tool.check(cfg), explored(cfg)
    assert sorted(spin.violations) == sorted(ours.violations)
    assert (variant == "project") == (not spin.violations)
    for kind, v in spin.violations.items():
        # SPIN's trail was followed step by step on the spec (promela.rebuild) and ends in the same kind
        assert v.trace[0][0] == ("init",) and len(v.trace) == len(spin.raw[kind]) + 1
        assert v.hazard == ours.violations[kind].hazard


@pytest.mark.parametrize("cfg", [Config(cells=1, rooms=2, receivers=1, faults=2, peers=True, sizes=(1,)),
                                 Config(cells=2, rooms=2, receivers=2, faults=1, peers=True, sizes=(1,)),
                                 Config(cells=1, rooms=3, receivers=1, faults=1, peers=True, sizes=(1,),
                                        regions=False)], ids=str)
def test_peers_spin_stores_exactly_the_explorers_canonical_states(cfg, explored):
    """First contact, suspect peers' re-checks, write deadlines and heartbeat probes: the same state space."""
    spin, ours = spin_tool.check(cfg), explored(cfg)
    assert spin.violations == ours.violations == {}
    assert spin.states == ours.states
    assert {"suspect", "down", "up"} <= {p for state in _peer_states(cfg) for p in state}


def _peer_states(cfg):
    """The peer parts of the states the explorer reaches (to show the space takes every peer state)."""
    from epd_ring.models.spec import Spec

    spec, seen, stack = Spec(cfg), set(), []
    stack.append(spec.initial())
    while stack:
        state = stack.pop()
        if state in seen:
            continue
        seen.add(state)
        stack.extend(step.state for step in spec.successors(state))
    return {state[5] for state in seen}


def test_peers_a_generator_whose_down_peer_fails_no_rooms_disagrees_with_the_spec(monkeypatch):
    """Without `fail_rooms` SPIN finds a down peer with a live room, which the spec cannot reach."""
    monkeypatch.setitem(promela.ACTIONS, "fail_rooms", "skip")
    cfg = Config(cells=1, rooms=2, receivers=1, faults=1, peers=True, sizes=(1,))
    with pytest.raises(promela.Disagreement):
        spin_tool.check(cfg)
    verdict = spin_tool.check(cfg, replay_on_spec=False)
    assert "room-of-down-peer-live" in verdict.violations


def test_spin_finds_the_seeds_receiver_side_region_reuse():
    """The seed's receiver frees a region on Failed (or on its own abort) while a write into it may land."""
    cfg = Config(cells=1, rooms=2, receivers=2, faults=1, variant="seed", regions=True)
    spin = spin_tool.check(cfg)
    v = spin.violations["write-into-released-region"]
    assert v.hazard == "H6-receiver-region-reuse"
    # the trail, replayed on the spec, ends with a write landing for a receiver whose region is released
    (event, *where), _state = v.trace[-1]
    assert event in ("write_done", "late_landing")
    before = v.trace[-2][1]
    room, k = where
    assert before[0][room][RCV][k][0] == "released"
    # the encode side alone has no regions to reuse
    assert "write-into-released-region" not in spin_tool.check(Config(1, 2, 2, 1, variant="seed",
                                                                        regions=False)).violations


def test_a_model_spin_cannot_parse_is_an_error_not_a_verdict(monkeypatch):
    # SPIN prints its syntax error, exits 0 and writes a pan.c all the same: the check must not verify that
    made = spin_tool.generate
    monkeypatch.setattr(spin_tool, "generate", lambda *a, **kw: made(*a, **kw) + "\nnot_promela\n")
    with pytest.raises(RuntimeError):
        spin_tool.check(Config(cells=1, rooms=1, receivers=1, faults=1, regions=False, sizes=(1,)))


def test_a_generator_with_a_dropped_guard_makes_the_engines_disagree(explored):
    """Drop `write_unsure` from the extent's `settle` edges: an unsure write frees its extent at once."""
    cfg = Config(cells=1, rooms=2, receivers=1, faults=1, regions=False)
    assert explored(cfg).violations == {}
    assert spin_tool.check(cfg).violations == {}
    mutant = promela.generate(cfg, drop_guard=("extent", "settle", "write_unsure"))
    assert "write_unsure" not in mutant.split("inline extent_settle", 1)[1].split("inline", 1)[0]
    with pytest.raises(promela.Disagreement, match="overwrite-under-late-write|cannot reach"):
        spin_tool.check(cfg, drop_guard=("extent", "settle", "write_unsure"))
    verdict = spin_tool.check(cfg, drop_guard=("extent", "settle", "write_unsure"), replay_on_spec=False)
    assert sorted(verdict.violations) == ["overwrite-under-late-write"]


def test_cli_engine_spin(capsys):
    from epd_ring.executor.tools.cli import main

    assert main(["check", "--engine", "spin", "--cells", "1", "--rooms", "2", "--receivers", "1",
                 "--variant", "reaped-deferred-crash", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "violation: crash (deferred-send-after-reap)" in out and "SPIN trail, replayed on the spec" in out
    assert "serve" in out.splitlines()[-1]


def test_cli_spin_flags_reach_pan(monkeypatch, capsys, explored):
    """--spin-no-regions checks the encode side alone (the explorer's space with regions off) and
    --spin-memlim is pan's memory bound: too small a bound stops pan."""
    from epd_ring.executor.tools.cli import main

    seen = []
    check = spin_tool.check
    monkeypatch.setattr(spin_tool, "check", lambda cfg, **kw: seen.append((cfg, kw["memlim_mb"])) or check(cfg, **kw))
    size = ["--cells", "1", "--rooms", "2", "--receivers", "1"]
    assert main(["check", "--engine", "spin", *size, "--spin-no-regions", "--spin-memlim", "512", "--quiet"]) == 0
    cfg, memlim = seen[-1]
    assert not cfg.regions and memlim == 512
    assert f" {explored(cfg).states:,} states" in capsys.readouterr().out
    # a bound below the hash table's (-w22: 32 MB) stops pan: no verdict
    assert main(["check", "--engine", "spin", *size, "--spin-no-regions", "--spin-memlim", "1", "--quiet"]) != 0
    assert seen[-1][1] == 1 and "out of memory at 1 MB" in capsys.readouterr().err


def test_spin_finds_an_extent_reused_while_a_write_may_still_read_it(explored):
    """The seed-style arena (a range handed out again once its room is terminal): SPIN's trail, replayed
    on the spec, ends in an allocation over a two-cell extent whose unsure write may still land."""
    from epd_ring.models.spec import EXTENTI, SIZE

    cfg = Config(cells=3, rooms=2, receivers=1, faults=1, variant="reuse-when-terminal", sizes=(2,))
    spin, ours = spin_tool.check(cfg), explored(cfg)
    assert sorted(spin.violations) == sorted(ours.violations)
    v = spin.violations["overwrite-under-late-write"]
    assert v.hazard == "extent-reuse-when-terminal" and v.trace[-1][0][0] in ("tower", "serve")
    rooms = v.trace[-1][1][0]
    a, b = (r for r in rooms if r[EXTENTI] >= 0)
    assert a[SIZE] == b[SIZE] == 2 and abs(a[EXTENTI] - b[EXTENTI]) <= 1  # the two extents share a cell
    assert spin_tool.check(Config(cells=3, rooms=2, receivers=1, faults=1, sizes=(2,))).violations == {}
