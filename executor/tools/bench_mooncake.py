"""Throughput through the controller over Mooncake, against raw TransferEngine async writes.

Both paths run in the same process against a receiver engine on 127.0.0.1, with
the same number of writes in flight (the ring's extents), and write the same
bytes: the controller path additionally copies each embedding into its ring
extent, as it must.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..core.clock import MonotonicClock
from ..core.executor import EncodeExecutor, EncodeItem
from ..core.frames import ReceiverFrame
from ..core.manager import EncodeManager
from ..core.pump import Pump
from ..drivers.mooncake import OWNER_PAGE, MooncakeTransport, load_engine, owner_page
from .progress import Progress

HIDDEN = 1024  # float32 columns: 4 KiB per row


class FixedTower:
    num_deepstack_embeddings = 0

    def __init__(self, rows: int):
        self.out = torch.randn(rows, HIDDEN)

    def image_encoder(self, items):
        return self.out

    get_video_feature = image_encoder


def controller(size: int, items: int, extents: int, rx_engine, rx_session: str, rx_buf: torch.Tensor) -> float:
    rows = size // (HIDDEN * 4)
    transport = MooncakeTransport()
    manager = EncodeManager(transport, MonotonicClock())
    # One receiver, `extents` items in flight to it: the figure is the controller's against the raw engine's at
    # the same depth, so no per-peer share of the arena (peer_ring_share=1.0).
    ex = EncodeExecutor(manager, FixedTower(rows), "cpu", arena_bytes=extents * size, peer_ring_share=1.0)
    pump = Pump(ex)
    dsts = [rx_buf.data_ptr() + i * size for i in range(extents)]
    room = 0

    def one(k: int) -> None:
        nonlocal room
        room += 1
        ex.register(room, "127.0.0.1", 0, room)
        manager.register_receiver(ReceiverFrame(room, rx_session, dsts[k % extents], 0, rows, 0, rows, HIDDEN,
                                                "torch.float32", False, 1))
        pump.flush()
        while ex.ring.main_arena.largest_free < size:
            pump.tick()
        ex.execute([(room, EncodeItem("image", rows))])
        pump.flush()  # the write is submitted here

    return timed_rooms(ex, pump, one, items, extents)


def timed_rooms(ex: EncodeExecutor, pump: Pump, one: Callable[[int], None], items: int, extents: int) -> float:
    """Seconds for `items` rooms started by `one(k)`, after `extents` rooms of warm-up (first contact, the
    ring touched); every room must succeed. Either transport's controller bench times its rooms here."""
    manager = ex.manager
    for k in range(extents):
        one(k)
    deadline = time.monotonic() + 60
    while manager.rooms and time.monotonic() < deadline:
        pump.tick()
    t0 = time.perf_counter()
    for k in range(items):
        one(k)
        pump.tick()
    while manager.rooms:
        pump.tick()
    elapsed = time.perf_counter() - t0
    if manager.stats["success"] != items + extents:
        raise RuntimeError(f"the controller's rooms did not all succeed: {dict(manager.stats)}")
    ex.reap_concluded_senders(set())
    return elapsed


def raw(size: int, items: int, extents: int, rx_session: str, rx_buf: torch.Tensor) -> float:
    engine, _ = load_engine()
    src = torch.randn(extents * size // 4)
    base = src.data_ptr()
    assert engine.register_memory(base, extents * size) == 0
    dsts = [rx_buf.data_ptr() + i * size for i in range(extents)]
    inflight: dict[int, int] = {}

    def run(n: int) -> None:
        k = 0
        while k < n or inflight:
            while k < n and len(inflight) < extents:
                s = k % extents
                if s in inflight.values():
                    break
                bid = engine.transfer_submit_write(rx_session, base + s * size, dsts[s], size)
                assert bid, "submit failed"
                inflight[bid] = s
                k += 1
            for bid in list(inflight):
                st = engine.transfer_check_status(bid)
                if st == 1:
                    del inflight[bid]
                elif st < 0:
                    raise RuntimeError(f"raw write failed: {st}")

    run(extents)
    t0 = time.perf_counter()
    run(items)
    return time.perf_counter() - t0


def run(sizes=(1 << 20, 16 << 20), extents: int = 4, seconds: float = 2.0, items: int | None = None,
        quiet: bool = False, echo=print) -> dict:
    """Print (through `echo`) and return {size: (controller GB/s, raw GB/s)}; `items` per size, or ~`seconds`."""
    if items is not None and items < 1:
        raise ValueError(f"items must be >= 1, got {items}")
    torch.set_num_threads(1)
    rx_engine, rx_session = load_engine()
    # First, as every receiver does: the page naming its key ("" here, no control plane), which
    # the encoder reads back at first contact before it writes (docs/trust.md).
    rx_page = torch.tensor(list(owner_page("")), dtype=torch.uint8)
    assert rx_engine.register_memory(rx_page.data_ptr(), OWNER_PAGE) == 0
    rx_buf = torch.zeros(extents * max(sizes) // 4)
    assert rx_engine.register_memory(rx_buf.data_ptr(), extents * max(sizes)) == 0
    echo(f"Mooncake over TCP on 127.0.0.1, {extents} writes in flight, one receiver engine")
    echo(f"{'size':>7} {'items':>6} {'ctrl GB/s':>10} {'ctrl img/s':>11} "
         f"{'raw GB/s':>9} {'raw img/s':>10} {'ratio':>6}")
    out = {}
    progress = Progress("bench", len(sizes), unit="sizes", enabled=not quiet)
    for size in sizes:
        n = items or max(8, int(seconds * 2e9 / size))
        t_ctrl = controller(size, n, extents, rx_engine, rx_session, rx_buf)
        t_raw = raw(size, n, extents, rx_session, rx_buf)
        gb_c, gb_r = n * size / t_ctrl / 1e9, n * size / t_raw / 1e9
        out[size] = (gb_c, gb_r)
        progress.update(len(out), size=f"{size >> 20} MiB")
        echo(f"{size >> 20:>5}Mi {n:>6} {gb_c:>10.2f} {n / t_ctrl:>11.0f} {gb_r:>9.2f} {n / t_raw:>10.0f} "
             f"{gb_c / gb_r:>5.2f}x")
    progress.close()
    return out


if __name__ == "__main__":
    run()
