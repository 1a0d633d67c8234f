"""Diagrams of the model: the reachable global state graph of a tiny configuration, and hazard paths."""

from __future__ import annotations

import json

from epd_ring.fsm.diagrams import KIND_STYLE

from .explore import _transition_check, canonical, event_name, replay
from .fixtures import hazard_traces
from .spec import Config, Spec

TINY = dict(slots=1, rooms=2, receivers=1, faults=0)
BAD = {"style": "filled", "fillcolor": "#f4b6b6", "color": "#b71c1c", "penwidth": "2"}


def short(spec: Spec, state: tuple) -> str:
    """A node label: one line per room, one per slot."""
    return "\\n".join(spec.describe_parts(state))


def _attrs(d: dict) -> str:
    return " ".join(f'{k}="{v}"' for k, v in sorted(d.items()))


def state_graph_dot(cfg: Config) -> str:
    """Every reachable state (up to symmetry) and every transition; bad states marked."""
    spec = Spec(cfg)
    start = canonical(spec.initial())
    ids = {start: 0}
    order = [start]
    edges = []
    bad = {}
    i = 0
    while i < len(order):
        state = order[i]
        i += 1
        if ids[state] in bad:
            continue
        for step in spec.successors(state):
            c = canonical(step.state)
            problem = step.violation or (_transition_check(spec, state, step.state) or (None,))[0]
            if c not in ids:
                ids[c] = len(order)
                order.append(c)
                problem = problem or (spec.invariant(step.state) or (None,))[0]
            if problem:
                bad.setdefault(ids[c], problem)
            edges.append((ids[state], ids[c], step.event[0], problem))
    lines = [f'digraph "model {cfg.variant}" {{',
             f'  graph [label="{cfg.variant}: {cfg.slots} slot, {cfg.rooms} rooms, {cfg.receivers} receiver, '
             f'{cfg.faults} faults; {len(order)} states up to symmetry; red: breaks an invariant" '
             'labelloc=t fontname="Helvetica"];',
             '  node [shape=box style="rounded,filled" fontname="Helvetica" fontsize=9 fillcolor=white];',
             '  edge [fontname="Helvetica" fontsize=8];']
    for n, state in enumerate(order):
        if n in bad:
            style = dict(BAD, label=f"{short(spec, state)}\\n{bad[n]}")
        elif not spec.successors(state) and spec.is_final(state):
            style = dict(KIND_STYLE["free"], label=short(spec, state))
        else:
            style = {"label": short(spec, state)}
        if n == 0:
            style["penwidth"] = "2"
        lines.append(f"  n{n} [{_attrs(style)}];")
    for a, b, ev, problem in sorted(set(edges), key=lambda e: (e[0], e[1], e[2], e[3] or "")):
        extra = ' color="#b71c1c" fontcolor="#b71c1c"' if problem else ""
        lines.append(f'  n{a} -> n{b} [label="{ev}"{extra}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def trace_dot(name: str, data: dict) -> str:
    """A hazard trace as a path: one node per state, one edge per event, the bad state in red."""
    spec = Spec(Config(**data["config"]))
    steps, problem = replay(data)
    title = f"{data['config']['variant']}: {data.get('hazard') or data['violation']} ({data['violation']})"
    lines = [f'digraph "{name}" {{', f'  graph [label="{title}" labelloc=t fontname="Helvetica" rankdir=TB];',
             '  node [shape=box style="rounded,filled" fontname="Helvetica" fontsize=9 fillcolor=white];',
             '  edge [fontname="Helvetica" fontsize=9];']
    for n, (_, state) in enumerate(steps):
        style = {"label": short(spec, state)}
        if n == len(steps) - 1 and problem:
            style = dict(BAD, label=f"{short(spec, state)}\\n{problem[0]}")
        lines.append(f"  t{n} [{_attrs(style)}];")
    for n, (event, _) in enumerate(steps[1:], start=1):
        lines.append(f'  t{n - 1} -> t{n} [label="{event_name(event)}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def model_sources() -> dict[str, str]:
    out = {}
    for variant in ("project", "seed"):
        out[f"model-{variant}"] = state_graph_dot(Config(variant=variant, **TINY))
    for fname, text in sorted(hazard_traces().items()):
        stem = fname[:-5]
        out[f"trace-{stem}"] = trace_dot(stem, json.loads(text))
    return out


__all__ = ["model_sources", "state_graph_dot", "trace_dot"]
