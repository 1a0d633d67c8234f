"""A byte arena carved into variable-size extents: the allocator behind the ring.

Pure bookkeeping over offsets (no memory, no torch): the ring registers one
buffer per arena with the transport and asks this class where an item's bytes go.

Policy: two-level segregated fit (TLSF-style) with boundary-tag coalescing, and
a top extent.

- Sizes are counted in `align`-byte units; every extent starts on a multiple of
  `align` and holds a whole number of units (a zero-byte item still takes one
  unit, so every live extent has its own offset).
- The *top* is the free extent that reaches the arena's end (at first, the
  whole arena). Every other free extent is a hole between live ones, filed by
  size class: exact classes below 32 units, then 16 classes per power of two,
  so sizes in one class differ by under 1/16.
- A lease takes a hole before the top, so holes are filled and the top stays
  large: the smallest non-empty class above the request's own (a bitmap finds
  it in O(1); any hole there is large enough), else the largest hole of its own
  class if that is large enough (a heap per class), else the top. The item is
  carved from the low end; the rest stays free. So `alloc` fails only when no
  free extent is large enough: no request is refused for want of a search.
- `free` merges the extent with a free neighbour on either side at once (free
  holes are indexed by start and by end; the top by its start), so free space is
  always fully coalesced: no two free extents touch.

Cost per call: O(1) for the class search, the top and the coalescing, O(log k)
for the heap of the class touched (k: holes in it); stale heap entries are
dropped lazily and a heap is rebuilt when it holds more than twice its live
entries, so memory stays proportional to the holes. A ring whose items come back
in about the order they went out mostly leases from and frees into the top,
which costs a few dict and integer operations.

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

    __slots__ = ("align", "capacity", "in_use", "_shift", "_units", "_top", "_live", "_free", "_end",
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
        self._top = 0                      # start unit of the top (free up to the end; empty at _units)
        self._live: dict[int, int] = {}   # start unit -> units, of each live extent
        self._free: dict[int, int] = {}   # start unit -> units, of each hole
        self._end: dict[int, int] = {}    # end unit -> start unit, of each hole
        top = _cls(self._units) + 1 if self._units else 1
        self._heaps: list[list[tuple[int, int]]] = [[] for _ in range(top)]
        self._count = [0] * top
        self._bitmap = 0

    # -- the allocator --------------------------------------------------------------
    def units(self, nbytes: int) -> int:
        """Units an item of `nbytes` takes (at least one)."""
        return max(1, -(-nbytes >> self._shift))

    def fits_ever(self, nbytes: int) -> bool:
        """Whether an item of `nbytes` fits in the empty arena."""
        return self.units(nbytes) <= self._units

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least `nbytes`, or None if no free extent is large enough now."""
        # The class look-ups are written out here and in `free`: they are the per-item path.
        shift = self._shift
        u = -(-nbytes >> shift) or 1
        if u < 32:
            c = u
        else:
            f = u.bit_length() - 5
            c = ((f + 1) << 4) + (u >> f) - _SUB
        bitmap = self._bitmap
        if bitmap:
            m = bitmap >> (c + 1)
            if m:
                # The smallest class above u's own: every hole in it is large enough.
                c = c + (m & -m).bit_length()
                return self._take(c, u, self._largest_in(c))
            if c < len(self._count) and self._count[c]:
                start = self._largest_in(c)  # u's own class: its largest hole may be large enough
                if self._free[start] >= u:
                    return self._take(c, u, start)
        start = self._top
        if self._units - start < u:
            return None
        self._top = start + u
        self._live[start] = u
        self.in_use += u << shift
        return start << shift

    def _take(self, c: int, u: int, start: int) -> int:
        """Carve u units from the low end of the hole at `start` (class c)."""
        free, end, heap = self._free, self._end, self._heaps[c]
        size = free.pop(start)
        del end[start + size]
        rest = size - u
        if rest:
            r = start + u
            free[r] = rest
            end[r + rest] = r
            cr = _cls(rest)
            if cr == c and heap[0][1] == start:
                heapreplace(heap, (-rest, r))  # the rest takes the taken hole's place in the heap
            else:
                self._uncount(c)
                self._file(r, rest, cr)
        else:
            self._uncount(c)
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
        end = self._end
        if end:
            before = end.pop(start, None)
            if before is not None:  # a hole ends where this one starts
                n = self._free.pop(before)
                self._uncount(_cls(n))
                u += n
                start = before
        stop = start + u
        if stop == self._top:  # it reaches the top: the top grows down over it
            self._top = start
            return
        free = self._free
        after = free.pop(stop, 0)
        if after:  # a hole starts where this one ends
            n = after
            del end[stop + n]
            c = _cls(n)
            u += n
            heap = self._heaps[c]
            cm = _cls(u)
            free[start] = u
            end[start + u] = start
            if cm == c and heap[0] == (-n, stop):
                heapreplace(heap, (-u, start))  # the merged hole takes its neighbour's place in the heap
                return
            self._uncount(c)
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
        top = self._units - self._top
        if self._bitmap:
            start = self._largest_in(self._bitmap.bit_length() - 1)
            top = max(top, self._free[start])
        return top << self._shift

    @property
    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when free space is one extent (or none)."""
        free = self.free_bytes
        return 1.0 - self.largest_free / free if free else 0.0

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, bytes) of every free extent, by address: for checks and dumps, not the hot path."""
        out = sorted((s << self._shift, n << self._shift) for s, n in self._free.items())
        if self._top < self._units:
            out.append((self._top << self._shift, (self._units - self._top) << self._shift))
        return out

    def live_extents(self) -> list[tuple[int, int]]:
        """(offset, bytes) of every live extent, by address: for checks and dumps, not the hot path."""
        return sorted((s << self._shift, n << self._shift) for s, n in self._live.items())

    # -- holes by class -------------------------------------------------------------------
    def _file(self, start: int, u: int, c: int) -> None:
        """File the hole (start, u) under class c (already in `_free` and `_end`)."""
        heap = self._heaps[c]
        heapq.heappush(heap, (-u, start))
        self._count[c] += 1
        self._bitmap |= 1 << c
        if len(heap) > 2 * self._count[c] + 8:
            # Drop stale entries (and duplicates of a re-filed hole) so a heap stays small.
            live = {(n, s) for n, s in heap if self._free.get(s) == -n}
            heap[:] = live
            heapq.heapify(heap)

    def _uncount(self, c: int) -> None:
        # The class heap keeps the entry; `_largest_in` drops it when it reaches the top.
        self._count[c] -= 1
        if not self._count[c]:
            self._bitmap &= ~(1 << c)
            self._heaps[c].clear()

    def _largest_in(self, c: int) -> int:
        heap = self._heaps[c]
        free = self._free
        while True:
            n, s = heap[0]
            if free.get(s) == -n:
                return s
            heappop(heap)  # stale: merged or taken since it was filed
