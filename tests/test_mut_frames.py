"""Registration frames at their edges: each limit at and one past, each refusal's exact message
(it names the field, and reaches the failed room's receivers and the logs), and every field over
the wire, byte for byte."""

from __future__ import annotations

import pytest

from epd_ring.executor import FrameError, ReceiverFrame
from epd_ring.executor.core.frames import (
    DTYPE_SIZES,
    MAX_DEEP_LEVELS,
    MAX_RECEIVERS,
    WIRE_MAGIC,
    _plainly_valid,
    check_against_chunk,
    check_frame,
    check_tiling,
    frame_from_parts,
    frame_to_parts,
)

U64_MAX = (1 << 64) - 1
SESSION = "127.0.0.1:1234"
FLAT = ReceiverFrame(room=7, session=SESSION, dst_ptr=0x1000, dst_deep_ptr=0, n_tokens=10, row_start=0, span=10,
                     hidden=64, dtype="torch.bfloat16", has_deepstack=False, n_receivers=1)
DEEP = FLAT._replace(has_deepstack=True, dst_deep_ptr=0x9000, deep_levels=3)


class RoomId(int):
    """An engine's own integer type for room ids (an IntEnum, a numbered id class): an integer, not a bool."""


def both_ways(f: ReceiverFrame) -> list[ReceiverFrame]:
    """The frame as given, and with its room id in an int subclass, which `check_frame` accepts like an
    int: the answer must be the same for both (the subclass leaves the common-case shortcut)."""
    if type(f.room) is not int:
        return [f]
    return [f, f._replace(room=RoomId(f.room))]


def refused(f: ReceiverFrame) -> str:
    with pytest.raises(FrameError) as err:
        check_frame(f)
    return str(err.value)


# -- check_frame: what it accepts ------------------------------------------------------------

ACCEPTED = {
    "flat": FLAT,
    "deepstack": DEEP,
    "room 0": FLAT._replace(room=0),
    "top pointers": DEEP._replace(dst_ptr=U64_MAX, dst_deep_ptr=U64_MAX),
    "one row, one hidden": FLAT._replace(n_tokens=1, span=1, hidden=1),
    "shard ending at the span": FLAT._replace(row_start=4, n_tokens=6, n_receivers=2),
    "zero-row shard needs no destination": FLAT._replace(row_start=10, n_tokens=0, dst_ptr=0, n_receivers=3),
    "zero-row deepstack shard": DEEP._replace(n_tokens=0, dst_ptr=0, dst_deep_ptr=0, n_receivers=3),
    "most receivers": FLAT._replace(n_receivers=MAX_RECEIVERS),
    "one deepstack level": DEEP._replace(deep_levels=1),
    "most deepstack levels": DEEP._replace(deep_levels=MAX_DEEP_LEVELS),
    "longest session": FLAT._replace(session="h" * 250 + ":12345"),
    "one-character session": FLAT._replace(session="h"),
    "status endpoint": FLAT._replace(status_endpoint="tcp://127.0.0.1:5555"),
    "longest status endpoint": FLAT._replace(status_endpoint="tcp://" + "h" * 244 + ":65535"),
    "authenticated peer": FLAT._replace(peer="receiver-3"),
    **{f"dtype {d}": FLAT._replace(dtype=d) for d in DTYPE_SIZES},
}


@pytest.mark.parametrize("name", ACCEPTED)
def test_frames_within_every_limit_are_accepted(name):
    for f in both_ways(ACCEPTED[name]):
        assert check_frame(f) is None


def test_limits_are_the_documented_ones():
    # 1024 receivers per room, 64 deepstack levels, 256-byte names: the bounds README and the
    # wire parser state; the tests below probe one past each.
    assert (MAX_RECEIVERS, MAX_DEEP_LEVELS) == (1024, 64)
    assert len(ACCEPTED["longest session"].session) == 256
    assert len(ACCEPTED["longest status endpoint"].status_endpoint) == 256


# -- check_frame: what it refuses, and the exact words -----------------------------------------

REFUSED = [
    # room: non-negative int, not bool
    (dict(room=-1), "room must be a non-negative integer, got -1"),
    (dict(room="7"), "room must be a non-negative integer, got '7'"),
    (dict(room=True), "room must be a non-negative integer, got True"),
    (dict(room=7.0), "room must be a non-negative integer, got 7.0"),
    # session: non-empty printable ASCII without spaces, at most 256 bytes
    (dict(session=""), "room 7: session must be a non-empty string"),
    (dict(session=None), "room 7: session must be a non-empty string"),
    (dict(session="h" * 251 + ":12345"),
     "room 7: session must be printable ASCII without spaces or control characters, at most 256 bytes, got "
     + repr("h" * 64)),
    (dict(session="host :1"), "room 7: session must be printable ASCII without spaces or control characters, "
                              "at most 256 bytes, got 'host :1'"),
    (dict(session="hôst:1"), "room 7: session must be printable ASCII without spaces or control characters, "
                             "at most 256 bytes, got 'hôst:1'"),
    (dict(session="host:1\nforged log line"),
     "room 7: session must be printable ASCII without spaces or control characters, "
     "at most 256 bytes, got 'host:1\\nforged log line'"),
    # status_endpoint: empty, or a printable tcp:// address of at most 256 bytes
    (dict(status_endpoint="ipc:///tmp/epd"), "room 7: status_endpoint must be a printable tcp:// address, "
                                             "got 'ipc:///tmp/epd'"),
    (dict(status_endpoint="inproc://status"), "room 7: status_endpoint must be a printable tcp:// address, "
                                              "got 'inproc://status'"),
    (dict(status_endpoint="tcp://" + "h" * 245 + ":65535"),
     "room 7: status_endpoint must be a printable tcp:// address, got " + repr("tcp://" + "h" * 58)),
    (dict(status_endpoint="tcp://h:1 x"), "room 7: status_endpoint must be a printable tcp:// address, "
                                          "got 'tcp://h:1 x'"),
    (dict(status_endpoint=b"tcp://h:1"), "room 7: status_endpoint must be a printable tcp:// address, "
                                         "got \"b'tcp://h:1'\""),
    (dict(status_endpoint=None), "room 7: status_endpoint must be a printable tcp:// address, got 'None'"),
    # peer: a string (set by the control plane, never off the wire)
    (dict(peer=b"receiver-3"), "room 7: peer must be a string"),
    (dict(peer=None), "room 7: peer must be a string"),
    # pointers: 64-bit unsigned
    (dict(dst_ptr=U64_MAX + 1), f"room 7: dst_ptr must be a 64-bit unsigned integer, got {U64_MAX + 1}"),
    (dict(dst_ptr=-1), "room 7: dst_ptr must be a 64-bit unsigned integer, got -1"),
    (dict(dst_ptr=True), "room 7: dst_ptr must be a 64-bit unsigned integer, got True"),
    (dict(dst_ptr=4096.0), "room 7: dst_ptr must be a 64-bit unsigned integer, got 4096.0"),
    (dict(dst_ptr="4096"), "room 7: dst_ptr must be a 64-bit unsigned integer, got '4096'"),
    (dict(dst_deep_ptr=U64_MAX + 1),
     f"room 7: dst_deep_ptr must be a 64-bit unsigned integer, got {U64_MAX + 1}"),
    (dict(dst_deep_ptr=-1), "room 7: dst_deep_ptr must be a 64-bit unsigned integer, got -1"),
    (dict(dst_deep_ptr=0.0), "room 7: dst_deep_ptr must be a 64-bit unsigned integer, got 0.0"),
    # counts: non-negative ints, not bools
    (dict(n_tokens=-1), "room 7: n_tokens must be a non-negative integer, got -1"),
    (dict(n_tokens=2.5), "room 7: n_tokens must be a non-negative integer, got 2.5"),
    (dict(n_tokens=True), "room 7: n_tokens must be a non-negative integer, got True"),
    (dict(row_start=-1), "room 7: row_start must be a non-negative integer, got -1"),
    (dict(row_start="0"), "room 7: row_start must be a non-negative integer, got '0'"),
    (dict(span=-1), "room 7: span must be a non-negative integer, got -1"),
    (dict(span=None), "room 7: span must be a non-negative integer, got None"),
    (dict(hidden=-1), "room 7: hidden must be a non-negative integer, got -1"),
    (dict(hidden=False), "room 7: hidden must be a non-negative integer, got False"),
    (dict(hidden=64.0), "room 7: hidden must be a non-negative integer, got 64.0"),
    (dict(span=10.0), "room 7: span must be a non-negative integer, got 10.0"),
    (dict(n_receivers=-1), "room 7: n_receivers must be a non-negative integer, got -1"),
    (dict(n_receivers=1.0), "room 7: n_receivers must be a non-negative integer, got 1.0"),
    # span and hidden at least 1; N in 1..1024
    (dict(span=0, n_tokens=0), "room 7: span and hidden must be at least 1"),
    (dict(hidden=0), "room 7: span and hidden must be at least 1"),
    (dict(n_receivers=0), "room 7: n_receivers must be in 1..1024, got 0"),
    (dict(n_receivers=MAX_RECEIVERS + 1), "room 7: n_receivers must be in 1..1024, got 1025"),
    # rows within the span
    (dict(row_start=5, n_tokens=6), "room 7: rows [5, 11) exceed span 10"),
    (dict(row_start=0, n_tokens=11), "room 7: rows [0, 11) exceed span 10"),
    (dict(row_start=11, n_tokens=0), "room 7: rows [11, 11) exceed span 10"),
    # dtype: a torch dtype name we know the size of
    (dict(dtype="float32"), "room 7: unknown dtype 'float32'"),
    (dict(dtype="torch.complex64"), "room 7: unknown dtype 'torch.complex64'"),
    # has_deepstack: a bool
    (dict(has_deepstack=1), "room 7: has_deepstack must be a bool"),
    (dict(has_deepstack="False"), "room 7: has_deepstack must be a bool"),
    (dict(has_deepstack=0), "room 7: has_deepstack must be a bool"),
    (dict(has_deepstack=1, dst_deep_ptr=0x9000, deep_levels=3), "room 7: has_deepstack must be a bool"),
    # deep_levels: 1..64 with a deepstack buffer, 0 without
    (dict(deep_levels=1), "room 7: deep_levels must be in 1..64 with a deepstack buffer and 0 without, got 1"),
    (dict(deep_levels=-1), "room 7: deep_levels must be in 1..64 with a deepstack buffer and 0 without, got -1"),
    (dict(deep_levels=False),
     "room 7: deep_levels must be in 1..64 with a deepstack buffer and 0 without, got False"),
    (dict(has_deepstack=True, dst_deep_ptr=0x9000),
     "room 7: deep_levels must be in 1..64 with a deepstack buffer and 0 without, got 0"),
    (dict(has_deepstack=True, dst_deep_ptr=0x9000, deep_levels=MAX_DEEP_LEVELS + 1),
     "room 7: deep_levels must be in 1..64 with a deepstack buffer and 0 without, got 65"),
    (dict(has_deepstack=True, dst_deep_ptr=0x9000, deep_levels=True),
     "room 7: deep_levels must be in 1..64 with a deepstack buffer and 0 without, got True"),
    (dict(has_deepstack=True, dst_deep_ptr=0x9000, deep_levels="3"),
     "room 7: deep_levels must be in 1..64 with a deepstack buffer and 0 without, got '3'"),
    # destinations for the rows it takes
    (dict(dst_ptr=0), "room 7: null destination for 10 rows"),
    (dict(dst_ptr=0, row_start=9, n_tokens=1), "room 7: null destination for 1 rows"),
    (dict(has_deepstack=True, deep_levels=3), "room 7: deepstack frame without a deepstack destination"),
    (dict(has_deepstack=True, deep_levels=3, n_tokens=1), "room 7: deepstack frame without a deepstack destination"),
]


@pytest.mark.parametrize("change, message", REFUSED, ids=[m[:60] for _, m in REFUSED])
def test_each_broken_field_is_refused_by_name(change, message):
    for f in both_ways(FLAT._replace(**change)):
        assert refused(f) == message


def test_the_first_broken_field_is_the_one_named():
    # Fields are checked in declaration order; a frame broken everywhere names its room id first.
    worst = FLAT._replace(room=-3, session="", dst_ptr=-1, n_tokens=-1, n_receivers=0, dtype="x")
    assert refused(worst) == "room must be a non-negative integer, got -3"
    assert refused(worst._replace(room=3)) == "room 3: session must be a non-empty string"
    assert refused(worst._replace(room=3, session="s")) == "room 3: dst_ptr must be a 64-bit unsigned integer, got -1"


def test_the_common_case_shortcut_agrees_with_the_full_check():
    # check_frame answers plain-typed frames with one expression (the per-frame hot path) and sends
    # whatever it doubts to the field-by-field checks: two statements of one contract, which must
    # agree. A valid frame the shortcut doubts silently takes the slow path; a broken one it passes
    # skips the checks (the refusal tests above catch that side through check_frame too).
    for name, f in ACCEPTED.items():
        assert _plainly_valid(f), name
    for change, message in REFUSED:
        assert not _plainly_valid(FLAT._replace(**change)), message


# -- check_against_chunk ---------------------------------------------------------------------

def chunk_refuses(f: ReceiverFrame, n_tokens=10, hidden=64, dtype="torch.bfloat16", deep_levels=0) -> str:
    with pytest.raises(FrameError) as err:
        check_against_chunk(f, n_tokens, hidden, dtype, deep_levels)
    return str(err.value)


def test_a_chunk_matching_the_frame_passes():
    assert check_against_chunk(FLAT, 10, 64, "torch.bfloat16", 0) is None
    assert check_against_chunk(DEEP, 10, 64, "torch.bfloat16", 3) is None


def test_a_chunk_unlike_the_frame_is_refused_with_both_sides_named():
    who = f"room 7: receiver {SESSION}"
    assert chunk_refuses(FLAT, n_tokens=11) == f"{who} expects 10 rows, chunk has 11"
    assert chunk_refuses(FLAT, hidden=32) == f"{who} expects hidden 64, chunk has 32"
    assert chunk_refuses(FLAT, dtype="torch.float16") == f"{who} expects torch.bfloat16, chunk is torch.float16"
    # deepstack on one side only: which side lacks it
    assert chunk_refuses(FLAT, deep_levels=3) == f"{who} lacks a deepstack buffer the chunk has"
    assert chunk_refuses(DEEP, deep_levels=0) == f"{who} expects deepstack rows the chunk lacks"
    # both have it, at different widths (1 is a real width: one level, not the "no multiple" marker)
    assert chunk_refuses(DEEP, deep_levels=2) == f"{who} expects 3 deepstack levels, chunk has 2"
    assert chunk_refuses(DEEP, deep_levels=1) == f"{who} expects 3 deepstack levels, chunk has 1"
    # the manager stages a chunk whose deepstack width is no multiple of hidden with deep_levels -1
    assert (chunk_refuses(DEEP, deep_levels=-1)
            == f"{who} expects 3 deepstack levels, chunk has a width that is no multiple of hidden")


# -- check_tiling ----------------------------------------------------------------------------

def shards(*ranges, span=10):
    return [FLAT._replace(session=f"s{i}", row_start=a, n_tokens=n, span=span, n_receivers=len(ranges))
            for i, (a, n) in enumerate(ranges)]


def test_tiling_names_the_gap_or_overlap_and_where():
    for ranges, message in [
        (((0, 4), (5, 5)), "room 7: shard gap between rows 4 and 5"),
        (((0, 3), (7, 3)), "room 7: shard gap between rows 3 and 7"),
        (((0, 6), (5, 5)), "room 7: shard overlap between rows 6 and 5"),
        (((6, 4), (0, 7)), "room 7: shard overlap between rows 7 and 6"),  # sorted by row_start first
        (((0, 10), (0, 5)), "room 7: shard overlap between rows 10 and 0"),  # identity beside a shard
    ]:
        with pytest.raises(FrameError) as err:
            check_tiling(shards(*ranges))
        assert str(err.value) == message


# -- wire format -----------------------------------------------------------------------------

# Every field distinct, so a field read from its neighbour's part shows; small values one digit long.
WIRED = ReceiverFrame(room=7, session="10.0.0.2:17000", dst_ptr=0x0102030405060708,
                      dst_deep_ptr=0x1112131415161718, n_tokens=5, row_start=3, span=12, hidden=2048,
                      dtype="torch.float16", has_deepstack=True, n_receivers=2,
                      status_endpoint="tcp://10.0.0.2:5557", deep_levels=4)
# Pointers little-endian over 8 bytes (least significant first), integers in decimal ASCII.
WIRED_PARTS = [b"epd-ring/2", b"7", b"10.0.0.2:17000", b"\x08\x07\x06\x05\x04\x03\x02\x01",
               b"\x18\x17\x16\x15\x14\x13\x12\x11", b"5", b"3", b"12", b"2048", b"torch.float16", b"1", b"2",
               b"tcp://10.0.0.2:5557", b"4"]


def test_frame_to_parts_is_byte_exact():
    assert WIRE_MAGIC == b"epd-ring/2"
    assert frame_to_parts(WIRED) == WIRED_PARTS
    # the peer identity never goes on the wire
    assert frame_to_parts(WIRED._replace(peer="receiver-3")) == WIRED_PARTS
    flat = FLAT._replace(dst_ptr=U64_MAX, span=10**19, n_tokens=10**19)
    assert frame_to_parts(flat) == [b"epd-ring/2", b"7", SESSION.encode(), b"\xff" * 8, b"\0" * 8,
                                    b"10000000000000000000", b"0", b"10000000000000000000", b"64",
                                    b"torch.bfloat16", b"0", b"1", b"", b"0"]


def test_frame_from_parts_reads_every_field_from_its_own_part():
    got = frame_from_parts(list(WIRED_PARTS))
    assert got == WIRED
    assert got._asdict() == dict(room=7, session="10.0.0.2:17000", dst_ptr=0x0102030405060708,
                                 dst_deep_ptr=0x1112131415161718, n_tokens=5, row_start=3, span=12, hidden=2048,
                                 dtype="torch.float16", has_deepstack=True, n_receivers=2,
                                 status_endpoint="tcp://10.0.0.2:5557", deep_levels=4, peer="")
    assert type(got.has_deepstack) is bool
    assert frame_from_parts(list(WIRED_PARTS), peer="receiver-3") == WIRED._replace(peer="receiver-3")


@pytest.mark.parametrize("f", [FLAT, DEEP, WIRED, ACCEPTED["top pointers"], ACCEPTED["longest session"],
                               ACCEPTED["longest status endpoint"], ACCEPTED["zero-row shard needs no destination"]])
def test_round_trip_is_exact(f):
    assert frame_from_parts(frame_to_parts(f)) == f
    assert frame_from_parts(frame_to_parts(f), peer="p") == f._replace(peer="p")


def wire_refuses(index: int, value: bytes) -> str:
    parts = list(WIRED_PARTS)
    parts[index] = value
    with pytest.raises(FrameError) as err:
        frame_from_parts(parts)
    return str(err.value)


def with_part(index: int, value: bytes) -> ReceiverFrame:
    parts = list(WIRED_PARTS)
    parts[index] = value
    return frame_from_parts(parts)


def test_wrong_part_count_and_magic_are_refused():
    for parts in (WIRED_PARTS[:-1], WIRED_PARTS + [b"4"], []):
        with pytest.raises(FrameError) as err:
            frame_from_parts(list(parts))
        assert str(err.value) == f"expected 14 parts, got {len(parts)}"
    assert wire_refuses(0, b"epd-ring/1") == "bad magic b'epd-ring/1'"
    assert wire_refuses(0, b"") == "bad magic b''"
    # at most 16 bytes of a hostile part are echoed
    assert wire_refuses(0, b"0123456789abcdefXYZ") == "bad magic b'0123456789abcdef'"


@pytest.mark.parametrize("index, name", [(3, "dst_ptr"), (4, "dst_deep_ptr")])
def test_pointer_parts_must_be_exactly_8_bytes(index, name):
    assert wire_refuses(index, b"\x01" * 7) == f"{name} must be 8 bytes, got 7"
    assert wire_refuses(index, b"\x01" * 9) == f"{name} must be 8 bytes, got 9"
    assert wire_refuses(index, b"") == f"{name} must be 8 bytes, got 0"
    assert getattr(with_part(index, b"\xff" * 8), name) == U64_MAX
    assert getattr(with_part(index, b"\x01" + b"\0" * 7), name) == 1


def test_has_deepstack_part_is_0_or_1():
    assert with_part(10, b"0").has_deepstack is False
    assert with_part(10, b"1").has_deepstack is True
    assert wire_refuses(10, b"2") == "has_deepstack must be b'0' or b'1', got b'2'"
    assert wire_refuses(10, b"") == "has_deepstack must be b'0' or b'1', got b''"
    assert wire_refuses(10, b"true-ish and more") == "has_deepstack must be b'0' or b'1', got b'true-ish'"


INT_PARTS = [(1, "room"), (5, "n_tokens"), (6, "row_start"), (7, "span"), (8, "hidden"), (11, "n_receivers"),
             (13, "deep_levels")]


@pytest.mark.parametrize("index, name", INT_PARTS)
def test_integer_parts_are_1_to_20_decimal_digits(index, name):
    assert getattr(with_part(index, b"0"), name) == 0
    assert getattr(with_part(index, b"9"), name) == 9
    assert getattr(with_part(index, b"9" * 20), name) == 10**20 - 1
    assert getattr(with_part(index, b"0" * 19 + b"5"), name) == 5
    for bad in (b"", b"-1", b"+1", b" 1", b"1 ", b"1.0", b"0x10", b"1_000", b"\xd9\xa1"):
        assert wire_refuses(index, bad) == f"{name} must be a decimal integer, got {bad!r}"
    assert wire_refuses(index, b"1" * 21) == f"{name} must be a decimal integer, got {b'1' * 21!r}"
    # at most 24 bytes of a hostile part are echoed
    assert wire_refuses(index, b"x" * 30) == f"{name} must be a decimal integer, got {b'x' * 24!r}"


@pytest.mark.parametrize("index, name, limit", [(2, "session", 256), (9, "dtype", 32), (12, "status_endpoint", 256)])
def test_text_parts_are_bounded_printable_ascii(index, name, limit):
    assert getattr(with_part(index, b"a" * limit), name) == "a" * limit
    assert getattr(with_part(index, b"~"), name) == "~"
    assert wire_refuses(index, b"a" * (limit + 1)) == f"{name} longer than {limit} bytes"
    assert wire_refuses(index, "hôst".encode()) == f"{name} is not ASCII"
    assert wire_refuses(index, b"\xff") == f"{name} is not ASCII"
    assert wire_refuses(index, b"host\n") == f"{name} holds control characters"
    assert wire_refuses(index, b"\x00") == f"{name} holds control characters"
    # the parser only reads text; the room's contract (no spaces, known dtype) is check_frame's
    assert getattr(with_part(index, b"a b"), name) == "a b"


def test_parts_are_checked_in_order_and_the_first_bad_one_named():
    parts = list(WIRED_PARTS)
    parts[1], parts[2], parts[3], parts[10] = b"-1", b"\xff", b"", b"x"
    with pytest.raises(FrameError, match="^dst_ptr must be 8 bytes, got 0$"):
        frame_from_parts(parts)
    parts[3] = bytes(8)
    with pytest.raises(FrameError, match="^has_deepstack must be"):
        frame_from_parts(parts)
    parts[10] = b"0"
    with pytest.raises(FrameError, match="^room must be a decimal integer"):
        frame_from_parts(parts)
