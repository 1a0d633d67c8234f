"""vLLM's encoder-cache connector, backed by epd-ring.

Configured as::

    --ec-transfer-config '{"ec_connector": "EpdRingConnector",
                           "ec_connector_module_path": "epd_ring.executor.connectors.vllm",
                           "ec_role": "ec_producer"}'

Each request names its room in `SamplingParams.extra_args["ec_transfer_params"]`:
`bootstrap_host`, `bootstrap_port`, `bootstrap_room` (both roles), `receiver` (the producer's
authenticated identity for the room, optional) and `ranks` (consumer: how many ranks share the
item, 1 by default).

The scheduler side (here) is bookkeeping: it turns vLLM's scheduling calls into the per-step
metadata the workers act on (registrations and items for a producer; a consumer's loads and
cancels go to the workers over a side channel too, since vLLM runs no consumer worker
connector on a step without tokens) and turns the workers' reports (rooms concluded or failed, loads
done or failed) back into what vLLM asks: is an item here (`has_cache_item`), may the
request run (`ensure_cache_available`), which requests fail (`take_unavailable_requests`),
must the engine keep stepping (`has_pending_push_work`).

The worker side (vllm_worker.py) does the transfers: a producer worker ships each item vLLM
encoded through epd-ring's manager, pump, control plane and transport (Mooncake or NIXL); a consumer worker
receives it into a region of its receiver and hands it to vLLM's encoder cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from .vllm_worker import ConsumerWorker, LoadChannel, ProducerWorker, Settings, channel_paths

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request


@dataclass(frozen=True)
class Room:
    """Where a request's items go (producer) or come from (consumer): epd-ring's bootstrap triple."""

    host: str
    port: int
    room: int
    receiver: str | None = None
    ranks: int = 1

    @classmethod
    def of(cls, request: Request) -> Room | None:
        """The request's room, or None when it names none (the engine then encodes locally)."""
        params = getattr(request, "ec_transfer_params", None) or {}
        if "bootstrap_room" not in params:
            return None
        ranks = int(params.get("ranks", 1))
        if ranks < 1:
            raise ValueError(f"request {request.request_id!r}: ranks must be at least 1, not {ranks}")
        receiver = params.get("receiver")
        return cls(str(params["bootstrap_host"]), int(params["bootstrap_port"]), int(params["bootstrap_room"]),
                   None if receiver is None else str(receiver), ranks)


@dataclass(frozen=True)
class Registration:
    """Producer: bind `request_id` to its room (`EncodeExecutor.register`)."""

    request_id: str
    room: Room


@dataclass(frozen=True)
class Item:
    """Producer: the encoder output `mm_hash` belongs to `request_id`'s room, as its `index`-th item."""

    request_id: str
    index: int
    mm_hash: str
    num_embeds: int


@dataclass(frozen=True)
class Load:
    """Consumer: receive `mm_hash` (`num_embeds` rows) from `room` into the encoder cache."""

    request_id: str
    index: int
    mm_hash: str
    num_embeds: int
    room: Room


@dataclass
class EpdRingMetadata(ECConnectorMetadata):
    """Scheduler -> workers, one step."""

    registrations: list[Registration] = field(default_factory=list)
    items: list[Item] = field(default_factory=list)
    # producer: requests vLLM finished while their rooms were live; the worker withdraws a room
    # whose items never came (an abort before the encoder ran), else lets it conclude
    finished: list[str] = field(default_factory=list)
    # consumer: loads asked this step; what starts them is the side channel (vllm_worker.channel_paths),
    # since vLLM runs no worker connector on a consumer step without tokens
    loads: list[Load] = field(default_factory=list)
    # consumer: loads no request waits for any more
    cancelled_loads: list[str] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)


@dataclass
class EpdRingWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler, one step, aggregated over the ranks."""

    concluded: set[str] = field(default_factory=set)  # producer rooms the receiver confirmed, by request
    failed: dict[str, str] = field(default_factory=dict)  # producer rooms failed: request -> reason kind
    loaded: set[str] = field(default_factory=set)  # consumer: mm_hashes now in the encoder cache
    failed_loads: dict[str, str] = field(default_factory=dict)  # consumer: mm_hash -> reason kind

    def aggregate(self, other: ECConnectorWorkerMetadata) -> EpdRingWorkerMetadata:
        assert isinstance(other, EpdRingWorkerMetadata)
        # Every rank gathers from its own cache: an item is loaded, a room concluded, only where all
        # ranks say so; one rank's failure fails it.
        failed = {**self.failed, **other.failed}
        failed_loads = {**self.failed_loads, **other.failed_loads}
        return EpdRingWorkerMetadata(concluded=(self.concluded & other.concluded) - failed.keys(),
                                     failed=failed,
                                     loaded=(self.loaded & other.loaded) - failed_loads.keys(),
                                     failed_loads=failed_loads)


class EpdRingConnector(ECConnectorBase):
    """vLLM's `ECConnectorBase` over epd-ring; the role (producer, consumer, both) comes from `ec_role`."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        self._producer: ProducerWorker | None = None
        self._consumer: ConsumerWorker | None = None
        # producer
        self._to_register: dict[str, Registration] = {}
        self._registered: set[str] = set()
        self._items: list[Item] = []
        self._live: set[str] = set()
        self._finished: list[str] = []
        # consumer: mm_hash -> "loading" | "ready" | "failed"; the requests waiting on a load
        self._state: dict[str, str] = {}
        self._waiters: dict[str, set[str]] = {}
        self._to_load: list[Load] = []
        self._cancelled: list[str] = []
        self._local: set[str] = set()
        # both
        self._unavailable: set[str] = set()
        # consumer: the side channel to the workers' loops (made at the first load), and which ranks
        # reported each item ready through it
        self._channel: LoadChannel | None = None
        self._ready_ranks: dict[str, set[int]] = {}
        if role == ECConnectorRole.WORKER:
            self._start_worker(vllm_config)

    # --- scheduler side -------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        return self.is_consumer and self._state.get(identifier) == "ready"

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if not self.is_consumer:
            return True
        room = Room.of(request)
        if room is None:
            return True  # nothing to receive: vLLM runs the encoder itself
        if self.is_producer and room.receiver is not None:
            return True  # `both`: a request naming its receiver is encoded here and sent, not loaded
        self._poll_channel()
        ready = True
        for index, feature in enumerate(request.mm_features):
            if feature.mm_position.offset + feature.mm_position.length <= num_computed_tokens:
                continue
            h = feature.identifier
            if h in self._local or self._state.get(h) == "ready":
                continue
            ready = False
            self._waiters.setdefault(h, set()).add(request.request_id)
            if self._state.get(h) == "failed":  # fails with the others at the next take, not loaded again
                self._unavailable.add(request.request_id)
            if h not in self._state:
                self._state[h] = "loading"
                load = Load(request.request_id, index, h, request.get_num_encoder_embeds(index), room)
                self._to_load.append(load)
                if not self._tell_workers({"op": "load", "mm_hash": h, "room": asdict(room), "index": index,
                                           "num_embeds": load.num_embeds}):
                    # a rank's queue is full (a dead rank): the request fails rather than wait on it
                    self._state[h] = "failed"
                    self._unavailable |= self._waiters.pop(h, set())
        return ready

    def _tell_workers(self, message: dict[str, Any]) -> bool:
        if self._channel is None:
            self._channel = LoadChannel(*channel_paths(self._vllm_config))
        return self._channel.send(message)

    def _poll_channel(self) -> None:
        if self._channel is None:
            return
        for report in self._channel.reports():
            h, outcome = report["mm_hash"], report["outcome"]
            if self._state.get(h) != "loading":
                continue  # cancelled, or already settled
            if outcome == "ready":
                ranks = self._ready_ranks.setdefault(h, set())
                ranks.add(int(report["rank"]))
                if len(ranks) >= self._channel.ranks:  # every rank holds it: the step that reads it may run
                    del self._ready_ranks[h]
                    self._state[h] = "ready"
                    self._waiters.pop(h, None)
            else:
                self._ready_ranks.pop(h, None)
                self._state[h] = "failed"
                self._unavailable |= self._waiters.pop(h, set())

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        self._local.add(feature.identifier)
        if not self.is_producer or self._state.get(feature.identifier) == "ready":
            return  # a loaded item is not encoded here, so it is not sent on
        room = Room.of(request)
        if room is None:
            return
        if self.is_consumer and room.receiver is None:
            return  # `both`: a request naming no receiver was to be loaded; its item is not sent on
        rid = request.request_id
        if rid not in self._registered:
            self._registered.add(rid)
            self._to_register[rid] = Registration(rid, room)
            self._live.add(rid)
        self._items.append(Item(rid, index, feature.identifier, request.get_num_encoder_embeds(index)))

    def update_state_after_free(self, request: Request, index: int) -> None:
        h = request.mm_features[index].identifier
        self._local.discard(h)
        if self._state.get(h) == "ready":
            del self._state[h]  # the worker drops its entry with vLLM's own free list

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = EpdRingMetadata(registrations=list(self._to_register.values()), items=self._items,
                               finished=self._finished, loads=self._to_load, cancelled_loads=self._cancelled,
                               freed=list(scheduler_output.free_encoder_mm_hashes or ()))
        self._to_register, self._items, self._finished, self._to_load, self._cancelled = {}, [], [], [], []
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = connector_output.ec_connector_worker_meta
        if not isinstance(meta, EpdRingWorkerMetadata):
            return
        self._live -= meta.concluded
        for rid in meta.failed:
            if rid in self._live:
                self._live.discard(rid)
                self._unavailable.add(rid)
        for h in meta.loaded:
            if self._state.get(h) == "loading":
                self._state[h] = "ready"
                self._waiters.pop(h, None)
        for h in meta.failed_loads:
            if self._state.get(h) == "loading":
                # every request waiting on the item fails (vLLM takes them a step later: meanwhile they
                # stay deferred, never encoded here); a request after that loads it afresh
                self._state[h] = "failed"
                self._unavailable |= self._waiters.pop(h, set())

    def take_unavailable_requests(self) -> set[str]:
        self._poll_channel()
        failed, self._unavailable = self._unavailable, set()
        self._state = {h: state for h, state in self._state.items() if state != "failed"}
        return failed

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if rid in self._to_register:  # finished before its registration reached a worker
            del self._to_register[rid]
            self._items = [item for item in self._items if item.request_id != rid]
            self._live.discard(rid)
            self._registered.discard(rid)
        elif rid in self._registered:
            # the workers forget it once its rooms are over, a failed request's too (it left `_live` at
            # its failure): without this, each failed request's records stayed on the workers for good
            self._registered.discard(rid)
            self._finished.append(rid)
        for feature in request.mm_features:
            waiters = self._waiters.get(feature.identifier)
            if waiters is None:
                continue
            waiters.discard(rid)
            if not waiters and self._state.get(feature.identifier) == "loading":
                del self._waiters[feature.identifier]
                del self._state[feature.identifier]
                self._to_load = [load for load in self._to_load if load.mm_hash != feature.identifier]
                self._cancelled.append(feature.identifier)
                self._ready_ranks.pop(feature.identifier, None)
                self._tell_workers({"op": "cancel", "mm_hash": feature.identifier})
        # The room outlives the request on the producer: its bytes are staged, the receiver reads on.
        return False, None

    def has_pending_push_work(self) -> bool:
        return bool(self._live)

    # --- worker side ---------------------------------------------------------------------

    def _start_worker(self, vllm_config: VllmConfig) -> None:
        import os
        ec = vllm_config.ec_transfer_config
        assert ec is not None  # the base class refused a config without one
        settings = Settings.of(vllm_config, dict(ec.ec_connector_extra_config or {}), dict(os.environ))
        # this step's items not yet shipped (their output comes with `save_caches`), and the consumer's
        # loads: reported once the tensor is in vLLM's encoder cache
        self._unsent: list[Item] = []
        self._loaded: set[str] = set()
        self._load_failed: dict[str, str] = {}
        if self.is_producer:
            self._producer = ProducerWorker(settings)
        if self.is_consumer:
            try:
                reports, ranks = channel_paths(vllm_config)
                self._consumer = ConsumerWorker(settings, vllm_config.device_config.device,
                                                (ranks[min(settings.rank, len(ranks) - 1)], reports))
            except Exception:
                self.shutdown()
                raise

    @property
    def endpoint(self) -> str | None:
        """The producer's control endpoint (`tcp://HOST:PORT`): the requests' `bootstrap_host`/`port`."""
        return self._producer.endpoint if self._producer is not None else None

    def _meta(self) -> EpdRingMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, EpdRingMetadata), f"not epd-ring's metadata: {type(meta).__name__}"
        return meta

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor] | None = None, **kwargs: Any) -> None:
        if self._producer is None:
            return
        meta = self._meta()
        for reg in meta.registrations:
            self._producer.register(reg.request_id, reg.room)
        # an item cached from an earlier step is not encoded again: it goes now; the rest as encoded
        self._unsent = []
        for item in meta.items:
            if encoder_cache is not None and item.mm_hash in encoder_cache:
                self._producer.send(item.request_id, item.index, item.num_embeds, encoder_cache[item.mm_hash])
            else:
                self._unsent.append(item)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if self._producer is None or not self._unsent:
            return
        keep = []
        for item in self._unsent:
            if item.mm_hash == mm_hash:
                self._producer.send(item.request_id, item.index, item.num_embeds, encoder_cache[mm_hash])
            else:
                keep.append(item)
        self._unsent = keep

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        if self._consumer is None:
            return
        # Loads and cancels reach the loop over the side channel, also on steps vLLM does not run this
        # (`channel_paths`); here the items received go into vLLM's cache, before the step reads them.
        ready, failed = self._consumer.take_reports()
        for h, tensor in ready.items():
            encoder_cache[h] = tensor
            self._loaded.add(h)
        self._load_failed.update(failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # `request_finished` never delays a request's free (a room outlives its request, its bytes staged
        # in epd-ring's ring), so no request waits on this; rooms are reported through the worker metadata.
        return None, None

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        out = EpdRingWorkerMetadata()
        if self._producer is not None:
            meta = self._connector_metadata
            for item in self._unsent:  # allocated for the encoder, yet vLLM saved no output for it
                self._producer.fail(item.request_id, item.index, "vLLM saved no encoder output for the item")
            self._unsent = []
            if isinstance(meta, EpdRingMetadata):
                for rid in meta.finished:
                    self._producer.finished(rid)
            out.concluded, out.failed = self._producer.take_reports()
        if self._consumer is not None:
            out.loaded, self._loaded = self._loaded, set()
            out.failed_loads, self._load_failed = self._load_failed, {}
        return out

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._producer is not None:
            self._producer.shutdown()
        if self._consumer is not None:
            self._consumer.shutdown()
