"""The receivers' withdraws and, with channels, the notices that reach them: three event families of the spec.

`Withdraws` is a part of `Events` (models/events.py): it builds successors through the rules it is given
(the region machine's step, the room's move, a receiver taking a notice, the release of settled regions,
the withdraw rule itself, which a variant may change) and hands each one to `emit`.
"""

from __future__ import annotations

from collections.abc import Callable

from .state import CHAN, CONCLUDED, NOTICE_OF, RCV, RS, WD, WD_NONE, WD_SEEN, WD_SENT, Draft, first_of_each, receivers


class Withdraws:
    """`withdraws`, `deliveries` and `seen`: room families, each `(state, i, out)`."""

    def __init__(self, channels: bool, emit: Callable[[list, Draft, tuple], None],
                 region_step: Callable[[str, str], str], move_room: Callable[[Draft, int, str], None],
                 withdraw: Callable[[Draft, int, int], None], deliver: Callable[[list, int, str], None],
                 release_settled: Callable[[list], None]) -> None:
        self.channels = channels
        self._emit, self._region_step, self._move_room = emit, region_step, move_room
        self._withdraw, self._deliver, self._release_settled = withdraw, deliver, release_settled

    def withdraws(self, state: tuple, i: int, out: list) -> None:
        """A receiver's request is aborted: it withdraws its region."""
        r = state[0][i]
        if self.channels:
            self._sent(state, i, out)
            return
        if not state[3] or r[RS] in CONCLUDED:
            return
        for k in sorted({k_ for k_, x in first_of_each(r[RCV]) if x[0] == "offered"}):
            d = Draft.of(state)
            d.faults -= 1
            self._withdraw(d, i, k)
            self._emit(out, d, ("withdraw", i, k))

    def _sent(self, state: tuple, i: int, out: list) -> None:
        """With channels: the receiver withdraws an offered region and tells the encoder, which hears it
        later (`seen`); an outcome may already be on its way (the two cross)."""
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

    def deliveries(self, state: tuple, i: int, out: list) -> None:
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

    def seen(self, state: tuple, i: int, out: list) -> None:
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
