"""Compile a `transitions` declaration into the table the runtime steps through.

The `transitions.Machine` built from a declaration is the single source of
truth. A trigger through it costs about 8 us, too much for a per-item hot path
that fires several transitions, so at import time we read its events back out
into a dict keyed by (state, event). Nothing here is written by hand: every
entry comes from the Machine object, and a test checks that both agree on every
state, event and guard valuation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from transitions import Machine
from transitions.extensions.states import Tags, add_state_features


class InvalidTransition(RuntimeError):
    """An event was fired that the declaration does not allow from this state."""

    def __init__(self, machine: str, state: str, event: str, subject: Any = None, detail: str = ""):
        self.machine = machine
        self.state = state
        self.event = event
        self.subject = subject
        who = f" ({subject})" if subject is not None else ""
        why = f": {detail}" if detail else ""
        super().__init__(
            f"{machine} machine{who}: event {event!r} is not allowed in state {state!r}{why}"
        )


@add_state_features(Tags)
class TaggedMachine(Machine):
    """Machine whose states carry tags (their meaning: free, in_flight, unsure, terminal)."""


# (predicate name, required value), in order
Guards = tuple[tuple[str, bool], ...]


@dataclass(frozen=True)
class Edge:
    source: str
    event: str
    dest: str
    guards: Guards

    @property
    def label(self) -> str:
        if not self.guards:
            return self.event
        conds = ", ".join(name if want else f"not {name}" for name, want in self.guards)
        return f"{self.event} [{conds}]"


class CompiledMachine:
    """A declared machine, compiled for stepping plain objects with a `.state`.

    Guards are predicate methods on the stepped object, named in the
    declaration; the first declared edge whose guards hold wins, as in
    `transitions`. If no edge exists, or none of their guards hold, the step
    raises InvalidTransition: nothing is ignored silently.
    """

    def __init__(self, name: str, declaration: dict[str, Any]):
        self.name = name
        self.declaration = declaration
        self.machine = build_machine(declaration)
        # Every declaration names its initial state (the stubs allow a machine without one).
        self.initial = cast(str, self.machine.initial)
        self.states: tuple[str, ...] = tuple(self.machine.states)
        self.tags: dict[str, tuple[str, ...]] = {
            # `tags` comes from the Tags state feature, which the stubs do not add to `State`.
            s: tuple(self.machine.get_state(s).tags) for s in self.states  # type: ignore[attr-defined]
        }
        self.docs: dict[str, str] = dict(declaration.get("docs", {}))
        edges: list[Edge] = []
        for event_name, event in self.machine.events.items():
            for source, transitions in event.transitions.items():
                for t in transitions:
                    # Guards are declared by name, never as callables.
                    guards = tuple((cast(str, c.func), bool(c.target)) for c in t.conditions)
                    edges.append(Edge(source, event_name, t.dest or source, guards))
        self.edges: tuple[Edge, ...] = tuple(edges)
        self.events: tuple[str, ...] = tuple(self.machine.events)
        self.guards: tuple[str, ...] = tuple(
            sorted({g for e in edges for g, _ in e.guards})
        )
        table: dict[tuple[str, str], list[tuple[str, Guards]]] = {}
        for e in edges:
            table.setdefault((e.source, e.event), []).append((e.dest, e.guards))
        self.table: dict[tuple[str, str], tuple[tuple[str, Guards], ...]] = {
            k: tuple(v) for k, v in table.items()
        }
        # Hot path: an unguarded single edge is stored as its bare destination, guarded edges as their
        # compiled pick (`_compile_pick`).
        self._fast: dict[tuple[str, str], str | Callable[[Any], str | None]] = {
            k: (v[0][0] if len(v) == 1 and not v[0][1] else _compile_pick(tuple(v))) for k, v in table.items()
        }

    def plans(self, on_enter: Mapping[str, tuple[str, ...]],
              on_event: Mapping[str, tuple[str, ...]]) -> dict[tuple[str, str], tuple[str, tuple[str, ...]]]:
        """(state, event) -> (destination, actions) for every step with one unguarded edge.

        The compiled success path: a caller steps there with one lookup, then runs the actions
        (entering the destination when it differs from the state, then the event's), in the order
        `step` and its caller would. Guarded and undeclared steps are not in it: they go through
        `step`, which checks the guards and raises InvalidTransition as ever.
        """
        return {k: (v, (on_enter.get(v, ()) if v != k[0] else ()) + on_event.get(k[1], ()))
                for k, v in self._fast.items() if type(v) is str}

    def allowed(self, state: str, event: str) -> bool:
        return (state, event) in self.table

    def step(self, obj: Any, event: str) -> str:
        """Move `obj.state` along the declared edge for `event`; return the new state."""
        state = obj.state
        options = self._fast.get((state, event))
        if isinstance(options, str):
            obj.state = options
            return options
        if options is None:
            raise InvalidTransition(self.name, state, event, obj)
        dest = options(obj)
        if dest is None:  # the detail below: wording, not mutated
            raise InvalidTransition(self.name, state, event, obj, "no declared guard holds")  # pragma: no mutate
        obj.state = dest
        return dest

    def destinations(self, state: str, event: str, truth: dict[str, bool]) -> str | None:
        """Where `event` leads from `state` given guard values, or None if refused."""
        for dest, guards in self.table.get((state, event), ()):
            if all(truth[g] is want for g, want in guards):
                return dest
        return None

    def states_tagged(self, tag: str) -> tuple[str, ...]:
        return tuple(s for s in self.states if tag in self.tags[s])

    def sources(self, event: str) -> frozenset[str]:
        """The states `event` is declared from (whatever its guards)."""
        return frozenset(e.source for e in self.edges if e.event == event)


def _compile_pick(options: tuple[tuple[str, Guards], ...]) -> Callable[[Any], str | None]:
    """The destination of a guarded step, as one straight-line function of the object stepped.

    Written from the declaration's edges for this (state, event), in declared order: each edge's
    guards are called in order, the first failing one ends that edge, and the first edge whose
    guards all hold gives the destination (None: none holds), as `transitions` decides. Generated
    rather than looped over: a loop over (dest, guards) pairs cost about three times the calls."""
    lines = ["def pick(obj):"]
    for dest, guards in options:
        if not all(name.isidentifier() for name, _ in guards):
            raise ValueError(f"guard names must be identifiers, got {[name for name, _ in guards]}")
        cond = " and ".join(f"obj.{name}()" if want else f"not obj.{name}()" for name, want in guards)
        lines.append(f"    if {cond or 'True'}:\n        return {dest!r}")
    lines.append("    return None")
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)  # the text is built above from the declaration alone
    pick: Callable[[Any], str | None] = namespace["pick"]
    return pick


def build_machine(declaration: dict[str, Any], cls: type[Machine] = TaggedMachine, **extra: Any) -> Machine:
    """Instantiate a `transitions` machine class from a declaration dict."""
    kwargs = {k: v for k, v in declaration.items() if k not in ("docs", "guard_docs")}
    kwargs.setdefault("auto_transitions", False)
    kwargs.setdefault("model", None)
    kwargs.update(extra)
    return cls(**kwargs)
