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
  O(1); within its own class the largest free extent is checked too (a heap
  per class), so `alloc` fails only when no free extent is large enough: no
  request is refused for want of a search.
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
        u = self.units(nbytes)
        if u > self._units:
            return None
        c = _cls(u)
        start = self._largest_in(c) if self._count[c] else None
        if start is None or self._free[start] < u:
            m = self._bitmap >> (c + 1)
            if not m:
                return None
            start = self._largest_in(c + (m & -m).bit_length())
        assert start is not None
        size = self._free[start]
        self._remove(start, size)
        if size > u:
            self._insert(start + u, size - u)
        self._live[start] = u
        self.in_use += u << self._shift
        return start << self._shift

    def free(self, offset: int) -> None:
        """The extent at `offset` becomes free, merged with any free neighbour."""
        start = offset >> self._shift
        u = self._live.pop(start, 0) if not offset & (self.align - 1) else 0
        if not u:
            raise ValueError(f"no live extent at offset {offset}")
        self.in_use -= u << self._shift
        after = self._free.get(start + u)
        if after is not None:
            self._remove(start + u, after)
            u += after
        before = self._end.get(start)
        if before is not None:
            self._remove(before, start - before)
            u += start - before
            start = before
        self._insert(start, u)

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
        c = _cls(u)
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
        # The class heap keeps the entry; `_largest_in` drops it when it reaches the top.
        del self._free[start]
        del self._end[start + u]
        c = _cls(u)
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
