"""An executable abstract spec of the encode-side protocol.

A global state is a tuple `(rooms, cells, deferred, faults, halt, peers)`:

- each room is `(rs, snd, ch, reg, told, ok, infl, ghost, rcv, size, extent)`: its
  room-machine state; its sender (0 none, 1 registered, 2 reaped); where its chunk is
  (see CH_*); receivers registered, told their outcome, written; writes in flight;
  writes that reported failure or timeout but may still land ("ghosts"); its
  receivers, the other end (a sorted tuple of `(region, write, told)`, one per
  registered receiver: the state of its receive region in the region machine, where
  the write into it is, see W_*, and the outcome it was told, a value kept after the
  region is released, see TOLD_*); its item's size in cells (0 before the tower ran); the
  first cell of the extent its chunk or writes use (-1 none);
- the ring's arena is a few cells, each `(ss, content, unsure, len)`: the extent
  machine's state of the extent it belongs to, the room whose bytes it holds (-1
  none), whether a write from its extent was unsure, and the extent's length at its
  first cell (0 on its other cells). An extent is a run of contiguous cells leased
  with a size; a free cell is a free extent of one cell. The lease may take any run
  of free cells long enough (every allocation policy that only hands out free bytes
  is one of these choices); an item that fits nowhere defers;
- `deferred` is the FIFO of rooms whose chunk waits for room in the arena (served
  oldest first, and the oldest blocks the rest until it fits); `faults` is the
  fault budget left; `halt` marks a loop that crashed or spins forever;
- `peers` (with `Config.peers`) holds one peer-machine state per receiver rank: the
  rank-k receiver of every room lives on peer k. First contact runs at the edge, so
  its outcome (connected, refused, or no answer by the connect deadline) is an event
  of its own, never a step of the loop. Refused and unanswered contacts spend the
  fault budget. Write failures do not move peers here (the model counts writes per
  room, not per receiver); the suites cover suspect peers.
- with `Config.restarts`, a seventh part: the encoder restarts left. A restart loses everything the
  encoder held; each room that had begun becomes an orphan (its sender `SND_DEAD`), kept only for its
  receivers' regions and the dead incarnation's writes that may still land in them
  (models/events_restarts.py, `restarts`, `reclaims`).

Room, extent and region moves are looked up in the fsm/ declarations (`ROOM`, `EXTENT`,
`REGION`), not copied, and what a move obliges elsewhere (a parked room parks its
extent, a failed one abandons it and tells its receivers, a quarantine's end releases
regions) is run from fsm/couplings.py's table. Notices reach a receiver when the
encoder sends them (one ordered socket per receiver, so a delay changes when, never
what, it learns).

The code: models/state.py (the layout above), models/rules.py (moves, the couplings'
actions), models/ring.py (leasing, serving deferred sends), models/events.py (one method per
family of events, and its parts events_peers.py, events_withdraws.py and events_restarts.py), this
module (checks and presentation). Variants change the executor's and manager's rules, never
the machines: the `seed` variant (models/seed.py) models the seed, whose extents have
no machine at all (a range of cells is reusable as soon as the rooms whose bytes it
holds are terminal and not parked), so its extent moves are set directly and the
invariants show what goes wrong: a new extent overlaps one a write may still read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from epd_ring.fsm import EXTENT, PEER, ROOM

from .events import Events

# The state's layout, imported from here by the spec's users.
from .state import (  # noqa: F401
    _PEER_RANK,
    _REGION_RANK,
    CH,
    CH_COPYING,
    CH_DEFERRED,
    CH_DROPPED,
    CH_HELD,
    CH_NAMES,
    CH_NONE,
    CH_SENT,
    CHAN,
    CONCLUDED,
    CONTENT,
    EXTENTI,
    GHOST,
    INFL,
    LEN,
    NOTICE_CODE,
    OK,
    OWNER,
    RCV,
    REG,
    REGION_MARK,
    REL,
    RS,
    SIZE,
    SND,
    SND_DEAD,
    SS,
    TOLD,
    TOLD_MARK,
    TOLD_NONE,
    TOLD_TWICE,
    UNSURE,
    W_FLIGHT,
    W_GHOST,
    W_IDLE,
    W_LANDED,
    W_MARK,
    W_STRAY,
    WD,
    WD_ACKED,
    WD_NONE,
    Step,
    chan_len,
    chan_notices,
    extent,
    room_cells,
)

VARIANTS = {
    "project": "our design",
    "seed": "the seed's rules: tenant-based reuse, only Success stragglers dropped, partial registration "
            "re-arms the deadline, no Failed for late receivers or on expiry, failed write frees its extent at once",
    "no-parked-check": "lease may take an extent whose chunk is parked",
    "reuse-when-terminal": "the arena hands a range out again as soon as the rooms whose bytes it holds are "
                           "terminal (a free on completion), while a write from it may still read it",
    "busy-wait": "a full ring makes the single loop wait for an extent instead of deferring",
    "reaped-deferred-crash": "serving a deferred send whose sender was reaped crashes the loop",
    "blocking-contact": "first contact with a peer runs on the encode loop (a silent peer holds it)",
    "write-before-up": "writes go to a peer that is still being contacted",
    "no-write-deadline": "no write deadline is armed, so a write the transport never reports stays in flight "
                         "(drops fairness F1: models/liveness.py)",
}

# Variants that differ from the project only in how peers are handled (need Config.peers).
PEER_VARIANTS = frozenset(("blocking-contact", "write-before-up"))

# Which hazard each violation stands for, per variant (for fixture names and reports).
HAZARDS = {
    ("seed", "receiver-not-told"): "H5",
    ("seed", "overwrite-under-late-write"): "H6",
    ("seed", "overwrite-under-write"): "H15-extent-reuse",
    ("seed", "overwrite-under-chunk"): "H15-extent-reuse-before-send",
    ("seed", "write-for-concluded-room"): "H15",
    ("seed", "deadline-extended"): "H16",
    ("seed", "write-into-released-region"): "H6-receiver-region-reuse",
    ("no-parked-check", "overwrite-under-chunk"): "lease-without-parked-check",
    ("reuse-when-terminal", "overwrite-under-late-write"): "extent-reuse-when-terminal",
    ("busy-wait", "deadlock"): "busy-wait-lease",
    ("blocking-contact", "loop-waits-on-peer"): "blocking-first-contact",
    ("write-before-up", "write-to-peer-not-up"): "write-before-peer-up",
    ("reaped-deferred-crash", "crash"): "deferred-send-after-reap",
    ("no-write-deadline", "room-never-concludes"): "write-never-reported",
}


@dataclass(frozen=True)
class Config:
    cells: int = 2  # the arena, in cells
    rooms: int = 2
    receivers: int = 1
    faults: int = 1
    variant: str = "project"
    # The receivers' end (regions, withdraws, release notices). Off: the encode side alone,
    # with the same events and states as before the receivers were modelled (what the SPIN
    # generator covers).
    regions: bool = True
    peers: bool = False  # model the peer machine (one peer per receiver rank)
    # The sizes, in cells, an item may have (the tower picks one); one larger than the arena fails its room.
    sizes: tuple[int, ...] = (1, 2)
    # Notices travel: a FIFO per receiver carries the encoder's notices (outcome, release, withdraw ack)
    # and the receiver's withdraw travels the other way, so a withdraw may cross an outcome or a release.
    # Off: a notice reaches its receiver in the step that sends it.
    channels: bool = False
    # A ghost write may land after its extent's quarantine ended (the transport broke the bound the
    # quarantine relies on): a hazard switch, not a design. Off: the quarantine outlasts every write.
    late_landing: bool = False
    # Encoder restarts (issue 29): up to this many times the encoder's process dies and a new incarnation
    # takes its address. Everything the encoder held is lost (rooms, extents, writes in flight, the deferred
    # queue); the receivers conclude every room of the dead incarnation not told success as failed, once,
    # and take every region back after their reclaim delay. Off (0): the state and its counts are as before.
    restarts: int = 0
    # Identities (issue 30): rooms are split among them (`Spec.owners`); each identity's rooms may hold
    # 1/identities of the arena (from lease until free, quarantined extents included) and its deferred sends
    # wait in a FIFO of their own, the FIFOs served round-robin (models/shares.py). 1: no shares, the state
    # and its counts as before.
    identities: int = 1
    # Runs of cells one extent may span when no run holds it whole (issue 33: the ring's `max_pieces`); the
    # spec leases any such cells, the arena its largest free runs, then the best fit. 1: the state and its
    # counts as before.
    pieces: int = 1

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; one of {sorted(VARIANTS)}")
        if min(self.cells, self.rooms, self.receivers) < 1 or self.faults < 0:
            raise ValueError("cells, rooms and receivers must be >= 1, faults >= 0")
        sizes = tuple(self.sizes)
        if not sizes or min(sizes) < 1 or max(sizes) > 15 or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"sizes must be distinct cell counts from 1 to 15, ascending; got {self.sizes!r}")
        object.__setattr__(self, "sizes", sizes)
        if (self.channels or self.late_landing) and (not self.regions or self.variant == "seed"):
            raise ValueError("channels and late_landing model the receivers' regions: they need regions=True "
                             "and a variant other than seed")  # a list from a trace file reads back as a tuple
        if self.identities < 1:
            raise ValueError("identities must be >= 1")
        if self.identities > 1 and (self.variant not in ("project", "no-write-deadline") or self.peers
                                    or self.restarts or self.identities > self.rooms):
            # the shares are the project's; peers and restarts are orthogonal to them and multiply the states
            raise ValueError("identities > 1 need the project's rules (or no-write-deadline), no peers, no "
                             "restarts, and at least one room per identity")
        if self.restarts < 0:
            raise ValueError("restarts must be >= 0")
        if self.pieces < 1 or (self.pieces > 1 and self.variant not in ("project", "no-write-deadline")):
            # the other variants lease over busy extents, whose cells a spanning extent's could not be told from
            raise ValueError("pieces must be >= 1; pieces > 1 need the project's rules (or no-write-deadline)")
        if self.restarts and (not self.regions or self.variant == "seed" or self.channels or self.peers):
            # Without channels a notice reaches its receiver in the step that sends it, so at the restart every
            # receiver's view is the dead encoder's last word; a peer table would be lost with the rest.
            raise ValueError("restarts model the receivers' side of an encoder restart: they need regions=True, "
                             "a variant other than seed, and neither channels nor peers")


def _outcome_on_way(ch: int) -> bool:
    return any(n in ("success", "failed") for n in chan_notices(ch))


def _channel_mark(x: tuple) -> str:
    """With channels: the notices on the way (<...), the withdraw's place and whether a release was sent."""
    if len(x) == 3:
        return ""
    way = "".join("+-RA"[NOTICE_CODE[n] - 1] for n in chan_notices(x[CHAN]))  # pragma: no mutate (trace text)
    # trace text: not mutated (the pragma below)
    return (f"<{way}" if way else "") + ("", "w>", "w", "wA")[x[WD]] + ("r" if x[REL] else "")  # pragma: no mutate


class Spec(Events):
    """The spec of one configuration: its initial state, successors, checks and how states read.

    `Spec(config)` with the seed variant builds a `models.seed.SeedSpec`, the seed's rules.
    """

    # A variant whose rules are a subclass names itself there (`class SeedSpec(Spec, variant="seed")`),
    # so this module imports none of them (they import it); the package's __init__ loads them.
    _by_variant: ClassVar[dict[str, type[Spec]]] = {}

    # runs when a variant's class is made, at import, before mutmut switches a mutant on, so no mutant
    # of it could be caught: not mutated (test_model_spec_edges.py checks the seed's variant makes a SeedSpec)
    # pragma: no mutate start
    def __init_subclass__(cls, variant: str | None = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if variant is not None:
            Spec._by_variant[variant] = cls
    # pragma: no mutate end

    def __new__(cls, config: Config):
        if cls is Spec:
            cls = Spec._by_variant.get(config.variant, Spec)
        return super().__new__(cls)

    def __init__(self, config: Config):
        super().__init__(config)
        self._rank_cache: dict = {}

    # -- states ---------------------------------------------------------------
    def initial(self) -> tuple:
        room = (ROOM.initial, 0, CH_NONE, 0, 0, 0, 0, 0, (), 0, -1)
        cell = (EXTENT.initial, -1, False, 1)
        peers = (PEER.initial,) * self.N if self.peers else ()
        k = self.cfg.identities
        rooms = tuple((*room, v) for v in self.owners()) if k > 1 else (room,) * self.cfg.rooms
        state = (rooms, (cell,) * self.cfg.cells, (), self.cfg.faults, None, peers)
        return state + (self.cfg.restarts,) if self.restarts else state

    def owners(self) -> tuple[int, ...]:
        """Each room's identity: as even a split as the rooms allow, in blocks (identity 0's rooms first). The
        canonical form sorts rooms by owner first, so the blocks stay in place and SPIN reads a room's owner
        from its index."""
        return tuple(sorted(i % self.cfg.identities for i in range(self.cfg.rooms)))

    def is_final(self, state: tuple) -> bool:
        """Quiescent: every room concluded and told, every cell free, nothing held or deferred."""
        rooms, extents, deferred, halt = state[0], state[1], state[2], state[4]
        return (halt is None and not deferred
                and all(s[SS] == "free" for s in extents)
                # an orphan's receivers that had not registered never will (their frames go to a new room)
                and all(r[RS] in CONCLUDED and r[TOLD] == r[REG] and (r[REG] == self.N or r[SND] == SND_DEAD)
                        and r[SND] in (2, SND_DEAD)
                        and r[INFL] == 0 and r[GHOST] == 0
                        and all(x[0] in ("written", "released") and x[1] == W_IDLE and x[2] == r[RS]
                                and (len(x) == 3 or (x[CHAN] == 0 and x[WD] in (WD_NONE, WD_ACKED)))
                                for x in r[RCV])
                        for r in rooms))

    def invariant(self, state: tuple) -> tuple[str, str] | None:
        """Safety checked in every state: (violation, detail) or None."""
        rooms, extents, halt, peers = state[0], state[1], state[4], state[5]
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
            s = r[EXTENTI]
            # Some cell of the room's extent holds another room's bytes: an allocation overlapped it.
            other = next((c for c in (extents[x][CONTENT] for x in room_cells(extents, s, r[SIZE])) if c != i), None) \
                if s >= 0 else None
            if other is not None:
                if r[GHOST]:
                    kind, who = "overwrite-under-late-write", "a write that reported failure may still land"
                elif r[INFL]:
                    kind, who = "overwrite-under-write", "a write is in flight"
                elif r[CH] in (CH_COPYING, CH_HELD):
                    kind, who = "overwrite-under-chunk", "its chunk is still to be sent"
                else:
                    kind = None
                if kind:
                    # message text: not mutated (the pragma below)
                    cells = f"cell {s}" if r[SIZE] == 1 else f"cells {s}-{s + r[SIZE] - 1}"  # pragma: no mutate
                    return kind, (f"an allocation for room {other} overlaps room {i}'s extent ({cells}) "
                                  f"while {who}")
            if r[RS] in CONCLUDED and r[TOLD] < r[REG]:
                untold = r[REG] - r[TOLD]  # pragma: no mutate (wording: a count only the detail shows)
                return "receiver-not-told", f"room {i} is {r[RS]} but {untold} of its receivers were not told"
            if r[RS] == "success" and r[OK] < self.N:
                return "success-without-all-writes", f"room {i} success with {r[OK]} of {self.N} receivers written"
            for x in r[RCV]:
                g, w, t = x[0], x[1], x[2]
                if g == "written" and w in (W_FLIGHT, W_GHOST):
                    return ("success-under-write",
                            f"room {i}: a receiver was told success while a write into it may land")
                if (g == "written" and r[RS] != "success") or (g == "failed" and r[RS] == "success"):
                    return "wrong-outcome", f"room {i} is {r[RS]} but a receiver's region is {g}"
                # The outcome each receiver was told, kept after its region is released: exactly one,
                # the room's, and only once the room concluded.
                if t == TOLD_TWICE:
                    return "told-twice", f"room {i}: a receiver ({g}) was told an outcome twice"
                if t != TOLD_NONE and t != r[RS]:
                    return "wrong-outcome", f"room {i} is {r[RS]} but a receiver ({g}) was told {t}"
                if t == TOLD_NONE and r[RS] in CONCLUDED and not (len(x) > 3 and _outcome_on_way(x[CHAN])):
                    return "receiver-not-told", f"room {i} is {r[RS]} but a receiver ({g}) was told nothing"
        return None

    # -- events -----------------------------------------------------------------------
    def successors(self, state: tuple) -> list[Step]:
        """Every step from `state`: each room's events in turn (ROOM_FAMILIES), then the encoder's."""
        if state[4] is not None:
            return []
        out: list[Step] = []
        if self.restarts:
            for i, r in enumerate(state[0]):
                # an orphan has no encoder: only its receivers and the dead incarnation's writes move
                for family in self._orphan_families if r[SND] == SND_DEAD else self._room_families:
                    family(state, i, out)
        else:
            for i in range(len(state[0])):
                for family in self._room_families:
                    family(state, i, out)
        for family in self._global_families:
            family(state, out)
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
                                + sum(_REGION_RANK[x[0]] for x in r[RCV]))
                if self.channels:
                    # every notice counts twice once sent (sent, then delivered) and once per step the
                    # withdraw takes: sending or delivering anything raises the rank
                    done = r[RS] in CONCLUDED
                    v += sum(2 * (done + x[REL] + (x[WD] == WD_ACKED)) - chan_len(x[CHAN]) + x[WD] for x in r[RCV])
                    cache[r] = v
            total += v
        for sl in state[1]:  # once per extent: its first cell (a continuation cell counts 1 in every state)
            total += sl[SS] != "quarantined" or sl[LEN] <= 0
        for ps in state[5]:
            total += _PEER_RANK[ps]
        if self.restarts:
            total += self.cfg.restarts - state[6]
        return total + (state[4] is not None)

    def describe_parts(self, state: tuple) -> list[str]:
        """One short description per room and extent (and the deferred queue), for traces and diagrams."""
        rooms, extents, deferred, halt, peers = state[0], state[1], state[2], state[4], state[5]
        parts = []
        for i, r in enumerate(rooms):
            s, z = r[EXTENTI], r[SIZE]
            extra = f" size{z}" if z else ""
            # trace text: not mutated (the pragma below)
            extra += "" if s < 0 else f" cell{s}" if z == 1 else f" cells{s}-{s + z - 1}"  # pragma: no mutate
            # trace text: a spanning extent's cells, each (not mutated: the pragma below)
            if s >= 0 and z > 1 and room_cells(extents, s, z)[-1] != s + z - 1:  # pragma: no mutate
                extra = f" size{z} cells" + "+".join(map(str, room_cells(extents, s, z)))  # pragma: no mutate
            w = f" infl{r[INFL]}" if r[INFL] else ""
            g = f" ghost{r[GHOST]}" if r[GHOST] else ""
            rx = ",".join(REGION_MARK[x[0]] + W_MARK[x[1]] + TOLD_MARK[x[2]] + _channel_mark(x) for x in r[RCV])
            rx = f" rx={rx}" if rx else ""
            if r[SND] == SND_DEAD:  # an orphan: its receivers' view of the room, and the dead writes
                parts.append(f"room{i}={r[RS]}[orphan reg{r[REG]}/{self.N}{g}{rx}]")
                continue
            who = f"@{r[OWNER]}" if len(r) > OWNER else ""
            parts.append(f"room{i}{who}={r[RS]}[{CH_NAMES[r[CH]]} reg{r[REG]}/{self.N} told{r[TOLD]}{w}{g}{rx}{extra}]")
        for s, sl in enumerate(extents):
            c = f"<room{sl[CONTENT]}" if sl[CONTENT] >= 0 else f"<@{-2 - sl[CONTENT]}" if sl[CONTENT] < -1 else ""
            if sl[LEN] > 0:
                where = f"cell{s}" if sl[LEN] == 1 else f"cells{s}-{s + sl[LEN] - 1}"  # pragma: no mutate (trace text)
                # trace text: a spanning extent's cells, each (not mutated: the pragma below)
                if sl[LEN] > 1 and extent(extents, s)[-1] != s + sl[LEN] - 1:  # pragma: no mutate
                    where = "cells" + "+".join(map(str, extent(extents, s)))  # pragma: no mutate (trace text)
                parts.append(f"{where}={sl[SS]}{c}{'!' if sl[UNSURE] else ''}")
            elif sl[LEN] == 0 and sl[CONTENT] != extents[s - 1][CONTENT]:  # its extent's first cell was overwritten
                parts.append(f"cell{s}=+{sl[SS]}{c}")  # pragma: no mutate (trace text)
        if deferred:
            parts.append("deferred=" + ",".join(f"room{i}" for i in deferred))  # pragma: no mutate (trace text)
        for k, ps in enumerate(peers):
            parts.append(f"peer{k}={ps}")
        if self.restarts and state[6] < self.cfg.restarts:
            parts.append(f"incarnation{self.cfg.restarts - state[6]}")
        if halt:
            parts.append(f"HALT={halt}")
        return parts

    def describe(self, state: tuple) -> str:
        return " ".join(self.describe_parts(state))
