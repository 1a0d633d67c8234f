"""The worker side of epd-ring's vLLM connector: the producer's encode worker, the consumer's receivers.

vLLM calls a worker connector from its model runner's thread, once per step and only on steps the
runner takes. epd-ring's drivers want ticking whether vLLM steps or not (deadlines, write outcomes,
notices, heartbeats), so each worker owns one loop thread: every call into the manager, the pump,
the control plane, the transport and the receivers is made on it, and vLLM's thread only hands
commands over (a queue) and takes reports back (under a lock). The core stays single-threaded as it
requires; vLLM's thread never waits on a transfer.

Rooms: epd-ring carries one item per room, a vLLM request has several. The item at `index` of a
request whose room is `R` travels in room `item_room(R, index)`, which both sides compute alike.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.clock import MonotonicClock
from ..core.executor import EncodeExecutor, EncodeItem
from ..core.manager import EncodeManager
from ..core.pump import Pump
from ..core.reasons import ReasonKind
from ..drivers.control import ENV_ALLOWED, ENV_ENCODER, ENV_SECRET, ZmqControlPlane, load_keypair, load_public_keys
from ..drivers.receiver import ReferenceReceiver
from ..drivers.transports import TRANSPORTS, make_transport

log = logging.getLogger("epd_ring.vllm")

_ROOM_BITS = 63


def item_room(room: int, index: int) -> int:
    """The epd-ring room of a request's `index`-th item, its request's room being `room`.

    Hashed rather than `room + index`: a proxy that numbers rooms consecutively would make the
    second item of one request collide with the first of the next."""
    if index == 0:
        return room  # the common single-image request keeps the room its proxy chose
    digest = hashlib.blake2b(f"{room}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - _ROOM_BITS)


@dataclass(frozen=True)
class Settings:
    """`ec_connector_extra_config`, checked once at start-up (a bad value names its key)."""

    hidden: int
    deepstack: int
    dtype: torch.dtype
    bind: str = "tcp://127.0.0.1:0"
    hostname: str = "127.0.0.1"
    keypair: tuple[bytes, bytes] | None = None
    allowed_keys: frozenset[bytes] = frozenset()
    encoder_key: bytes | None = None
    insecure: bool = False
    arena_bytes: int = 64 << 20
    max_item_bytes: int | None = None
    park_timeout: float = 30.0
    write_timeout: float = 30.0
    quarantine_s: float = 30.0
    drain_timeout: float = 10.0
    capacity: int = 64 << 20
    load_timeout: float = 60.0
    rank: int = 0
    transport: str = "mooncake"  # the engine the bytes move on (docs/transports.md), the same on both sides

    @classmethod
    def of(cls, vllm_config: Any, extra: dict[str, Any], env: dict[str, str]) -> Settings:
        def number(key: str, default: Any, kind: type = float, least: float = 0) -> Any:
            value = extra.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < least or (
                    kind is int and int(value) != value):
                raise ValueError(f"ec_connector_extra_config[{key!r}] must be a {kind.__name__} >= {least}, "
                                 f"got {value!r}")
            return kind(value)

        model = vllm_config.model_config
        hidden = number("hidden_size", _hidden_size(model), int, 1)
        deepstack = number("deepstack_levels", _deepstack_levels(model), int, 0)
        dtype = extra.get("dtype", model.dtype)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"ec_connector_extra_config['dtype'] names no torch dtype: {extra.get('dtype')!r}")
        insecure = extra.get("insecure", False)
        if not isinstance(insecure, bool):  # "false" as a string must not switch CURVE off
            raise ValueError(f"ec_connector_extra_config['insecure'] must be true or false, got {insecure!r}")
        secret = extra.get("secret_key", env.get(ENV_SECRET))
        keypair = load_keypair(secret) if secret else None
        allowed = extra.get("allowed_keys", env.get(ENV_ALLOWED, ""))
        encoder = extra.get("encoder_key", env.get(ENV_ENCODER))
        max_item = extra.get("max_item_bytes")
        transport = extra.get("transport", cls.transport)
        if transport not in TRANSPORTS:
            raise ValueError(f"ec_connector_extra_config['transport'] must be one of {', '.join(TRANSPORTS)}, "
                             f"got {transport!r}")
        return cls(hidden=hidden, deepstack=deepstack, dtype=dtype, bind=str(extra.get("bind", cls.bind)),
                   hostname=str(extra.get("hostname", cls.hostname)), keypair=keypair,
                   allowed_keys=frozenset(load_public_keys(allowed)),
                   encoder_key=next(iter(load_public_keys([encoder]))) if encoder else None, insecure=insecure,
                   arena_bytes=number("arena_bytes", cls.arena_bytes, int, 1),
                   max_item_bytes=None if max_item is None else number("max_item_bytes", max_item, int, 1),
                   park_timeout=number("park_timeout", cls.park_timeout),
                   write_timeout=number("write_timeout", cls.write_timeout),
                   quarantine_s=number("quarantine_s", cls.quarantine_s),
                   drain_timeout=number("drain_timeout", cls.drain_timeout),
                   capacity=number("capacity", cls.capacity, int, 1),
                   load_timeout=number("load_timeout", cls.load_timeout),
                   rank=number("rank", _rank(), int, 0), transport=transport)


def _hidden_size(model: Any) -> int:
    # What vLLM's encoder cache holds per row: the language model's input embedding width.
    for name in ("get_inputs_embeds_size", "get_hidden_size"):
        fn = getattr(model, name, None)
        if fn is not None:
            return int(fn())
    raise ValueError("cannot tell the embedding width: set ec_connector_extra_config['hidden_size']")


def _deepstack_levels(model: Any) -> int:
    vision = getattr(getattr(model, "hf_config", None), "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


def _rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # no model-parallel group (a single worker, a test): rank 0
        return 0


class _EncodedOnly:
    """The executor's model when vLLM runs the encoder itself: items come encoded (`send_item`)."""

    def __init__(self, deepstack: int):
        self.num_deepstack_embeddings = deepstack

    def image_encoder(self, items: Any) -> torch.Tensor:
        raise RuntimeError("vLLM runs the encoder; the connector only ships its outputs")

    get_video_feature = image_encoder

    def separate_deepstack_embeds(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("vLLM runs the encoder; the connector only ships its outputs")


class Loop:
    """One thread that owns a driver stack: commands in, `step()` on every turn, bounded idling."""

    def __init__(self, name: str, step: Callable[[], int], idle_s: float = 0.001):
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._step, self._idle_s = step, idle_s
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        self.commands.put(fn)

    def _run(self) -> None:
        name = self.thread.name
        while not self._stop.is_set():
            busy = 0
            while True:
                try:
                    fn = self.commands.get_nowait()
                except queue.Empty:
                    break
                busy += 1
                try:
                    fn()
                except Exception:  # one command's bug (one request's) must not stop the others'
                    log.exception("%s: a command failed", name)
            try:
                busy += self._step()
            except Exception as exc:  # the drivers' own tick failed: reported to vLLM's thread, loudly
                log.exception("%s: the loop failed", name)
                self.error = exc
                return
            if not busy:
                time.sleep(self._idle_s)

    def stop(self, timeout: float) -> bool:
        """Stop the thread; True once it has ended (its stack may then be closed from outside)."""
        self._stop.set()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def run(self, fn: Callable[[], None], timeout: float) -> None:
        """`fn` on the loop's thread, waited for at most `timeout`; on the caller's if the loop has
        ended (a failed tick), since nobody else then touches the stack."""
        if not self.thread.is_alive():
            fn()
            return
        done = threading.Event()

        def call() -> None:
            try:
                fn()
            finally:
                done.set()

        self.call(call)
        if not done.wait(timeout) and not self.thread.is_alive():
            fn()  # it ended before reaching the command


@dataclass
class _Request:
    rooms: set[int]
    finished: bool = False
    failed: bool = False


class ProducerWorker:
    """The encode side: vLLM's encoder outputs go out through the manager, pump, control plane and
    transport (Mooncake or NIXL, `transport`); rooms that conclude or fail come back as reports for the scheduler."""

    def __init__(self, settings: Settings):
        s = self.settings = settings
        if s.keypair is None and not s.insecure:
            raise ValueError(f"the producer needs its CURVE secret key (ec_connector_extra_config['secret_key'] or "
                             f"{ENV_SECRET}) and the receivers' public keys ('allowed_keys' or {ENV_ALLOWED}); "
                             "or 'insecure': true")
        self.control = ZmqControlPlane(bind=s.bind, keypair=s.keypair, allowed_keys=s.allowed_keys,
                                       insecure=s.insecure)
        self.endpoint = self.control.endpoint
        transport = None
        try:
            transport = make_transport(s.transport, s.hostname, notifier=self.control.push_status)
            self.manager = EncodeManager(transport, MonotonicClock(), park_timeout=s.park_timeout,
                                         write_timeout=s.write_timeout, quarantine_s=s.quarantine_s)
            self.executor = EncodeExecutor(self.manager, _EncodedOnly(s.deepstack), "cpu", arena_bytes=s.arena_bytes,
                                           max_item_bytes=s.max_item_bytes or min(s.arena_bytes, 1 << 30))
        except Exception:
            if transport is not None:
                transport.close()
            self.control.close()
            raise
        self.pump = Pump(self.executor)
        self.control.attach(self.pump)
        self.pump.on_conclude.append(self._concluded)
        # loop thread only
        self._rooms: dict[Any, Any] = {}  # request id -> its Room (the scheduler's registration)
        self._requests: dict[str, _Request] = {}
        self._room_of: dict[int, str] = {}  # epd-ring room -> request id
        # handed to vLLM's thread
        self._lock = threading.Lock()
        self._concluded_out: set[str] = set()
        self._failed_out: dict[str, str] = {}
        self._closed = False
        self.loop = Loop("epd-ring-producer", self._tick)

    # vLLM's thread -------------------------------------------------------------------------
    def register(self, request_id: str, room: Any) -> None:
        self.loop.call(lambda: self._rooms.__setitem__(request_id, room))

    def send(self, request_id: str, index: int, num_embeds: int, output: torch.Tensor) -> None:
        self.loop.call(lambda: self._send(request_id, index, num_embeds, output))

    def fail(self, request_id: str, index: int, why: str) -> None:
        self.loop.call(lambda: self._fail_unsent(request_id, index, why))

    def finished(self, request_id: str) -> None:
        self.loop.call(lambda: self._finished(request_id))

    def take_reports(self) -> tuple[set[str], dict[str, str]]:
        if self.loop.error is not None and not self._closed:
            raise RuntimeError("epd-ring's producer loop stopped") from self.loop.error
        with self._lock:
            concluded, self._concluded_out = self._concluded_out, set()
            failed, self._failed_out = self._failed_out, {}
        return concluded, failed

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        report: list[Any] = []

        def drain() -> None:
            report.append(self.pump.close(self.settings.drain_timeout, lambda: time.sleep(0.001)))

        # bounded: the drain's own deadline, and a margin for the loop to reach it
        self.loop.run(drain, self.settings.drain_timeout + 5)
        if self.loop.stop(5):  # the control plane is the loop's until its thread ended
            self.control.close()
        else:
            log.warning("epd-ring producer: the loop did not stop; its control plane is left open")
        if report and not report[0].clean:
            log.warning("epd-ring producer closed with its drain unfinished: %s", report[0])

    # the loop thread -----------------------------------------------------------------------
    def _tick(self) -> int:
        n = self.pump.tick()
        self.executor.reap_concluded_senders(())
        return n

    def _request(self, rid: str) -> _Request:
        req = self._requests.get(rid)
        if req is None:
            req = self._requests[rid] = _Request(set())
        return req

    def _send(self, rid: str, index: int, num_embeds: int, output: torch.Tensor) -> None:
        room = self._rooms.get(rid)
        req = self._request(rid)
        if room is None or req.failed:
            return
        s = self.settings
        width = s.hidden * (1 + s.deepstack)
        if output.dim() != 2 or output.shape[0] != num_embeds or output.shape[1] != width:
            self._report_failed(rid, ReasonKind.ITEM,
                                f"item {index}: encoder output {tuple(output.shape)} is not [{num_embeds}, {width}]")
            return
        rid_item = (rid, index)
        room_id = item_room(room.room, index)
        try:
            self.executor.register(rid_item, room.host, room.port, room_id, receiver=room.receiver)
        except Exception as exc:  # a reused room, a bad host: this request alone fails
            self._report_failed(rid, ReasonKind.CALLER, f"item {index}: {type(exc).__name__}: {exc}")
            return
        req.rooms.add(room_id)
        self._room_of[room_id] = rid
        main = output[:, :s.hidden].contiguous() if s.deepstack else output
        deep = output[:, s.hidden:].contiguous() if s.deepstack else None
        self.executor.send_item(rid_item, EncodeItem("image", num_embeds, encoded=main, encoded_deepstack=deep))
        self.pump.flush()

    def _fail_unsent(self, rid: str, index: int, why: str) -> None:
        if rid in self._rooms:
            self._report_failed(rid, ReasonKind.CALLER, f"item {index}: {why}")

    def _finished(self, rid: str) -> None:
        req = self._request(rid)
        req.finished = True
        self._settle(rid, req)

    def _concluded(self, room_id: int, state: str) -> None:
        rid = self._room_of.pop(room_id, None)
        if rid is None:
            return
        req = self._request(rid)
        req.rooms.discard(room_id)
        if state != "success":
            reason = self.manager.failure_reason(room_id)
            self._report_failed(rid, reason.kind if reason is not None else ReasonKind.CALLER, str(reason or ""))
            return
        self._settle(rid, req)

    def _settle(self, rid: str, req: _Request) -> None:
        # A request is done once vLLM finished it (no more items can come) and its rooms all concluded.
        if req.finished and not req.rooms:
            if not req.failed:
                with self._lock:
                    self._concluded_out.add(rid)
            self._forget(rid)

    def _report_failed(self, rid: str, kind: ReasonKind, detail: str) -> None:
        req = self._request(rid)
        if not req.failed:
            req.failed = True
            log.warning("epd-ring: request %s failed (%s): %s", rid, kind.value, detail)
            with self._lock:
                self._failed_out[rid] = kind.value
        # its other rooms conclude on their own (a receiver is told); nothing more is reported
        if req.finished and not req.rooms:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._requests.pop(rid, None)
        self._rooms.pop(rid, None)


def channel_paths(vllm_config: Any) -> tuple[str, list[str]]:
    """The consumer's side channel: (the scheduler's report endpoint, each rank's load endpoint).

    vLLM 0.33.0's model runner enters a consumer's connector only on steps that schedule tokens: with
    every request waiting on a load, loads asked for through the step's metadata would never start.
    So the scheduler-side connector hands loads to the workers' loop threads directly, and they
    report back the same way; IPC paths named by the engine, which both sides' configs share."""
    import tempfile
    ec = vllm_config.ec_transfer_config
    dp = vllm_config.parallel_config.data_parallel_rank
    base = f"ipc://{tempfile.gettempdir()}/epd-ring-{ec.engine_id}-{dp}"
    ranks = max(1, int(vllm_config.parallel_config.tensor_parallel_size))
    return f"{base}-s", [f"{base}-w{r}" for r in range(ranks)]


class LoadChannel:
    """The scheduler's end of the side channel: loads and cancels out to every rank, reports in."""

    def __init__(self, reports: str, ranks: list[str]):
        import zmq
        self._zmq = zmq
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(reports)
        self.pushes = []
        for endpoint in ranks:  # a rank not bound yet gets what was queued once it is
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self.pushes.append(sock)
        self.ranks = len(ranks)

    def send(self, message: dict[str, Any]) -> bool:
        """Out to every rank without waiting: False if a rank's queue is full (a dead rank), so
        vLLM's scheduler thread never blocks on it; the caller fails what it asked for."""
        import json
        data = json.dumps(message).encode()
        sent = True
        for sock in self.pushes:
            try:
                sock.send(data, self._zmq.NOBLOCK)
            except self._zmq.Again:
                sent = False
        return sent

    def reports(self) -> list[dict[str, Any]]:
        import json
        out = []
        while self.pull.poll(0):
            out.append(json.loads(self.pull.recv()))
        return out

    def close(self) -> None:
        for sock in self.pushes:
            sock.close(0)
        self.pull.close(0)
        self.ctx.term()


@dataclass
class _Loading:
    mm_hash: str
    endpoint: str
    deadline: float


class ConsumerWorker:
    """The prefill side: one receiver per encoder endpoint (its memory registered once), a frame
    per load, the received region handed to vLLM's encoder cache on success."""

    def __init__(self, settings: Settings, device: Any = "cpu", channel: tuple[str, str] | None = None):
        """`channel`: (this rank's load endpoint, the scheduler's report endpoint): loads come in and
        outcomes go out there, not only through vLLM's steps (see `channel_paths`)."""
        s = self.settings = settings
        if not s.insecure and (s.keypair is None or s.encoder_key is None):
            raise ValueError(f"the consumer needs its CURVE secret key (ec_connector_extra_config['secret_key'] or "
                             f"{ENV_SECRET}) and the encoder's public key ('encoder_key' or {ENV_ENCODER}); "
                             "or 'insecure': true")
        self.device = torch.device(device)
        # loop thread only
        self.receivers: dict[str, ReferenceReceiver] = {}
        self._loading: dict[tuple[str, int], _Loading] = {}
        self._by_hash: dict[str, tuple[str, int]] = {}
        self._over: set[tuple[str, int]] = set()  # loads ended whose receiver's records go once its region has
        # handed to vLLM's thread
        self._lock = threading.Lock()
        self._ready: dict[str, torch.Tensor] = {}
        self._failed_out: dict[str, str] = {}
        self._closed = False
        self._in = self._out = self._ctx = None
        if channel is not None:
            import zmq
            self._ctx = zmq.Context()
            self._in = self._ctx.socket(zmq.PULL)
            self._in.setsockopt(zmq.LINGER, 0)
            self._in.bind(channel[0])
            self._out = self._ctx.socket(zmq.PUSH)
            self._out.setsockopt(zmq.LINGER, 0)
            self._out.connect(channel[1])
        self.loop = Loop("epd-ring-consumer", self._tick)

    # vLLM's thread -------------------------------------------------------------------------
    def take_reports(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        if self.loop.error is not None and not self._closed:
            raise RuntimeError("epd-ring's consumer loop stopped") from self.loop.error
        with self._lock:
            ready, self._ready = self._ready, {}
            failed, self._failed_out = self._failed_out, {}
        return ready, failed

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True

        def close() -> None:
            for key in list(self._loading):
                self._withdraw(key)
            for rcv in self.receivers.values():
                rcv.close()
            self.receivers.clear()
            for sock in (self._in, self._out):
                if sock is not None:
                    sock.close(0)
            if self._ctx is not None:
                self._ctx.term()

        self.loop.run(close, 10)
        self.loop.stop(5)

    # the loop thread -----------------------------------------------------------------------
    def _receiver(self, endpoint: str) -> ReferenceReceiver:
        rcv = self.receivers.get(endpoint)
        if rcv is None:
            s = self.settings
            rcv = self.receivers[endpoint] = ReferenceReceiver(
                endpoint, capacity=s.capacity, hostname=s.hostname, dtype=s.dtype, encoder_key=s.encoder_key,
                keypair=s.keypair, insecure=s.insecure, transport=s.transport)
        return rcv

    def _fail(self, mm_hash: str, kind: str) -> None:
        with self._lock:
            self._failed_out[mm_hash] = kind
        self._report(mm_hash, kind)

    def _report(self, mm_hash: str, outcome: str) -> None:
        if self._out is not None:
            import json

            import zmq
            try:  # never waits on the scheduler: the step's metadata carries the same outcome
                self._out.send(json.dumps({"rank": self.settings.rank, "mm_hash": mm_hash, "outcome": outcome})
                               .encode(), zmq.NOBLOCK)
            except zmq.Again:
                log.warning("epd-ring: report of %s (%s) dropped: the scheduler's queue is full", mm_hash, outcome)

    def _take_channel(self) -> int:
        import json
        from types import SimpleNamespace
        n = 0
        while self._in is not None and self._in.poll(0):
            data = self._in.recv()
            n += 1
            msg: Any = None
            try:  # one bad message fails its own load, never the loop
                msg = json.loads(data)
                if msg["op"] == "load":
                    self._load(msg["mm_hash"], SimpleNamespace(**msg["room"]), msg["index"], msg["num_embeds"])
                elif msg["op"] == "cancel":
                    self._cancel(msg["mm_hash"])
            except Exception as exc:
                log.warning("epd-ring: a load message refused (%s: %s)", type(exc).__name__, exc)
                h = msg.get("mm_hash") if isinstance(msg, dict) else None
                if isinstance(h, str) and h not in self._by_hash:
                    self._fail(h, "refused")
        return n

    def _load(self, mm_hash: str, room: Any, index: int, num_embeds: int) -> None:
        s = self.settings
        if mm_hash in self._by_hash:
            return  # asked again (every rank's channel carries each load once; a repeat is one load)
        endpoint = f"tcp://{room.host}:{room.port}"
        key = (endpoint, item_room(room.room, index))
        try:
            rcv = self._receiver(endpoint)
            rcv.expect(key[1], span=num_embeds, hidden=s.hidden, deep_width=s.hidden * s.deepstack, n=room.ranks,
                       rank=s.rank)
        except Exception as exc:  # no memory left, a room still held, a bad endpoint: this load alone fails
            log.warning("epd-ring: load of %s from %s refused: %s", mm_hash, endpoint, exc)
            self._fail(mm_hash, "refused")
            return
        self._loading[key] = _Loading(mm_hash, endpoint, time.monotonic() + s.load_timeout)
        self._by_hash[mm_hash] = key
        try:
            rcv.register(key[1])
        except Exception as exc:  # the encoder does not take our frames (a refused key: send timed out)
            log.warning("epd-ring: frame for %s to %s not sent: %s", mm_hash, endpoint, exc)
            self._withdraw(key)
            self._fail(mm_hash, "refused")

    def _cancel(self, mm_hash: str) -> None:
        with self._lock:
            self._ready.pop(mm_hash, None)  # not yet in vLLM's cache: nobody would free it there
        key = self._by_hash.get(mm_hash)
        if key is not None:
            self._withdraw(key)

    def _withdraw(self, key: tuple[str, int]) -> None:
        self._over.add(key)
        loading = self._loading.pop(key, None)
        if loading is not None:
            self._by_hash.pop(loading.mm_hash, None)
        rcv = self.receivers.get(key[0])
        if rcv is None:
            return
        try:
            rcv.withdraw(key[1])  # the region stays unusable until the encoder answers: no late write lands on reuse
        except Exception as exc:
            log.warning("epd-ring: withdraw of room %s at %s not sent: %s", key[1], key[0], exc)

    def _tick(self) -> int:
        n = self._take_channel()
        for key in [k for k in self._over if k[0] not in self.receivers or self.receivers[k[0]].forget(k[1])]:
            self._over.discard(key)
        for endpoint, rcv in self.receivers.items():
            try:
                n += rcv.poll(0)
            except Exception as exc:  # one encoder's receiver fails its own loads, not the loop
                log.warning("epd-ring: the receiver for %s failed: %s", endpoint, exc)
                for key, loading in list(self._loading.items()):
                    if key[0] == endpoint:
                        self._withdraw(key)
                        self._fail(loading.mm_hash, "failed")
        if not self._loading:
            return n
        now = time.monotonic()
        for key, loading in list(self._loading.items()):
            rcv = self.receivers[key[0]]
            told = rcv.status.get(key[1])
            if told:
                self._over.add(key)
            if told and told[0] == "success":
                del self._loading[key]
                self._by_hash.pop(loading.mm_hash, None)
                try:
                    main, deep = rcv.consume(key[1])
                except Exception as exc:
                    log.warning("epd-ring: room %s at %s not consumed: %s", key[1], key[0], exc)
                    self._fail(loading.mm_hash, "failed")
                    n += 1
                    continue
                out = torch.cat([main, deep], dim=1) if deep is not None else main
                with self._lock:
                    self._ready[loading.mm_hash] = out.to(self.device)
                self._report(loading.mm_hash, "ready")  # held here: in vLLM's cache before the step that reads it
                n += 1
            elif told:
                del self._loading[key]
                self._by_hash.pop(loading.mm_hash, None)
                self._fail(loading.mm_hash, "failed")
                n += 1
            elif now >= loading.deadline:
                # nothing told within the bound (a silent or gone encoder): the request must not wait on
                self._withdraw(key)
                self._fail(loading.mm_hash, "timeout")
                n += 1
        return n


__all__ = ["ConsumerWorker", "LoadChannel", "Loop", "channel_paths", "ProducerWorker", "Settings", "item_room"]
