"""One heap of deadlines for every waiting state (park, announce, write, quarantine).

Each object that can wait carries a `timer` token (and `due`, its deadline); an entry is live only while
the object's token still equals the entry's. Cancelling is O(1) (reset the
token); dead entries are dropped when popped, and the heap is rebuilt when they
outnumber live ones, so it stays bounded by the live deadlines.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

_COMPACT_FLOOR = 4096
_NEVER = float("inf")


class Deadlines:
    __slots__ = ("_heap", "_seq", "_live", "first")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._live = 0
        # When the earliest entry is due (live or cancelled; inf with none): a tick asks `first <= now`
        # without a call. Never later than the true earliest (kept at every push and after every pop).
        self.first = _NEVER

    def __len__(self) -> int:
        return self._live

    @property
    def heap_size(self) -> int:
        return len(self._heap)

    def arm(self, when: float, kind: str, obj: Any) -> None:
        if obj.timer:
            self.cancel(obj)
        self._seq += 1
        obj.timer = self._seq
        obj.due = when
        heap = self._heap
        heapq.heappush(heap, (when, self._seq, kind, obj))
        self._live += 1
        if len(heap) > _COMPACT_FLOOR and len(heap) > 4 * self._live:
            heap = self._heap = [e for e in heap if e[3].timer == e[1]]
            heapq.heapify(heap)
        self.first = heap[0][0]

    def cancel(self, obj: Any) -> None:
        if obj.timer:
            obj.timer = 0
            self._live -= 1

    def pending(self) -> list[tuple[float, str, Any]]:
        """Every live deadline as (due, kind, obj), earliest first: what the next polls will fire, in order."""
        return sorted(((when, kind, obj) for when, seq, kind, obj in self._heap if obj.timer == seq),
                      key=lambda e: e[0])

    def any_due(self, now: float) -> bool:
        return self.first <= now

    def due(self, now: float) -> Iterator[tuple[str, Any]]:
        """Pop and yield (kind, obj) for every live deadline at or before `now`."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, seq, kind, obj = heapq.heappop(heap)
            if obj.timer == seq:
                obj.timer = 0
                self._live -= 1
                yield kind, obj
        self.first = heap[0][0] if heap else _NEVER
