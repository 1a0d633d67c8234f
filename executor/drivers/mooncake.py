"""A transport over Mooncake's TransferEngine (TCP here, RDMA in production).

One engine per encode worker. Ring extents are registered once, in one
`batch_register_memory` call; a registration failure raises at start-up.
Writes go out with `transfer_submit_write` (one per buffer: main rows, and
deepstack rows when present) and are polled with `transfer_check_status`
from the controller's `poll()`, so no thread ever spins in a sync call.
A write reports only once all its buffers have: DONE if all landed,
TIMED_OUT if any timed out, FAILED otherwise; the controller quarantines the
extent of any write that did not report DONE, since a -1 does not prove that
nothing lands later.

First contact with a peer never runs on the encode loop: `connect` hands the
session to a `Connector` (threads that fetch the peer's segment descriptor with a
total deadline, have the engine open the segment from our relay, and read the
identity its ownership page names: handshake.py) and the answer comes back through
`peer_reports`, read by the controller's `poll()`; the controller's connect
deadline decides when a silent peer is down.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from ..core import settings
from ..core.transport import Buf, Outcome, TransportError
from . import handshake
from .edge import OWNER_MAGIC, OWNER_PAGE, Connector, EdgeTransport, contact_deadlines, owner_page, read_owner_page
from .handshake import HandshakeError, same_segment
from .pages import ReadPages

# Connector and the ownership page live in edge.py (shared with the NIXL transport); named here too.
__all__ = ["OWNER_MAGIC", "OWNER_PAGE", "Connector", "MooncakeTransport", "TransportError", "load_engine",
           "owner_page", "read_owner_page"]

log = logging.getLogger("epd_ring.mooncake")

# transfer_check_status: 1 done, 0 pending, -1 failed, -2 timed out
_DONE, _PENDING, _FAILED, _TIMEOUT = 1, 0, -1, -2
_HANDED = 2  # ours: handed to the submit thread, not submitted yet
_RETIRED = -1000  # ours: no page to read into (this key's retired pages are all too recent to reuse)
_RC_MEANING = {-1: "invalid argument or generic failure", -3: "address not registered",
               -7: "overlaps a registered region", -102: "socket error (peer unreachable)",
               _RETIRED: "this receiver key's reads failed too often recently"}


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


class _Pending:
    __slots__ = ("session", "bufs", "ids", "status", "retried")

    def __init__(self, session: str, bufs: Sequence[Buf]):
        self.session = session
        self.bufs = [b for b in bufs if b[2]]
        self.ids: list[int] = []
        self.status: list[int] = []
        self.retried = [False] * len(self.bufs)


class MooncakeTransport(EdgeTransport):
    def __init__(self, hostname: str = "127.0.0.1", *, metadata_server: str = "P2PHANDSHAKE",
                 protocol: str = "tcp", device: str = "",
                 notifier: Callable[[Any, int, str, str], None] | None = None, quiet: bool = True,
                 expose_ring: bool | None = None, connector_threads: int = 32, contacts_per_identity: int = 2,
                 prove_ownership: bool = True, open_stall_s: float = 2.0, stall_penalty_s: float = 300.0,
                 max_respellings: int = 64, connect_timeout: float = 5.0, handshake_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        # Checked before the engine starts, naming the setting, like the control plane's and the
        # manager's: a NaN stall_penalty_s compares false and turns the penalty off, a negative
        # max_respellings never respells, 0 threads could never contact a peer.
        for name, value in (("hostname", hostname), ("metadata_server", metadata_server), ("protocol", protocol),
                            ("device", device)):
            settings.text(name, value)
        connector_threads = settings.count("connector_threads", connector_threads, 1)
        contacts_per_identity = settings.count("contacts_per_identity", contacts_per_identity, 1)
        open_stall_s = settings.seconds("open_stall_s", open_stall_s)
        if open_stall_s == 0:  # every open takes some time: each key would be held off after its first
            raise ValueError("open_stall_s must be more than 0 seconds (0 would hold off every key after its "
                             "first segment open)")
        stall_penalty_s = settings.seconds("stall_penalty_s", stall_penalty_s)
        max_respellings = settings.count("max_respellings", max_respellings)
        connect_timeout, handshake_timeout_s = contact_deadlines(connect_timeout, handshake_timeout_s)
        self.handshake_timeout_s = handshake_timeout_s
        # The engine only ever dials our relay on loopback; were it to dial a peer, its connect
        # would wait no longer than ours (its own default is 5 s whatever the deadline says).
        os.environ.setdefault("MC_HANDSHAKE_CONNECT_TIMEOUT", str(min(3599, max(1, math.ceil(connect_timeout)))))
        self.clock = clock
        # The engine listens on all interfaces and cannot be bound to one address, and any
        # peer that reaches it can read or write what is registered. Over TCP a write's
        # source need not be registered, so the ring is not (no peer can read a parked
        # embedding or overwrite it); RDMA needs it registered (see docs/trust.md).
        self.expose_ring = protocol != "tcp" if expose_ring is None else expose_ring
        if not self.expose_ring:
            os.environ.setdefault("MC_FORCE_TCP", "1")  # an RDMA NIC must not pick a transport needing it
        self.engine, self.session = load_engine(hostname, metadata_server, protocol, device, quiet)
        # With `prove_ownership` a session's owner is the identity its engine's ownership page
        # names (receivers register one first: `owner_page`), not whoever named it first.
        self.proves_ownership = prove_ownership
        self.connector = Connector(self._contact, threads=connector_threads, per_identity=contacts_per_identity,
                                   clock=clock)
        # The engine opens a segment under a lock of its own that `transfer_submit_write` also
        # takes, whatever the segment written to. Its handshake is ours (handshake.py): the
        # descriptor is fetched on a connector thread within `handshake_timeout_s`, and the engine
        # opens the segment from a relay of ours that answers at once and is closed at
        # `open_stall_s`. Opens still run one at a time under `_opening`, and a submit that finds
        # it held goes to the submit thread rather than wait on the loop. An open that took longer
        # than `open_stall_s` all the same holds its key off for `stall_penalty_s`.
        self.fetch: Callable[[str, float], bytes] = handshake.fetch
        self.relay = handshake.Relay(open_stall_s)
        self._opening = threading.Lock()
        self.open_stall_s = open_stall_s
        self.stall_penalty_s = stall_penalty_s
        self._stalled_until: dict[str, float] = {}
        # The engine caches a segment by the name it was opened with, for good. `_names` maps a
        # session to the name its writes use (the relay's address that opened it), `_descriptors`
        # a name to the descriptor it was opened with; a session whose receiver restarted is
        # opened afresh under a new name, a bounded number of times, since every name's
        # descriptor stays in the engine's cache.
        self._names: dict[str, str] = {}
        self._descriptors: dict[str, bytes] = {}
        self._respelt: Counter = Counter()
        self.max_respellings = max_respellings
        self._start_edge(notifier)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._owners: dict[int, list[int]] = {}  # id(owner) -> its registered pointers
        # Reads land in pages that outlive any read (see pages.py); registered when the engine
        # reads through a NIC, like the ring. The 0-byte read that opens a segment writes nothing,
        # but its address must be valid all the same: one page, held for good.
        register = self._register_pages if self.expose_ring else None
        self.pages = ReadPages(OWNER_PAGE, clock=clock, register=register)
        self._open_page_buf = ctypes.create_string_buffer(OWNER_PAGE)
        self._open_page = ctypes.addressof(self._open_page_buf)

    def _register_pages(self, addr: int, n: int) -> None:
        rc = self.engine.register_memory(addr, n)
        if rc != 0:
            raise TransportError(f"registering read pages failed: rc={rc} ({_RC_MEANING.get(rc, 'unknown')})")

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

    def _submit(self, p: _Pending, i: int) -> None:
        if not self._opening.acquire(blocking=False):
            # A segment is being opened: the engine would hold this submit until it is.
            p.status[i] = _HANDED
            self._hand(p, i)
            return
        try:
            self._submit_now(p, i)
        finally:
            self._opening.release()

    def _submit_now(self, p: _Pending, i: int) -> None:
        src, dst, n = p.bufs[i]
        bid = self.engine.transfer_submit_write(p.session, src, dst, n)
        p.ids[i] = bid
        p.status[i] = _PENDING if bid else _FAILED  # the loop reads it once it is no longer _HANDED

    def _submit_failed(self, p: _Pending, i: int) -> None:
        p.status[i] = _FAILED

    def submit_write(self, session: str, bufs: Sequence[Buf]) -> int:
        if self.closed:
            raise TransportError("transport is closed")
        handle = next(self._ids)
        name = self._names.get(session)
        p = _Pending(name or session, bufs)
        p.ids = [0] * len(p.bufs)
        p.status = [_PENDING] * len(p.bufs)
        if name is None:
            # Never opened through our handshake: the engine would open it itself, inside the
            # submit, under its mutex, at the peer's pace. The write fails instead (no id: no retry).
            self.stats["writes_before_contact"] += 1
            p.status = [_FAILED] * len(p.bufs)
        else:
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
                    # spuriously: retry once (the extent is still ours, it is `sending`).
                    p.retried[i] = True
                    self.stats["retries"] += 1
                    self._submit(p, i)
            if any(st in (_PENDING, _HANDED) for st in p.status):
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

    def _contact(self, session: str, identity: str = "", probe: bool = False) -> tuple[bool, str, str | None]:
        """On a connector thread: (ok, detail, owner).

        The peer's descriptor is fetched by us within `handshake_timeout_s` in all (handshake.py),
        holding nothing of the engine's. A heartbeat (`probe`) asks no more: an answer shows the
        receiver's engine serves (a stopped process's kernel accepts the connection but nothing
        replies), and a descriptor unlike the one its segment was opened with shows another
        process there now. It reads nothing through the engine, so it never queues behind the
        receiver's own writes on their lanes (a slow link's receiver stays up while it works)."""
        try:
            desc = self.fetch(session, self.handshake_timeout_s)
        except HandshakeError as exc:
            self.stats["handshakes_failed"] += 1
            return False, f"handshake with {session} failed: {exc}", None
        name = self._names.get(session)
        if probe:
            self.stats["heartbeats"] += 1
            if name is not None and not same_segment(desc, self._descriptors[name]):
                return False, "the receiver's segment changed since it was opened (another process there now)", None
            return True, "", None
        if name is None or not same_segment(desc, self._descriptors[name]):
            # First contact, or a receiver restarted on the same host:port: the engine keeps a
            # segment's descriptor for good under the name it was opened with, so the new one is
            # opened under a name of its own (each costs an entry in the engine's cache: bounded).
            if name is not None and self._respelt[session] >= self.max_respellings:
                self.stats["respellings_refused"] += 1
                return False, f"segment opened afresh {self.max_respellings} times already", None
            opened = self._open(session, desc, identity)
            if isinstance(opened, tuple):
                return opened
            if name is not None:
                self._respelt[session] += 1
                self.stats["segments_opened_afresh"] += 1
            name = opened
        if not self.proves_ownership:
            return True, "", None
        owner, rc = self._read_owner(name, identity)
        if owner is None:
            return False, "no ownership page at the peer's first registered buffer" + (f" (read rc={rc})" if rc else
                                                                                          ""), None
        return True, "", owner

    def _open(self, session: str, desc: bytes, identity: str) -> str | tuple[bool, str, None]:
        """Open the segment `desc` describes under `_opening`, through the relay; its name, else the failed contact.

        The engine holds its submit mutex while it opens; the relay answers it from `desc` at once
        and is closed at `open_stall_s`, so no peer decides how long that is. An open that took
        longer all the same (our own machine overloaded) holds the key off for `stall_penalty_s`."""
        engine = self.engine
        with self._opening:
            if self.clock() < self._stalled_until.get(identity, 0.0):
                self.stats["opens_refused_stalled"] += 1
                return False, "this receiver key stalled a segment open recently", None
            started = self.clock()
            # A 0-byte read is not checked against the peer's buffers: it only opens the segment
            # (here, not on the loop's first write).
            name, rc = self.relay.open(desc, lambda n: engine.transfer_sync_read(n, self._open_page, self._open_page,
                                                                               0))
            if self.clock() - started > self.open_stall_s:
                self.stats["opens_stalled"] += 1
                self._stalled_until[identity] = self.clock() + self.stall_penalty_s
                if len(self._stalled_until) > 4096:  # bounded: the oldest penalties go first
                    self._stalled_until.pop(next(iter(self._stalled_until)))
        if rc != 0:
            return False, f"opening the segment failed: rc={rc} ({_RC_MEANING.get(rc, 'unknown')})", None
        self._descriptors[name] = desc
        self._names[session] = name  # the loop's writes go to this segment from now on
        self.stats["segments_opened"] += 1
        return name

    def _read_owner(self, name: str, identity: str) -> tuple[str | None, int]:
        """The identity the ownership page at `name`'s first registered buffer names, and the read's rc.

        The page is read into one of `pages`, never into memory this call owns: a read that gave
        up can still be answered, and the engine then writes the reply where it was told to."""
        base = self.engine.get_first_buffer_address(name)  # from the segment just opened (cached)
        if not base:
            return None, -3
        local = self.pages.take(identity)
        if local is None:
            self.stats["reads_refused_retired"] += 1
            return None, _RETIRED
        rc = -1
        try:
            rc = self.engine.transfer_sync_read(name, local, base, OWNER_PAGE)
            return (read_owner_page(self.pages.read(local)) if rc == 0 else None), rc
        finally:
            if rc != 0:
                self.stats["read_pages_retired"] += 1
            self.pages.give_back(local, rc == 0, identity)

    def probe(self, session: str) -> bool:
        """Is the peer's engine alive? Tells a dead peer (False, at once) from a refused address (True).

        For diagnostics off the encode loop: against a hung (stopped) peer the
        engine's probe waits for its 60 s handshake timeout.
        """
        rc = self.engine.send_probe(session)
        self.stats["probe_dead" if rc else "probe_alive"] += 1
        return rc == 0

    @property
    def in_flight(self) -> int:
        return len(self._pending)
