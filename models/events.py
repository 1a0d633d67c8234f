"""The spec's events, one method per family: each adds the successors its events give from one state.

Room families run for each room in turn, in `ROOM_FAMILIES` order, then the
global ones: that order is the order of `Spec.successors`, which the saved
traces and the explorer's shortest traces rely on. A family builds each
successor in a `Draft`, moves the machines through `Rules` (so the couplings
run), and emits it. Three groups of families are parts of their own, each given only the rules it
calls: `PeerEvents` (models/events_peers.py), `Withdraws` (models/events_withdraws.py) and
`Restarts` (models/events_restarts.py).
"""

from __future__ import annotations

from operator import attrgetter

from .events_peers import PeerEvents
from .events_restarts import Restarts
from .events_withdraws import Withdraws
from .rules import Rules
from .state import (
    CH,
    CH_COPYING,
    CH_DEFERRED,
    CH_DROPPED,
    CH_NONE,
    CH_SENT,
    CONCLUDED,
    CONTENT,
    EXTENTI,
    GHOST,
    INFL,
    LEN,
    OK,
    RCV,
    REG,
    RS,
    SIZE,
    SND,
    SS,
    STAGEABLE,
    TOLD,
    UNSURE,
    W_FLIGHT,
    W_GHOST,
    W_IDLE,
    W_STRAY,
    Draft,
    Step,
    receivers,
    room_cells,
)


class Events(Rules):
    """The event families; `Spec.successors` runs them, each room's in turn, then the encoder's."""

    # Each family by its name here, or its part's and its own (`withdraws.seen`).
    ROOM_FAMILIES = ("_register", "_frame", "_tower", "_copied", "_write_outcomes", "_late_landings", "_deadlines",
                     "withdraws.withdraws", "_abort", "peer_events.write_deadlines", "withdraws.deliveries",
                     "withdraws.seen")
    GLOBAL_FAMILIES = ("peer_events.connect_outcomes", "_deferred_served", "_reap", "_quarantine_ends",
                       "peer_events.probe_outcomes")
    # With `Config.restarts`: what an orphan (a room of a dead incarnation) still does, in place of the room
    # families, and the restart itself, after the global families (added only then: the default's order and
    # cost are unchanged).
    ORPHAN_FAMILIES = ("_late_landings", "restart_events.reclaims")
    RESTART_FAMILIES = ("restart_events.restarts",)

    def __init__(self, config) -> None:
        super().__init__(config)
        # The parts: each family group owns its switches and reaches the rules only through what it is given.
        self.withdraws = Withdraws(self.channels, self._emit, self._region_step, self._move_room, self._withdraw,
                                   self._deliver, self._release_settled)
        self.peer_events = PeerEvents(config, self._emit, self._move_room, self._move_peer, self._spread, self._offer,
                                      self._add_receiver)
        self.restart_events = Restarts(self.late_landing, self._emit, self._region_step)
        self._room_families = tuple(attrgetter(f)(self) for f in self.ROOM_FAMILIES)
        self._orphan_families = tuple(attrgetter(f)(self) for f in self.ORPHAN_FAMILIES)
        self._global_families = tuple(attrgetter(f)(self) for f in self.GLOBAL_FAMILIES
                                      + (self.RESTART_FAMILIES if self.restarts else ()))

    def _emit(self, out: list, d: Draft, event: tuple) -> None:
        # A cell no room's extent covers holds nothing that matters any more: forget whose bytes
        # it had, so states that differ only in stale bytes are one state.
        rooms, extents = d.rooms, d.cells
        used = None
        for s, sl in enumerate(extents):
            if sl[CONTENT] >= 0:
                if used is None:
                    used = {c for r in rooms if r[EXTENTI] >= 0 for c in room_cells(extents, r[EXTENTI], r[SIZE])}
                if s not in used:
                    sl = extents[s] = list(sl)
                    # with shares a busy cell stays charged to its identity until free (models/shares.py)
                    sl[CONTENT] = self.shares.forgotten(rooms, sl[CONTENT]) if self.fair and sl[SS] != "free" else -1
            elif sl[CONTENT] < -1 and sl[SS] == "free":
                sl = extents[s] = list(sl)
                sl[CONTENT] = -1
        # Likewise an item's size matters only while it waits or holds an extent.
        for r in rooms:
            if r[SIZE] and r[EXTENTI] < 0 and r[CH] != CH_DEFERRED:
                r[SIZE] = 0
        if self.regions:
            rooms = [list(x) for x in rooms]
            for x in rooms:
                x[RCV] = tuple(sorted(x[RCV]))
        else:  # no receivers modelled: only an emptied list to turn back into a tuple
            for k, x in enumerate(rooms):
                if x[RCV].__class__ is not tuple:
                    x = rooms[k] = list(x)
                    x[RCV] = tuple(sorted(x[RCV]))
        st = (tuple(map(tuple, rooms)), tuple(map(tuple, extents)), d.deferred, d.faults, d.halt, d.peers)
        if d.restarts is not None:
            st += (d.restarts,)
        out.append(Step(event, st, d.violation, d.detail))

    # -- senders and receivers ---------------------------------------------------------------
    def _register(self, state: tuple, i: int, out: list) -> None:
        """The encode request is registered: the room's sender."""
        if state[0][i][SND] != 0:
            return
        d = Draft.of(state)
        if d.rooms[i][RS] not in CONCLUDED:
            self._move_room(d, i, "bind_sender")
        d.rooms[i][SND] = 1
        self._emit(out, d, ("register", i))

    def _frame(self, state: tuple, i: int, out: list) -> None:
        """A receiver registers: early, late, or after the room concluded."""
        r = state[0][i]
        if r[REG] >= self.N:
            return
        if state[5] and r[RS] not in CONCLUDED:
            self.peer_events.frame(state, i, out)
            return
        d = Draft.of(state)
        self._offer(d.rooms[i])
        if r[RS] in CONCLUDED:
            self._move_room(d, i, "add_receiver")
            self._late_receiver(d, i)
        else:
            self._add_receiver(d, i)
        self._emit(out, d, ("frame", i))

    def _add_receiver(self, d: Draft, i: int) -> None:
        self._move_room(d, i, "add_receiver")

    def _late_receiver(self, d: Draft, i: int) -> None:
        """A receiver of a concluded room is told Failed at once (no write will go there), and released."""
        ro = d.rooms[i]
        ro[TOLD] += 1
        if self.regions:
            self._notice(ro, len(ro[RCV]) - 1, "failed")
            self._release_settled(ro)

    # -- the tower and the ring ------------------------------------------------------------
    def _tower(self, state: tuple, i: int, out: list) -> None:
        """The tower runs (or a cache hit arrives) for the room's single item, of any size the
        configuration allows; or it or the staging fails."""
        r = state[0][i]
        if r[SND] != 1 or r[CH] != CH_NONE:
            return
        if r[RS] not in STAGEABLE:
            d = Draft.of(state)
            d.rooms[i][CH] = CH_DROPPED  # its room concluded: never written, never deferred
            self._emit(out, d, ("tower", i))
            return
        for z in self.cfg.sizes:
            d = Draft.of(state)
            d.rooms[i][SIZE] = z
            if z > self.cfg.cells:
                # Larger than the whole arena: it could never be staged, so its room fails at once.
                d.rooms[i][CH] = CH_DROPPED
                self._move_room(d, i, "fail")
                self._emit(out, d, ("tower", i, z))
                continue
            d.rooms[i][CH] = CH_DEFERRED  # placeholder until offered
            for served in self.ring.serve_deferred(d):
                self._offer_chunk(served, i, out)
        if state[3]:
            for ev in ("tower_error", "stage_error"):
                d = Draft.of(state)
                d.rooms[i][CH] = CH_DROPPED
                d.faults -= 1
                self._move_room(d, i, "fail")
                self._emit(out, d, (ev, i))

    def _offer_chunk(self, d: Draft, i: int, out: list) -> None:
        """Room i's chunk, once the deferred sends were served: staged, or deferred while it fits nowhere
        (or older sends still wait: they are served first)."""
        event = ("tower", i, d.rooms[i][SIZE])
        if self.fair:
            # the core's `_offer`: behind a send that waits for bytes (or any, with one FIFO), or held back by
            # its identity's share, or fitting nowhere, it joins its identity's queue
            waits = d.waits if not self.shares.one_fifo else bool(d.deferred)
            if d.halt is None and (waits or self.shares.held_back(d.rooms, d.cells, i) or not self.ring.fits(d, i)):
                d.deferred = self.shares.enqueue(d.rooms, d.deferred, i)
            elif d.halt is None:  # sends passed over (held back by their share) do not keep it behind them
                for staged in self.ring.stage(d, i):
                    self._emit(out, staged, event)
                return
            self._emit(out, d, event)
            return
        if d.halt is None and (d.deferred or not self.ring.fits(d, i)):
            if self.busy_wait:
                d.halt = "spin"
            else:
                d.deferred += (i,)
        elif d.halt is None:
            for staged in self.ring.stage(d, i):
                self._emit(out, staged, event)
            return
        self._emit(out, d, event)

    def _copied(self, state: tuple, i: int, out: list) -> None:
        """The copy into the extent completed: the chunk goes to the manager, or is dropped."""
        r = state[0][i]
        if r[CH] != CH_COPYING or state[1][r[EXTENTI]][SS] != "copying":
            return
        d = Draft.of(state)
        self._move_extent(d, r[EXTENTI], "copied")
        if r[RS] not in STAGEABLE:
            self._drop_chunk(d, i)
        else:
            self._move_room(d, i, "stage")
        self._emit(out, d, ("copied", i))

    # -- writes ----------------------------------------------------------------------------
    def _write_outcomes(self, state: tuple, i: int, out: list) -> None:
        """A write completes, or reports failure or timeout (it may still land)."""
        r = state[0][i]
        for k in self._choices(r, W_FLIGHT, r[INFL]):
            for ev in ("write_done", "write_unsure") if state[3] else ("write_done",):
                d = Draft.of(state)
                self._write_outcome(d, i, k, ev == "write_unsure")
                self._emit(out, d, (ev, i) if k is None else (ev, i, k))

    def _write_outcome(self, d: Draft, i: int, k: int | None, unsure: bool) -> None:
        ro = d.rooms[i]
        ro[INFL] -= 1
        if k is not None:
            rc = receivers(ro)
            if not unsure and rc[k][0] == "released":
                d.flag("write-into-released-region",
                       f"room {i}'s write landed in a region its receiver had released (and may reuse)")
            rc[k] = (rc[k][0], W_GHOST if unsure else W_IDLE, *rc[k][2:])
        if unsure:
            ro[GHOST] += 1
            d.cells[ro[EXTENTI]][UNSURE] = True
            d.faults -= 1
        self._settle(d, i, unsure)
        if ro[RS] == "transferring":
            if unsure:
                self._move_room(d, i, "fail")
            else:
                ro[OK] += 1
                if ro[OK] == self.N:
                    self._move_room(d, i, "written")
        elif not unsure and ro[RS] == "failed":
            self._release_settled(ro)
        if not self._holds_extent(ro) and ro[CH] == CH_SENT:
            ro[EXTENTI] = -1

    def _late_landings(self, state: tuple, i: int, out: list) -> None:
        """A write reported unsure lands after all."""
        r = state[0][i]
        ks = self._choices(r, W_GHOST, r[GHOST])
        if self.late_landing:
            ks = sorted({*ks, *self._choices(r, W_STRAY, r[GHOST])})
        for k in ks:
            d = Draft.of(state)
            ro = d.rooms[i]
            s = ro[EXTENTI]
            other = next((c for c in (d.cells[x][CONTENT] for x in room_cells(d.cells, s, ro[SIZE])) if c != i), None)
            if other is not None:
                d.flag("overwrite-under-late-write", f"bytes of room {other} landed for room {i}")
            elif k is not None and r[RCV][k][0] == "released":
                d.flag("write-into-released-region",
                       f"room {i}'s late write landed in a region its receiver had released (and may reuse)")
            ro[GHOST] -= 1
            if k is not None:
                rc = receivers(ro)
                # a stray lands after its quarantine: nothing waits for it any more
                rc[k] = (rc[k][0], W_IDLE if rc[k][1] == W_STRAY else self.LANDED, *rc[k][2:])
            if not self._holds_extent(ro):
                ro[EXTENTI] = -1
            self._emit(out, d, ("late_landing", i) if k is None else ("late_landing", i, k))

    # -- deadlines and aborts ----------------------------------------------------------------
    def _deadlines(self, state: tuple, i: int, out: list) -> None:
        """The room's deadline passes: it is in a state whose entry armed one (fsm/couplings.py)."""
        if state[0][i][RS] in self._armed["room"]:
            d = Draft.of(state)
            self._move_room(d, i, "expire")
            self._emit(out, d, ("expire", i))

    def _withdraw(self, d: Draft, i: int, k: int) -> None:
        """Receiver k withdraws its region: the room fails (the rule `Withdraws` takes it by)."""
        rc = receivers(d.rooms[i])
        rc[k] = (self._region_step(rc[k][0], "withdraw"), *rc[k][1:])
        self._move_room(d, i, "fail")

    def _abort(self, state: tuple, i: int, out: list) -> None:
        """The client aborts: the encode loop fails the room."""
        r = state[0][i]
        if state[3] and r[SND] == 1 and r[RS] not in CONCLUDED:
            d = Draft.of(state)
            d.faults -= 1
            self._move_room(d, i, "fail")
            self._emit(out, d, ("abort", i))

    def _deferred_served(self, state: tuple, out: list) -> None:
        """The loop serves deferred sends when the oldest fits or is to be dropped."""
        if self.ring.servable(state[0], state[1], state[2]):
            for d in self.ring.serve_deferred(Draft.of(state)):
                self._emit(out, d, ("serve",))

    def _reap(self, state: tuple, out: list) -> None:
        """Senders of concluded rooms whose tower already ran are reaped."""
        reap = [i for i, r in enumerate(state[0]) if r[SND] == 1 and r[RS] in CONCLUDED and r[CH] != CH_NONE]
        if reap:
            d = Draft.of(state)
            for i in reap:
                d.rooms[i][SND] = 2
            self._emit(out, d, ("reap",))

    def _quarantine_ends(self, state: tuple, out: list) -> None:
        """A quarantine deadline passes; writes that could land have landed by then."""
        for s, sl in enumerate(state[1]):
            if sl[LEN] > 0 and sl[SS] in self._armed["extent"] and not self._writes_pending(state[0], s):
                d = Draft.of(state)
                self._move_extent(d, s, "release")
                self._emit(out, d, ("release", s))
