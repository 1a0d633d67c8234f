"""In-process loopback transport: the embedded default, and the fault injector.

Writes copy bytes between registered regions of this process, checked the way a
one-sided engine checks them (source and destination must lie inside registered
regions, a dead receiver fails the write). Faults can be scripted per session
or chosen by a policy: fail, delay, time out (and never land), time out and
land later (the Mooncake hazard: bytes are read from the source when they land,
not when the write was submitted), and hold until completed by hand. First contact with a peer can be made to
hang (answered by hand, or never), be refused, or answer late; a receiver can
die and recover.
"""

from __future__ import annotations

import bisect
import ctypes
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .clock import Clock, FakeClock
from .transport import Buf, Outcome, Transport, TransportError

_OUTCOMES = frozenset(("success", "failed"))
FAULT_KINDS = ("fail", "delay", "timeout", "timeout_land_later", "hold")
# Faults of first contact with a peer: never answers (a host that accepts TCP and
# sleeps), answers "refused" (after `delay`), answers "ok" only after `delay`.
CONTACT_FAULTS = ("hang", "refuse", "slow")


@dataclass
class Fault:
    kind: str
    delay: float = 0.0  # when the outcome is reported (fail, delay, timeout*)
    land_after: float = 0.0  # timeout_land_later: when the bytes land

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; expected one of {FAULT_KINDS}")


@dataclass
class _Rule:
    fault: Fault
    session: str | None
    remaining: int


@dataclass
class _ContactRule:
    kind: str
    delay: float
    session: str | None
    remaining: int


class Regions:
    """Sorted, non-overlapping (start, end) ranges, as a registering engine keeps them."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._owners: list[Any] = []

    def add(self, ptr: int, length: int, owner: Any = None) -> None:
        if length <= 0:
            raise TransportError(f"cannot register {length} bytes at {ptr:#x}")
        i = bisect.bisect_right(self._starts, ptr)
        if (i > 0 and self._ends[i - 1] > ptr) or (i < len(self._starts) and self._starts[i] < ptr + length):
            raise TransportError(f"region {ptr:#x}+{length} overlaps a registered region")
        self._starts.insert(i, ptr)
        self._ends.insert(i, ptr + length)
        self._owners.insert(i, owner)

    def remove_owner(self, owner: Any) -> int:
        keep = [i for i, o in enumerate(self._owners) if o is not owner]
        removed = len(self._owners) - len(keep)
        self._starts = [self._starts[i] for i in keep]
        self._ends = [self._ends[i] for i in keep]
        self._owners = [self._owners[i] for i in keep]
        return removed

    def covers(self, ptr: int, length: int) -> bool:
        i = bisect.bisect_right(self._starts, ptr) - 1
        return i >= 0 and ptr + length <= self._ends[i]

    def __len__(self) -> int:
        return len(self._starts)


@dataclass
class Notice:
    room: int
    status: str
    reason: str
    time: float


@dataclass
class LoopbackReceiver:
    """A prefill receiver living in this process: its buffers, the statuses it was told, and the
    writes addressed to it."""

    session: str
    regions: Regions = field(default_factory=Regions)
    alive: bool = True
    notices: list[Notice] = field(default_factory=list)
    # Kept only where the transport was made with `record=True` (the model's lockstep harness: a
    # short run), so a long one does not grow them. Each write addressed to it, when submitted:
    # (handle, first destination byte, bytes).
    submitted: list[tuple[int, int, int]] = field(default_factory=list)
    # Each write whose bytes landed: (handle, how many notices it had got by then), so bytes that
    # landed before an outcome notice tell apart from bytes that landed after it.
    landed: list[tuple[int, int]] = field(default_factory=list)

    def register(self, tensor_or_ptr: Any, length: int | None = None) -> int:
        if length is None:
            t = tensor_or_ptr
            ptr, length = int(t.data_ptr()), t.numel() * t.element_size()
            self.regions.add(ptr, length, owner=t)
        else:
            ptr = int(tensor_or_ptr)
            self.regions.add(ptr, length)
        return ptr

    def statuses(self, room: int) -> list[str]:
        """The outcomes (success, failed) this receiver was told for `room`, in order."""
        return [n.status for n in self.notices if n.room == room and n.status in _OUTCOMES]

    def releases(self, room: int) -> list[str]:
        """The release notices and withdraw acks it got for `room`, in order."""
        return [n.status for n in self.notices if n.room == room and n.status not in _OUTCOMES]

    def kill(self) -> None:
        self.alive = False

    def revive(self) -> None:
        """The peer recovers: writes land and contact succeeds again."""
        self.alive = True


class LoopbackTransport(Transport):
    def __init__(self, clock: Clock | None = None, record: bool = False):
        self.clock = clock or FakeClock()
        self.record = record  # each receiver keeps the writes addressed to it and what landed
        self.local = Regions()
        self.receivers: dict[str, LoopbackReceiver] = {}
        self.policy: Callable[[str, Sequence[Buf]], Fault | None] | None = None
        self._rules: list[_Rule] = []
        self._ids = itertools.count(1)
        self._ready: list[tuple[int, Outcome]] = []
        # (due time, order, handle, outcome or None for a landing only, bufs to copy or None)
        self._timed: list[tuple[float, int, int, Outcome | None, Any]] = []
        self._held: dict[int, tuple[str, Sequence[Buf]]] = {}
        self._ghosts: dict[int, tuple[str, Sequence[Buf]]] = {}
        self._order = itertools.count()
        self._contact_rules: list[_ContactRule] = []
        self._reports: list[tuple[str, int, bool, str]] = []
        # (due time, order, session, attempt, ok) for contacts answered later
        self._contacts: list[tuple[float, int, str, int, bool]] = []
        self.hung: dict[str, int] = {}  # session -> attempt of a contact that never answers
        self.contacts = 0
        self.probes = 0  # of those, heartbeats (`probe=True`)
        # Sessions whose contact answered ok. A write to any other session is where a real
        # engine would open the segment itself, inside the submit call: counted, never waited on.
        self.reached: set[str] = set()
        self.unreached_writes = 0
        self.submitted = 0
        self.closed = False
        self.bytes_landed = 0
        self.late_landings = 0

    # set-up -------------------------------------------------------------
    def register_memory(self, regions: Sequence[tuple[int, int]], owner: Any = None) -> None:
        for ptr, length in regions:
            self.local.add(ptr, length, owner)

    def unregister_memory(self, owner: Any) -> None:
        self.local.remove_owner(owner)

    def close(self) -> None:
        self.closed = True

    def add_receiver(self, session: str) -> LoopbackReceiver:
        if session in self.receivers:
            raise ValueError(f"receiver session {session!r} already exists")
        r = LoopbackReceiver(session)
        self.receivers[session] = r
        return r

    def inject(self, kind: str, *, session: str | None = None, count: int = 1,
               delay: float = 0.0, land_after: float = 0.0) -> None:
        """Apply a fault to the next `count` writes (to `session`, or to any)."""
        self._rules.append(_Rule(Fault(kind, delay, land_after), session, count))

    def inject_contact(self, kind: str, *, session: str | None = None, count: int = 1,
                       delay: float = 0.0) -> None:
        """Apply a contact fault to the next `count` contacts (with `session`, or with any)."""
        if kind not in CONTACT_FAULTS:
            raise ValueError(f"unknown contact fault {kind!r}; expected one of {CONTACT_FAULTS}")
        self._contact_rules.append(_ContactRule(kind, delay, session, count))

    # peers ----------------------------------------------------------------
    def connect(self, session: str, attempt: int, identity: str = "", probe: bool = False) -> bool | None:
        """Contact answers at once unless a contact fault applies: refused if the receiver is dead.

        A session with no receiver here is not refused: its writes fail, as before peers existed.
        """
        self.contacts += 1
        self.probes += probe
        r = self.receivers.get(session)
        alive = r is None or r.alive
        rule = None
        for x in self._contact_rules:
            if x.session is None or x.session == session:
                rule = x
                x.remaining -= 1
                if x.remaining <= 0:
                    self._contact_rules.remove(x)
                break
        if rule is None:
            if alive:
                self.reached.add(session)
            return alive
        kind, delay = rule.kind, rule.delay
        if kind == "hang":
            self.hung[session] = attempt
            return None
        ok = alive if kind == "slow" else False
        if delay <= 0:
            if ok:
                self.reached.add(session)
            return ok
        heapq.heappush(self._contacts, (self.clock.now() + delay, next(self._order), session, attempt, ok))
        return None

    def answer(self, session: str, ok: bool | None = None) -> bool:
        """A hung contact answers after all (ok defaults to the receiver's liveness)."""
        attempt = self.hung.pop(session, None)
        if attempt is None:
            return False
        if ok is None:
            r = self.receivers.get(session)
            ok = r is not None and r.alive
        if ok:
            self.reached.add(session)
        self._reports.append((session, attempt, ok, "" if ok else "refused"))
        return True

    def peer_reports(self) -> list[tuple[str, int, bool, str]]:
        if self._contacts:
            now = self.clock.now()
            while self._contacts and self._contacts[0][0] <= now:
                _, _, session, attempt, ok = heapq.heappop(self._contacts)
                if ok:
                    self.reached.add(session)
                self._reports.append((session, attempt, ok, "" if ok else "refused"))
        if not self._reports:
            return []
        out, self._reports = self._reports, []
        return out

    # data path ----------------------------------------------------------
    def _fault_for(self, session: str, bufs: Sequence[Buf]) -> Fault | None:
        for rule in self._rules:
            if rule.session is None or rule.session == session:
                rule.remaining -= 1
                if rule.remaining <= 0:
                    self._rules.remove(rule)
                return rule.fault
        return self.policy(session, bufs) if self.policy else None

    def _valid(self, session: str, bufs: Sequence[Buf]) -> bool:
        r = self.receivers.get(session)
        if r is None or not r.alive:
            return False
        local, remote = self.local, r.regions
        for s, d, n in bufs:  # `covers` of both sides, written out: every write's path
            if n:
                i = bisect.bisect_right(local._starts, s) - 1
                if i < 0 or s + n > local._ends[i]:
                    return False
                i = bisect.bisect_right(remote._starts, d) - 1
                if i < 0 or d + n > remote._ends[i]:
                    return False
        return True

    def _land(self, handle: int, session: str, bufs: Sequence[Buf]) -> bool:
        if not self._valid(session, bufs):
            return False
        for src, dst, n in bufs:
            if n:
                ctypes.memmove(dst, src, n)
                self.bytes_landed += n
        if self.record:
            r = self.receivers[session]
            r.landed.append((handle, len(r.notices)))
        return True

    def _later(self, when: float, handle: int, outcome: Outcome | None, land: Any) -> None:
        heapq.heappush(self._timed, (when, next(self._order), handle, outcome, land))

    def submit_write(self, session: str, bufs: Sequence[Buf]) -> int:
        if self.closed:
            raise TransportError("transport is closed")
        handle = next(self._ids)
        self.submitted += 1
        if session not in self.reached:
            self.unreached_writes += 1
        if self.record:
            r = self.receivers.get(session)
            if r is not None and bufs:
                r.submitted.append((handle, bufs[0][1], sum(n for _, _, n in bufs)))
        fault = self._fault_for(session, bufs) if (self._rules or self.policy) else None
        if fault is None:
            ok = self._land(handle, session, bufs)
            self._ready.append((handle, Outcome.DONE if ok else Outcome.FAILED))
            return handle
        now = self.clock.now()
        kind = fault.kind
        if kind == "fail":
            self._later(now + fault.delay, handle, Outcome.FAILED, None)
        elif kind == "delay":
            self._later(now + fault.delay, handle, Outcome.DONE, (session, tuple(bufs)))
        elif kind == "timeout":
            self._later(now + fault.delay, handle, Outcome.TIMED_OUT, None)
        elif kind == "timeout_land_later":
            self._later(now + fault.delay, handle, Outcome.TIMED_OUT, None)
            self._later(now + fault.land_after, handle, None, (session, tuple(bufs)))
        else:  # hold
            self._held[handle] = (session, tuple(bufs))
        return handle

    def complete(self, handle: int, outcome: Outcome = Outcome.DONE, land: bool | None = None,
                 land_later: bool = False) -> None:
        """Finish a held write by hand; by default its bytes land only when DONE.

        With `land_later`, a write reported FAILED or TIMED_OUT keeps its bytes
        pending until `land_ghost(handle)`, as a Mooncake write that returned -1
        and still landed.
        """
        session, bufs = self._held.pop(handle)
        if land is None:
            land = outcome is Outcome.DONE
        landed = self._land(handle, session, bufs) if land else False
        if outcome is Outcome.DONE and not landed:
            outcome = Outcome.FAILED
        if land_later and outcome is not Outcome.DONE:
            self._ghosts[handle] = (session, bufs)
        self._ready.append((handle, outcome))

    def land_ghost(self, handle: int) -> bool:
        """Land the bytes of a write that already reported failure; True if they landed."""
        landed = self._land(handle, *self._ghosts.pop(handle))
        self.late_landings += landed
        return landed

    @property
    def ghosts(self) -> list[int]:
        return list(self._ghosts)

    def session_of(self, handle: int) -> str | None:
        """The session a held or ghost write is addressed to (None if it is neither)."""
        entry = self._held.get(handle) or self._ghosts.get(handle)
        return entry[0] if entry is not None else None

    def forget_ghost(self, handle: int) -> bool:
        """Drop a ghost write without landing it (a driver assumes it gone past its quarantine)."""
        return self._ghosts.pop(handle, None) is not None

    @property
    def held(self) -> list[int]:
        return list(self._held)

    @property
    def in_flight(self) -> int:
        return len(self._held) + len(self._timed)

    def poll(self) -> list[tuple[int, Outcome]]:
        if self._timed:
            now = self.clock.now()
            while self._timed and self._timed[0][0] <= now:
                _, _, handle, outcome, land = heapq.heappop(self._timed)
                if land is not None:
                    landed = self._land(handle, *land)
                    if outcome is None:
                        self.late_landings += landed
                    elif outcome is Outcome.DONE and not landed:
                        outcome = Outcome.FAILED
                if outcome is not None:
                    self._ready.append((handle, outcome))
        out, self._ready = self._ready, []
        return out

    # control path -------------------------------------------------------
    def notify(self, frame: Any, room: int, status: str, reason: str = "") -> None:
        r = self.receivers.get(frame.session)
        if r is not None and r.alive:
            r.notices.append(Notice(room, status, reason, self.clock.now()))
