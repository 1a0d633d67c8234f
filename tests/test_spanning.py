"""Items spanning several runs of the arena (`max_pieces`, 4 by default; issue 33): an item no free run
holds whole takes up to `max_pieces` of them, its receivers still get contiguous rows, and every piece keeps
its bytes until its extent is free."""

from __future__ import annotations

import random

import pytest
from helpers import make_rig, reason_kind
from hypothesis import given, strategies as st
from test_arena import check

from epd_ring.executor import LoopbackTransport, Ring
from epd_ring.executor.core.arena import Arena, span
from epd_ring.executor.core.rooms import spread
from epd_ring.executor.tools.timeline import TimelineRecorder

HIDDEN = 8
ROWS = 16  # one quarter of the rig's arena: 16 rows of 8 float32
QUARTER = ROWS * HIDDEN * 4


# -- the arena --------------------------------------------------------------------------------------------

def _fragmented(units: int = 8) -> tuple[Arena, dict[int, int]]:
    """An arena of `units` 64-byte units with every other unit live: `units // 2` free runs of one unit."""
    a = Arena(units * 64)
    live = {a.alloc(64): 64 for _ in range(units)}
    for off in sorted(live)[::2]:
        a.free(off)
        del live[off]
    return a, live


def test_an_item_no_free_run_holds_takes_the_largest_runs_then_the_best_fit_for_the_rest():
    a = Arena(16 * 64)
    sizes = [64, 64, 3 * 64, 64, 2 * 64, 64, 64 * 7]
    offsets = [a.alloc(n) for n in sizes]
    for i in (0, 2, 4):  # free runs of 1, 3 and 2 units, none touching another
        a.free(offsets[i])
    live = {offsets[i]: sizes[i] for i in (1, 3, 5, 6)}
    assert a.alloc(4 * 64) is None
    pieces = span(a, 4 * 64 + 10, 4)
    # the 3-unit run whole, then the best fit for the 74 bytes left: the 2-unit run, not the 1-unit one
    assert pieces == [(offsets[2], 3 * 64), (offsets[4], 74)]
    live.update(pieces)
    check(a, live)


def test_a_span_that_needs_more_pieces_than_allowed_takes_nothing():
    a, live = _fragmented()
    before = (a.free_extents(), a.in_use)
    assert span(a, 3 * 64, 2) is None  # three one-unit runs would be needed
    assert (a.free_extents(), a.in_use) == before
    check(a, live)
    assert span(a, 5 * 64, 8) is None  # only four units are free at all
    assert (a.free_extents(), a.in_use) == before
    got = span(a, 3 * 64, 3)
    assert got is not None and len(got) == 3 and all(n == 64 for _, n in got)
    live.update(got)
    check(a, live)


def test_a_span_of_an_item_one_free_run_holds_is_that_one_run():
    a, _ = _fragmented()
    lowest = a.free_extents()[0][0]
    assert span(a, 64, 4) == [(lowest, 64)]


@given(seed=st.integers(0, 10 ** 6), most=st.integers(1, 5))
def test_random_spans_never_overlap_and_fail_only_when_the_largest_runs_are_too_small(seed, most):
    rng = random.Random(seed)
    a = Arena(64 * 64)
    live: dict[int, int] = {}  # offset -> bytes, of every piece
    items: list[list[tuple[int, int]]] = []
    for _ in range(60):
        if items and rng.random() < 0.45:
            for off, _n in items.pop(rng.randrange(len(items))):
                a.free(off)
                del live[off]
        else:
            n = rng.randrange(1, 12 * 64)
            runs = sorted((size for _, size in a.free_extents()), reverse=True)
            at = a.alloc(n)
            got = [(at, n)] if at is not None else span(a, n, most)
            if got is None:
                # largest first is the fewest pieces: the `most` largest runs together must be too small
                assert sum(runs[:most]) < -(-n // 64) * 64
            else:
                assert 1 <= len(got) <= most and sum(size for _, size in got) == n
                items.append(got)
                live.update(got)
        check(a, live)


# -- the ring -------------------------------------------------------------------------------------------

def _holed(max_pieces: int = 2, deep: bool = False) -> Ring:
    """A ring of four 64-byte units (in each half) whose units 0 and 2 are free: two holes apart."""
    ring = Ring(LoopbackTransport(), 4 * 64, deep_bytes=4 * 64 if deep else 0, max_pieces=max_pieces)
    for e in [ring.lease(64, 64 if deep else 0) for _ in range(4)][::2]:
        ring.fire(e, "abandon")
    return ring


def test_a_ring_spans_only_when_asked_and_gives_every_piece_back_when_free():
    plain, spanning = _holed(max_pieces=1), _holed()
    assert plain.lease(128) is None
    e = spanning.lease(100)
    assert e.pieces == ((0, 64), (128, 36)) and (e.offset, e.nbytes) == (0, 100)
    assert spanning.main_arena.in_use == 4 * 64
    spanning.fire(e, "abandon")
    assert spanning.main_arena.in_use == 2 * 64 and e.state == "free"


def test_a_spanning_item_takes_both_arenas_or_neither():
    ring = Ring(LoopbackTransport(), 6 * 64, deep_bytes=4 * 64, max_pieces=2)
    a, _, c, _ = [ring.lease(64, 64) for _ in range(4)]
    e = ring.lease(128)
    for x in (a, c):
        ring.fire(x, "abandon")
    ring.lease(64, 64)  # takes unit 0 of each half: the main half's units 2 and 4-5 and the deepstack's 2 are free
    ring.fire(e, "abandon")
    free = ring.main_arena.free_extents()
    assert ring.lease(192, 128) is None  # the main half spans 4-5 and 2; the deepstack half cannot take 128
    assert ring.main_arena.free_extents() == free and ring.main_arena.in_use == 3 * 64  # the main pieces went back
    both = _holed(deep=True)
    e = both.lease(128, 128)
    assert e.pieces == ((0, 64), (128, 64)) and e.deep_pieces == ((0, 64), (128, 64))
    both.fire(e, "abandon")
    assert both.main_arena.in_use == both.deep_arena.in_use == 2 * 64


def test_spread_maps_a_receivers_rows_onto_the_pieces_they_touch():
    pieces = ((1000, 64), (5000, 64), (9000, 32))
    assert spread(pieces, 0, 70000, 160) == [(1000, 70000, 64), (5000, 70064, 64), (9000, 70128, 32)]
    assert spread(pieces, 60, 70000, 10) == [(1060, 70000, 4), (5000, 70004, 6)]
    assert spread(pieces, 128, 70000, 32) == [(9000, 70000, 32)]
    assert spread(pieces, 64, 70000, 0) == []


def test_each_receiver_writes_its_own_rows_from_every_piece_and_a_zero_row_shard_none():
    from types import SimpleNamespace as NS

    from epd_ring.executor.core.rooms import Chunk, chunk_writes

    # 4 rows of 16 bytes main and 32 deepstack; main in pieces of 40 and 24 bytes, deepstack in one run
    chunk = Chunk(None, 4, 4, "torch.float32", 16, 1000, 5000, 32, 2, pieces=((1000, 40), (3000, 24)))
    frames = [NS(n_tokens=2, row_start=0, dst_ptr=100, dst_deep_ptr=200),
              NS(n_tokens=0, row_start=2, dst_ptr=0, dst_deep_ptr=0),
              NS(n_tokens=2, row_start=2, dst_ptr=300, dst_deep_ptr=400)]
    writes = chunk_writes(chunk, frames)
    assert [f for f, _ in writes] == [frames[0], frames[2]]
    assert writes[0][1] == ((1000, 100, 32), (5000, 200, 64))
    assert writes[1][1] == ((1032, 300, 8), (3000, 308, 24), (5064, 400, 64))  # row 2 straddles the pieces


# -- an item end to end on the loopback -------------------------------------------------------------------

def _two_holes(rig) -> None:
    """Four quarter-arena rooms staged: 2 and 4 wait for a receiver (parked: the rig bounds no parked
    bytes), 1 and 3 fail, so the
    arena's free bytes are two quarters that do not touch."""
    for room in (1, 2, 3, 4):
        rig.executor.register(f"r{room}", "prefill-host", 8998, room)
        rig.executor.execute([(f"r{room}", rig.item(ROWS, room))])
    rig.executor.fail_rooms(["r1", "r3"], "gone")
    arena = rig.executor.ring.main_arena
    assert arena.free_bytes == 2 * QUARTER and arena.largest_free == QUARTER


@pytest.mark.parametrize("n_deep, host_copy", [(0, True), (2, True), (2, False)],
                         ids=["plain", "deepstack", "through torch"])
def test_an_item_spanning_two_holes_reaches_every_receiver_whole(n_deep, host_copy):
    rig = make_rig(arena_bytes=4 * QUARTER, parked_ring_share=1.0, hidden=HIDDEN, n_deep=n_deep, max_pieces=4)
    rig.executor.staging._host_copy = host_copy  # False: the device path's copy (a view per piece), on the CPU
    _two_holes(rig)
    # three shards of 32 rows: the middle one's rows straddle the two pieces
    for rank in range(3):
        rig.manager.register_receiver(rig.frame(5, f"s{rank}", 2 * ROWS, n=3, rank=rank, shard=True))
    rid = "r5"
    rig.executor.register(rid, "prefill-host", 8998, 5)
    item = rig.item(2 * ROWS, 5)
    rig.executor.execute([(rid, item)])
    extent = rig.extent_of(5)
    assert len(extent.pieces) == 2 and len(extent.deep_pieces) == (2 if n_deep else 0)
    assert rig.manager.stats["spanned"] == 1
    line = next(x for x in rig.executor.dump_state().splitlines() if x.strip().startswith(f"extent {extent.index} "))
    assert all(f"@{offset}+" in line for offset, _ in extent.pieces)  # the dump shows where each piece lies
    recorder = TimelineRecorder(rig.executor.pump, rig.clock)
    recorder.sample()
    bands = [r for r in recorder.svg().split("<rect")[1:] if f"extent {extent.index} " in r]
    assert len(bands) == 2  # the timeline draws a band per piece, where it lies
    rig.executor.poll()
    assert rig.manager.room_status(5) == "success"
    assert all(rig.delivered_ok(5, f"s{rank}", item) for rank in range(3))
    assert extent.state == "free" and rig.executor.ring.main_arena.free_bytes == 2 * QUARTER


def test_without_spanning_the_same_item_waits_for_bytes():
    rig = make_rig(arena_bytes=4 * QUARTER, parked_ring_share=1.0, hidden=HIDDEN, max_pieces=1)
    _two_holes(rig)
    rig.open_room(5, rows=2 * ROWS)
    rig.executor.execute([("r5", rig.item(2 * ROWS, 5))])
    assert rig.executor.deferred_requests() == ["r5"] and not rig.executor.can_take()


def test_a_failed_write_keeps_every_piece_of_its_extent_until_the_quarantine_ends():
    rig = make_rig(arena_bytes=4 * QUARTER, parked_ring_share=1.0, hidden=HIDDEN, max_pieces=4, quarantine_s=5.0)
    _two_holes(rig)
    rig.open_room(5, rows=2 * ROWS)
    rig.transport.inject("fail", session="p5")
    rig.executor.execute([("r5", rig.item(2 * ROWS, 5))])
    extent = rig.extent_of(5)
    rig.executor.poll()
    assert reason_kind(rig.manager, 5) is not None and extent.state == "quarantined"
    arena = rig.executor.ring.main_arena
    assert arena.free_bytes == 0  # both pieces are still held: the failed write may land late
    rig.open_room(6, rows=ROWS)
    rig.executor.execute([("r6", rig.item(ROWS, 6))])
    assert rig.executor.deferred_requests() == ["r6"]
    rig.clock.advance(5.0)
    rig.executor.poll()  # the quarantine ends, and the deferred item takes the bytes
    assert extent.state == "free" and rig.executor.deferred_requests() == []
    rig.executor.poll()
    assert rig.manager.room_status(6) == "success"
