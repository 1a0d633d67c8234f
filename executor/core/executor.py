"""The encode-side controller: run the tower, scatter, lease, stage, defer, send, reap.

`EncodeExecutor` keeps the public surface of the executor it replaces, so an
encode loop written against it can switch, and adds `poll()`, the core's tick.
It starts no threads and calls out to nothing: everything happens inside calls
made by the loop, and what must happen outside (writes, contacts, notices)
comes back as effects that a `Pump` does. That is what lets tests and the model
drive every interleaving.

A walk through one item: `execute` runs the tower on the batch and splits its
output per item (`assign_encoded_embeddings`); `Staging.offer` (staging.py) leases an
extent or defers the item; `_stage` copies the embedding into the extent and hands
the chunk to the manager (`submit_chunk`), at once or when its copy fence
passes (`finish_copies`). The room's step then parks the chunk or starts its
writes (lifecycle.py, through fsm/couplings.py), which leave `Submit` effects.
`poll` finishes copies, fires deadlines (`EncodeManager.poll`), serves deferred
items and steps a drain; outcomes come in through `writes_reported`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from epd_ring.fsm import EXTENT, ROOM_CONCLUDED

from . import settings
from .drain import DRAINING, Drain
from .manager import EncodeManager
from .reasons import Reason, ReasonKind, as_reason
from .ring import Ring
from .shares import Shares
from .staging import Sender, StagedCalls, Staging
from .tower import TowerModel

log = logging.getLogger("epd_ring.executor")


class Modality(str, enum.Enum):
    IMAGE = "image"
    VIDEO = "video"


@dataclass(eq=False)
class EncodeItem:
    """One image or video to encode: the tower input and, after encoding, its embedding.

    - `modality`: "image" or "video" (a `Modality` or its string); picks `image_encoder` or
      `get_video_feature` of the `TowerModel`.
    - `n_tokens`: post-merge tokens, i.e. the rows this item owns in the tower's packed output
      and the rows its receivers expect (`ReceiverFrame.span`).
    - `pixel_values`: whatever the tower reads (a tensor, frames); the executor never looks at it.
    - `hash`, `meta`: the caller's, carried along untouched.
    - `encoded`, `encoded_deepstack`: set by `execute` (contiguous `[n_tokens, hidden]` and
      `[n_tokens, hidden * levels]` or None); set them yourself before `send_item` for a cache hit.

    An engine's own item type works too if it has `modality`, `encoded`, `encoded_deepstack` and
    either `n_tokens` or `offsets` (inclusive (start, end) token ranges).
    """

    modality: Any  # a `Modality`, its value, or an engine's own enum: matched by value (`_modality_name`)
    n_tokens: int  # post-merge token count: the rows this item owns in the tower output
    pixel_values: Any = None
    hash: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    encoded: torch.Tensor | None = None
    encoded_deepstack: torch.Tensor | None = None


def item_token_count(item: Any) -> int:
    """Post-merge tokens of an item: `n_tokens`, or the sum of its (start, end) offsets."""
    n = getattr(item, "n_tokens", None)
    if n is not None:
        return int(n)
    offsets = getattr(item, "offsets", None)
    if offsets is not None:
        return sum(end - start + 1 for start, end in offsets)
    raise ValueError(f"cannot count tokens of {type(item).__name__}: no n_tokens or offsets")


def assign_encoded_embeddings(items: Sequence[Any], output: torch.Tensor, model: Any) -> None:
    """Split a packed tower output into per-item embeddings, in place.

    Rows go to items in order, by each item's post-merge token count. For
    deepstack models the columns are split by `model.separate_deepstack_embeds`
    into the main and deepstack halves. Results are contiguous, since the
    transfer ships raw row-major bytes.
    """
    if output.dim() != 2:
        output = output.reshape(-1, output.shape[-1])
    one = len(items) == 1
    if one:  # the common batch of one: its count without a list (nor, below, a split)
        n = getattr(items[0], "n_tokens", None)
        total = n if type(n) is int else item_token_count(items[0])
    else:
        counts = [item_token_count(item) for item in items]
        total = sum(counts)
    if output.shape[0] != total:
        raise ValueError(
            f"tower output has {output.shape[0]} rows but the items' post-merge token counts sum to {total}"
        )
    deepstack = getattr(model, "num_deepstack_embeddings", 0) > 0
    # A batch of one needs no split (torch.split costs a few microseconds).
    pieces = (output,) if one else torch.split(output, counts, dim=0)
    for item, emb in zip(items, pieces):
        if deepstack:
            main, deep = model.separate_deepstack_embeds(emb)
            item.encoded = main.contiguous()
            item.encoded_deepstack = deep.contiguous()
        else:
            item.encoded = emb.contiguous()
            item.encoded_deepstack = None


_MODALITY_NAMES: dict[Any, str] = {}
_TOWER_MODALITIES = frozenset(("image", "video"))


def _modality_name(m: Any) -> str:
    try:
        return _MODALITY_NAMES[m]
    except (KeyError, TypeError):
        try:
            name = str(getattr(m, "value", m)).lower()
        except Exception:  # an object whose str() raises is no modality
            return ""
        try:
            if len(_MODALITY_NAMES) < 64:
                _MODALITY_NAMES[m] = name
        except TypeError:  # unhashable modality object
            pass
        return name


def _cuda_fence() -> Any:
    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's stubs leave it untyped
    ev.record()
    return ev


class EncodeExecutor(StagedCalls):
    """The encode loop's surface: the tower, its items' senders, the tick, shutdown and health.

    How an item gets into an extent (lease, copy, defer) is its `staging` part's; the rooms are its
    manager's. The seed's calls on the deferred queue (`drain_deferred`, `has_deferred`) and the
    deferred queue's and copies' gauges are answered by `staging` itself (`StagedCalls`)."""

    def __init__(
        self,
        manager: EncodeManager,
        multimodal_model: TowerModel,
        device: Any,
        *,
        arena_bytes: int | None = None,
        deep_arena_bytes: int | None = None,
        max_item_bytes: int | None = None,
        ring_slots: int | None = None,
        ring_bytes: int | None = None,
        max_deferred: int | None = None,
        copy_fence: Callable[[], Any] | None = None,
        peer_ring_share: float = 0.5,
        parked_ring_share: float = 0.5,
        identity_ring_share: float | None = None,
        max_pieces: int = 4,
    ):
        arena_bytes, max_item_bytes, old_extents = settings.arena(arena_bytes, max_item_bytes, ring_slots, ring_bytes)
        if max_deferred is not None:
            settings.count("max_deferred", max_deferred, 0)
        self.manager, self.model = manager, multimodal_model
        self.device = torch.device(device)
        n_deep = settings.count("model.num_deepstack_embeddings",
                                getattr(multimodal_model, "num_deepstack_embeddings", 0) or 0, 0)
        # By default the deepstack arena is n_deep times the main one, so it holds as many tokens
        # as the main arena (deepstack rows are n_deep * hidden wide).
        if deep_arena_bytes is None:
            deep_arena_bytes = arena_bytes * n_deep
        else:
            settings.count("deep_arena_bytes", deep_arena_bytes, 0)
            if not n_deep:
                deep_arena_bytes = 0  # no deepstack rows to hold
        self.ring = Ring(manager.transport, arena_bytes, self.device, deep_bytes=deep_arena_bytes,
                         actions=manager.actions, max_item_bytes=max_item_bytes, max_pieces=max_pieces)
        max_deferred = (8 * (old_extents or 64)) if max_deferred is None else max_deferred
        holds = manager.holds
        # One receiver's peer may hold at most this share of the arenas' bytes (unless the manager was
        # given `max_peer_bytes`): a stuck receiver cannot take the ring from the others. 1.0: no bound.
        ring_total = arena_bytes + deep_arena_bytes
        if settings.share("peer_ring_share", peer_ring_share) < 1 and manager.peers.max_bytes is None:
            manager.peers.max_bytes = max(1, int(ring_total * peer_ring_share))
        # One identity's chunks parked for receivers not all registered (charged to no peer) may hold at
        # most this share (unless the manager was given `max_parked_bytes`). 1.0: no bound.
        if settings.share("parked_ring_share", parked_ring_share) < 1 and holds.max_parked_bytes is None:
            holds.max_parked_bytes = max(1, int(ring_total * parked_ring_share))
        # Each identity's share of the ring and of the deferred queue (shares.py): 1 / the identities seen,
        # or this fixed fraction. 1.0: no bound.
        if identity_ring_share is not None:
            settings.share("identity_ring_share", identity_ring_share)
        self.shares = holds.shares = Shares(ring_total, max_deferred, identity_ring_share, clock=manager.clock.now)
        if copy_fence is None and self.device.type == "cuda":
            copy_fence = _cuda_fence
        self._inference = torch.inference_mode()  # reused: creating one per batch costs ~1 us
        self.senders: dict[Any, Sender] = {}
        self._room_sender: dict[int, Sender] = {}
        self._concluded: list[Any] = []
        self.staging = Staging(manager, self.ring, self.senders, max_deferred=max_deferred, copy_fence=copy_fence,
                               host_copy=self.device.type == "cpu")
        self.stats = manager.stats
        self._drain: Drain | None = None
        manager.on_conclude.append(self._room_concluded)

    # registration ----------------------------------------------------------
    def register(self, request_id: Any, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int,
                 receiver: str | None = None) -> None:
        """Bind a request to its room; `receiver` names the identity whose frames it takes (see
        `EncodeManager.bind_sender`): name it whenever the control plane authenticates."""
        if request_id in self.senders:
            raise ValueError(f"request {request_id!r} is already registered")
        # kept on the sender for the engine that serves it: refused here, not when read (called to raise)
        if type(bootstrap_host) is not str or type(bootstrap_port) is not int or not 0 <= bootstrap_port <= 65535:
            settings.text("bootstrap_host", bootstrap_host)
            settings.port("bootstrap_port", bootstrap_port)
        state = self.manager.bind_sender(bootstrap_room, receiver)
        sender = self.senders[request_id] = Sender(request_id, bootstrap_room, bootstrap_host, bootstrap_port)
        self._room_sender[bootstrap_room] = sender
        if state in ROOM_CONCLUDED:
            self._concluded.append(request_id)
        elif self._drain is not None:
            self._drain.fail(bootstrap_room, DRAINING)  # intake has stopped

    def _room_concluded(self, room: int, state: str) -> None:
        sender = self._room_sender.pop(room, None)
        if sender is not None:
            self._concluded.append(sender.request_id)

    # the tower -------------------------------------------------------------
    def _feature_fn(self, name: str) -> Callable[[list[Any]], torch.Tensor]:
        """The tower's seam for a modality `execute` has named (one of `_TOWER_MODALITIES`)."""
        # Images go through the `image_encoder` seam, which a CUDA-graph wrapper may replace.
        if name == "image":
            return self.model.image_encoder
        if name == "video":
            return self.model.get_video_feature
        raise ValueError(f"unsupported modality for encode: {name!r}")

    def execute(self, request_items: Sequence[tuple[Any, Any]]) -> int:
        """Run the tower on a batch and ship each item; return items encoded.

        An item that cannot go to the tower (None, no modality, an unknown one)
        fails only its own room. A tower or scatter exception fails every room
        of the batch and returns 0. Neither escapes into the encode loop.
        """
        if len(request_items) == 1:  # the common cache-miss batch of one: no grouping needed
            rid, item = request_items[0]
            name = _modality_name(getattr(item, "modality", None))
            if name not in _TOWER_MODALITIES:
                self._refuse_item(rid, item)
                return 0
            by_modality = {name: [item]}
        else:
            by_modality = {}
            good = []
            for rid, item in request_items:
                name = _modality_name(getattr(item, "modality", None))
                if name not in _TOWER_MODALITIES:
                    self._refuse_item(rid, item)
                    continue
                by_modality.setdefault(name, []).append(item)
                good.append((rid, item))
            request_items = good
        try:
            with self._inference:
                for modality, items in by_modality.items():
                    output = self._feature_fn(modality)(items)
                    assign_encoded_embeddings(items, output, self.model)
        except Exception as exc:
            senders = [s for s in (self._sender_of(rid) for rid, _ in request_items) if s is not None]
            for sender in senders:  # their one item is spent: a second is a protocol error
                sender.offered = True
            if self.manager.observer is not None:
                self.manager.observer.tower_failed([s.room for s in senders])
            n = self.fail_rooms([rid for rid, _ in request_items],
                                Reason(ReasonKind.TOWER, str(exc) or type(exc).__name__))
            self.stats["tower_errors"] += 1
            log.error("encode batch of %d items failed (%d rooms failed): %s", len(request_items), n, exc)
            return 0
        for rid, item in request_items:
            self._offer_safely(rid, item)
        return len(request_items)

    def send_item(self, request_id: Any, item: Any) -> None:
        """Ship an item already encoded (a cache hit) through the same lease-or-defer path."""
        self._offer_safely(request_id, item)

    def _refuse_item(self, rid: Any, item: Any) -> None:
        self.stats["items_refused"] += 1
        modality = getattr(item, "modality", "<none>")  # pragma: no mutate (the refusal's wording)
        why = f"bad item {type(item).__name__}: unsupported modality {modality!r}"  # pragma: no mutate (wording)
        self._fail_request(rid, Reason(ReasonKind.ITEM, why))

    def _sender_of(self, rid: Any) -> Sender | None:
        try:
            return self.senders.get(rid)
        except TypeError:  # an unhashable request id (a tuple holding a list, say) names no room
            return None

    def _fail_request(self, rid: Any, reason: Reason) -> None:
        sender = self._sender_of(rid)
        if sender is None:
            self.stats["items_without_sender"] += 1
            log.error("dropping item for unregistered request %r: %s", rid, reason)
            return
        sender.offered = True
        self.manager.fail_room(sender.room, reason)

    def _offer_safely(self, rid: Any, item: Any) -> None:
        # The last defence for one bad item: what it raises fails its own room, never the loop (a try is free).
        try:
            self.staging.offer(rid, item)
        except Exception as exc:
            self.stats["items_refused"] += 1
            why = f"item could not be sent: {type(exc).__name__}: {exc}"  # pragma: no mutate (wording)
            self._fail_request(rid, Reason(ReasonKind.ITEM, why))

    # the tick --------------------------------------------------------------
    def poll(self) -> int:
        """Finish copies, fire due deadlines, serve deferred sends, step a drain; return events handled.

        Transfer outcomes and contact answers come in through the manager's `writes_reported` and
        `contacts_reported`; what to do comes out through `manager.take_effects()` (the `Pump`
        does both around this call)."""
        staging = self.staging
        n = staging.finish_copies() if staging.copies else 0
        n += self.manager.poll()
        if self.shares.deferred:
            staging.serve_deferred()
        if self._drain is not None:
            self._drain.step()
        return n

    # shutdown ----------------------------------------------------------------
    def begin_close(self, timeout: float, *, close_transport: bool = True) -> None:
        """Start a graceful drain (see `drain`); `poll()` carries it on. Idempotent."""
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout}")
        if self._drain is None:
            self._drain = Drain(self.staging, self.manager.clock.now() + timeout, close_transport)
            self._drain.step()

    @property
    def closed(self) -> bool:
        """True once a drain has retired the ring, unregistered it and closed the transport."""
        return self._drain is not None and self._drain.done

    @property
    def drain(self) -> Drain | None:
        """The drain under way (see `begin_close`), or None."""
        return self._drain

    # failure and reaping -----------------------------------------------------
    def fail_rooms(self, request_ids: Iterable[Any], exc: BaseException | str) -> int:
        """Fail the rooms of these requests, each once; return how many this call failed.

        A plain string or exception is the engine's own reason (kind `caller`)."""
        rooms = []
        seen = set()
        for rid in request_ids:
            sender = self._sender_of(rid)
            if sender is not None and sender.room not in seen:
                seen.add(sender.room)
                rooms.append(sender.room)
        reason = as_reason(str(exc) or type(exc).__name__) if not isinstance(exc, Reason) else exc
        return sum(1 for room in rooms if self.manager.fail_room(room, reason))

    def reap_concluded_senders(self, pending_request_ids: Any = ()) -> int:
        """Drop senders whose room concluded, except those still awaiting the tower.

        Costs O(rooms concluded since the last reap), not O(senders).
        """
        kept = []
        reaped = 0
        for rid in self._concluded:
            if rid in pending_request_ids:
                kept.append(rid)
                continue
            sender = self.senders.pop(rid, None)
            if sender is not None:
                reaped += 1
                self.manager.tombs.unpin(sender.room)  # `unbind_sender`, without its call
                if self._room_sender.get(sender.room) is sender:
                    del self._room_sender[sender.room]
        self._concluded = kept
        return reaped

    # health and debugging ------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """A cheap view for health checks and metrics (O(extents + peers + writes); not for the hot path).

        `loop_lag_s`: seconds since the last `poll()` read the clock (None before the
        first); a loop stuck on anything shows here. `oldest_write_age_s`: age of the
        oldest write still in flight (0 if none).
        """
        m = self.manager
        now = m.clock.now()
        ring = self.ring
        counts = ring.counts()
        return {
            "loop_lag_s": None if m.polled_at is None else max(0.0, now - m.polled_at),
            "oldest_write_age_s": m.oldest_write_age(),
            "writes_in_flight": m.writes_in_flight,
            "peers": m.peers.counts(),
            "extents": {s: counts.get(s, 0) for s in EXTENT.states},
            "quarantined": counts.get("quarantined", 0),
            **ring.gauges(),
            "deferred": self.shares.deferred,
            "rooms": len(m.rooms),
        }

    def dump_state(self, format: str = "text") -> str:
        """Each live extent with its state and room, each live room with its state and receivers.

        `format="dot"` gives a graphviz picture of the same (render with `dot -Tsvg`).
        """
        if format == "dot":
            from epd_ring.fsm.diagrams import live_dot
            return live_dot(list(self.ring.extents.values()), self.manager.snapshot(), self.manager.peers.snapshot())
        if format != "text":
            raise ValueError(f"format must be 'text' or 'dot', got {format!r}")
        return _text_dump(self.ring, self.shares.deferred, self.manager.snapshot(), self.manager.peers.snapshot())


def _text_dump(ring: Ring, deferred: int, rooms: dict[int, dict[str, Any]], peers: dict[str, dict[str, Any]]) -> str:
    """`dump_state`'s text: the ring's extents, then the live rooms, then the peers."""
    arena = ring.main_arena
    lines = [f"ring: arena of {arena.capacity} B, {arena.in_use} B in {ring.live} extents, largest free "
             f"{arena.largest_free} B, {deferred} deferred"]
    for s in ring.extents.values():
        extra = f" room={s.room}" if s.room is not None else ""  # pragma: no mutate (a dump's wording)
        if s.writes_in_flight:
            extra += f" writes={s.writes_in_flight}"
        at = ",".join(f"@{o}+{n}" for o, n in s.pieces) if s.pieces else f"@{s.offset}+{s.nbytes}"  # pragma: no mutate
        lines.append(f"  extent {s.index} {at}: {s.state}{extra}")
    if ring.retired:
        lines.append("  retired")  # pragma: no mutate (a dump's wording)
    for rid, info in sorted(rooms.items()):
        lines.append(f"  room {rid}: {info['state']} receivers={len(info['receivers'])}/{info['n'] or '?'}"
                     + (f" extent={info['extent']}" if info["extent"] is not None else ""))
    for session, info in peers.items():
        extra = f" fails={info['fails']}" if info["fails"] else ""
        if info["reason"]:
            extra += f" ({info['reason']})"
        lines.append(f"  peer {session}: {info['state']} rooms={info['rooms']}{extra}")
    return "\n".join(lines)
