"""A transport over NIXL (UCX underneath), behind the same seam as Mooncake's.

One agent per encode worker, UCX backend. The ring is registered once (NIXL, unlike Mooncake over
TCP, needs a write's source registered). A write is one `initialize_xfer` + `transfer` over all
its buffers, polled with `check_xfer_state` from `poll()`. NIXL's failure behaviour is not
Mooncake's, and is mapped onto the seam here:

- a killed peer: `check_xfer_state` raises (`nixlRemoteDisconnectError`) rather than return an
  error state: the write is FAILED;
- a stopped (or cut) peer: the transfer stays in progress with no timeout of its own, so each
  write carries our deadline (`write_timeout_s`): past it the handle is released, which cancels,
  and the write reports TIMED_OUT (bytes already in flight may still land: the core quarantines
  the extent). A handle NIXL refuses to release is kept, its extent with it, and released again on
  the next poll: memory handed to the engine lives until the engine can no longer touch it;
- a refused peer fails at first contact; a blackholed one makes `add_remote_agent` block for
  the kernel's SYN retries (minutes) while holding the agent, so no write to anyone would go.

First contact runs on the connector (edge.py), never on the loop: the peer's metadata is fetched
from its metadata port within `handshake_timeout_s` (our socket, our deadline, handshake.py's
framing), then added to a *prober* agent of that connector thread's own (no memory registered),
and only once that add came back, to the writing agent. A peer that blackholes the add holds one
connector thread and its prober. A hostile peer can let the prober's add through and blackhole the
writing agent's: that add holds `_lock` for minutes (NIXL has no deadline on it, and its own
agent lock would stall any other call meanwhile). The loop never waits on the agent: every call
into it is made under `_lock`, which the loop only tries. A submit that finds it held goes to the
submit thread (which never posts a write past its deadline); a poll that finds it held makes no
call into NIXL but still holds our deadlines: each write past its deadline is named once by
`overdue()` (the core fails its room and keeps its extent), and is released, and reported
TIMED_OUT, by the next poll that gets the lock. With `prove_ownership` the ownership page is read
through the agent, as over Mooncake.

The receiver side: `NixlTarget` registers the ownership page and the receive buffer with an agent
of its own and serves its metadata (`descriptor`) on a TCP port: its session is that HOST:PORT.
UCX lists a worker's network devices only as it is made, so that agent is made once a device it
would use is up (`Links`): a receiver started during a cut makes it at the first request after.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ipaddress
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..core import settings
from ..core.transport import Buf, Outcome, TransportError
from . import handshake
from .edge import OWNER_PAGE, Connector, EdgeTransport, contact_deadlines, read_owner_page
from .handshake import HandshakeError, same_segment
from .pages import ReadPages

log = logging.getLogger("epd_ring.nixl")

_HANDED, _PROC, _DONE, _FAILED, _TIMED_OUT = "handed", "proc", "done", "failed", "timed_out"
_ENDED = frozenset((_DONE, _FAILED, _TIMED_OUT))
ENGINE = "nixl"
_MAKE_WAIT_S = 10.0  # how long close waits for an agent being made on a request's thread


def nixl_classes() -> tuple[Any, Any, Any]:
    """NIXL's agent, its config and its thread-sync enum; TransportError if NIXL is missing."""
    try:
        from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError as exc:
        raise TransportError(f"NIXL is not installed ({exc}); pip install 'epd-ring[nixl]'") from exc
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


def load_agent(name: str, *, progress_thread: bool = True, quiet: bool = True) -> Any:
    """A NIXL agent with the UCX backend; TransportError if NIXL or UCX is missing."""
    # UCX logs on stdout by default: a receiver process answers JSON lines there.
    os.environ.setdefault("UCX_LOG_FILE", "/dev/stderr")
    if quiet:
        os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
        logging.getLogger("nixl").setLevel(logging.ERROR)
    nixl_agent, nixl_agent_config, nixl_thread_sync_t = nixl_classes()
    # STRICT: the agent is called from the loop, the submit thread and connector threads (each
    # under our own lock too; NIXL's progress thread is the reason for its own).
    config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                               sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    try:
        agent = nixl_agent(name, config)
    except Exception as exc:
        raise TransportError(f"NIXL agent {name!r} did not start: {type(exc).__name__}: {exc}") from exc
    if "UCX" not in agent.backends:
        raise TransportError("NIXL has no UCX backend here (its plugin did not load)")
    return agent


def descriptor(agent: Any, owner_ptr: int) -> bytes:
    """What a receiver's metadata port serves: the agent's name and metadata, and where its
    ownership page is (`buffers`, as a Mooncake descriptor names its first buffer)."""
    return json.dumps({"engine": ENGINE, "agent": agent.name, "buffers": [owner_ptr],
                       "metadata": base64.b64encode(agent.get_agent_metadata()).decode()}).encode()


def parse_descriptor(body: bytes) -> tuple[str, bytes, int]:
    """(agent name, metadata, ownership page address); HandshakeError if it is not a NIXL agent's."""
    desc = handshake.check_descriptor(body)
    try:
        name, meta, owner = desc["agent"], base64.b64decode(desc["metadata"], validate=True), desc["buffers"][0]
    except (KeyError, IndexError, TypeError, binascii.Error) as exc:
        raise HandshakeError(f"not a NIXL agent's metadata ({type(exc).__name__})") from None
    if desc.get("engine") != ENGINE or type(name) is not str or not name or type(owner) is not int:
        raise HandshakeError("not a NIXL agent's metadata")
    return name, meta, owner


class MetadataServer:
    """Serves `body` (or what `body()` gives at each request; None: no answer) to whoever asks on
    HOST:PORT (handshake.py's framing), one thread per request, each closed at `timeout_s`: a
    client that never sends holds its own thread, briefly."""

    def __init__(self, host: str, body: bytes | Callable[[], bytes | None], port: int = 0, timeout_s: float = 2.0,
                 max_answers: int = 16):
        self.body = body if callable(body) else (lambda: body)
        self.timeout_s = timeout_s
        # answers at once: a flood of clients that never send is turned away, not given a thread each
        self._answers = threading.BoundedSemaphore(max_answers)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, name="epd-ring-nixl-metadata", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            if not self._answers.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.timeout_s
        with contextlib.ExitStack() as done:
            done.callback(self._answers.release)
            done.enter_context(conn)
            try:
                handshake.read_frame(conn, deadline, max_bytes=4096)
                body = self.body()
                if body is None:  # nothing to serve yet: closed unanswered, the client tries again
                    return
                conn.settimeout(self.timeout_s)
                conn.sendall(handshake.frame(handshake.METADATA, body))
            except (OSError, HandshakeError):
                pass

    def close(self) -> None:
        # a close alone does not wake the thread blocked in accept(): the port would stay open
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Links:
    """Is a network device a NIXL agent's UCX worker would use up, as /sys/class/net (`root`) says?

    UCX's TCP transport lists the devices once, as the worker is made, and keeps those up with
    carrier (IFF_UP and IFF_RUNNING): with UCX_NET_DEVICES naming only devices without one, no agent
    is made ("No such device"); with it unset, one is made that only this host reaches, and stays
    so. `devices`: UCX_NET_DEVICES, an allow list (comma-separated, `^` first to exclude, `all`)."""

    def __init__(self, devices: str | None = None, root: str = "/sys/class/net"):
        names = [d.strip() for d in (devices or "").split(",") if d.strip()]
        self.exclude = bool(names) and names[0].startswith("^")
        if self.exclude:
            names[0] = names[0][1:]
        self.devices = None if not names or "all" in names else set(names)
        self.root = root

    def _running(self, dev: str) -> bool:
        try:
            with open(os.path.join(self.root, dev, "operstate")) as f:
                oper = f.read().strip()
            with open(os.path.join(self.root, dev, "carrier")) as f:
                carrier = f.read().strip()
        except OSError:  # gone, or set down (its carrier then reads EINVAL)
            return False
        # IFF_RUNNING is operstate up, or unknown (a device that reports none, as a dummy one does)
        return carrier == "1" and oper in ("up", "unknown")

    def up(self) -> bool:
        try:
            present = set(os.listdir(self.root)) - {"lo"}
        except OSError:  # no sysfs here: nothing to tell, so nothing to wait for
            return True
        if self.devices is None or self.exclude:
            names = present - (self.devices or set())
        elif "lo" in self.devices or not self.devices <= present:
            # loopback is always up; a name that is no network device here (an RDMA port, `mlx5_0:1`)
            # is UCX's to judge: nothing to tell either way
            return True
        else:
            names = self.devices
        return any(self._running(d) for d in names)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class NixlTarget:
    """A receiver's memory over NIXL: the ownership page first, then the receive buffer, registered
    with an agent of its own, whose metadata is served at `session` (HOST:PORT).

    The agent is made once a network device it would use is up (`links`): UCX lists the devices
    once, as an agent is made, and with none up it refuses to make one (UCX_NET_DEVICES named) or
    makes one reachable over loopback only. A receiver started while its link is down serves its
    session at once but answers no metadata request until a device is up, and makes its agent at
    the first request after (its encoder tries again, as for any failed contact). One advertising a
    loopback address is reached over loopback: its agent is made at once."""

    def __init__(self, hostname: str, page: Any, buffer: Any, port: int = 0, links: Links | None = None):
        if links is None and not _loopback(hostname):
            links = Links(os.environ.get("UCX_NET_DEVICES"))
        self._links = links
        # the registered memory lives as long as the agent that exposes it, whoever else lets go first
        self.memory = (page, buffer)
        self.agent: Any = None
        self.regs: list[Any] = []
        self._body: bytes | None = None  # the agent's descriptor, once there is an agent
        self._held: list[tuple[Any, list[Any]]] = []  # agents whose making failed, with memory NIXL kept
        self._lock = threading.Lock()  # making the agent (on a request's thread) against close
        self._closed = False
        if links is None or links.up():
            self._make()
        else:
            nixl_classes()  # NIXL missing fails the start, not every request after it
            log.warning("no network device up (UCX_NET_DEVICES=%s): the NIXL agent is made, and metadata "
                        "served, once one is", os.environ.get("UCX_NET_DEVICES", ""))
        self.server = MetadataServer(hostname, self._descriptor, port)
        self.session = self.server.address

    def _make(self) -> None:
        agent = load_agent(f"epd-ring-rx-{uuid.uuid4().hex[:16]}")
        regs: list[Any] = []
        try:
            for t in self.memory:
                regs.append(agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), 0, "")], "DRAM"))
            body = descriptor(agent, self.memory[0].data_ptr())
        except BaseException:
            if refused := self._deregister(agent, regs):
                self._held.append((agent, refused))
            raise
        self.agent, self.regs, self._body = agent, regs, body

    def _descriptor(self) -> bytes | None:
        """What a metadata request is answered with (on its own thread): None, no answer, until there
        is an agent; the first request that finds a device up makes it. A request that comes while
        another makes it is not answered: it would wait past its client's deadline."""
        if self._body is None and self._links is not None and self._links.up() and self._lock.acquire(blocking=False):
            try:
                if self._body is None and not self._closed:
                    self._make()
                    log.warning("a network device is up: NIXL agent %s made", self.agent.name)
            except Exception as exc:  # tried again at the next request
                log.warning("making the NIXL agent failed: %s: %s", type(exc).__name__, exc)
            finally:
                self._lock.release()
        return self._body

    def close(self) -> None:
        """Stop serving the metadata, deregister the memory, then let go of the agent (idempotent).
        Memory whose deregistration NIXL refused stays held, with the agent, as long as this object."""
        self.server.close()
        if not self._lock.acquire(timeout=_MAKE_WAIT_S):
            log.warning("a NIXL agent still being made holds the receiver's memory: it stays held")
            return
        try:
            self._closed = True
            self._held = [(a, kept) for a, regs in self._held if (kept := self._deregister(a, regs))]
            if self.agent is not None:
                self.regs = self._deregister(self.agent, self.regs)
                if not self.regs:
                    self.agent = None
            if self.agent is None and not self._held:
                self.memory = ()
        finally:
            self._lock.release()

    @staticmethod
    def _deregister(agent: Any, regs: list[Any]) -> list[Any]:
        """Deregisters `regs` from `agent`, last first; returns those NIXL refused."""
        refused = []
        for reg in reversed(regs):
            try:
                agent.deregister_memory(reg)
            except Exception as exc:
                log.warning("deregistering a receiver's memory from NIXL failed: %s: %s", type(exc).__name__, exc)
                refused.append(reg)
        return refused


class _Write:
    __slots__ = ("name", "bufs", "state", "handle", "deadline", "failure", "notif", "overdue")

    def __init__(self, name: str, bufs: Sequence[Buf], deadline: float, notif: bytes = b""):
        self.name, self.bufs, self.deadline, self.notif = name, [b for b in bufs if b[2]], deadline, notif
        self.state = _PROC
        self.handle: Any = None
        self.failure = ""
        self.overdue = False  # named by `overdue()`: past our deadline while a contact held the agent


class NixlTransport(EdgeTransport):
    def __init__(self, hostname: str = "127.0.0.1", *, notifier: Callable[[Any, int, str, str], None] | None = None,
                 connect_timeout: float = 5.0, handshake_timeout_s: float | None = None,
                 write_timeout_s: float = 10.0, prove_ownership: bool = True, connector_threads: int = 32,
                 contacts_per_identity: int = 2, quiet: bool = True, clock: Callable[[], float] = time.monotonic):
        settings.text("hostname", hostname)
        connect_timeout, handshake_timeout_s = contact_deadlines(connect_timeout, handshake_timeout_s)
        self.write_timeout_s = settings.seconds("write_timeout_s", write_timeout_s)
        if self.write_timeout_s == 0:
            raise ValueError("write_timeout_s must be more than 0 seconds")
        self.connect_timeout, self.handshake_timeout_s, self.clock = connect_timeout, handshake_timeout_s, clock
        self.proves_ownership, self.quiet = prove_ownership, quiet
        self.agent = load_agent(f"epd-ring-tx-{uuid.uuid4().hex[:16]}", quiet=quiet)
        self.session = f"nixl:{self.agent.name}"
        self._lock = threading.Lock()  # held for every call into `agent`; the loop only tries it
        self._local = threading.local()  # a connector thread's prober agent
        self.connector = Connector(self._contact, threads=connector_threads, per_identity=contacts_per_identity,
                                   clock=clock)
        self.fetch: Callable[[str, float], bytes] = handshake.fetch
        self._start_edge(notifier)
        self._names: dict[str, str] = {}  # session -> the remote agent its writes go to
        # connector threads check and change `_names` together; `_claims`: names being added, by session
        self._names_lock = threading.Lock()
        self._claims: dict[str, str] = {}
        self._descriptors: dict[str, bytes] = {}  # session -> the metadata it was added with
        self._pending: dict[int, _Write] = {}
        self._overdue: list[int] = []  # handles past our deadline that no poll could release yet
        self._next = 0
        self._regs: dict[int, list[Any]] = {}  # id(owner) -> its registrations
        self.pages = ReadPages(OWNER_PAGE, clock=clock, register=self._register_pages)

    def _register_pages(self, addr: int, n: int) -> None:
        with self._lock:
            self.agent.register_memory([(addr, n, 0, "")], "DRAM")

    def register_memory(self, regions: Sequence[tuple[int, int]], owner: Any = None) -> None:
        try:
            with self._lock:
                reg = self.agent.register_memory([(p, n, 0, "") for p, n in regions], "DRAM")
        except Exception as exc:
            raise TransportError(f"registering {len(regions)} ring regions with NIXL failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
        self._regs.setdefault(id(owner), []).append(reg)

    def unregister_memory(self, owner: Any) -> None:
        for reg in self._regs.pop(id(owner), []):
            try:
                with self._lock:
                    self.agent.deregister_memory(reg)
            except Exception as exc:
                log.warning("deregistering ring regions from NIXL failed: %s", exc)

    def submit_write(self, session: str, bufs: Sequence[Buf]) -> int:
        if self.closed:
            raise TransportError("transport is closed")
        self._next += 1
        name = self._names.get(session)
        w = self._pending[self._next] = _Write(name or session, bufs, self.clock() + self.write_timeout_s)
        if name is None:
            self.stats["writes_before_contact"] += 1  # no agent added for it: nothing to write through
            w.state = _FAILED
        elif not w.bufs:
            w.state = _DONE
        elif self._lock.acquire(blocking=False):
            try:
                self._post(w)
            finally:
                self._lock.release()
        else:  # a contact holds the agent: the submit thread waits for it, not the loop
            w.state = _HANDED
            self._hand(w, 0)
        return self._next

    def _submit_now(self, w: _Write, _i: int) -> None:
        with self._lock:
            if self.clock() >= w.deadline:  # it waited out its deadline behind a contact: never posted
                w.state = _TIMED_OUT
            else:
                self._post(w)

    def _submit_failed(self, w: _Write, _i: int) -> None:
        w.state = _FAILED

    def _post(self, w: _Write) -> None:
        """Under `_lock`: create and post the write's transfer."""
        agent = self.agent
        try:
            local = agent.get_xfer_descs([(src, n, 0) for src, _, n in w.bufs], "DRAM")
            remote = agent.get_xfer_descs([(dst, n, 0) for _, dst, n in w.bufs], "DRAM")
            w.handle = agent.initialize_xfer("WRITE", local, remote, w.name, w.notif)
            st = agent.transfer(w.handle, w.notif)
        except Exception as exc:  # outside the peer's registered memory, an agent removed, a disconnect
            w.failure = f"{type(exc).__name__}: {exc}"
            w.state = _FAILED
            return
        w.state = {"DONE": _DONE, "PROC": _PROC}.get(st, _FAILED)

    def poll(self) -> list[tuple[int, Outcome]]:
        if not self._pending:
            return []
        if not self._lock.acquire(blocking=False):
            return self._poll_deferred()
        out: list[tuple[int, Outcome]] = []
        try:
            now = self.clock()
            for handle, w in list(self._pending.items()):
                if w.state == _HANDED:
                    continue
                if w.state == _PROC and w.handle is not None:
                    self._check(w, now)
                if w.state == _PROC:
                    continue
                if w.handle is not None and not self._release(w):
                    continue  # NIXL may still touch its memory: kept, released again next poll
                self._report(handle, w, out)
        finally:
            self._lock.release()
        return out

    def _poll_deferred(self) -> list[tuple[int, Outcome]]:
        """A poll while a contact holds the agent (a blackholed add may hold it for minutes): no call
        into NIXL. A write NIXL never got reports now; one past our deadline is named once by
        `overdue()` (the core fails its room at once and keeps its extent), and reports only once
        a poll with the agent has released its handle: NIXL may touch its memory until then."""
        self.stats["polls_deferred"] += 1
        out: list[tuple[int, Outcome]] = []
        now = self.clock()
        for handle, w in list(self._pending.items()):
            # state first: the submit thread sets a write's handle before its state
            if w.state in _ENDED and w.handle is None:
                self._report(handle, w, out)
            elif not w.overdue and now >= w.deadline:
                w.overdue = True
                self._overdue.append(handle)
                self.stats["overdue"] += 1
        return out

    def overdue(self) -> list[int]:
        out, self._overdue = self._overdue, []
        return out

    def _report(self, handle: int, w: _Write, out: list[tuple[int, Outcome]]) -> None:
        """`w` ended and NIXL holds nothing of it: it leaves `_pending`, its outcome goes in `out`."""
        del self._pending[handle]
        if w.state == _DONE:
            out.append((handle, Outcome.DONE))
            return
        self.stats[w.state] += 1
        log.warning("write to %s %s%s", w.name, w.state, f" ({w.failure})" if w.failure else "")
        out.append((handle, Outcome.TIMED_OUT if w.state == _TIMED_OUT else Outcome.FAILED))

    def _check(self, w: _Write, now: float) -> None:
        try:
            st = self.agent.check_xfer_state(w.handle)
        except Exception as exc:  # a killed peer: nixlRemoteDisconnectError, raised rather than returned
            self.stats[f"raised_{type(exc).__name__}"] += 1
            w.failure, w.state = f"{type(exc).__name__}: {exc}", _FAILED
            return
        if st == "DONE":
            w.state = _DONE
        elif st != "PROC":
            w.state = _FAILED
        elif now >= w.deadline:
            # A stopped or cut peer: NIXL waits for ever. Releasing the handle cancels; what was
            # already sent may still land, so the core quarantines the extent.
            w.state = _TIMED_OUT

    def _release(self, w: _Write) -> bool:
        try:
            w.handle.release()
        except Exception as exc:
            self.stats["releases_refused"] += 1
            if self.stats["releases_refused"] & (self.stats["releases_refused"] - 1) == 0:  # 1, 2, 4, ...: a
                # handle refused on every poll would otherwise log a line a millisecond
                log.warning("NIXL refused to release a write to %s (%s, %d refusals so far); kept, retried next "
                            "poll", w.name, exc, self.stats["releases_refused"])
            return False
        w.handle = None
        return True

    def _prober(self) -> Any:
        """This connector thread's own agent, with nothing registered: a blackholed add holds it, and
        this thread, never the agent the loop writes with."""
        prober = getattr(self._local, "agent", None)
        if prober is None:
            prober = self._local.agent = load_agent(f"epd-ring-probe-{uuid.uuid4().hex[:16]}",
                                                    progress_thread=False, quiet=self.quiet)
        return prober

    def _contact(self, session: str, identity: str = "", probe: bool = False) -> tuple[bool, str, str | None]:
        """On a connector thread: (ok, detail, owner). See the module's docstring."""
        started = self.clock()
        try:
            desc = self.fetch(session, self.handshake_timeout_s)
            name, meta, owner_ptr = parse_descriptor(desc)
        except HandshakeError as exc:
            self.stats["handshakes_failed"] += 1
            return False, f"metadata from {session} failed: {exc}", None
        known = self._descriptors.get(session)
        if probe:
            self.stats["heartbeats"] += 1
            if known is not None and not same_segment(desc, known):
                return False, "the receiver's agent changed since it was added (another process there now)", None
            return True, "", None
        if known is None or not same_segment(desc, known):
            with self._names_lock:
                if self._claims.get(name, session) != session or any(
                        n == name for s, n in self._names.items() if s != session):
                    return False, f"agent name {name!r} is another session's", None
                self._claims[name] = session
            try:
                failed = self._add(session, name, meta)
            finally:
                with self._names_lock:
                    del self._claims[name]
            if failed:
                return False, failed, None
            self._descriptors[session] = desc
        if not self.proves_ownership:
            return True, "", None
        owner = self._read_owner(name, owner_ptr, identity, started + self.connect_timeout)
        if owner is None:
            return False, "no ownership page where the peer's metadata says", None
        return True, "", owner

    def _add(self, session: str, name: str, meta: bytes) -> str:
        """Add the peer's agent: to this thread's prober, then (it came back) to the writing agent.
        Returns what failed, or ""."""
        try:
            prober = self._prober()
            prober.add_remote_agent(meta)
            prober.remove_remote_agent(name)
        except Exception as exc:
            self.stats["adds_failed"] += 1
            return f"adding the peer's agent failed: {type(exc).__name__}: {exc}"
        with self._names_lock:
            old = self._names.pop(session, None)  # the loop's writes to it fail until the new one is added
        try:
            with self._lock:
                if old is not None:
                    self.agent.remove_remote_agent(old)
                self.agent.add_remote_agent(meta)
        except Exception as exc:
            self.stats["adds_failed"] += 1
            return f"adding the peer's agent failed: {type(exc).__name__}: {exc}"
        with self._names_lock:
            self._names[session] = name
        self.stats["agents_added"] += 1
        return ""

    def _read_owner(self, name: str, base: int, identity: str, deadline: float) -> str | None:
        """The identity the peer's ownership page names, read through the agent into one of `pages`
        (a read that gave up is cancelled, and its page retired, never reused while it may land)."""
        page = self.pages.take(identity)
        if page is None:
            self.stats["reads_refused_retired"] += 1
            return None
        handle, ok = None, False
        try:
            with self._lock:
                local = self.agent.get_xfer_descs([(page, OWNER_PAGE, 0)], "DRAM")
                remote = self.agent.get_xfer_descs([(base, OWNER_PAGE, 0)], "DRAM")
                handle = self.agent.initialize_xfer("READ", local, remote, name)
                st = self.agent.transfer(handle)
            while st == "PROC" and self.clock() < deadline:
                time.sleep(0.001)  # a connector thread: it waits, holding nothing
                with self._lock:
                    st = self.agent.check_xfer_state(handle)
            ok = st == "DONE"
            return read_owner_page(self.pages.read(page)) if ok else None
        except Exception as exc:
            self.stats[f"read_raised_{type(exc).__name__}"] += 1
            return None
        finally:
            if handle is not None:
                try:
                    with self._lock:
                        handle.release()
                except Exception:
                    ok = False
            self.pages.give_back(page, ok, identity)

    def probe(self, session: str) -> bool:
        """Does the peer's metadata port answer? A dead receiver's is refused at once (diagnostics,
        off the loop: a stopped one is waited for up to `handshake_timeout_s`)."""
        try:
            self.fetch(session, self.handshake_timeout_s)
        except HandshakeError:
            self.stats["probe_dead"] += 1
            return False
        self.stats["probe_alive"] += 1
        return True

    @property
    def in_flight(self) -> int:
        return len(self._pending)
