"""The control plane over ZMQ: authenticated registration frames in, authenticated status pushes out.

Frames arrive on one PULL socket, read with NOBLOCK from the encode loop's
`Pump.tick()` (through `Pump.sources`), so no listener thread is needed.

Authentication is ZeroMQ CURVE with an allow-list of receiver public keys. The
ZAP handler that checks each connecting key is a REP socket in this context,
also polled without blocking from `poll()`, rather than pyzmq's
ThreadAuthenticator: a thread would work, but the loop already polls, keeping it
there means no lock around the allow-list and a handshake storm costs a bounded
number of answers per tick. A connection whose key is not on the list is refused
during the handshake, before any frame of it is read. Each frame then carries
the key that sent it (ZMQ's User-Id) as `ReceiverFrame.identity`, which the core
binds rooms and sessions to.

Status pushes go out on a PUSH socket per (endpoint, identity), as a CURVE client
whose server key is that identity's own key: only the receiver holding it can
accept them, and it knows they came from this encoder because it allow-lists
our key. Sent with NOBLOCK over a small high-water mark: a dead or slow
receiver costs a dropped, counted status, never a blocked loop (H4). A notice is
`[room, status, session, reason]`, and a fifth part, the region's `dst_ptr`, for a
receiver whose frame said it reads it (wire format /3): a receiver that offered two
regions for one room can tell which one a notice concerns.

Every edge is bounded: parts per message (counted before the rest is read;
an oversized message is discarded across polls, so one poll's work stays
bounded), bytes per part (refused alone: the identity's following frames are kept),
frames per poll and per identity per poll, the time one poll spends, ZAP answers per
poll, the status-socket pool (below the context's socket limit), and log lines.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

from ..core import settings
from ..core.frames import _WIRE_PARTS, FrameError, ReceiverFrame, frame_from_parts, numeric_endpoint
from ..core.ratelog import RateLimitedLog
from ..core.regions import WITHDRAW_MAGIC, WithdrawError, withdraw_from_parts
from .guard import ConnectionGuard, raise_fd_limit, wire_bytes

log = logging.getLogger("epd_ring.control")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ENV_SECRET = "EPD_RING_SECRET_KEY"  # this side's CURVE secret key (z85), or a path to a secret key file
ENV_ALLOWED = "EPD_RING_ALLOWED_KEYS"  # receivers' public keys: z85 keys, files or directories, comma-separated
ENV_ENCODER = "EPD_RING_ENCODER_KEY"  # a receiver's view: the encoder's public key (z85 or file)
# What a receiver sends as it connects: it binds the connection to the receiver's key at once, so the
# guard never counts it among connections that completed a handshake and said nothing.
HELLO = b"epd-ring/hello/1"
# The answer to a hello that names its status endpoint (`[HELLO, endpoint, number]`): this control
# plane's incarnation, drawn at start, and the hello's number (at most 20 digits), if it had one. A
# receiver that hears a new one knows the encoder it offered its regions to is gone, with every room
# it held (docs/mooncake.md, "Encoder incarnations").
INCARNATION = b"epd-ring/incarnation/1"


# -- keys ----------------------------------------------------------------------------------
def generate_keypair() -> tuple[bytes, bytes]:
    """A fresh CURVE (public, secret) pair, z85-encoded."""
    return zmq.curve_keypair()


def _key_from(text: str, want_secret: bool = False) -> bytes:
    text = text.strip()
    if len(text) == 40 and not os.path.exists(text):
        key = text.encode()
        z85.decode(key)  # raises on a malformed key
        return key
    if not os.path.isfile(text):
        raise ValueError(f"{text[:48]!r} is neither a 40-character z85 key nor a key file")
    public, secret = zmq.auth.load_certificate(text)
    if want_secret:
        if secret is None:
            raise ValueError(f"{text} holds no secret key")
        return secret
    return public


def check_keypair(keypair: Any) -> tuple[bytes, bytes]:
    """(public, secret) as z85 bytes, refused with a clear error unless both are 40-character z85
    keys and the public key is the secret's (a swapped or mismatched pair would fail every
    handshake later, with no error saying why)."""
    if not isinstance(keypair, (tuple, list)) or len(keypair) != 2:
        raise TypeError(f"keypair must be a (public, secret) pair of z85 keys, got {type(keypair).__name__}")
    out = []
    for name, key in zip(("public", "secret"), keypair):
        if isinstance(key, str):
            key = key.encode()
        if not isinstance(key, bytes):
            raise TypeError(f"keypair: the {name} key must be z85 bytes or str, got {type(key).__name__}")
        try:
            if len(key) != 40:
                raise ValueError
            z85.decode(key)
        except (ValueError, KeyError):  # pyzmq's decoder raises KeyError on a character outside z85
            raise ValueError(f"keypair: the {name} key is not a 40-character z85 key") from None
        out.append(key)
    public, secret = out
    if zmq.curve_public(secret) != public:
        raise ValueError("keypair: the public key is not the secret key's")
    return public, secret


def load_keypair(spec: str) -> tuple[bytes, bytes]:
    """(public, secret) from a z85 secret key or a zmq.auth secret-key file."""
    secret = _key_from(spec, want_secret=True)
    return zmq.curve_public(secret), secret


def load_public_keys(spec: str | Iterable[Any]) -> set[bytes]:
    """Public keys from z85 strings, zmq.auth certificate files or directories of them."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    keys: set[bytes] = set()
    for item in items:
        if isinstance(item, bytes):
            item = item.decode()
        item = str(item).strip()
        if not item:
            continue
        if os.path.isdir(item):
            for path in sorted(Path(item).glob("*.key")):
                keys.add(zmq.auth.load_certificate(str(path))[0])
        else:
            keys.add(_key_from(item))
    return keys


def keys_from_env() -> tuple[tuple[bytes, bytes] | None, set[bytes]]:
    """This side's keypair and the allowed receiver keys from EPD_RING_SECRET_KEY / EPD_RING_ALLOWED_KEYS."""
    secret = os.environ.get(ENV_SECRET)
    allowed = os.environ.get(ENV_ALLOWED, "")
    return (load_keypair(secret) if secret else None), load_public_keys(allowed)


class ZapAuthenticator:
    """The ZAP handler: answers each CURVE handshake from the allow-list of receiver keys.

    A REP socket in the control plane's context, polled without blocking from its `poll()` (a bounded
    number of answers per poll), rather than pyzmq's ThreadAuthenticator: no lock around the list."""

    def __init__(self, max_per_poll: int, stats: Counter, log: RateLimitedLog):
        self.allowed: set[bytes] = set()
        self.max_per_poll = max_per_poll
        self.stats, self.log = stats, log
        self.sock: zmq.Socket | None = None  # listening once `listen` ran (not when insecure)

    def allow(self, *keys: Any) -> None:
        self.allowed |= load_public_keys(keys)

    def listen(self, ctx: zmq.Context) -> None:
        # Bound before any CURVE socket: libzmq lets every handshake through when no ZAP handler is listening.
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)

    def answer(self) -> int:
        """Answer the handshakes waiting, at most `max_per_poll`; return how many."""
        zap = self.sock
        n = 0
        while zap is not None and n < self.max_per_poll:
            try:
                msg = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            version, request_id = (msg + [b"", b""])[:2]
            mechanism = msg[5] if len(msg) > 5 else b""
            key = msg[6] if len(msg) > 6 else b""
            if version == b"1.0" and mechanism == b"CURVE" and len(key) == 32 and z85.encode(key) in self.allowed:
                user = z85.encode(key)
                zap.send_multipart([b"1.0", request_id, b"200", b"OK", user, b""])
                self.stats["zap_allowed"] += 1
            else:
                zap.send_multipart([b"1.0", request_id, b"400", b"key not allowed", b"", b""])
                self.stats["zap_denied"] += 1
                self.log.warning("zap", "refused a control connection from %s: key not on the allow-list",
                                 msg[3].decode("ascii", "replace") if len(msg) > 3 else "?")
        return n

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)


class FrameReader:
    """Reads whole messages off the frame socket, with every part bounded: a message with too many parts
    is refused and its parts discarded, across polls if need be; one with a part too big is refused alone."""

    def __init__(self, pull: zmq.Socket, guard: ConnectionGuard | None, keyed: bool, max_part_bytes: int,
                 stats: Counter, log: RateLimitedLog):
        self.pull, self.guard, self.keyed, self.max_part_bytes = pull, guard, keyed, max_part_bytes
        self.stats, self.log = stats, log
        self.discarding = False  # mid-way through discarding a refused message's parts
        self.discard_source = ""  # the source address of the message being discarded

    def discard(self, deadline: float) -> int:
        """Discard parts of a refused message until it ends or `deadline`; the rest waits for the next poll."""
        n = 0
        while not (n & 1023 == 1023 and time.perf_counter() > deadline):
            try:
                part = self.pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # cannot happen mid-message; be safe anyway
                self.discarding = False
                break
            n += 1
            if self.guard is not None:
                self.guard.read_from(self.discard_source, wire_bytes((part,), self.keyed))
            if not part.more:
                self.discarding = False
                break
        self.stats["parts_discarded"] += n
        self.stats["parts_drained"] += n  # deprecated name of parts_discarded, kept for one release
        return n

    def read(self) -> tuple[str, list[bytes] | None] | None:
        """The next message as (identity, parts), parts None if refused; None when nothing is queued."""
        try:
            first = self.pull.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        identity = first.get("User-Id") if self.keyed else ""
        parts = [first]
        too_big = len(first) > self.max_part_bytes
        part = first
        # The count is checked part by part, before the rest is read.
        while part.more and len(parts) < _WIRE_PARTS:
            part = self.pull.recv(zmq.NOBLOCK, copy=False)
            parts.append(part)
            too_big = too_big or len(part) > self.max_part_bytes
        if self.guard is not None:
            source = first.get("Peer-Address")
            self.guard.read_from(source, wire_bytes(parts, self.keyed))
            self.guard.attribute(first.get(zmq.SRCFD), source, identity)
        if part.more:
            self.discarding = True
            self.discard_source = source if self.guard is not None else ""
            self.stats["frames_refused"] += 1
            self.stats["frames_too_many_parts"] += 1
            self.log.warning("parts", "refused a control message from %s with more than %d parts", identity[:8] or "?",
                             _WIRE_PARTS)
            return identity, None
        if too_big:
            self.stats["frames_refused"] += 1
            self.stats["frames_oversized"] += 1
            self.log.warning("size", "refused a control message from %s with a part over %d bytes", identity[:8] or "?",
                             self.max_part_bytes)
            return identity, None
        return identity, [p.bytes for p in parts]


class StatusSockets:
    """Status pushes out: one PUSH socket per (endpoint, identity), in a pool evicted oldest first.

    Each is a CURVE client whose server key is that identity's own: only the receiver holding it can
    accept them. Sent with NOBLOCK over a small high-water mark: a dead or slow receiver costs a dropped,
    counted status, never a blocked loop."""

    def __init__(self, ctx: zmq.Context, keypair: tuple[bytes, bytes] | None, max_sockets: int, hwm: int,
                 stats: Counter, log: RateLimitedLog):
        self.ctx, self.keypair, self.max_sockets, self.hwm = ctx, keypair, max_sockets, hwm
        self.stats, self.log = stats, log
        self.pool: OrderedDict[tuple[str, str], zmq.Socket] = OrderedDict()
        self.endpoints_ok: set[str] = set()  # endpoints already dialled (numeric, so no blocking lookup)

    def socket(self, endpoint: str, identity: str) -> zmq.Socket:
        key = (endpoint, identity)
        sock = self.pool.get(key)
        if sock is not None:
            self.pool.move_to_end(key)
            return sock
        if len(self.pool) >= self.max_sockets:
            _, old = self.pool.popitem(last=False)
            old.close(linger=0)
            self.stats["status_sockets_evicted"] += 1
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        if self.keypair is not None:
            # The receiver's status socket serves with the same key it authenticated with,
            # so nobody else can accept its statuses.
            public, secret = self.keypair
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_serverkey = identity.encode()
        sock.connect(endpoint)
        self.pool[key] = sock
        self.endpoints_ok.add(endpoint)
        if len(self.endpoints_ok) > 4 * self.max_sockets:
            self.endpoints_ok.clear()  # a cache of checked endpoints, not a record
        return sock

    def send(self, endpoint: str, identity: str, parts: list[bytes], room: int | None = None,
             sent: str = "status_sent") -> None:
        """Send `parts` to the status socket at `endpoint` serving `identity`'s key, never blocking."""
        if endpoint not in self.endpoints_ok and not numeric_endpoint(endpoint):
            # Never dialled: libzmq would resolve a host name with a blocking lookup on its one I/O
            # thread, stalling every socket of the context. The core refuses such frames; this
            # guards every other way an endpoint can reach here (a withdraw, a hello, a caller).
            self.stats["status_endpoint_refused"] += 1
            self.log.warning("endpoint", "refused to push a status to %r: not a numeric tcp://ADDRESS:PORT",
                             str(endpoint)[:64])
            return
        if self.keypair is not None and not identity:
            self.stats["status_without_identity"] += 1  # a frame that did not come through this plane
            return
        try:
            self.socket(endpoint, identity).send_multipart(parts, zmq.NOBLOCK)
            self.stats[sent] += 1
        except zmq.Again:
            self.stats["status_dropped"] += 1  # queue full: the receiver is gone or stuck
        except zmq.ZMQError as exc:
            self.stats["status_errors"] += 1
            self.log.warning("status", "status for room %s to %s failed: %s", room, endpoint, exc)

    def close(self) -> None:
        for sock in self.pool.values():
            sock.close(linger=0)
        self.pool.clear()


class ZmqControlPlane:
    """Frames in, statuses out, polled from the encode loop. Its parts own their state: `auth` (the ZAP
    handler and the allow-list), `reader` (whole, bounded messages off the frame socket), `statuses`
    (the pool of status sockets) and `guard` (the frame socket's connections); the plane itself keeps
    the per-identity share of each poll (and the backlog of frames held back by it) and its
    incarnation, and hands each frame to the manager."""

    def __init__(self, pump: Any = None, bind: str = "tcp://127.0.0.1:0", *,
                 keypair: tuple[bytes, bytes] | None = None, allowed_keys: Iterable[Any] = (),
                 insecure: bool = False, max_frames_per_poll: int = 1024, max_frames_per_identity: int = 256,
                 max_backlog: int = 4096, max_poll_s: float = 0.010, max_part_bytes: int = 4096,
                 max_message_bytes: int = 1 << 20, max_zap_per_poll: int = 256, push_hwm: int = 64,
                 max_push_sockets: int = 512, handshake_s: float = 2.0, max_connections_per_source: int = 32,
                 max_pending_connections: int = 256, max_connections_per_key: int = 64,
                 max_unread_bytes: int = 64 << 20, heartbeat_s: float = 10.0):
        if keypair is None and not insecure:
            raise ValueError("the control plane needs a CURVE keypair and an allow-list of receiver keys "
                             "(see generate_keypair / keys_from_env); pass insecure=True to run without "
                             "authentication")
        # Checked like the manager's settings, naming the setting: a NaN poll bound compares false
        # and would never end a poll early, a zero pool could never hold a socket.
        if not isinstance(bind, str):
            raise TypeError(f"bind must be a str endpoint, got {type(bind).__name__}")
        max_frames_per_poll = settings.count("max_frames_per_poll", max_frames_per_poll, 1)
        max_frames_per_identity = settings.count("max_frames_per_identity", max_frames_per_identity, 1)
        max_backlog = settings.count("max_backlog", max_backlog)
        max_poll_s = settings.seconds("max_poll_s", max_poll_s)
        max_part_bytes = settings.count("max_part_bytes", max_part_bytes, 1)
        max_message_bytes = settings.count("max_message_bytes", max_message_bytes, max_part_bytes)
        max_zap_per_poll = settings.count("max_zap_per_poll", max_zap_per_poll, 1)
        push_hwm = settings.count("push_hwm", push_hwm, 1)
        max_push_sockets = settings.count("max_push_sockets", max_push_sockets, 1)
        handshake_s = settings.seconds("handshake_s", handshake_s)
        if handshake_s < 0.001:
            raise ValueError(f"handshake_s must be at least 1 ms (0 would disable the handshake timeout), "
                             f"got {handshake_s!r}")
        max_connections_per_source = settings.count("max_connections_per_source", max_connections_per_source, 1)
        max_pending_connections = settings.count("max_pending_connections", max_pending_connections, 1)
        # A key is a prefill instance's, shared by its ranks (a process and a connection each):
        # the cap must be above the most ranks an instance runs, or its last ranks cannot register.
        max_connections_per_key = settings.count("max_connections_per_key", max_connections_per_key, 1)
        max_unread_bytes = settings.count("max_unread_bytes", max_unread_bytes, max_message_bytes)
        heartbeat_s = settings.seconds("heartbeat_s", heartbeat_s)
        if heartbeat_s < 0.001:
            raise ValueError(f"heartbeat_s must be at least 1 ms, got {heartbeat_s!r}")
        if keypair is not None:
            keypair = check_keypair(keypair)
        self.insecure = keypair is None
        # Every descriptor the worker may need (see fd_budget) fits under the hard limit.
        self.fd_limit = raise_fd_limit()[0]
        self.ctx = zmq.Context()
        # The pool below must fit under the context's socket limit, with room for the
        # frame socket, the ZAP socket and evicted pool sockets that libzmq's reaper
        # thread has not released yet (closing is asynchronous; under churn they pile up: a burst
        # of 2,000 new endpoints on a 256-socket pool left over 450 unreaped, so twice the pool was
        # not room enough). Sockets are cheap; a status that cannot be sent is not.
        self.max_push_sockets = max_push_sockets
        self.ctx.MAX_SOCKETS = 8 * max_push_sockets + 64
        self.stats: Counter = Counter()
        self.log = RateLimitedLog(log, time.monotonic)
        self.auth = ZapAuthenticator(max_zap_per_poll, self.stats, self.log)
        self.public_key, self._secret = keypair or (None, None)
        if keypair is not None:
            self.auth.allow(*allowed_keys)
            self.auth.listen(self.ctx)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 100_000)
        # A hard stop for parts far past any frame (the connection is dropped); parts
        # between max_part_bytes and this are refused alone, keeping the connection.
        self.pull.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        # A connection that has not finished its handshake by then is closed (libzmq's default is
        # 30 s): with the guard below, what bounds a keyless client's descriptors.
        self.pull.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake_s * 1000)))
        # A PULL socket never writes, so a receiver whose host died would keep its connection (and
        # its place under its key's cap) for good: ZMTP heartbeats find it within 3 intervals.
        self.pull.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat_s * 1000)))
        self.pull.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(3 * heartbeat_s * 1000)))
        if not self.insecure:
            self.pull.curve_server = True
            self.pull.curve_secretkey = self._secret
            self.pull.setsockopt(zmq.ZAP_DOMAIN, b"epd-ring")
        if bind.endswith(":0"):
            self.pull.bind_to_random_port(bind[: bind.rindex(":")])
        else:
            self.pull.bind(bind)
        self.endpoint = self.pull.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.guard = None
        if self.endpoint.startswith("tcp://"):
            self.guard = ConnectionGuard(self.pull, int(self.endpoint.rsplit(":", 1)[1]),
                                         per_source=max_connections_per_source,
                                         max_pending=max_pending_connections, handshake_s=handshake_s,
                                         per_key=max_connections_per_key, max_unread_bytes=max_unread_bytes)
        self.max_pending_connections = max_pending_connections
        self.max_connections_per_key = max_connections_per_key
        self.reader = FrameReader(self.pull, self.guard, keypair is not None, max_part_bytes, self.stats, self.log)
        self.statuses = StatusSockets(self.ctx, keypair, max_push_sockets, push_hwm, self.stats, self.log)
        if self.fd_limit < self.fd_budget():
            log.warning("the descriptor limit (%d) is below what the control plane may need (%d, fd_budget()): "
                        "raise the hard limit (ulimit -Hn) or lower max_push_sockets", self.fd_limit,
                        self.fd_budget())
        if self.insecure:
            log.warning("control plane at %s runs WITHOUT authentication (insecure=True): any process that "
                        "can reach it can register, fail or take rooms", self.endpoint)
        self.max_frames_per_poll = max_frames_per_poll
        self.max_frames_per_identity = max_frames_per_identity
        self.max_backlog = max_backlog
        self.max_poll_s = max_poll_s
        # Frames of identities that had their share of a poll, for the next (per-identity fairness).
        self._backlog: deque[tuple[str, list[bytes]]] = deque()
        self.max_poll_seconds = 0.0  # the longest poll() so far (for benchmarks and health)
        self.manager = None
        # Drawn once per process: a restarted encoder (same address, same keys) is told apart by it.
        self.incarnation = os.urandom(8).hex().encode()
        if pump is not None:
            self.attach(pump)

    def fd_budget(self, peers: int = 0) -> int:
        """Descriptors the control plane may hold at once, plus `peers` transfer-engine peers.

        Each ZMQ socket holds a mailbox (an eventfd) and one descriptor per TCP connection; closed
        status sockets keep their mailbox until libzmq's reaper gets to them, up to the context's
        socket limit. On the frame socket the guard caps young connections and silent ones (past
        their handshake, nothing said) at `max_pending_connections` each, and those that have spoken
        at `max_connections_per_key` per allow-listed key. 256 covers the interpreter, torch, CUDA
        and the context's own threads, and a transfer-engine peer is counted at 4 (its handshake
        and data connections)."""
        sockets = self.ctx.MAX_SOCKETS  # every socket's mailbox, reaped or not
        return 256 + sockets + self.max_push_sockets + 2 * self.max_pending_connections \
            + len(self.allowed) * self.max_connections_per_key + 4 * peers

    def allow(self, *keys: Any) -> None:
        """Add receiver public keys (z85, certificate files or directories) to the allow-list."""
        self.auth.allow(*keys)

    def attach(self, pump: Any) -> None:
        """Read frames on every tick of `pump` (a `Pump`): each goes to its manager, and what the
        manager decides goes out with the pump's flush."""
        self.manager = pump.manager
        pump.sources.append(self.poll)

    # the parts' state, as the tests and tools read it -----------------------------------------
    @property
    def zap(self) -> zmq.Socket | None:
        """The ZAP handler's socket (None when insecure)."""
        return self.auth.sock

    @property
    def allowed(self) -> set[bytes]:
        """The allow-list of receiver public keys (z85)."""
        return self.auth.allowed

    @property
    def _push(self) -> OrderedDict[tuple[str, str], zmq.Socket]:
        return self.statuses.pool

    # frames in ---------------------------------------------------------------------------
    def _handle(self, identity: str, parts: list[bytes]) -> None:
        if parts and parts[0] == HELLO and len(parts) <= 3:
            self.stats["hellos"] += 1  # it bound its connection to its key (the guard)
            if len(parts) >= 2:  # and asks who we are, at its status endpoint (repeating its number)
                number = parts[2:] if parts[2:] and len(parts[2]) <= 20 and parts[2].isdigit() else []
                self.statuses.send(parts[1].decode("ascii", "replace"), identity,
                                   [INCARNATION, self.incarnation, *number], sent="incarnations_told")
            return
        if parts and parts[0] == WITHDRAW_MAGIC:
            self._withdraw(identity, parts)
            return
        try:
            frame = frame_from_parts(parts, identity=identity)
        except FrameError as exc:
            # Refused alone: nothing in it can be trusted, not even its room.
            self.stats["frames_refused"] += 1
            self.log.warning("malformed", "refused a control frame: %s", exc)
            return
        self.stats["frames"] += 1
        self.manager.register_receiver(frame)

    def _withdraw(self, identity: str, parts: list[bytes]) -> None:
        try:
            w = withdraw_from_parts(parts)
        except WithdrawError as exc:
            self.stats["withdraws_refused"] += 1
            self.log.warning("withdraw", "refused a withdraw: %s", exc)
            return
        self.stats["withdraws"] += 1
        # Bound to its sender like a frame: a withdraw may only name its own identity's rooms and sessions.
        self.manager.withdraw(w.room, w.session, w.status_endpoint, identity)

    def poll(self) -> int:
        t0 = time.perf_counter()
        deadline = t0 + self.max_poll_s
        if self.guard is not None:
            self.guard.poll()
            self.guard.check_bytes()
            self.guard.check_silent()
        self.auth.answer()
        reader = self.reader
        budget = self.max_frames_per_poll
        if reader.discarding:
            reader.discard(deadline)
            if reader.discarding:
                self._note(t0)
                return 0
        seen: Counter = Counter()
        n = 0
        cap = self.max_frames_per_identity
        # Frames held back from earlier polls first, each identity still within its cap.
        backlog = self._backlog
        for _ in range(len(backlog)):
            if n >= budget or (n & 7 == 7 and time.perf_counter() > deadline):
                break
            identity, parts = backlog.popleft()
            if seen[identity] >= cap:
                backlog.append((identity, parts))
                continue
            seen[identity] += 1
            n += 1
            self._handle(identity, parts)
        while n < budget:
            # A frame costs tens of microseconds when it reaches the manager: look at the
            # clock every few, so one poll stays within max_poll_s plus a few frames.
            if n & 7 == 7 and time.perf_counter() > deadline:
                self.stats["polls_out_of_time"] += 1
                break
            got = reader.read()
            if got is None:
                break
            n += 1
            if reader.discarding:
                reader.discard(deadline)
                if reader.discarding:
                    break
                continue
            identity, parts = got
            if parts is None:
                continue
            if seen[identity] >= cap:
                # This identity had its share of this poll: its frame waits, the others go on.
                if len(self._backlog) < self.max_backlog:
                    self._backlog.append((identity, parts))
                    self.stats["frames_held_back"] += 1
                else:
                    self.stats["frames_shed"] += 1
                    self.log.warning("shed", "shed a control frame from %s: backlog of %d full", identity[:8] or "?",
                                     self.max_backlog)
                continue
            seen[identity] += 1
            self._handle(identity, parts)
        self._note(t0)
        return n

    def _note(self, t0: float) -> None:
        took = time.perf_counter() - t0
        if took > self.max_poll_seconds:
            self.max_poll_seconds = took

    # statuses out ------------------------------------------------------------------------
    def push_status(self, frame: ReceiverFrame, room: int, status: str, reason: str = "") -> None:
        if not frame.status_endpoint:
            self.stats["status_without_endpoint"] += 1
            return
        parts = [b"%d" % room, status.encode(), frame.session.encode(), reason.encode()[:1024]]
        if getattr(frame, "region_notices", False):
            parts.append(b"%d" % frame.dst_ptr)  # which of its regions the notice concerns
        self.statuses.send(frame.status_endpoint, getattr(frame, "identity", ""), parts, room)

    def close(self) -> None:
        self.statuses.close()
        if self.guard is not None:
            self.guard.close()
        self.pull.close(linger=0)
        self.auth.close()
        self.ctx.term()
