"""Diagrams of the model: the reachable state graph of a tiny configuration, drawn as one room sees
it (a projection: rooms are interchangeable, so one room's view shows every room's life), the
receiver's view of a region, and hazard paths."""

from __future__ import annotations

import json

from epd_ring.fsm.diagrams import KIND_STYLE

from .explore import _transition_check, canonical, event_name, replay
from .fixtures import hazard_traces
from .spec import (
    CH,
    CH_NAMES,
    CONTENT,
    EXTENTI,
    GHOST,
    INFL,
    RCV,
    REG,
    REGION_MARK,
    RS,
    SIZE,
    SS,
    TOLD,
    W_MARK,
    Config,
    Spec,
    room_cells,
)

TINY = dict(cells=1, rooms=2, receivers=1, faults=1, sizes=(1,))
BAD = {"style": "filled", "fillcolor": "#f4b6b6", "color": "#b71c1c", "penwidth": "2"}


def short(spec: Spec, state: tuple) -> str:
    """A node label: one line per room, one per extent."""
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
    # pragma: no mutate start (drawing style)
    lines = [f'digraph "model {cfg.variant}" {{',
             f'  graph [label="{cfg.variant}: {cfg.cells} cell, {cfg.rooms} rooms, {cfg.receivers} receiver, '
             f'{cfg.faults} faults; {len(order)} states up to symmetry; red: breaks an invariant" '
             'labelloc=t fontname="Helvetica"];',
             '  node [shape=box style="rounded,filled" fontname="Helvetica" fontsize=9 fillcolor=white];',
             '  edge [fontname="Helvetica" fontsize=8];']
    # pragma: no mutate end
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
    # the edges' order: layout only: not mutated (the pragma below)
    for a, b, ev, problem in sorted(set(edges), key=lambda e: (e[0], e[1], e[2], e[3] or "")):  # pragma: no mutate
        extra = ' color="#b71c1c" fontcolor="#b71c1c"' if problem else ""
        lines.append(f'  n{a} -> n{b} [label="{ev}"{extra}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def room_view(state: tuple, i: int = 0) -> tuple:
    """What room i sees of a global state: itself, its receivers, the extent it uses, its queue place."""
    rooms, cells, deferred, _, halt = state[:5]
    r = rooms[i]
    s = r[EXTENTI]
    extent = ((cells[s][SS], all(cells[c][CONTENT] == i for c in room_cells(cells, s, r[SIZE]))) if s >= 0
              else ("", True))
    return (r[RS], r[CH], r[REG], r[TOLD], r[INFL], r[GHOST], r[RCV], extent, i in deferred, halt)


def _view_label(spec: Spec, v: tuple) -> str:
    rs, ch, reg, told, infl, ghost, rcv, (ss, mine), deferred, halt = v
    # pragma: no mutate start (label wording)
    lines = [rs, f"chunk {CH_NAMES[ch]}" + (" (queued)" if deferred and CH_NAMES[ch] != "deferred" else "")]
    # pragma: no mutate end
    counts = f"reg {reg}/{spec.N} told {told}" + (f" writes {infl}" if infl else "")
    counts += f" ghosts {ghost}" if ghost else ""
    lines.append(counts)
    if rcv:
        # label wording: not mutated (the pragma below)
        lines.append("receivers " + ",".join(REGION_MARK[g] + W_MARK[w] for g, w, _ in rcv))  # pragma: no mutate
    if ss:
        lines.append(f"extent {ss}" + ("" if mine else " OVERLAPPED"))
    if halt:
        lines.append(f"HALT {halt}")
    return "\\n".join(lines)


def room_view_dot(cfg: Config) -> str:
    """The reachable graph projected on room 0: one node per distinct view, one edge per event that
    changes it (events of other rooms that change nothing here are left out)."""
    spec = Spec(cfg)
    init = spec.initial()
    seen = {init}
    order = [init]
    views: dict[tuple, int] = {room_view(init): 0}
    bad: dict[int, str] = {}
    final: set[int] = set()
    edges: set[tuple[int, int, str, bool]] = set()
    k = 0
    while k < len(order):
        state = order[k]
        k += 1
        a = views[room_view(state)]
        steps = spec.successors(state)
        if not steps and spec.is_final(state):
            final.add(a)
        for step in steps:
            ev = step.event
            mine = len(ev) > 1 and ev[0] != "release" and ev[1] == 0
            found = ((step.violation, step.detail) if step.violation else
                     _transition_check(spec, state, step.state) or spec.invariant(step.state))
            problem = None
            if found:
                # Drawn where it is this room's trouble; another room's is the same picture by symmetry.
                if not ("room 0" in found[1] or (mine and step.violation)):
                    continue
                problem = found[0]
            vb = room_view(step.state)
            b = views.setdefault((vb, problem) if problem else vb, len(views))
            if problem:
                bad[b] = problem
            elif step.state not in seen:
                seen.add(step.state)
                order.append(step.state)
            if a != b:
                name = ev[0] if mine or ev[0] in ("release", "serve", "reap") else f"{ev[0]} (other room)"
                edges.add((a, b, name, bool(problem)))
    lines = [f'digraph "model {cfg.variant}" {{',
             f'  graph [label="{cfg.variant}: the life of one room in {cfg.cells} cell, {cfg.rooms} rooms, '
             f'{cfg.receivers} receiver, {cfg.faults} fault ({len(views)} views of {len(seen)} global states)\\n'
             f'receivers: o offered, W written, F failed, X withdrawing, R released; '
             f'~ write in flight, ? may land, . landed late\\nred: breaks an invariant; green: quiescent" '
             'labelloc=t fontname="Helvetica" rankdir=TB];',
             '  node [shape=box style="rounded,filled" fontname="Helvetica" fontsize=9 fillcolor=white];',
             '  edge [fontname="Helvetica" fontsize=8];']
    for v, n in sorted(views.items(), key=lambda x: x[1]):
        label = _view_label(spec, v[0] if n in bad else v)
        if n in bad:
            style = dict(BAD, label=f"{label}\\n{bad[n]}")
        elif n in final:
            style = dict(KIND_STYLE["free"], label=label)
        else:
            style = {"label": label}
        if n == 0:
            style["penwidth"] = "2"
        lines.append(f"  v{n} [{_attrs(style)}];")
    merged: dict[tuple[int, int, bool], list[str]] = {}
    for a, b, name, problem in sorted(edges):
        merged.setdefault((a, b, problem), []).append(name)
    for (a, b, problem), names in sorted(merged.items()):
        extra = ' color="#b71c1c" fontcolor="#b71c1c"' if problem else ""
        lines.append(f'  v{a} -> v{b} [label="{" | ".join(sorted(set(names)))}"{extra}];')
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
        out[f"model-{variant}"] = room_view_dot(Config(variant=variant, **TINY))
    for fname, text in sorted(hazard_traces().items()):
        stem = fname[:-5]
        out[f"trace-{stem}"] = trace_dot(stem, json.loads(text))
    return out


__all__ = ["model_sources", "room_view_dot", "state_graph_dot", "trace_dot"]
