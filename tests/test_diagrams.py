"""Diagrams are drawn from the declarations, deterministic, and kept fresh."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from epd_ring.executor.tools.diagrams import DIRECTORY, main as render_main, render, stale
from epd_ring.fsm import EXTENT, PEER, REGION, ROOM
from epd_ring.fsm.diagrams import machine_dot, parse_edges

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")


def dot_label(edge) -> str:
    if not edge.guards:
        return edge.event
    conds = " & ".join(g if want else f"!{g}" for g, want in edge.guards)
    return f"{edge.event} [{conds}]"


@pytest.mark.parametrize("machine", [EXTENT, ROOM, REGION, PEER], ids=lambda m: m.name)
def test_rendered_edges_equal_declared_transitions_both_ways(machine):
    drawn = parse_edges(machine_dot(machine))
    declared = {(e.source, e.dest, dot_label(e)) for e in machine.edges}
    assert drawn == declared


@pytest.mark.parametrize("machine", [EXTENT, ROOM, REGION, PEER], ids=lambda m: m.name)
def test_states_are_coloured_by_meaning(machine):
    dot = machine_dot(machine)
    from epd_ring.fsm.diagrams import KIND_STYLE

    for state in machine.states:
        colour = KIND_STYLE[machine.tags[state][0]]["fillcolor"]
        line = next(ln for ln in dot.splitlines() if ln.strip().startswith(f"{state} [label="))
        assert colour in line


def test_rendering_is_deterministic():
    assert render() == render()


def test_committed_diagrams_are_fresh():
    assert stale(ROOT / DIRECTORY, render()) == []


def test_the_command_writes_into_the_top_level_folder_by_default():
    from epd_ring.executor.tools.cli import build_parser

    assert build_parser().parse_args(["diagrams"]).dir == DIRECTORY
    assert (ROOT / DIRECTORY).parent == ROOT  # the card's layout; the docs site adds them (docs/hooks.py)


def test_check_names_stale_files(tmp_path):
    out = []
    assert render_main(str(tmp_path), check=True, echo=out.append) == 1
    assert render_main(str(tmp_path), echo=out.append) == 0
    assert render_main(str(tmp_path), check=True, echo=out.append) == 0
    (tmp_path / "extent.svg").write_text("<svg/>")
    (tmp_path / "old.dot").write_text("digraph {}")
    out.clear()
    assert render_main(str(tmp_path), check=True, echo=out.append) == 1
    text = "\n".join(out)
    assert "extent.svg" in text and "old.dot (no longer generated)" in text and "room.svg" not in text


def test_live_state_dump_as_text_and_picture():
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import make_rig

    rig = make_rig(extents=3)
    rig.executor.register("a", "h", 1, 11)
    rig.executor.register("b", "h", 1, 12)
    rig.manager.register_receiver(rig.frame(12, "prefill-0:1", 2, n=2))
    rig.executor.execute([("a", rig.item(2, 1)), ("b", rig.item(2, 2))])
    text = rig.executor.dump_state()
    assert "extent 1 @0+64: parked room=11" in text and "room 12: parked receivers=1/2" in text
    dot = rig.executor.dump_state("dot")
    assert "extent1 -> room11" in dot and '"prefill-0:1"' in dot
    svg = subprocess.run(["dot", "-Tsvg"], input=dot.encode(), capture_output=True, check=True).stdout
    assert b"<svg" in svg
