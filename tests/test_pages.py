"""Read pages: memory the engine reads into outlives every read, and a failed read's page is retired."""

from __future__ import annotations

import ctypes

import pytest

from epd_ring.executor.drivers.pages import ReadPages


def test_a_page_whose_read_failed_is_never_handed_out_again_and_its_bytes_are_not_read():
    pages = ReadPages(64, slab_pages=4)
    failed = pages.take("k")
    ctypes.memmove(failed, b"late", 4)
    pages.give_back(failed, ok=False, identity="k")
    assert pages.retired("k") == [failed]
    with pytest.raises(ValueError):
        pages.read(failed)  # a retired page's bytes are whatever the engine wrote late
    taken = {pages.take("k") for _ in range(3 * 4)}
    assert failed not in taken and len(taken) == 12  # slabs grow rather than reuse it
    assert pages.pages == 16


def test_a_page_whose_read_succeeded_is_reused_and_its_bytes_read():
    pages = ReadPages(64, slab_pages=2)
    page = pages.take()
    ctypes.memmove(page, b"owner", 5)
    assert pages.read(page)[:5] == b"owner"
    pages.give_back(page, ok=True)
    assert pages.take() == page
    assert pages.pages == 2


def test_an_identity_past_its_retired_pages_is_refused_alone_until_its_oldest_may_be_reused():
    now = [0.0]
    pages = ReadPages(64, slab_pages=1, retired_per_identity=2, reuse_after_s=100.0, clock=lambda: now[0])
    first = pages.take("attacker")
    pages.give_back(first, ok=False, identity="attacker")
    now[0] = 10.0
    second = pages.take("attacker")
    pages.give_back(second, ok=False, identity="attacker")
    assert pages.take("attacker") is None and pages.refused == 1
    honest = pages.take("honest")  # another identity is not held by the attacker's failures
    assert honest is not None and honest not in (first, second)
    now[0] = 99.0
    assert pages.take("attacker") is None
    now[0] = 100.0  # the oldest is long past any reply the engine could still write
    assert pages.take("attacker") == first
    assert pages.retired("attacker") == [second]
    assert pages.pages == 3  # bounded: 2 retired + what is in use


def test_slabs_are_registered_once_each_when_the_engine_reads_through_a_nic():
    registered = []
    pages = ReadPages(64, slab_pages=4, register=lambda addr, n: registered.append((addr, n)))
    taken = [pages.take() for _ in range(5)]
    assert len(registered) == 2 and all(n == 256 for _, n in registered)
    assert all(any(a <= p < a + n for a, n in registered) for p in taken)


@pytest.mark.parametrize("kw", [dict(page_bytes=0), dict(page_bytes=64, slab_pages=0),
                                dict(page_bytes=64, retired_per_identity=0),
                                dict(page_bytes=64, reuse_after_s=float("nan"))])
def test_read_pages_settings_are_checked(kw):
    with pytest.raises(ValueError):
        ReadPages(**kw)
