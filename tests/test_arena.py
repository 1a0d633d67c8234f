"""The arena allocator (executor/core/arena.py): extents never overlap, free space is coalesced, alignment kept."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, strategies as st

from epd_ring.executor.core.arena import Arena, _cls


def check(a: Arena, live: dict[int, int]) -> None:
    """Live and free extents tile [0, capacity) exactly; no two free extents touch."""
    assert a.live_extents() == sorted((o, a.extent_bytes(o)) for o in live)
    for off, want in live.items():
        assert off % a.align == 0 and a.extent_bytes(off) >= want
    free = a.free_extents()
    pieces = sorted([*a.live_extents(), *free])
    at = 0
    for off, n in pieces:
        assert off == at and n > 0, (off, at)  # no gap, no overlap
        at = off + n
    assert at == a.capacity
    free_ends = {o + n for o, n in free}
    assert not any(o in free_ends for o, _ in free), "two free extents touch: not coalesced"
    assert a.in_use == sum(n for _, n in a.live_extents())
    assert a.free_bytes == sum(n for _, n in free)
    assert a.largest_free == max((n for _, n in free), default=0)


ops = st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(0, 5000)),
                         st.tuples(st.just("free"), st.integers(0, 10 ** 6))), max_size=120)


@given(capacity=st.integers(0, 40_000), align=st.sampled_from([1, 8, 64, 256]), ops=ops)
def test_random_allocs_and_frees_keep_extents_apart_coalesced_and_aligned(capacity, align, ops):
    a = Arena(capacity, align)
    live: dict[int, int] = {}
    for op, n in ops:
        if op == "alloc":
            largest = a.largest_free
            off = a.alloc(n)
            need = max(1, -(-n // align)) * align
            if off is None:
                assert largest < need, "refused although a free extent was large enough"
            else:
                assert off not in live
                live[off] = n
        elif live:
            off = sorted(live)[n % len(live)]
            del live[off]
            a.free(off)
        check(a, live)
    for off in list(live):
        a.free(off)
    assert a.free_extents() == ([(0, a.capacity)] if a.capacity else [])
    assert a.fragmentation == 0.0


def test_an_item_larger_than_the_arena_never_fits_and_one_that_fills_it_does():
    a = Arena(64 * 1000)
    assert not a.fits_ever(64 * 1000 + 1) and a.alloc(64 * 1000 + 1) is None
    assert a.fits_ever(64 * 1000)
    # 1000 units is not the lower bound of its class: the whole arena must still be found.
    assert a.alloc(64 * 1000) == 0
    assert a.alloc(1) is None and a.free_bytes == 0


def test_an_extent_in_its_own_class_is_found_when_no_larger_class_has_one():
    a = Arena(64 * 4000)
    offs = [a.alloc(64 * 1000) for _ in range(4)]
    a.free(offs[1])  # 1000 units free, between live extents: the only free extent
    assert a.alloc(64 * 999) == offs[1]
    assert a.alloc(64 * 2) is None  # one unit left, not two


def test_freeing_merges_both_neighbours_and_fragmentation_follows():
    a = Arena(64 * 10)
    offs = [a.alloc(64) for _ in range(10)]
    for o in offs[::2]:
        a.free(o)
    assert a.free_bytes == 64 * 5 and a.largest_free == 64
    assert a.fragmentation == pytest.approx(1 - 1 / 5)
    assert a.alloc(128) is None  # five bytes-worth of units free, none two in a row
    for o in offs[1::2]:
        a.free(o)
    assert a.free_extents() == [(0, 640)] and a.fragmentation == 0.0


def test_freeing_what_is_not_a_live_extent_is_refused():
    a = Arena(64 * 8)
    off = a.alloc(100)
    assert off == 0 and a.extent_bytes(off) == 128  # rounded to whole units
    with pytest.raises(ValueError):
        a.free(64)  # inside the extent, not its start
    with pytest.raises(ValueError):
        a.free(3)  # not aligned
    a.free(off)
    with pytest.raises(ValueError):
        a.free(off)  # twice


def test_a_zero_byte_item_takes_its_own_unit():
    a = Arena(64 * 2)
    x, y = a.alloc(0), a.alloc(0)
    assert x is not None and y is not None and x != y and a.alloc(0) is None


def test_size_classes_are_monotone_and_fine():
    sizes = sorted({*range(1, 5000), *(2 ** k + d for k in range(12, 40) for d in (-1, 0, 1))})
    classes = [_cls(u) for u in sizes]
    assert classes == sorted(classes)
    # sizes in one class differ by less than 1/16 of the smallest
    lo: dict[int, int] = {}
    for u, c in zip(sizes, classes):
        lo.setdefault(c, u)
        assert u - lo[c] < max(1, lo[c] / 16)


def test_heaps_stay_proportional_to_the_free_extents_over_a_long_churn():
    rng = random.Random(7)
    a = Arena(64 * 100_000)
    live = []
    for _ in range(20_000):
        if live and (rng.random() < 0.5 or a.largest_free < 64 * 3000):
            a.free(live.pop(rng.randrange(len(live))))
        else:
            off = a.alloc(64 * rng.randint(1, 3000))
            if off is not None:
                live.append(off)
    free = len(a.free_extents())
    assert sum(len(h) for h in a._small + a._large) <= 2 * (2 * free + 8 * len(a._small))


@pytest.mark.parametrize("seed", range(4))
def test_a_long_churn_of_near_sizes_refuses_only_when_nothing_fits(seed):
    # Many holes of a few classes, filed and unfiled over and over, so each class's heap is
    # rebuilt many times: a rebuild must keep every live hole findable.
    rng = random.Random(seed)
    a = Arena(64 * 4_000)
    live: list[int] = []
    for _ in range(30_000):
        if live and rng.random() < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            units = rng.choice((1, 2, 3, 33, 34, 40))
            largest = a.largest_free
            off = a.alloc(64 * units)
            if off is None:
                assert largest < 64 * units, "refused although a free extent was large enough"
            else:
                live.append(off)
    check(a, {o: a.extent_bytes(o) for o in live})


def holes(a: Arena, sizes: list[int]) -> list[int]:
    """Lay out free extents of `sizes` units, each followed by a one-unit live extent; their offsets."""
    offs = []
    for n in sizes:
        offs.append(a.alloc(64 * n))
        a.alloc(64)  # keeps this hole apart from the next
    for o in offs:
        a.free(o)
    return offs


def test_a_lease_takes_the_smallest_free_extent_that_fits():
    a = Arena(64 * 100)
    five, three, eight = holes(a, [5, 3, 8])
    assert a.alloc(64 * 3) == three  # an exact fit, though a larger extent comes first
    assert a.alloc(64 * 4) == five  # not the 8-unit hole nor the free space at the end
    assert a.alloc(64 * 6) == eight


def test_equal_best_fits_go_to_the_lowest_address():
    a = Arena(64 * 100)
    first, _, third = holes(a, [4, 9, 4])
    assert a.alloc(64 * 4) == first
    assert a.alloc(64 * 4) == third


def test_the_free_space_at_the_end_is_taken_when_it_is_the_best_fit():
    a = Arena(64 * 20)
    big = a.alloc(64 * 10)
    a.alloc(64 * 7)  # three units left at the end
    a.free(big)
    assert a.alloc(64 * 3) == 64 * 17  # the 10-unit hole stays whole for a larger item
    assert a.alloc(64 * 10) == 0


def test_within_one_size_class_a_larger_extent_that_fits_beats_one_of_a_larger_class():
    a = Arena(64 * 10_000)
    assert _cls(1000) == _cls(1010) != _cls(2000)
    small, mid, large = holes(a, [1000, 1010, 2000])
    # The class's smallest extent (1000) is too small; its largest (1010) fits and is smaller
    # than anything in a larger class.
    assert a.alloc(64 * 1005) == mid
    assert a.alloc(64 * 1005) == large  # the 1000-unit hole never fits it
    assert a.alloc(64 * 1000) == small


def test_a_freed_extent_is_taken_back_by_a_lease_of_its_exact_size():
    a = Arena(64 * 100)
    x, _, z = (a.alloc(64 * n) for n in (3, 5, 3))
    a.free(z)
    a.free(x)
    # x is an exact fit between live extents; z merged with the free space at the end.
    assert a.alloc(64 * 3) == x and a.alloc(64 * 3) == z
    assert a.in_use == 64 * 11


def test_the_extent_freed_last_is_merged_before_any_other_lease_and_in_the_gauges():
    a = Arena(64 * 6)
    offs = [a.alloc(64 * 2) for _ in range(3)]
    a.free(offs[0])
    a.free(offs[1])
    # Two 2-unit extents side by side, the second not merged yet: the free space they make is 4 units.
    assert a.largest_free == 64 * 4 and a.free_extents() == [(0, 64 * 4)]
    assert a.alloc(64 * 4) == 0  # another size: it sees them merged
    a.free(offs[2])
    a.free(0)
    assert a.free_extents() == [(0, 64 * 6)] and a.fragmentation == 0.0


def test_the_gauges_only_read_so_another_thread_may_call_them():
    a = Arena(64 * 50)
    offs = [a.alloc(64 * n) for n in (1, 2, 3, 4, 5)]
    for o in offs[::2]:
        a.free(o)
    before = (dict(a._free), a._last, [list(h) for h in a._small + a._large])
    a.largest_free, a.free_extents(), a.fragmentation
    assert before == (dict(a._free), a._last, [list(h) for h in a._small + a._large])


class MergesAtOnce(Arena):
    """The same allocator with nothing put off: every free merges at once."""

    __slots__ = ()

    def free(self, offset: int) -> None:
        super().free(offset)
        self._merge(self._last, self._last_u)
        self._last = -1


@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=8), ops=ops)
def test_putting_off_the_last_merge_never_changes_where_an_item_goes(sizes, ops):
    # A few sizes, as an encoder's items come: the extent freed last is often taken back at once.
    a, b = Arena(64 * 400), MergesAtOnce(64 * 400)
    live: list[int] = []
    for op, n in ops:
        if op == "alloc":
            got = a.alloc(sizes[n % len(sizes)])
            assert got == b.alloc(sizes[n % len(sizes)])
            if got is not None:
                live.append(got)
        elif live:
            off = live.pop(n % len(live))
            a.free(off)
            b.free(off)
        assert a.free_extents() == b.free_extents()


def test_a_non_power_of_two_alignment_is_refused():
    for align in (0, 3, 48, 96):
        with pytest.raises(ValueError):
            Arena(64 * 10, align)


def best_fit(free: list[tuple[int, int]], nbytes: int, align: int = 64) -> int | None:
    """Where the module docstring's policy puts `nbytes`, worked out from the merged free extents alone."""
    def cls(u: int) -> int:  # exact below 32 units, then 16 classes per power of two
        return u if u < 32 else ((u.bit_length() - 4) << 4) + (u >> (u.bit_length() - 5)) - 16

    u = max(1, -(-nbytes // align))
    holes = [(n // align, off) for off, n in free]
    own = [h for h in holes if cls(h[0]) == cls(u)]
    if own and min(own)[0] >= u:
        return min(own)[1]  # the smallest of u's own class
    if own and max(own, key=lambda h: (h[0], -h[1]))[0] >= u:
        return max(own, key=lambda h: (h[0], -h[1]))[1]  # else its largest, lowest address first
    larger = [h for h in holes if cls(h[0]) > cls(u)]
    return min(larger)[1] if larger else None


@pytest.mark.parametrize("seed", range(2))
def test_every_lease_lands_where_best_fit_over_the_merged_free_space_puts_it(seed):
    # Sizes about the class bounds (32 units, 64 units) and a few that repeat, so the extent freed
    # last is often taken back at once, next to free extents of its own and other classes.
    rng = random.Random(seed)
    a = Arena(64 * 600)
    live: dict[int, int] = {}
    for _ in range(1500):
        if live and rng.random() < 0.45:
            off = rng.choice(sorted(live))
            del live[off]
            a.free(off)
        else:
            n = 64 * rng.choice((1, 2, 3, 5, 31, 32, 33, 34, 40, 63, 64, 66, 70)) - rng.choice((0, 1, 63))
            want = best_fit(a.free_extents(), n)
            got = a.alloc(n)
            assert got == want, (n, a.free_extents())
            if got is not None:
                live[got] = n
        check(a, live)


def test_the_extent_freed_last_is_not_taken_back_where_a_free_neighbour_below_would_merge_with_it():
    for below_units in (2, 3):  # of the lease's size and of another
        a = Arena(64 * (below_units + 3))  # no free space at the end: `below` is the only other free extent
        below, last = a.alloc(64 * below_units), a.alloc(64 * 2)
        a.alloc(64)
        a.free(below)
        a.free(last)
        # Merged they start at 0: a 2-unit item goes at their low end, not where `last` was.
        assert a.alloc(64 * 2) == below


def test_the_extent_freed_last_with_free_space_after_it_yields_to_a_better_fit():
    a = Arena(64 * 100)
    a.alloc(64 * 2)
    hole = a.alloc(64 * 3)
    a.alloc(64)
    last = a.alloc(64 * 2)  # the free space at the end follows it
    a.free(hole)
    a.free(last)
    # Merged with the free space after it, `last` is the large extent: the 3-unit hole fits better.
    assert a.alloc(64 * 2) == hole
    assert a.alloc(64 * 2) == last


def test_the_extent_freed_last_yields_to_a_better_fit_of_its_free_neighbours_class():
    a = Arena(64 * 12)  # no free space at the end
    a.alloc(64 * 2)
    hole = a.alloc(64 * 3)
    a.alloc(64)
    last, after = a.alloc(64 * 2), a.alloc(64 * 3)
    a.alloc(64)
    a.free(after)
    a.free(hole)
    a.free(last)
    # Merged with the 3 units after it, `last` makes 5; the other 3-unit extent fits better.
    assert a.alloc(64 * 2) == hole


def test_the_extent_freed_last_yields_to_an_exact_fit_elsewhere_when_its_free_neighbour_is_smaller():
    a = Arena(64 * 11)
    exact = a.alloc(64 * 3)
    a.alloc(64)
    last, after = a.alloc(64 * 3), a.alloc(64 * 2)
    a.alloc(64)
    a.alloc(64)  # the arena is full
    a.free(after)
    a.free(exact)
    a.free(last)
    assert a.alloc(64 * 3) == exact  # an exact fit beats the 5 units `last` makes with its neighbour


def test_the_extent_freed_last_yields_to_an_equal_fit_at_a_lower_address():
    a = Arena(64 * 100)
    first, _, last, _ = (a.alloc(64) for _ in range(4))
    a.free(first)
    a.free(last)
    assert a.alloc(64) == first
    assert a.alloc(64) == last


def test_carving_one_extent_over_and_over_keeps_its_class_findable():
    # Three holes of one class (1024-1087 units) and nothing smaller: each 1-unit lease carves the
    # smallest hole, which stays in the class, so that class's largest-first heap gathers stale
    # entries until it is rebuilt.
    a = Arena(64 * (1080 + 1085 + 1087 + 3))
    first = holes(a, [1080, 1085, 1087])[0]
    for k in range(40):
        assert a.alloc(64) == first + 64 * k
    assert a.largest_free >= 64 * 1087
    assert a.alloc(64 * 1087) is not None and a.alloc(64 * 1085) is not None


def test_after_its_smallest_extent_is_carved_a_class_still_finds_its_largest():
    # Two holes of one class (1024-1087 units): a 1-unit lease carves the smaller, which stays in
    # the class; the larger must still be found, and a size between them refused, not crash.
    a = Arena(64 * (1030 + 1080 + 2))
    small, large = holes(a, [1030, 1080])
    assert a.alloc(64) == small
    assert a.alloc(64 * 1080) == large
    assert a.alloc(64 * 1040) is None and a.largest_free == 64 * 1029


class GaugedMidMerge(Arena):
    """Reads the gauges while a merge is under way, as the metrics thread may."""

    __slots__ = ("seen",)

    def _merge(self, start: int, u: int) -> None:
        self.seen = self.free_extents()
        super()._merge(start, u)


def test_a_gauge_read_during_a_merge_sees_each_free_byte_once():
    a = GaugedMidMerge(64 * 8)
    x, _, z = a.alloc(64 * 2), a.alloc(64 * 3), a.alloc(64)
    a.free(x)
    a.free(z)  # merges x meanwhile: a read then may miss x (a step stale), never see bytes not free
    final = a.free_extents()
    assert sum(n for _, n in a.seen) <= a.free_bytes
    assert all(any(fo <= o and o + n <= fo + fn for fo, fn in final) for o, n in a.seen), (a.seen, final)
