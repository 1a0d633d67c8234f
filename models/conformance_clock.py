"""Time in the conformance harness: the `Timing` part, which fires deadlines through the clock.

Deadlines fire through the clock and `poll()`. The spec fires them in any order, the clock in the order
of their due times, so the harness picks each deadline's duration when it is armed (through the
settings: a kind's timeout before each event): one its plan fires at event f is due at STEP * (f + 1),
one it does not fire is due FAR away; other events take at most a second each. Each kind adds its own
OFFSET, so a deadline armed from another kind's setting shows (`check_full_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

STEP, FAR = 1000.0, 1e6
OFFSET = {"park": 101.0, "announce": 103.0, "write": 107.0, "quarantine": 109.0, "connect": 113.0,
          "probe": 131.0}
# A probe's contact is armed and left unanswered within one event: its connect deadline this soon after.
PROBE_CONTACT = 10.0


def fires(event: tuple) -> tuple[tuple[str, int], ...]:
    """The deadlines (as `Timing.deadline_key`s) a spec event fires."""
    name = event[0]
    if name == "expire":
        return (("room", event[1]),)
    if name == "write_deadline":
        return (("write", event[1]),)
    if name == "release":
        return (("extent", event[1]),)
    if name == "connect_expired":
        return (("connect", event[1]),)
    if name in ("probe_refused", "probe_expired"):
        return (("probe", event[1]),)
    return ()


class NotByClock(Exception):
    """A deadline an event fires is not the clock's next, even with the event in the harness's plan (one
    event armed two deadlines of a kind, which the plan fires at different events: one timeout each
    kind per event cannot tell them apart)."""



class Timing:
    """The core's pending deadlines, the timeouts that make each one the harness's plan fires due when the
    plan fires it, and the clock: `plan` (the events this harness will take) and `arms` (the deadlines
    each of the first of them arms), as `Harness` takes them."""

    def __init__(self, peers: bool, manager: Any, clock: Any, pump: Any, cell: Callable[[Any], int],
                 room_base: int, plan: list, arms: list) -> None:
        self.peers, self.manager, self.clock, self.pump, self.cell = peers, manager, clock, pump, cell
        self.room_base = room_base
        self.plan, self.arms = plan, arms
        self.fired = {"clock": 0}  # deadline events fired, all through the clock and `poll()`
        # (what, id, kind) -> when it is due: the time of the event that armed it plus the timeout then set
        self.armed: dict[tuple, float] = {}

    def record(self, extents: Iterable[Any], receivers: int) -> None:
        """After an event: when each deadline the core has armed is due (`check_full_state` compares them);
        `extents`, the ring's, give the quarantines (by each extent's first cell)."""
        now = self.clock.now()
        m = self.manager
        for rid, room in m.rooms.items():
            if room.timer:
                timeout = m.park_timeout if room.state == "parked" else m.announce_timeout
                self.armed.setdefault(("room", rid, room.state), now + timeout)
        quarantined = {self.cell(e) for e in extents if e.state == "quarantined"}
        for c in quarantined:
            self.armed.setdefault(("extent", c, "quarantine"), now + m.quarantine_s)
        for key in [k for k in self.armed if k[0] == "extent" and k[1] not in quarantined]:
            del self.armed[key]
        for h in m.writes.by_handle:
            self.armed.setdefault(("write", h, ""), now + m.write_timeout)
        # a peer's contact and heartbeat are re-armed as they go: each arming is its own (by its timer's id)
        for k in range(receivers) if self.peers else ():
            peer = m.peers.get(f"p.{k}")
            if peer is not None and peer.timer:
                self.armed.setdefault(("connect", k, peer.timer), now + m.peers.connect_timeout)
            if peer is not None and peer.beat.timer:
                self.armed.setdefault(("probe", k, peer.beat.timer), now + m.peers.probe_interval)

    def pending(self) -> list[tuple[float, str, Any]]:
        """Every deadline the core has armed (rooms, writes, quarantines, connects, heartbeats), earliest first."""
        out = self.manager.deadlines.pending()
        if self.peers:
            out = sorted(out + self.manager.peers.beats.pending(), key=lambda e: e[0])
        return out

    def deadline_key(self, kind: str, obj: Any) -> tuple[str, int]:
        """A pending deadline as the spec's event names what it fires: a room's, a room's writes', an
        extent's (by its first cell), a peer's contact or heartbeat (by its receivers' rank)."""
        if kind in ("announce", "park"):
            return ("room", obj.id - self.room_base)
        if kind == "write":
            return ("write", obj.room - self.room_base)
        if kind == "quarantine":
            return ("extent", self.cell(obj))
        peer = obj.peer if kind == "probe" else obj
        return (kind, int(peer.session.rsplit(".", 1)[1]))

    def armed_now(self) -> set[tuple]:
        """Pending deadlines as (kind, key, due)."""
        return {(kind, self.deadline_key(kind, obj), when) for when, kind, obj in self.pending()}

    def _fired_at(self, key: tuple, j: int) -> int | None:
        """The plan's event that fires the deadline `key` armed at event j (None: none, or it is armed again first)."""
        for f in range(j + 1, len(self.plan)):
            if key in fires(self.plan[f]):
                return f
            if f < len(self.arms) and any(k == key for _, k in self.arms[f]):
                return None
        return None

    def set_timeouts(self, j: int) -> None:
        """Before the j-th event: each kind's timeout, so that a deadline it arms is due when the plan fires it."""
        ev = self.plan[j] if j < len(self.plan) else None
        # what an event that fires a deadline arms, it arms once the clock reached that deadline
        now = (self.fire_time(ev) if ev is not None else None) or self.clock.now()
        want: dict[str, set] = {}
        for kind, key in self.arms[j] if j < len(self.arms) else ():
            want.setdefault(kind, set()).add(self._fired_at(key, j))
        due = {}
        for kind in OFFSET:
            targets = want.get(kind, set())
            f = next(iter(targets)) if len(targets) == 1 else None  # several, each its own: none can be exact
            due[kind] = STEP * (f + 1) + OFFSET[kind] - now if f is not None else 0.0
            if due[kind] <= 0:  # not foreseen (or past already: no plan has that many events)
                due[kind] = FAR + OFFSET[kind]
        if ev is not None and ev[0] == "probe_expired":
            due["connect"] = PROBE_CONTACT + OFFSET["connect"] / 1000
        m = self.manager
        m.park_timeout, m.announce_timeout = due["park"], due["announce"]
        m.write_timeout, m.quarantine_s = due["write"], due["quarantine"]
        m.peers.connect_timeout, m.peers.probe_interval = due["connect"], due["probe"]

    def pass_time(self) -> None:
        """Move the clock on before an event: a second, or less so that no pending deadline comes due
        (after a deadline fired the next may be a second away; each event then takes a slice of the gap)."""
        now = self.clock.now()
        pending = self.pending()
        self.clock.advance(min(1.0, (pending[0][0] - now) / 64) if pending else 1.0)

    def fire(self, objs: list) -> None:
        """Fire the deadlines of `objs` (one spec event) through the clock and the pump's tick (which polls):
        they are the next due, with nothing else due by then (`step` saw to it, see `_replan`)."""
        pending = self.pending()
        mine = [when for when, _, obj in pending if any(obj is o for o in objs)]
        if not objs or len(mine) != len(objs):
            raise AssertionError(f"the core has no pending deadline for {objs}")
        when = max(mine)
        if not all(any(obj is o for o in objs) for w, _, obj in pending if w <= when):
            raise NotByClock(f"{[o for w, _, o in pending if w <= when]} are due by {when}, not only {objs}")
        self.clock.advance(when - self.clock.now())
        self.pump.tick()
        self.fired["clock"] += 1

    def fire_time(self, event: tuple) -> float | None:
        """When the clock fires the deadlines `event` fires: the latest of them, if they are pending and nothing
        else is due by then; else None."""
        keys = fires(event)
        if not keys:
            return None
        pending = [(key, when) for _, key, when in self.armed_now()]
        mine = [when for key, when in pending if key in keys]
        if mine and all(key in keys for key, when in pending if when <= max(mine)):
            return max(mine)
        return None
