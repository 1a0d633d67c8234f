"""The executor's and manager's rules as the spec has them: machine moves and the couplings.

Every move of a room, extent or peer goes through `_move_room`, `_move_extent` or
`_move_peer`: the destination is looked up in the fsm/ declarations, and the
actions fsm/couplings.py lists for the state entered (`ON_ENTER`) and the event
taken (`ON_EVENT`) run after it, each one method named after its action. The
variants (models/seed.py, and the flags set here and in the parts) change these rules,
never the machines or the table. The ring (leasing, serving deferred sends) is a part of its own,
models/ring.py's `Ring`, built here as `ring`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from epd_ring.fsm import EXTENT, PEER, REGION, ROOM, couplings
from epd_ring.fsm.regions import NOTICE_EVENTS

from .ring import Ring
from .shares import Shares
from .state import (
    CH,
    CH_DROPPED,
    CH_HELD,
    CH_SENT,
    CHAN,
    CONCLUDED,
    EXTENTI,
    GHOST,
    INFL,
    LEN,
    RCV,
    REG,
    REL,
    RS,
    SS,
    TOLD,
    TOLD_NONE,
    UNSURE,
    W_FLIGHT,
    W_GHOST,
    W_IDLE,
    W_LANDED,
    W_STRAY,
    WD,
    WD_ACKED,
    WD_SEEN,
    Draft,
    chan_push,
    extent,
    first_of_each,
    receivers,
    told_after,
)

Action = Callable[[Draft, int, str], None]


class Rules:
    """Moves and the couplings' actions over a `Draft`, and the ring (`ring`); `Events` builds successors from them."""

    # The actions of fsm/couplings.py this spec implements, each as `_<action>(draft, index, cause)`:
    # the index of the room, extent or peer that moved, and the event that moved it.
    ACTIONS = frozenset(("arm_announce_deadline", "park_extent", "arm_park_deadline", "start_writes", "conclude",
                         "abandon_extent", "arm_quarantine_deadline", "resume_rooms", "fail_rooms",
                         "release_regions"))
    UNARMED: frozenset[str] = frozenset()  # deadline actions a variant does without
    LANDED = W_LANDED  # where a late write that landed leaves its region's write
    RING: ClassVar[type[Ring]] = Ring  # the leasing rules (a variant's own subclass, models/seed.py)

    def __init__(self, config) -> None:
        self.cfg = config
        v = config.variant
        self.busy_wait = v == "busy-wait"
        self.write_before_up = v == "write-before-up"
        self.N = config.receivers
        self.regions = config.regions
        self.peers = config.peers
        self.channels = config.channels
        self.late_landing = config.late_landing
        self.restarts = config.restarts
        self.shares = Shares(config)
        self.fair = self.shares.k > 1  # per-identity shares and deferred queues (models/shares.py)
        self._read_couplings()
        # the arena's part: leases through `_move_extent`, so the couplings run (after they are bound)
        self.ring = self.RING(config, self.shares, self._move_extent, self._spread)

    def _read_couplings(self) -> None:
        """Bind fsm/couplings.py's table to this spec's methods (read at construction, as the core reads it)."""
        unknown = couplings.actions() - self.ACTIONS
        if unknown:
            raise AssertionError(f"model bug: fsm/couplings.py names actions the spec lacks: {sorted(unknown)}")

        def bind(table: dict) -> dict[tuple[str, str], tuple[Action, ...]]:
            return {key: tuple(getattr(self, "_" + a) for a in acts) for key, acts in table.items()}

        self._on_enter = bind(couplings.ON_ENTER)
        self._on_event = bind(couplings.ON_EVENT)
        # The model keeps no clock: a deadline may pass while its object stays in the state that armed it.
        self._armed = {m: couplings.armed_states(m, self.UNARMED) for m in ("room", "extent")}

    def _couple(self, d: Draft, machine: str, index: int, old: str, new: str, event: str) -> None:
        if new != old:
            for act in self._on_enter.get((machine, new), ()):
                act(d, index, event)
        for act in self._on_event.get((machine, event), ()):
            act(d, index, event)

    # -- moves: the declarations decide where, the table what follows --------------------
    # Moves are looked up once per (state, event, guard values), then remembered: the explorer
    # asks the same few questions millions of times.
    _room_moves: ClassVar[dict] = {}
    _extent_moves: ClassVar[dict] = {}

    @staticmethod
    def _room_step(rs: str, event: str, all_receivers: bool) -> str:
        key = (rs, event, all_receivers)
        dest = Rules._room_moves.get(key)
        if dest is None:
            dest = Rules._room_moves[key] = ROOM.destinations(rs, event, {"all_receivers": all_receivers})
        if dest is None:
            raise AssertionError(f"model bug: room event {event!r} not declared from {rs!r}")
        return dest

    def _extent_step(self, extent: list, event: str, pending: bool = False) -> None:
        key = (extent[SS], event, pending, extent[UNSURE])
        dest = Rules._extent_moves.get(key)
        if dest is None:
            dest = Rules._extent_moves[key] = EXTENT.destinations(
                extent[SS], event, {"writes_pending": pending, "write_unsure": extent[UNSURE]})
        if dest is None:
            raise AssertionError(f"model bug: extent event {event!r} not declared from {extent[SS]!r}")
        extent[SS] = dest
        if dest == "free":
            extent[UNSURE] = False

    @staticmethod
    def _peer_step(ps: str, event: str, backing_off: bool = False) -> str:
        dest = PEER.destinations(ps, event, {"backing_off": backing_off, "at_threshold": False})
        if dest is None:
            raise AssertionError(f"model bug: peer event {event!r} not declared from {ps!r}")
        return dest

    def _move_room(self, d: Draft, i: int, event: str) -> None:
        ro = d.rooms[i]
        old = ro[RS]
        ro[RS] = self._room_step(old, event, ro[REG] >= self.N)
        self._couple(d, "room", i, old, ro[RS], event)

    def _move_extent(self, d: Draft, s: int, event: str, pending: bool = False) -> None:
        """Move the extent whose first cell is s (every cell of it follows)."""
        sl = d.cells[s]
        old = sl[SS]
        self._extent_step(sl, event, pending)
        self._spread(d, s)
        self._couple(d, "extent", s, old, sl[SS], event)

    @staticmethod
    def _spread(d: Draft, s: int) -> None:
        """The extent's other cells take its first cell's state; a free extent falls apart into free cells."""
        cells = d.cells
        head = cells[s]
        for c in extent(cells, s):
            cell = cells[c]
            cell[SS], cell[UNSURE] = head[SS], head[UNSURE]
            if head[SS] == "free":
                cell[LEN] = 1

    def _move_peer(self, d: Draft, k: int, event: str, backing_off: bool = False) -> None:
        old = d.peers[k]
        new = self._peer_step(old, event, backing_off)
        d.peers = d.peers[:k] + (new,) + d.peers[k + 1:]
        self._couple(d, "peer", k, old, new, event)

    # -- the couplings' actions (fsm/couplings.py ACTION_DOCS says what each is for) ---------
    def _arm_deadline(self, d: Draft, index: int, cause: str) -> None:
        """Nothing to record: the deadline's event is enabled by the state itself (see `_armed`)."""

    _arm_announce_deadline = _arm_park_deadline = _arm_quarantine_deadline = _arm_deadline

    def _park_extent(self, d: Draft, i: int, cause: str) -> None:
        ro = d.rooms[i]
        self._move_extent(d, ro[EXTENTI], "park")
        ro[CH] = CH_HELD

    def _start_writes(self, d: Draft, i: int, cause: str) -> None:
        self._issue_writes(d, i)

    def _conclude(self, d: Draft, i: int, cause: str) -> None:
        """Every receiver is told the outcome; a failed room's settled regions are released."""
        ro = d.rooms[i]
        ro[TOLD] = ro[REG]
        outcome = "success" if ro[RS] == "success" else "failed"
        for k, x in enumerate(receivers(ro)):
            # with channels the encoder cannot see a region: it tells every receiver (none was told yet)
            if self.channels or x[0] in ("offered", "withdrawing"):
                self._notice(ro, k, outcome)
        if outcome == "failed":
            self._release_settled(ro)

    def _abandon_extent(self, d: Draft, i: int, cause: str) -> None:
        # A copying chunk is abandoned when its copy completes; one not yet in the ring, when it gets there.
        if d.rooms[i][CH] == CH_HELD:
            self._drop_chunk(d, i)

    def _resume_rooms(self, d: Draft, k: int, cause: str) -> None:
        for i, r in enumerate(d.rooms):
            if r[RS] == "transferring" and r[CH] == CH_HELD:
                self._issue_writes(d, i)

    def _fail_rooms(self, d: Draft, k: int, cause: str) -> None:
        """Every live room with a receiver on peer k (its rank-k receiver) fails."""
        for i, r in enumerate(d.rooms):
            if r[REG] > k and r[RS] not in CONCLUDED:
                self._move_room(d, i, "fail")

    def _release_regions(self, d: Draft, s: int, cause: str) -> None:
        """Writes from extent s that could land have landed: its rooms' failed regions are released."""
        for ro in d.rooms:
            if ro[EXTENTI] == s and self._holds_extent(ro):
                rc = receivers(ro)
                if self.late_landing:
                    # the transport outlived the quarantine: a ghost stays, a stray the encoder no longer waits for
                    for k, x in enumerate(rc):
                        if x[1] in (W_GHOST, W_LANDED):
                            rc[k] = (x[0], W_STRAY if x[1] == W_GHOST else W_IDLE, *x[2:])
                else:
                    ro[GHOST] = 0
                    for k, x in enumerate(rc):
                        if x[1] in (W_GHOST, W_LANDED):
                            rc[k] = (x[0], W_IDLE, *x[2:])
                self._release_settled(ro)
                if not self._holds_extent(ro):
                    ro[EXTENTI] = -1

    # -- writes and chunks --------------------------------------------------------------
    def _issue_writes(self, d: Draft, i: int) -> None:
        """One write per receiver from the room's extent; held back while a peer of the room is not up."""
        r = d.rooms[i]
        d.flag("write-for-concluded-room" if r[RS] in CONCLUDED else None)
        if any(ps != "up" for ps in d.peers):
            if not self.write_before_up:
                # The chunk waits in its extent until every peer of the room is up (a down one failed it).
                r[CH] = CH_HELD
                return
            d.flag("write-to-peer-not-up")
        self._move_extent(d, r[EXTENTI], "send")
        r[CH], r[INFL] = CH_SENT, self.N
        r[RCV] = [(x[0], W_FLIGHT, *x[2:]) for x in r[RCV]]

    def _drop_chunk(self, d: Draft, i: int) -> None:
        """The room's chunk will never be sent: its extent goes back free."""
        ro = d.rooms[i]
        self._move_extent(d, ro[EXTENTI], "abandon")
        ro[CH], ro[EXTENTI] = CH_DROPPED, -1

    def _settle(self, d: Draft, i: int, unsure: bool) -> None:
        """A write from the room's extent completed or was reported unsure."""
        s = d.rooms[i][EXTENTI]
        self._move_extent(d, s, "settle", self._writes_pending(d.rooms, s))

    def _holds_extent(self, ro) -> bool:
        if not self.regions:
            return bool(ro[INFL] or ro[GHOST])
        return any(x[1] != W_IDLE for x in ro[RCV])

    @staticmethod
    def _writes_pending(rooms, s: int) -> bool:
        return any(r[EXTENTI] == s and r[INFL] for r in rooms)

    def _choices(self, r: tuple, w: int, count: int) -> list:
        """Receivers whose write is in state w (alike ones are one choice); [None] without regions."""
        if not count:
            return []
        if not self.regions:
            return [None]
        return sorted({k for k, x in first_of_each(r[RCV]) if x[1] == w})

    # -- the receivers' regions ------------------------------------------------------------
    def _notice(self, ro: list, k: int, notice: str) -> None:
        """The encoder tells receiver k `notice`: with channels it joins the receiver's FIFO (`_deliver`
        takes it off), else it arrives at once."""
        if self.channels:
            rc = receivers(ro)
            x = rc[k]
            rc[k] = (*x[:CHAN], chan_push(x[CHAN], notice), *x[CHAN + 1:])
        else:
            self._deliver(ro, k, notice)

    def _deliver(self, ro: list, k: int, notice: str) -> None:
        """Receiver k takes `notice`: its region moves by the region machine, and an outcome is kept as a
        value (a second one marks the receiver told twice)."""
        rc = receivers(ro)
        x = rc[k]
        rc[k] = (self._region_step(x[0], NOTICE_EVENTS[notice]), x[1], told_after(x[2], notice), *x[3:])

    _region_moves: ClassVar[dict] = {}

    @staticmethod
    def _region_step(g: str, event: str) -> str:
        dest = Rules._region_moves.get((g, event))
        if dest is None:
            dest = Rules._region_moves[g, event] = REGION.destinations(g, event, {})
        if dest is None:
            raise AssertionError(f"model bug: region event {event!r} not declared from {g!r}")
        return dest

    def _release_settled(self, ro: list) -> None:
        """A failed room's region is released (or its withdraw acked) once no write into it can land
        (as far as the encoder knows: a stray is not waited for)."""
        rc = receivers(ro)
        if self.channels:
            self._release_settled_by_encoder(ro, rc)
            return
        for k, x in enumerate(rc):
            if x[1] in (W_IDLE, W_STRAY) and x[0] in ("failed", "withdrawing"):
                self._notice(ro, k, "released" if x[0] == "failed" else "withdrawn")

    def _release_settled_by_encoder(self, ro: list, rc: list) -> None:
        """With channels the encoder acts on what it knows: a withdraw it saw is acked, else a failed
        room's region is released; a withdraw seen after the release is acked too (they crossed)."""
        for k, x in enumerate(rc):
            if x[1] not in (W_IDLE, W_STRAY):
                continue
            if x[WD] == WD_SEEN:
                rc[k] = (*x[:WD], WD_ACKED, x[REL])
                self._notice(ro, k, "withdrawn")
            elif ro[RS] == "failed" and not x[REL] and x[WD] != WD_ACKED:
                rc[k] = (*x[:REL], 1)
                self._notice(ro, k, "released")

    def _offer(self, ro: list) -> None:
        """One more receiver registered (and, with regions, offered its receive region)."""
        ro[REG] += 1
        if self.regions:
            receivers(ro).append(("offered", W_IDLE, TOLD_NONE, 0, 0, 0) if self.channels
                                 else ("offered", W_IDLE, TOLD_NONE))
