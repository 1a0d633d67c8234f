"""The loopback transport behaves like a one-sided engine: bounds, faults, late landings."""

from __future__ import annotations

import torch

from epd_ring.executor import Outcome, TransportError
from helpers import loopback_setup


setup = loopback_setup


def test_write_lands_and_reports_done_on_next_poll():
    _, t, src, dst, _ = setup()
    h = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 64)])
    assert torch.equal(dst, src)
    assert t.poll() == [(h, Outcome.DONE)] and t.poll() == []


def test_out_of_bounds_or_dead_receiver_fails_without_writing():
    _, t, src, dst, rcv = setup()
    h1 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr() + 8, 64)])  # past the registered end
    h2 = t.submit_write("nobody", [(src.data_ptr(), dst.data_ptr(), 64)])
    rcv.kill()
    h3 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 64)])
    assert t.poll() == [(h1, Outcome.FAILED), (h2, Outcome.FAILED), (h3, Outcome.FAILED)]
    assert not dst.any()


def test_overlapping_or_empty_registration_is_refused():
    _, t, src, _, _ = setup()
    for ptr, n in ((src.data_ptr(), 64), (src.data_ptr() + 32, 64), (src.data_ptr() - 16, 32)):
        try:
            t.register_memory([(ptr, n)])
        except TransportError:
            continue
        raise AssertionError(f"overlap at {ptr:#x}+{n} accepted")
    try:
        t.register_memory([(src.data_ptr() + 4096, 0)])
    except TransportError:
        pass
    else:
        raise AssertionError("empty registration accepted")
    t.register_memory([(src.data_ptr() + 64, 64)])  # adjacent is fine


def test_timeout_that_lands_later_reads_the_source_when_it_lands():
    clock, t, src, dst, _ = setup()
    t.inject("timeout_land_later", delay=1.0, land_after=2.0)
    h = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 64)])
    clock.advance(1.0)
    assert t.poll() == [(h, Outcome.TIMED_OUT)] and not dst.any()
    src.fill_(7.0)  # the slot was rewritten before the stale write landed
    clock.advance(1.0)
    assert t.poll() == []
    assert t.late_landings == 1 and torch.equal(dst, torch.full((16,), 7.0))


def test_delay_hold_and_scripted_counts():
    clock, t, src, dst, _ = setup()
    t.inject("delay", delay=0.5)
    t.inject("hold", session="r", count=2)
    h1 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 4)])
    h2 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 4)])
    h3 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 4)])
    h4 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 4)])  # rules used up: immediate
    assert t.poll() == [(h4, Outcome.DONE)]
    clock.advance(0.5)
    assert t.poll() == [(h1, Outcome.DONE)]
    assert t.held == [h2, h3]
    t.complete(h3, Outcome.TIMED_OUT)
    assert t.poll() == [(h3, Outcome.TIMED_OUT)]
