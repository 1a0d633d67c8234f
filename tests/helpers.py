"""Shared rigs for the unit suites: a clock, loopback, manager, executor and receivers (`make_rig`),
a manager alone on a ring (`ManagerRig`), an observer that records its calls, and the one place
tests read a room's failure reason as text (`reason_text`)."""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from epd_ring.executor import (
    Chunk,
    EncodeExecutor,
    EncodeItem,
    EncodeManager,
    FakeClock,
    LoopbackTransport,
    Observer,
    Pump,
    ReasonKind,
    ReceiverFrame,
    Ring,
    shard_rows,
)

# The calls into the core after which a driver does what they decided (`Pump.flush`).
ENTRY_POINTS = frozenset((
    "register", "execute", "send_item", "fail_rooms", "reap_concluded_senders", "serve_deferred", "finish_copies",
    "drain_deferred",  # the seed's name for serve_deferred
    "begin_close", "bind_sender", "unbind_sender", "register_receiver", "withdraw", "submit_chunk", "fail_room",
    "writes_reported", "contacts_reported"))
# The peer table's own steps (tests of the table drive it directly): each may decide a contact.
PEER_ENTRY_POINTS = frozenset(("contact", "report", "expired", "write_ok", "write_failed"))
# Parts of a driven core reached as attributes, driven too: attribute -> its entry points.
DRIVEN_PARTS = {"manager": ENTRY_POINTS, "peers": PEER_ENTRY_POINTS}


class Driven:
    """A core object (manager or executor) driven as an encode loop drives it: each entry point is
    followed by the pump's `flush()`, `poll()` is the pump's `tick()` and `close()` the pump's.

    So one call in a test shows its whole effect (writes submitted, receivers told), as in a
    worker; every other attribute is the core's own. Its `manager` and `peers` are driven the same
    way (a peer table's `contact` answered at once by the transport is answered on return)."""

    __slots__ = ("_core", "_pump", "_entries")

    def __init__(self, core, pump: Pump, entries: frozenset[str] = ENTRY_POINTS):
        object.__setattr__(self, "_core", core)
        object.__setattr__(self, "_pump", pump)
        object.__setattr__(self, "_entries", entries)

    def __getattr__(self, name: str):
        core_entries = self._entries is ENTRY_POINTS
        if core_entries and name == "poll":
            return self._pump.tick
        if core_entries and name == "close":
            return self._pump.close
        value = getattr(self._core, name)
        if core_entries and name in DRIVEN_PARTS:
            return Driven(value, self._pump, DRIVEN_PARTS[name])
        if name in self._entries:
            flush = self._pump.flush

            def call(*args, **kw):
                out = value(*args, **kw)
                flush()
                return out
            return call
        return value

    def __setattr__(self, name: str, value) -> None:
        setattr(self._core, name, value)

    @property
    def core(self):
        return self._core

    @property
    def pump(self) -> Pump:
        return self._pump


def drive(core, transport=None) -> Driven:
    """`core` (an executor or a manager) with a pump on `transport` (default: the manager's)."""
    return Driven(core, Pump(core, transport))


def reason_text(manager: EncodeManager, room: int) -> str | None:
    """Why `room` failed, as its detail text (None unless it failed). Tests compare it only with
    text that came from elsewhere (the engine's own reason, a notice), never with our wording."""
    return manager.failure_reason(room)


def reason_kind(manager: EncodeManager, room: int) -> ReasonKind | None:
    """The kind of why `room` failed (None unless it failed): what tests assert."""
    reason = manager.failure_reason(room)
    return None if reason is None else reason.kind


def log_lines(caplog, logger: str = "epd_ring.manager") -> list[str]:
    """The log lines `logger` wrote, as text."""
    return [r.getMessage() for r in caplog.records if r.name == logger]


def counters(stats, *keys) -> dict:
    """The named counters of a stats table, zero for those never counted."""
    return {k: stats[k] for k in keys}


class Calls(Observer):
    """An observer that records the hooks named (every hook when none is named) as (hook, *args)."""

    def __init__(self, *hooks: str):
        self.hooks = set(hooks)
        self.calls: list[tuple] = []


def _recording(hook: str):
    def record(self, *args):
        if not self.hooks or hook in self.hooks:
            self.calls.append((hook, *args))
    return record


for _hook in [n for n, v in vars(Observer).items() if callable(v) and not n.startswith("_")]:
    setattr(Calls, _hook, _recording(_hook))


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

    def open_room(self, room: int, session: str | None = None, rows: int = 2, *, rid: str | None = None,
                  receiver=None, **frame) -> str:
        """Register room's sender (request `r<room>`) and one receiver's frame (session `p<room>`); the request id."""
        rid = rid or f"r{room}"
        self.executor.register(rid, "prefill-host", 8998, room, receiver=receiver)
        self.manager.register_receiver(self.frame(room, session or f"p{room}", rows, **frame))
        return rid

    def held_room(self, room: int, rows: int = 2, *, rid: str | None = None) -> str:
        """One room whose write the transport holds: `open_room`, then its item staged and written."""
        rid = self.open_room(room, rows=rows, rid=rid)
        self.transport.inject("hold", session=f"p{room}")
        self.executor.execute([(rid, self.item(rows, room))])
        return rid

    def send(self, room: int, n_tokens: int = 2, **register) -> str:
        """Register room's sender (request `req-<room>`) and run its item through the tower."""
        rid = f"req-{room}"
        self.executor.register(rid, "prefill-host", 8998, room, **register)
        self.executor.execute([(rid, self.item(n_tokens, room))])
        return rid

    def told(self, session: str, room: int) -> list[tuple[str, str]]:
        """The (status, reason) notices receiver `session` got for `room`, in order."""
        return [(n.status, n.reason) for n in self.receiver(session).notices if n.room == room]

    def extent_of(self, room: int):
        return next(s for s in self.executor.ring.extents.values() if s.room == room)

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


def make_rig(*, extents: int = 4, extent_bytes: int = 4096, hidden: int = 8, n_deep: int = 0,
             park_timeout: float = 10.0, quarantine_s: float = 5.0, write_timeout: float = 30.0,
             max_deferred: int | None = None, arena_bytes: int | None = None, parked_ring_share: float = 0.5,
             identity_ring_share: float | None = None, transport_cls: type[LoopbackTransport] = LoopbackTransport,
             peer_ring_share: float = 0.5, max_pieces: int | None = None, **manager_kw) -> Rig:
    """A rig whose arena holds `extents` items of `extent_bytes` (each capped at that), or is `arena_bytes` uncapped."""
    clock = FakeClock()
    transport = transport_cls(clock)
    manager = EncodeManager(transport, clock, park_timeout=park_timeout, quarantine_s=quarantine_s,
                            write_timeout=write_timeout, **manager_kw)
    tower = TableTower(hidden=hidden, n_deep=n_deep)
    sizes = (dict(arena_bytes=arena_bytes) if arena_bytes is not None
             else dict(ring_slots=extents, ring_bytes=extent_bytes))
    executor = drive(EncodeExecutor(manager, tower, "cpu", max_deferred=max_deferred,
                                    parked_ring_share=parked_ring_share, identity_ring_share=identity_ring_share,
                                    peer_ring_share=peer_ring_share, **sizes,
                                    **({} if max_pieces is None else {"max_pieces": max_pieces})))
    return Rig(clock, transport, executor.manager, executor, tower)


def loopback_setup(at: float = 0.0, record: bool = False):
    """A loopback transport at time `at` with one 64-byte source region and receiver "r" on a zeroed buffer."""
    clock = FakeClock()
    clock.advance(at)
    t = LoopbackTransport(clock, record=record)
    src = torch.arange(16, dtype=torch.float32)
    t.register_memory([(src.data_ptr(), 64)], owner=src)
    rcv = t.add_receiver("r")
    dst = torch.zeros(16)
    rcv.register(dst)
    return clock, t, src, dst, rcv


def managed(**kw):
    """A bare manager on a loopback transport and fake clock: (clock, transport, manager)."""
    clock = FakeClock()
    t = LoopbackTransport(clock)
    return clock, t, drive(EncodeManager(t, clock, **kw))


HIDDEN = 8
DTYPE = "torch.float32"


class AddressedLoopback(LoopbackTransport):
    """A loopback that also keeps what each notice was addressed to (the frame, or a withdraw's reply)."""

    def __init__(self, clock):
        super().__init__(clock)
        self.told: list[tuple] = []

    def notify(self, frame, room, status, reason=""):
        self.told.append((frame, room, status, reason))
        super().notify(frame, room, status, reason)


class ManagerRig:
    """A manager with no executor on a loopback transport and fake clock, and a 4-item ring to stage
    chunks in by hand: for what the manager alone decides (rooms, frames, tombstones, withdraws)."""

    def __init__(self, **kw):
        self.clock = FakeClock()
        self.t = AddressedLoopback(self.clock)
        kw = {"park_timeout": 10.0, "quarantine_s": 5.0, "write_timeout": 30.0, **kw}
        self.m = drive(EncodeManager(self.t, self.clock, **kw))
        self.ring = Ring(self.t, 4 * 4096, actions=self.m.actions)  # coupled as an executor couples it
        self.keep: list[torch.Tensor] = []

    def frame(self, room: int, session: str, rows: int = 2, n: int = 1, identity: str = "", **over) -> ReceiverFrame:
        r = self.t.receivers.get(session) or self.t.add_receiver(session)
        buf = torch.zeros(max(rows, 1), HIDDEN)
        r.register(buf)
        self.keep.append(buf)
        fields = dict(room=room, session=session, dst_ptr=buf.data_ptr(), dst_deep_ptr=0, n_tokens=rows,
                      row_start=0, span=rows, hidden=HIDDEN, dtype=DTYPE, has_deepstack=False, n_receivers=n,
                      identity=identity)
        fields.update(over)
        return ReceiverFrame(**fields)

    def chunk(self, rows: int = 2) -> Chunk:
        extent = self.ring.lease(rows * HIDDEN * 4)
        self.ring.fire(extent, "copied")
        return Chunk(extent, rows, HIDDEN, DTYPE, HIDDEN * 4, self.ring.main_ptr(extent))

    def notices(self, session: str, room: int | None = None) -> list[tuple]:
        return [(n.room, n.status, n.reason) for n in self.t.receivers[session].notices
                if room is None or n.room == room]

    def announced_failed(self, room: int, session: str, reason: str = "gone", identity: str = "") -> None:
        """A room only a receiver announced, failed before any sender came (nobody pins it)."""
        assert self.m.register_receiver(self.frame(room, session, identity=identity))
        assert self.m.fail_room(room, reason)

    def succeed(self, room: int, session: str) -> None:
        assert self.m.bind_sender(room) == "registered"
        assert self.m.register_receiver(self.frame(room, session))
        assert self.m.submit_chunk(room, self.chunk())
        self.m.poll()
        assert self.m.room_status(room) == "success"


def run(rig, *pairs):
    """Execute (request, item) pairs on a rig and let a few ticks pass."""
    rig.executor.execute(list(pairs))
    for _ in range(4):
        rig.executor.poll()


def untouched(rig, room, session):
    """No byte of the receiver's region (NaN-filled by the rig) was written."""
    main, deep, _, _ = rig.buffers[(room, session)]
    return torch.isnan(main).all() and (deep is None or torch.isnan(deep).all())


def wait_stopped(pid: int, guard: float = 10.0) -> None:
    """Until the kernel shows the process stopped (state T), so nothing it does races the test."""
    deadline = time.monotonic() + guard
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)


def figure(request, name: str, value: str) -> None:
    """A figure a test measured: printed, and carried on its report to the run's summary (conftest.py)."""
    line = f"[figure] {name}: {value}"
    print(line)
    request.node.user_properties.append(("figure", line))


def reachable_states(cfg) -> list[tuple]:
    """Every canonical state the model reaches from its start, breadth first (small bounds only)."""
    from epd_ring.models.explore import canonical
    from epd_ring.models.spec import Spec

    spec = Spec(cfg)
    start = canonical(spec.initial())
    seen, frontier = {start}, [start]
    while frontier:
        nxt = []
        for state in frontier:
            for step in spec.successors(state):
                c = canonical(step.state)
                if c not in seen:
                    seen.add(c)
                    nxt.append(c)
        frontier = nxt
    return list(seen)


def nixl_missing() -> bool:
    """NIXL is not installed here, and nothing requires it (CI sets EPD_RING_REQUIRE_NIXL)."""
    if os.environ.get("EPD_RING_REQUIRE_NIXL"):
        return False
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return True
    return False


# The engines a transport's suite runs over: NIXL where it is installed (CI requires it).
TRANSPORTS = ["mooncake", pytest.param("nixl", marks=pytest.mark.skipif(nixl_missing(), reason="nixl_cu12 missing"))]
