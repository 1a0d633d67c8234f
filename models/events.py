"""The spec's events, one method per family: each adds the successors its events give from one state.

Room families run for each room in turn, in `ROOM_FAMILIES` order, then the
global ones: that order is the order of `Spec.successors`, which the saved
traces and the explorer's shortest traces rely on. A family builds each
successor in a `Draft`, moves the machines through `Rules` (so the couplings
run), and emits it.
"""

from __future__ import annotations

from .rules import Rules
from .state import (
    CH,
    CH_COPYING,
    CH_DEFERRED,
    CH_DROPPED,
    CH_NONE,
    CH_SENT,
    CHAN,
    CONCLUDED,
    CONTENT,
    GHOST,
    INFL,
    LEN,
    NOTICE_OF,
    OK,
    RCV,
    REG,
    RS,
    SIZE,
    SLOTI,
    SND,
    SND_DEAD,
    SS,
    STAGEABLE,
    TOLD,
    TOLD_NONE,
    UNSURE,
    W_FLIGHT,
    W_GHOST,
    W_IDLE,
    W_LANDED,
    W_STRAY,
    WD,
    WD_NONE,
    WD_SEEN,
    WD_SENT,
    Draft,
    Step,
    first_of_each,
    receivers,
)


class Events(Rules):
    """The event families; `Spec.successors` runs them, each room's in turn, then the encoder's."""

    ROOM_FAMILIES = ("_register", "_frame", "_tower", "_copied", "_write_outcomes", "_late_landings", "_deadlines",
                     "_withdraws", "_abort", "_write_deadlines", "_deliveries", "_withdraws_seen")
    GLOBAL_FAMILIES = ("_connect_outcomes", "_deferred_served", "_reap", "_quarantine_ends", "_probe_outcomes")
    # With `Config.restarts`: what an orphan (a room of a dead incarnation) still does, in place of the room
    # families, and the restart itself, after the global families (added only then: the default's order and
    # cost are unchanged).
    ORPHAN_FAMILIES = ("_late_landings", "_reclaims")
    RESTART_FAMILIES = ("_restarts",)

    def __init__(self, config) -> None:
        super().__init__(config)
        self._room_families = tuple(getattr(self, f) for f in self.ROOM_FAMILIES)
        self._orphan_families = tuple(getattr(self, f) for f in self.ORPHAN_FAMILIES)
        self._global_families = tuple(getattr(self, f) for f in self.GLOBAL_FAMILIES
                                      + (self.RESTART_FAMILIES if self.restarts else ()))

    def _emit(self, out: list, d: Draft, event: tuple) -> None:
        # A cell no room's extent covers holds nothing that matters any more: forget whose bytes
        # it had, so states that differ only in stale bytes are one state.
        rooms, slots = d.rooms, d.cells
        used = None
        for s, sl in enumerate(slots):
            if sl[CONTENT] >= 0:
                if used is None:
                    used = {c for r in rooms if r[SLOTI] >= 0 for c in range(r[SLOTI], r[SLOTI] + r[SIZE])}
                if s not in used:
                    sl = slots[s] = list(sl)
                    # with shares a busy cell stays charged to its identity until free (models/shares.py)
                    sl[CONTENT] = self.shares.forgotten(rooms, sl[CONTENT]) if self.fair and sl[SS] != "free" else -1
            elif sl[CONTENT] < -1 and sl[SS] == "free":
                sl = slots[s] = list(sl)
                sl[CONTENT] = -1
        # Likewise an item's size matters only while it waits or holds an extent.
        for r in rooms:
            if r[SIZE] and r[SLOTI] < 0 and r[CH] != CH_DEFERRED:
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
        st = (tuple(map(tuple, rooms)), tuple(map(tuple, slots)), d.deferred, d.faults, d.halt, d.peers)
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
            self._frame_with_peer(state, i, out)
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

    def _frame_with_peer(self, state: tuple, i: int, out: list) -> None:
        """Receiver rank k of live room i registers; its peer is peer k."""
        k = state[0][i][REG]
        ps = state[5][k]
        event = "frame"
        if ps == "down":
            # During the backoff the frame fails its room at once; after it, contact starts again.
            d = Draft.of(state)
            self._offer(d.rooms[i])
            self._move_room(d, i, "fail")
            self._emit(out, d, ("frame", i))
            event = "frame_after_backoff"
        d = Draft.of(state)
        self._move_peer(d, k, "contact")
        if d.peers[k] == "connecting" and ps != "connecting" and self.blocking_contact:
            # First contact on the loop: it answers at once, or the loop waits on the peer.
            halted = Draft.of(state)
            halted.peers, halted.halt = d.peers, "peer-wait"
            self._offer(halted.rooms[i])
            self._emit(out, halted, (event, i))
            self._move_peer(d, k, "connected")
        self._offer(d.rooms[i])
        self._add_receiver(d, i)
        self._emit(out, d, (event, i))

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
        """The copy into the slot completed: the chunk goes to the manager, or is dropped."""
        r = state[0][i]
        if r[CH] != CH_COPYING or state[1][r[SLOTI]][SS] != "copying":
            return
        d = Draft.of(state)
        self._move_slot(d, r[SLOTI], "copied")
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
            d.cells[ro[SLOTI]][UNSURE] = True
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
        if not self._holds_slot(ro) and ro[CH] == CH_SENT:
            ro[SLOTI] = -1

    def _late_landings(self, state: tuple, i: int, out: list) -> None:
        """A write reported unsure lands after all."""
        r = state[0][i]
        ks = self._choices(r, W_GHOST, r[GHOST])
        if self.late_landing:
            ks = sorted({*ks, *self._choices(r, W_STRAY, r[GHOST])})
        for k in ks:
            d = Draft.of(state)
            ro = d.rooms[i]
            s = ro[SLOTI]
            other = next((c for c in (d.cells[x][CONTENT] for x in range(s, s + ro[SIZE])) if c != i), None)
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
            if not self._holds_slot(ro):
                ro[SLOTI] = -1
            self._emit(out, d, ("late_landing", i) if k is None else ("late_landing", i, k))

    # -- deadlines and aborts ----------------------------------------------------------------
    def _deadlines(self, state: tuple, i: int, out: list) -> None:
        """The room's deadline passes: it is in a state whose entry armed one (fsm/couplings.py)."""
        if state[0][i][RS] in self._armed["room"]:
            d = Draft.of(state)
            self._move_room(d, i, "expire")
            self._emit(out, d, ("expire", i))

    def _withdraws(self, state: tuple, i: int, out: list) -> None:
        """A receiver's request is aborted: it withdraws its region."""
        r = state[0][i]
        if self.channels:
            self._withdraws_sent(state, i, out)
            return
        if not state[3] or r[RS] in CONCLUDED:
            return
        for k in sorted({k_ for k_, x in first_of_each(r[RCV]) if x[0] == "offered"}):
            d = Draft.of(state)
            d.faults -= 1
            self._withdraw(d, i, k)
            self._emit(out, d, ("withdraw", i, k))

    def _withdraws_sent(self, state: tuple, i: int, out: list) -> None:
        """With channels: the receiver withdraws an offered region and tells the encoder, which hears it
        later (`_withdraws_seen`); an outcome may already be on its way (the two cross)."""
        r = state[0][i]
        if not state[3]:
            return
        for k in sorted({k_ for k_, x in first_of_each(r[RCV]) if x[0] == "offered" and x[WD] == WD_NONE}):
            d = Draft.of(state)
            d.faults -= 1
            rc = receivers(d.rooms[i])
            x = rc[k]
            rc[k] = (self._region_step(x[0], "withdraw"), *x[1:WD], WD_SENT, *x[WD + 1:])
            self._emit(out, d, ("withdraw", i, k))

    def _deliveries(self, state: tuple, i: int, out: list) -> None:
        """With channels: the notice at the head of a receiver's FIFO reaches it."""
        if not self.channels:
            return
        for k, x in first_of_each(state[0][i][RCV]):
            if x[CHAN]:
                d = Draft.of(state)
                rc = receivers(d.rooms[i])
                ch = rc[k][CHAN]
                rc[k] = (*rc[k][:CHAN], ch // 5, *rc[k][CHAN + 1:])
                self._deliver(d.rooms[i], k, NOTICE_OF[ch % 5])
                self._emit(out, d, ("deliver", i, k))

    def _withdraws_seen(self, state: tuple, i: int, out: list) -> None:
        """With channels: a receiver's withdraw reaches the encoder; a live room fails (its outcome goes
        out), and the withdraw is acked once no write into the region can land."""
        if not self.channels:
            return
        for k, x in first_of_each(state[0][i][RCV]):
            if x[WD] == WD_SENT:
                d = Draft.of(state)
                rc = receivers(d.rooms[i])
                rc[k] = (*rc[k][:WD], WD_SEEN, *rc[k][WD + 1:])
                if d.rooms[i][RS] not in CONCLUDED:
                    self._move_room(d, i, "fail")
                self._release_settled(d.rooms[i])
                self._emit(out, d, ("withdraw_seen", i, k))

    def _withdraw(self, d: Draft, i: int, k: int) -> None:
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

    def _write_deadlines(self, state: tuple, i: int, out: list) -> None:
        """With peers: the room's write deadline passes before any of its writes reported.

        Its writes were issued together, so they are due together: each one's peer turns suspect
        (a re-check starts at the edge) and the room fails; the writes stay in flight and report
        later. (Once some wrote back, which are left is not kept here: that case is not modelled.)"""
        r = state[0][i]
        if not state[5] or not state[3] or r[RS] != "transferring" or r[INFL] != self.N or self.no_write_deadline:
            return
        d = Draft.of(state)
        d.faults -= 1
        # the writes may land any time: the extent serves a quarantine (each of its cells says so)
        d.cells[r[SLOTI]][UNSURE] = True
        self._spread(d, r[SLOTI])
        for k in range(self.N):
            self._move_peer(d, k, "write_overdue")
        self._move_room(d, i, "fail")
        self._emit(out, d, ("write_deadline", i))

    # -- events of the whole encoder -------------------------------------------------------
    def _probe_outcomes(self, state: tuple, out: list) -> None:
        """The heartbeat: an up peer with a live room is probed, and the probe is refused or unanswered."""
        if not state[3]:
            return
        for k, ps in enumerate(state[5]):
            if ps != "up" or not any(r[REG] > k and r[RS] not in CONCLUDED for r in state[0]):
                continue
            for ev, report in (("probe_refused", "refused"), ("probe_expired", "connect_expired")):
                d = Draft.of(state)
                d.faults -= 1
                self._move_peer(d, k, "probe")
                self._move_peer(d, k, report)
                self._emit(out, d, (ev, k))

    def _connect_outcomes(self, state: tuple, out: list) -> None:
        """The edge reports first contact with a peer (or a suspect's re-check), or its connect deadline passes."""
        for k, ps in enumerate(state[5]):
            if ps not in ("connecting", "suspect"):
                continue
            d = Draft.of(state)
            self._move_peer(d, k, "connected")
            self._emit(out, d, ("connected", k))
            if state[3]:
                for ev in ("refused", "connect_expired"):
                    d = Draft.of(state)
                    d.faults -= 1
                    self._move_peer(d, k, ev)
                    self._emit(out, d, (ev, k))

    def _deferred_served(self, state: tuple, out: list) -> None:
        """The loop serves deferred sends when the oldest fits or is to be dropped."""
        if self.ring.servable(state[0], state[1], state[2]):
            for d in self.ring.serve_deferred(Draft.of(state)):
                self._emit(out, d, ("drain",))

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
            if sl[LEN] and sl[SS] in self._armed["extent"] and not self._writes_pending(state[0], s):
                d = Draft.of(state)
                self._move_slot(d, s, "release")
                self._emit(out, d, ("release", s))

    # -- encoder restarts (Config.restarts; the receiver's side as executor/drivers/receiver.py has it) --------
    def _restarts(self, state: tuple, out: list) -> None:
        """The encoder's process dies and a new incarnation answers at its address.

        The encoder's side is lost: its rooms, extents, writes in flight, deferred sends (a fresh arena: the
        dead writes read the dead process's memory, never the new one's). Each room that had begun becomes an
        orphan; a room that had not is a room of the new incarnation. Every receiver learns of the new
        incarnation in the same step (within one reconnect, or `give_up_s` without any encoder: nothing moves
        its region in between) and does what the receiver's `_orphan` does: a room not told success is
        failed here, once; an `offered` region is withdrawn (towards the new incarnation); each held
        region waits for its reclaim (`_reclaims`). A write of the dead incarnation still in flight may land
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
        ro[SND], ro[CH], ro[TOLD], ro[INFL], ro[SIZE], ro[SLOTI] = SND_DEAD, CH_DROPPED, ro[REG], 0, 0, -1
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

    def _reclaims(self, state: tuple, i: int, out: list) -> None:
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
