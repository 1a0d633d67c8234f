"""The ring: slots registered once with the transport, their views, the free list, and close."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from epd_ring.executor import LoopbackTransport, Ring
from epd_ring.executor.core.timers import Deadlines


def test_ring_settings_are_checked_with_clear_errors():
    t = LoopbackTransport()
    # each refusal names what is wrong and echoes the value given
    bad = [((0, 64), {}, r"\bslot\b.*\b0$"),
           ((1, 0), {}, r"^slot bytes\b.*\b64\b.*\b0$"),
           ((1, 100), {}, r"^slot bytes\b.*\b64\b.*\b100$"),
           ((1, 64), dict(deep_slot_bytes=32), r"^deepstack slot bytes\b.*\b64\b.*\b32$")]
    for args, kw, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            Ring(t, *args, **kw)
    assert len(t.local) == 0  # nothing registered by a refused ring


def test_a_ring_without_deepstack_registers_one_byte_region_per_slot_on_its_device():
    t = LoopbackTransport()
    ring = Ring(t, 3, 128)
    assert ring.device == torch.device("cpu") and ring.main.device == ring.device
    assert ring.main.dtype == torch.uint8 and ring.main.numel() == 3 * 128
    assert ring.deep is None and ring.deep_base == 0 and ring.deep_slot_bytes == 0
    assert len(t.local) == 3 and all(t.local.covers(ring.main_ptr(s), 128) for s in ring.slots)
    assert not t.local.covers(ring.main_base, 129)  # one region per slot, never one across two
    deep = Ring(t, 2, 64, deep_slot_bytes=192)
    assert deep.deep.dtype == torch.uint8 and deep.deep.numel() == 2 * 192 and deep.deep.device == deep.device
    assert len(t.local) == 3 + 4 and all(t.local.covers(deep.deep_ptr(s), 192) for s in deep.slots)
    # the meta device holds no memory but keeps placement visible: the ring lives where asked
    anywhere = SimpleNamespace(register_memory=lambda regions, owner=None: None)  # meta pointers are all 0
    meta = Ring(anywhere, 2, 64, device="meta", deep_slot_bytes=64)
    assert meta.device.type == meta.main.device.type == meta.deep.device.type == "meta"


def test_fresh_slots_are_free_empty_and_have_no_deadline():
    ring = Ring(LoopbackTransport(), 2, 64)
    for s in ring.slots:
        assert (s.state, s.room, s.unsure, s.writes_in_flight) == ("free", None, False, 0) and not s.timer
    deadlines = Deadlines()
    deadlines.arm(1.0, "quarantine", ring.slots[0])
    assert len(deadlines) == 1 and list(deadlines.due(1.0)) == [("quarantine", ring.slots[0])]


def test_slot_views_cover_exactly_their_slot():
    t = LoopbackTransport()
    ring = Ring(t, 3, 64, deep_slot_bytes=128)
    ring.main.zero_()
    ring.deep.zero_()
    slot = ring.slots[2]
    main = ring.main_view(slot, 32)
    assert main.numel() == 32 and main.data_ptr() == ring.main_ptr(slot) == ring.main_base + 2 * 64
    main.fill_(7)
    assert ring.main[128:160].eq(7).all() and not ring.main[:128].any() and not ring.main[160:].any()
    deep = ring.deep_view(slot, 100)
    assert deep.numel() == 100 and deep.data_ptr() == ring.deep_ptr(slot) == ring.deep_base + 2 * 128
    deep.fill_(9)
    assert ring.deep[256:356].eq(9).all() and not ring.deep[:256].any() and not ring.deep[356:].any()


def test_a_slot_back_on_the_free_list_forgets_its_room_and_is_reused_last():
    ring = Ring(LoopbackTransport(), 2, 64)
    a = ring.lease()
    a.room = 7  # the executor names the room a leased slot holds
    assert ring.fire(a, "abandon") == "free"
    assert a.room is None and ring.free_count == 2
    b = ring.lease()
    assert b is ring.slots[1] and ring.lease() is a  # FIFO: the slot freed longest ago first
    b.room, b.unsure, b.writes_in_flight = 8, True, 0  # its write failed: it may still land
    for event in ("copied", "send"):
        ring.fire(b, event)
    assert ring.fire(b, "settle") == "quarantined" and b.room == 8 and ring.free_count == 0
    assert ring.fire(b, "release") == "free"
    assert b.room is None and b.unsure is False and ring.free_count == 1
    assert ring.lease() is b
    for event in ("copied", "send"):
        ring.fire(b, event)
    assert ring.fire(b, "settle") == "free"  # its next, clean write needs no quarantine


def test_close_retires_free_slots_and_counts_the_busy_ones():
    ring = Ring(LoopbackTransport(), 3, 64)
    busy = ring.lease()
    assert ring.close() == 1
    assert ring.counts() == {"retired": 2, busy.state: 1} and busy.state != "retired"
    assert Ring(LoopbackTransport(), 2, 64).close() == 0
