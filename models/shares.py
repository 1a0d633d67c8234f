"""Shares by identity in the spec (`Config.identities`; executor/core/shares.py is the core's).

With `identities` = k > 1 each room carries its owner (`OWNER`; `Spec.owners` splits the rooms in
blocks, and the canonical form sorts by owner first, so relabelling keeps the blocks in place).
Every identity's share is the fixed fraction 1/k of the arena (the core's `identity_ring_share =
1/k`): `cap` cells, the arena's cells times 1/k rounded down, at least one. An identity holds every
cell of an extent leased for one of its rooms from the lease until the extent is free, quarantined
ones included; a cell whose room no longer covers it (its bytes matter to nobody, `Events._emit`)
keeps its identity as `-2 - owner` in its content, so it is charged until free all the same. An
identity holding nothing may always take one chunk (as the core's `Shares.over`).

The deferred queue is one FIFO per identity, served round-robin: `deferred` lists every deferred
room identity by identity in serving order, each identity's oldest first (the core's
`deferred_requests()`), so the round's order is the order in which identities first appear in it.
With k = 1 nothing here runs: the state and its counts are as before.

The mutants the tests use to show the liveness property (models/liveness.py, `starved`) has teeth
flip `uncharged` (quarantined extents count against nobody) or `one_fifo` (one global FIFO whose
oldest send blocks the rest, held back or not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .state import CH, CH_DROPPED, CONTENT, OWNER, RS, SIZE, SND, SS, STAGEABLE, Draft


class Shares:
    """The share arithmetic of one configuration: caps, what an identity holds, the queue's order."""

    uncharged: tuple[str, ...] = ()  # extent states not charged to anyone (a mutant's)
    one_fifo = False  # a mutant: the deferred queue is one FIFO, its oldest send blocking every other

    def __init__(self, config) -> None:
        self.k = config.identities
        self.cap = max(1, config.cells // self.k) if self.k > 1 else None

    def owner_of_cell(self, rooms, content: int) -> int:
        return rooms[content][OWNER] if content >= 0 else -2 - content

    def forgotten(self, rooms, content: int) -> int:
        """What a busy cell no room covers keeps: the identity its extent is charged to (`content`, the
        room whose bytes it held, is a room: a forgotten cell is never forgotten again)."""
        return -2 - rooms[content][OWNER]

    def held(self, rooms, cells, v: int) -> int:
        """Cells charged to identity v: every cell of its rooms' extents that is not free."""
        n = 0
        for sl in cells:
            c = sl[CONTENT]
            if sl[SS] != "free" and c != -1 and sl[SS] not in self.uncharged and self.owner_of_cell(rooms, c) == v:
                n += 1
        return n

    def held_back(self, rooms, cells, i: int) -> bool:
        """Must room i's item wait, its identity holding its share? One holding nothing may take one chunk."""
        if self.cap is None:
            return False
        held = self.held(rooms, cells, rooms[i][OWNER])
        return held > 0 and held + rooms[i][SIZE] > self.cap

    def order(self, rooms, deferred: tuple) -> list[int]:
        """The identities with deferred sends, in the order the round serves them next."""
        out: list[int] = []
        for i in deferred:
            v = rooms[i][OWNER]
            if v not in out:
                out.append(v)
        return out

    def enqueue(self, rooms, deferred: tuple, i: int) -> tuple:
        """Room i's send at the back of its identity's queue (an identity new to the round joins at its end)."""
        v = rooms[i][OWNER]
        last = max((n for n, j in enumerate(deferred) if rooms[j][OWNER] == v), default=None)
        if last is None or self.one_fifo:
            return (*deferred, i)
        return (*deferred[:last + 1], i, *deferred[last + 1:])

    def rotate(self, rooms, deferred: tuple, v: int) -> tuple:
        """Identity v was served this turn: its sends go to the back of the round."""
        if self.one_fifo:
            return deferred
        return (*(j for j in deferred if rooms[j][OWNER] != v), *(j for j in deferred if rooms[j][OWNER] == v))

    def queue(self, rooms, deferred: tuple, v: int) -> list[int]:
        if self.one_fifo:
            return list(deferred)
        return [j for j in deferred if rooms[j][OWNER] == v]

    # -- serving the deferred queues: the arena's calls (`place`, `stage`, `fits`) are the rules' -----------
    def servable(self, rooms, cells, deferred: tuple, place: Callable) -> bool:
        """Would the round's first move change something (a send dropped or staged, not one that waits)?"""
        for v in ([None] if self.one_fifo else self.order(rooms, deferred)):
            for j in self.queue(rooms, deferred, v):
                r = rooms[j]
                if r[SND] == 2 or r[RS] not in STAGEABLE:
                    return True
                if self.held_back(rooms, cells, j):
                    if self.one_fifo:
                        return False
                    continue  # passed over: it blocks nobody
                return bool(place(rooms, cells, r[SIZE]))
        return False

    def serve(self, d: Draft, stage: Callable[[Draft, int], Iterator[Draft]],
              fits: Callable[[Draft, int], bool]) -> Iterator[Draft]:
        """The core's `serve_deferred` on draft `d` (its own copy): one draft per placement of each send staged."""
        yield from self._round(d, [None] if self.one_fifo else self.order(d.rooms, d.deferred), 0, False, {},
                               stage, fits)

    def _round(self, d: Draft, todo: list, pos: int, progress: bool, start: dict, stage, fits) -> Iterator[Draft]:
        """One send per identity per turn, in the round's order (`todo`, this pass's), each identity's oldest not
        passed over (`start` counts each identity's sends passed over): one held back by its identity's share
        is passed over and keeps its place, one that waits for bytes stops the round for everyone (`d.waits`)."""
        while True:
            if pos == len(todo):
                if not progress or not d.deferred:
                    yield d
                    return
                todo, pos, progress = ([None] if self.one_fifo else self.order(d.rooms, d.deferred)), 0, False
                continue
            v = todo[pos]
            pos += 1
            q = self.queue(d.rooms, d.deferred, v)
            i = start.get(v, 0)
            while i < len(q):
                j = q[i]
                r = d.rooms[j]
                if r[SND] == 2 or r[RS] not in STAGEABLE:  # its sender reaped or its room concluded: dropped
                    r[CH] = CH_DROPPED
                    d.deferred = tuple(x for x in d.deferred if x != j)
                    del q[i]
                    continue
                if self.held_back(d.rooms, d.cells, j) and not self.one_fifo:
                    i += 1
                    continue
                start[v] = i
                if self.held_back(d.rooms, d.cells, j) or not fits(d, j):
                    d.waits = True
                    yield d
                    return
                for d2 in stage(d, j):
                    d2.deferred = self.rotate(d2.rooms, tuple(x for x in d2.deferred if x != j), v)
                    yield from self._round(d2, todo, pos, True, dict(start), stage, fits)
                return
            start[v] = i
