"""The ring: one arena per half registered once with the transport, extents leased by size, their
views, bytes back only on `free`, and close."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from epd_ring.executor import Extent, LoopbackTransport, Ring
from epd_ring.executor.core.timers import Deadlines


def test_ring_settings_are_checked_with_clear_errors():
    t = LoopbackTransport()
    # each refusal names what is wrong and echoes the value given
    bad = [((0,), {}, r"^arena bytes\b.*\b64\b.*\b0$"),
           ((100,), {}, r"^arena bytes\b.*\b64\b.*\b100$"),
           ((64,), dict(deep_bytes=32), r"^deepstack arena bytes\b.*\b64\b.*\b32$"),
           ((64,), dict(max_item_bytes=0), r"^max item bytes\b.*\b0$")]
    for args, kw, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            Ring(t, *args, **kw)
    assert len(t.local) == 0  # nothing registered by a refused ring


def test_each_arena_is_one_registration_on_the_rings_device():
    t = LoopbackTransport()
    ring = Ring(t, 3 * 128)
    assert ring.device == torch.device("cpu") and ring.main.device == ring.device
    assert ring.main.dtype == torch.uint8 and ring.main.numel() == 3 * 128
    assert ring.deep is None and ring.deep_base == 0 and ring.deep_arena is None
    assert len(t.local) == 1 and t.local.covers(ring.main_base, 3 * 128)  # one registration, not one per extent
    deep = Ring(t, 128, deep_bytes=3 * 128)
    assert deep.deep.dtype == torch.uint8 and deep.deep.numel() == 3 * 128 and deep.deep.device == deep.device
    assert len(t.local) == 1 + 2 and t.local.covers(deep.deep_base, 3 * 128)
    for _ in range(3):
        deep.lease(64, 128)
    assert len(t.local) == 3  # leasing registers nothing
    # the meta device holds no memory but keeps placement visible: the ring lives where asked
    anywhere = SimpleNamespace(register_memory=lambda regions, owner=None: None)  # meta pointers are all 0
    meta = Ring(anywhere, 128, device="meta", deep_bytes=64)
    assert meta.device.type == meta.main.device.type == meta.deep.device.type == "meta"


def test_a_fresh_extent_is_copying_for_no_room_and_has_no_deadline():
    ring = Ring(LoopbackTransport(), 256)
    e = ring.lease(100)
    assert (e.state, e.room, e.unsure, e.writes_in_flight) == ("copying", None, False, 0) and not e.timer
    assert (e.offset, e.nbytes, e.deep_offset, e.deep_nbytes) == (0, 100, -1, 0)
    assert ring.main_arena.in_use == 128  # whole 64-byte units
    deadlines = Deadlines()
    deadlines.arm(1.0, "quarantine", e)
    assert len(deadlines) == 1 and list(deadlines.due(1.0)) == [("quarantine", e)]


def test_extent_views_cover_exactly_their_bytes():
    ring = Ring(LoopbackTransport(), 3 * 64, deep_bytes=3 * 128)
    ring.main.zero_()
    ring.deep.zero_()
    ring.lease(64, 128)
    second = ring.lease(32, 100)
    assert (second.offset, second.deep_offset) == (64, 128)
    main = ring.main_view(second, 32)
    assert main.numel() == 32 and main.data_ptr() == ring.main_ptr(second) == ring.main_base + 64
    main.fill_(7)
    assert ring.main[64:96].eq(7).all() and not ring.main[:64].any() and not ring.main[96:].any()
    deep = ring.deep_view(second, 100)
    assert deep.numel() == 100 and deep.data_ptr() == ring.deep_ptr(second) == ring.deep_base + 128
    deep.fill_(9)
    assert ring.deep[128:228].eq(9).all() and not ring.deep[:128].any() and not ring.deep[228:].any()


def test_an_item_takes_both_arenas_or_neither():
    ring = Ring(LoopbackTransport(), 4 * 64, deep_bytes=2 * 64)
    held = ring.lease(64, 128)  # the deepstack arena is now full
    assert ring.lease(64, 64) is None
    assert ring.main_arena.in_use == 64 and ring.live == 1  # the main bytes it took were given back
    assert ring.lease(64) is not None  # an item without deepstack rows needs only the main arena
    ring.fire(held, "abandon")
    assert ring.lease(64, 128) is not None


def test_bytes_go_back_only_when_the_extent_enters_free():
    ring = Ring(LoopbackTransport(), 2 * 64)
    a = ring.lease(64)
    a.room = 7  # the executor names the room an extent holds
    b = ring.lease(64)
    assert ring.lease(1) is None
    b.room, b.unsure = 8, True  # its write failed: it may still land
    for event in ("copied", "send"):
        ring.fire(b, event)
    assert ring.fire(b, "settle") == "quarantined" and b.room == 8
    assert ring.lease(1) is None  # quarantined bytes are not handed out
    assert ring.fire(a, "abandon") == "free" and a.room is None
    c = ring.lease(64)
    assert c is not a and c.offset == a.offset  # a new extent on the bytes a gave back
    assert ring.lease(1) is None
    assert ring.fire(b, "release") == "free"
    assert b.room is None and b.unsure is False and ring.live == 1
    d = ring.lease(64)
    assert d.offset == b.offset
    for event in ("copied", "send"):
        ring.fire(d, event)
    assert ring.fire(d, "settle") == "free"  # a clean write needs no quarantine
    assert ring.live == 1


def test_too_large_names_the_arena_or_the_cap():
    ring = Ring(LoopbackTransport(), 4 * 64, deep_bytes=4 * 64, max_item_bytes=128)
    assert ring.too_large(128, 256) is None
    assert "max_item_bytes" in ring.too_large(129)
    assert "whole deepstack arena" in ring.too_large(64, 4 * 64 + 1)
    assert "whole ring arena" in Ring(LoopbackTransport(), 64).too_large(65)
    assert "no deepstack arena" in Ring(LoopbackTransport(), 64).too_large(64, 64)


def test_close_retires_the_ring_once_no_extent_is_live():
    ring = Ring(LoopbackTransport(), 3 * 64)
    busy = ring.lease(64)
    assert ring.close() == 1 and not ring.retired
    assert ring.counts() == {"copying": 1}
    ring.fire(busy, "abandon")
    assert ring.close() == 0 and ring.retired
    assert ring.counts() == {"retired": 1} and ring.lease(1) is None
    assert Ring(LoopbackTransport(), 64).close() == 0


def test_gauges_report_bytes_in_use_largest_free_and_fragmentation():
    ring = Ring(LoopbackTransport(), 4 * 64)
    es = [ring.lease(64) for _ in range(4)]
    ring.fire(es[0], "abandon")
    ring.fire(es[2], "abandon")
    g = ring.gauges()
    assert (g["main_bytes_in_use"], g["main_largest_free"]) == (128, 64)
    assert g["main_fragmentation"] == pytest.approx(0.5) and "deep_bytes_in_use" not in g


def test_fire_runs_the_coupled_actions_on_the_compiled_path_and_refuses_what_is_undeclared():
    from epd_ring.fsm import InvalidTransition
    from epd_ring.fsm.couplings import ON_ENTER, ON_EVENT

    ran: list[tuple[str, int]] = []
    names = {a for row in (*ON_ENTER.values(), *ON_EVENT.values()) for a in row}
    def recorder(name):
        return lambda ext: ran.append((name, ext.index))

    ring = Ring(LoopbackTransport(), 2 * 64, actions={n: recorder(n) for n in names})
    a = ring.lease(64)
    for event in ("copied", "send"):  # unguarded: the compiled plan
        ran.clear()
        ring.fire(a, event)
        dest = a.state
        assert ran == [(n, a.index) for n in ON_ENTER.get(("extent", dest), ()) + ON_EVENT.get(("extent", event), ())]
    with pytest.raises(InvalidTransition) as caught:
        ring.fire(a, "copied")  # declared only from `copying`
    assert (caught.value.machine, caught.value.state, caught.value.event) == ("extent", "sending", "copied")
    assert a.state == "sending" and ring.live == 1


def test_a_cap_of_one_byte_is_a_valid_max_item_bytes_and_fits_bytes_is_the_largest_size_accepted():
    for cap, ring in ((1, Ring(LoopbackTransport(), 4 * 64, max_item_bytes=1)),
                      (100, Ring(LoopbackTransport(), 4 * 64, max_item_bytes=100)),
                      (None, Ring(LoopbackTransport(), 4 * 64))):
        # staging skips `too_large` for items up to `fits_bytes`: it must be exactly the bound
        assert ring.too_large(ring.fits_bytes) is None and ring.too_large(ring.fits_bytes + 1) is not None
        assert ring.fits_bytes == (cap if cap is not None else 4 * 64)


def test_an_item_without_deepstack_rows_is_not_too_large_for_a_ring_without_a_deepstack_arena():
    ring = Ring(LoopbackTransport(), 2 * 64)
    assert ring.too_large(2 * 64) is None and ring.too_large(64, 0) is None


def test_extent_cost_rounds_each_half_up_to_whole_units():
    cases = {(0,): 64, (1,): 64, (63,): 64, (64,): 64, (65,): 128,
             (64, 0): 64, (64, 1): 128, (64, 63): 128, (64, 64): 128, (64, 65): 192, (0, 65): 192}
    assert {args: Ring.extent_cost(*args) for args in cases} == cases


def test_a_lease_records_both_halves_sizes():
    ring = Ring(LoopbackTransport(), 4 * 64, deep_bytes=4 * 64)
    e = ring.lease(100, 130)
    assert (e.nbytes, e.deep_nbytes) == (100, 130) and ring.deep_arena.extent_bytes(e.deep_offset) == 3 * 64
    bare = Extent(9, ring, 0, 64)  # built by hand: no deepstack half unless given
    assert (bare.deep_offset, bare.deep_nbytes) == (-1, 0)


def test_the_deepstack_arena_has_its_own_gauges():
    ring = Ring(LoopbackTransport(), 4 * 64, deep_bytes=4 * 64)
    ring.lease(64, 128)
    g = ring.gauges()
    assert (g["deep_bytes_in_use"], g["deep_largest_free"], g["deep_fragmentation"]) == (128, 128, 0.0)
    assert g["main_bytes_in_use"] == 64


def test_an_extent_object_stepped_into_free_again_gives_back_no_bytes_it_no_longer_holds():
    ring = Ring(LoopbackTransport(), 2 * 64)
    old = ring.lease(64)
    ring.fire(old, "abandon")
    new = ring.lease(64)
    assert new.offset == old.offset
    ring.fire(old, "lease")  # a stale handle stepped again: the ring does not hold it
    assert ring.fire(old, "abandon") == "free"
    assert ring.main_arena.in_use == 64 and ring.live == 1 and ring.lease(64) is not None
