"""Walk the implementation along every edge of the spec's graph, and say how many it took.

Breadth-first over the spec's states up to relabelling rooms (`explore.canonical`), each reached on
the implementation by a shortest event path: from each state reached, every event the spec enables
there is taken on a `conformance.Harness` brought to that state by replaying its path (unchecked: the
path was checked when it was first walked) and then stepped in lockstep (checked: the spec's
successors, its invariants and `check_full_state`). A step's target not seen before joins the
frontier with its path; prefixes are shared through parent links.

A state is taken once per history the core keeps of it (`with_history`: each failed room's reason
kind, which the spec does not keep and the core may branch on later), so a late frame reaches a room
failed by its park deadline even where a room failed otherwise is the same spec state and nearer.

Coverage counts edges `(state, event, target)` up to relabelling: the implementation is
deterministic (the arena places an extent at the lowest free cells), so where the spec lets an
event reach several states (any run of free cells), it walks one of them; the rest, and the states
only they lead to, are what is left. Run: `python -m epd_ring.models.walk 2 3 2 1 --sizes 1`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import permutations

from .conformance import Harness
from .conformance_clock import NotByClock
from .explore import canonical, event_name
from .spec import EXTENTI, LEN, RS, SIZE, Config, Spec, extent
from .state import runs


@dataclass
class Walk:
    config: Config
    spec_states: int = 0
    spec_edges: int = 0
    states: int = 0  # spec states (up to relabelling) the implementation was brought to
    nodes: int = 0  # spec states with a history (`with_history`): each one's edges are walked
    edges: int = 0  # spec edges walked on the implementation
    steps: int = 0  # events applied, replays included
    seconds: float = 0.0
    # edges whose deadlines fired through the clock and poll(); edges whose deadline could not be made the
    # clock's next (`conformance_clock.NotByClock`): not walked
    deadlines: dict = field(default_factory=lambda: {"clock": 0, "not by clock": 0})
    failures: list = field(default_factory=list)  # (event path, message): the implementation left the spec

    @property
    def edge_coverage(self) -> float:
        return self.edges / self.spec_edges if self.spec_edges else 0.0

    @property
    def state_coverage(self) -> float:
        return self.states / self.spec_states if self.spec_states else 0.0

    def summary(self) -> str:
        c = self.config
        # pragma: no mutate start (report wording)
        return (f"({c.cells},{c.rooms},{c.receivers},{c.faults}) sizes {c.sizes}"
                f"{' peers' if c.peers else ''}: {self.edges}/{self.spec_edges} edges "
                f"({100 * self.edge_coverage:.1f}%), {self.states}/{self.spec_states} states "
                f"({100 * self.state_coverage:.1f}%), {self.nodes} with their histories; "
                f"deadlines fired through the clock and poll() on "
                f"{self.deadlines['clock']} edges, not the clock's next on {self.deadlines['not by clock']}; "
                f"{self.steps} events in {self.seconds:.0f} s, "
                f"{len(self.failures)} nonconforming")
        # pragma: no mutate end


def _sizes(cfg: Config, path: list[tuple]) -> tuple[int, ...]:
    """Each room's item size for a harness taking `path`: the size its tower event picks, else the default."""
    sizes = list(Harness.room_sizes(cfg))
    for ev in path:
        if ev[0] == "tower" and len(ev) > 2:
            sizes[ev[1]] = ev[2]
    return tuple(sizes)


def replay(cfg: Config, path: list[tuple], sizes: tuple[int, ...], plan: list[tuple] | None = None,
           arms: list[frozenset] = ()) -> Harness:
    """A fresh harness brought along `path` (already walked and checked) without checking again; `plan`
    (default: `path`) and `arms` as `Harness` takes them."""
    h = Harness(cfg, room_sizes=sizes, plan=path if plan is None else plan, arms=arms)
    h.follow(path)
    return h


def canonical_cells(state: tuple) -> tuple:
    """Relabel rooms and cells: with items of one cell every extent is one cell, so cells are as
    interchangeable as the extents of a ring (the arena always takes the lowest free one; the spec any)."""
    rooms, cells = state[0], state[1]
    best = None
    for perm in permutations(range(len(cells))):
        moved = [None] * len(cells)
        for c, to in enumerate(perm):
            moved[to] = cells[c]
        rs = tuple(r if r[EXTENTI] < 0 else (*r[:EXTENTI], perm[r[EXTENTI]], *r[EXTENTI + 1:]) for r in rooms)
        c = canonical((rs, tuple(moved), *state[2:]))
        if best is None or c < best:
            best = c
    return best


def reflect(state: tuple) -> tuple:
    """The same state with the arena read from its other end: the spec leases any run of free cells, so
    a state and its mirror image have mirrored futures."""
    rooms, cells = state[0], state[1]
    n = len(cells)
    if any(cell[LEN] < 0 for cell in cells):
        return _reflect_spanning(state)
    first = [0] * n  # each cell's extent: its first cell
    for c, cell in enumerate(cells):
        first[c] = c if cell[LEN] or c == 0 else first[c - 1]
    moved = [None] * n
    for c, cell in enumerate(cells):
        f = first[c]
        length = cells[f][LEN] or 1
        at = n - 1 - c
        moved[at] = (*cell[:LEN], length if at == n - f - length else 0)
    x = EXTENTI
    rs = tuple(r if r[x] < 0 else (*r[:x], n - r[x] - (r[SIZE] or 1), *r[x + 1:]) for r in rooms)
    return (rs, tuple(moved), *state[2:])


def _reflect_spanning(state: tuple) -> tuple:
    """`reflect` of a state where an extent spans runs of cells (`Config.pieces` > 1: the project's rules,
    so no extent overlaps another): each extent's cells mirrored, its first cell the lowest of their images."""
    rooms, cells = state[0], state[1]
    n = len(cells)
    moved: list = [None] * n
    image_of = {}  # an extent's first cell -> its image's
    for f, cell in enumerate(cells):
        if cell[LEN] <= 0:
            continue
        own = extent(cells, f)
        img = sorted(n - 1 - c for c in own)
        image_of[f] = img[0]
        spans = runs(img) > 1
        for c in own:
            at = n - 1 - c
            moved[at] = (*cells[c][:LEN], len(own) if at == img[0] else -1 - img[0] if spans else 0)
    x = EXTENTI
    rs = tuple(r if r[x] < 0 else (*r[:x], image_of[r[x]], *r[x + 1:]) for r in rooms)
    return (rs, tuple(moved), *state[2:])


def canonical_mirror(state: tuple) -> tuple:
    """Relabel rooms, and read the arena from whichever end gives the smaller form."""
    return min(canonical(state), canonical(reflect(state)))


def spec_graph(spec: Spec, canon: Callable[[tuple], tuple] = canonical) -> tuple[int, int]:
    """The spec's states and edges up to relabelling rooms: an edge is a distinct (event, target) out of a state."""
    init = canon(spec.initial())
    seen = {init}
    frontier = [init]
    edges = 0
    while frontier:
        nxt = []
        for st in frontier:
            out = set()
            for step in spec.successors(st):
                if step.violation or spec.invariant(step.state):
                    raise ValueError(f"the spec itself breaks a check at {spec.cfg}: {step.event}")
                c = canon(step.state)
                out.add((step.event, c))
                if c not in seen:
                    seen.add(c)
                    nxt.append(c)
            edges += len(out)
        frontier = nxt
    return len(seen), edges


def with_history(state: tuple, history: tuple[str, ...]) -> tuple:
    """The state with each failed room's reason kind in its room state: the walk's key, so that a spec state
    the core reaches with rooms failed for different reasons is walked once per history (see
    `conformance.FAILED_BY`); relabelling rooms moves the kind with its room."""
    rooms = tuple(r if not w else (f"{r[RS]}:{w}", *r[RS + 1:]) for r, w in zip(state[0], history))
    return (rooms, *state[1:])


def walk(cfg: Config, *, max_states: int | None = None,
         progress: Callable[[Walk], None] | None = None) -> Walk:
    """Walk every spec edge reachable on the implementation at bound `cfg` (see the module's docstring)."""
    spec = Spec(cfg)
    canon = canonical_cells if cfg.sizes == (1,) else canonical_mirror
    states, edges = spec_graph(spec, canon)
    out = Walk(cfg, spec_states=states, spec_edges=edges)
    t0 = last = time.perf_counter()
    # node id -> (parent id, event from it); a node's path is read back through its parents
    parent: list[tuple[int, tuple | None]] = [(-1, None)]
    armed: list[frozenset] = [frozenset()]  # node id -> the deadlines the event into it armed
    reached: list[tuple] = [spec.initial()]  # node id -> its state as the implementation labels it
    # a node is a spec state with a history (`with_history`); the first node of each spec state counts its edges
    seen = {canon(spec.initial()): 0}
    first = {canon(spec.initial()): 0}
    frontier = deque([0])

    def path_of(n: int) -> tuple[list[tuple], list[frozenset]]:
        """The events into node n, and the deadlines each armed."""
        evs, arms = [], []
        while parent[n][0] >= 0:
            arms.append(armed[n])
            n, ev = parent[n]
            evs.append(ev)
        return evs[::-1], arms[::-1]

    while frontier:
        node = frontier.popleft()
        counts = first[canon(reached[node])] == node
        path, arms = path_of(node)
        events: list[tuple] = []
        for st in spec.successors(reached[node]):
            if st.event not in events:
                events.append(st.event)
        for ev in events:
            # replayed with the event in its plan, so a deadline the event fires is the clock's next
            h = replay(cfg, path, _sizes(cfg, path + [ev]), path + [ev], arms)
            out.steps += len(path) + 1
            before = dict(h.fired)
            try:
                got = h.step(ev)
            except AssertionError as exc:
                out.failures.append((path + [ev], str(exc)))
                h = None
                continue
            except NotByClock:
                out.deadlines["not by clock"] += 1
                h = None
                continue
            out.edges += counts
            out.deadlines["clock"] += h.fired["clock"] - before["clock"]
            target = canon(with_history(got, h.history()))
            if target not in seen and (max_states is None or len(parent) < max_states):
                seen[target] = len(parent)
                first.setdefault(canon(got), len(parent))
                parent.append((node, ev))
                armed.append(h.arms_made[-1])
                reached.append(got)
                frontier.append(seen[target])
            h = None  # stepped: the next event starts from the node again
        if progress is not None and time.perf_counter() - last >= 5.0:
            last = time.perf_counter()
            out.states, out.nodes, out.seconds = len(first), len(parent), last - t0
            progress(out)
    out.states, out.nodes = len(first), len(parent)
    out.seconds = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    # pragma: no mutate start (help wording)
    p = argparse.ArgumentParser(prog="python -m epd_ring.models.walk", description=__doc__.split("\n\n")[0])
    # pragma: no mutate end
    # one positional each: argparse's help cannot show a tuple metavar of a positional (--help crashed)
    for name in ("cells", "rooms", "receivers", "faults"):
        p.add_argument(name, type=int, metavar=name.upper())  # pragma: no mutate (help wording)
    # Each help= starts a line of its own: the mutation pass leaves such lines alone (wording, not behaviour).
    p.add_argument("--sizes", default="1,2",
                   help="item sizes in cells, comma-separated (default 1,2)")
    p.add_argument("--peers", action="store_true",
                   help="model the peer machine")
    p.add_argument("--identities", type=int, default=1,
                   help="split the rooms among this many identities (shares and per-identity queues)")
    p.add_argument("--min-coverage", type=float, default=0.0,
                   help="exit 1 below this edge coverage (0..1)")
    a = p.parse_args(argv)
    logging.getLogger("epd_ring").setLevel(logging.CRITICAL)  # injected tower errors are events here, not news
    cfg = Config(a.cells, a.rooms, a.receivers, a.faults, sizes=tuple(int(x) for x in a.sizes.split(",")),
                 peers=a.peers, identities=a.identities)

    def progress(w: Walk) -> None:
        # pragma: no mutate start (progress display)
        print(f"  ... {w.states} states, {w.edges} edges, {w.seconds:.0f} s", file=sys.stderr, flush=True)
        # pragma: no mutate end

    w = walk(cfg, progress=progress)  # pragma: no mutate (a display every 5 s of wall time)
    print(w.summary())
    for path, msg in w.failures[:5]:  # pragma: no mutate (report: how many are printed)
        # report wording: not mutated (the pragma below)
        print("nonconforming after " + ", ".join(event_name(e) for e in path) + ":\n  " + msg)  # pragma: no mutate
    return 1 if w.failures or w.edge_coverage < a.min_coverage else 0


if __name__ == "__main__":
    sys.exit(main())
