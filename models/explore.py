"""Exhaustive breadth-first exploration of the spec, with symmetry reduction.

Every reachable state (up to a permutation of room and extent identities) is
checked against the safety invariants; every transition against the checks
that belong to transitions (no write for a concluded room, no extended deadline,
failure sticky, status forward, a rank that strictly grows so the graph has no
cycle). A state with no successor must be quiescent, otherwise it deadlocks;
since the graph is acyclic, that also proves progress: from every reachable
state a quiescent one (every room concluded, every extent free) is reachable.

The first, and so shortest, trace to each kind of violation is kept; traces
are concrete (replayable event lists), rebuilt from the canonical path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import liveness
from .spec import CONCLUDED, CONTENT, EXTENTI, HAZARDS, OWNER, RS, SIZE, SS, UNSURE, Config, Spec
from .state import room_cells


def _keys(state: tuple) -> list:
    rooms, cells, deferred = state[0], state[1], state[2]
    dpos = {r: k for k, r in enumerate(deferred)} if deferred else {}
    keys = []
    for i, r in enumerate(rooms):
        s = r[EXTENTI]
        if s >= 0:
            own = all(cells[c][CONTENT] == i for c in room_cells(cells, s, r[SIZE]))
            keys.append((r[EXTENTI + 1:], r[:EXTENTI], s + 1, own, dpos.get(i, -1), i))
        else:
            keys.append((r[EXTENTI + 1:], r[:EXTENTI], 0, False, dpos.get(i, -1), i))
    keys.sort()
    return keys


def canonical(state: tuple) -> tuple:
    """Relabel rooms into canonical order: a complete invariant of the symmetry.

    Rooms are interchangeable, cells are not (with identities, only rooms of one owner are: the owner sorts
    first, so each identity's rooms keep their block of indices) (an extent is a run of neighbours,
    so a cell's place matters). Rooms are ordered by everything about them:
    their fields, the first cell of their extent, whether its cells hold their
    bytes, and their place in the deferred queue; cells keep their places, and
    the rooms they name are relabelled. Two states get the same canonical form
    exactly when a permutation of rooms maps one onto the other.
    """
    rooms, cells, deferred = state[0], state[1], state[2]
    keys = _keys(state)
    R = len(rooms)
    rmap = [0] * R
    for new, k in enumerate(keys):
        rmap[k[-1]] = new
    if rmap == _IDENTITY[R]:
        return state if deferred.__class__ is tuple else (rooms, cells, tuple(deferred), *state[3:])
    new_rooms = [None] * R
    for i, r in enumerate(rooms):
        new_rooms[rmap[i]] = r
    new_cells = tuple(sl if sl[CONTENT] < 0 else (sl[SS], rmap[sl[CONTENT]], *sl[UNSURE:]) for sl in cells)
    new_deferred = tuple(rmap[i] for i in deferred) if deferred else ()
    return (tuple(new_rooms), new_cells, new_deferred, *state[3:])


_IDENTITY = [list(range(n)) for n in range(16)]
_FACT = [1, 1, 2, 6, 24, 120, 720, 5040, 40320, 362880, 3628800]


def orbit_size(state: tuple) -> int:
    """How many states (relabellings of rooms) this one stands for.

    |orbit| = R! / |automorphisms|; an automorphism can only swap rooms with
    identical keys, so |automorphisms| is a product of factorials. Exact when
    no two rooms' extents overlap, which holds in every state that is not
    itself a violation (a test checks the sum against an unreduced search).
    """
    keys = _keys(state)
    stab = 1
    run = 1
    for a, b in zip(keys, keys[1:]):
        if a[:-1] == b[:-1]:
            run += 1
        else:
            stab *= _FACT[run]
            run = 1
    stab *= _FACT[run]
    rooms = state[0]
    if rooms and len(rooms[0]) > OWNER:  # with identities only rooms of one owner are interchangeable
        classes: dict[int, int] = {}
        for r in rooms:
            classes[r[OWNER]] = classes.get(r[OWNER], 0) + 1
        whole = 1
        for n in classes.values():
            whole *= _FACT[n]
        return whole // stab
    return _FACT[len(rooms)] // stab


@dataclass
class Violation:
    kind: str
    detail: str
    trace: list  # [(event, state), ...] from the initial state; the last step is the bad one
    hazard: str | None = None


@dataclass
class Result:
    config: Config
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    finals: int = 0
    fair_ends: int = 0  # states with successors but no fair event enabled (each judged by models/liveness.py)
    violations: dict = field(default_factory=dict)  # kind -> Violation
    symmetry: bool = True
    represented: int = 0  # states the explored ones stand for, before symmetry reduction

    @property
    def states_per_s(self) -> float:
        return self.states / self.seconds if self.seconds else 0.0

    @property
    def represented_per_s(self) -> float:
        return self.represented / self.seconds if self.seconds else 0.0


def _transition_check(spec: Spec, state: tuple, nxt: tuple, rank: int | None = None,
                      nrank: int | None = None) -> tuple[str, str] | None:
    for i, (a, b) in enumerate(zip(state[0], nxt[0])):
        if a is not b and a[RS] in CONCLUDED and b[RS] != a[RS]:
            kind = "failure-not-sticky" if a[RS] == "failed" else "status-not-forward"
            return kind, f"room {i} moved from {a[RS]} to {b[RS]}"
    if (spec.rank(nxt) if nrank is None else nrank) <= (spec.rank(state) if rank is None else rank):
        return ("model-cycle",
                "a transition did not increase the rank"  # pragma: no mutate (wording)
                )
    return None


def explore(config: Config, *, symmetry: bool = True, max_states: int | None = None,
            progress: Callable[[int, float, int], None] | None = None, stop_at_first: bool = False) -> Result:
    spec = Spec(config)
    init = spec.initial()
    canon = canonical if symmetry else (lambda s: s)
    start = canon(init)
    seen: dict[tuple, int] = {start: 0}
    parent: list[int] = [-1]
    ranks: list[int] = [spec.rank(start)]  # per state id: the rank is the same for every relabelling
    frontier = [start]
    result = Result(config, symmetry=symmetry)
    bad: dict[str, tuple[int, str]] = {}  # kind -> (state id, detail)
    tail: dict[int, tuple | None] = {}
    t0 = time.perf_counter()
    last = t0
    depth = 0
    transitions = 0
    finals = 0
    fair = liveness.fair_events(config.variant)
    fair_ends = 0
    shares = liveness.checks_shares(config)
    while frontier:
        nxt_frontier = []
        for state in frontier:
            sid = seen[state]
            steps = spec.successors(state)
            rank = ranks[sid]
            if not steps:
                if spec.is_final(state):
                    finals += 1
                elif "deadlock" not in bad:
                    bad["deadlock"] = (sid, "no event is enabled: " + spec.describe(state))
                continue
            if not any(st.event[0] in fair for st in steps):
                # Kept here forever is a fair behaviour: it must be done (the state is still explored).
                fair_ends += 1
                problem = liveness.stuck(state, steps, fair)
                if problem is not None and problem[0] not in bad:
                    bad[problem[0]] = (sid, problem[1])
            if shares and "identity-starved" not in bad:
                problem = liveness.starved(state, steps, fair, config.identities)
                if problem is not None:
                    bad[problem[0]] = (sid, problem[1])
            for step in steps:
                transitions += 1
                c = canon(step.state)
                known = seen.get(c)
                nrank = ranks[known] if known is not None else spec.rank(c)
                # Checks on the transition itself apply even when its target is known.
                problem = ((step.violation, step.detail or f"on {step.event}") if step.violation
                           else _transition_check(spec, state, step.state, rank, nrank))
                if known is not None and problem is None:
                    continue
                if problem is not None and problem[0] in bad:
                    continue
                cid = len(parent)
                if known is None:
                    seen[c] = cid
                else:
                    # A bad transition into a known state: keep the state, record a separate node for the trace.
                    seen[("bad-edge", cid)] = cid
                parent.append(sid)
                ranks.append(nrank)
                tail[cid] = step.event if known is not None else None
                if problem is None:
                    problem = spec.invariant(step.state)
                if problem:
                    bad.setdefault(problem[0], (cid, problem[1]))
                    continue  # a bad state is reported, not explored further
                nxt_frontier.append(c)
            if progress is not None:
                now = time.perf_counter()
                if now - last >= 1.0:
                    last = now
                    progress(len(parent), now - t0, depth)
            if max_states is not None and len(parent) >= max_states:
                nxt_frontier = []
                break
        if stop_at_first and bad:
            break
        frontier = nxt_frontier
        if frontier:
            depth += 1
    result.seconds = time.perf_counter() - t0
    result.states = len(parent)
    result.represented = (sum(orbit_size(st) for st in seen if st[0] != "bad-edge") if symmetry
                          else len(seen))
    result.transitions = transitions
    result.depth = depth
    result.finals = finals
    result.fair_ends = fair_ends
    if bad:
        result.violations = _violations(spec, config, bad, seen, parent, tail, canon)
    return result


def _violations(spec: Spec, config: Config, bad: dict, seen: dict, parent: list, tail: dict, canon) -> dict:
    """kind -> Violation, each with a concrete trace rebuilt from the canonical path to its bad state."""
    by_id = {v: k for k, v in seen.items()}
    out = {}
    for kind, (cid, detail) in bad.items():
        path = []
        i = cid
        last_event = tail.get(cid)
        if last_event is not None:  # the bad step led into a state already seen
            i = parent[cid]
        while i >= 0:
            path.append(by_id[i])
            i = parent[i]
        path.reverse()
        trace = concretize(spec, path, canon)
        if last_event is not None:
            state = trace[-1][1]
            step = next(st for st in spec.successors(state) if _event_matches(spec, state, st, last_event))
            trace.append((step.event, step.state))
        if last_event is not None or detail.startswith("on ("):
            detail = "on " + event_name(trace[-1][0])
        out[kind] = Violation(kind, detail, trace, HAZARDS.get((config.variant, kind)))
    return out


def _event_matches(spec: Spec, state: tuple, step, event: tuple) -> bool:
    """Does `step` take `event` (up to relabelling) and break a transition check?"""
    if step.event[0] != event[0]:
        return False
    return bool(step.violation) or _transition_check(spec, state, step.state) is not None


def concretize(spec: Spec, path: list[tuple], canon) -> list[tuple[tuple, tuple]]:
    """Turn a path of canonical states into concrete (event, state) steps from the initial state."""
    state = spec.initial()
    trace = [(("init",), state)]
    for target in path[1:]:
        for step in spec.successors(state):
            if canon(step.state) == target:
                state = step.state
                trace.append((step.event, state))
                break
        else:
            raise AssertionError("model bug: canonical path cannot be followed concretely")
    return trace


def event_name(event: tuple) -> str:
    name, *args = event
    if not args:
        return name
    what = "cell" if name == "release" else "room"  # pragma: no mutate (wording)
    if name == "tower" and len(args) > 1:
        return f"{name} room{args[0]} ({args[1]} cell{'s' if args[1] > 1 else ''})"  # pragma: no mutate (wording)
    return f"{name} {what}{args[0]}"


def format_trace(spec: Spec, violation: Violation,
                 heading: str = "shortest trace",  # pragma: no mutate (wording)
                 ) -> str:
    hazard = f" ({violation.hazard})" if violation.hazard else ""  # pragma: no mutate (wording)
    lines = [f"violation: {violation.kind}{hazard}",  # pragma: no mutate (wording)
             f"  {violation.detail}",
             f"{heading}, {len(violation.trace) - 1} events:",  # pragma: no mutate (wording)
             ]
    for n, (event, state) in enumerate(violation.trace):
        lines.append(f"  {n:2d}. {event_name(event):<22} {spec.describe(state)}")
    return "\n".join(lines)  # pragma: no mutate (wording)


def trace_to_json(config: Config, violation: Violation) -> str:
    head = {
        "config": {"cells": config.cells, "rooms": config.rooms, "receivers": config.receivers,
                   "faults": config.faults, "variant": config.variant, "sizes": list(config.sizes),
                   **({} if config.regions else {"regions": False}),
                   **({"peers": True} if config.peers else {}),
                   **({"channels": True} if config.channels else {}),
                   **({"late_landing": True} if config.late_landing else {}),
                   **({"restarts": config.restarts} if config.restarts else {}),
                   **({"identities": config.identities} if config.identities > 1 else {})},
        "violation": violation.kind,
        "hazard": violation.hazard,
        "detail": violation.detail,
    }
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    events = ",\n".join(f"    {json.dumps(list(e))}" for e, _ in violation.trace[1:])
    return "{\n" + "\n".join(lines) + f'\n  "events": [\n{events}\n  ]\n}}\n'



def replay(data: dict) -> tuple[list[tuple[tuple, tuple]], tuple[str, str] | None]:
    """Re-run a saved trace on the spec; return the steps and the violation it reaches, if any."""
    cfg = Config(**data["config"])
    spec = Spec(cfg)
    state = spec.initial()
    steps = [(("init",), state)]
    for raw in data["events"]:
        event = tuple(raw)
        for step in spec.successors(state):
            if step.event == event and _same_choice(step, data, len(steps)):
                break
        else:
            raise ValueError(f"event {event} is not enabled at step {len(steps)}: {spec.describe(state)}")
        problem = (step.violation, step.detail) if step.violation else (
            spec.invariant(step.state) or _transition_check(spec, state, step.state))
        state = step.state
        steps.append((event, state))
        if problem:
            return steps, problem
    if not spec.successors(state) and not spec.is_final(state):
        return steps, ("deadlock",
                       "no event is enabled: " + spec.describe(state)  # pragma: no mutate (wording)
                       )
    return steps, None


def _same_choice(step, data, index) -> bool:
    choices = data.get("states")
    if not choices:
        return True
    return repr(step.state) == choices[index - 1]
