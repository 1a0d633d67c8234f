"""The layout of the spec's global state, and the draft a successor is built in.

A global state is a tuple `(rooms, cells, deferred, faults, halt, peers)`, with the restarts
left appended when `Config.restarts` is on; see models/spec.py for what each part means. The
constants here name the places in a room and a cell tuple and the values they take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CH_NONE, CH_DEFERRED, CH_COPYING, CH_HELD, CH_SENT, CH_DROPPED = range(6)
CH_NAMES = ("awaiting-tower", "deferred", "copying", "held", "sent", "dropped")
RS, SND, CH, REG, TOLD, OK, INFL, GHOST, RCV, SIZE, EXTENTI = range(11)
# With `Config.identities` > 1 a room has a twelfth field: the identity that owns it (models/shares.py).
OWNER = 11
# A room's sender (SND): none yet, registered, reaped; or, with `Config.restarts`, the room's encoder
# incarnation died: the room is an orphan, only its receivers' regions (and the dead writes into them) are left.
SND_DEAD = 3
# The write into one receiver's region: none that can land (never issued, or done), in
# flight, reported failed or timed out but may still land, or landed late (the encoder
# cannot tell: it waits out the quarantine either way).
# With `Config.late_landing`, a ghost whose quarantine ended is a stray: the encoder released its
# extent and regions believing nothing could land, yet it may.
W_IDLE, W_FLIGHT, W_GHOST, W_LANDED, W_STRAY = range(5)
W_MARK = ("", "~", "?", ".", "!")
# With `Config.channels`, a receiver is `(region, write, told, chan, wd, rel)`: the notices on the way to it
# (a FIFO coded as base-5 digits, head in the lowest, so both engines sort it alike), where its withdraw is
# (WD_*: the encoder's view of it), and whether the encoder sent it a release notice.
NOTICE_CODE = {"success": 1, "failed": 2, "released": 3, "withdrawn": 4}
NOTICE_OF = {c: n for n, c in NOTICE_CODE.items()}
CHAN_CAP = 3  # most notices one region is ever sent: an outcome, a release and a withdraw's ack
CHAN, WD, REL = 3, 4, 5
WD_NONE, WD_SENT, WD_SEEN, WD_ACKED = range(4)
# The outcome a receiver was told (a value kept after its region is released): none yet, one of the
# room outcomes, or TOLD_TWICE once a second outcome reached it. Sorted as SPIN codes them (0..3).
TOLD_NONE, TOLD_TWICE = "", "twice"
TOLD_MARK = {"": "", "failed": "-", "success": "+", "twice": "*"}
REGION_MARK = {"offered": "o", "written": "W", "failed": "F", "withdrawing": "X", "released": "R"}
_REGION_RANK = {"offered": 0, "failed": 1, "withdrawing": 1, "written": 2, "released": 3}
# A cell: the state of the extent it belongs to (every cell of an extent carries it), whose
# bytes it holds, whether a write from its extent was unsure, and the extent's length in cells
# at its first cell (0 on the others; a free cell is an extent of its own, of one cell). An extent
# that spans runs of cells (`Config.pieces` > 1, no run large enough) has its first cell's index s
# as -1 - s on each other cell, so its cells are found wherever they lie.
SS, CONTENT, UNSURE, LEN = range(4)
CONCLUDED = frozenset(("success", "failed"))
# Rooms whose chunk may still be staged: a sender bound, no chunk in the ring yet.
STAGEABLE = ("registered", "ready")
# Peer states in the order the model moves them (down -> connecting needs a new frame).
_PEER_RANK = {"unknown": 0, "connecting": 1, "suspect": 1, "up": 2, "down": 3}


@dataclass
class Step:
    """One successor of a state: the event taken, the state reached, and the check the step itself breaks."""
    event: tuple
    state: tuple
    violation: str | None = None
    detail: str = ""


class Draft:
    """One successor being built: mutable copies of the rooms and cells, and what else the step changes."""

    __slots__ = ("cells", "deferred", "detail", "faults", "halt", "peers", "restarts", "rooms", "violation", "waits")

    def __init__(self, rooms: list, cells: list, deferred: tuple, faults: int, peers: tuple,
                 restarts: int | None = None) -> None:
        self.rooms, self.cells = rooms, cells
        self.deferred, self.faults, self.peers = deferred, faults, peers
        self.restarts = restarts  # restarts left, None without `Config.restarts` (the state has no 7th part)
        self.halt: str | None = None
        self.violation: str | None = None
        self.detail = ""
        # With identities: serving the deferred queues stopped at a send that waits for bytes (the core's
        # `_head_waits`), so a new item queues behind it.
        self.waits = False

    @classmethod
    def of(cls, state: tuple) -> Draft:
        return cls([list(x) for x in state[0]], [list(x) for x in state[1]], state[2], state[3], state[5],
                   state[6] if len(state) > 6 else None)

    def copy(self) -> Draft:
        d = Draft([list(x) for x in self.rooms], [list(x) for x in self.cells], self.deferred, self.faults,
                  self.peers, self.restarts)
        d.halt, d.violation, d.detail, d.waits = self.halt, self.violation, self.detail, self.waits
        return d

    def flag(self, violation: str | None, detail: str = "") -> None:
        """Mark the step as breaking a transition check; the first one named stays."""
        if violation and self.violation is None:
            self.violation, self.detail = violation, detail


def receivers(ro: list) -> list:
    """The room's receivers as a mutable list (sorted again when the state is emitted)."""
    if type(ro[RCV]) is tuple:
        ro[RCV] = list(ro[RCV])
    return ro[RCV]


def chan_len(ch: int) -> int:
    return (ch > 0) + (ch >= 5) + (ch >= 25)


def chan_push(ch: int, notice: str) -> int:
    """The channel with `notice` appended at its tail; it never holds more than CHAN_CAP."""
    n = chan_len(ch)
    if n >= CHAN_CAP:
        raise AssertionError(f"model bug: a notice channel holds more than {CHAN_CAP}")
    return ch + NOTICE_CODE[notice] * 5 ** n


def chan_notices(ch: int) -> list[str]:
    out = []
    while ch:
        out.append(NOTICE_OF[ch % 5])
        ch //= 5
    return out


def told_after(told: str, notice: str) -> str:
    """What a receiver has been told after `notice`: outcomes are kept, a second one is TOLD_TWICE."""
    if notice not in CONCLUDED:
        return told
    return notice if told == TOLD_NONE else TOLD_TWICE


def extent(cells, s: int) -> Sequence[int]:
    """The cells of the extent whose first cell is s (one cell if s is not the first of several)."""
    n = cells[s][LEN]
    return room_cells(cells, s, n if n > 0 else 1)


def runs(cells: Sequence[int]) -> int:
    """How many runs of consecutive cells the ascending `cells` make: one for an extent in one run, more
    for a spanning one (`Config.pieces`)."""
    return 1 + sum(b != a + 1 for a, b in zip(cells, cells[1:]))


def room_cells(cells, s: int, z: int) -> Sequence[int]:
    """The `z` cells of an extent whose first cell is s: the run from s, or a spanning extent's cells."""
    if z > 1:
        tail = -1 - s
        rest = [c for c in range(s + 1, len(cells)) if cells[c][LEN] == tail]
        if rest:
            return [s, *rest]
    return range(s, s + z)


def first_of_each(rcv) -> list[tuple[int, tuple]]:
    """(index, receiver) for the first receiver of each distinct kind: receivers alike are one choice."""
    seen = set()
    out = []
    for k, x in enumerate(rcv):
        if x not in seen:
            seen.add(x)
            out.append((k, x))
    return out
