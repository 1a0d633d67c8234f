"""State diagrams of the declared machines, drawn by transitions' GraphMachine and graphviz.

States are filled by meaning (their tags); edges carry event and guard. The
output is deterministic: same declaration, same bytes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, cast

from transitions.extensions import GraphMachine
from transitions.extensions.states import Tags, add_state_features

from .core import CompiledMachine, build_machine

# One colour per meaning, shared by every diagram of the project.
KIND_STYLE = {
    "free": {"style": "rounded,filled", "fillcolor": "#d8f0d8", "color": "#2e7d32"},
    "waiting": {"style": "rounded,filled", "fillcolor": "#e3ecfa", "color": "#1f4e9c"},
    "in_flight": {"style": "rounded,filled", "fillcolor": "#fff1c9", "color": "#a66d00"},
    "unsure": {"style": "rounded,filled", "fillcolor": "#ffd8c2", "color": "#b8430b"},
    "terminal": {"style": "rounded,filled", "fillcolor": "#e0e0e0", "color": "#424242"},
    "down": {"style": "rounded,filled", "fillcolor": "#f6c6c6", "color": "#9c1f1f"},
}


@add_state_features(Tags)
class TaggedGraphMachine(GraphMachine):
    pass


def machine_dot(machine: CompiledMachine) -> str:
    """DOT source of a declared machine."""

    class Model:
        pass

    model = Model()
    gm = cast(GraphMachine, build_machine(machine.declaration, cls=TaggedGraphMachine, model=model,
                                          graph_engine="graphviz", show_conditions=True))
    # A copy: the class-level styles are shared by every GraphMachine.
    styles: dict[str, Any] = copy.deepcopy(gm.style_attributes)
    for kind, style in KIND_STYLE.items():
        styles["node"][kind] = dict(styles["node"]["default"], **style)
    gm.style_attributes = styles
    graph = gm.model_graphs[id(model)]
    graph.reset_styling()
    for state in machine.states:
        graph.set_node_style(state, machine.tags[state][0])
    # The graphviz backend hands back a graphviz.Digraph (the stubs say only GraphProtocol).
    dot: Any = graph.get_graph(title=f"epd-ring {machine.name} machine")
    dot.graph_attr["rankdir"] = "LR"
    return str(dot.source)


def parse_edges(dot: str) -> set[tuple[str, str, str]]:
    """(source, dest, label) for every edge label in DOT text written by graphviz."""
    import re

    edges = set()
    for m in re.finditer(r'^\s*"?([\w]+)"?\s*->\s*"?([\w]+)"?\s*\[(.*)\]\s*$', dot, re.M):
        src, dst, attrs = m.groups()
        label = re.search(r'label=(?:"([^"]*)"|(\w+))', attrs)
        text = (label.group(1) or label.group(2)) if label else ""
        for part in text.split(" | "):
            edges.add((src, dst, part))
    return edges


def live_dot(extents: Iterable[Any], rooms: Mapping[int, Mapping[str, Any]],
             peers: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """A picture of live controller state: extents by state, the rooms they hold, receivers' peers.

    `extents`: the ring's live extents (objects with index/state/room/writes_in_flight);
    `rooms`: the manager's snapshot;
    `peers`: the peer table's snapshot (session -> state).
    """
    from .machines import EXTENT, ROOM
    from .peer import PEER

    def attrs(machine: CompiledMachine, state: str) -> str:
        style = KIND_STYLE[machine.tags[state][0]]
        return " ".join(f'{k}="{v}"' for k, v in sorted(style.items()))

    lines = ["digraph live {", "  rankdir=LR;", '  node [shape=box fontname="Helvetica"];']
    for s in extents:
        extra = f"\\nwrites {s.writes_in_flight}" if s.writes_in_flight else ""
        lines.append(f'  extent{s.index} [label="extent {s.index}\\n{s.state}{extra}" {attrs(EXTENT, s.state)}];')
        if s.room is not None:
            lines.append(f"  extent{s.index} -> room{s.room};")
    for rid, info in sorted(rooms.items()):
        n = info["n"] or "?"
        lines.append(f'  room{rid} [label="room {rid}\\n{info["state"]} {len(info["receivers"])}/{n}" '
                     f'{attrs(ROOM, info["state"])}];')
        for session in info["receivers"]:
            lines.append(f'  room{rid} -> "{session}" [style=dashed];')
    for session, info in sorted((peers or {}).items()):
        lines.append(f'  "{session}" [label="peer {session}\\n{info["state"]}" {attrs(PEER, info["state"])}];')
    lines.append("}")
    return "\n".join(lines) + "\n"
