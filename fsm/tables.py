"""Markdown tables of the declared machines, for the docs' machines page (kept fresh by a test).

    python -m epd_ring.fsm.tables --write [PAGE]    # PAGE: docs/machines.md by default
"""

from __future__ import annotations

from .core import CompiledMachine
from .machines import EXTENT, ROOM
from .peer import PEER
from .regions import REGION


def states_table(machine: CompiledMachine) -> str:
    rows = ["| state | meaning | kind |", "| --- | --- | --- |"]
    for s in machine.states:
        mark = " (initial)" if s == machine.initial else ""
        rows.append(f"| `{s}`{mark} | {machine.docs.get(s, '')} | {', '.join(machine.tags[s])} |")
    return "\n".join(rows)


def events_table(machine: CompiledMachine) -> str:
    rows = ["| event | from | to | guard |", "| --- | --- | --- | --- |"]
    for e in machine.edges:
        guard = ", ".join(g if want else f"not {g}" for g, want in e.guards)
        rows.append(f"| `{e.event}` | `{e.source}` | `{e.dest}` | {guard} |")
    return "\n".join(rows)


def markdown() -> str:
    parts = []
    for m in (EXTENT, ROOM, REGION, PEER):
        guards = m.declaration.get("guard_docs", {})
        parts.append(f"#### {m.name.capitalize()} machine\n\n![{m.name} machine](diagrams/{m.name}.svg)\n\n"
                     f"{states_table(m)}\n\n{events_table(m)}")
        if guards:
            parts.append("\n".join(f"- guard `{g}`: {doc}" for g, doc in guards.items()))
    return "\n\n".join(parts)


BEGIN, END = "<!-- machine-tables:begin -->", "<!-- machine-tables:end -->"
# The page holding the markers, relative to the repository root.
PAGE = "docs/machines.md"


def refresh(text: str) -> str:
    """`text` with the block between the markers replaced by the current tables."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{markdown()}\n{END}{tail}"


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--write"]:
        path = sys.argv[2] if len(sys.argv) > 2 else PAGE
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(refresh(text))
    else:
        print(markdown())
