"""The peers' events: a room's write deadline and each peer's contact and heartbeat outcomes (`Config.peers`).

`PeerEvents` is a part of `Events` (models/events.py): it moves peers, rooms and extents through the rules
it is given and hands each successor to `emit`. A receiver's frame that starts contact with its peer is
the room's frame event (`Events._frame` hands it over: `frame`).
"""

from __future__ import annotations

from collections.abc import Callable

from .state import CONCLUDED, EXTENTI, INFL, REG, RS, UNSURE, Draft


class PeerEvents:
    """`write_deadlines` (a room family, `(state, i, out)`), `connect_outcomes` and `probe_outcomes` (the
    encoder's, `(state, out)`), and `frame`, a receiver's frame for a live room while peers are modelled."""

    def __init__(self, config, emit: Callable[[list, Draft, tuple], None], move_room: Callable[[Draft, int, str], None],
                 move_peer: Callable[..., None], spread: Callable[[Draft, int], None],
                 offer: Callable[[list], None], add_receiver: Callable[[Draft, int], None]) -> None:
        self.N = config.receivers
        self.blocking_contact = config.variant == "blocking-contact"
        self.no_write_deadline = config.variant == "no-write-deadline"
        self._emit, self._move_room, self._move_peer, self._spread = emit, move_room, move_peer, spread
        self._offer, self._add_receiver = offer, add_receiver

    def frame(self, state: tuple, i: int, out: list) -> None:
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

    def write_deadlines(self, state: tuple, i: int, out: list) -> None:
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
        d.cells[r[EXTENTI]][UNSURE] = True
        self._spread(d, r[EXTENTI])
        for k in range(self.N):
            self._move_peer(d, k, "write_overdue")
        self._move_room(d, i, "fail")
        self._emit(out, d, ("write_deadline", i))

    def probe_outcomes(self, state: tuple, out: list) -> None:
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

    def connect_outcomes(self, state: tuple, out: list) -> None:
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
