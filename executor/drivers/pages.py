"""Memory the transfer engine reads into: ownership pages, held as long as the engine may write them.

A synchronous read that gives up (`transfer_sync_read` returns -1 after `MC_TRANSFER_TIMEOUT`)
does not cancel it: the peer's reply can still arrive seconds later, and the engine writes it to
the address it was given (a receiver stopped during the read and resumed after it, or a slow link,
shows it every time). A buffer owned by the Python call that made the read would be freed by then,
and the late reply would write into whatever the allocator put there next: the encoder crashed on
slow links. So every read lands in a page of a slab allocated here and kept for the transport's
life, and a page whose read did not succeed is retired: never read, never handed out again while
the engine may still write it.

Bounded all the same: retired pages are charged to the identity whose read failed, at most
`retired_per_identity` each. An identity past that reuses its own oldest retired page once it has
been retired `reuse_after_s` (an hour by default, against the engine's 60 s handshake and 30 s
transfer timeouts); before then its reads are refused (`None`): a receiver whose reads keep failing
costs its own contacts, never another identity's, and memory stays at most
`identities * retired_per_identity` pages plus those in use.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable

from ..core import settings


class ReadPages:
    """Fixed-size pages for engine reads, in slabs that live as long as this object."""

    def __init__(self, page_bytes: int, *, slab_pages: int = 64, retired_per_identity: int = 256,
                 reuse_after_s: float = 3600.0, clock: Callable[[], float] = time.monotonic,
                 register: Callable[[int, int], None] | None = None):
        self.page_bytes = settings.count("page_bytes", page_bytes, 1)
        self.slab_pages = settings.count("slab_pages", slab_pages, 1)
        self.retired_per_identity = settings.count("retired_per_identity", retired_per_identity, 1)
        self.reuse_after_s = settings.seconds("reuse_after_s", reuse_after_s)
        self._clock = clock
        self._register = register  # an engine that reads through a NIC needs the slab registered (RDMA)
        self._lock = threading.Lock()
        self._slabs: list[ctypes.Array[ctypes.c_char]] = []  # never freed while this object lives
        self._free: list[int] = []
        self._busy: set[int] = set()
        self._retired: dict[str, deque[tuple[int, float]]] = {}  # identity -> (page, since), oldest first
        self.refused = 0

    def take(self, identity: str = "") -> int | None:
        """A page to read into (its address), or None when `identity` holds all the retired pages it may."""
        with self._lock:
            if self._free:
                page = self._free.pop()
            else:
                retired = self._retired.get(identity)
                if retired is not None and len(retired) >= self.retired_per_identity:
                    if self._clock() - retired[0][1] < self.reuse_after_s:
                        self.refused += 1
                        return None
                    page = retired.popleft()[0]  # long past any reply the engine could still write
                else:
                    page = self._grow()
            self._busy.add(page)
            return page

    def _grow(self) -> int:
        """Under the lock: a new slab; its first page is returned, the rest are free."""
        slab = ctypes.create_string_buffer(self.page_bytes * self.slab_pages)
        base = ctypes.addressof(slab)
        if self._register is not None:
            self._register(base, len(slab))
        self._slabs.append(slab)
        self._free.extend(base + i * self.page_bytes for i in range(self.slab_pages - 1, 0, -1))
        return base

    def read(self, page: int) -> bytes:
        """What a successful read left in `page`."""
        if page not in self._busy:
            raise ValueError(f"page {page:#x} is not taken: its bytes are not this read's")
        return ctypes.string_at(page, self.page_bytes)

    def give_back(self, page: int, ok: bool, identity: str = "") -> None:
        """Done with `page`: free again if its read succeeded, else retired (the engine may still write it)."""
        with self._lock:
            self._busy.remove(page)
            if ok:
                self._free.append(page)
            else:
                self._retired.setdefault(identity, deque()).append((page, self._clock()))

    def retired(self, identity: str | None = None) -> list[int]:
        """Addresses of the retired pages (of `identity`, or of all)."""
        with self._lock:
            groups = self._retired.values() if identity is None else [self._retired.get(identity, deque())]
            return [page for group in groups for page, _ in group]

    @property
    def pages(self) -> int:
        """Pages allocated in all: in use, free or retired."""
        return len(self._slabs) * self.slab_pages
