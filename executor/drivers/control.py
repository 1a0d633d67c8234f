"""The control plane over ZMQ: registration frames in, status pushes out, never blocking.

Frames arrive on one PULL socket, read with NOBLOCK from the encode loop's
`poll()` (through `EncodeManager.sources`), so no listener thread is needed.
Each receiver's outcome goes out on a PUSH socket per status endpoint, sent
with NOBLOCK over a small high-water mark: a dead or slow receiver costs a
dropped, counted status, never a blocked loop (H4).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Any

import zmq

from ..core.frames import FrameError, ReceiverFrame, frame_from_parts
from ..core.regions import WITHDRAW_MAGIC, WithdrawError, withdraw_from_parts

log = logging.getLogger("epd_ring.control")


class ZmqControlPlane:
    def __init__(self, manager: Any = None, bind: str = "tcp://127.0.0.1:0", *, max_frames_per_poll: int = 1024,
                 push_hwm: int = 64, max_push_sockets: int = 1024):
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 100_000)
        self.pull.setsockopt(zmq.MAXMSGSIZE, 4096)  # a frame is ~150 bytes; refuse floods of junk early
        if bind.endswith(":0"):
            self.pull.bind_to_random_port(bind[: bind.rindex(":")])
        else:
            self.pull.bind(bind)
        self.endpoint = self.pull.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.max_frames_per_poll = max_frames_per_poll
        self.push_hwm = push_hwm
        self.max_push_sockets = max_push_sockets
        self._push: OrderedDict[str, zmq.Socket] = OrderedDict()
        self.stats: Counter = Counter()
        self.manager = None
        if manager is not None:
            self.attach(manager)

    def attach(self, manager: Any) -> None:
        """Poll frames from `manager.poll()`; push statuses for its transport."""
        self.manager = manager
        manager.sources.append(self.poll)

    # frames in ------------------------------------------------------------------------
    def poll(self) -> int:
        n = 0
        while n < self.max_frames_per_poll:
            try:
                parts = self.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            if parts and parts[0] == WITHDRAW_MAGIC:
                self._withdraw(parts)
                continue
            try:
                frame = frame_from_parts(parts)
            except FrameError as exc:
                # Refused alone: nothing in it can be trusted, not even its room.
                self.stats["frames_refused"] += 1
                log.warning("refused a control frame: %s", exc)
                continue
            self.stats["frames"] += 1
            self.manager.register_receiver(frame)
        return n

    def _withdraw(self, parts: list[bytes]) -> None:
        try:
            w = withdraw_from_parts(parts)
        except WithdrawError as exc:
            self.stats["withdraws_refused"] += 1
            log.warning("refused a withdraw: %s", exc)
            return
        self.stats["withdraws"] += 1
        self.manager.withdraw(w.room, w.session, w.status_endpoint)

    # statuses out ---------------------------------------------------------------------
    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._push.get(endpoint)
        if sock is not None:
            self._push.move_to_end(endpoint)
            return sock
        if len(self._push) >= self.max_push_sockets:
            _, old = self._push.popitem(last=False)
            old.close(linger=0)
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.push_hwm)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        sock.connect(endpoint)
        self._push[endpoint] = sock
        return sock

    def push_status(self, frame: ReceiverFrame, room: int, status: str, reason: str = "") -> None:
        endpoint = frame.status_endpoint
        if not endpoint:
            self.stats["status_without_endpoint"] += 1
            return
        try:
            self._socket(endpoint).send_multipart(
                [b"%d" % room, status.encode(), frame.session.encode(), reason.encode()[:1024]], zmq.NOBLOCK)
            self.stats["status_sent"] += 1
        except zmq.Again:
            self.stats["status_dropped"] += 1  # queue full: the receiver is gone or stuck
        except zmq.ZMQError as exc:
            self.stats["status_errors"] += 1
            log.warning("status for room %s to %s failed: %s", room, endpoint, exc)

    def close(self) -> None:
        for sock in self._push.values():
            sock.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
