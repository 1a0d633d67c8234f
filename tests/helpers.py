"""Shared fixtures-as-functions: a small rig of clock, loopback, manager, executor, receivers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from epd_ring.executor import (EncodeExecutor, EncodeItem, EncodeManager, FakeClock, LoopbackTransport,
                               ReceiverFrame, shard_rows)


class TableTower:
    """A tower whose output rows are a pure function of each item's `seed` in meta.

    Each item gets distinct bytes, so an overwrite or misrouted write is visible.
    """

    def __init__(self, hidden: int = 8, n_deep: int = 0, dtype=torch.float32):
        self.hidden = hidden
        self.num_deepstack_embeddings = n_deep
        self.dtype = dtype
        self.calls: list[tuple[str, int]] = []
        self.raise_next: Exception | None = None

    def expected(self, item) -> torch.Tensor:
        g = torch.Generator().manual_seed(int(item.meta["seed"]))
        width = self.hidden * (1 + self.num_deepstack_embeddings)
        return torch.randn(item.n_tokens, width, generator=g).to(self.dtype)

    def _run(self, kind, items):
        self.calls.append((kind, len(items)))
        if self.raise_next is not None:
            exc, self.raise_next = self.raise_next, None
            raise exc
        return torch.cat([self.expected(i) for i in items], dim=0)

    def image_encoder(self, items):
        return self._run("image", items)

    def get_video_feature(self, items):
        return self._run("video", items)

    def separate_deepstack_embeds(self, emb):
        return emb[:, : self.hidden], emb[:, self.hidden:]


@dataclass
class Rig:
    clock: FakeClock
    transport: LoopbackTransport
    manager: EncodeManager
    executor: EncodeExecutor
    tower: TableTower
    buffers: dict = field(default_factory=dict)  # (room, session) -> (main, deep)
    rids: itertools.count = field(default_factory=lambda: itertools.count())

    def receiver(self, session: str):
        r = self.transport.receivers.get(session)
        return r if r is not None else self.transport.add_receiver(session)

    def frame(self, room: int, session: str, span: int, *, n: int = 1, rank: int = 0,
              shard: bool = False, hidden: int | None = None, deep: bool | None = None, **over):
        """Allocate this receiver's buffers, register them, and build its frame."""
        hidden = hidden or self.tower.hidden
        deep = bool(self.tower.num_deepstack_embeddings) if deep is None else deep
        row_start, rows = shard_rows(span, rank, n) if shard else (0, span)
        rcv = self.receiver(session)
        main = torch.full((max(rows, 1), hidden), float("nan"), dtype=self.tower.dtype)
        rcv.register(main)
        deep_t = None
        if deep:
            deep_t = torch.full((max(rows, 1), hidden * self.tower.num_deepstack_embeddings), float("nan"),
                                dtype=self.tower.dtype)
            rcv.register(deep_t)
        self.buffers[(room, session)] = (main, deep_t, row_start, rows)
        fields = dict(room=room, session=session, dst_ptr=main.data_ptr(),
                      dst_deep_ptr=deep_t.data_ptr() if deep_t is not None else 0,
                      n_tokens=rows, row_start=row_start, span=span, hidden=hidden,
                      dtype=str(self.tower.dtype), has_deepstack=deep, n_receivers=n,
                      deep_levels=self.tower.num_deepstack_embeddings if deep else 0)
        fields.update(over)
        return ReceiverFrame(**fields)

    def item(self, n_tokens: int, seed: int, modality: str = "image") -> EncodeItem:
        return EncodeItem(modality=modality, n_tokens=n_tokens, meta={"seed": seed})

    def delivered_ok(self, room: int, session: str, item) -> bool:
        main, deep_t, row_start, rows = self.buffers[(room, session)]
        exp = self.tower.expected(item)
        h = self.tower.hidden
        if not torch.equal(main[:rows], exp[row_start:row_start + rows, :h]):
            return False
        if deep_t is not None:
            return torch.equal(deep_t[:rows], exp[row_start:row_start + rows, h:])
        return True


def make_rig(*, slots: int = 4, slot_bytes: int = 4096, hidden: int = 8, n_deep: int = 0,
             park_timeout: float = 10.0, quarantine_s: float = 5.0, write_timeout: float = 30.0,
             max_deferred: int | None = None, **manager_kw) -> Rig:
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    manager = EncodeManager(transport, clock, park_timeout=park_timeout, quarantine_s=quarantine_s,
                            write_timeout=write_timeout, **manager_kw)
    tower = TableTower(hidden=hidden, n_deep=n_deep)
    executor = EncodeExecutor(manager, tower, "cpu", ring_slots=slots, ring_bytes=slot_bytes,
                              max_deferred=max_deferred)
    return Rig(clock, transport, manager, executor, tower)


def loopback_setup(at: float = 0.0):
    """A loopback transport at time `at` with one 64-byte source region and receiver "r" on a zeroed buffer."""
    clock = FakeClock()
    clock.advance(at)
    t = LoopbackTransport(clock)
    src = torch.arange(16, dtype=torch.float32)
    t.register_memory([(src.data_ptr(), 64)], owner=src)
    rcv = t.add_receiver("r")
    dst = torch.zeros(16)
    rcv.register(dst)
    return clock, t, src, dst, rcv
