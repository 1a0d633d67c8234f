"""The seed's rules, where they differ from the project's: the `seed` variant of the spec.

The seed has no extent machine (an extent is reusable when its tenant room is
concluded and its chunk not parked; here, over an arena of cells, a range is
reusable as soon as the rooms whose bytes it holds are, so a new extent may
overlap one a write may still read), no release protocol for regions, no
announce deadline and no peers; a partial registration re-arms the park
deadline, expiry tells nobody, a failed write frees its extent at once. Each
override below is one of those rules; everything else is the project's.
"""

from __future__ import annotations

from typing import ClassVar

from .ring import Ring
from .spec import Config, Spec
from .state import CH, CH_HELD, CONTENT, EXTENTI, INFL, REG, RS, SS, UNSURE, W_IDLE, Draft, receivers, told_after


class SeedRing(Ring):
    """The seed's leasing: a cell is reusable once the room whose bytes it holds concluded, its chunk not parked."""

    def leasable(self, rooms, cells) -> list[bool]:
        out = []
        for sl in cells:
            t = sl[CONTENT]
            out.append(t < 0 or (rooms[t][RS] in ("success", "failed") and rooms[t][CH] != CH_HELD))
        return out


class SeedSpec(Spec, variant="seed"):
    """`Spec(Config(variant="seed"))`: the project's spec with the seed's rules where they differ."""

    UNARMED = frozenset(("arm_announce_deadline",))
    LANDED = W_IDLE  # it waits out no quarantine: a landed write is simply gone
    RING = SeedRing
    # Each extent move sets the state it names, from whatever state the extent is in.
    EXTENT_MOVES: ClassVar[dict[str, str]] = {"lease": "copying", "copied": "staged", "park": "parked",
                                            "send": "sending", "abandon": "free"}
    # Its receiver frees a region on Failed.
    NOTICES: ClassVar[dict[str, str]] = {"success": "written", "failed": "released"}

    def __init__(self, config: Config):
        super().__init__(config)
        self.peers = False

    def _extent_step(self, extent: list, event: str, pending: bool = False) -> None:
        extent[SS] = self.EXTENT_MOVES[event]
        if event == "lease":
            extent[UNSURE] = False

    def _notice(self, ro: list, k: int, notice: str) -> None:
        rc = receivers(ro)
        rc[k] = (self.NOTICES[notice], rc[k][1], told_after(rc[k][2], notice))

    def _release_settled(self, ro: list) -> None:
        """No release protocol: nothing waits for the writes to settle."""

    def _abandon_extent(self, d: Draft, i: int, cause: str) -> None:
        # A room failed by the loop keeps its parked chunk: the seed's reaper pops it later.
        if cause != "fail":
            super()._abandon_extent(d, i, cause)

    def _conclude(self, d: Draft, i: int, cause: str) -> None:
        # No Failed on expiry: its receivers are never told.
        if cause != "expire":
            super()._conclude(d, i, cause)

    def _add_receiver(self, d: Draft, i: int) -> None:
        super()._add_receiver(d, i)
        if d.rooms[i][RS] == "parked":  # a partial registration re-arms the park deadline
            d.flag("deadline-extended")

    def _late_receiver(self, d: Draft, i: int) -> None:
        # No Failed for late receivers; the last one of a failed room flushes its parked chunk, and it is sent.
        ro = d.rooms[i]
        if ro[RS] == "failed" and ro[CH] == CH_HELD and ro[REG] >= self.N:
            self._issue_writes(d, i)

    def _settle(self, d: Draft, i: int, unsure: bool) -> None:
        ro = d.rooms[i]
        if unsure or not ro[INFL]:
            d.cells[ro[EXTENTI]][SS] = "free"  # a failed write frees the extent at once
        self._spread(d, ro[EXTENTI])

    def _deadlines(self, state: tuple, i: int, out: list) -> None:
        r = state[0][i]
        if r[RS] == "failed" and r[CH] == CH_HELD:
            # its reaper pops a parked chunk of a room already failed
            d = Draft.of(state)
            self._drop_chunk(d, i)
            self._emit(out, d, ("expire", i))
        super()._deadlines(state, i, out)

    def _withdraw(self, d: Draft, i: int, k: int) -> None:
        # No withdraw message: its receiver frees the region, the encoder never hears.
        rc = receivers(d.rooms[i])
        rc[k] = ("released", *rc[k][1:])
