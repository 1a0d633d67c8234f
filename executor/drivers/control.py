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
an oversized message is drained across polls, so one poll's work stays
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

from ..core.frames import _WIRE_PARTS, FrameError, ReceiverFrame, frame_from_parts
from ..core.ratelog import RateLimitedLog
from ..core.regions import WITHDRAW_MAGIC, WithdrawError, withdraw_from_parts

log = logging.getLogger("epd_ring.control")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ENV_SECRET = "EPD_RING_SECRET_KEY"  # this side's CURVE secret key (z85), or a path to a secret key file
ENV_ALLOWED = "EPD_RING_ALLOWED_KEYS"  # receivers' public keys: z85 keys, files or directories, comma-separated
ENV_ENCODER = "EPD_RING_ENCODER_KEY"  # a receiver's view: the encoder's public key (z85 or file)


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


class ZmqControlPlane:
    def __init__(self, pump: Any = None, bind: str = "tcp://127.0.0.1:0", *,
                 keypair: tuple[bytes, bytes] | None = None, allowed_keys: Iterable[Any] = (),
                 insecure: bool = False, max_frames_per_poll: int = 1024, max_frames_per_identity: int = 256,
                 max_backlog: int = 4096, max_poll_s: float = 0.010, max_part_bytes: int = 4096,
                 max_message_bytes: int = 1 << 20, max_zap_per_poll: int = 256, push_hwm: int = 64,
                 max_push_sockets: int = 512):
        if keypair is None and not insecure:
            raise ValueError("the control plane needs a CURVE keypair and an allow-list of receiver keys "
                             "(see generate_keypair / keys_from_env); pass insecure=True to run without "
                             "authentication")
        self.insecure = keypair is None
        self.ctx = zmq.Context()
        # The pool below must fit under the context's socket limit, with room for the
        # frame socket, the ZAP socket and evicted pool sockets that libzmq's reaper
        # thread has not released yet (closing is asynchronous; under churn they pile up: a burst
        # of 2,000 new endpoints on a 256-socket pool left over 450 unreaped, so twice the pool was
        # not room enough). Sockets are cheap; a status that cannot be sent is not.
        self.max_push_sockets = max_push_sockets
        self.ctx.MAX_SOCKETS = 8 * max_push_sockets + 64
        self.allowed: set[bytes] = set()
        self.stats: Counter = Counter()
        self.log = RateLimitedLog(log, time.monotonic)
        self.zap = None
        if not self.insecure:
            self.public_key, self._secret = keypair
            self.allow(*allowed_keys)
            # Bound before any CURVE socket: libzmq lets every handshake through when
            # no ZAP handler is listening.
            self.zap = self.ctx.socket(zmq.REP)
            self.zap.setsockopt(zmq.LINGER, 0)
            self.zap.bind(ZAP_ENDPOINT)
        else:
            self.public_key = self._secret = None
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 100_000)
        # A hard stop for parts far past any frame (the connection is dropped); parts
        # between max_part_bytes and this are refused alone, keeping the connection.
        self.pull.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if not self.insecure:
            self.pull.curve_server = True
            self.pull.curve_secretkey = self._secret
            self.pull.setsockopt(zmq.ZAP_DOMAIN, b"epd-ring")
        if bind.endswith(":0"):
            self.pull.bind_to_random_port(bind[: bind.rindex(":")])
        else:
            self.pull.bind(bind)
        self.endpoint = self.pull.getsockopt(zmq.LAST_ENDPOINT).decode()
        if self.insecure:
            log.warning("control plane at %s runs WITHOUT authentication (insecure=True): any process that "
                        "can reach it can register, fail or take rooms", self.endpoint)
        self.max_frames_per_poll = max_frames_per_poll
        self.max_frames_per_identity = max_frames_per_identity
        self.max_backlog = max_backlog
        self.max_poll_s = max_poll_s
        self.max_part_bytes = max_part_bytes
        self.max_zap_per_poll = max_zap_per_poll
        self.push_hwm = push_hwm
        self._push: OrderedDict[tuple[str, str], zmq.Socket] = OrderedDict()
        self._backlog: deque[tuple[str, list[bytes]]] = deque()
        self._discarding = False  # mid-way through discarding a refused message's parts
        self.max_poll_seconds = 0.0  # the longest poll() so far (for benchmarks and health)
        self.manager = None
        if pump is not None:
            self.attach(pump)

    def allow(self, *keys: Any) -> None:
        """Add receiver public keys (z85, certificate files or directories) to the allow-list."""
        self.allowed |= load_public_keys(keys)

    def attach(self, pump: Any) -> None:
        """Read frames on every tick of `pump` (a `Pump`): each goes to its manager, and what the
        manager decides goes out with the pump's flush."""
        self.manager = pump.manager
        pump.sources.append(self.poll)

    # authentication ----------------------------------------------------------------------
    def _answer_zap(self) -> int:
        n = 0
        while n < self.max_zap_per_poll:
            try:
                msg = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            version, request_id = (msg + [b"", b""])[:2]
            mechanism = msg[5] if len(msg) > 5 else b""
            key = msg[6] if len(msg) > 6 else b""
            if version == b"1.0" and mechanism == b"CURVE" and len(key) == 32 and z85.encode(key) in self.allowed:
                user = z85.encode(key)
                self.zap.send_multipart([b"1.0", request_id, b"200", b"OK", user, b""])
                self.stats["zap_allowed"] += 1
            else:
                self.zap.send_multipart([b"1.0", request_id, b"400", b"key not allowed", b"", b""])
                self.stats["zap_denied"] += 1
                self.log.warning("zap", "refused a control connection from %s: key not on the allow-list",
                                 msg[3].decode("ascii", "replace") if len(msg) > 3 else "?")
        return n

    # frames in ---------------------------------------------------------------------------
    def _drain(self, deadline: float) -> int:
        """Discard parts of a refused message until it ends or `deadline`; the rest waits for the next poll."""
        n = 0
        while not (n & 1023 == 1023 and time.perf_counter() > deadline):
            try:
                part = self.pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # cannot happen mid-message; be safe anyway
                self._discarding = False
                break
            n += 1
            if not part.more:
                self._discarding = False
                break
        self.stats["parts_drained"] += n
        return n

    def _read(self) -> tuple[str, list[bytes] | None] | None:
        """The next message as (identity, parts), parts None if refused; None when nothing is queued."""
        try:
            first = self.pull.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        identity = "" if self.insecure else first.get("User-Id")
        parts = [first]
        too_big = len(first) > self.max_part_bytes
        part = first
        # The count is checked part by part, before the rest is read.
        while part.more and len(parts) < _WIRE_PARTS:
            part = self.pull.recv(zmq.NOBLOCK, copy=False)
            parts.append(part)
            too_big = too_big or len(part) > self.max_part_bytes
        if part.more:
            self._discarding = True
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

    def _handle(self, identity: str, parts: list[bytes]) -> None:
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
        if self.zap is not None:
            self._answer_zap()
        budget = self.max_frames_per_poll
        if self._discarding:
            self._drain(deadline)
            if self._discarding:
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
            got = self._read()
            if got is None:
                break
            n += 1
            if self._discarding:
                self._drain(deadline)
                if self._discarding:
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
    def _socket(self, endpoint: str, identity: str) -> zmq.Socket:
        key = (endpoint, identity)
        sock = self._push.get(key)
        if sock is not None:
            self._push.move_to_end(key)
            return sock
        if len(self._push) >= self.max_push_sockets:
            _, old = self._push.popitem(last=False)
            old.close(linger=0)
            self.stats["status_sockets_evicted"] += 1
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.push_hwm)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        if not self.insecure:
            # The receiver's status socket serves with the same key it authenticated with,
            # so nobody else can accept its statuses.
            sock.curve_secretkey = self._secret
            sock.curve_publickey = self.public_key
            sock.curve_serverkey = identity.encode()
        sock.connect(endpoint)
        self._push[key] = sock
        return sock

    def push_status(self, frame: ReceiverFrame, room: int, status: str, reason: str = "") -> None:
        endpoint = frame.status_endpoint
        if not endpoint:
            self.stats["status_without_endpoint"] += 1
            return
        identity = getattr(frame, "identity", "")
        if not self.insecure and not identity:
            self.stats["status_without_identity"] += 1  # a frame that did not come through this plane
            return
        parts = [b"%d" % room, status.encode(), frame.session.encode(), reason.encode()[:1024]]
        if getattr(frame, "region_notices", False):
            parts.append(b"%d" % frame.dst_ptr)  # which of its regions the notice concerns
        try:
            self._socket(endpoint, identity).send_multipart(parts, zmq.NOBLOCK)
            self.stats["status_sent"] += 1
        except zmq.Again:
            self.stats["status_dropped"] += 1  # queue full: the receiver is gone or stuck
        except zmq.ZMQError as exc:
            self.stats["status_errors"] += 1
            self.log.warning("status", "status for room %s to %s failed: %s", room, endpoint, exc)

    def close(self) -> None:
        for sock in self._push.values():
            sock.close(linger=0)
        self._push.clear()
        self.pull.close(linger=0)
        if self.zap is not None:
            self.zap.close(linger=0)
        self.ctx.term()
