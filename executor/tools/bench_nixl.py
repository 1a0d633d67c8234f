"""Throughput side by side: the controller over NIXL, raw NIXL writes, the controller over Mooncake.

All in one process against receivers on 127.0.0.1 (a NIXL agent with its metadata port, a
Mooncake engine), the same number of writes in flight (`extents`) and the same bytes per item. The
controller paths copy each embedding into its arena extent, as they must; raw NIXL writes from a
registered buffer straight into the receiver's. MB/s and items/s per item size.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from ..core.clock import MonotonicClock
from ..core.executor import EncodeExecutor, EncodeItem
from ..core.frames import ReceiverFrame
from ..core.manager import EncodeManager
from ..core.pump import Pump
from ..drivers.edge import OWNER_PAGE, owner_page

SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)


class _Tower:
    num_deepstack_embeddings = 0

    def __init__(self, rows: int, hidden: int):
        self.out = torch.randn(rows, hidden)

    def image_encoder(self, items: Any) -> torch.Tensor:
        return self.out

    get_video_feature = image_encoder


def _shape(size: int) -> tuple[int, int]:
    hidden = min(1024, size // 4)  # float32 columns; 1 KiB is one row of 256
    return size // (hidden * 4), hidden


def controller(transport: Any, size: int, items: int, extents: int, session: str, base: int) -> float:
    """Seconds for `items` rooms of `size` bytes through the manager, `extents` in flight, after a warm-up."""
    rows, hidden = _shape(size)
    manager = EncodeManager(transport, MonotonicClock())
    ex = EncodeExecutor(manager, _Tower(rows, hidden), "cpu", arena_bytes=extents * size, peer_ring_share=1.0)
    pump = Pump(ex)
    room = 0

    def one(k: int) -> None:
        nonlocal room
        room += 1
        ex.register(room, "127.0.0.1", 0, room)
        manager.register_receiver(ReceiverFrame(room, session, base + (k % extents) * size, 0, rows, 0, rows, hidden,
                                                "torch.float32", False, 1))
        pump.flush()
        while ex.ring.main_arena.largest_free < size:
            pump.tick()
        ex.execute([(room, EncodeItem("image", rows))])
        pump.flush()

    from .bench_mooncake import timed_rooms  # lazily: it imports Mooncake's driver

    return timed_rooms(ex, pump, one, items, extents)


def raw_nixl(size: int, items: int, extents: int, target: Any, base: int) -> float:
    """Seconds for `items` raw NIXL writes of `size` bytes, `extents` in flight, after a warm-up."""
    from ..drivers.nixl import load_agent

    agent = load_agent(f"epd-ring-bench-{uuid.uuid4().hex[:12]}")
    src = torch.randn(extents * size // 4)
    agent.register_memory([(src.data_ptr(), extents * size, 0, "")], "DRAM")
    name = agent.add_remote_agent(target.agent.get_agent_metadata())
    handles = []
    for s in range(extents):
        local = agent.get_xfer_descs([(src.data_ptr() + s * size, size, 0)], "DRAM")
        remote = agent.get_xfer_descs([(base + s * size, size, 0)], "DRAM")
        handles.append(agent.initialize_xfer("WRITE", local, remote, name))

    def run(n: int) -> None:
        busy: set[int] = set()
        k = 0
        deadline = time.monotonic() + 60 + n  # a write that never ends (a stopped peer) ends the bench
        while k < n or busy:
            if time.monotonic() > deadline:
                raise RuntimeError(f"raw NIXL: {len(busy)} writes still in progress after the bench's deadline")
            for s in range(extents):
                if s in busy:
                    st = agent.check_xfer_state(handles[s])
                    if st == "ERR":
                        raise RuntimeError("raw NIXL write failed")
                    if st == "DONE":
                        busy.discard(s)
                if s not in busy and k < n:
                    if agent.transfer(handles[s]) == "ERR":
                        raise RuntimeError("raw NIXL write failed")
                    busy.add(s)
                    k += 1

    run(extents)
    t0 = time.perf_counter()
    run(items)
    elapsed = time.perf_counter() - t0
    for h in handles:
        h.release()
    return elapsed


def run(sizes: tuple[int, ...] = SIZES, extents: int = 4, seconds: float = 1.0, items: int | None = None,
        mooncake: bool = True, echo: Callable[[str], None] = print) -> dict:
    """Print (through `echo`) and return {size: {path: (MB/s, items/s)}}; `items` per size, or about `seconds`."""
    from ..drivers.nixl import NixlTarget, NixlTransport

    torch.set_num_threads(1)
    page = torch.tensor(list(owner_page("")), dtype=torch.uint8)
    rx = torch.zeros(extents * max(sizes), dtype=torch.uint8)
    target = NixlTarget("127.0.0.1", page, rx)
    nixl = NixlTransport()
    mc: tuple[Any, str] | None = None
    if mooncake:
        from ..drivers.mooncake import MooncakeTransport, load_engine

        engine, session = load_engine()
        for t in (page, rx):
            assert engine.register_memory(t.data_ptr(), t.numel()) == 0
        mc = (MooncakeTransport(), session)
        assert page.numel() == OWNER_PAGE
    paths = ["nixl (controller)", "nixl (raw)"] + (["mooncake (controller)"] if mc else [])
    echo(f"one host, 127.0.0.1, {extents} writes in flight; MB/s and items/s per path")
    echo(f"{'size':>8} {'items':>6} " + " ".join(f"{p:>24}" for p in paths))
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for size in sizes:
        n = items or max(16, min(20000, int(seconds * 1e9 / size)))
        took = {"nixl (controller)": controller(nixl, size, n, extents, target.session, rx.data_ptr()),
                "nixl (raw)": raw_nixl(size, n, extents, target, rx.data_ptr())}
        if mc is not None:
            took["mooncake (controller)"] = controller(mc[0], size, n, extents, mc[1], rx.data_ptr())
        out[size] = {p: (n * size / s / 1e6, n / s) for p, s in took.items()}
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        echo(f"{label:>8} {n:>6} " + " ".join(f"{out[size][p][0]:>11.0f} MB/s {out[size][p][1]:>7.0f}/s"
                                             for p in paths))
    nixl.close()
    if mc is not None:
        mc[0].close()
    target.close()
    return out
