"""Compiling a declaration, checked on a machine compiled inside the test.

`EXTENT` and `ROOM` are compiled once at import, so a test that only uses them
cannot see a fault in the compiler that is introduced after import (as a
mutation tool does). These tests compile the declarations afresh and check the
result against the declaration and against the `transitions` Machine itself.
"""

from __future__ import annotations

import itertools

import pytest
from transitions import MachineError

from epd_ring.fsm import InvalidTransition, build_machine
from epd_ring.fsm.core import CompiledMachine, Edge, TaggedMachine
from epd_ring.fsm.machines import EXTENT_DECLARATION, ROOM_DECLARATION

DECLARATIONS = [EXTENT_DECLARATION, ROOM_DECLARATION]


def declared_edges(decl: dict) -> list[tuple[str, str, str, tuple]]:
    """(source, event, dest, guards) for every declared transition, in declaration order."""
    out = []
    for t in decl["transitions"]:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        guards = tuple((g, True) for g in t.get("conditions", [])) + tuple((g, False) for g in t.get("unless", []))
        for src in sources:
            out.append((src, t["trigger"], t["dest"], guards))
    return out


class Subject:
    def __init__(self, state, truth):
        self.state = state
        for name, value in truth.items():
            setattr(self, name, (lambda v: (lambda: v))(value))


@pytest.fixture(params=DECLARATIONS, ids=lambda d: d["name"])
def compiled(request):
    decl = request.param
    return decl, CompiledMachine(decl["name"], decl)


def test_states_tags_docs_and_initial_come_from_the_declaration(compiled):
    decl, m = compiled
    assert m.name == decl["name"] and m.declaration is decl
    assert m.initial == decl["initial"]
    assert m.states == tuple(s["name"] for s in decl["states"])
    assert m.tags == {s["name"]: tuple(s["tags"]) for s in decl["states"]}
    assert m.docs == decl["docs"]
    for tag in ("free", "in_flight", "unsure", "terminal", "waiting"):
        assert m.states_tagged(tag) == tuple(s["name"] for s in decl["states"] if tag in s["tags"])
    assert isinstance(m.machine, TaggedMachine)


def test_edges_events_and_guards_are_exactly_the_declared_ones(compiled):
    decl, m = compiled
    want = declared_edges(decl)
    assert sorted((e.source, e.event, e.dest, e.guards) for e in m.edges) == sorted(want)
    assert all(isinstance(e, Edge) for e in m.edges)
    assert set(m.events) == {t["trigger"] for t in decl["transitions"]}
    assert m.guards == tuple(sorted({g for *_, gs in want for g, _ in gs}))
    # the table keeps declaration order per (state, event): the first edge whose guards hold wins
    for (src, ev), options in m.table.items():
        assert list(options) == [(d, g) for s, e, d, g in want if (s, e) == (src, ev)]
    assert set(m.table) == {(s, e) for s, e, _, _ in want}
    for s, e, _, _ in want:
        assert m.allowed(s, e)
    assert not m.allowed(m.states[0], "no-such-event")


def test_step_and_destinations_agree_with_the_transitions_machine(compiled):
    decl, m = compiled

    class Model:
        pass

    checked = 0
    for values in itertools.product([False, True], repeat=len(m.guards)):
        truth = dict(zip(m.guards, values))
        model = Model()
        for name, value in truth.items():
            setattr(model, name, (lambda v: (lambda: v))(value))
        real = build_machine(decl, model=model)
        for state, event in itertools.product(m.states, m.events):
            real.set_state(state, model=model)
            try:
                real_dest = model.state if getattr(model, event)() else None
            except MachineError:
                real_dest = None
            assert m.destinations(state, event, truth) == real_dest, (state, event, truth)
            subject = Subject(state, truth)
            if real_dest is None:
                with pytest.raises(InvalidTransition) as info:
                    m.step(subject, event)
                assert (info.value.machine, info.value.state, info.value.event) == (m.name, state, event)
                assert info.value.subject is subject and subject.state == state
            else:
                assert m.step(subject, event) == real_dest == subject.state
            checked += 1
    assert checked == len(m.states) * len(m.events) * 2 ** len(m.guards)


def test_invalid_transition_says_which_machine_state_event_and_why():
    e = InvalidTransition("extent", "free", "send", subject="extent 3", detail="no declared guard holds")
    assert str(e) == "extent machine (extent 3): event 'send' is not allowed in state 'free': no declared guard holds"
    assert (e.machine, e.state, e.event, e.subject) == ("extent", "free", "send", "extent 3")
    bare = InvalidTransition("room", "new", "written")
    assert str(bare) == "room machine: event 'written' is not allowed in state 'new'"
    assert bare.subject is None and isinstance(bare, RuntimeError)


def test_edge_label_names_event_and_guards():
    assert Edge("a", "go", "b", ()).label == "go"
    assert Edge("a", "go", "b", (("x", True), ("y", False))).label == "go [x, not y]"


def test_build_machine_keeps_extra_arguments_and_no_auto_transitions():
    m = build_machine(EXTENT_DECLARATION)
    assert "to_free" not in m.events and m.initial == "free" and m.models == []
    plain = build_machine(EXTENT_DECLARATION, auto_transitions=True)
    assert "to_free" in plain.events


def test_a_declaration_without_docs_and_with_a_lone_guarded_edge():
    decl = {"name": "tiny", "initial": "a", "states": [{"name": "a", "tags": ["free"]}, {"name": "b", "tags": []}],
            "transitions": [{"trigger": "go", "source": "a", "dest": "b"},
                            {"trigger": "hop", "source": "a", "dest": "b", "conditions": ["ok"]}]}
    m = CompiledMachine("tiny", decl)
    assert m.docs == {} and m.guards == ("ok",)
    assert m.table == {("a", "go"): (("b", ()),), ("a", "hop"): (("b", (("ok", True),)),)}
    # a single edge with a guard is still guarded on the fast path
    with pytest.raises(InvalidTransition, match="no declared guard holds"):
        m.step(Subject("a", {"ok": False}), "hop")
    assert m.step(Subject("a", {"ok": True}), "hop") == "b"
    assert m.step(Subject("a", {"ok": False}), "go") == "b"


def test_an_unguarded_edge_after_a_guarded_one_is_the_fallback_as_in_transitions():
    decl = {"name": "tiny", "initial": "a", "states": [{"name": "a", "tags": []}, {"name": "b", "tags": []},
                                                       {"name": "c", "tags": []}],
            "transitions": [{"trigger": "go", "source": "a", "dest": "b", "conditions": ["ok"]},
                            {"trigger": "go", "source": "a", "dest": "c"}]}
    m = CompiledMachine("tiny", decl)
    assert m.step(Subject("a", {"ok": True}), "go") == "b"
    assert m.step(Subject("a", {"ok": False}), "go") == "c"
    machine = build_machine(decl)
    for ok, dest in ((True, "b"), (False, "c")):
        subject = Subject("a", {"ok": ok})
        machine.add_model(subject, initial="a")
        subject.go()
        assert subject.state == dest


def test_the_compiled_plans_go_where_step_goes_and_run_the_actions_a_step_runs(compiled):
    _, compiled = compiled
    # Actions named after what they mark, so a plan that runs the wrong ones, or enters on a self-loop, shows.
    on_enter = {s: (f"enter {s}",) for s in compiled.states}
    on_event = {e: (f"on {e}",) for e in compiled.events}
    plans = compiled.plans(on_enter, on_event)
    for state, event in itertools.product(compiled.states, compiled.events):
        options = compiled.table.get((state, event), ())
        if len(options) != 1 or options[0][1]:  # guarded or undeclared: not compiled, `step` decides
            assert (state, event) not in plans
            continue
        dest = options[0][0]
        subject = Subject(state, {})
        assert compiled.step(subject, event) == dest == plans[state, event][0]
        want = ((f"enter {dest}",) if dest != state else ()) + (f"on {event}",)
        assert plans[state, event][1] == want, (state, event)
    assert plans  # every machine here has unguarded steps


def test_a_state_or_event_the_coupling_tables_leave_out_has_no_actions_in_its_plan(compiled):
    _, compiled = compiled
    # fsm/couplings.py lists only the states and events that have actions: a plan for any other runs none
    plans = compiled.plans({}, {})
    assert plans and all(acts == () for _, acts in plans.values())
    entered = next(dest for (state, _), (dest, _) in plans.items() if dest != state)
    plans = compiled.plans({entered: ("enter",)}, {})
    for (state, event), (dest, acts) in plans.items():
        assert acts == (("enter",) if dest == entered != state else ()), (state, event)
