"""An executable abstract spec of the encode-side protocol.

A global state is a tuple `(rooms, slots, deferred, faults, halt, peers)`:

- each room is `(rs, snd, ch, reg, told, ok, infl, ghost, rcv, slot)`: its room-machine
  state; its sender (0 none, 1 registered, 2 reaped); where its chunk is (see CH_*);
  receivers registered, told their outcome, written; writes in flight; writes that
  reported failure or timeout but may still land ("ghosts"); its receivers, the other
  end (a sorted tuple of `(region, write)`, one per registered receiver: the state of
  its receive region in the region machine, and where the write into it is, see W_*);
  the slot its chunk or writes use (-1 none);
- each slot is `(ss, content, unsure)`: its slot-machine state, the room whose bytes
  it holds (-1 none), and whether a write from it was unsure;
- `deferred` is the FIFO of rooms whose chunk waits for a slot; `faults` is the
  fault budget left; `halt` marks a loop that crashed or spins forever;
- `peers` (with `Config.peers`) holds one peer-machine state per receiver rank: the
  rank-k receiver of every room lives on peer k. First contact runs at the edge, so
  its outcome (connected, refused, or no answer by the connect deadline) is an event
  of its own, never a step of the loop. Refused and unanswered contacts spend the
  fault budget. Write failures do not move peers here (the model counts writes per
  room, not per receiver); the suites cover suspect peers.

Room, slot and region moves are looked up in the fsm/ declarations (`ROOM`, `SLOT`,
`REGION`), not copied. Notices reach a receiver when the encoder sends them (one
ordered socket per receiver, so a delay changes when, never what, it learns). Variants change the executor's and manager's rules, never the machines:
the `seed` variant models the seed, whose slots have no machine at all (a slot is
reusable when its tenant room is terminal and not parked), so its slot moves are
set directly and the invariants show what goes wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from epd_ring.fsm import PEER, REGION, ROOM, SLOT
from epd_ring.fsm.regions import NOTICE_EVENTS

CH_NONE, CH_DEFERRED, CH_COPYING, CH_HELD, CH_SENT, CH_DROPPED = range(6)
CH_NAMES = ("awaiting-tower", "deferred", "copying", "held", "sent", "dropped")
RS, SND, CH, REG, TOLD, OK, INFL, GHOST, RCV, SLOTI = range(10)
# The write into one receiver's region: none that can land (never issued, or done), in
# flight, reported failed or timed out but may still land, or landed late (the encoder
# cannot tell: it waits out the quarantine either way).
W_IDLE, W_FLIGHT, W_GHOST, W_LANDED = range(4)
W_MARK = ("", "~", "?", ".")
REGION_MARK = {"offered": "o", "written": "W", "failed": "F", "withdrawing": "X", "released": "R"}
_REGION_RANK = {"offered": 0, "failed": 1, "withdrawing": 1, "written": 2, "released": 3}
SS, CONTENT, UNSURE = range(3)
CONCLUDED = frozenset(("success", "failed"))
# Peer states in the order the model moves them (down -> connecting needs a new frame).
_PEER_RANK = {"unknown": 0, "connecting": 1, "suspect": 1, "up": 2, "down": 3}

VARIANTS = {
    "project": "our design",
    "seed": "the seed's rules: tenant-based reuse, only Success stragglers dropped, partial registration "
            "re-arms the deadline, no Failed for late receivers or on expiry, failed write frees its slot at once",
    "no-parked-check": "lease may take a slot whose chunk is parked",
    "busy-wait": "a full ring makes the single loop wait for a slot instead of deferring",
    "reaped-deferred-crash": "serving a deferred send whose sender was reaped crashes the loop",
    "blocking-contact": "first contact with a peer runs on the encode loop (a silent peer holds it)",
    "write-before-up": "writes go to a peer that is still being contacted",
}

# Variants that differ from the project only in how peers are handled (need Config.peers).
PEER_VARIANTS = frozenset(("blocking-contact", "write-before-up"))

# Which hazard each violation stands for, per variant (for fixture names and reports).
HAZARDS = {
    ("seed", "receiver-not-told"): "H5",
    ("seed", "overwrite-under-late-write"): "H6",
    ("seed", "overwrite-under-write"): "H15-slot-reuse",
    ("seed", "overwrite-under-chunk"): "H15-slot-reuse-before-send",
    ("seed", "write-for-concluded-room"): "H15",
    ("seed", "deadline-extended"): "H16",
    ("seed", "write-into-released-region"): "H6-receiver-region-reuse",
    ("no-parked-check", "overwrite-under-chunk"): "lease-without-parked-check",
    ("busy-wait", "deadlock"): "busy-wait-lease",
    ("blocking-contact", "loop-waits-on-peer"): "blocking-first-contact",
    ("write-before-up", "write-to-peer-not-up"): "write-before-peer-up",
    ("reaped-deferred-crash", "crash"): "deferred-send-after-reap",
}


@dataclass(frozen=True)
class Config:
    slots: int = 2
    rooms: int = 2
    receivers: int = 1
    faults: int = 1
    variant: str = "project"
    # The receivers' end (regions, withdraws, release notices). Off: the encode side alone,
    # with the same events and states as before the receivers were modelled (what the SPIN
    # generator covers).
    regions: bool = True
    peers: bool = False  # model the peer machine (one peer per receiver rank)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; one of {sorted(VARIANTS)}")
        if min(self.slots, self.rooms, self.receivers) < 1 or self.faults < 0:
            raise ValueError("slots, rooms and receivers must be >= 1, faults >= 0")


@dataclass
class Step:
    event: tuple
    state: tuple
    violation: str | None = None
    detail: str = ""


class Spec:
    def __init__(self, config: Config):
        self.cfg = config
        v = config.variant
        self.seed = v == "seed"
        self.no_parked_check = v == "no-parked-check"
        self.busy_wait = v == "busy-wait"
        self.reap_crash = v == "reaped-deferred-crash"
        self.blocking_contact = v == "blocking-contact"
        self.write_before_up = v == "write-before-up"
        self.N = config.receivers
        self.regions = config.regions
        self.peers = config.peers and not self.seed  # the seed has no peers to model
        self._rank_cache: dict = {}

    # -- states ---------------------------------------------------------------
    def initial(self) -> tuple:
        room = (ROOM.initial, 0, CH_NONE, 0, 0, 0, 0, 0, (), -1)
        slot = (SLOT.initial, -1, False)
        peers = (PEER.initial,) * self.N if self.peers else ()
        return ((room,) * self.cfg.rooms, (slot,) * self.cfg.slots, (), self.cfg.faults, None, peers)

    def is_final(self, state: tuple) -> bool:
        """Quiescent: every room concluded and told, every slot free, nothing held or deferred."""
        rooms, slots, deferred, _, halt, _ = state
        return (halt is None and not deferred
                and all(s[SS] == "free" for s in slots)
                and all(r[RS] in CONCLUDED and r[TOLD] == r[REG] == self.N and r[SND] == 2
                        and r[INFL] == 0 and r[GHOST] == 0
                        and all(g in ("written", "released") and w == W_IDLE for g, w in r[RCV])
                        for r in rooms))

    def invariant(self, state: tuple) -> tuple[str, str] | None:
        """Safety checked in every state: (violation, detail) or None."""
        rooms, slots, deferred, _, halt, peers = state
        if halt == "crash":
            return "crash", "the encode loop raised"
        if halt == "peer-wait":
            return "loop-waits-on-peer", "the encode loop waits for a peer's first contact"
        for k, ps in enumerate(peers):
            if ps == "down":
                for i, r in enumerate(rooms):
                    if r[REG] > k and r[RS] not in CONCLUDED:
                        return "room-of-down-peer-live", f"peer {k} is down but room {i}, which it serves, is {r[RS]}"
        for i, r in enumerate(rooms):
            s = r[SLOTI]
            if s >= 0 and slots[s][CONTENT] != i:
                if r[GHOST]:
                    kind, who = "overwrite-under-late-write", "a write that reported failure may still land"
                elif r[INFL]:
                    kind, who = "overwrite-under-write", "a write is in flight"
                elif r[CH] in (CH_COPYING, CH_HELD):
                    kind, who = "overwrite-under-chunk", "its chunk is still to be sent"
                else:
                    kind = None
                if kind:
                    return kind, f"slot {s} was rewritten by room {slots[s][CONTENT]} while {who} (room {i})"
            if r[RS] in CONCLUDED and r[TOLD] < r[REG]:
                return "receiver-not-told", f"room {i} is {r[RS]} but {r[REG] - r[TOLD]} of its receivers were not told"
            if r[RS] == "success" and r[OK] < self.N:
                return "success-without-all-writes", f"room {i} success with {r[OK]} of {self.N} receivers written"
            for g, w in r[RCV]:
                if g == "written" and w in (W_FLIGHT, W_GHOST):
                    return "success-under-write", f"room {i}: a receiver was told success while a write into it may land"
                if (g == "written" and r[RS] != "success") or (g == "failed" and r[RS] == "success"):
                    return "wrong-outcome", f"room {i} is {r[RS]} but a receiver's region is {g}"
        return None

    # -- helpers ----------------------------------------------------------------
    # Moves are looked up in the declarations once per (state, event, guard values), then remembered:
    # the explorer asks the same few questions millions of times.
    _room_moves: dict = {}
    _slot_moves: dict = {}

    @staticmethod
    def _room_step(rs: str, event: str, all_receivers: bool) -> str:
        key = (rs, event, all_receivers)
        dest = Spec._room_moves.get(key)
        if dest is None:
            dest = Spec._room_moves[key] = ROOM.destinations(rs, event, {"all_receivers": all_receivers})
        if dest is None:
            raise AssertionError(f"model bug: room event {event!r} not declared from {rs!r}")
        return dest

    @staticmethod
    def _slot_step(slot: list, event: str, pending: bool = False) -> None:
        key = (slot[SS], event, pending, slot[UNSURE])
        dest = Spec._slot_moves.get(key)
        if dest is None:
            dest = Spec._slot_moves[key] = SLOT.destinations(
                slot[SS], event, {"writes_pending": pending, "write_unsure": slot[UNSURE]})
        if dest is None:
            raise AssertionError(f"model bug: slot event {event!r} not declared from {slot[SS]!r}")
        slot[SS] = dest
        if dest == "free":
            slot[UNSURE] = False

    # -- the receivers' regions --------------------------------------------------------
    @staticmethod
    def _rcv(ro: list) -> list:
        """The room's receivers as a mutable list (sorted again when the state is emitted)."""
        if type(ro[RCV]) is tuple:
            ro[RCV] = list(ro[RCV])
        return ro[RCV]

    def _notice(self, ro: list, k: int, notice: str) -> None:
        rc = self._rcv(ro)
        g, w = rc[k]
        if self.seed:
            # The seed has no release protocol: its receiver frees the region on Failed.
            dest = {"success": "written", "failed": "released"}[notice]
        else:
            dest = REGION.destinations(g, NOTICE_EVENTS[notice], {})
            if dest is None:
                raise AssertionError(f"model bug: region notice {notice!r} not declared from {g!r}")
        rc[k] = (dest, w)

    def _release_settled(self, ro: list) -> None:
        """Encoder rule: a Failed room's region is released (or its withdraw acked) once no write can land."""
        if self.seed:
            return
        rc = self._rcv(ro)
        for k, (g, w) in enumerate(rc):
            if w == W_IDLE and g in ("failed", "withdrawing"):
                self._notice(ro, k, "released" if g == "failed" else "withdrawn")

    def _holds_slot(self, ro: list) -> bool:
        if not self.regions:
            return bool(ro[INFL] or ro[GHOST])
        return any(w != W_IDLE for _, w in ro[RCV])

    def _choices(self, r: tuple, w: int, count: int) -> list:
        """Receivers whose write is in state w (alike ones are one choice); [None] without regions."""
        if not count:
            return []
        if not self.regions:
            return [None]
        return sorted({k for k, (_, x) in self._first_of_each(r[RCV]) if x == w})

    def _leasable(self, rooms: list, slots: list) -> list[int]:
        if self.seed:
            out = []
            for s, sl in enumerate(slots):
                t = sl[CONTENT]
                if t < 0 or (rooms[t][RS] in CONCLUDED and not rooms[t][CH] == CH_HELD):
                    out.append(s)
            return out
        ok = ("free", "parked") if self.no_parked_check else ("free",)
        return [s for s, sl in enumerate(slots) if sl[SS] in ok]

    def _writes_pending(self, rooms: list, s: int) -> bool:
        return any(r[SLOTI] == s and r[INFL] for r in rooms)

    # -- room conclusion -----------------------------------------------------------
    def _conclude(self, rooms: list, i: int, tell: bool = True) -> None:
        if tell:
            ro = rooms[i]
            ro[TOLD] = ro[REG]
            outcome = "success" if ro[RS] == "success" else "failed"
            for k, (g, _) in enumerate(self._rcv(ro)):
                if g in ("offered", "withdrawing"):
                    self._notice(ro, k, outcome)
            if outcome == "failed":
                self._release_settled(ro)

    def _fail(self, rooms: list, slots: list, i: int, event: str = "fail") -> None:
        r = rooms[i]
        r[RS] = self._room_step(r[RS], event, r[REG] >= self.N)
        if r[CH] in (CH_COPYING, CH_HELD) and not (self.seed and r[CH] == CH_HELD and event == "fail"):
            if r[CH] == CH_HELD:
                sl = slots[r[SLOTI]]
                if self.seed:
                    sl[SS] = "free"
                else:
                    self._slot_step(sl, "abandon")
                r[CH], r[SLOTI] = CH_DROPPED, -1
            # a copying chunk is abandoned when its copy completes
        elif r[CH] in (CH_NONE, CH_DEFERRED):
            pass  # dropped when it reaches the ring
        silent = self.seed and event == "expire"
        self._conclude(rooms, i, tell=not silent)

    def _issue_writes(self, rooms: list, slots: list, i: int, peers: tuple = ()) -> str | None:
        r = rooms[i]
        sl = slots[r[SLOTI]]
        violation = "write-for-concluded-room" if r[RS] in CONCLUDED else None
        if any(ps != "up" for ps in peers):
            if not self.write_before_up:
                # Writes wait, chunk held in its slot, until every peer of the room is up
                # (a down peer has failed the room already).
                r[CH] = CH_HELD
                return violation
            violation = violation or "write-to-peer-not-up"
        if self.seed:
            sl[SS] = "sending"
        else:
            self._slot_step(sl, "send")
        r[CH], r[INFL] = CH_SENT, self.N
        r[RCV] = [(g, W_FLIGHT) for g, _ in r[RCV]]
        return violation

    # -- peers ----------------------------------------------------------------------------
    @staticmethod
    def _peer_step(ps: str, event: str, backing_off: bool = False) -> str:
        dest = PEER.destinations(ps, event, {"backing_off": backing_off, "at_threshold": False})
        if dest is None:
            raise AssertionError(f"model bug: peer event {event!r} not declared from {ps!r}")
        return dest

    def _peer_down(self, rooms: list, slots: list, k: int) -> None:
        """Peer k went down: every live room with a receiver on it fails now, all its receivers told."""
        for i, r in enumerate(rooms):
            if r[REG] > k and r[RS] not in CONCLUDED:
                self._fail(rooms, slots, i)

    def _offer(self, ro: list) -> None:
        """One more receiver registered (and, with regions, offered its receive region)."""
        ro[REG] += 1
        if self.regions:
            self._rcv(ro).append(("offered", W_IDLE))

    def _frame_with_peer(self, i, r, rooms_t, slots_t, peers_t, emit, copy) -> None:
        """Receiver rank k of live room i registers; its peer is peer k."""
        k = r[REG]
        ps = peers_t[k]
        tries = []  # (event, peer state after the frame's contact)
        if ps == "down":
            # During the backoff the frame fails its room at once; after it, contact starts again.
            rooms, slots = copy()
            self._offer(rooms[i])
            self._fail(rooms, slots, i)
            emit(("frame", i), rooms, slots)
            tries.append(("frame_after_backoff", self._peer_step(ps, "contact", backing_off=False)))
        else:
            tries.append(("frame", self._peer_step(ps, "contact")))
        for event, after in tries:
            starts = after == "connecting" and ps != "connecting"
            if starts and self.blocking_contact:
                # First contact on the loop: it answers at once, or the loop waits on the peer.
                halted = peers_t[:k] + (after,) + peers_t[k + 1:]
                rooms, slots = copy()
                self._offer(rooms[i])
                emit((event, i), rooms, slots, peers=halted, halt="peer-wait")
                after = self._peer_step(after, "connected")
            peers = peers_t[:k] + (after,) + peers_t[k + 1:]
            rooms, slots = copy()
            ro = rooms[i]
            self._offer(ro)
            rs = ro[RS]
            ro[RS] = self._room_step(rs, "add_receiver", ro[REG] >= self.N)
            violation = None
            if rs == "parked" and ro[RS] == "transferring":
                violation = self._issue_writes(rooms, slots, i, peers)
            emit((event, i), rooms, slots, peers=peers, violation=violation)

    # -- the ring ---------------------------------------------------------------------
    def _stage(self, rooms: list, slots: list, i: int) -> Iterator[tuple[list, list, str | None]]:
        """Lease a slot for room i and start the copy: one result per slot it may take."""
        r = rooms[i]
        if r[RS] not in ("registered", "ready"):
            r2 = [list(x) for x in rooms]
            r2[i][CH] = CH_DROPPED
            yield r2, [list(x) for x in slots], None
            return
        for s in self._leasable(rooms, slots):
            r2 = [list(x) for x in rooms]
            s2 = [list(x) for x in slots]
            sl = s2[s]
            if self.seed or sl[SS] != "free":
                sl[SS], sl[UNSURE] = "copying", False  # the seed has no slot machine
            else:
                self._slot_step(sl, "lease")
            sl[CONTENT] = i
            r2[i][CH], r2[i][SLOTI] = CH_COPYING, s
            yield r2, s2, None

    def _drain(self, rooms: list, slots: list, deferred: tuple) -> Iterator[tuple[list, list, tuple, str | None]]:
        """Serve deferred sends oldest first while slots are leasable."""
        if not deferred or not self._leasable(rooms, slots):
            yield rooms, slots, deferred, None
            return
        head = deferred[0]
        if rooms[head][SND] == 2:
            if self.reap_crash:
                yield rooms, slots, deferred, "crash"
                return
            r2 = [list(x) for x in rooms]
            r2[head][CH] = CH_DROPPED
            yield from self._drain(r2, slots, deferred[1:])
            return
        for r2, s2, _ in self._stage(rooms, slots, head):
            yield from self._drain(r2, s2, deferred[1:])

    # -- events -----------------------------------------------------------------------
    def successors(self, state: tuple) -> list[Step]:
        rooms_t, slots_t, deferred, faults, halt, peers_t = state
        if halt is not None:
            return []
        out: list[Step] = []
        N = self.N

        def emit(event, rooms, slots, deferred=deferred, faults=faults, violation=None, detail="", halt=None,
                 peers=peers_t):
            # A slot no room uses holds nothing that matters any more: forget whose bytes it had,
            # so states that differ only in stale bytes are one state.
            used = None
            for s, sl in enumerate(slots):
                if sl[CONTENT] >= 0:
                    if used is None:
                        used = {r[SLOTI] for r in rooms}
                    if s not in used:
                        sl = slots[s] = list(sl)
                        sl[CONTENT] = -1
            if self.regions:
                rooms = [list(x) for x in rooms]
                for x in rooms:
                    x[RCV] = tuple(sorted(x[RCV]))
            else:  # no receivers modelled: only an emptied list to turn back into a tuple
                for k, x in enumerate(rooms):
                    if x[RCV].__class__ is not tuple:
                        x = rooms[k] = list(x)
                        x[RCV] = tuple(sorted(x[RCV]))
            st = (tuple(map(tuple, rooms)), tuple(map(tuple, slots)), deferred, faults, halt, peers)
            out.append(Step(event, st, violation, detail))

        def copy():
            return [list(x) for x in rooms_t], [list(x) for x in slots_t]

        for i, r in enumerate(rooms_t):
            rs = r[RS]
            # the encode request is registered (its sender)
            if r[SND] == 0:
                rooms, slots = copy()
                if rs not in CONCLUDED:
                    rooms[i][RS] = self._room_step(rs, "bind_sender", r[REG] >= N)
                rooms[i][SND] = 1
                emit(("register", i), rooms, slots)
            # a receiver registers (early, late, after the room concluded)
            if r[REG] < N and peers_t and rs not in CONCLUDED:
                self._frame_with_peer(i, r, rooms_t, slots_t, peers_t, emit, copy)
            elif r[REG] < N:
                rooms, slots = copy()
                ro = rooms[i]
                ro[REG] += 1
                if self.regions:
                    self._rcv(ro).append(("offered", W_IDLE))
                violation = None
                if rs in CONCLUDED:
                    ro[RS] = self._room_step(rs, "add_receiver", True)
                    if not self.seed:
                        ro[TOLD] += 1
                        if self.regions:  # told Failed at once (no write will go there), and released with it
                            self._notice(ro, len(ro[RCV]) - 1, "failed")
                            self._release_settled(ro)
                    elif rs == "failed" and ro[CH] == CH_HELD and ro[REG] >= N:
                        # the seed flushes a parked chunk of a failed room and the worker sends it
                        violation = self._issue_writes(rooms, slots, i)
                else:
                    allr = ro[REG] >= N
                    ro[RS] = self._room_step(rs, "add_receiver", allr)
                    if rs == "parked" and ro[RS] == "transferring":
                        violation = self._issue_writes(rooms, slots, i)
                    elif rs == "parked" and self.seed:
                        violation = "deadline-extended"
                emit(("frame", i), rooms, slots, violation=violation)
            # the tower runs (or a cache hit arrives) for the room's single item
            if r[SND] == 1 and r[CH] == CH_NONE and rs not in ("registered", "ready"):
                rooms, slots = copy()
                rooms[i][CH] = CH_DROPPED  # its room concluded: never written, never deferred
                emit(("tower", i), rooms, slots)
            elif r[SND] == 1 and r[CH] == CH_NONE:
                rooms, slots = copy()
                rooms[i][CH] = CH_DEFERRED  # placeholder until offered
                for r2, s2, d2, crash in self._drain(rooms, slots, deferred):
                    if crash:
                        emit(("tower", i), r2, s2, d2, halt="crash")
                        continue
                    if d2 or not self._leasable(r2, s2):
                        if self.busy_wait:
                            emit(("tower", i), r2, s2, d2, halt="spin")
                            continue
                        r3 = [list(x) for x in r2]
                        r3[i][CH] = CH_DEFERRED
                        emit(("tower", i), r3, s2, d2 + (i,))
                    else:
                        for r3, s3, _ in self._stage(r2, s2, i):
                            emit(("tower", i), r3, s3, d2)
                if faults:
                    for ev in ("tower_error", "stage_error"):
                        rooms, slots = copy()
                        rooms[i][CH] = CH_DROPPED
                        if rs not in CONCLUDED:
                            self._fail(rooms, slots, i)
                        emit((ev, i), rooms, slots, faults=faults - 1)
            # the copy into the slot completed: hand the chunk to the manager
            if r[CH] == CH_COPYING and slots_t[r[SLOTI]][SS] == "copying":
                rooms, slots = copy()
                ro, sl = rooms[i], slots[r[SLOTI]]
                violation = None
                if self.seed:
                    sl[SS] = "staged"
                else:
                    self._slot_step(sl, "copied")
                if rs not in ("registered", "ready"):
                    if self.seed and rs == "failed":
                        sl[SS] = "free"
                    else:
                        self._slot_step(sl, "abandon")
                    ro[CH], ro[SLOTI] = CH_DROPPED, -1
                else:
                    ro[RS] = self._room_step(rs, "stage", ro[REG] >= N)
                    if ro[RS] == "parked":
                        if self.seed:
                            sl[SS] = "parked"
                        else:
                            self._slot_step(sl, "park")
                        ro[CH] = CH_HELD
                    else:
                        violation = self._issue_writes(rooms, slots, i, peers_t)
                emit(("copied", i), rooms, slots, violation=violation)
            # a write completes, or reports failure / timeout (it may still land)
            for k in self._choices(r, W_FLIGHT, r[INFL]):
                for ev in ("write_done", "write_unsure") if faults else ("write_done",):
                    rooms, slots = copy()
                    ro = rooms[i]
                    sl = slots[ro[SLOTI]]
                    ro[INFL] -= 1
                    violation = None
                    if k is not None:
                        rc = self._rcv(ro)
                        if ev == "write_done" and rc[k][0] == "released":
                            violation = "write-into-released-region"
                        rc[k] = (rc[k][0], W_GHOST if ev == "write_unsure" else W_IDLE)
                    if ev == "write_unsure":
                        ro[GHOST] += 1
                        sl[UNSURE] = True
                    if self.seed:
                        if ev == "write_unsure" or not ro[INFL]:
                            sl[SS] = "free"  # the seed: a failed write frees the slot at once
                    else:
                        self._slot_step(sl, "settle", self._writes_pending(rooms, ro[SLOTI]))
                    if ro[RS] == "transferring":
                        if ev == "write_done":
                            ro[OK] += 1
                            if ro[OK] == N:
                                ro[RS] = self._room_step(ro[RS], "written", True)
                                self._conclude(rooms, i)
                        else:
                            self._fail(rooms, slots, i)
                    elif ev == "write_done" and ro[RS] == "failed":
                        self._release_settled(ro)
                    if not self._holds_slot(ro):
                        ro[SLOTI] = -1 if ro[CH] == CH_SENT else ro[SLOTI]
                    emit((ev, i) if k is None else (ev, i, k), rooms, slots, faults=faults - (ev == "write_unsure"), violation=violation,
                         detail=f"room {i}'s write landed in a region its receiver had released (and may reuse)"
                         if violation else "")
            # an unsure write lands after all
            for k in self._choices(r, W_GHOST, r[GHOST]):
                rooms, slots = copy()
                ro = rooms[i]
                s = ro[SLOTI]
                violation = detail = None
                if slots[s][CONTENT] != i:
                    violation = "overwrite-under-late-write"
                    detail = f"bytes of room {slots[s][CONTENT]} landed for room {i}"
                elif k is not None and r[RCV][k][0] == "released":
                    violation = "write-into-released-region"
                    detail = f"room {i}'s late write landed in a region its receiver had released (and may reuse)"
                ro[GHOST] -= 1
                if k is not None:
                    rc = self._rcv(ro)
                    # The seed waits out no quarantine: a landed write is simply gone.
                    rc[k] = (rc[k][0], W_IDLE if self.seed else W_LANDED)
                if not self._holds_slot(ro):
                    ro[SLOTI] = -1
                emit(("late_landing", i) if k is None else ("late_landing", i, k), rooms, slots, violation=violation, detail=detail or "")
            # a deadline passes: parked too long, or receivers without a sender
            if self.seed and rs == "failed" and r[CH] == CH_HELD:
                # the seed's reaper pops a parked chunk of a room already failed
                rooms, slots = copy()
                slots[r[SLOTI]][SS] = "free"
                rooms[i][CH], rooms[i][SLOTI] = CH_DROPPED, -1
                emit(("expire", i), rooms, slots)
            if rs == "parked" or (rs == "announced" and not self.seed):  # the seed has no announce deadline
                rooms, slots = copy()
                self._fail(rooms, slots, i, event="expire")
                if rs == "parked":
                    rooms[i][CH], rooms[i][SLOTI] = CH_DROPPED, -1
                emit(("expire", i), rooms, slots)
            # a receiver's request is aborted: it withdraws its region
            if faults and rs not in CONCLUDED:
                for k in sorted({k_ for k_, (g, w) in self._first_of_each(r[RCV]) if g == "offered"}):
                    rooms, slots = copy()
                    ro = rooms[i]
                    rc = self._rcv(ro)
                    if self.seed:
                        # no withdraw message: the seed's receiver frees the region, the encoder never hears
                        rc[k] = ("released", rc[k][1])
                    else:
                        rc[k] = (REGION.destinations("offered", "withdraw", {}), rc[k][1])
                        self._fail(rooms, slots, i)
                    emit(("withdraw", i, k), rooms, slots, faults=faults - 1)
            # the client aborts: the encode loop fails the room
            if faults and r[SND] == 1 and rs not in CONCLUDED:
                rooms, slots = copy()
                self._fail(rooms, slots, i)
                emit(("abort", i), rooms, slots, faults=faults - 1)

        # the edge reports first contact with a peer, or its connect deadline passes
        for k, ps in enumerate(peers_t):
            if ps != "connecting":
                continue
            up = peers_t[:k] + (self._peer_step(ps, "connected"),) + peers_t[k + 1:]
            rooms, slots = copy()
            violation = None
            for i, r in enumerate(rooms):
                if r[RS] == "transferring" and r[CH] == CH_HELD:
                    violation = self._issue_writes(rooms, slots, i, up) or violation
            emit(("connected", k), rooms, slots, peers=up, violation=violation)
            if faults:
                for ev in ("refused", "connect_expired"):
                    down = peers_t[:k] + (self._peer_step(ps, ev),) + peers_t[k + 1:]
                    rooms, slots = copy()
                    self._peer_down(rooms, slots, k)
                    emit((ev, k), rooms, slots, faults=faults - 1, peers=down)
        # the loop serves deferred sends when slots free up
        if deferred and self._leasable([list(x) for x in rooms_t], slots_t):
            rooms, slots = copy()
            for r2, s2, d2, crash in self._drain(rooms, slots, deferred):
                emit(("drain",), r2, s2, d2, halt="crash" if crash else None)
        # reaping: senders of concluded rooms whose tower already ran
        reap = [i for i, r in enumerate(rooms_t) if r[SND] == 1 and r[RS] in CONCLUDED and r[CH] != CH_NONE]
        if reap:
            rooms, slots = copy()
            for i in reap:
                rooms[i][SND] = 2
            emit(("reap",), rooms, slots)
        # a quarantine deadline passes; writes that could land have landed by then
        for s, sl in enumerate(slots_t):
            if sl[SS] == "quarantined" and not self._writes_pending([list(x) for x in rooms_t], s):
                rooms, slots = copy()
                self._slot_step(slots[s], "release")
                for ro in rooms:
                    if ro[SLOTI] == s and self._holds_slot(ro):
                        ro[GHOST] = 0
                        rc = self._rcv(ro)
                        for k, (g, w) in enumerate(rc):
                            if w in (W_GHOST, W_LANDED):
                                rc[k] = (g, W_IDLE)
                        self._release_settled(ro)
                        if not self._holds_slot(ro):
                            ro[SLOTI] = -1
                emit(("release", s), rooms, slots)
        return out

    @staticmethod
    def _first_of_each(rcv) -> list[tuple[int, tuple]]:
        """(index, receiver) for the first receiver of each distinct kind: receivers alike are one choice."""
        seen = set()
        out = []
        for k, x in enumerate(rcv):
            if x not in seen:
                seen.add(x)
                out.append((k, x))
        return out

    # -- presentation ----------------------------------------------------------------
    def rank(self, state: tuple) -> int:
        """Strictly increases along every transition, so the state graph has no cycle."""
        cache = self._rank_cache
        total = 0
        for r in state[0]:
            v = cache.get(r)
            if v is None:
                m = 3 * self.N + 4
                v = cache[r] = (m * (r[CH] + r[SND] + r[REG] + r[TOLD] + (r[RS] in CONCLUDED)) - 3 * r[INFL] - r[GHOST]
                                + sum(_REGION_RANK[g] for g, _ in r[RCV]))
            total += v
        for sl in state[1]:
            total += sl[SS] != "quarantined"
        for ps in state[5]:
            total += _PEER_RANK[ps]
        return total + (state[4] is not None)

    def describe_parts(self, state: tuple) -> list[str]:
        """One short description per room and slot (and the deferred queue), for traces and diagrams."""
        rooms, slots, deferred, faults, halt, peers = state
        parts = []
        for i, r in enumerate(rooms):
            extra = f" slot{r[SLOTI]}" if r[SLOTI] >= 0 else ""
            w = f" infl{r[INFL]}" if r[INFL] else ""
            g = f" ghost{r[GHOST]}" if r[GHOST] else ""
            rx = ",".join(REGION_MARK[a] + W_MARK[b] for a, b in r[RCV])
            rx = f" rx={rx}" if rx else ""
            parts.append(f"room{i}={r[RS]}[{CH_NAMES[r[CH]]} reg{r[REG]}/{self.N} told{r[TOLD]}{w}{g}{rx}{extra}]")
        for s, sl in enumerate(slots):
            c = f"<room{sl[CONTENT]}" if sl[CONTENT] >= 0 else ""
            parts.append(f"slot{s}={sl[SS]}{c}{'!' if sl[UNSURE] else ''}")
        if deferred:
            parts.append("deferred=" + ",".join(f"room{i}" for i in deferred))
        for k, ps in enumerate(peers):
            parts.append(f"peer{k}={ps}")
        if halt:
            parts.append(f"HALT={halt}")
        return parts

    def describe(self, state: tuple) -> str:
        return " ".join(self.describe_parts(state))
