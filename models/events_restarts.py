"""Encoder restarts (`Config.restarts`; the receiver's side as executor/drivers/receiver.py has it).

`Restarts` is a part of `Events` (models/events.py): the restart itself, an event of the whole encoder,
and the reclaims of an orphan's regions, the one family of an orphan besides its late landings. It moves
regions through the region machine's step it is given and hands each successor to `emit`.
"""

from __future__ import annotations

from collections.abc import Callable

from .state import (
    CH,
    CH_DROPPED,
    EXTENTI,
    GHOST,
    INFL,
    RCV,
    REG,
    RS,
    SIZE,
    SND,
    SND_DEAD,
    TOLD,
    TOLD_NONE,
    W_FLIGHT,
    W_GHOST,
    W_IDLE,
    W_LANDED,
    W_STRAY,
    Draft,
    first_of_each,
    receivers,
)


class Restarts:
    """`restarts` (the encoder's family, `(state, out)`) and `reclaims` (an orphan's, `(state, i, out)`)."""

    def __init__(self, late_landing: bool, emit: Callable[[list, Draft, tuple], None],
                 region_step: Callable[[str, str], str]) -> None:
        self.late_landing = late_landing
        self._emit, self._region_step = emit, region_step

    def restarts(self, state: tuple, out: list) -> None:
        """The encoder's process dies and a new incarnation answers at its address.

        The encoder's side is lost: its rooms, extents, writes in flight, deferred sends (a fresh arena: the
        dead writes read the dead process's memory, never the new one's). Each room that had begun becomes an
        orphan; a room that had not is a room of the new incarnation. Every receiver learns of the new
        incarnation in the same step (within one reconnect, or `give_up_s` without any encoder: nothing moves
        its region in between) and does what the receiver's `_orphan` does: a room not told success is
        failed here, once; an `offered` region is withdrawn (towards the new incarnation); each held
        region waits for its reclaim (`reclaims`). A write of the dead incarnation still in flight may land
        until then."""
        left = state[6]
        rooms = state[0]
        if not left or not any((r[SND] or r[REG]) and r[SND] != SND_DEAD for r in rooms):
            return
        d = Draft.of(state)
        d.restarts = left - 1
        d.cells = [list(self._free_cell) for _ in d.cells]
        d.deferred = ()
        for ro in d.rooms:
            if (ro[SND] or ro[REG]) and ro[SND] != SND_DEAD:
                self._orphan(ro)
        self._emit(out, d, ("restart",))

    _free_cell = ("free", -1, False, 1)

    def _orphan(self, ro: list) -> None:
        """Room `ro` of the incarnation that died, as its receivers see it from now on."""
        rc = receivers(ro)
        for k, (g, w, t) in enumerate(rc):
            w = W_GHOST if w == W_FLIGHT else w  # the dead process's kernel may still deliver it
            if g not in ("written", "released"):  # told success, or no longer held: the receiver leaves it
                g = self._region_step(g, "withdraw") if g == "offered" else g
                t = self._concluded_here(t)
            rc[k] = (g, w, t)
        ro[RS] = "success" if ro[RS] == "success" else "failed"
        ro[SND], ro[CH], ro[TOLD], ro[INFL], ro[SIZE], ro[EXTENTI] = SND_DEAD, CH_DROPPED, ro[REG], 0, 0, -1
        ro[GHOST] = sum(x[1] in (W_GHOST, W_STRAY) for x in rc)

    @staticmethod
    def _concluded_here(told: str) -> str:
        """The receiver fails a room of a dead incarnation only if no encoder told it an outcome."""
        return "failed" if told == TOLD_NONE else told

    @staticmethod
    def _repeated(told: str, notice: str) -> str:
        """An outcome from the new incarnation for a room concluded here (it held the room from a frame queued
        across the restart, and fails it on the withdraw behind that frame) is a repeat: nothing changes."""
        return told

    def _dead_write_at_reclaim(self, w: int) -> int:
        """Where a dead incarnation's write into a region is once its receiver reclaims the region. The bound
        the receiver relies on: `reclaim_s` outlasts every such write, so one that has not landed never will.
        With `Config.late_landing` the transport broke it: the write stays, a stray that may still land."""
        if w == W_GHOST:
            return W_STRAY if self.late_landing else W_IDLE
        return W_IDLE if w == W_LANDED else w

    def reclaims(self, state: tuple, i: int, out: list) -> None:
        """An orphan's receiver reclaims a region it holds once its reclaim delay passed: a `failed` one
        (it waited only for the dead encoder's release), or a `withdrawing` one once the new incarnation
        acknowledged the withdraw too (`reclaim`), maybe after a repeated `failed` from it
        (`reclaim_after_repeat`). The region is released: its memory may be carved again."""
        r = state[0][i]
        for k, x in first_of_each(r[RCV]):
            if x[0] not in ("failed", "withdrawing"):
                continue
            for ev in ("reclaim", "reclaim_after_repeat") if x[0] == "withdrawing" else ("reclaim",):
                d = Draft.of(state)
                ro = d.rooms[i]
                rc = receivers(ro)
                g, w, t = rc[k]
                if ev == "reclaim_after_repeat":
                    t = self._repeated(t, "failed")
                nw = self._dead_write_at_reclaim(w)
                if w in (W_GHOST, W_STRAY) and nw == W_IDLE:
                    ro[GHOST] -= 1
                rc[k] = (self._region_step(g, "release" if g == "failed" else "ack"), nw, t)
                self._emit(out, d, (ev, i, k))
