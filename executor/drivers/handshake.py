"""The segment handshake, done by us: no peer's pace reaches the engine's lock.

Mooncake (0.3.13, P2PHANDSHAKE) opens a peer's segment by asking the peer's handshake port for its
segment descriptor, under a mutex that every `transfer_submit_write` also takes. Its 60 s is a
timeout per socket read, not a deadline: a peer that answers the probe and then trickles its reply
one byte every few seconds held that mutex, and so every write to every receiver, for hours.

So the engine never meets a peer's handshake port:
- `fetch` asks the peer for its descriptor ourselves, on a connector thread, holding no lock of the
  engine's, within a total deadline (every `recv` gets only what is left of it);
- `Relay.open` hands the descriptor to the engine: a listener of ours on a loopback address never
  used before answers the engine's request at once, and the engine caches the segment under that
  name. A listener still open at `timeout_s` is closed, so the engine's read fails at once: the
  mutex is held for as long as our own thread takes, never a peer.
Data still goes straight to the peer: the engine's TCP lanes dial the address inside the descriptor
(`tcp_data_host`, `tcp_data_port`), not the name the segment was opened under.

The exchange, as the engine speaks it: a little-endian u64 length (counting the type byte), a type
byte (1: metadata), then JSON. The peer ignores the JSON a requester sends and answers with its own
descriptor, framed the same way.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import socket
import struct
import threading
import time
from collections.abc import Callable

_HEADER = struct.Struct("<QB")
METADATA = 1
MAX_DESCRIPTOR = 1 << 20  # the engine's own cap on a handshake message (MC_HANDSHAKE_MAX_LENGTH)


class HandshakeError(Exception):
    """The peer's descriptor could not be had within the deadline, or is not one."""


def frame(kind: int, body: bytes) -> bytes:
    return _HEADER.pack(len(body) + 1, kind) + body


def _recv_exactly(sock: socket.socket, n: int, deadline: float, clock: Callable[[], float]) -> bytes:
    """`n` bytes, all before `deadline`: a peer that sends one byte at a time gets no more time."""
    out = bytearray()
    while len(out) < n:
        left = deadline - clock()
        if left <= 0:
            raise HandshakeError(f"deadline passed with {len(out)} of {n} bytes read")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(out))
        except TimeoutError:
            raise HandshakeError(f"deadline passed with {len(out)} of {n} bytes read") from None
        if not chunk:
            raise HandshakeError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def read_frame(sock: socket.socket, deadline: float, clock: Callable[[], float] = time.monotonic,
               max_bytes: int = MAX_DESCRIPTOR) -> tuple[int, bytes]:
    """(type, body) of one framed message, read before `deadline`."""
    length, kind = _HEADER.unpack(_recv_exactly(sock, _HEADER.size, deadline, clock))
    if not 1 <= length <= max_bytes + 1:
        raise HandshakeError(f"a handshake message of {length} bytes (at most {max_bytes + 1})")
    return kind, _recv_exactly(sock, length - 1, deadline, clock)


def split_session(session: str) -> tuple[str, int]:
    host, sep, port = session.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise HandshakeError(f"not a host:port session: {session!r:.80}")
    return host, int(port)


def check_descriptor(body: bytes) -> dict:
    """The descriptor as JSON; HandshakeError if it is not one the engine could open."""
    try:
        desc = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise HandshakeError(f"the descriptor is not JSON ({exc})") from None
    if not isinstance(desc, dict) or not isinstance(desc.get("buffers"), list):
        raise HandshakeError("the descriptor names no buffers")
    return desc


def same_segment(a: bytes, b: bytes) -> bool:
    """Do two descriptors describe the same segment (the peer's reply stamps the time it was made)?"""
    x, y = json.loads(a), json.loads(b)
    x.pop("timestamp", None)
    y.pop("timestamp", None)
    return bool(x == y)


def fetch(session: str, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> bytes:
    """The segment descriptor `session`'s handshake port gives, within `timeout_s` in all."""
    host, port = split_session(session)
    deadline = clock() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=max(deadline - clock(), 0.001)) as sock:
            sock.settimeout(max(deadline - clock(), 0.001))
            sock.sendall(frame(METADATA, b"{}"))
            kind, body = read_frame(sock, deadline, clock)
    except OSError as exc:  # refused, unreachable, or the connect or send ran out of time
        raise HandshakeError(f"{type(exc).__name__}: {exc}") from None
    if kind != METADATA:
        raise HandshakeError(f"answered a metadata request with a message of type {kind}")
    check_descriptor(body)
    return body


class Relay:
    """Hands a fetched descriptor to the engine from a loopback listener of ours.

    Each open gets an address of 127.0.0.0/8 this process has not used before (over 16 million), so
    a name the engine has cached never comes back for another segment. Addresses are drawn from
    127.1.0.1 up (127.0.0.1, the usual loopback, stays clear of them)."""

    _addresses = itertools.count()
    _lock = threading.Lock()

    def __init__(self, timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.clock = clock
        self.served = 0
        self.expired = 0

    @classmethod
    def _next_address(cls) -> str:
        with cls._lock:
            n = next(cls._addresses)
        if n >= 254 * 256 * 254:
            raise HandshakeError("every loopback address has named a segment in this process")
        a, rest = divmod(n, 256 * 254)
        b, c = divmod(rest, 254)
        return str(ipaddress.IPv4Address(f"127.{a + 1}.{b}.{c + 1}"))

    def open(self, descriptor: bytes, engine_open: Callable[[str], int]) -> tuple[str, int]:
        """(the name the engine cached the segment under, `engine_open(name)`'s rc).

        `engine_open` makes the engine open the segment (a 0-byte read) on this thread; the
        listener answers it from another, and is closed by `timeout_s` whatever happened."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((self._next_address(), 0))
            listener.listen(1)
            host, port = listener.getsockname()
            deadline = self.clock() + self.timeout_s
            server = threading.Thread(target=self._serve, args=(listener, descriptor, deadline),
                                      name="epd-ring-relay", daemon=True)
            server.start()
            rc = engine_open(f"{host}:{port}")
        finally:
            listener.close()  # an accept still waiting returns at once
        server.join(max(deadline - self.clock(), 0.0) + 1.0)
        return f"{host}:{port}", rc

    def _serve(self, listener: socket.socket, descriptor: bytes, deadline: float) -> None:
        """One request, answered with `descriptor`; whatever is open at the deadline is closed."""
        try:
            listener.settimeout(max(deadline - self.clock(), 0.001))
            conn, _ = listener.accept()
        except OSError:
            self.expired += 1
            return
        finally:
            listener.close()  # one request: an engine dialling later is refused, never left waiting
        with conn:
            try:
                read_frame(conn, deadline, self.clock)  # the engine's own descriptor: not needed
                conn.settimeout(max(deadline - self.clock(), 0.001))
                conn.sendall(frame(METADATA, descriptor))
                conn.shutdown(socket.SHUT_WR)
                self.served += 1
            except (OSError, HandshakeError):
                self.expired += 1
