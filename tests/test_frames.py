"""Receiver frames: what check_frame accepts and refuses (naming the field), agreement of a room's
frames with each other and with its chunk, the fanout tiling, and the wire format byte for byte."""

from __future__ import annotations

import re

import pytest

from epd_ring.executor import FrameError, ReceiverFrame, shard_rows
from epd_ring.executor.core.frames import (
    DTYPE_SIZES,
    MAX_DEEP_LEVELS,
    MAX_RECEIVERS,
    WIRE_MAGIC,
    WIRE_MAGIC_REGION_NOTICES,
    _plainly_valid,
    check_against_chunk,
    check_frame,
    check_frames_agree,
    check_tiling,
    frame_from_parts,
    frame_to_parts,
    numeric_endpoint,
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
    "longest status endpoint": FLAT._replace(
        status_endpoint="tcp://[ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255]:65535"),
    "authenticated peer": FLAT._replace(identity="receiver-3"),
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
    # A status endpoint is numeric (no name lookup): the longest spelling is well under 256.
    assert len(ACCEPTED["longest status endpoint"].status_endpoint) == 59


# -- check_frame: what it refuses, naming the field ------------------------------------------

REFUSED = [
    (dict(room=-1), "room"),
    (dict(room="7"), "room"),
    (dict(room=True), "room"),
    (dict(room=7.0), "room"),
    (dict(session=""), "session"),
    (dict(session=None), "session"),
    (dict(session="h" * 251 + ":12345"), "session"),
    (dict(session="host :1"), "session"),
    (dict(session="hôst:1"), "session"),
    (dict(session="host:1\nforged log line"), "session"),
    (dict(status_endpoint="ipc:///tmp/epd"), "status_endpoint"),
    (dict(status_endpoint="inproc://status"), "status_endpoint"),
    (dict(status_endpoint="tcp://" + "h" * 245 + ":65535"), "status_endpoint"),
    (dict(status_endpoint="tcp://h:1 x"), "status_endpoint"),
    (dict(status_endpoint=b"tcp://h:1"), "status_endpoint"),
    (dict(status_endpoint=None), "status_endpoint"),
    (dict(identity=b"receiver-3"), "identity"),
    (dict(identity=None), "identity"),
    (dict(dst_ptr=U64_MAX + 1), "dst_ptr"),
    (dict(dst_ptr=-1), "dst_ptr"),
    (dict(dst_ptr=True), "dst_ptr"),
    (dict(dst_ptr=4096.0), "dst_ptr"),
    (dict(dst_ptr="4096"), "dst_ptr"),
    (dict(dst_deep_ptr=U64_MAX + 1), "dst_deep_ptr"),
    (dict(dst_deep_ptr=-1), "dst_deep_ptr"),
    (dict(dst_deep_ptr=0.0), "dst_deep_ptr"),
    (dict(n_tokens=-1), "n_tokens"),
    (dict(n_tokens=2.5), "n_tokens"),
    (dict(n_tokens=True), "n_tokens"),
    (dict(row_start=-1), "row_start"),
    (dict(row_start="0"), "row_start"),
    (dict(span=-1), "span"),
    (dict(span=None), "span"),
    (dict(hidden=-1), "hidden"),
    (dict(hidden=False), "hidden"),
    (dict(hidden=64.0), "hidden"),
    (dict(span=10.0), "span"),
    (dict(n_receivers=-1), "n_receivers"),
    (dict(n_receivers=1.0), "n_receivers"),
    (dict(span=0, n_tokens=0), "span"),
    (dict(hidden=0), "hidden"),
    (dict(n_receivers=0), "n_receivers"),
    (dict(n_receivers=MAX_RECEIVERS + 1), "n_receivers"),
    (dict(row_start=5, n_tokens=6), "exceed span"),
    (dict(row_start=0, n_tokens=11), "exceed span"),
    (dict(row_start=11, n_tokens=0), "exceed span"),
    (dict(dtype="float32"), "dtype"),
    (dict(dtype="torch.complex64"), "dtype"),
    (dict(has_deepstack=1), "has_deepstack"),
    (dict(has_deepstack="False"), "has_deepstack"),
    (dict(has_deepstack=0), "has_deepstack"),
    (dict(has_deepstack=1, dst_deep_ptr=0x9000, deep_levels=3), "has_deepstack"),
    (dict(deep_levels=1), "deep_levels"),
    (dict(deep_levels=-1), "deep_levels"),
    (dict(deep_levels=False), "deep_levels"),
    (dict(has_deepstack=True, dst_deep_ptr=0x9000), "deep_levels"),
    (dict(has_deepstack=True, dst_deep_ptr=0x9000, deep_levels=MAX_DEEP_LEVELS + 1), "deep_levels"),
    (dict(has_deepstack=True, dst_deep_ptr=0x9000, deep_levels=True), "deep_levels"),
    (dict(has_deepstack=True, dst_deep_ptr=0x9000, deep_levels="3"), "deep_levels"),
    (dict(dst_ptr=0), "null destination"),
    (dict(dst_ptr=0, row_start=9, n_tokens=1), "null destination"),
    (dict(has_deepstack=True, deep_levels=3), "deepstack destination"),
    (dict(has_deepstack=True, deep_levels=3, n_tokens=1), "deepstack destination"),
]


@pytest.mark.parametrize("change, field", REFUSED, ids=[f"{i}-{f}" for i, (_, f) in enumerate(REFUSED)])
def test_each_broken_field_is_refused_by_name(change, field):
    for f in both_ways(FLAT._replace(**change)):
        message = refused(f)
        assert field in message
        if "room" not in change:  # once the room id is sound, the refusal says which room
            assert message.startswith("room 7:")


def test_a_refusal_echoes_only_a_bounded_escaped_part_of_the_bad_value():
    # a hostile value reaches logs and notices: at most 64 characters of it, control characters escaped
    long_session = refused(FLAT._replace(session="h" * 251 + ":12345"))
    assert "h" * 64 in long_session and "h" * 65 not in long_session
    forged = refused(FLAT._replace(session="host:1\nforged log line"))
    assert "\n" not in forged and "forged log line" in forged
    long_endpoint = refused(FLAT._replace(status_endpoint="tcp://" + "h" * 245 + ":65535"))
    assert "h" * 58 in long_endpoint and "h" * 59 not in long_endpoint


def test_the_first_broken_field_is_the_one_named():
    # Fields are checked in declaration order; a frame broken everywhere names its room id first.
    worst = FLAT._replace(room=-3, session="", dst_ptr=-1, n_tokens=-1, n_receivers=0, dtype="x")
    assert re.match(r"room\b.*-3$", refused(worst))
    assert re.match(r"room 3: session\b", refused(worst._replace(room=3)))
    assert re.match(r"room 3: dst_ptr\b.*-1$", refused(worst._replace(room=3, session="s")))


def test_the_common_case_shortcut_agrees_with_the_full_check():
    # check_frame answers plain-typed frames with one expression (the per-frame hot path) and sends
    # whatever it doubts to the field-by-field checks: two statements of one contract, which must
    # agree. A valid frame the shortcut doubts silently takes the slow path; a broken one it passes
    # skips the checks (the refusal tests above catch that side through check_frame too).
    for name, f in ACCEPTED.items():
        assert _plainly_valid(f), name
    for change, field in REFUSED:
        assert not _plainly_valid(FLAT._replace(**change)), (change, field)
    # a session's text is checked once per exact str: a bad one is never remembered, and a str
    # subclass spelling a known good session still goes to the full check
    assert not _plainly_valid(FLAT._replace(session="bad session")) and not _plainly_valid(
        FLAT._replace(session="bad session"))

    class Text(str):
        pass

    assert _plainly_valid(FLAT) and not _plainly_valid(FLAT._replace(session=Text(FLAT.session)))


# -- agreement: a room's frames with each other and with its chunk ----------------------------

def test_frames_of_a_room_must_agree():
    check_frames_agree(FLAT, FLAT._replace(session="b", dst_ptr=0x2000))
    for change in (dict(n_receivers=2), dict(span=11), dict(hidden=32), dict(dtype="torch.float16"),
                   dict(has_deepstack=True, deep_levels=1, dst_deep_ptr=0x2000)):
        with pytest.raises(FrameError, match="disagree"):
            check_frames_agree(FLAT, FLAT._replace(session="b", **change))


def chunk_refuses(f: ReceiverFrame, n_tokens=10, hidden=64, dtype="torch.bfloat16", deep_levels=0) -> str:
    with pytest.raises(FrameError) as err:
        check_against_chunk(f, n_tokens, hidden, dtype, deep_levels)
    message = str(err.value)
    assert message.startswith(f"room 7: receiver {SESSION} ")  # which room, and whose frame
    return message


def test_a_chunk_matching_the_frame_passes():
    assert check_against_chunk(FLAT, 10, 64, "torch.bfloat16", 0) is None
    assert check_against_chunk(DEEP, 10, 64, "torch.bfloat16", 3) is None


def test_a_chunk_unlike_the_frame_is_refused_with_both_sides_named():
    assert re.search(r"\b10 rows\b.*\b11\b", chunk_refuses(FLAT, n_tokens=11))
    assert re.search(r"hidden 64\b.*\b32\b", chunk_refuses(FLAT, hidden=32))
    assert re.search(r"torch\.bfloat16\b.*torch\.float16", chunk_refuses(FLAT, dtype="torch.float16"))
    # deepstack on one side only: which side lacks it
    assert "lacks a deepstack buffer" in chunk_refuses(FLAT, deep_levels=3)
    assert "rows the chunk lacks" in chunk_refuses(DEEP, deep_levels=0)
    # both have it, at different widths (1 is a real width: one level, not the "no multiple" marker)
    assert re.search(r"\b3 deepstack levels\b.*\b2$", chunk_refuses(DEEP, deep_levels=2))
    assert re.search(r"\b3 deepstack levels\b.*\b1$", chunk_refuses(DEEP, deep_levels=1))
    # the manager stages a chunk whose deepstack width is no multiple of hidden with deep_levels -1
    assert "no multiple of hidden" in chunk_refuses(DEEP, deep_levels=-1)


# -- the fanout: shards tile the span ----------------------------------------------------------

def shards(*ranges, span=10):
    return [FLAT._replace(session=f"s{i}", row_start=a, n_tokens=n, span=span, n_receivers=len(ranges))
            for i, (a, n) in enumerate(ranges)]


def test_tiling_accepts_identity_and_contiguous_shards():
    check_tiling(shards((0, 10), (0, 10)))
    check_tiling(shards((0, 5), (5, 5)))
    check_tiling(shards((5, 5), (0, 5)))  # order of arrival does not matter
    check_tiling(shards((2, 3), (5, 4)))  # an encode rank may serve a block not starting at 0
    check_tiling(shards((0, 1), (1, 0), span=1))  # span smaller than the shard count


@pytest.mark.parametrize("ranges, kind, where", [
    (((0, 4), (5, 5)), "gap", (4, 5)),
    (((0, 3), (7, 3)), "gap", (3, 7)),
    (((0, 6), (5, 5)), "overlap", (6, 5)),
    (((6, 4), (0, 7)), "overlap", (7, 6)),  # sorted by row_start first
    (((0, 10), (0, 5)), "overlap", (10, 0)),  # identity beside a shard
])
def test_tiling_names_the_gap_or_overlap_and_where(ranges, kind, where):
    with pytest.raises(FrameError) as err:
        check_tiling(shards(*ranges))
    message = str(err.value)
    assert message.startswith("room 7:") and kind in message
    assert re.search(rf"\b{where[0]}\b.*\b{where[1]}$", message)


@pytest.mark.parametrize("span", [1, 2, 3, 7, 8, 128, 129])
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_shard_rows_tile_the_span_exactly(span, size):
    parts = [shard_rows(span, r, size) for r in range(size)]
    pos = 0
    for start, n in parts:
        assert start == pos
        pos += n
    assert pos == span
    assert max(n for _, n in parts) - min(n for _, n in parts) <= 1


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
    assert frame_to_parts(WIRED._replace(identity="receiver-3")) == WIRED_PARTS
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
                                 status_endpoint="tcp://10.0.0.2:5557", deep_levels=4, identity="",
                                 region_notices=False)
    assert type(got.has_deepstack) is bool
    assert frame_from_parts(list(WIRED_PARTS), identity="receiver-3") == WIRED._replace(identity="receiver-3")


def test_a_frame_says_whether_its_receiver_reads_notices_naming_their_region():
    # /3 is /2 with the same parts, from a receiver that reads a notice's fifth part (its region);
    # a /2 frame (an older receiver) still parses, and is sent the four parts it reads.
    named = WIRED._replace(region_notices=True)
    assert frame_to_parts(named) == [WIRE_MAGIC_REGION_NOTICES, *WIRED_PARTS[1:]]
    assert frame_from_parts(frame_to_parts(named)) == named
    assert frame_from_parts(list(WIRED_PARTS)).region_notices is False
    with pytest.raises(FrameError, match="region_notices"):
        check_frame(WIRED._replace(region_notices=1))


@pytest.mark.parametrize("f", [FLAT, DEEP, WIRED, ACCEPTED["top pointers"], ACCEPTED["longest session"],
                               ACCEPTED["longest status endpoint"], ACCEPTED["zero-row shard needs no destination"]])
def test_round_trip_is_exact(f):
    assert frame_from_parts(frame_to_parts(f)) == f
    assert frame_from_parts(frame_to_parts(f), identity="p") == f._replace(identity="p")


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
        with pytest.raises(FrameError, match=rf"\b14\b.*\b{len(parts)}$"):
            frame_from_parts(list(parts))
    assert "magic" in wire_refuses(0, b"epd-ring/1") and "epd-ring/1" in wire_refuses(0, b"epd-ring/1")
    assert "magic" in wire_refuses(0, b"")
    # at most 16 bytes of a hostile part are echoed
    echoed = wire_refuses(0, b"0123456789abcdefXYZ")
    assert "0123456789abcdef" in echoed and "X" not in echoed


@pytest.mark.parametrize("index, name", [(3, "dst_ptr"), (4, "dst_deep_ptr")])
def test_pointer_parts_must_be_exactly_8_bytes(index, name):
    for size in (7, 9, 0):
        assert re.match(rf"{name}\b.*\b8 bytes\b.*\b{size}$", wire_refuses(index, b"\x01" * size))
    assert getattr(with_part(index, b"\xff" * 8), name) == U64_MAX
    assert getattr(with_part(index, b"\x01" + b"\0" * 7), name) == 1


def test_has_deepstack_part_is_0_or_1():
    assert with_part(10, b"0").has_deepstack is False
    assert with_part(10, b"1").has_deepstack is True
    for bad in (b"2", b""):
        message = wire_refuses(10, bad)
        assert message.startswith("has_deepstack") and message.endswith(repr(bad))
    # at most 8 bytes of a hostile part are echoed
    echoed = wire_refuses(10, b"true-ish and more")
    assert "true-ish" in echoed and "and more" not in echoed


INT_PARTS = [(1, "room"), (5, "n_tokens"), (6, "row_start"), (7, "span"), (8, "hidden"), (11, "n_receivers"),
             (13, "deep_levels")]


@pytest.mark.parametrize("index, name", INT_PARTS)
def test_integer_parts_are_1_to_20_decimal_digits(index, name):
    assert getattr(with_part(index, b"0"), name) == 0
    assert getattr(with_part(index, b"9"), name) == 9
    assert getattr(with_part(index, b"9" * 20), name) == 10**20 - 1
    assert getattr(with_part(index, b"0" * 19 + b"5"), name) == 5
    for bad in (b"", b"-1", b"+1", b" 1", b"1 ", b"1.0", b"0x10", b"1_000", b"\xd9\xa1", b"1" * 21):
        message = wire_refuses(index, bad)
        assert message.startswith(f"{name} ") and message.endswith(repr(bad))
    # at most 24 bytes of a hostile part are echoed
    echoed = wire_refuses(index, b"x" * 30)
    assert echoed.startswith(f"{name} ") and repr(b"x" * 24) in echoed and "x" * 25 not in echoed


@pytest.mark.parametrize("index, name, limit", [(2, "session", 256), (9, "dtype", 32), (12, "status_endpoint", 256)])
def test_text_parts_are_bounded_printable_ascii(index, name, limit):
    assert getattr(with_part(index, b"a" * limit), name) == "a" * limit
    assert getattr(with_part(index, b"~"), name) == "~"
    assert re.match(rf"{name}\b.*\b{limit} bytes$", wire_refuses(index, b"a" * (limit + 1)))
    for not_ascii in ("hôst".encode(), b"\xff"):
        assert re.match(rf"{name}\b.*ASCII", wire_refuses(index, not_ascii))
    for control in (b"host\n", b"\x00"):
        assert re.match(rf"{name}\b.*control characters", wire_refuses(index, control))
    # the parser only reads text; the room's contract (no spaces, known dtype) is check_frame's
    assert getattr(with_part(index, b"a b"), name) == "a b"


def test_parts_are_checked_in_order_and_the_first_bad_one_named():
    parts = list(WIRED_PARTS)
    parts[1], parts[2], parts[3], parts[10] = b"-1", b"\xff", b"", b"x"
    with pytest.raises(FrameError, match="^dst_ptr "):
        frame_from_parts(parts)
    parts[3] = bytes(8)
    with pytest.raises(FrameError, match="^has_deepstack "):
        frame_from_parts(parts)
    parts[10] = b"0"
    with pytest.raises(FrameError, match="^room "):
        frame_from_parts(parts)


@pytest.mark.parametrize("endpoint", [
    "udp://127.0.0.1:5555",  # statuses go out over TCP only (the control plane asks this alone)
    "tcp://127.0.0.1:005555",  # six digits, whatever their value
    "tcp://[1.2.3.4]:5555",  # brackets hold an IPv6 address only
    "tcp://[::12:5555",  # an opening bracket without its closing one
    "tcp://::12]:5555",
])
def test_a_status_endpoint_that_is_not_plainly_numeric_tcp_is_refused(endpoint):
    assert not numeric_endpoint(endpoint)
    with pytest.raises(FrameError):
        check_frame(FLAT._replace(status_endpoint=endpoint))


@pytest.mark.parametrize("endpoint", ["tcp://[::1.2.3.4]:5555", "tcp://[fe80::]:1", "tcp://[1::]:65535"])
def test_a_bracketed_ipv6_endpoint_is_read_whole(endpoint):
    # whose every character matters: one dropped from either end leaves no address
    assert numeric_endpoint(endpoint)
    check_frame(FLAT._replace(status_endpoint=endpoint))
