"""An epd-ring sender that NVIDIA Dynamo's `NixlWriteEmbeddingReceiver` (1.6.1) accepts.

Dynamo's write protocol (dynamo/common/multimodal/embedding_transfer.py), as its receiver speaks it:
1. the sender hands the receiver a `TransferRequest` (JSON: shape, dtype, and a serialized
   `NixlTransferRequest`: the sender's agent name and metadata, a tensor id, its size);
2. the receiver adds the sender's agent, carves an extent of its ring, and sends the sender a NIXL
   notification: msgpack `(tensor_id, (addr, size, device, "cpu"|"cuda"), done_id, its metadata)`;
3. the sender writes the tensor there with the notification `str(done_id)`, which the receiver
   waits for.

Here the tensor is an extent of the encode worker's arena, registered once by `NixlTransport`; the
write is the transport's (`_Write`: our deadline, cancelled by releasing its handle). What Dynamo's
side lacks, and why epd-ring's own receiver is safer: its receiver frees the ring extent when its
`receive_timeout` passes, while the write may still land there (into the next request's tensor),
and its sender resets a long write's timer rather than fail it. epd-ring's receiver carves a
region again only once the encoder's release notice says no write into it can land
(docs/transports.md, tests/test_nixl_dynamo.py).

Edge code: `poll` adds a receiver's agent when its first notification comes (a call that waits on
that peer), so it runs on a thread of the integrator's, not on the encode loop.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
from typing import Any

from ..core.transport import Outcome
from .nixl import _DONE, _FAILED, _PROC, _TIMED_OUT, NixlTransport, _Write

log = logging.getLogger("epd_ring.nixl")


class DynamoWriteSender:
    def __init__(self, transport: NixlTransport):
        self.t = transport
        self._ids = itertools.count(1)
        self._offered: dict[int, tuple[int, int]] = {}  # tensor id -> (arena pointer, bytes)
        self._writes: dict[int, _Write] = {}  # tensor id -> its write
        self._agents: set[str] = set()
        self.refused: list[tuple[int, str]] = []  # (tensor id, why): notifications not acted on
        self._later: list[tuple[Any, bytes]] = []  # notifications held back by `poll(defer=...)`

    def request(self, ptr: int, nbytes: int, shape: list[int], dtype: str) -> dict:
        """A `TransferRequest` (as a dict) offering `nbytes` at `ptr` (in a registered arena)."""
        tensor_id = next(self._ids)
        self._offered[tensor_id] = (ptr, nbytes)
        agent = self.t.agent
        inner = {"sender_agent_id": agent.name, "agent_metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
                 "tensor_id": tensor_id, "tensor_size": nbytes}
        return {"embeddings_shape": list(shape), "embedding_dtype_str": dtype.removeprefix("torch."),
                "serialized_request": json.dumps(inner)}

    def poll(self, defer: frozenset[int] = frozenset()) -> list[tuple[int, Outcome]]:
        """Answer the receivers' notifications with writes; the outcomes of writes that ended.
        `defer`: tensor ids whose requests wait for a later poll (a slow link, in tests).

        Each notification is answered on its own: a bad one (not Dynamo's, a tensor not offered,
        metadata NIXL will not add) is refused (`refused`, logged) and fails its own tensor's write
        if it named one offered, never the rest of the batch."""
        t = self.t
        with t._lock:
            notifs = t.agent.get_new_notifs()
        todo, self._later = self._later + [(s, m) for s, msgs in notifs.items() for m in msgs], []
        out: list[tuple[int, Outcome]] = []
        for sender, msg in todo:
            try:
                self._answer(sender, msg, defer, out)
            except Exception as exc:  # not foreseen below: still this notification's alone
                self._refuse(0, f"a notification from {sender!r} raised {type(exc).__name__}: {exc}")
        with t._lock:
            now = t.clock()
            for tensor_id, w in list(self._writes.items()):
                if w.state == _PROC and w.handle is not None:
                    t._check(w, now)
                if w.state == _PROC or (w.handle is not None and not t._release(w)):
                    continue
                del self._writes[tensor_id]
                out.append((tensor_id, {_DONE: Outcome.DONE, _FAILED: Outcome.FAILED,
                                        _TIMED_OUT: Outcome.TIMED_OUT}[w.state]))
        return out

    def _answer(self, sender: Any, msg: bytes, defer: frozenset[int], out: list[tuple[int, Outcome]]) -> None:
        """One notification: its write posted, or it refused (and its offered tensor, if any, FAILED)."""
        import msgspec

        try:
            tensor_id, (addr, size, _device, mem), done_id, meta = msgspec.msgpack.decode(msg)
        except (ValueError, TypeError, msgspec.DecodeError):
            tensor_id = None
        if type(tensor_id) is not int:
            self._refuse(0, f"not a Dynamo write request from {sender!r}")
            return
        if tensor_id in defer:
            self._later.append((sender, msg))
            return
        offered = self._offered.pop(tensor_id, None)
        if offered is None:
            self._refuse(tensor_id, "no such tensor offered")
            return
        if offered[1] != size or mem != "cpu" or type(addr) is not int or not isinstance(meta, bytes):
            self._refuse(tensor_id, "another size or memory than offered, or no metadata", out)
            return
        t = self.t
        try:
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            with t._lock:
                if name not in self._agents:
                    t.agent.add_remote_agent(meta)
                    self._agents.add(name)
                w = _Write(name, [(offered[0], addr, size)], t.clock() + t.write_timeout_s, str(done_id).encode())
                t._post(w)  # a write NIXL refuses is FAILED here, and reports as any other
        except Exception as exc:  # metadata NIXL will not add, a name that is not text
            self._refuse(tensor_id, f"the receiver's agent was not added: {type(exc).__name__}: {exc}", out)
            return
        self._writes[tensor_id] = w

    def _refuse(self, tensor_id: int, why: str, out: list[tuple[int, Outcome]] | None = None) -> None:
        """A notification not acted on; `out`: the offered tensor it named fails."""
        log.warning("Dynamo notification refused (tensor %d): %s", tensor_id, why)
        self.refused.append((tensor_id, why))
        if out is not None:
            out.append((tensor_id, Outcome.FAILED))

    def pending(self) -> int:
        return len(self._writes)

    def offered(self) -> dict[int, Any]:
        return dict(self._offered)
