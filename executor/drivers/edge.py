"""What the transports over a real engine share: first contact off the loop, and the ownership page.

`Connector` runs each first contact with a peer on threads of its own, bounded per receiver key;
a transport hands it a `contact(session, identity, probe=False)` that does the engine's part
(Mooncake: fetch the segment descriptor and open the segment; NIXL: fetch the agent's metadata
and add the remote agent). `EdgeTransport` is the part of the seam both implement alike: contacts
through the connector, notices through the control plane's notifier.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from ..core import settings
from ..core.transport import Transport

# The page a receiver registers first with its engine, naming the key it answers to. The
# encoder reads it back from the session at first contact, so a session is bound to what the
# engine actually reaches, never to how the frame spelled it (see docs/trust.md).
OWNER_MAGIC = b"epd-ring/owner/1"  # 16 bytes
OWNER_PAGE = 64


def owner_page(identity: str) -> bytes:
    """The ownership page naming `identity` (a z85 key, or "" without authentication)."""
    key = identity.encode("ascii")
    if len(key) > OWNER_PAGE - len(OWNER_MAGIC) - 1:
        raise ValueError(f"identity too long for the ownership page: {len(key)} bytes")
    return (OWNER_MAGIC + key).ljust(OWNER_PAGE, b"\0")


def read_owner_page(page: bytes) -> str | None:
    """The identity an ownership page names; None if it is not one."""
    if not page.startswith(OWNER_MAGIC):
        return None
    key = page[len(OWNER_MAGIC):].rstrip(b"\0")
    try:
        text = key.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() and " " not in text else None


def contact_deadlines(connect_timeout: float, handshake_timeout_s: float | None) -> tuple[float, float]:
    """Both engines' contact settings, checked: (connect deadline, handshake deadline).

    The handshake must end before the controller's connect deadline does, or an honest but slow
    answer would come too late to count: 0.8 of it unless given, never more than it."""
    connect_timeout = settings.seconds("connect_timeout", connect_timeout)
    if connect_timeout == 0:
        raise ValueError("connect_timeout must be more than 0 seconds")
    handshake_timeout_s = settings.seconds("handshake_timeout_s", 0.8 * connect_timeout if handshake_timeout_s
                                           is None else handshake_timeout_s)
    if not 0 < handshake_timeout_s <= connect_timeout:
        raise ValueError(f"handshake_timeout_s must be more than 0 and at most connect_timeout "
                         f"({connect_timeout} s), got {handshake_timeout_s}")
    return connect_timeout, handshake_timeout_s


class Connector:
    """First contact with peers, off the encode loop.

    Threads, not a subprocess: the engine's `send_probe` and its sync reads release the
    GIL while they wait, so a contact hung on a peer that accepts TCP and never answers
    (the engine's handshake waits 60 s) leaves the loop running. `get_first_buffer_address`
    holds the GIL through a handshake, so it is called only once the segment is open.

    A contact (`contact`): the probe; then, with `prove`, a 0-byte read that opens the
    peer's segment here (the engine caches it, so the loop's first write to the peer finds
    it open and never handshakes on the loop: a peer that answers the probe and then goes
    silent holds a connector thread, not the loop); then the ownership page, read from the
    segment's first registered buffer. The report names the identity it holds.

    Bounded per identity: an identity has at most `per_identity` contacts queued or running
    (a hung one counts until the engine gives up on it, about a minute); its next
    `waiting_per_identity` wait their turn behind its own (those that waited longer than
    `max_wait_s` are reported failed instead of started), and one more is refused at once.
    `threads` run at once in all, `max_queued` are queued and as many wait. So one key naming
    silent listeners holds `per_identity` threads, never the pool. A session already queued,
    waiting or being contacted is not contacted twice: its contact answers the newest attempt.
    """

    def __init__(self, contact: Callable[[str, str], tuple[bool, str, str | None]], *, threads: int = 32,
                 max_queued: int = 1024, per_identity: int = 2, waiting_per_identity: int = 64,
                 max_wait_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        # A NaN max_wait_s compares false, so a contact would wait behind its key's others forever.
        self._contact = contact
        self._threads = settings.count("threads", threads, 1)
        self.max_queued = settings.count("max_queued", max_queued, 1)
        self.per_identity = settings.count("per_identity", per_identity, 1)
        self.waiting_per_identity = settings.count("waiting_per_identity", waiting_per_identity)
        self.max_wait_s = settings.seconds("max_wait_s", max_wait_s)
        self._clock = clock
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._attempt: dict[str, int] = {}  # session queued, waiting or being contacted -> newest attempt
        self._probe_only: set[str] = set()  # of those, the heartbeat probes of peers already proven
        self._identity: dict[str, str] = {}  # session queued, waiting or being contacted -> whose share it uses
        self._load: Counter = Counter()  # identity -> its contacts queued or running
        self._active = 0  # contacts queued or running, in all
        self._waiting: dict[str, deque] = {}  # identity -> (session, since) waiting behind its own contacts
        self._n_waiting = 0
        self._workers: list[threading.Thread] = []
        self.reports: deque = deque()  # (session, attempt, ok, detail, owner); appended by workers
        self.stats: Counter = Counter()

    def start(self, session: str, attempt: int, identity: str = "", probe: bool = False) -> bool:
        """Queue a contact; False if `identity`'s share or the queue is full (the caller treats it as refused).

        `probe`: the heartbeat of a peer already up, which only asks whether it answers (a full
        contact queued for the same session, or joining it, does the whole contact)."""
        with self._lock:
            if session in self._attempt:
                self._attempt[session] = attempt
                if not probe:
                    self._probe_only.discard(session)
                self.stats["joined"] += 1
                return True
            if self._load[identity] < self.per_identity:
                if self._active >= self.max_queued:
                    self.stats["refused_full"] += 1
                    return False
                self._enqueue(session, identity)
            else:
                waiting = self._waiting.setdefault(identity, deque())
                if len(waiting) >= self.waiting_per_identity or self._n_waiting >= self.max_queued:
                    if not waiting:
                        del self._waiting[identity]
                    self.stats["refused_identity"] += 1
                    return False
                waiting.append((session, self._clock()))
                self._n_waiting += 1
                self.stats["waited_identity"] += 1
            self._attempt[session] = attempt
            self._identity[session] = identity
            if probe:
                self._probe_only.add(session)
        return True

    def _enqueue(self, session: str, identity: str) -> None:
        """Under the lock: `session` goes to a worker, one of its own if none is free."""
        self._load[identity] += 1
        self._active += 1
        self._queue.put(session)
        # Every contact queued or running needs a worker of its own (counted under the lock:
        # a worker between taking an item and starting it is still busy with it).
        if self._active > len(self._workers) and len(self._workers) < self._threads:
            t = threading.Thread(target=self._work, name=f"epd-ring-connector-{len(self._workers)}", daemon=True)
            self._workers.append(t)
            t.start()

    def _work(self) -> None:
        while True:
            session = self._queue.get()
            if session is None:
                return
            try:
                with self._lock:
                    identity = self._identity[session]
                    probe = session in self._probe_only
                    self._probe_only.discard(session)
                ok, detail, owner = (self._contact(session, identity, probe=True) if probe
                                     else self._contact(session, identity))
            except Exception as exc:  # report it; a connector thread must not die
                ok, detail, owner = False, f"contact raised {type(exc).__name__}: {exc}", None
            with self._lock:
                attempt = self._attempt.pop(session)
                identity = self._identity.pop(session)
                self._load[identity] -= 1
                if not self._load[identity]:
                    del self._load[identity]
                self._active -= 1
                self.stats["ok" if ok else "failed"] += 1
                self.reports.append((session, attempt, ok, detail, owner))
                self._next_of(identity)

    def _next_of(self, identity: str) -> None:
        """Under the lock: the identity's next waiting contact starts; those that waited too long fail."""
        waiting = self._waiting.get(identity)
        now = self._clock()
        while waiting:
            session, since = waiting.popleft()
            self._n_waiting -= 1
            if now - since <= self.max_wait_s:
                self._enqueue(session, identity)
                break
            self.stats["waited_too_long"] += 1
            del self._identity[session]
            self.reports.append((session, self._attempt.pop(session), False,
                                 f"waited over {self.max_wait_s} s behind this receiver key's other contacts", None))
        if waiting is not None and not waiting:
            del self._waiting[identity]

    def close(self) -> None:
        for _ in self._workers:
            self._queue.put(None)

    @property
    def in_progress(self) -> int:
        return len(self._attempt)


class EdgeTransport(Transport):
    """The seam's edge half, alike for every engine: contacts run on `connector` (built by the
    subclass around its own `_contact`), their answers come back through `peer_reports`, and a
    room's final status goes out through `notifier` (the control plane's `push_status`).

    Submits the loop cannot make now (the engine is busy with a contact that may take a peer's
    time) are handed to one submit thread (`_hand`), which makes them in order with `_submit_now`;
    the loop reads their outcome from the write's own record, as for any other."""

    connector: Connector
    notifier: Callable[[Any, int, str, str], None] | None = None

    def _start_edge(self, notifier: Callable[[Any, int, str, str], None] | None) -> None:
        self.notifier = notifier
        self._handed: queue.SimpleQueue = queue.SimpleQueue()
        self._submitter: threading.Thread | None = None
        self.closed = False
        self.stats: Counter = Counter()

    def _hand(self, p: Any, i: int) -> None:
        self.stats["submits_handed"] += 1
        self._handed.put((p, i))
        if self._submitter is None:
            self._submitter = threading.Thread(target=self._submit_handed, name="epd-ring-submit", daemon=True)
            self._submitter.start()

    def _submit_now(self, p: Any, i: int) -> None:
        raise NotImplementedError

    def _submit_failed(self, p: Any, i: int) -> None:
        raise NotImplementedError

    def _submit_handed(self) -> None:
        while True:
            p, i = self._handed.get()
            if p is None:
                return
            try:
                self._submit_now(p, i)
            except Exception:  # a submit thread must not die; the write fails
                self._submit_failed(p, i)

    def close(self) -> None:
        # Refusing new writes is what closing means here (the engine is released with this object).
        self.closed = True
        self.connector.close()
        self._handed.put((None, 0))

    def connect(self, session: str, attempt: int, identity: str = "", probe: bool = False) -> bool | None:
        """Start first contact with `session` on the connector (or, `probe`, the heartbeat of an up
        peer); the answer comes from `peer_reports`."""
        return None if self.connector.start(session, attempt, identity, probe) else False

    def peer_reports(self) -> list[tuple[Any, ...]]:
        reports = self.connector.reports
        out = []
        while reports:
            out.append(reports.popleft())
        return out

    def notify(self, frame: Any, room: int, status: str, reason: str = "") -> None:
        if self.notifier is not None:
            self.notifier(frame, room, status, reason)
