"""A byte arena carved into variable-size extents: the allocator behind the ring.

Pure bookkeeping over offsets (no memory, no torch): the ring registers one
buffer per arena with the transport and asks this class where an item's bytes go.

Policy: best fit over segregated size classes, with boundary-tag coalescing.

- Sizes are counted in `align`-byte units; every extent starts on a multiple of
  `align` and holds a whole number of units (a zero-byte item still takes one
  unit, so every live extent has its own offset).
- Every free extent (the free space at the arena's end included: it is not kept
  for last) is filed by size class: exact classes below 32 units, then 16 classes
  per power of two, so sizes in one class differ by under 1/16. Each class keeps
  two heaps, smallest first and largest first (ties: lowest address).
- A lease takes the smallest free extent that fits, ties by lowest address: the
  smallest extent of the request's own class if it fits, else that class's
  largest if it fits, else the smallest extent of the smallest non-empty larger
  class (a bitmap finds it in O(1); every extent there fits). That is the exact
  best fit except within the request's own class, where it may take an extent
  up to 1/16 larger than the best. The item is carved from the low end; the
  rest stays free. So `alloc` fails only when no free extent is large enough.
- `free` merges the extent with a free neighbour on either side (free extents
  are indexed by start and by end), so the free space is fully coalesced: no two
  free extents touch. One step of that is put off: the extent freed last waits
  unmerged until the next lease or free. A lease of exactly its size takes it
  back when it is provably what the merged best fit would pick (no free extent
  ends where it starts, and no free extent other than its own right neighbour
  lies in a size class from the lease's up to the merged extent's): then it is
  the low end of the smallest free extent that fits, so the placement is the
  same as merging first, for a few dict and bit operations instead of four heap
  updates. That is the steady state of an encoder whose items come and go in
  turn. Anything else merges it first. `free_extents` and `largest_free` report
  the free space merged, and only read (the metrics thread calls them).

Why best fit: a failed write's extent is quarantined for tens of seconds, and
a large item (a video: up to hundreds of MiB) needs its bytes contiguous. Best
fit puts small items in the smallest holes that take them, so the large free
extents stay whole; on the arena bench's traces the search finds it needs at most
1.18x the peak bytes in flight over seeds 0-19 (`epd-ring bench-arena`; the robust
size, from which every larger ring carries too, is up to 1.24x on seeds 0-9), where keeping the
end's free space for last needed up to 1.37x and address-ordered first fit up
to 1.43x, and placing large items from the high end of their extent did worse
than plain best fit.

Cost per call: O(1) for the extent freed last, the class
search and the coalescing, O(log k) for the heaps of the classes touched (k:
free extents in a class); stale heap entries are dropped lazily and a class's
heaps are rebuilt when one holds more than twice its live entries, so memory
stays proportional to the free extents (a class that empties keeps its old heaps,
no larger than they ever were, until an extent is filed into it again). No lease or free scans the free
extents. A ring whose items come back in about the order they went out mostly
carves from and frees onto one large extent, whose heap entries are replaced in
place. The gauges (`largest_free`, `free_extents`) are not on that path: they
read the largest class's heap, or every free extent while one waits unmerged.

Which bytes may be handed out again is the caller's decision: the ring frees an
extent only when its machine enters `free`, so bytes a write may still read are
never in this arena's free space.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush, heapreplace

from mypy_extensions import mypyc_attr

_SUB = 16  # classes per power of two above the exact range


def _cls(u: int) -> int:
    """Size class of `u` units: monotone in `u`, exact below 2 * _SUB."""
    if u < 2 * _SUB:
        return u
    f = u.bit_length() - 5
    return ((f + 1) << 4) + (u >> f) - _SUB


# compiled (setup.py), it stays open to subclasses: tests have some that watch its merges
@mypyc_attr(allow_interpreted_subclasses=True)
class Arena:
    """`capacity` bytes (rounded down to `align`) handed out as aligned extents."""

    __slots__ = ("align", "capacity", "in_use", "_shift", "_units", "_live", "_free", "_end",
                 "_small", "_large", "_count", "_bitmap", "_last", "_last_u")

    def __init__(self, capacity: int, align: int = 64):
        if align < 1 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self.align = align
        self._shift = align.bit_length() - 1
        self._units = capacity >> self._shift
        self.capacity = self._units << self._shift
        self.in_use = 0
        self._live: dict[int, int] = {}   # start unit -> units, of each live extent
        self._free: dict[int, int] = {}   # start unit -> units, of each free extent
        self._end: dict[int, int] = {}    # end unit -> start unit, of each free extent
        classes = _cls(self._units) + 1 if self._units else 1
        self._small: list[list[tuple[int, int]]] = [[] for _ in range(classes)]  # (units, start): smallest first
        self._large: list[list[tuple[int, int]]] = [[] for _ in range(classes)]  # (-units, start): largest first
        self._count = [0] * classes
        self._bitmap = 0
        self._last = -1  # start unit of the extent freed last, not merged yet (-1: none)
        self._last_u = 0
        if self._units:
            self._free[0] = self._units
            self._end[self._units] = 0
            self._file(0, self._units, _cls(self._units))

    # -- the allocator --------------------------------------------------------------
    def units(self, nbytes: int) -> int:
        """Units an item of `nbytes` takes (at least one)."""
        return max(1, -(-nbytes >> self._shift))

    def fits_ever(self, nbytes: int) -> bool:
        """Whether an item of `nbytes` fits in the empty arena."""
        return self.units(nbytes) <= self._units

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least `nbytes`, or None if no free extent is large enough now."""
        u = -(-nbytes >> self._shift) or 1
        last = self._last
        if last >= 0:
            self._last = -1
            free = self._free
            # Its right neighbour is all the other free space, or there is none: trivially the best fit.
            if u == self._last_u and ((last + u in free if len(free) == 1 else not free)
                                      or self._best_is(last, u)):
                self._live[last] = u
                self.in_use += u << self._shift
                return last << self._shift
            self._merge(last, self._last_u)
        # The class look-up is written out here: it is the per-item path.
        if u < 32:
            c = u
        else:
            f = u.bit_length() - 5
            c = ((f + 1) << 4) + (u >> f) - _SUB
        if c < len(self._count) and self._count[c]:
            # u's own class: its smallest extent if that fits (the best fit), else its largest
            # if that fits (smaller than any extent of a larger class).
            n, start = self._small[c][0]
            if self._free.get(start) != n:
                start = self._smallest_in(c)
                n = self._free[start]
            if n >= u:
                return self._take(c, u, start)
            start = self._largest_in(c)
            if self._free[start] >= u:
                return self._take(c, u, start)
        m = self._bitmap >> (c + 1)
        if not m:
            return None
        # The smallest extent of the smallest class above u's own: any extent there fits.
        c += (m & -m).bit_length()
        n, start = self._small[c][0]
        if self._free.get(start) != n:
            start = self._smallest_in(c)
        return self._take(c, u, start)

    def _take(self, c: int, u: int, start: int) -> int:
        """Carve u units from the low end of the free extent at `start` (class c)."""
        free, end = self._free, self._end
        size = free.pop(start)
        del end[start + size]
        rest = size - u
        self._live[start] = u
        self.in_use += u << self._shift
        if rest:
            r = start + u
            free[r] = rest
            end[r + rest] = r
            self._refile(c, size, start, r, rest)
        else:
            self._unfile(c)
        return start << self._shift

    def free(self, offset: int) -> None:
        """The extent at `offset` becomes free: merged with its free neighbours at the next call, unless
        that is a lease of its size that best fit would place there anyway (`alloc`)."""
        start = offset >> self._shift
        u = self._live.pop(start, 0) if not offset & (self.align - 1) else 0
        if not u:
            raise ValueError(f"no live extent at offset {offset}")
        self.in_use -= u << self._shift
        last = self._last
        if last >= 0:
            self._last = -1  # a gauge read meanwhile must not see it both merged and pending
            self._merge(last, self._last_u)
        self._last_u = u
        self._last = start

    def _best_is(self, start: int, u: int) -> bool:
        """Whether best fit over the merged free space would place a `u`-unit item at `start`, the
        extent freed last (free, `u` units, not merged yet): it is the low end of its merged extent,
        and no other free extent lies in a class from `u`'s up to the merged extent's."""
        if start in self._end:
            return False  # merged, it would start lower down
        r = self._free.get(start + u, 0)
        lo, hi = _cls(u), _cls(u + r)
        others = self._bitmap & ((2 << hi) - (1 << lo))
        if others and r:
            cr = _cls(r)
            if self._count[cr] == 1:
                others &= ~(1 << cr)  # the right neighbour it merges with
        return not others

    def _merge(self, start: int, u: int) -> None:
        """File the free extent (start, u), merged with a free neighbour on either side."""
        free, end = self._free, self._end
        before = end.pop(start, None)
        stop = start + u
        after = free.pop(stop, 0)
        if after:
            del end[stop + after]
        if before is not None:  # a free extent ends where this one starts: it grows over it
            n = free[before]
            if after:
                self._unfile(_cls(after))
            total = n + u + after
            free[before] = total
            end[before + total] = before
            self._refile(n if n < 32 else _cls(n), n, before, before, total)
        elif after:  # a free extent starts where this one ends: it grows down over it
            total = u + after
            free[start] = total
            end[start + total] = start
            self._refile(after if after < 32 else _cls(after), after, stop, start, total)
        else:
            free[start] = u
            end[stop] = start
            self._file(start, u, _cls(u))

    def extent_bytes(self, offset: int) -> int:
        """Bytes held by the live extent at `offset` (its units, not the item's size)."""
        return self._live[offset >> self._shift] << self._shift

    # -- gauges -----------------------------------------------------------------------
    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.in_use

    @property
    def largest_free(self) -> int:
        """Bytes of the largest free extent, the one freed last merged with its free neighbours.

        Reads only, and copies what it walks: the metrics thread reads it while the loop allocates
        (a figure a step stale is fine; an exception would fail the scrape)."""
        if self._last >= 0 or not self._bitmap:
            return max((n for _, n in self.free_extents()), default=0)
        free = self._free
        top = list(self._large[self._bitmap.bit_length() - 1])
        found = max((-n for n, s in top if free.get(s) == -n), default=0)
        return (found << self._shift) or max((n for _, n in self.free_extents()), default=0)

    @property
    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when free space is one extent (or none)."""
        free = self.free_bytes
        return max(0.0, 1.0 - self.largest_free / free) if free else 0.0

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, bytes) of every free extent, by address, the one freed last merged with its free
        neighbours: for checks, gauges and dumps, not the hot path. Reads only."""
        pieces = sorted(self._free.items())
        last = self._last
        if last >= 0:
            pieces = sorted([*pieces, (last, self._last_u)])
        out: list[tuple[int, int]] = []
        for s, n in pieces:
            if out and out[-1][0] + out[-1][1] == s:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((s, n))
        return [(s << self._shift, n << self._shift) for s, n in out]

    def live_extents(self) -> list[tuple[int, int]]:
        """(offset, bytes) of every live extent, by address: for checks and dumps, not the hot path."""
        return sorted((s << self._shift, n << self._shift) for s, n in self._live.items())

    # -- free extents by class ------------------------------------------------------------
    def _file(self, start: int, u: int, c: int) -> None:
        """File the free extent (start, u) under class c (already in `_free` and `_end`)."""
        count = self._count[c]
        if not count:
            # An empty class starts fresh heaps: what its old ones held went stale when it emptied.
            self._small[c] = [(u, start)]
            self._large[c] = [(-u, start)]
            self._count[c] = 1
            self._bitmap |= 1 << c
            return
        small, large = self._small[c], self._large[c]
        heappush(small, (u, start))
        heappush(large, (-u, start))
        count = self._count[c] = count + 1
        if len(small) > 2 * count + 8 or len(large) > 2 * count + 8:
            self._compact(c)

    def _compact(self, c: int) -> None:
        # Drop stale entries (and duplicates of a re-filed extent) so a heap stays small.
        free, small, large = self._free, self._small[c], self._large[c]
        small[:] = {(n, s) for n, s in small if free.get(s) == n}
        large[:] = {(n, s) for n, s in large if free.get(s) == -n}
        heapify(small)
        heapify(large)

    def _refile(self, c: int, n: int, s: int, start: int, u: int) -> None:
        """The free extent (s, n) of class c is now (start, u), already so in `_free` and `_end`."""
        if u < 32:  # _cls(u), written out: this is on the per-item path
            cu = u
        else:
            f = u.bit_length() - 5
            cu = ((f + 1) << 4) + (u >> f) - _SUB
        if cu == c:
            # Same class: replace in place where the old entry heads its heap (the common case:
            # an extent just taken from, or the one a ring frees back onto), else file anew.
            small = self._small[c]
            if small[0] == (n, s):
                heapreplace(small, (u, start))
                large = self._large[c]
                if large[0] == (-n, s):
                    heapreplace(large, (-u, start))
                else:
                    heappush(large, (-u, start))  # the old entry goes stale
                    if len(large) > 2 * self._count[c] + 8:
                        self._compact(c)
                return
        count = self._count[c] = self._count[c] - 1  # _unfile(c), written out
        if not count:
            self._bitmap &= ~(1 << c)
        self._file(start, u, cu)

    def _unfile(self, c: int) -> None:
        # The heaps keep the old entry; `_smallest_in`/`_largest_in` drop it when it reaches the top.
        count = self._count[c] = self._count[c] - 1
        if not count:  # its heaps are replaced when it is next filed into
            self._bitmap &= ~(1 << c)

    def _smallest_in(self, c: int) -> int:
        heap, free = self._small[c], self._free
        while True:
            n, s = heap[0]
            if free.get(s) == n:
                return s
            heappop(heap)  # stale: merged or taken since it was filed

    def _largest_in(self, c: int) -> int:
        heap, free = self._large[c], self._free
        while True:
            n, s = heap[0]
            if free.get(s) == -n:
                return s
            heappop(heap)


def span(arena: Arena, nbytes: int, most: int) -> list[tuple[int, int]] | None:
    """(offset, bytes) of up to `most` pieces, each a new extent, that together hold `nbytes` in the
    item's order (one if a free extent holds it: the caller tries `alloc` first); None if they cannot.

    The largest free extents go whole while what is left of the item fits none; the last piece is
    the best fit for the rest. Largest first takes the fewest pieces there can be, so this fails
    only when the `most` largest free extents together are too small. Nothing is taken on failure."""
    if arena.free_bytes < arena.units(nbytes) * arena.align:
        return None
    pieces: list[tuple[int, int]] = []
    rest = nbytes
    while len(pieces) < most - 1:
        largest = arena.largest_free
        if largest >= rest:  # the rest fits one free extent: its best fit ends the item
            break
        at = arena.alloc(largest)
        assert at is not None  # the largest free extent, taken whole
        pieces.append((at, largest))
        rest -= largest
    at = arena.alloc(rest)
    if at is None:  # more than `most` pieces would be needed: give back what was taken
        for offset, _ in pieces:
            arena.free(offset)
        return None
    pieces.append((at, rest))
    return pieces
