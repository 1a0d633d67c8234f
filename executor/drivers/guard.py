"""Caps on the TCP connections a keyless client, or an allow-listed key, can hold open on the
control plane's socket.

libzmq has no per-source connection limit, and a connection that never completes
its CURVE handshake never reaches the ZAP handler (ZAP is asked only after the
client's INITIATE), so an allow-list alone cannot stop idle connections from
eating file descriptors. What libzmq offers:

- `ZMQ_HANDSHAKE_IVL`: a connection whose handshake has not completed by then is
  closed (30 s by default; the control plane sets 2 s). Alone it bounds the
  descriptors an attacker holds to its connection rate times the interval.
- The socket monitor: `EVENT_ACCEPTED` and `EVENT_DISCONNECTED` carry the
  connection's file descriptor, in order, from libzmq's one I/O thread.

`ConnectionGuard` reads those events on every poll, learns each new connection's
source address (`getpeername` on a duplicate of its descriptor) and, when a
source holds more than `per_source` connections still within the handshake window,
or all sources together more than `max_pending`, shuts the newest down with
`shutdown(2)` on the duplicate. libzmq still owns the descriptor: it sees the
connection end, reports it and closes it itself (closing it under libzmq would
let it act on a reused number).

Past the handshake window a connection is authenticated, and counted by what it
has said. Each message carries its connection's descriptor (`ZMQ_SRCFD`) and its
key (the ZAP User-Id), so the first message a connection carries binds it to its
key (`attribute`): a key holds at most `per_key` connections that have spoken;
past that, the one it was heard from least recently is shut down (a dead one goes
before a live one: a rank restarted after its host died is not locked out by its
own ghost until the heartbeat finds it). A connection that completed its
handshake and has said nothing has no key the guard can see: those are capped per
source and in all, as young ones are, and shed the longest silent first, so a key
that opens connections and never speaks loses its own old ones, and a receiver
that says hello as it connects (the reference receiver does: `HELLO`) is bound to
its key at once and never counted among them.

A descriptor number can be reused between the event and the shutdown; before
acting the guard checks the descriptor is still a TCP socket on our listening port
from the same source, so the worst a reuse can do is shut down another
connection from the same source.

Alternatives weighed: a ZAP handler sees only connections that completed the
first half of the handshake (not idle ones); `ZMQ_TCP_ACCEPT_FILTER` is an
allow-list of addresses, not a count, and deprecated; an accept front of our own
(a thread relaying bytes into libzmq) would cap exactly but adds a thread and a
copy on every frame, and the relayed connections would all come from 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class ConnectionGuard:
    """Caps on one listening socket's connections: young (unauthenticated) and silent ones per source and
    in all, those that have spoken per key."""

    def __init__(self, sock: zmq.Socket, listen_port: int, *, per_source: int, max_pending: int,
                 handshake_s: float, per_key: int = 64, max_unread_bytes: int = 64 << 20,
                 bytes_check_s: float = 0.02, silent_check_s: float = 0.05, max_events_per_poll: int = 4096,
                 max_checks_per_poll: int = 32):
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self.port = listen_port
        self.per_source = per_source
        self.max_pending = max_pending
        # A connection older than this has completed its handshake (libzmq closes the others at
        # handshake_s); the margin covers libzmq's timer granularity.
        self.young_s = handshake_s + 0.5
        self.max_events = max_events_per_poll
        self.live: dict[int, tuple[str, float]] = {}  # fd -> (source address, accepted at)
        self.per_key = per_key
        self.key_of: dict[int, str] = {}  # fd -> the key its first message carried
        self.heard: dict[str, dict[int, float]] = {}  # key -> {fd: when its connection last carried a message}
        self.silent_check_s = silent_check_s
        self._silent_checked_at = 0.0
        self.stats: Counter = Counter()
        # Bytes a source sent that were not read as messages yet (the message cap, below).
        self.max_unread_bytes = max_unread_bytes
        self.bytes_check_s = bytes_check_s
        self._checked_at = 0.0
        self.received: dict[int, int] = {}  # fd -> the kernel's bytes_received at the last check
        self.received_by: Counter = Counter()  # source -> bytes of all its connections, at their last check
        # source -> wire bytes of the messages read from it, and those written off with a closed connection
        self.delivered: Counter = Counter()
        self.connections_from: Counter = Counter()  # source -> connections ever accepted
        self.most_unread = 0  # the largest unread backlog of one source seen (for figures)
        self.max_checks = max_checks_per_poll
        self._cursor = 0

    def poll(self, budget_s: float = 0.004) -> int:
        """Read pending monitor events for at most about `budget_s` and shut down connections over
        the caps; return how many. Events left over wait in the monitor's queue for the next poll
        (when it fills, libzmq's I/O thread waits for us, and accepts nothing meanwhile)."""
        events: list[tuple[int, int]] = []
        deadline = time.perf_counter() + budget_s
        while len(events) < self.max_events:
            if len(events) & 15 == 15 and time.perf_counter() > deadline:
                self.stats["polls_out_of_time"] += 1
                break
            try:
                msg = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            events.append((msg["event"], msg["value"]))
        if not events:
            return 0
        # A descriptor closed later in this batch may already carry another connection: only the
        # last acceptance of each number, not followed by its close, is looked up.
        last_close = {fd: i for i, (ev, fd) in enumerate(events) if ev == zmq.EVENT_DISCONNECTED}
        now = time.monotonic()
        fresh: list[int] = []
        for i, (ev, fd) in enumerate(events):
            if ev == zmq.EVENT_ACCEPTED:
                self.stats["accepted"] += 1
                if last_close.get(fd, -1) > i:
                    continue
                source = _peer_of(fd, self.port)
                if source is not None:
                    self.live[fd] = (source, now)
                    self.received[fd] = 0
                    self.connections_from[source] += 1
                    fresh.append(fd)
            elif ev == zmq.EVENT_DISCONNECTED:
                self._forget(fd)
        shed = self._enforce(fresh, now) if fresh else 0
        return shed

    def _forget(self, fd: int) -> None:
        key = self.key_of.pop(fd, None)
        if key is not None:
            fds = self.heard[key]
            del fds[fd]
            if not fds:
                del self.heard[key]
        gone = self.live.pop(fd, None)
        got = self.received.pop(fd, 0)
        if gone is not None:
            # libzmq drops a partial message with its connection, so what the source has unread is
            # written off up to what this connection received. Kept, the cut message would hold the
            # source over the cap for good, and every connection of it that sends (an honest
            # receiver's on the same address) would be cut in turn.
            unread = self.unread(gone[0])
            if unread > 0:
                self.delivered[gone[0]] += min(unread, got)

    def unread(self, source: str) -> int:
        """Bytes `source` sent that were not read as messages (nor written off), as last checked. A
        connection's handshake is received and never read as a message: allowed for."""
        return self.received_by[source] - self.delivered[source] - _HANDSHAKE_BYTES * self.connections_from[source]

    # the message cap ---------------------------------------------------------------------
    def read_from(self, source: str, wire_bytes: int) -> None:
        """The control plane read a message (or discarded parts) of `wire_bytes` from `source`."""
        self.delivered[source] += wire_bytes

    def check_bytes(self) -> int:
        """Shut down a connection whose source has more than `max_unread_bytes` received but not
        read as messages, while it keeps sending. libzmq buffers a multipart message whole before
        any part is readable (and caps neither parts nor total bytes), so the kernel's count of
        bytes received on each connection (TCP_INFO) against the bytes read from its source is the
        one measure of what libzmq holds. Return how many were shut down."""
        now = time.monotonic()
        if now - self._checked_at < self.bytes_check_s or not self.live:
            return 0
        self._checked_at = now
        # A look costs about 10-40 us (four system calls): at most `max_checks` connections per
        # check, in turn, the others counted at their last reading.
        fds = list(self.live)
        start = self._cursor % len(fds)
        batch = (fds[start:] + fds[:start])[:self.max_checks]
        self._cursor = start + len(batch)
        grew: dict[str, tuple[int, int]] = {}  # source -> (largest growth, its fd)
        for fd in batch:
            source = self.live[fd][0]
            got = _bytes_received(fd, self.port, source)
            if got is None:
                continue
            before = self.received.get(fd, 0)
            self.received[fd] = got
            if got > before:
                self.received_by[source] += got - before
                if got - before > grew.get(source, (0, -1))[0]:
                    grew[source] = (got - before, fd)
        if not grew:
            return 0
        shed = 0
        for source, (_, fd) in grew.items():
            unread = self.unread(source)
            self.most_unread = max(self.most_unread, unread)
            if unread > self.max_unread_bytes and _shut(fd, self.port, source):
                shed += 1
                self.stats["shed_unread_bytes"] += 1
                self._forget(fd)
        return shed

    # connections past their handshake --------------------------------------------------
    def attribute(self, fd: int, source: str, key: str) -> None:
        """A message from `key` came in on connection `fd` from `source` (its `ZMQ_SRCFD` and
        Peer-Address). Bind the connection to the key on its first message; when that takes the key
        past `per_key` connections, shut down the one of its connections heard from least recently.
        Only the key's own connections are ever shut down here."""
        if self.live.get(fd, ("",))[0] != source:
            # Its acceptance is queued before its first message, but may still wait in the monitor's
            # queue (a poll out of time on a loaded machine): read it now, so the first message binds.
            self.poll()
            if self.live.get(fd, ("",))[0] != source:
                return  # a descriptor the events have not shown us: bound by a later message
        now = time.monotonic()
        bound = self.key_of.get(fd)
        if bound is not None:
            self.heard[bound][fd] = now
            return
        self.key_of[fd] = key
        fds = self.heard.setdefault(key, {})
        fds[fd] = now
        if not key or len(fds) <= self.per_key:
            return  # without authentication every connection has the same empty key: not capped
        quiet = min(fds, key=fds.__getitem__)
        if _shut(quiet, self.port, self.live[quiet][0]):
            self.stats["shed_per_key"] += 1
        self._forget(quiet)

    def check_silent(self) -> int:
        """Shut down connections past their handshake that have said nothing, the longest silent
        first, while a source holds more than `per_source` of them or all sources more than
        `max_pending`. Return how many."""
        now = time.monotonic()
        if now - self._silent_checked_at < self.silent_check_s:
            return 0
        self._silent_checked_at = now
        if len(self.live) - len(self.key_of) <= min(self.per_source, self.max_pending):
            return 0  # too few unbound connections to be over either cap: no need to look
        silent = sorted((t, fd, src) for fd, (src, t) in self.live.items()
                        if now - t >= self.young_s and fd not in self.key_of)
        over = len(silent) - self.max_pending
        per_source = Counter(src for _, _, src in silent)
        if over <= 0 and all(n <= self.per_source for n in per_source.values()):
            return 0
        shed = 0
        for _, fd, source in silent:  # the oldest first
            if over <= 0 and per_source[source] <= self.per_source:
                continue
            if _shut(fd, self.port, source):
                shed += 1
                self.stats["shed_silent"] += 1
            over -= 1
            per_source[source] -= 1
            self._forget(fd)
        return shed

    def _enforce(self, fresh: list[int], now: float) -> int:
        young = {fd: src for fd, (src, t) in self.live.items() if now - t < self.young_s}
        per_source = Counter(young.values())
        total = len(young)
        shed = 0
        for fd in reversed(fresh):  # the newest first
            source = young.get(fd)
            if source is None:
                continue
            if per_source[source] > self.per_source or total > self.max_pending:
                if _shut(fd, self.port, source):
                    shed += 1
                    self.stats["shed_per_source" if per_source[source] > self.per_source else "shed_pending"] += 1
                per_source[source] -= 1
                total -= 1
                self._forget(fd)  # its DISCONNECTED event follows; forgetting twice is harmless
        return shed

    def connections(self) -> int:
        """Connections libzmq holds on the socket, as the events so far tell."""
        return len(self.live)

    def close(self) -> None:
        self.monitor.close(linger=0)


def _dup(fd: int) -> socket.socket | None:
    try:
        return socket.socket(fileno=os.dup(fd))  # family and type read from the descriptor itself
    except OSError:
        return None


def _matches(s: socket.socket, port: int) -> Any:
    """The source address if `s` is a TCP connection accepted on `port`, else None."""
    try:
        if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        if s.getsockname()[1] != port:
            return None
        return s.getpeername()[0]
    except OSError:
        return None


def _peer_of(fd: int, port: int) -> str | None:
    s = _dup(fd)
    if s is None:
        return None
    try:
        return _matches(s, port)
    finally:
        s.close()  # closes the duplicate only


def _shut(fd: int, port: int, source: str) -> bool:
    s = _dup(fd)
    if s is None:
        return False
    try:
        if _matches(s, port) != source:
            return False  # the number was reused by something else: leave it alone
        s.shutdown(socket.SHUT_RDWR)  # acts on the connection, seen by libzmq's own descriptor
        return True
    except OSError:
        return False
    finally:
        s.close()


# A CURVE client's greeting, HELLO and INITIATE (with its metadata), received on every connection
# and never read as a message; rounded up.
_HANDSHAKE_BYTES = 1024
_TCPI_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received in Linux's struct tcp_info (4.1+)


def wire_bytes(parts: Any, curve: bool) -> int:
    """The bytes `parts` took on the wire, as ZMTP 3 frames them: each part a frame (flags and a
    1- or 8-byte size), inside a CURVE MESSAGE command (name, nonce, flags and MAC: 33 bytes)."""
    total = 0
    for part in parts:
        n = len(part) + (33 if curve else 0)
        total += n + (2 if n <= 255 else 9)
    return total


def _bytes_received(fd: int, port: int, source: str) -> int | None:
    s = _dup(fd)
    if s is None:
        return None
    try:
        if _matches(s, port) != source:
            return None
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < _TCPI_BYTES_RECEIVED + 8:
            return None  # a kernel before 4.1: the message cap cannot be kept
        return int.from_bytes(info[_TCPI_BYTES_RECEIVED:_TCPI_BYTES_RECEIVED + 8], "little")
    except OSError:
        return None
    finally:
        s.close()


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's descriptor limit (soft) to its hard limit; return (soft, hard) after."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft, hard


__all__ = ["ConnectionGuard", "raise_fd_limit", "wire_bytes"]
