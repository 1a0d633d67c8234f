"""The machines of fsm/: every declared transition of each, refusal of undeclared ones (naming
machine, subject, state and event), agreement of the compiled table with the `transitions` Machine
it came from, machine building, and what is drawn from the declarations: the docs' machine tables and the
diagrams, declared and live.

Expectations are derived from the declaration dicts themselves (not from the compiled machines the
code under test reads), so a table or diagram that drops, renames or mislabels a state, event or
guard fails here.
"""

from __future__ import annotations

import itertools
import re
import shutil
from types import SimpleNamespace

import pytest
from transitions import Machine, MachineError
from transitions.extensions import GraphMachine

from epd_ring.fsm import (
    EXTENT,
    EXTENT_DECLARATION,
    PEER,
    PEER_DECLARATION,
    REGION,
    REGION_DECLARATION,
    ROOM,
    ROOM_DECLARATION,
    InvalidTransition,
    build_machine,
    tables,
)
from epd_ring.fsm.core import CompiledMachine
from epd_ring.fsm.diagrams import KIND_STYLE, live_dot, machine_dot, parse_edges

MACHINES = [EXTENT, ROOM, REGION, PEER]


class Subject:
    """A stepped object whose guards return fixed values."""

    def __init__(self, state, truth):
        self.state = state
        for name, value in truth.items():
            setattr(self, name, (lambda v: (lambda: v))(value))


def valuations(machine: CompiledMachine):
    for values in itertools.product([False, True], repeat=len(machine.guards)):
        yield dict(zip(machine.guards, values))


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_every_declared_edge_is_taken_when_its_guards_hold(machine):
    for edge in machine.edges:
        taken = False
        for truth in valuations(machine):
            if not all(truth[g] is want for g, want in edge.guards):
                continue
            subject = Subject(edge.source, truth)
            # Earlier edges for the same (source, event) win, as in transitions.
            expected = machine.destinations(edge.source, edge.event, truth)
            assert machine.step(subject, edge.event) == expected == subject.state
            taken = taken or expected == edge.dest
        assert taken, f"{machine.name}: edge {edge} is shadowed by an earlier one"


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_undeclared_transitions_raise_naming_machine_state_and_event(machine):
    refused = 0
    for state, event in itertools.product(machine.states, machine.events):
        if machine.allowed(state, event):
            continue
        subject = Subject(state, {g: True for g in machine.guards})
        with pytest.raises(InvalidTransition) as info:
            machine.step(subject, event)
        msg = str(info.value)
        assert machine.name in msg and repr(state) in msg and repr(event) in msg
        assert subject.state == state  # nothing moved
        refused += 1
    assert refused > 0


def test_guard_that_holds_nowhere_is_refused_not_ignored():
    subject = Subject("sending", {"writes_pending": False, "write_unsure": False})
    assert EXTENT.step(subject, "settle") == "free"
    # No valuation leaves `settle` without a match, so check refusal on a room guard.
    room = Subject("registered", {"all_receivers": False})
    assert ROOM.step(room, "add_receiver") == "registered"
    with pytest.raises(InvalidTransition, match="'bind_sender' is not allowed in state 'registered'"):
        ROOM.step(room, "bind_sender")


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_compiled_table_agrees_with_the_transitions_machine(machine):
    """For every state, event and guard valuation, both give the same answer."""

    class Model:
        pass

    checked = 0
    for truth in valuations(machine):
        model = Model()
        for name, value in truth.items():
            setattr(model, name, (lambda v: (lambda: v))(value))
        real = build_machine(machine.declaration, model=model)
        for state, event in itertools.product(machine.states, machine.events):
            real.set_state(state, model=model)
            try:
                moved = getattr(model, event)()
                real_dest = model.state if moved else None
            except MachineError:
                real_dest = None
            assert machine.destinations(state, event, truth) == real_dest, (state, event, truth)
            checked += 1
    assert checked == len(machine.states) * len(machine.events) * 2 ** len(machine.guards)


def test_extent_machine_has_the_states_safety_needs():
    assert {"free", "staged", "sending", "parked", "quarantined", "retired"} <= set(EXTENT.states)
    assert EXTENT.tags["quarantined"] == ("unsure",)
    assert EXTENT.tags["retired"] == ("terminal",)
    # Only quarantine expiry, an abandon (no write issued) or a clean settle free an extent.
    into_free = {(e.source, e.event) for e in EXTENT.edges if e.dest == "free"}
    assert into_free == {("copying", "abandon"), ("staged", "abandon"), ("parked", "abandon"),
                         ("sending", "settle"), ("quarantined", "release")}
    # A sending extent never goes straight to free when a write was unsure.
    assert EXTENT.destinations("sending", "settle", {"writes_pending": False, "write_unsure": True}) == "quarantined"


def test_room_failure_is_sticky_and_status_only_moves_forward():
    concluded = {"success", "failed"}
    for edge in ROOM.edges:
        if edge.source in concluded:
            assert edge.dest == edge.source, edge
    assert ROOM.destinations("failed", "fail", {"all_receivers": True}) == "failed"
    assert ROOM.destinations("success", "fail", {"all_receivers": True}) is None


def test_every_state_has_a_doc_and_a_tag():
    for machine in MACHINES:
        for state in machine.states:
            assert machine.docs.get(state), (machine.name, state)
            assert machine.tags[state], (machine.name, state)


def test_peer_takes_writes_only_when_up_and_comes_back_only_through_contact():
    # Only a successful contact (first contact, or the re-check of a suspect peer) leads to `up`.
    into_up = {(e.source, e.event) for e in PEER.edges if e.dest == "up" and e.source != "up"}
    assert into_up == {("connecting", "connected"), ("suspect", "connected")}
    # A down peer leaves `down` only for `connecting`, and only once its backoff passed.
    out_of_down = {(e.event, e.dest, e.guards) for e in PEER.edges if e.source == "down" and e.dest != "down"}
    assert out_of_down == {("contact", "connecting", (("backing_off", False),))}
    # A missed connect deadline takes the peer down from wherever contact (or a probe) was running.
    assert {e.source for e in PEER.edges if e.event == "connect_expired"} == {"connecting", "suspect", "up"}
    assert PEER.destinations("up", "write_failed", {"at_threshold": True, "backing_off": False}) == "suspect"
    assert PEER.destinations("up", "write_failed", {"at_threshold": False, "backing_off": False}) == "up"
    # The first overdue write makes an up peer suspect, whatever the threshold.
    assert PEER.destinations("up", "write_overdue", {"at_threshold": False, "backing_off": False}) == "suspect"
    # Only an up peer is probed (a contact is running everywhere else it could be).
    assert {e.source for e in PEER.edges if e.event == "probe"} == {"up"}
    with pytest.raises(InvalidTransition, match="peer machine.*'probe' is not allowed in state 'down'"):
        PEER.step(Subject("down", {}), "probe")


# ---------------------------------------------------------------- declarations, as read by the tests below

DECLARED = [(EXTENT, EXTENT_DECLARATION), (ROOM, ROOM_DECLARATION), (REGION, REGION_DECLARATION),
            (PEER, PEER_DECLARATION)]
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")
def declared_edges(decl: dict) -> list[tuple[str, str, str, tuple[tuple[str, bool], ...]]]:
    """(event, source, dest, guards) for every edge written in a declaration dict."""
    out = []
    for t in decl["transitions"]:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        guards = tuple((g, True) for g in t.get("conditions", [])) + tuple((g, False) for g in t.get("unless", []))
        for src in sources:
            out.append((t["trigger"], src, src if t["dest"] == "=" else t["dest"], guards))
    return out


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.split("\n")]


# ---------------------------------------------------------------- docs' machine tables (fsm/tables.py)

@pytest.mark.parametrize("machine,decl", DECLARED, ids=lambda x: getattr(x, "name", ""))
def test_states_table_lists_every_declared_state_with_meaning_and_kind(machine, decl):
    rows = table_rows(tables.states_table(machine))
    assert rows[0] == ["state", "meaning", "kind"]
    assert rows[1] == ["---", "---", "---"]
    expected = []
    for st in decl["states"]:
        mark = " (initial)" if st["name"] == decl["initial"] else ""
        expected.append([f"`{st['name']}`{mark}", decl["docs"][st["name"]], ", ".join(st["tags"])])
    assert rows[2:] == expected
    assert sum("(initial)" in r[0] for r in rows) == 1


def test_states_table_of_a_state_without_doc_or_with_two_tags():
    m = CompiledMachine("toy", {
        "name": "toy", "initial": "a",
        "states": [{"name": "a", "tags": ["free"]}, {"name": "b", "tags": ["in_flight", "unsure"]}],
        "transitions": [{"trigger": "go", "source": "a", "dest": "b"}],
        "docs": {"a": "the start"},
    })
    # an undocumented state gets an empty meaning cell, not "None"; tags are comma separated
    assert tables.states_table(m).split("\n")[2:] == [
        "| `a` (initial) | the start | free |",
        "| `b` |  | in_flight, unsure |",
    ]


@pytest.mark.parametrize("machine,decl", DECLARED, ids=lambda x: getattr(x, "name", ""))
def test_events_table_lists_every_declared_edge_with_its_guards(machine, decl):
    text = tables.events_table(machine)
    rows = table_rows(text)
    assert rows[0] == ["event", "from", "to", "guard"]
    assert rows[1] == ["---", "---", "---", "---"]
    expected = [[f"`{ev}`", f"`{src}`", f"`{dst}`", ", ".join(g if want else f"not {g}" for g, want in guards)]
                for ev, src, dst, guards in declared_edges(decl)]
    assert sorted(rows[2:]) == sorted(expected)
    assert len(rows) == 2 + len(expected)


def test_events_table_spells_a_two_guard_edge():
    # extent: settle from sending to quarantined needs write_unsure and not writes_pending
    assert "| `settle` | `sending` | `quarantined` | write_unsure, not writes_pending |" in \
        tables.events_table(EXTENT).split("\n")


def test_markdown_has_a_section_per_machine_with_diagram_tables_and_guard_docs():
    md = tables.markdown()
    expected = []
    for machine, decl in DECLARED:
        name = decl["name"]
        expected.append(f"#### {name[0].upper()}{name[1:]} machine")
        expected.append(f"![{name} machine](diagrams/{name}.svg)")
        expected.append(tables.states_table(machine))
        expected.append(tables.events_table(machine))
        if decl.get("guard_docs"):
            expected.append("\n".join(f"- guard `{g}`: {doc}" for g, doc in decl["guard_docs"].items()))
    # blocks separated by one blank line, in the order extent, room, region, peer
    assert md == "\n\n".join(expected)
    assert "- guard `writes_pending`: some write from this extent has not reported yet\n" \
           "- guard `write_unsure`: some write from this extent failed or timed out" in md


def test_refresh_replaces_only_the_generated_block():
    b, e = tables.BEGIN, tables.END
    before = f"# Title\n\nintro text\n{b}\nstale table\n| old | row |\n{e}\n\nafter the block\n"
    out = tables.refresh(before)
    assert out == f"# Title\n\nintro text\n{b}\n{tables.markdown()}\n{e}\n\nafter the block\n"
    assert tables.refresh(out) == out  # fresh text is a fixed point


def test_refresh_keeps_later_mentions_of_the_markers():
    # a README may quote the markers after the block (e.g. explaining how the tables are made):
    # only the first block is generated; everything after its end marker is kept byte for byte
    b, e = tables.BEGIN, tables.END
    tail = f"\n\nThe tables sit between `{b}` and `{e}`; quoted again: {b} {e} done.\n"
    out = tables.refresh(f"head\n{b}\nold\n{e}{tail}")
    assert out == f"head\n{b}\n{tables.markdown()}\n{e}{tail}"


def test_refresh_without_markers_is_an_error():
    with pytest.raises(ValueError):
        tables.refresh("no markers here\n")


# ---------------------------------------------------------------- declared machine diagrams

@pytest.mark.parametrize("machine,decl", DECLARED, ids=lambda x: getattr(x, "name", ""))
def test_machine_dot_is_titled_and_draws_every_declared_edge(machine, decl):
    dot = machine_dot(machine)
    assert f'label="epd-ring {decl["name"]} machine"' in dot
    assert "rankdir=LR" in dot
    drawn = parse_edges(dot)
    for ev, src, dst, guards in declared_edges(decl):
        label = ev if not guards else f"{ev} [{' & '.join(g if want else '!' + g for g, want in guards)}]"
        assert (src, dst, label) in drawn
    # no auto transitions (to_<state>) are drawn
    assert not any(label.startswith("to_") for _, _, label in drawn)
    assert machine_dot(machine) == dot


def test_machine_dot_leaves_graphmachine_styles_alone():
    pristine = {k: dict(v) for k, v in GraphMachine.style_attributes.items()}
    machine_dot(EXTENT)
    machine_dot(ROOM)
    # our per-kind node styles live on our machine only, not on the library's shared class table
    assert not set(KIND_STYLE) & set(GraphMachine.style_attributes["node"])
    assert {k: dict(v) for k, v in GraphMachine.style_attributes.items()} == pristine


def test_machine_dot_does_not_depend_on_pygraphviz_being_installed(monkeypatch):
    """With pygraphviz importable, transitions' default engine would switch to it; ours must not."""
    import transitions.extensions.diagrams_pygraphviz as pgv_backend

    expected = machine_dot(EXTENT)

    class NoPygraphviz:
        def __getattr__(self, name):
            raise AssertionError(f"pygraphviz.{name} used: the diagrams must come from the graphviz engine")

    monkeypatch.setattr(pgv_backend, "pgv", NoPygraphviz())
    assert machine_dot(EXTENT) == expected


def test_parse_edges_reads_quoted_bare_and_missing_labels():
    dot = "\n".join([
        "digraph {",
        '  a -> b [label="go [ok] | stop"]',
        '  "b" -> "c" [label=plain]',
        "  c -> a [style=dashed]",
        "  a [label=nodes_are_not_edges]",
        "}",
    ])
    assert parse_edges(dot) == {("a", "b", "go [ok]"), ("a", "b", "stop"), ("b", "c", "plain"), ("c", "a", "")}


# ---------------------------------------------------------------- live state picture

NODE = re.compile(r'^  ("?[\w:.-]+"?) \[(.*)\];$')
EDGE = re.compile(r'^  ("?[\w:.-]+"?) -> ("?[\w:.-]+"?)( \[style=dashed\])?;$')


def parse_live(dot: str):
    assert dot.endswith("}\n")
    lines = dot[:-1].split("\n")
    assert lines[:3] == ["digraph live {", "  rankdir=LR;", '  node [shape=box fontname="Helvetica"];']
    assert lines[-1] == "}"
    nodes, edges = {}, []
    for line in lines[3:-1]:
        if m := EDGE.match(line):
            edges.append((m.group(1).strip('"'), m.group(2).strip('"'), bool(m.group(3))))
        else:
            m = NODE.match(line)
            assert m, f"not a node or edge line: {line!r}"
            nodes[m.group(1).strip('"')] = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
    return nodes, edges


def test_live_dot_draws_extents_rooms_and_peers():
    extents = [SimpleNamespace(index=0, state="free", room=None, writes_in_flight=0),
             SimpleNamespace(index=1, state="sending", room=7, writes_in_flight=2),
             SimpleNamespace(index=2, state="parked", room=8, writes_in_flight=0)]
    rooms = {
        8: {"state": "parked", "receivers": ["p:3"], "n": 3},
        7: {"state": "transferring", "receivers": ["p:1", "p:2"], "n": 2},
        9: {"state": "announced", "receivers": ["p:4"], "n": None},  # sender not registered: N unknown
    }
    peers = {"p:2": {"state": "suspect"}, "p:1": {"state": "up"}}
    nodes, edges = parse_live(live_dot(extents, rooms, peers))

    def node(label, machine, state):
        return {"label": label, **KIND_STYLE[machine.tags[state][0]]}

    assert nodes == {
        # an extent shows its writes in flight only when it has some
        "extent0": node(r"extent 0\nfree", EXTENT, "free"),
        "extent1": node(r"extent 1\nsending\nwrites 2", EXTENT, "sending"),
        "extent2": node(r"extent 2\nparked", EXTENT, "parked"),
        # a room shows k of N registered receivers, "?" while N is unknown
        "room7": node(r"room 7\ntransferring 2/2", ROOM, "transferring"),
        "room8": node(r"room 8\nparked 1/3", ROOM, "parked"),
        "room9": node(r"room 9\nannounced 1/?", ROOM, "announced"),
        "p:1": node(r"peer p:1\nup", PEER, "up"),
        "p:2": node(r"peer p:2\nsuspect", PEER, "suspect"),
    }
    assert sorted(edges) == sorted([("extent1", "room7", False), ("extent2", "room8", False),
                                    ("room7", "p:1", True), ("room7", "p:2", True), ("room8", "p:3", True),
                                    ("room9", "p:4", True)])


def test_live_dot_of_an_idle_controller():
    nodes, edges = parse_live(live_dot([], {}))
    assert nodes == {} and edges == []


@needs_dot
def test_live_dot_renders_with_graphviz():
    import subprocess

    extents = [SimpleNamespace(index=0, state="sending", room=1, writes_in_flight=1)]
    dot = live_dot(extents, {1: {"state": "transferring", "receivers": ["h:1"], "n": 1}}, {"h:1": {"state": "up"}})
    plain = subprocess.run(["dot", "-Tplain"], input=dot.encode(), capture_output=True, check=True).stdout.decode()
    assert {ln.split()[1] for ln in plain.splitlines() if ln.startswith("node ")} == {"extent0", "room1", '"h:1"'}


# ---------------------------------------------------------------- building machines

@pytest.mark.parametrize("machine,decl", DECLARED, ids=lambda x: getattr(x, "name", ""))
def test_build_machine_has_only_the_declared_events(machine, decl):
    m = build_machine(decl)
    assert isinstance(m, Machine)
    assert m.auto_transitions is False
    assert set(m.events) == {t["trigger"] for t in decl["transitions"]}
    assert m.models == []  # no model attached: the machine is a table, not a stateful object
    assert m.initial == decl["initial"]


def test_build_machine_extra_arguments_override_the_defaults():
    m = build_machine(EXTENT_DECLARATION, auto_transitions=True)
    assert {f"to_{s['name']}" for s in EXTENT_DECLARATION["states"]} <= set(m.events)


# ---------------------------------------------------------------- stepping: what a refusal names

class Lamp:
    """A stepped object: its guard `powered` is a predicate method, as for Extent and Room."""

    def __init__(self, state: str, powered: bool):
        self.state = state
        self._powered = powered

    def powered(self) -> bool:
        return self._powered

    def __str__(self) -> str:
        return f"lamp in {self.state}"


LAMP = CompiledMachine("lamp", {
    "name": "lamp", "initial": "off",
    "states": [{"name": "off", "tags": ["free"]}, {"name": "on", "tags": ["in_flight"]},
               {"name": "broken", "tags": ["terminal"]}],
    "transitions": [{"trigger": "switch", "source": "off", "dest": "on", "conditions": ["powered"]},
                    {"trigger": "switch", "source": "on", "dest": "off"},
                    {"trigger": "smash", "source": ["off", "on"], "dest": "broken"}],
})


def test_step_refuses_an_undeclared_event_naming_machine_subject_state_and_event():
    lamp = Lamp("broken", powered=True)
    with pytest.raises(InvalidTransition) as info:
        LAMP.step(lamp, "switch")
    e = info.value
    assert all(fact in str(e) for fact in ("lamp machine", "(lamp in broken)", "'switch'", "'broken'"))
    assert (e.machine, e.state, e.event, e.subject) == ("lamp", "broken", "switch", lamp)
    assert lamp.state == "broken"


def test_step_refuses_when_no_guard_holds_and_says_so():
    lamp = Lamp("off", powered=False)
    with pytest.raises(InvalidTransition) as info:
        LAMP.step(lamp, "switch")
    e = info.value
    assert all(fact in str(e) for fact in ("lamp machine", "(lamp in off)", "'switch'", "'off'", "guard"))
    assert (e.machine, e.state, e.event, e.subject) == ("lamp", "off", "switch", lamp)
    assert lamp.state == "off"


def test_step_moves_along_guarded_and_bare_edges():
    lamp = Lamp("off", powered=True)
    assert LAMP.step(lamp, "switch") == "on" == lamp.state  # guard holds
    assert LAMP.step(lamp, "switch") == "off" == lamp.state  # single unguarded edge
    assert LAMP.step(lamp, "smash") == "broken" == lamp.state


def test_sources_are_the_states_an_event_is_declared_from():
    assert ROOM.sources("stage") == {"registered", "ready"}
    assert ROOM.sources("expire") == {"announced", "parked"}
    assert PEER.sources("connected") == {"connecting", "suspect", "up"}
    assert ROOM.sources("no such event") == frozenset()
