"""Dynamo interop: NVIDIA Dynamo 1.6.1's own `NixlWriteEmbeddingReceiver` receives from an epd-ring
sender (bytes equal); its hazard (a ring extent freed on timeout while the write may still land) shown
on its real receiver, and prevented by epd-ring's receiver, which carves a failed room's region again
only once the encoder's release notice came.

Dynamo's module is loaded from its file: its package's __init__ imports Dynamo's compiled runtime
(`dynamo._core`, `dynamo.llm`), which these classes never use; the two helpers it imports from
there (an NVTX annotation and `run_async`) are stood in for. `nixl` is `nixl_cu12` (the `nixl`
meta package needs both CUDA variants).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
import time
import types

import pytest
import torch

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

# CI installs ai-dynamo (--no-deps, .ci/run) and requires it with NIXL.
if not os.environ.get("EPD_RING_REQUIRE_NIXL"):
    pytest.importorskip("nixl_cu12")
    pytest.importorskip("msgspec")
    if importlib.util.find_spec("dynamo") is None:
        pytest.skip("ai-dynamo is not installed (pip install --no-deps ai-dynamo==1.6.1)", allow_module_level=True)

from epd_ring.executor.core.transport import Outcome
from epd_ring.executor.drivers import nixl
from epd_ring.executor.drivers.nixl import NixlTransport
from epd_ring.executor.drivers.nixl_dynamo import DynamoWriteSender
from epd_ring.executor.drivers.receiver import ReferenceReceiver


class _Noop(contextlib.ContextDecorator):
    """NVTX's `annotate`, as a decorator and a context: nothing to annotate on a CPU machine."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def dynamo_embedding_transfer() -> types.ModuleType:
    import nixl_cu12
    import nixl_cu12._api

    sys.modules.setdefault("nixl", nixl_cu12)
    sys.modules.setdefault("nixl._api", nixl_cu12._api)
    nvtx = types.ModuleType("dynamo.common.utils.nvtx_utils")
    nvtx.annotate = lambda *a, **k: _Noop()  # type: ignore[attr-defined]
    runtime = types.ModuleType("dynamo.common.utils.runtime")
    runtime.run_async = lambda f, *a, **k: None  # type: ignore[attr-defined]
    utils = types.ModuleType("dynamo.common.utils")
    utils.nvtx_utils, utils.runtime = nvtx, runtime  # type: ignore[attr-defined]
    for name, mod in (("dynamo.common.utils", utils), ("dynamo.common.utils.nvtx_utils", nvtx),
                      ("dynamo.common.utils.runtime", runtime)):
        sys.modules.setdefault(name, mod)
    root = os.path.dirname(importlib.util.find_spec("dynamo").submodule_search_locations[0])
    path = os.path.join(root, "dynamo", "common", "multimodal", "embedding_transfer.py")
    spec = importlib.util.spec_from_file_location("dynamo_embedding_transfer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dyn():
    return dynamo_embedding_transfer()


async def serve(sender: DynamoWriteSender, until, deadline_s: float = 60.0, defer=frozenset()) -> dict:
    """Answer the receiver's notifications, as the encode side's edge would, until `until()`."""
    outcomes: dict = {}
    deadline = time.monotonic() + deadline_s
    while not until() and time.monotonic() < deadline:
        outcomes.update(sender.poll(defer))
        await asyncio.sleep(0.001)
    return outcomes


def test_dynamos_receiver_takes_an_epd_ring_senders_write_bytes_equal(dyn):
    t = NixlTransport()
    arena = torch.randn(4096, 64)  # an epd-ring arena, registered once
    t.register_memory([(arena.data_ptr(), arena.numel() * 4)], owner="arena")
    sender = DynamoWriteSender(t)
    item = arena[100:164]  # an item's extent: 64 rows of 64 float32

    async def run():
        receiver = dyn.NixlWriteEmbeddingReceiver(buffer_size=1 << 20)
        request = dyn.TransferRequest(**sender.request(item.data_ptr(), item.numel() * 4, list(item.shape),
                                                       str(item.dtype)))
        got = asyncio.create_task(receiver.receive_embeddings(request, receive_timeout=60))
        outcomes = await serve(sender, got.done)
        tensor_id, tensor = await got
        assert torch.equal(tensor, item)
        receiver.release_tensor(tensor_id)
        outcomes.update(await serve(sender, lambda: sender.pending() == 0))
        return outcomes

    try:
        assert asyncio.run(run()) == {1: Outcome.DONE}
    finally:
        t.close()


def test_dynamos_receiver_reuses_a_timed_out_extent_while_the_write_still_lands(dyn):
    """The hazard, on Dynamo's real receiver: its first request times out (the write is late), its
    extent is freed at once and handed to the next request, which receives its own bytes; then the
    late write lands, and the tensor the caller already holds turns into the first item's bytes."""
    t = NixlTransport()
    arena = torch.cat([torch.full((64, 64), 1.0), torch.full((64, 64), 2.0)])
    t.register_memory([(arena.data_ptr(), arena.numel() * 4)], owner="arena")
    sender = DynamoWriteSender(t)
    first, second = arena[:64], arena[64:]

    async def run():
        receiver = dyn.NixlWriteEmbeddingReceiver(buffer_size=64 * 64 * 4)  # one extent
        ask = [dyn.TransferRequest(**sender.request(x.data_ptr(), x.numel() * 4, list(x.shape), str(x.dtype)))
               for x in (first, second)]
        with pytest.raises(TimeoutError):  # nobody answers its notification in time: a slow link
            await receiver.receive_embeddings(ask[0], receive_timeout=0.2)
        got = asyncio.create_task(receiver.receive_embeddings(ask[1], receive_timeout=60))
        # The second request is answered; the first's write is still on its way.
        outcomes = await serve(sender, got.done, defer=frozenset({1}))
        _, tensor = await got
        assert torch.equal(tensor, second)  # the caller has its tensor, its own bytes
        outcomes.update(await serve(sender, lambda: sender.pending() == 0 and not sender.offered()))
        assert outcomes == {1: Outcome.DONE, 2: Outcome.DONE}
        return tensor

    try:
        tensor = asyncio.run(run())
        assert torch.equal(tensor, first)  # the late write landed in the reused extent, under the caller
    finally:
        t.close()


def test_epd_rings_receiver_keeps_a_failed_region_until_its_release_notice():
    """The same moment on epd-ring's receiver: a room failed (timed out at the encoder), its region is
    not carved again, so a late write can land only in its own room's memory; once the release notice
    says no write can land, its memory is reused."""
    r = ReferenceReceiver("tcp://127.0.0.1:9", insecure=True, transport="nixl", capacity=64 * 64 * 4 * 2)
    try:
        first = r.expect(1, span=64, hidden=64)
        r.on_notice(1, "failed", first.dst_ptr, r.session)
        second = r.expect(2, span=64, hidden=64)
        assert second.dst_ptr != first.dst_ptr  # failed, not released: its memory is not handed out
        with pytest.raises(MemoryError):
            r.expect(3, span=64, hidden=64)  # and nothing else may take it
        r.on_notice(1, "released", first.dst_ptr, r.session)
        assert r.expect(3, span=64, hidden=64).dst_ptr == first.dst_ptr  # now it may
        assert r.protocol_errors == []
    finally:
        r.close()


class NotifyingAgent:
    """NIXL's agent as the sender calls it, without UCX: `notifs` is what the next poll gets, metadata
    `b"bad"` is refused by `add_remote_agent`, and every transfer is done at once."""

    backends = ("UCX",)

    def __init__(self, name: str):
        self.name, self.notifs, self.added, self.posted = name, {}, [], []

    def get_agent_metadata(self) -> bytes:
        return b"meta"

    def get_new_notifs(self) -> dict:
        notifs, self.notifs = self.notifs, {}
        return notifs

    def add_remote_agent(self, meta: bytes) -> None:
        if meta == b"bad":
            raise RuntimeError("nixlInvalidParamError")
        self.added.append(meta)

    def get_xfer_descs(self, descs, _kind):
        return descs

    def initialize_xfer(self, _op, _local, remote, _name, notif):
        self.posted.append((remote, notif))
        return types.SimpleNamespace(release=lambda: None)

    def transfer(self, _handle, _notif) -> str:
        return "DONE"


def test_one_bad_notification_fails_its_own_tensor_never_the_rest_of_the_batch(monkeypatch):
    import msgspec

    monkeypatch.setattr(nixl, "load_agent", lambda name, **_kw: NotifyingAgent(name))
    t = NixlTransport()
    sender = DynamoWriteSender(t)
    for i in range(3):
        sender.request(0x1000 * (i + 1), 256, [64], "torch.float32")  # tensors 1, 2, 3

    def ask(tensor_id, meta=b"meta", mem="cpu"):
        return msgspec.msgpack.encode((tensor_id, (0x9000, 256, 0, mem), 7, meta))

    t.agent.notifs = {
        b"evil": [b"not msgpack", ask(2, meta=b"bad"), ask([1])],  # its agent will not be added
        b"good": [ask(1), ask(3, mem="cuda"), ask(99)],
    }
    try:
        assert dict(sender.poll()) == {1: Outcome.DONE, 2: Outcome.FAILED, 3: Outcome.FAILED}
        assert sorted(tid for tid, _ in sender.refused) == [0, 0, 2, 3, 99]
        assert t.agent.added == [b"meta"] and t.agent.posted == [([(0x9000, 256, 0)], b"7")]
        assert sender.offered() == {} and sender.pending() == 0
    finally:
        t.close()
