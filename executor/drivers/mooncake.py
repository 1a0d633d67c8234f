"""A transport over Mooncake's TransferEngine (TCP here, RDMA in production).

One engine per encode worker. Ring slots are registered once, in one
`batch_register_memory` call; a registration failure raises at start-up.
Writes go out with `transfer_submit_write` (one per buffer: main rows, and
deepstack rows when present) and are polled with `transfer_check_status`
from the controller's `poll()`, so no thread ever spins in a sync call.
A write reports only once all its buffers have: DONE if all landed,
TIMED_OUT if any timed out, FAILED otherwise; the controller quarantines the
slot of any write that did not report DONE, since a -1 does not prove that
nothing lands later.

First contact with a peer never runs on the encode loop: `connect` hands the
session to a `Connector` (a few threads calling `send_probe`) and the answer
comes back through `peer_reports`, read by the controller's `poll()`; the
controller's connect deadline decides when a silent peer is down.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from ..core.transport import Buf, Outcome, Transport, TransportError

log = logging.getLogger("epd_ring.mooncake")

# transfer_check_status: 1 done, 0 pending, -1 failed, -2 timed out
_DONE, _PENDING, _FAILED, _TIMEOUT = 1, 0, -1, -2
_RC_MEANING = {-1: "invalid argument or generic failure", -3: "address not registered",
               -7: "overlaps a registered region", -102: "socket error (peer unreachable)"}


@contextlib.contextmanager
def _quiet_stderr(enabled: bool):
    """The engine's glog prints banners on fd 2 at import and init; hide those only."""
    if not enabled:
        yield
        return
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def load_engine(hostname: str = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp",
                device: str = "", quiet: bool = True) -> tuple[Any, str]:
    """An initialized TransferEngine and its session id; TransportError if it will not start."""
    if quiet:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        with _quiet_stderr(quiet):
            from mooncake.engine import TransferEngine

            engine = TransferEngine()
            rc = engine.initialize(hostname, metadata_server, protocol, device)
    except ImportError as exc:
        raise TransportError(f"Mooncake is not installed ({exc}); pip install 'epd-ring[mooncake]' "
                             "and apt-get install libibverbs1") from exc
    if rc != 0:
        raise TransportError(f"TransferEngine.initialize({hostname!r}, {metadata_server!r}, {protocol!r}) "
                             f"returned {rc}")
    return engine, f"{hostname}:{engine.get_rpc_port()}"


class Connector:
    """First contact with peers, off the encode loop.

    Threads, not a subprocess: the engine's `send_probe` releases the GIL while
    it waits, so a probe hung on a peer that accepts TCP and never answers (the
    engine's handshake waits 60 s) leaves the loop running (measured: writes to
    a healthy peer kept completing, the slowest in 17 ms on two busy cores).
    `get_first_buffer_address` and even a 0-byte sync write hold the loop for
    the whole minute, so they are never called here. A subprocess would need an
    engine of its own (about 1 s to tear down, 41 MB) and its handshake would
    open no segment in ours any more than the probe does. After a probe
    answers, the first write on the loop opens the segment in about 0.3 ms.

    Bounded: at most `threads` probes run at once and `max_queued` sessions
    wait; one more is refused at once. A session already queued or being
    probed is not probed twice: the running probe answers the newest attempt.
    A hung probe keeps its thread until the engine gives up; the controller
    does not wait for it (its connect deadline takes the peer down).
    """

    def __init__(self, probe: Callable[[str], int], *, threads: int = 4, max_queued: int = 1024):
        if threads < 1 or max_queued < 1:
            raise ValueError(f"threads and max_queued must be >= 1, got {threads}, {max_queued}")
        self._probe = probe
        self._threads = threads
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._lock = threading.Lock()
        self._attempt: dict[str, int] = {}  # session queued or being probed -> newest attempt
        self._workers: list[threading.Thread] = []
        self._busy = 0
        self.reports: deque = deque()  # (session, attempt, ok, detail); appended by workers
        self.stats: Counter = Counter()

    def start(self, session: str, attempt: int) -> bool:
        """Queue a probe; False if the connector is full (the caller treats it as refused)."""
        with self._lock:
            if session in self._attempt:
                self._attempt[session] = attempt
                self.stats["joined"] += 1
                return True
            try:
                self._queue.put_nowait(session)
            except queue.Full:
                self.stats["refused_full"] += 1
                return False
            self._attempt[session] = attempt
            if self._busy + self._queue.qsize() > len(self._workers) and len(self._workers) < self._threads:
                t = threading.Thread(target=self._work, name=f"epd-ring-connector-{len(self._workers)}",
                                     daemon=True)
                self._workers.append(t)
                t.start()
        return True

    def _work(self) -> None:
        while True:
            session = self._queue.get()
            if session is None:
                return
            with self._lock:
                self._busy += 1
            try:
                rc = self._probe(session)
                ok, detail = rc == 0, "" if rc == 0 else f"probe rc={rc} ({_RC_MEANING.get(rc, 'unknown')})"
            except Exception as exc:  # report it; a connector thread must not die
                ok, detail = False, f"probe raised {type(exc).__name__}: {exc}"
            with self._lock:
                self._busy -= 1
                attempt = self._attempt.pop(session)
            self.stats["ok" if ok else "failed"] += 1
            self.reports.append((session, attempt, ok, detail))

    def close(self) -> None:
        for _ in self._workers:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)

    @property
    def in_progress(self) -> int:
        return len(self._attempt)


class _Pending:
    __slots__ = ("session", "bufs", "ids", "status", "retried")

    def __init__(self, session: str, bufs: Sequence[Buf]):
        self.session = session
        self.bufs = [b for b in bufs if b[2]]
        self.ids: list[int] = []
        self.status: list[int] = []
        self.retried = [False] * len(self.bufs)


class MooncakeTransport(Transport):
    def __init__(self, hostname: str = "127.0.0.1", *, metadata_server: str = "P2PHANDSHAKE",
                 protocol: str = "tcp", device: str = "",
                 notifier: Callable[[Any, int, str, str], None] | None = None, quiet: bool = True,
                 expose_ring: bool | None = None, connector_threads: int = 4):
        # The engine listens on all interfaces and cannot be bound to one address, and any
        # peer that reaches it can read or write what is registered. Over TCP a write's
        # source need not be registered, so the ring is not (no peer can read a parked
        # embedding or overwrite it); RDMA needs it registered (see docs/trust.md).
        self.expose_ring = protocol != "tcp" if expose_ring is None else expose_ring
        if not self.expose_ring:
            os.environ.setdefault("MC_FORCE_TCP", "1")  # an RDMA NIC must not pick a transport needing it
        self.engine, self.session = load_engine(hostname, metadata_server, protocol, device, quiet)
        self.connector = Connector(self.engine.send_probe, threads=connector_threads)
        self.notifier = notifier
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self.closed = False
        self._owners: dict[int, list[int]] = {}  # id(owner) -> its registered pointers
        self.stats: Counter = Counter()

    def register_memory(self, regions: Sequence[tuple[int, int]], owner: Any = None) -> None:
        if not self.expose_ring:
            self.stats["regions_not_exposed"] += len(regions)  # not shown to the engine's peers
            return
        ptrs = [p for p, _ in regions]
        lens = [n for _, n in regions]
        rc = self.engine.batch_register_memory(ptrs, lens)
        if rc != 0:
            raise TransportError(f"registering {len(regions)} ring regions failed: rc={rc} "
                                 f"({_RC_MEANING.get(rc, 'unknown')})")
        self._owners.setdefault(id(owner), []).extend(ptrs)

    def unregister_memory(self, owner: Any) -> None:
        ptrs = self._owners.pop(id(owner), [])
        if ptrs:
            rc = self.engine.batch_unregister_memory(ptrs)
            if rc != 0:
                log.warning("unregistering %d ring regions returned rc=%s", len(ptrs), rc)

    def close(self) -> None:
        # The engine has no close call of its own; it is released with this
        # object. Refusing new writes is what closing means here (and stopping the connector).
        self.closed = True
        self.connector.close()

    def _submit(self, p: _Pending, i: int) -> None:
        src, dst, n = p.bufs[i]
        bid = self.engine.transfer_submit_write(p.session, src, dst, n)
        p.ids[i] = bid
        p.status[i] = _PENDING if bid else _FAILED

    def submit_write(self, session: str, bufs: Sequence[Buf]) -> int:
        if self.closed:
            raise TransportError("transport is closed")
        handle = next(self._ids)
        p = _Pending(session, bufs)
        p.ids = [0] * len(p.bufs)
        p.status = [_PENDING] * len(p.bufs)
        for i in range(len(p.bufs)):
            self._submit(p, i)
        self._pending[handle] = p
        return handle

    def poll(self) -> list[tuple[int, Outcome]]:
        out = []
        check = self.engine.transfer_check_status
        for handle, p in list(self._pending.items()):
            for i, st in enumerate(p.status):
                if st == _PENDING:
                    st = p.status[i] = check(p.ids[i])
                if st == _FAILED and not p.retried[i] and p.ids[i]:
                    # A rejected transfer resets a TCP lane and can fail the next write
                    # spuriously: retry once (the slot is still ours, it is `sending`).
                    p.retried[i] = True
                    self.stats["retries"] += 1
                    self._submit(p, i)
            if any(st == _PENDING for st in p.status):
                continue
            del self._pending[handle]
            if all(st == _DONE for st in p.status):
                out.append((handle, Outcome.DONE))
                continue
            outcome = Outcome.TIMED_OUT if any(st == _TIMEOUT for st in p.status) else Outcome.FAILED
            self.stats[outcome.value] += 1
            log.warning("write to %s %s", p.session, outcome.value)
            out.append((handle, outcome))
        return out

    def connect(self, session: str, attempt: int) -> bool | None:
        """Start first contact with `session` on the connector; the answer comes from `peer_reports`."""
        return None if self.connector.start(session, attempt) else False

    def peer_reports(self) -> list[tuple[str, int, bool, str]]:
        reports = self.connector.reports
        if not reports:
            return []
        out = []
        while reports:
            out.append(reports.popleft())
        return out

    def probe(self, session: str) -> bool:
        """Is the peer's engine alive? Tells a dead peer (False, at once) from a refused address (True).

        For diagnostics off the encode loop: against a hung (stopped) peer the
        engine's probe waits for its 60 s handshake timeout.
        """
        rc = self.engine.send_probe(session)
        self.stats["probe_dead" if rc else "probe_alive"] += 1
        return rc == 0

    def notify(self, frame: Any, room: int, status: str, reason: str = "") -> None:
        if self.notifier is not None:
            self.notifier(frame, room, status, reason)

    @property
    def in_flight(self) -> int:
        return len(self._pending)
