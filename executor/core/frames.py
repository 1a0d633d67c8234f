"""Receiver registration frames and the fanout contract they must satisfy.

A room is one request's transfer to N receivers. Each receiver registers a
frame naming where its rows go. The N frames either each take a full copy
(identity) or together tile a contiguous range of the chunk's rows (shards).
"""

from __future__ import annotations

import ipaddress
from typing import Any, NamedTuple

_U64 = 1 << 64
MAX_RECEIVERS = 1024
MAX_DEEP_LEVELS = 64

DTYPE_SIZES = {
    "torch.float32": 4,
    "torch.float16": 2,
    "torch.bfloat16": 2,
    "torch.float64": 8,
    "torch.float8_e4m3fn": 1,
    "torch.float8_e5m2": 1,
    "torch.uint8": 1,
    "torch.int8": 1,
}


class FrameError(ValueError):
    """A registration frame that breaks the contract; it fails only its own room."""


class ReceiverFrame(NamedTuple):
    """One receiver's registration for a room (immutable; built once per frame).

    A prefill receiver sends one per room it takes part in: where the room's rows
    go in its registered memory and what it expects them to be. The room starts
    writing once its sender registered, its chunk is staged and all
    `n_receivers` frames arrived. Over the wire (`frame_to_parts` /
    `parts_to_frame`) every field is checked; a bad frame fails only its room.

    - `room`: the bootstrap room id the encode request was registered with.
    - `session`: the receiver's transfer-engine session ("host:port"); statuses go to it.
    - `dst_ptr`, `dst_deep_ptr`: destination of its main rows and (deepstack) rows, in
      memory it registered with its engine (`dst_deep_ptr` 0 without deepstack).
    - `n_tokens`, `row_start`: the rows it takes, `[row_start, row_start + n_tokens)` of
      the chunk (the whole chunk unless the room is sharded over receivers: see `shard_rows`).
    - `span`, `hidden`, `dtype`: the chunk's rows, main width and torch dtype name
      ("torch.float32"); a chunk that differs fails the room instead of being written.
    - `has_deepstack`, `deep_levels`: whether it takes deepstack rows, and how many levels wide.
    - `n_receivers`: N, the receivers the room waits for (the same in every frame of a room).
    - `status_endpoint`: where the control plane pushes the room's final status, if any.
    - `region_notices`: the receiver reads notices naming their region (wire format /3).
    """

    room: int
    session: str  # the receiver's transfer-engine session ("host:port")
    dst_ptr: int
    dst_deep_ptr: int
    n_tokens: int  # rows this receiver takes
    row_start: int  # first source row it takes
    span: int  # rows in the whole chunk, as the receiver expects it
    hidden: int
    dtype: str
    has_deepstack: bool
    n_receivers: int  # N: receivers the room waits for
    status_endpoint: str = ""  # where status pushes go (control plane), if any
    # Deepstack levels the receiver's deepstack buffer holds per row (each `hidden`
    # wide): 0 exactly when it has none. Part of the contract, so an encoder at a
    # different width fails the room instead of writing rows past each region.
    deep_levels: int = 0
    # The authenticated identity that sent the frame, set by the control plane from
    # the connection (never read off the wire); "" without authentication.
    identity: str = ""
    # The receiver reads notices that name their region (a fifth part, `dst_ptr`): wire
    # format /3. A /2 frame (an older receiver) gets the four parts it parses.
    region_notices: bool = False

    @property
    def whole(self) -> bool:
        """The receiver takes every row of the chunk (no shard)."""
        return self.row_start == 0 and self.n_tokens == self.span


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The field types of a plainly valid frame, in order (exact types: a bool is no int here, a str subclass
# no str; anything else gets the full check).
_PLAIN_TYPES = (int, str, int, int, int, int, int, int, str, bool, int, str, int, str, bool)
# Sessions that passed `_plain_text` (a pure check of an exact str): a receiver's frames name the same
# session room after room, so its text is checked once. Bounded: emptied when full.
_SESSIONS_OK: set[str] = set()
_SESSIONS_OK_CAP = 4096


def _plainly_valid(f: ReceiverFrame) -> bool:
    """The common case in one expression; anything it doubts gets the full check."""
    if tuple(map(type, f)) != _PLAIN_TYPES:  # every field's type in one comparison
        return False
    room, session, dst, deep, n, start, span, hidden, dtype, has_deep, n_recv, endpoint, levels, _identity, _named = f
    if session not in _SESSIONS_OK:
        # _plain_text(session), written out: this is every new session's path
        if not (0 < len(session) <= _TEXT_LIMIT and session.isascii() and session.isprintable()
                and " " not in session):
            return False
        if len(_SESSIONS_OK) >= _SESSIONS_OK_CAP:
            _SESSIONS_OK.clear()
        _SESSIONS_OK.add(session)
    return (
        (not endpoint or _endpoint_ok(endpoint))
        and room >= 0 and (0 < levels <= MAX_DEEP_LEVELS if has_deep else levels == 0)
        and 0 <= dst < _U64 and 0 <= deep < _U64 and n >= 0 and start >= 0 and span >= 1
        and hidden >= 1 and 1 <= n_recv <= MAX_RECEIVERS and start + n <= span and dtype in DTYPE_SIZES
        and (n == 0 or (dst != 0 and (not has_deep or deep != 0)))
    )


_TEXT_LIMIT = 256


def _plain_text(s: str, limit: int = _TEXT_LIMIT) -> bool:
    """Printable ASCII without spaces: nothing that can forge a log line or hide in one."""
    return type(s) is str and 0 < len(s) <= limit and s.isascii() and s.isprintable() and " " not in s


def _endpoint_ok(e: str) -> bool:
    # Statuses go out over TCP only: a frame must not point the encoder at ipc:// or inproc://.
    return _plain_text(e) and e.startswith("tcp://") and numeric_endpoint(e)


def numeric_endpoint(e: str) -> bool:
    """`tcp://A.B.C.D:PORT` or `tcp://[IPv6]:PORT`, both numeric: libzmq connects to it without
    a name lookup. A host name would be resolved by a blocking lookup on libzmq's one I/O thread,
    again on every reconnect, stalling every other socket of the context (issue 21, attack 5)."""
    if not e.startswith("tcp://"):
        return False
    host, sep, port = e[6:].rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        return False
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if "." in host and ":" not in host:
            return False  # [1.2.3.4] is not an IPv6 address
    elif ":" in host:
        return False  # an IPv6 address needs its brackets
    if "%" in host:
        return False  # a scope id names an interface
    try:
        ipaddress.ip_address(host)  # strict: no 127.1, 0x7f000001, 2130706433, leading zeros
    except ValueError:
        return False
    return True


def check_frame(f: ReceiverFrame) -> None:
    """Field-level checks; raise FrameError naming the first broken field."""
    if _plainly_valid(f):
        return
    if not _is_int(f.room) or f.room < 0:
        raise FrameError(f"room must be a non-negative integer, got {f.room!r}")
    if not isinstance(f.session, str) or not f.session:
        raise FrameError(f"room {f.room}: session must be a non-empty string")
    if not _plain_text(f.session):
        raise FrameError(f"room {f.room}: session must be printable ASCII without spaces or control characters, "
                         f"at most 256 bytes, got {f.session[:64]!r}")
    if not isinstance(f.status_endpoint, str) or (f.status_endpoint and not _endpoint_ok(f.status_endpoint)):
        raise FrameError(f"room {f.room}: status_endpoint must be a numeric tcp://ADDRESS:PORT, "
                         f"got {str(f.status_endpoint)[:64]!r}")
    if not isinstance(f.identity, str):
        raise FrameError(f"room {f.room}: identity must be a string")
    if not isinstance(f.region_notices, bool):
        raise FrameError(f"room {f.room}: region_notices must be a bool")
    for name in ("dst_ptr", "dst_deep_ptr"):
        v = getattr(f, name)
        if not _is_int(v) or not 0 <= v < _U64:
            raise FrameError(f"room {f.room}: {name} must be a 64-bit unsigned integer, got {v!r}")
    for name in ("n_tokens", "row_start", "span", "hidden", "n_receivers"):
        v = getattr(f, name)
        if not _is_int(v) or v < 0:
            raise FrameError(f"room {f.room}: {name} must be a non-negative integer, got {v!r}")
    if f.span < 1 or f.hidden < 1:
        raise FrameError(f"room {f.room}: span and hidden must be at least 1")
    if not 1 <= f.n_receivers <= MAX_RECEIVERS:
        raise FrameError(f"room {f.room}: n_receivers must be in 1..{MAX_RECEIVERS}, got {f.n_receivers}")
    if f.row_start + f.n_tokens > f.span:
        raise FrameError(
            f"room {f.room}: rows [{f.row_start}, {f.row_start + f.n_tokens}) exceed span {f.span}"
        )
    if f.dtype not in DTYPE_SIZES:
        raise FrameError(f"room {f.room}: unknown dtype {f.dtype!r}")
    if not isinstance(f.has_deepstack, bool):
        raise FrameError(f"room {f.room}: has_deepstack must be a bool")
    if not _is_int(f.deep_levels) or not (0 < f.deep_levels <= MAX_DEEP_LEVELS if f.has_deepstack
                                          else f.deep_levels == 0):
        raise FrameError(f"room {f.room}: deep_levels must be in 1..{MAX_DEEP_LEVELS} with a deepstack buffer "
                         f"and 0 without, got {f.deep_levels!r}")
    if f.n_tokens and not f.dst_ptr:
        raise FrameError(f"room {f.room}: null destination for {f.n_tokens} rows")
    if f.n_tokens and f.has_deepstack and not f.dst_deep_ptr:
        raise FrameError(f"room {f.room}: deepstack frame without a deepstack destination")


def check_frames_agree(a: ReceiverFrame, b: ReceiverFrame) -> None:
    """Frames of one room must describe the same chunk and the same N."""
    for name in ("n_receivers", "span", "hidden", "dtype", "has_deepstack", "deep_levels"):
        if getattr(a, name) != getattr(b, name):
            raise FrameError(
                f"room {a.room}: receivers disagree on {name} "
                f"({getattr(a, name)!r} from {a.session} vs {getattr(b, name)!r} from {b.session})"
            )


def check_against_chunk(f: ReceiverFrame, n_tokens: int, hidden: int, dtype: str, deep_levels: int) -> None:
    """The receiver's side of the contract (rows, hidden, dtype, deepstack width) against the chunk's."""
    has_deep = deep_levels != 0
    if f.span != n_tokens:
        raise FrameError(f"room {f.room}: receiver {f.session} expects {f.span} rows, chunk has {n_tokens}")
    if f.hidden != hidden:
        raise FrameError(f"room {f.room}: receiver {f.session} expects hidden {f.hidden}, chunk has {hidden}")
    if f.dtype != dtype:
        raise FrameError(f"room {f.room}: receiver {f.session} expects {f.dtype}, chunk is {dtype}")
    if f.has_deepstack != has_deep:
        raise FrameError(
            f"room {f.room}: receiver {f.session} "
            + ("expects deepstack rows the chunk lacks" if f.has_deepstack
               else "lacks a deepstack buffer the chunk has")
        )
    if f.deep_levels != deep_levels:
        raise FrameError(f"room {f.room}: receiver {f.session} expects {f.deep_levels} deepstack levels, "
                         f"chunk has {deep_levels if deep_levels > 0 else 'a width that is no multiple of hidden'}")


def check_tiling(frames: list[ReceiverFrame]) -> None:
    """All identity copies, or non-empty shards tiling one contiguous row range."""
    if len(frames) == 1 or all(f.whole for f in frames):
        return
    # Otherwise shards: a full-span frame beside others overlaps them, and a
    # zero-row frame (span smaller than the shard count) carries nothing.
    shards = sorted((f for f in frames if f.n_tokens), key=lambda f: f.row_start)
    for prev, nxt in zip(shards, shards[1:]):
        end = prev.row_start + prev.n_tokens
        if nxt.row_start != end:
            kind = "gap" if nxt.row_start > end else "overlap"  # pragma: no mutate (wording)
            raise FrameError(
                f"room {prev.room}: shard {kind} between rows {end} and {nxt.row_start}"
            )


def shard_rows(span: int, rank: int, size: int) -> tuple[int, int]:
    """(row_start, n_rows) of `rank` of `size` balanced contiguous shards of `span` rows."""
    base, extra = divmod(span, size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


# -- wire format (control plane) --------------------------------------------------------
WIRE_MAGIC = b"epd-ring/2"  # /2: deep_levels joined the contract
# /3: the same parts; the receiver reads notices naming their region (`region_notices`).
WIRE_MAGIC_REGION_NOTICES = b"epd-ring/3"
_WIRE_PARTS = 14


def frame_to_parts(f: ReceiverFrame) -> list[bytes]:
    """A frame as ZMQ multipart: magic, then one part per field; pointers as 8-byte little-endian."""
    magic = WIRE_MAGIC_REGION_NOTICES if f.region_notices else WIRE_MAGIC
    return [magic, b"%d" % f.room, f.session.encode(), f.dst_ptr.to_bytes(8, "little"),
            f.dst_deep_ptr.to_bytes(8, "little"), b"%d" % f.n_tokens, b"%d" % f.row_start, b"%d" % f.span,
            b"%d" % f.hidden, f.dtype.encode(), b"1" if f.has_deepstack else b"0", b"%d" % f.n_receivers,
            f.status_endpoint.encode(), b"%d" % f.deep_levels]


def _wire_int(part: bytes, name: str) -> int:
    if not isinstance(part, (bytes, bytearray)) or not 0 < len(part) <= 20 or not part.isdigit():
        raise FrameError(f"{name} must be a decimal integer, got {bytes(part)[:24]!r}")
    return int(part)


def _wire_text(part: bytes, name: str, limit: int = 256) -> str:
    if len(part) > limit:
        raise FrameError(f"{name} longer than {limit} bytes")
    try:
        text = bytes(part).decode("ascii")
    except UnicodeDecodeError:
        raise FrameError(f"{name} is not ASCII") from None
    if not text.isprintable():
        raise FrameError(f"{name} holds control characters")
    return text


def frame_from_parts(parts: list[bytes], identity: str = "") -> ReceiverFrame:
    """Parse a multipart frame; raise FrameError naming the first bad part.

    `identity` is the key the control plane authenticated for the connection
    it came on; it is never read from the parts."""
    if len(parts) != _WIRE_PARTS:
        raise FrameError(f"expected {_WIRE_PARTS} parts, got {len(parts)}")
    if parts[0] != WIRE_MAGIC and parts[0] != WIRE_MAGIC_REGION_NOTICES:
        raise FrameError(f"bad magic {bytes(parts[0])[:16]!r}")
    for i, name in ((3, "dst_ptr"), (4, "dst_deep_ptr")):
        if len(parts[i]) != 8:
            raise FrameError(f"{name} must be 8 bytes, got {len(parts[i])}")
    if parts[10] not in (b"0", b"1"):
        raise FrameError(f"has_deepstack must be b'0' or b'1', got {bytes(parts[10])[:8]!r}")
    return ReceiverFrame(
        room=_wire_int(parts[1], "room"), session=_wire_text(parts[2], "session"),
        dst_ptr=int.from_bytes(parts[3], "little"), dst_deep_ptr=int.from_bytes(parts[4], "little"),
        n_tokens=_wire_int(parts[5], "n_tokens"), row_start=_wire_int(parts[6], "row_start"),
        span=_wire_int(parts[7], "span"), hidden=_wire_int(parts[8], "hidden"),
        dtype=_wire_text(parts[9], "dtype", 32), has_deepstack=parts[10] == b"1",
        n_receivers=_wire_int(parts[11], "n_receivers"), status_endpoint=_wire_text(parts[12], "status_endpoint"),
        deep_levels=_wire_int(parts[13], "deep_levels"), identity=identity,
        region_notices=parts[0] == WIRE_MAGIC_REGION_NOTICES)
