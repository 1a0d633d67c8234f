"""The core's shape, checked: it runs exactly the declared couplings, and every state it names is declared.

A state name written into the core as a string ("parked", "up") must be one the machines declare;
a misspelt or removed state would otherwise be a silent `False`. State sets are derived from the
declarations' tags and events (`ROOM.sources("stage")`), not written by hand.
"""

from __future__ import annotations

import ast
from pathlib import Path

from epd_ring.executor import EncodeExecutor, EncodeManager, FakeClock, LoopbackTransport
from epd_ring.fsm import EXTENT, PEER, REGION, ROOM, couplings

CORE = Path(__file__).resolve().parent.parent / "executor" / "core"
DECLARED = {s for m in (ROOM, EXTENT, PEER, REGION) for s in m.states}
# Names that hold a machine's state in the core (`room.state`, `was = peer.state`, ...).
STATE_NAMES = {"state", "was", "now", "dest", "now_state"}


def _holds_state(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "state") or (
        isinstance(node, ast.Name) and node.id in STATE_NAMES)


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def state_literals(source: str) -> list[tuple[int, str]]:
    """(line, literal) of every string compared with a state in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_holds_state(o) for o in operands):
                found += [(node.lineno, s) for o in operands for s in _strings(o)]
    return found


def test_every_state_the_core_compares_with_is_declared():
    undeclared = [(p.name, line, s) for p in sorted(CORE.glob("*.py"))
                  for line, s in state_literals(p.read_text()) if s not in DECLARED]
    assert not undeclared, undeclared
    # and the check looks where it should: the core does compare states by name
    assert sum(len(state_literals(p.read_text())) for p in CORE.glob("*.py")) > 5


def test_the_check_catches_an_undeclared_state():
    planted = 'def f(room, peer):\n    was = peer.state\n    return room.state in ("parked", "parkd") or was != "upp"\n'
    assert [s for _, s in state_literals(planted) if s not in DECLARED] == ["parkd", "upp"]


def test_the_core_runs_exactly_the_declared_couplings():
    m = EncodeManager(LoopbackTransport(FakeClock()), FakeClock())
    assert set(m.actions) == couplings.actions()
    ex = EncodeExecutor(m, object(), "cpu", ring_slots=1, ring_bytes=64)
    assert ex.ring.actions is m.actions and m.peers.actions is m.actions  # extents and peers step through them


def test_state_sets_come_from_the_declarations():
    from epd_ring.executor.core import peers, rooms

    assert rooms.ACCEPTS_CHUNK == {"registered", "ready"} == ROOM.sources("stage")
    assert rooms.EXPIRABLE == {"announced", "parked"} == ROOM.sources("expire")
    # Where a contact's report may be awaited: first contact, a suspect's re-check, an up peer's probe.
    assert peers._CONTACTING == {"connecting", "suspect", "up"} == PEER.sources("connected")
