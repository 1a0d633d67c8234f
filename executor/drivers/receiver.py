"""A reference receiver (the prefill role), for tests, the demo and integrators.

It registers one receive buffer once, carves a region per room out of it,
sends registration frames to the encode worker's control endpoint, collects
the status pushes and hands back the received embeddings. Each region steps
the declared region machine (fsm/regions.py) on every notice, and its memory
is carved again only once it is `released`: never while a write into it may
still land.

With CURVE (the default) it holds one keypair: its frames go out as a CURVE
client of the encoder (whose public key it must know), and its status socket
serves with the same key, accepting only the encoder's key, so a status it
reads came from its encoder. As a process it takes its secret key from
EPD_RING_SECRET_KEY and the encoder's public key from EPD_RING_ENCODER_KEY.

Run as a process, it takes JSON commands on stdin, one per line, and answers
one JSON line each (used by the end-to-end tests):
  {"cmd": "expect", "room": R, "span": S, "hidden": H, "deep": D, "n": N, "rank": K, "shard": bool}
  {"cmd": "register", "rooms": [R, ...]}       send those rooms' frames now
  {"cmd": "raw", "parts_hex": [...]}           send arbitrary multipart (hostile frames)
  {"cmd": "report", "wait_rooms": [...], "wait_released": [...], "wait_free": [...], "timeout": T}
                                               statuses, notices not ours, sha256 of received bytes
                                               (wait_free: rooms whose region must be back)
  {"cmd": "withdraw", "rooms": [R, ...]}       withdraw those rooms' regions (requests aborted)

What it sends survives a lost connection: each time its frame socket connects again (after a cut
its encoder's heartbeat ended, or the encoder's restart) it says hello naming its status endpoint,
and the encoder answers with its incarnation. The same encoder: every frame of a region still
`offered` and every withdraw not yet acknowledged is sent again (either may have died with the old
connection; both are idempotent). Another one, or none for `give_up_s`: the rooms it was offered
are failed here, and every region comes back (docs/mooncake.md, "Encoder incarnations").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from epd_ring.fsm import REGION, InvalidTransition
from epd_ring.fsm.regions import NOTICE_EVENTS, OUTCOMES

from ..core import settings
from ..core.frames import ReceiverFrame, frame_to_parts, shard_rows
from ..core.regions import withdraw_to_parts
from .control import (
    ENV_ENCODER,
    ENV_SECRET,
    HELLO,
    INCARNATION,
    check_keypair,
    generate_keypair,
    load_keypair,
    load_public_keys,
)
from .mooncake import load_engine, owner_page
from .orphans import Inbound, Reclaim
from .transports import TRANSPORTS

_ALIGN = 64


class Region:
    """One room's receive region at this receiver: its extents and its region-machine state."""

    __slots__ = ("room", "state", "extents", "ptr", "resent", "reclaim_at", "reclaim_by", "lingering", "needs_ack",
                 "acked")

    def __init__(self, room: int, extents: list[tuple[int, int]], ptr: int = 0):
        self.room, self.state, self.extents = room, REGION.initial, extents
        self.ptr = ptr  # its frame's dst_ptr: what the encoder's notices name it by
        self.resent = False  # its frame went out again: the encoder may tell its outcome again
        # Orphaned (its encoder's incarnation ended): reclaimed here once `reclaim_at` passed, the dead
        # process's connections (`lingering`) closed or `reclaim_by` passed (orphans.py) and, where the
        # new incarnation was asked to forget it (`needs_ack`), it acknowledged.
        self.reclaim_at: float | None = None
        self.reclaim_by = 0.0
        self.lingering: frozenset = frozenset()
        self.needs_ack = self.acked = False

    def __repr__(self) -> str:
        return f"region of room {self.room}"


class Extents:
    """Free byte ranges of the receive buffer: first fit, neighbours merged on free."""

    def __init__(self, capacity: int):
        self.free: list[tuple[int, int]] = [(0, capacity)]  # (start, length), sorted

    def take(self, nbytes: int) -> int:
        need = ((max(nbytes, 1) + _ALIGN - 1) // _ALIGN) * _ALIGN
        for i, (start, length) in enumerate(self.free):
            if length >= need:
                self.free[i:i + 1] = [(start + need, length - need)] if length > need else []
                return start
        raise MemoryError("receive buffer exhausted (regions not yet released)")

    def give(self, start: int, nbytes: int) -> None:
        need = ((max(nbytes, 1) + _ALIGN - 1) // _ALIGN) * _ALIGN
        self.free.append((start, need))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self.free = merged


def _status_address(status_address: Any, hostname: str) -> tuple[str, str]:
    """(numeric host, port or "") the status socket binds to and advertises."""
    if status_address is not None and not isinstance(status_address, str):
        raise TypeError(f"status_address must be a str HOST or HOST:PORT, got {status_address!r}")
    host, _, port = (status_address or hostname).partition(":")
    # Checked before the engine starts: libzmq would refuse a bad port only at bind, with
    # "Invalid argument" and no word of which setting.
    if port and not (port.isdecimal() and port.isascii() and 0 < int(port) < 65536):
        raise ValueError(f"status_address: the port must be a number from 1 to 65535, got {port!r}")
    # The encoder dials our status endpoint and refuses host names (a lookup would block its I/O
    # thread): resolved here, once, at start-up.
    return numeric_host(host), port


def _check_args(encode_endpoint: Any, capacity: Any, hostname: Any, dtype: Any, transport: Any) -> None:
    if not isinstance(encode_endpoint, str):
        raise TypeError(f"encode_endpoint must be a str like tcp://HOST:PORT, got {type(encode_endpoint).__name__}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive integer of bytes, got {capacity!r}")
    if not isinstance(hostname, str) or not hostname:
        raise TypeError(f"hostname must be a non-empty str, got {hostname!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")



def _check_expect(*, shard: bool, **values: int) -> None:
    """`expect`'s arguments, each named when it is wrong (a receiver's room is one request's)."""
    for name, least in (("room", 0), ("span", 1), ("hidden", 1), ("deep_width", 0), ("n", 1), ("rank", 0)):
        value = values[name]
        if type(value) is not int:
            raise TypeError(f"expect: {name} must be an int, got {type(value).__name__} {value!r:.32}")
        if value < least:
            raise ValueError(f"expect: {name} must be >= {least}, got {value}")
    if not isinstance(shard, bool):
        raise TypeError(f"expect: shard must be a bool, got {type(shard).__name__}")
    if values["deep_width"] % values["hidden"]:
        raise ValueError(f"deepstack width {values['deep_width']} is no multiple of hidden {values['hidden']}")


class MooncakeTarget:
    """A receiver's memory over Mooncake: the ownership page first, then the receive buffer."""

    def __init__(self, hostname: str, page: torch.Tensor, buffer: torch.Tensor):
        self.engine, self.session = load_engine(hostname)
        for what, t in (("ownership page", page), ("receive buffer", buffer)):
            rc = self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size())
            if rc != 0:
                raise RuntimeError(f"registering the {what} failed: rc={rc}")

    def close(self) -> None:
        """The engine is released with this object."""


def target(transport: str, hostname: str, page: torch.Tensor, buffer: torch.Tensor) -> Any:
    """The receive side of `transport` with `page` and `buffer` registered; `.session` names it."""
    if transport == "nixl":
        import os

        from .nixl import NixlTarget

        # The metadata port (the session's): random unless pinned, as a restarted receiver may want.
        return NixlTarget(hostname, page, buffer, int(os.environ.get("EPD_RING_NIXL_PORT", "0")))
    return MooncakeTarget(hostname, page, buffer)


def _frame_socket(ctx: Any, heartbeat_s: float, curve: tuple[bytes, bytes, bytes] | None) -> tuple[Any, Any]:
    """The PUSH socket frames and withdraws go out on (CURVE client: `curve` = our secret and
    public keys, the encoder's public key), and a monitor of its handshakes and disconnections."""
    import zmq

    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    # A refused handshake leaves no pipe to queue on: give up on a send after 2 s
    # instead of hanging (an encoder that does not accept our key is an error here).
    push.setsockopt(zmq.SNDTIMEO, 2000)
    if curve is not None:
        push.curve_secretkey, push.curve_publickey, push.curve_serverkey = curve
    # Each connection says hello, so the encoder binds it to our key at once rather than count it
    # among silent ones (which it sheds under a flood): the first as it is made, queued on the pipe
    # connect() makes, and every later one (after a cut, a blip, the encoder's restart) from poll().
    # Our own heartbeats too: a connection the encoder no longer answers on ends, and counts
    # towards `give_up_s`, instead of looking alive until TCP gives up (minutes).
    push.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat_s * 1000)))
    push.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(3 * heartbeat_s * 1000)))
    return push, push.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)


def _status_socket(ctx: Any, host: str, port: str, secret: bytes | None) -> tuple[Any, str]:
    """The PULL socket statuses arrive on (a CURVE server under `secret`), bound; and its port."""
    import zmq

    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        sock.curve_server = True
        sock.curve_secretkey = secret
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return sock, port
    return sock, str(sock.bind_to_random_port(f"tcp://{host}"))


class ReferenceReceiver:
    def __init__(self, encode_endpoint: str, *, capacity: int = 64 << 20, hostname: str = "127.0.0.1",
                 dtype: torch.dtype = torch.float32, encoder_key: Any = None,
                 keypair: tuple[bytes, bytes] | None = None, insecure: bool = False,
                 status_address: str | None = None, heartbeat_s: float = 10.0, give_up_s: float = 600.0,
                 reclaim_s: float = 30.0, clock: Any = time.monotonic, transport: str = "mooncake",
                 reclaim_max_s: float = 300.0):
        """`hostname`: the address this receiver's session advertises (the engine's local
        hostname; the encoder's writes come to it). `status_address`: HOST or HOST:PORT the
        status socket binds to and advertises (`hostname` and a random port by default).

        `heartbeat_s`: ZMTP heartbeats on the frame socket (a silent connection ends after 3).
        `give_up_s`: how long it keeps its rooms with no connection to its encoder; then they fail
        here. It must exceed what the encoder may still do for a room (announce or park deadline,
        write deadline, quarantine): a cut shorter than it loses nothing. `reclaim_s`, `reclaim_max_s`:
        how long a region of an ended encoder incarnation is kept, for writes the dead process's kernel
        may still deliver (orphans.py). `clock`: seconds, for those. `transport`: the engine the
        encoder writes with, "mooncake" or "nixl" (docs/transports.md)."""
        _check_args(encode_endpoint, capacity, hostname, dtype, transport)
        if keypair is not None:
            keypair = check_keypair(keypair)
        heartbeat_s = settings.seconds("heartbeat_s", heartbeat_s)
        give_up_s = settings.seconds("give_up_s", give_up_s)
        status_host, status_port = _status_address(status_address, hostname)
        import zmq  # the mooncake extra; imported here so `--help` works without it
        self._zmq = zmq

        if not insecure:
            if encoder_key is None:
                raise ValueError("a receiver needs the encoder's public key (or insecure=True)")
            keypair = keypair or generate_keypair()
        self.dtype = dtype
        # First registered: the page naming our key, which the encoder reads back at first
        # contact before it writes here (a session is ours because our engine says so).
        self.owner_page = torch.tensor(list(owner_page("" if insecure else keypair[0].decode())),
                                       dtype=torch.uint8)
        self.buffer = torch.zeros(capacity, dtype=torch.uint8)
        reclaim = Reclaim(reclaim_s, reclaim_max_s, Inbound())  # before the engine: what listens now is not its
        self.target = target(transport, hostname, self.owner_page, self.buffer)
        self.session = self.target.session
        self._extents = Extents(capacity)

        self.ctx = zmq.Context()
        self.auth = None
        self.insecure = insecure
        if not insecure:
            (encoder,) = load_public_keys([encoder_key])
            self.public_key = keypair[0]
            # The status socket accepts the encoder's key only. Its ZAP handler may be a
            # thread: this is the receiver's edge, not the encode loop.
            from zmq.auth.thread import ThreadAuthenticator

            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve_callback("*", credentials_provider=_OnlyKey(encoder))
        secret = None if insecure else keypair[1]
        self.push, self._handshakes = _frame_socket(self.ctx, heartbeat_s, None if insecure else
                                                    (secret, self.public_key, encoder))
        self.status_sock, status_port = _status_socket(self.ctx, status_host, status_port, secret)
        self.status_endpoint = f"tcp://{status_host}:{status_port}"
        reclaim.inbound.exclude(int(status_port))
        self.clock, self.give_up_s, self.reclaim = clock, give_up_s, reclaim
        self.incarnation: bytes | None = None  # the encoder's, as it last answered a hello
        self.handshakes = self.stale_answers = 0
        self._resend = False  # connected again: send again what may have been lost, once it answers
        self._lost_since: float | None = None  # no connection to the encoder since then
        self.repeated_notices: list[tuple[int, str]] = []  # outcomes told again after a frame went out again
        self.concluded_here: set[int] = set()  # rooms failed here: their encoder's incarnation ended
        self.push.connect(encode_endpoint)
        with contextlib.suppress(zmq.Again):
            self.push.send_multipart(self._hello(), zmq.NOBLOCK)
        self.frames: dict[int, ReceiverFrame] = {}
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.status: dict[int, list[str]] = {}  # outcomes told, per room
        self.notices: dict[int, list[str]] = {}  # every notice, per room (outcomes, releases, acks)
        self.regions: dict[int, Region] = {}  # rooms whose region is not released yet
        self.protocol_errors: list[str] = []  # notices the region machine does not allow
        self.foreign_notices: list[tuple[int, str, int | None]] = []  # (room, status, region): not ours

    def _carve(self, nbytes: int, extents: list) -> torch.Tensor:
        start = self._extents.take(nbytes)
        extents.append((start, nbytes))
        return self.buffer[start:start + nbytes]

    def expect(self, room: int, *, span: int, hidden: int, deep_width: int = 0, n: int = 1, rank: int = 0,
               shard: bool = False) -> ReceiverFrame:
        _check_expect(room=room, span=span, hidden=hidden, deep_width=deep_width, n=n, rank=rank, shard=shard)
        if room in self.regions:
            raise ValueError(f"room {room} already has a region here ({self.regions[room].state})")
        row_start, rows = shard_rows(span, rank, n) if shard else (0, span)
        es = torch.tensor([], dtype=self.dtype).element_size()
        extents: list[tuple[int, int]] = []
        main = self._carve(rows * hidden * es, extents).view(self.dtype).view(rows, hidden)
        deep = (self._carve(rows * deep_width * es, extents).view(self.dtype).view(rows, deep_width)
                if deep_width else None)
        frame = ReceiverFrame(room, self.session, main.data_ptr() if rows else self.buffer.data_ptr(),
                              (deep.data_ptr() if rows else self.buffer.data_ptr()) if deep_width else 0,
                              rows, row_start, span, hidden, str(self.dtype), bool(deep_width), n,
                              self.status_endpoint, deep_width // hidden, region_notices=True)
        self.regions[room] = Region(room, extents, frame.dst_ptr)
        self.status.pop(room, None), self.notices.pop(room, None)  # a reused id: the last region's, not this
        self.frames[room] = frame
        self.views[room] = (main, deep)
        return frame

    def register(self, room: int) -> None:
        self.push.send_multipart(frame_to_parts(self.frames[room]))

    def send_raw(self, parts: list[bytes]) -> None:
        self.push.send_multipart(parts)

    def _hello(self) -> list[bytes]:
        # Numbered by the connection it goes out on (the first is sent before it is made), and the
        # answer repeats it: an answer to a connection before, read late (a receiver that did not
        # poll across a restart), is told from this one's.
        return [HELLO, self.status_endpoint.encode(), b"%d" % max(self.handshakes, 1)]

    def poll(self, timeout_ms: int = 0) -> int:
        from zmq.utils.monitor import parse_monitor_message

        while self._handshakes.poll(0):
            event = parse_monitor_message(self._handshakes.recv_multipart())["event"]
            if event == self._zmq.EVENT_DISCONNECTED:
                if self._lost_since is None:
                    self._lost_since = self.clock()
                    self.reclaim.lost()
                continue
            self._lost_since = None
            self.handshakes += 1
            # A connection after the first: what went out on the one before may have died with it.
            self._resend = self._resend or self.handshakes > 1
            with contextlib.suppress(self._zmq.Again):
                self.push.send_multipart(self._hello(), self._zmq.NOBLOCK)
        n = 0
        while self.status_sock.poll(timeout_ms if n == 0 else 0):
            parts = self.status_sock.recv_multipart()
            n += 1
            if parts[0] == INCARNATION and len(parts) in (2, 3):
                if len(parts) == 2 or (parts[2].isdigit() and int(parts[2]) >= self.handshakes):
                    self.on_incarnation(parts[1])
                else:
                    self.stale_answers += 1
                continue
            # [room, status, session, reason] and, from an encoder that names regions, the region's dst_ptr
            region = int(parts[4]) if len(parts) > 4 else None
            self.on_notice(int(parts[0]), parts[1].decode(), region, parts[2].decode("ascii", "replace"))
        now = self.clock()
        if self._lost_since is not None and now - self._lost_since >= self.give_up_s:
            self._lost_since = None
            self.incarnation = None  # whoever answers next is new to the regions left
            self._orphan(now, ask=False)
        self._reclaim(now)
        return n

    def on_incarnation(self, incarnation: bytes) -> None:
        """The encoder answered a hello. The one we knew: send again what a dead connection may have
        lost. Another: the rooms of the one before ended with it (failed here), and its regions come
        back (`_orphan`)."""
        known, self.incarnation = self.incarnation, incarnation
        if known is not None and known != incarnation:
            self._resend = False
            self._orphan(self.clock(), ask=True)
            return
        self.reclaim.kept()
        if self._resend:
            self._resend = False
            self.resend()

    def resend(self) -> None:
        """Every frame of a region still `offered` and every withdraw not yet acknowledged, again: the
        encoder takes a frame it has twice once, and answers a withdraw as often as it comes."""
        for room, region in sorted(self.regions.items()):
            if region.reclaim_at is not None:
                continue
            if region.state == "offered":
                region.resent = True
                self.push.send_multipart(frame_to_parts(self.frames[room]))
            elif region.state == "withdrawing":
                self.push.send_multipart(withdraw_to_parts(room, self.session, self.status_endpoint))

    def _orphan(self, now: float, ask: bool) -> None:
        """The encoder that was offered our open regions is gone (a new incarnation answered, `ask`, or
        none for `give_up_s`): its rooms failed here, once, and each region comes back once no write of
        the dead one can land (`Reclaim`). A region its frame may have offered to the new incarnation too
        (`offered`, or withdrawing) is withdrawn there first, and comes back only once that one
        acknowledged. A `failed` one waited only for the dead one's release."""
        dead = self.reclaim.dead()
        for room, region in sorted(self.regions.items()):
            if region.state == "written" or region.reclaim_at is not None:
                continue  # told success: its bytes are the room's; or already orphaned
            if region.state == "offered":
                REGION.step(region, "withdraw")
            if room not in self.status:
                self.status[room] = ["failed"]
                self.concluded_here.add(room)
            self.reclaim.hold(region, now, dead)
            region.needs_ack = ask and region.state == "withdrawing"
            if region.needs_ack:
                self.push.send_multipart(withdraw_to_parts(room, self.session, self.status_endpoint))

    def _reclaim(self, now: float) -> None:
        # `release` walks the regions and returns a list: freeing from it leaves the walk alone.
        for region in self.reclaim.release(self.regions.values(), now):
            self._free(region)

    def on_notice(self, room: int, status: str, region_ptr: int | None = None, session: str | None = None) -> None:
        """Step the room's region; a region that reaches `released` gives its memory back.

        `region_ptr`: the region the notice names (None from an encoder that does not name
        regions). A notice for another session, or naming a region this receiver does not
        hold for the room, is recorded in `foreign_notices` and changes nothing: a receiver
        restarted on the same status address gets what was queued for its predecessor."""
        held = self.regions.get(room)
        if (session is not None and session != self.session) or (
                region_ptr is not None and (held is None or held.ptr != region_ptr)):
            self.foreign_notices.append((room, status, region_ptr))
            return
        self.notices.setdefault(room, []).append(status)
        region = self.regions.get(room)
        if status in OUTCOMES:
            told = self.status.get(room, [])
            if region is not None and told and (
                    (region.resent and told == [status]) or region.reclaim_at is not None):
                # The answer to a frame sent again (its outcome was on its way), or an outcome from the
                # new incarnation for a room already failed here: the room was told once.
                self.repeated_notices.append((room, status))
                return
            self.status.setdefault(room, []).append(status)
        event = NOTICE_EVENTS.get(status)
        if region is None or event is None:
            if status != "withdrawn":  # an ack may cross the release it duplicates
                self.protocol_errors.append(f"room {room}: {status!r} for no open region")
            return
        if region.reclaim_at is not None and event in ("ack", "release"):
            region.acked = True  # the new incarnation forgot it; it comes back at `reclaim_at` (poll)
            self._reclaim(self.clock())
            return
        try:
            REGION.step(region, event)
        except InvalidTransition as exc:
            self.protocol_errors.append(str(exc))
            return
        if region.state == "released":
            self._free(region)

    def _free(self, region: Region) -> None:
        del self.regions[region.room]
        for start, nbytes in region.extents:
            self._extents.give(start, nbytes)

    def consume(self, room: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copies of a Success room's rows; its region is free for reuse from here on."""
        region = self.regions[room]
        main, deep = self.views[room]
        out = (main.clone(), deep.clone() if deep is not None else None)
        REGION.step(region, "consume")
        self._free(region)
        return out

    def forget(self, room: int) -> bool:
        """Drop a gone region's frame, view, outcome and notices (False while its region is held)."""
        if room in self.regions:
            return False
        for kept in (self.frames, self.views, self.status, self.notices):
            kept.pop(room, None)
        return True

    def withdraw(self, room: int) -> None:
        """This receiver's request for `room` was aborted: ask the encoder to stop writing there.

        The region stays unusable until the encoder acknowledges (or releases it).
        """
        region = self.regions.get(room)
        if region is None or region.state != "offered":
            return  # already told its outcome: a release or nothing is still to come
        REGION.step(region, "withdraw")
        self.push.send_multipart(withdraw_to_parts(room, self.session, self.status_endpoint))

    def result(self, room: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.views[room]

    def digest(self, room: int) -> str:
        main, deep = self.views[room]
        h = hashlib.sha256(main.contiguous().numpy().tobytes())
        if deep is not None:
            h.update(deep.contiguous().numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.push.disable_monitor()
        self._handshakes.close(linger=0)
        self.push.close(linger=0)
        self.status_sock.close(linger=0)
        self.ctx.term()
        self.target.close()


class _OnlyKey:
    """Credentials provider for zmq.auth: exactly one allowed public key."""

    def __init__(self, key: bytes):
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key  # zmq.auth hands the client key over z85-encoded


def numeric_host(hostname: str) -> str:
    """`hostname` as a numeric IPv4 address (resolved once; an address is returned as it is)."""
    import socket

    try:
        return socket.getaddrinfo(hostname, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"hostname {hostname!r} does not resolve to an IPv4 address: {exc}") from None


class MissingKeys(ValueError):
    """A receiver process was started without keys and without being told to run insecure."""


def receiver_from_env(encode_endpoint: str, insecure: bool = False, **kw: Any) -> ReferenceReceiver:
    """A receiver keyed from EPD_RING_SECRET_KEY / EPD_RING_ENCODER_KEY; without either, it refuses
    to start unless `insecure` (then its frames and statuses are unauthenticated: anyone who can
    reach its status socket can forge a `success`)."""
    import os

    secret, encoder = os.environ.get(ENV_SECRET), os.environ.get(ENV_ENCODER)
    if not secret and not encoder:
        if not insecure:
            raise MissingKeys(f"no keys: set {ENV_SECRET} (this receiver's secret key) and {ENV_ENCODER} "
                              "(the encoder's public key), or run with --insecure")
        return ReferenceReceiver(encode_endpoint, insecure=True, **kw)
    if not encoder:
        raise MissingKeys(f"{ENV_SECRET} is set but {ENV_ENCODER} (the encoder's public key) is not")
    return ReferenceReceiver(encode_endpoint, encoder_key=encoder, keypair=load_keypair(secret) if secret else None,
                             **kw)


def serve(encode_endpoint: str, insecure: bool = False, **kw: Any) -> None:
    r = receiver_from_env(encode_endpoint, insecure=insecure, **kw)
    import zmq  # for zmq.Again below; the module imports it lazily
    print(json.dumps({"session": r.session, "status_endpoint": r.status_endpoint}), flush=True)
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            kind = cmd["cmd"]
        except (ValueError, TypeError, KeyError) as exc:  # a bad command line is answered, not fatal
            print(json.dumps({"ok": False, "error": f"bad command: {exc}"}), flush=True)
            continue
        if kind == "expect":
            f = r.expect(cmd["room"], span=cmd["span"], hidden=cmd["hidden"], deep_width=cmd.get("deep", 0),
                         n=cmd.get("n", 1), rank=cmd.get("rank", 0), shard=cmd.get("shard", False))
            print(json.dumps({"ok": True, "dst_ptr": f.dst_ptr}), flush=True)
        elif kind == "register":
            try:
                for room in cmd["rooms"]:
                    r.register(room)
                print(json.dumps({"ok": True}), flush=True)
            except zmq.Again:
                print(json.dumps({"ok": False, "error": "send timed out"}), flush=True)
        elif kind == "raw":
            try:
                r.send_raw([bytes.fromhex(p) for p in cmd["parts_hex"]])
                print(json.dumps({"ok": True}), flush=True)
            except zmq.Again:
                print(json.dumps({"ok": False, "error": "send timed out"}), flush=True)
        elif kind == "report":
            deadline = time.monotonic() + cmd.get("timeout", 0)
            wait = set(cmd.get("wait_rooms", []))
            released = set(cmd.get("wait_released", []))  # rooms whose `released` notice is awaited too
            free = set(cmd.get("wait_free", []))  # rooms whose region must be back, however it came back
            while True:
                r.poll(20)
                foreign = {room for room, _, _ in r.foreign_notices}
                done = all(r.status.get(room) or room in foreign for room in wait) and all(
                    "released" in r.notices.get(room, ()) for room in released) and not free & set(r.regions)
                if done or time.monotonic() > deadline:
                    break
            print(json.dumps({"status": {str(k): v for k, v in r.status.items()},
                              "foreign_notices": [[room, status] for room, status, _ in r.foreign_notices],
                              "notices": {str(k): v for k, v in r.notices.items()},
                              "open_regions": {str(k): g.state for k, g in r.regions.items()},
                              "protocol_errors": r.protocol_errors,
                              "repeated_notices": r.repeated_notices, "concluded_here": sorted(r.concluded_here),
                              "incarnation": (r.incarnation or b"").decode(),
                              "lingered": sorted(r.reclaim.waited), "reclaimed_overdue": r.reclaim.overdue,
                              "digest": {str(k): r.digest(k) for k in r.views}}), flush=True)
        elif kind == "withdraw":
            for room in cmd["rooms"]:
                r.withdraw(room)
            print(json.dumps({"ok": True}), flush=True)
        elif kind == "exit":
            break
        else:
            print(json.dumps({"ok": False, "error": f"unknown command {kind!r}"}), flush=True)

    r.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m epd_ring.executor.drivers.receiver ENDPOINT`: serve JSON-line commands on stdin.

    Exit 0 at `exit` or end of input, 2 on a usage error, 3 when the mooncake (or, with
    `--transport nixl`, the nixl) extra is missing or the engine will not start.
    """
    import argparse
    import re

    parser = argparse.ArgumentParser(
        prog="python -m epd_ring.executor.drivers.receiver", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("endpoint", help="the encode worker's control endpoint, tcp://HOST:PORT")
    parser.add_argument("--hostname", default="127.0.0.1",
                        help="the address this receiver's session advertises: the encoder writes to it "
                             "(default 127.0.0.1)")
    parser.add_argument("--status-address", metavar="HOST[:PORT]",
                        help="where the status socket binds and what it advertises (default: the hostname, "
                             "a random port)")
    parser.add_argument("--heartbeat", type=float, default=10.0, metavar="S",
                        help="ZMTP heartbeat interval on the frame socket (a silent connection ends after 3)")
    parser.add_argument("--give-up", type=float, default=600.0, metavar="S",
                        help="fail the open rooms after this long without a connection to the encoder; above "
                             "whatever the encoder may still do for a room (default 600)")
    parser.add_argument("--reclaim", type=float, default=30.0, metavar="S",
                        help="how long a region of an ended encoder incarnation is kept before its memory is "
                             "reused (default 30)")
    parser.add_argument("--reclaim-max", type=float, default=300.0, metavar="S",
                        help="after --reclaim, such a region also waits for the connections the dead process had "
                             "into this receiver's engine to close, at most this long (default 300)")
    parser.add_argument("--transport", choices=TRANSPORTS, default="mooncake",
                        help="the engine the encoder writes with (default mooncake; docs/transports.md)")
    parser.add_argument("--insecure", action="store_true",
                        help=f"run without CURVE keys when {ENV_SECRET} and {ENV_ENCODER} are unset: frames and "
                             "statuses unauthenticated, so anyone who reaches the status socket can forge a "
                             "`success` (tests and demos on one host only)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[^\s:/]+", args.hostname):
        parser.exit(2, f"{parser.prog}: error: --hostname must be a host name or address, got {args.hostname!r}\n")
    if args.status_address is not None and (
            not re.fullmatch(r"[^\s:/]+(:\d{1,5})?", args.status_address)
            or int(args.status_address.partition(":")[2] or 0) > 65535):
        parser.exit(2, f"{parser.prog}: error: --status-address must look like HOST or HOST:PORT, "
                       f"got {args.status_address!r}\n")
    if not re.fullmatch(r"tcp://[^\s:/]+:\d{1,5}", args.endpoint) or int(args.endpoint.rsplit(":", 1)[1]) > 65535:
        parser.exit(2, f"{parser.prog}: error: endpoint must look like tcp://HOST:PORT, got {args.endpoint!r}\n")
    import os

    keyed = bool(os.environ.get(ENV_SECRET) or os.environ.get(ENV_ENCODER))
    if not keyed and not args.insecure:
        parser.exit(2, f"{parser.prog}: error: no keys: set {ENV_SECRET} and {ENV_ENCODER}, or pass --insecure "
                       "to run without authentication\n")
    if not keyed:
        print(f"{parser.prog}: warning: running WITHOUT authentication (--insecure): any process that reaches "
              "the status socket can forge statuses, and the encoder cannot tell this receiver's frames from "
              "anyone's", file=sys.stderr, flush=True)
    try:
        import zmq  # noqa: F401
    except ImportError as exc:
        parser.exit(3, f"{parser.prog}: error: {exc}; install it with: pip install 'epd-ring[mooncake]'\n")
    from ..core.transport import TransportError

    try:
        serve(args.endpoint, insecure=args.insecure, hostname=args.hostname, status_address=args.status_address,
              heartbeat_s=args.heartbeat, give_up_s=args.give_up, reclaim_s=args.reclaim,
              reclaim_max_s=args.reclaim_max, transport=args.transport)
    except TransportError as exc:
        parser.exit(3, f"{parser.prog}: error: {exc}\n")
    except ValueError as exc:  # malformed keys in the environment, a host that does not resolve
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    except (KeyboardInterrupt, BrokenPipeError):
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())


def child_env(encoder_key: Any = None, keypair: tuple[bytes, bytes] | None = None) -> tuple[dict, bytes | None]:
    """Environment for a receiver process: CURVE keys when `encoder_key` is given (a fresh
    keypair if none), else none at all (it then runs insecure). Returns (env, public key)."""
    import os

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(ENV_SECRET, None)
    env.pop(ENV_ENCODER, None)
    if encoder_key is None:
        return env, None
    public, secret = keypair or generate_keypair()
    # Keys through the environment, never argv (which any local user can read).
    env[ENV_SECRET] = secret.decode()
    env[ENV_ENCODER] = encoder_key.decode() if isinstance(encoder_key, bytes) else str(encoder_key)
    return env, public


def spawn_json_child(module_args: list[str], env: dict, what: str, prefix: Sequence[str] = ()) -> tuple[Any, dict]:
    """Start `python -m MODULE ARGS` speaking JSON lines on stdin/stdout; return it and its hello line.

    `prefix`: a command that runs it (as `ip netns exec NAME`, for another host's namespace)."""
    import subprocess

    proc = subprocess.Popen([*prefix, sys.executable, "-m", *module_args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} process failed to start")
    return proc, json.loads(line)


def ask_json_child(proc: Any, cmd: dict, what: str) -> dict:
    """One JSON-line command to a child started by `spawn_json_child`, and its one-line answer."""
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} process died")
    return json.loads(line)


class ReceiverProcess:
    """A receiver in its own process, driven by the JSON-line commands of `serve`."""

    def __init__(self, encode_endpoint: str, *, encoder_key: bytes | None = None,
                 keypair: tuple[bytes, bytes] | None = None, hostname: str | None = None,
                 status_address: str | None = None, prefix: Sequence[str] = (), env: dict | None = None,
                 options: Sequence[str] = (), transport: str = "mooncake"):
        """With `encoder_key`, the process runs with CURVE under `keypair` (a fresh one if
        None; its public half is `public_key`, for the encoder's allow-list). `hostname`,
        `status_address`: its command-line options (`options`: more of them); `prefix` runs it
        (in another network namespace, say); `env`: variables added to its environment."""
        child, self.public_key = child_env(encoder_key, keypair)
        child.update(env or {})
        args = ["epd_ring.executor.drivers.receiver", encode_endpoint] + ([] if encoder_key is not None
                                                                          else ["--insecure"])
        if hostname is not None:
            args += ["--hostname", hostname]
        if status_address is not None:
            args += ["--status-address", status_address]
        args += [*options, "--transport", transport]
        self.proc, hello = spawn_json_child(args, child, "receiver", prefix)
        self.session, self.status_endpoint = hello["session"], hello["status_endpoint"]

    def ask(self, **cmd: Any) -> dict:
        return ask_json_child(self.proc, cmd, "receiver")

    def close(self) -> None:
        import signal

        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
