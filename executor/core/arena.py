"""A byte arena carved into variable-size extents: the allocator behind the ring.

Pure bookkeeping over offsets (no memory, no torch): the ring registers one
buffer per arena with the transport and asks this class where an item's bytes go.

Policy: two-level segregated fit (TLSF-style) with boundary-tag coalescing.

- Sizes are counted in `align`-byte units; every extent starts on a multiple of
  `align` and holds a whole number of units (a zero-byte item still takes one
  unit, so every live extent has its own offset).
- Free extents are filed by size class: exact classes below 32 units, then 16
  classes per power of two, so sizes in one class differ by under 1/16. A bitmap
  over the classes finds the smallest non-empty class above a request's own in
  O(1) (any extent there is large enough); only when there is none is the
  request's own class checked, through its largest free extent (a heap per
  class). So `alloc` fails only when no free extent is large enough: no request
  is refused for want of a search.
- An extent is carved from the low end of the free extent chosen; the rest
  stays free.
- `free` merges the extent with a free neighbour on either side at once (two
  dict look-ups: free extents by start and by end), so free space is always
  fully coalesced: no two free extents touch.

Cost per call: O(1) for the class search and the coalescing, O(log k) for the
heap of the class touched (k: free extents in it); stale heap entries are
dropped lazily and a heap is rebuilt when it holds more than twice its live
entries, so memory stays proportional to the free extents.

Which bytes may be handed out again is the caller's decision: the ring frees an
extent only when its machine enters `free`, so bytes a write may still read are
never in this arena's free space.
"""

from __future__ import annotations

import heapq
from heapq import heappop, heapreplace

_SUB = 16  # classes per power of two above the exact range


def _cls(u: int) -> int:
    """Size class of `u` units: monotone in `u`, exact below 2 * _SUB."""
    if u < 2 * _SUB:
        return u
    f = u.bit_length() - 5
    return ((f + 1) << 4) + (u >> f) - _SUB


class Arena:
    """`capacity` bytes (rounded down to `align`) handed out as aligned extents."""

    __slots__ = ("align", "capacity", "in_use", "_shift", "_units", "_live", "_free", "_end",
                 "_heaps", "_count", "_bitmap")

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
        top = _cls(self._units) + 1 if self._units else 1
        self._heaps: list[list[tuple[int, int]]] = [[] for _ in range(top)]
        self._count = [0] * top
        self._bitmap = 0
        if self._units:
            self._insert(0, self._units)

    # -- the allocator --------------------------------------------------------------
    def units(self, nbytes: int) -> int:
        """Units an item of `nbytes` takes (at least one)."""
        return max(1, -(-nbytes >> self._shift))

    def fits_ever(self, nbytes: int) -> bool:
        """Whether an item of `nbytes` fits in the empty arena."""
        return self.units(nbytes) <= self._units

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least `nbytes`, or None if no free extent is large enough now."""
        # The class look-ups and filing are written out here and in `free`: they are the per-item path.
        shift = self._shift
        u = -(-nbytes >> shift) or 1
        if u > self._units:
            return None
        if u < 32:
            c = u
        else:
            f = u.bit_length() - 5
            c = ((f + 1) << 4) + (u >> f) - _SUB
        free = self._free
        count = self._count
        m = self._bitmap >> (c + 1)
        if m:
            # The smallest class above u's own: every extent in it is large enough.
            c = c + (m & -m).bit_length()
            heap = self._heaps[c]
            while True:
                n, start = heap[0]
                if free.get(start) == -n:
                    break
                heappop(heap)  # stale: merged or taken since it was filed
            size = -n
        else:
            # Only u's own class may hold an extent large enough: its largest.
            got = self._largest_in(c) if count[c] else None
            if got is None or free[got] < u:
                return None
            start, size = got, free[got]
            heap = self._heaps[c]
        del free[start]
        end = self._end
        del end[start + size]
        rest = size - u
        if rest:
            r = start + u
            free[r] = rest
            end[r + rest] = r
            if rest < 32:
                cr = rest
            else:
                g = rest.bit_length() - 5
                cr = ((g + 1) << 4) + (rest >> g) - _SUB
            if cr == c and heap[0][1] == start:
                # The rest stays in the class: it takes the taken extent's place in the heap.
                heapreplace(heap, (-rest, r))
            else:
                count[c] -= 1
                if not count[c]:
                    self._bitmap &= ~(1 << c)
                    heap.clear()
                self._file(r, rest, cr)
        else:
            count[c] -= 1
            if not count[c]:
                self._bitmap &= ~(1 << c)
                heap.clear()
        self._live[start] = u
        self.in_use += u << shift
        return start << shift

    def free(self, offset: int) -> None:
        """The extent at `offset` becomes free, merged with any free neighbour."""
        start = offset >> self._shift
        u = self._live.pop(start, 0) if not offset & (self.align - 1) else 0
        if not u:
            raise ValueError(f"no live extent at offset {offset}")
        self.in_use -= u << self._shift
        free, end = self._free, self._end
        before = end.pop(start, None)
        if before is not None:  # a free extent ends where this one starts
            n = free.pop(before)
            self._uncount(_cls(n))
            u += n
            start = before
        stop = start + u
        after = free.pop(stop, 0)
        if after:  # a free extent starts where this one ends
            n = after
            del end[stop + n]
            if n < 32:
                c = n
            else:
                f = n.bit_length() - 5
                c = ((f + 1) << 4) + (n >> f) - _SUB
            u += n
            heap = self._heaps[c]
            if u < 32:
                cm = u
            else:
                f = u.bit_length() - 5
                cm = ((f + 1) << 4) + (u >> f) - _SUB
            free[start] = u
            end[start + u] = start
            if cm == c and heap[0] == (-n, stop):
                # The merged extent stays in the class: it takes its neighbour's place in the heap.
                heapreplace(heap, (-u, start))
                return
            count = self._count
            count[c] -= 1
            if not count[c]:
                self._bitmap &= ~(1 << c)
                heap.clear()
            self._file(start, u, cm)
            return
        free[start] = u
        end[start + u] = start
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
        if not self._bitmap:
            return 0
        start = self._largest_in(self._bitmap.bit_length() - 1)
        assert start is not None
        return self._free[start] << self._shift

    @property
    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when free space is one extent (or none)."""
        free = self.free_bytes
        return 1.0 - self.largest_free / free if free else 0.0

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, bytes) of every free extent, by address: for checks and dumps, not the hot path."""
        return sorted((s << self._shift, n << self._shift) for s, n in self._free.items())

    def live_extents(self) -> list[tuple[int, int]]:
        """(offset, bytes) of every live extent, by address: for checks and dumps, not the hot path."""
        return sorted((s << self._shift, n << self._shift) for s, n in self._live.items())

    # -- free extents by class ----------------------------------------------------------
    def _insert(self, start: int, u: int) -> None:
        self._free[start] = u
        self._end[start + u] = start
        self._file(start, u, _cls(u))

    def _file(self, start: int, u: int, c: int) -> None:
        """File the free extent (start, u) under class c (already in `_free` and `_end`)."""
        heap = self._heaps[c]
        heapq.heappush(heap, (-u, start))
        self._count[c] += 1
        self._bitmap |= 1 << c
        if len(heap) > 2 * self._count[c] + 8:
            # Drop stale entries (and duplicates of a re-inserted extent) so a heap stays small.
            live = {(-n, s) for n, s in heap if self._free.get(s) == -n}
            heap[:] = live
            heapq.heapify(heap)

    def _remove(self, start: int, u: int) -> None:
        # The class heap keeps the entry; a look-up drops it when it reaches the top.
        del self._free[start]
        del self._end[start + u]
        self._uncount(_cls(u))

    def _uncount(self, c: int) -> None:
        self._count[c] -= 1
        if not self._count[c]:
            self._bitmap &= ~(1 << c)
            self._heaps[c].clear()

    def _largest_in(self, c: int) -> int | None:
        heap = self._heaps[c]
        while heap:
            n, s = heap[0]
            if self._free.get(s) == -n:
                return s
            heapq.heappop(heap)
        return None
