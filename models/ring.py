"""The spec's ring: which cells a new extent may take, staging an item into them, serving deferred sends.

`Ring` is a part of the rules (models/rules.py): it owns the variants' leasing rules and reads the
shares (models/shares.py); it moves an extent only through the `move` and `spread` the rules give it,
so every lease runs the extent machine and its couplings. A variant with other leasing rules
subclasses it (models/seed.py) and names the subclass as its rules' `RING`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import combinations

from .shares import Shares
from .state import (
    CH,
    CH_COPYING,
    CH_DROPPED,
    CH_HELD,
    CONCLUDED,
    CONTENT,
    EXTENTI,
    GHOST,
    INFL,
    LEN,
    RS,
    SIZE,
    SND,
    SS,
    STAGEABLE,
    UNSURE,
    Draft,
    runs,
)


class Ring:
    """The arena of cells as the executor leases it, over a `Draft`."""

    def __init__(self, config, shares: Shares, move: Callable[[Draft, int, str], None],
                 spread: Callable[[Draft, int], None]) -> None:
        v = config.variant
        self.no_parked_check = v == "no-parked-check"
        self.reuse_when_terminal = v == "reuse-when-terminal"
        self.reap_crash = v == "reaped-deferred-crash"
        self.pieces = config.pieces  # runs of cells one extent may span when no run holds it whole
        self.shares = shares
        self.fair = shares.k > 1  # per-identity shares and deferred queues (models/shares.py)
        self._move, self._spread = move, spread

    def leasable(self, rooms, cells) -> list[bool]:
        """Per cell: may a new extent take it?"""
        if self.reuse_when_terminal:  # whatever its extent's state, once the room whose bytes it holds concluded
            return [sl[SS] == "free" or (sl[CONTENT] >= 0 and rooms[sl[CONTENT]][RS] in CONCLUDED) for sl in cells]
        ok = ("free", "parked") if self.no_parked_check else ("free",)
        return [sl[SS] in ok for sl in cells]

    def placements(self, rooms, cells, size: int) -> list[tuple[int, ...]]:
        """The cells of every place an extent of `size` cells may take: each run of that many leasable
        cells or, when there is none and `pieces` > 1, any `size` leasable cells in at most `pieces` runs
        (the arena takes its largest free runs whole, then the best fit: the spec, any such cells)."""
        ok = self.leasable(rooms, cells)
        whole = [tuple(range(s, s + size)) for s in range(len(cells) - size + 1) if all(ok[s:s + size])]
        if whole or self.pieces == 1:
            return whole
        return [p for p in combinations([c for c, free in enumerate(ok) if free], size)
                if runs(p) <= self.pieces]

    @staticmethod
    def reads(r) -> bool:
        """Does the room still need its extent's bytes (a write in flight or unsure, a chunk to send)?"""
        return bool(r[GHOST] or r[INFL] or r[CH] in (CH_COPYING, CH_HELD))

    def fits(self, d: Draft, i: int) -> bool:
        return bool(self.placements(d.rooms, d.cells, d.rooms[i][SIZE]))

    def stage(self, d: Draft, i: int) -> Iterator[Draft]:
        """Lease an extent of the room's size and start the copy: one draft per place it may take."""
        if d.rooms[i][RS] not in STAGEABLE:
            d2 = d.copy()
            d2.rooms[i][CH] = CH_DROPPED
            yield d2
            return
        z = d.rooms[i][SIZE]
        for place in self.placements(d.rooms, d.cells, z):
            s = place[0]
            d2 = d.copy()
            cells = d2.cells
            free = cells[s][SS] == "free"
            for c in place:
                # A busy extent is never overlapped: a write may still read it, as far as the encoder can
                # tell. Where the spec knows the reader (a write in flight or unsure, a chunk to send), the
                # invariant names the overwrite; otherwise the allocation itself is the violation.
                t = cells[c][CONTENT]
                if cells[c][SS] != "free" and not (t >= 0 and self.reads(d2.rooms[t])):
                    d2.flag("overlap-of-busy-extent", f"room {i}'s extent overlaps a {cells[c][SS]} extent at "
                                                      f"cell {c}, which a write may still read")
            spans = runs(place) > 1  # its other cells name its first: they are not all in one run
            for c in place:
                cells[c][CONTENT], cells[c][LEN] = i, -1 - s if spans else 0
            cells[s][LEN] = z
            if free:
                self._move(d2, s, "lease")
            else:  # a variant leasing over a busy extent: no move declared
                cells[s][SS], cells[s][UNSURE] = "copying", False
                self._spread(d2, s)
            d2.rooms[i][CH], d2.rooms[i][EXTENTI] = CH_COPYING, s
            yield d2

    def servable(self, rooms, cells, deferred) -> bool:
        """Would serving deferred sends do anything: the oldest is dropped (its sender reaped, its room
        concluded) or fits?"""
        if not deferred:
            return False
        if self.fair:
            return self.shares.servable(rooms, cells, deferred, self.placements)
        head = rooms[deferred[0]]
        return head[SND] == 2 or head[RS] not in STAGEABLE or bool(self.placements(rooms, cells, head[SIZE]))

    def serve_deferred(self, d: Draft) -> Iterator[Draft]:
        """Serve deferred sends oldest first: drop the oldest if its sender was reaped or its room
        concluded, stage it if it fits, else stop (nothing behind it overtakes it). A crash halts."""
        if not d.deferred:
            yield d
            return
        if self.fair:
            yield from self.shares.serve(d.copy(), self.stage, self.fits)
            return
        head, rest = d.deferred[0], d.deferred[1:]
        r = d.rooms[head]
        if r[SND] == 2 and self.reap_crash:
            d.halt = "crash"
            yield d
            return
        if r[SND] == 2 or r[RS] not in STAGEABLE:
            d2 = d.copy()
            d2.rooms[head][CH] = CH_DROPPED
            d2.deferred = rest
            yield from self.serve_deferred(d2)
            return
        if not self.fits(d, head):
            yield d
            return
        for d2 in self.stage(d, head):
            d2.deferred = rest
            yield from self.serve_deferred(d2)
