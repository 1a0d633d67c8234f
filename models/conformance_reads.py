"""The implementation read back as spec states: the conformance harness's `Readback` part.

`Readback` reads the real executor, manager and loopback transport a `conformance.Harness` drives, and
what the receivers did that the core does not keep (which withdrew, and when), into the spec's terms:
rooms, cells, the deferred queue, writes in flight and each receiver's region (stepped through the
region machine on every notice that receiver got, so a second outcome fails at once).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from epd_ring.fsm import REGION, InvalidTransition
from epd_ring.fsm.regions import NOTICE_EVENTS

from .spec import (
    CH_COPYING,
    CH_DEFERRED,
    CH_DROPPED,
    CH_HELD,
    CH_NONE,
    CH_SENT,
    EXTENTI,
    W_FLIGHT,
    W_GHOST,
    W_IDLE,
    W_LANDED,
    Config,
)
from .state import TOLD_NONE, runs, told_after


class Readback:
    """Reads the implementation back; the harness names rooms and sessions (`room`, `rid`, `session`)."""

    def __init__(self, config: Config, executor: Any, manager: Any, transport: Any, buffers: dict,
                 size: tuple[int, ...], owner: tuple, cell_bytes: int, room_base: int,
                 room: Callable[[int], int], rid: Callable[[int], str], session: Callable[[int, int], str]) -> None:
        self.cfg, self.executor, self.manager, self.transport = config, executor, manager, transport
        self.buffers, self.size, self.owner = buffers, size, owner
        self.cell_bytes, self.room_base = cell_bytes, room_base
        self.room, self.rid, self.session = room, rid, session
        self.withdrawn: set[tuple[int, str]] = set()  # (room, session) that withdrew (the receiver's own move)
        self._withdrawn_at: dict[tuple[int, str], int] = {}  # how many notices it had got when it withdrew

    def withdrew(self, i: int, session: str) -> None:
        """The session's receiver withdrew its region of room i (now: after the notices it got so far)."""
        self._withdrawn_at[(i, session)] = len([n for n in self.transport.receivers[session].notices
                                                if n.room == self.room(i)])
        self.withdrawn.add((i, session))

    def cell(self, extent: Any) -> int:
        """The model's cell an extent starts at (a spanning extent's: its lowest)."""
        return min(self.span(extent))

    def span(self, extent: Any) -> list[int]:
        """The model's cells an extent covers, in order (a spanning extent's, from each of its pieces)."""
        size = self.cell_bytes
        return [c for offset, nbytes in getattr(extent, "pieces", ()) or ((extent.offset, extent.nbytes),)
                for c in range(offset // size, offset // size + max(1, -(-nbytes // size)))]

    def _length(self, s: Any, i: int) -> int:
        """The spec's LEN of cell i, covered by extent (or free stand-in) s: its length at its first cell, 0 on
        its other cells, or there -1 - its first cell when it spans runs of cells (models/state.py)."""
        cells = self.span(s)
        first = min(cells)
        if s.state == "free" or first == i:
            return len(cells)
        return -1 - first if runs(sorted(cells)) > 1 else 0

    def cells(self) -> list[Any]:
        """The ring as the model's cells: the live extent covering each cell, or a free stand-in."""
        out: list[Any] = [SimpleNamespace(state="free", room=None, unsure=False,
                                          offset=i * self.cell_bytes, nbytes=self.cell_bytes)
                          for i in range(self.cfg.cells)]
        for e in self.executor.ring.extents.values():
            for c in self.span(e):
                out[c] = e
        return out

    def reasons(self) -> tuple[str, ...]:
        """The reason kind each failed room's tombstone keeps, read from the core ("" for a room not failed)."""
        out = []
        for i in range(self.cfg.rooms):
            reason = self.manager.failure_reason(self.room(i))
            out.append(reason.kind.value if reason is not None else "")
        return tuple(out)


    def told(self, i: int, session: str) -> str:
        """The outcome the session's receiver was told for room i, as the spec keeps it (state.told_after)."""
        told = TOLD_NONE
        for status in self.transport.receivers[session].statuses(self.room(i)):
            told = told_after(told, status)
        return told

    def region(self, i: int, session: str) -> str:
        """The session's region, stepped through the region machine on every notice it got."""
        r = SimpleNamespace(state=REGION.initial)
        steps = [("withdraw" if n.status == "withdraw" else NOTICE_EVENTS[n.status])
                 for n in self.transport.receivers[session].notices if n.room == self.room(i)]
        if (i, session) in self.withdrawn:
            steps.insert(self._withdrawn_at[(i, session)], "withdraw")
        for e in steps:
            try:
                REGION.step(r, e)
            except InvalidTransition as exc:
                raise AssertionError(f"receiver {session} of room {i}: {exc}") from None
        return r.state

    def registered_sessions(self, i: int) -> list[str]:
        """The sessions whose frame room i took, read from the core: the live room's frames, else its
        tombstone's; a frame for a concluded room is answered at once, so its receiver's notices show it."""
        rid, m = self.room(i), self.manager
        room = m.rooms.get(rid)
        tomb = m.tombstone(rid) if room is None else None
        got = set(room.frames) if room is not None else set(tomb.sessions) if tomb is not None else set()
        got |= {s for s, r in self.transport.receivers.items() if any(n.room == rid for n in r.notices)}
        return sorted(got)

    def sender(self, i: int) -> tuple[int, bool]:
        """Room i's sender as the spec keeps it (none, registered, reaped), and whether its item was taken
        (the tower ran on it, or it came from the cache): the executor's sender while it has one, then
        the manager's record of the room, which keeps that one came (a sender is reaped only after its
        item was taken)."""
        sender = self.executor.senders.get(self.rid(i))
        if sender is not None:
            return 1, sender.offered
        return (2, True) if self.manager.has_sender(self.room(i)) else (0, False)

    def _writes_into(self, i: int, k: int) -> set[int]:
        """Handles of the writes the transport was asked to make into room i's k-th receive buffer."""
        buf = self.buffers[(i, k)]
        lo = buf.data_ptr()
        hi = lo + buf.numel() * buf.element_size()
        return {h for h, ptr, _ in self.transport.receivers[self.session(i, k)].submitted if lo <= ptr < hi}

    def sent(self, i: int) -> bool:
        """Whether room i's chunk was written (its writes were submitted), as its receivers' side shows."""
        return any(self._writes_into(i, k) for k in range(self.cfg.receivers))

    def written(self, i: int) -> int:
        """Receivers of room i whose bytes landed before they were told the room's outcome: the writes
        that reported done while the room was transferring (a write done later, or one that lands after
        reporting unsure, lands after the outcome notice)."""
        n = 0
        for k in range(self.cfg.receivers):
            rcv = self.transport.receivers[self.session(i, k)]
            mine = self._writes_into(i, k)
            told = next((j for j, x in enumerate(rcv.notices)
                         if x.room == self.room(i) and x.status in ("success", "failed")), len(rcv.notices))
            n += any(h in mine and seen <= told for h, seen in rcv.landed)
        return n

    def write_state(self, i: int, session: str) -> int:
        """Where the write into the session's region is, read from the manager and the transport."""
        rid = self.room(i)
        if any(w.room == rid and w.frame.session == session for w in self.manager.writes.by_handle.values()):
            return W_FLIGHT
        t = self.transport
        k = next(k for k in range(self.cfg.receivers) if self.session(i, k) == session)
        if set(t.ghosts) & self._writes_into(i, k):  # reported failed or timed out, and may still land
            return W_GHOST
        if self.manager.regions.is_open(rid, session):
            return W_LANDED  # reported unsure, landed or not: the encoder waits out the quarantine
        return W_IDLE

    def abstract(self, faults: int) -> tuple:
        ex, m = self.executor, self.manager
        deferred = tuple(int(rid[1:]) for rid in ex.deferred_requests())
        cells = self.cells()
        extent_of = {s.room - self.room_base: s for s in cells if s.room is not None}
        infl = [0] * self.cfg.rooms
        for w in m.writes.values():
            infl[w.room - self.room_base] += 1
        rooms = []
        for i in range(self.cfg.rooms):
            rid = self.room(i)
            rs = m.room_status(rid) or "new"
            snd, taken = self.sender(i)
            ok = self.written(i)
            extent = extent_of.get(i)
            if not taken:
                ch = CH_NONE
            elif i in deferred:
                ch = CH_DEFERRED
            elif extent is not None and extent.state == "copying":
                ch = CH_COPYING
            elif extent is not None and extent.state in ("staged", "parked"):
                ch = CH_HELD
            elif self.sent(i):
                ch = CH_SENT
            else:
                ch = CH_DROPPED
            told = sum(1 for k in range(self.cfg.receivers)
                       if self.transport.receivers[self.session(i, k)].statuses(rid))
            # A quarantined extent still names its last room; the spec lets go once nothing may read it.
            sessions = self.registered_sessions(i)
            rcv = tuple(sorted((self.region(i, s), self.write_state(i, s), self.told(i, s)) for s in sessions))
            uses = extent is not None and (ch != CH_SENT or any(x[1] != W_IDLE for x in rcv))
            ghosts = sum(1 for x in rcv if x[1] == W_GHOST)
            live = m.rooms.get(rid)
            if live is not None and rs == "transferring" and live.chunk is None:  # not waiting for a peer
                # the manager's count and the receivers' bytes agree
                assert self.cfg.receivers - live.writes_left == ok, f"room {i}: writes left {live.writes_left}"
            size = self.size[i] if uses or ch == CH_DEFERRED else 0  # the spec keeps a size while it matters
            owner = () if self.owner[i] is None else (self.owner[i],)
            rooms.append((rs, snd, ch, len(sessions), told, ok, infl[i], ghosts, rcv, size,
                          self.cell(extent) if uses else -1, *owner))
        # the spec forgets the bytes of cells no room's extent covers (with identities a busy one keeps whose
        # identity it is charged to, as `-2 - owner`: models/shares.py)
        used = {c for i, r in enumerate(rooms) if r[EXTENTI] >= 0 for c in self.span(extent_of[i])}
        extents = tuple((s.state, s.room - self.room_base if i in used else self._charged(s), s.unsure,
                       self._length(s, i))
                      for i, s in enumerate(cells))
        peers = ()
        if self.cfg.peers:
            peers = tuple(getattr(m.peers.get(f"p.{k}"), "state", "unknown") for k in range(self.cfg.receivers))
        # the fault budget is the spec's alone: the implementation has none, so it is the harness's count
        return (tuple(rooms), extents, deferred, faults, None, peers)

    def _charged(self, extent: Any) -> int:
        """A cell no room covers: -1, or with identities, while its extent is busy, `-2 - ` the identity the
        core charges it to (its share, read back as the spec's owner)."""
        if self.owner[0] is None or extent.state == "free" or extent.share is None:
            return -1
        return -2 - int(extent.share.identity.removeprefix("id"))
