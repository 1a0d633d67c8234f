"""End to end across processes over a real transfer engine on 127.0.0.1: Mooncake's TransferEngine
over TCP, and (the tests parametrised by `transport`) NIXL over UCX's TCP transport.

The encode worker runs in the test process (MooncakeTransport or NixlTransport, ZMQ control plane,
a real tiny vision tower); two receiver processes run `epd_ring.executor.drivers.receiver`.
Every received byte is checked against the tower output by sha256.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import signal
import time
from typing import Any

import pytest
import torch

# Read when an engine starts. MC_TRANSFER_TIMEOUT bounds sync calls; submitted writes on TCP
# are bounded by the transport's own progress and status deadlines.
os.environ["MC_TRANSFER_TIMEOUT"] = "5"  # the minimum
os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = "5"
os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = "5"
# NIXL over UCX's TCP transport on loopback (a CPU machine has no RDMA device to pick).
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

if not os.environ.get("EPD_RING_REQUIRE_MOONCAKE"):
    pytest.importorskip("mooncake.engine")
    pytest.importorskip("zmq")

from helpers import TRANSPORTS, drive, figure, nixl_missing, reason_kind, wait_stopped

from epd_ring.executor import EncodeExecutor, EncodeItem, EncodeManager, MonotonicClock, ReasonKind
from epd_ring.executor.core.frames import WIRE_MAGIC, shard_rows
from epd_ring.executor.drivers.control import ZmqControlPlane, generate_keypair
from epd_ring.executor.drivers.mooncake import OWNER_PAGE, MooncakeTransport, owner_page
from epd_ring.executor.drivers.receiver import ReceiverProcess
from epd_ring.executor.tools.tower import TinyVisionModel, TinyVisionTower

STEP = 8  # pixels per merged token side (patch 4 x merge 2)


Receiver = ReceiverProcess


over_each_transport = pytest.mark.parametrize("transport", TRANSPORTS)
# CI's time: on NIXL by default only the faults whose engine behaviour differs from Mooncake's (a
# killed peer raises, a stopped one waits for ever, a blackholed add, the bytes); the others (the
# same handshake, heartbeat and withdraw code, another shape of the same bytes) with EPD_RING_NIXL_ALL=1.
NIXL_ALL = bool(os.environ.get("EPD_RING_NIXL_ALL"))
TRANSPORTS_FULL = ["mooncake", pytest.param("nixl", marks=pytest.mark.skipif(
    nixl_missing() or not NIXL_ALL, reason="nixl_cu12 missing, or EPD_RING_NIXL_ALL unset (CI's time)"))]
over_each_transport_with_all = pytest.mark.parametrize("transport", TRANSPORTS_FULL)


def rooms_with_b_stopped(enc, a, b, items: dict[int, EncodeItem]) -> tuple[dict, int, list]:
    """`items` (room -> item, in order): the first 4 rooms to receiver b, the rest to a, every frame
    registered. b's first room is written while b answers (Mooncake's first write to a peer opens its
    segment with a handshake inside the submit call, which a stopped peer would hold for 60 s), then b
    is stopped. Returns {room: (item, receiver)}, b's first room and b's other rooms, not yet run."""
    rooms = {}
    for k, (room, item) in enumerate(items.items()):
        rcv = b if k < 4 else a
        rcv.ask(cmd="expect", room=room, span=item.n_tokens, hidden=enc.hidden)
        rooms[room] = (item, rcv)
    for rcv in (a, b):
        rcv.ask(cmd="register", rooms=[r for r, (_, x) in rooms.items() if x is rcv])
    # The frames are in flight to the encode side: wait until it has heard from both (each
    # receiver's peer is made by its first frame), however loaded the machine.
    enc.poll_until(lambda: all(enc.manager.peers.get(x.session) is not None for x in (a, b)))
    to_b = [(r, item) for r, (item, x) in rooms.items() if x is b]
    enc.run(to_b[:1])
    enc.settle([to_b[0][0]])
    b.proc.send_signal(signal.SIGSTOP)
    wait_stopped(b.proc.pid)  # a signal is delivered when the kernel gets to it: not before the writes
    return rooms, to_b[0][0], to_b[1:]


class SkippingClock(MonotonicClock):
    """Wall time, plus whatever the test skipped: a deadline set far beyond the run fires when
    the test moves past it, after what must happen before it, however slow the machine is."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def now(self) -> float:
        return super().now() + self.skipped

    def skip(self, seconds: float) -> None:
        self.skipped += seconds


IMAGE_BYTES = 64 * 64 * 4  # the largest image: 64 merged tokens of 64 float32


class EncodeSide:
    def __init__(self, deep: bool, *, extents: int = 8, park_timeout: float = 30.0, quarantine_s: float = 2.0,
                 write_timeout: float = 60.0, announce_timeout: float = 120.0, arena_bytes: int | None = None,
                 peer_ring_share: float = 0.5, peer_probe_interval: float | None = None,
                 transport: str = "mooncake", **executor_kw: Any):
        # CURVE on, as in production: the encoder's keypair, and one prefill instance's
        # keypair shared by its receiver processes (its ranks).
        self.keypair = generate_keypair()
        self.instance = generate_keypair()
        self.control = ZmqControlPlane(keypair=self.keypair, allowed_keys=[self.instance[0]])
        self.engine = transport
        if transport == "nixl":
            from epd_ring.executor.drivers.nixl import NixlTransport

            # NIXL has no write timeout of its own: the transport's frees a stopped peer's extent. Past
            # what the heartbeat needs to find that peer (twice the connect deadline), as Mooncake's
            # TCP status timeout above is in practice (honoured 14-78 s late under load).
            self.transport: Any = NixlTransport(notifier=self.control.push_status, write_timeout_s=30.0)
        else:
            self.transport = MooncakeTransport(notifier=self.control.push_status)
        self.clock = clock = SkippingClock()
        # Early frames wait for their senders as long as the run takes on a loaded machine;
        # only the park deadline is short (the partial rooms fail at it). The deadlines are set
        # here, not on the manager afterwards: a write's deadline is armed from its construction.
        manager = EncodeManager(self.transport, clock, park_timeout=park_timeout, quarantine_s=quarantine_s,
                                write_timeout=write_timeout, announce_timeout=announce_timeout,
                                peer_probe_interval=peer_probe_interval)
        self.model = TinyVisionModel(TinyVisionTower(deepstack_layers=(0, 1) if deep else (), seed=7))
        self.hidden = self.model.hidden
        self.deep_width = self.model.hidden * self.model.num_deepstack_embeddings
        # Driven as a worker drives it: each call is followed by the pump's flush, `poll()` is its tick.
        # One arena for items of every size (images and videos), by default as large as `extents`
        # twice-the-largest images.
        arena_bytes = extents * IMAGE_BYTES * 2 if arena_bytes is None else arena_bytes
        self.executor = drive(EncodeExecutor(manager, self.model, "cpu", arena_bytes=arena_bytes,
                                             peer_ring_share=peer_ring_share, **executor_kw))
        self.manager = self.executor.manager
        self.control.attach(self.executor.pump)  # frames are read on every tick
        self.expected: dict[int, torch.Tensor] = {}

    def run(self, rooms: list[tuple[int, EncodeItem]], batch: int = 8, after_batch=None) -> None:
        for i in range(0, len(rooms), batch):
            chunk = rooms[i:i + batch]
            for room, _item in chunk:
                self.executor.register(f"r{room}", "127.0.0.1", 0, room, receiver=self.instance[0].decode())
            while self.executor.has_deferred():  # backpressure, as an encode loop does
                self.executor.poll()
                time.sleep(0.001)
            self.executor.execute([(f"r{room}", item) for room, item in chunk])
            for room, item in chunk:
                if item.encoded is not None:
                    deep = item.encoded_deepstack
                    self.expected[room] = torch.cat([item.encoded, deep], 1) if deep is not None else item.encoded
            self.executor.poll()
            if after_batch is not None:
                after_batch([room for room, _ in chunk])

    def receiver(self, keypair=None, allow: bool = True) -> ReceiverProcess:
        """A receiver process under the instance's key, or another (allow-listed or not)."""
        keypair = keypair or self.instance
        if allow:
            self.control.allow(keypair[0])
        return ReceiverProcess(self.control.endpoint, encoder_key=self.keypair[0], keypair=keypair,
                               transport=self.engine)

    def poll_until(self, condition, guard: float = 60.0) -> bool:
        """Poll until `condition()` holds; whether it did. `guard` only keeps a broken build from
        hanging: a loaded machine waits longer, and the caller asserts what it needed."""
        deadline = time.monotonic() + guard
        while not condition() and time.monotonic() < deadline:
            self.executor.poll()
            time.sleep(0.01)
        return condition()

    def settle(self, rooms, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.executor.poll()
            self.executor.reap_concluded_senders(set())
            if all(self.manager.room_status(r) in ("success", "failed") for r in rooms):
                return
            time.sleep(0.002)
        raise AssertionError({r: self.manager.room_status(r) for r in rooms
                              if self.manager.room_status(r) not in ("success", "failed")})

    def digest(self, room: int, row_start: int, rows: int) -> str:
        exp = self.expected[room][row_start:row_start + rows]
        h = self.hidden
        d = hashlib.sha256(exp[:, :h].contiguous().numpy().tobytes())
        if self.deep_width:
            d.update(exp[:, h:].contiguous().numpy().tobytes())
        return d.hexdigest()

    def close(self) -> None:
        self.control.close()
        self.transport.close()


def image(rng: random.Random, room: int, tower: TinyVisionTower) -> EncodeItem:
    h, w = STEP * rng.randint(1, 8), STEP * rng.randint(1, 8)
    pixels = torch.randn(3, h, w, generator=torch.Generator().manual_seed(room))
    return EncodeItem("image", tower.tokens_for(h, w), pixel_values=pixels)


def video(rng: random.Random, room: int, tower: TinyVisionTower) -> EncodeItem:
    """Frames of one size, each encoded as an image: up to 4x the largest image's bytes."""
    h, w, frames = STEP * rng.randint(4, 8), STEP * rng.randint(4, 8), rng.randint(2, 4)
    g = torch.Generator().manual_seed(room)
    return EncodeItem("video", frames * tower.tokens_for(h, w), pixel_values=[torch.randn(3, h, w, generator=g)
                                                                               for _ in range(frames)])


@pytest.mark.parametrize("deep", [True, False], ids=["deepstack", "plain"])
@over_each_transport
def test_images_across_processes_with_fanout_and_late_registration(deep, transport):
    if transport == "nixl" and deep and not NIXL_ALL:
        pytest.skip("the plain run covers NIXL's bytes; deepstack too with EPD_RING_NIXL_ALL=1 (CI's time)")
    rng = random.Random(1 if deep else 2)
    # The partial rooms fail at the park deadline, which the test moves past once every other
    # room is done: a late registration never races it, however slow the machine is.
    park_timeout = 300.0
    enc = EncodeSide(deep, transport=transport, park_timeout=park_timeout)
    a, b = enc.receiver(), enc.receiver()
    try:
        plans = {}
        for k in range(100):
            room = (10_000 if deep else 20_000) + k
            kind = rng.choice(["a", "a", "b", "identity", "shard"])
            partial = k % 25 == 7  # only one of two receivers ever registers: fails at the park deadline
            late = rng.random() < 0.3
            # mixed sizes in one arena: images of 1-64 tokens, and every fifth item a video of 32-256
            item = (video if k % 5 == 3 else image)(rng, room, enc.model.tower)
            members = {"a": [(a, 0)], "b": [(b, 0)], "identity": [(a, 0), (b, 0)], "shard": [(a, 0), (b, 1)]}[kind]
            if partial:
                kind, members = "partial", [(a, 0), (b, 1)]
            n = len(members)
            for rcv, rank in members:
                rcv.ask(cmd="expect", room=room, span=item.n_tokens, hidden=enc.hidden, deep=enc.deep_width, n=n,
                        rank=rank, shard=kind in ("shard", "partial"))
            plans[room] = (item, kind, members, late)
        early = lambda rcv: [r for r, (_, kind, m, late) in plans.items()  # noqa: E731
                             if not late and any(x is rcv and (kind != "partial" or rank == 0) for x, rank in m)]
        for rcv in (a, b):
            rcv.ask(cmd="register", rooms=early(rcv))

        def register_late(batch_rooms):  # their chunks are parked by now
            for rcv in (a, b):
                rcv.ask(cmd="register", rooms=[r for r in batch_rooms if plans[r][3] and any(
                    x is rcv and (plans[r][1] != "partial" or rank == 0) for x, rank in plans[r][2])])

        enc.run([(room, item) for room, (item, *_) in plans.items()], after_batch=register_late)
        partial = [r for r, p in plans.items() if p[1] == "partial"]
        enc.settle([r for r in plans if r not in partial])
        assert all(enc.manager.room_status(r) not in ("success", "failed") for r in partial)  # still parked
        enc.clock.skip(park_timeout)
        enc.settle(list(plans))
        # A failed room's `released` notice follows its outcome: wait for it too, not only the outcome.
        reports = {rcv: rcv.ask(cmd="report", wait_rooms=[r for r, p in plans.items() if any(x is rcv for x, _ in p[2])
                                                          and not (p[1] == "partial" and rcv is b)],
                                wait_released=[r for r in partial if rcv is a], timeout=20)
                   for rcv in (a, b)}
        for room, (item, kind, members, _) in plans.items():
            status = enc.manager.room_status(room)
            assert status == ("failed" if kind == "partial" else "success"), (room, kind, status,
                                                                            enc.manager.failure_reason(room))
            n = len(members)
            for rcv, rank in members:
                if kind == "partial" and rcv is b:
                    continue
                told = reports[rcv]["status"].get(str(room))
                assert told == [status], (room, kind, told)
                # Failed: released once no write can land; Success releases by itself.
                notices = reports[rcv]["notices"].get(str(room))
                assert notices == ([status, "released"] if status == "failed" else [status]), (room, notices)
                if status == "success":
                    start, rows = shard_rows(item.n_tokens, rank, n) if kind == "shard" else (0, item.n_tokens)
                    assert reports[rcv]["digest"][str(room)] == enc.digest(room, start, rows), (room, kind)
        assert enc.executor.ring.live == 0
        for rcv in (a, b):
            assert reports[rcv]["protocol_errors"] == []
            # Only Success regions stay open (until consumed), and the ones never registered.
            unsent = {str(r) for r, p in plans.items() if p[1] == "partial" and rcv is b}
            left = {k for k, v in reports[rcv]["open_regions"].items() if v != "written"}
            assert left == unsent, reports[rcv]["open_regions"]
    finally:
        a.close()
        b.close()
        enc.close()


@over_each_transport
def test_an_item_spanning_two_runs_of_the_arena_reaches_both_receivers_whole(transport):
    """Deepstack rows too: each receiver's one write carries a buffer per piece of either half."""
    quarter = 16 * 64 * 4  # a 32 x 32 image: 16 merged tokens of 64 float32
    enc = EncodeSide(True, transport=transport, arena_bytes=4 * quarter, max_pieces=4, parked_ring_share=1.0)
    a, b = enc.receiver(), enc.receiver()
    key = enc.instance[0].decode()
    try:
        g = torch.Generator().manual_seed(5)
        # four quarter-arena items whose receivers never register (parked), then the first and third
        # fail: the free bytes are two quarters apart
        for room in range(40_001, 40_005):
            enc.executor.register(f"r{room}", "127.0.0.1", 0, room, receiver=key)
            enc.executor.execute([(f"r{room}", EncodeItem("image", 16, pixel_values=torch.randn(3, 32, 32,
                                                                                                  generator=g)))])
        enc.executor.fail_rooms(["r40001", "r40003"], "gone")
        assert enc.executor.ring.main_arena.largest_free == quarter
        room, item = 40_005, EncodeItem("image", 32, pixel_values=torch.randn(3, 64, 32, generator=g))
        for rcv in (a, b):  # both receivers take every row: each write crosses from one piece to the next
            rcv.ask(cmd="expect", room=room, span=32, hidden=enc.hidden, deep=enc.deep_width, n=2, rank=0,
                    shard=False)
            rcv.ask(cmd="register", rooms=[room])
        enc.executor.register(f"r{room}", "127.0.0.1", 0, room, receiver=key)
        enc.executor.execute([(f"r{room}", item)])
        enc.expected[room] = torch.cat([item.encoded, item.encoded_deepstack], 1)
        assert enc.manager.stats["spanned"] == 1
        enc.settle([room])
        assert enc.manager.room_status(room) == "success", enc.manager.failure_reason(room)
        for rcv in (a, b):
            report = rcv.ask(cmd="report", wait_rooms=[room], timeout=20)
            assert report["digest"][str(room)] == enc.digest(room, 0, 32)
            assert report["protocol_errors"] == []
        enc.executor.fail_rooms(["r40002", "r40004"], "done")
        assert enc.poll_until(lambda: enc.executor.ring.live == 0)
    finally:
        a.close()
        b.close()
        enc.close()


@over_each_transport
def test_killed_receiver_fails_its_rooms_and_others_succeed(transport):
    rng = random.Random(3)
    enc = EncodeSide(False, transport=transport, quarantine_s=0.5)
    a, b = enc.receiver(), enc.receiver()
    try:
        rooms = {}
        for k in range(40):
            room = 30_000 + k
            item = image(rng, room, enc.model.tower)
            rcv = a if k % 2 else b
            rcv.ask(cmd="expect", room=room, span=item.n_tokens, hidden=enc.hidden)
            rooms[room] = (item, rcv)
        for rcv in (a, b):
            rcv.ask(cmd="register", rooms=[r for r, (_, x) in rooms.items() if x is rcv])
        first = list(rooms.items())[:20]
        second = list(rooms.items())[20:]
        enc.run([(r, item) for r, (item, _) in first])
        enc.settle([r for r, _ in first])
        b.proc.kill()
        b.proc.wait()
        enc.run([(r, item) for r, (item, _) in second])
        enc.settle(list(rooms))
        for r, (item, rcv) in rooms.items():
            status = enc.manager.room_status(r)
            if rcv is a or (r, (item, rcv)) in first:
                assert status == "success", (r, status, enc.manager.failure_reason(r))
            else:
                assert status == "failed", (r, status)
        report = a.ask(cmd="report", wait_rooms=[r for r, (_, x) in rooms.items() if x is a], timeout=10)
        for r, (item, rcv) in rooms.items():
            if rcv is a:
                assert report["digest"][str(r)] == enc.digest(r, 0, item.n_tokens)
        assert enc.transport.stats["failed"] + enc.transport.stats["timed_out"] >= 1
        assert enc.transport.probe(b.session) is False  # dead peer, told apart at once
        assert enc.transport.probe(a.session) is True
        assert enc.poll_until(lambda: enc.executor.ring.live == 0)  # the quarantines end (0.5 s)
    finally:
        a.close()
        b.close()
        enc.close()


def test_malformed_and_hostile_frames_disturb_nothing_else():
    import zmq

    rng = random.Random(4)
    enc = EncodeSide(False)
    a = enc.receiver()
    attacker = enc.receiver(keypair=generate_keypair())  # allow-listed, but another identity
    outsider = enc.receiver(keypair=generate_keypair(), allow=False)  # not on the allow-list
    try:
        good = {}
        for k in range(10):
            room = 40_000 + k
            item = image(rng, room, enc.model.tower)
            a.ask(cmd="expect", room=room, span=item.n_tokens, hidden=enc.hidden)
            good[room] = item
        junk = [
            [b"hello"],  # wrong part count
            [b"not-magic"] + [b"1"] * 13,  # bad magic
            [WIRE_MAGIC, b"12x", b"s", b"\0" * 8, b"\0" * 8] + [b"1"] * 9,  # non-digit room
            [WIRE_MAGIC, b"5", b"s", b"\0" * 9, b"\0" * 8] + [b"1"] * 9,  # 9-byte pointer
            [WIRE_MAGIC, b"5", b"s\nforged", b"\0" * 8, b"\0" * 8] + [b"1"] * 9,  # a log line in a session
        ]
        for parts in junk:
            a.ask(cmd="raw", parts_hex=[p.hex() for p in parts])
        a.ask(cmd="register", rooms=list(good))
        # a's frames (and its session claim) are in before the attacker's
        assert enc.poll_until(lambda: enc.control.stats["frames"] >= len(good))
        first, second, third = list(good)[:3]
        # Another allow-listed identity: N = 0 for a's room (used to fail it), a full seat in it,
        # and a frame naming a's session (used to make the encoder overwrite a's rows).
        for room, session, n in ((first, attacker.session, 0), (second, attacker.session, 1), (third, a.session, 1)):
            bad = [WIRE_MAGIC, str(room).encode(), session.encode(), (4096).to_bytes(8, "little"),
                   b"\0" * 8, b"1", b"0", b"1", b"64", b"torch.float32", b"0", str(n).encode(),
                   attacker.status_endpoint.encode(), b"0"]
            attacker.ask(cmd="raw", parts_hex=[p.hex() for p in bad])
        # Not on the allow-list at all: refused at the handshake, nothing of it is read.
        attacker_like = [WIRE_MAGIC, str(first).encode(), outsider.session.encode(), (4096).to_bytes(8, "little"),
                         b"\0" * 8, b"1", b"0", b"1", b"64", b"torch.float32", b"0", b"0", b"", b"0"]
        outsider.ask(cmd="raw", parts_hex=[p.hex() for p in attacker_like])
        # The attacker's frames are read before a's rooms run (its socket's handshake may lag a's
        # on a loaded machine): they must find the rooms live.
        enc.poll_until(lambda: enc.manager.stats["frames_foreign"] >= 2)
        assert all(enc.manager.room_status(r) not in ("success", "failed") for r in good)
        # A status forged to a's status socket, by a key that is not the encoder's, and in the clear.
        ctx = zmq.Context()
        forger = generate_keypair()
        curve = ctx.socket(zmq.PUSH)
        curve.curve_secretkey, curve.curve_publickey = forger[1], forger[0]
        curve.curve_serverkey = enc.instance[0]
        plain = ctx.socket(zmq.PUSH)
        for sock in (curve, plain):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(a.status_endpoint)
            sock.send_multipart([b"%d" % first, b"failed", a.session.encode(), b"forged"], zmq.NOBLOCK)
        enc.run([(r, item) for r, item in good.items()])
        enc.settle(list(good))
        for sock in (curve, plain):
            sock.close(0)
        ctx.term()
        assert all(enc.manager.room_status(r) == "success" for r in good), {
            r: enc.manager.failure_reason(r) for r in good}
        assert enc.control.stats["frames_refused"] >= len(junk)
        assert enc.control.stats["zap_denied"] >= 1
        assert enc.manager.stats["frames_foreign"] >= 2
        report = a.ask(cmd="report", wait_rooms=list(good), timeout=10)
        for r, item in good.items():
            assert report["digest"][str(r)] == enc.digest(r, 0, item.n_tokens)
            assert report["status"][str(r)] == ["success"], r  # the forged statuses never arrived
        answer = attacker.ask(cmd="report", wait_rooms=[first, second, third], timeout=10)
        told = answer["status"]
        assert told.get(str(first)) == ["failed"] and told.get(str(second)) == ["failed"]
        # Naming a's session in a's room: told failed like any frame for another's room, at its own
        # endpoint under its own key (a's status socket would refuse that key). The notice names
        # a's session, so the attacker's receiver files it as not its own.
        assert [third, "failed"] in answer["foreign_notices"]
    finally:
        a.close()
        attacker.close()
        outsider.close()
        enc.close()


@over_each_transport
def test_stopped_receiver_times_out_quarantines_and_its_late_landing_corrupts_nothing(transport):
    rng = random.Random(5)
    # Every deadline is far beyond the run and fires when the test moves the clock past it, after
    # what must happen first, however slow the machine: the write deadline of the stopped
    # receiver's rooms, then the quarantine of their extents (one skip each). The announce and park
    # deadlines are further still, so neither skip fires them.
    quarantine_s, write_timeout = 300.0, 3000.0
    tower = TinyVisionTower(seed=7)
    items = {50_000 + k: image(rng, 50_000 + k, tower) for k in range(13)}
    extent = [64 * -(-it.n_tokens * 64 * 4 // 64) for it in items.values()]
    # The arena holds the three stopped rooms' extents (they will be quarantined) and room for the
    # largest of the others: no more, so the others queue for the quarantines' bytes. The write
    # deadline's path, alone: no heartbeat (it would find the stopped peer first, see
    # test_a_stopped_receiver_with_work_pending_is_found_by_the_heartbeat) and no per-peer share (the
    # stopped receiver's three rooms take most of the arena on purpose).
    arena = sum(extent[1:4]) + max(extent[4:])
    enc = EncodeSide(False, transport=transport, quarantine_s=quarantine_s, write_timeout=write_timeout,
                     arena_bytes=arena,
                     announce_timeout=100 * quarantine_s, park_timeout=100 * quarantine_s, peer_ring_share=1.0,
                     peer_probe_interval=100 * write_timeout)
    a, b = enc.receiver(), enc.receiver()
    try:
        rooms, warm, stopped = rooms_with_b_stopped(enc, a, b, items)
        assert enc.manager.room_status(warm) == "success"
        enc.run(stopped)
        # a's peer is up before the clock moves: its contact's deadline is on the same clock, and
        # only the stopped receiver's rooms may meet a deadline here.
        assert enc.poll_until(lambda: getattr(enc.manager.peers.get(a.session), "state", None) == "up")
        # Our own write deadline fails them, whenever the engine gives up (14-78 s seen under load).
        enc.clock.skip(write_timeout)
        enc.settle([r for r, _ in stopped], timeout=40)
        assert {r: enc.manager.failure_reason(r).kind for r, _ in stopped} == {
            r: ReasonKind.WRITE_DEADLINE for r, _ in stopped}
        # Each extent stays `sending` until the engine reports its write, then serves a full quarantine.
        enc.poll_until(lambda: not enc.executor.ring.counts()["sending"], guard=150)
        held = enc.executor.ring.counts()
        assert held["quarantined"] == len(stopped), held  # not free: those writes may still land
        b.proc.send_signal(signal.SIGCONT)
        others = [(r, item) for r, (item, x) in rooms.items() if x is a]

        deferred = enc.executor.stats["deferred"]

        def quarantine_ends(batch):
            if enc.clock.skipped == write_timeout:  # once: the first batch waits for an extent
                # The quarantined bytes are not reused: some of the batch waited (whether any still
                # waits after the batch's poll depends on the writes' pace), the quarantines hold.
                assert enc.executor.stats["deferred"] > deferred, (
                    enc.executor.ring.counts(), {r: enc.manager.room_status(r) for r in batch},
                    {r: repr(enc.manager.failure_reason(r)) for r in batch if enc.manager.room_status(r) == "failed"},
                    {s: p.state for s, p in enc.manager.peers.by_session.items()})
                assert enc.executor.ring.counts()["quarantined"] == len(stopped)
                enc.clock.skip(quarantine_s)

        enc.run(others, after_batch=quarantine_ends)
        enc.settle([r for r, _ in others], timeout=30)
        report_a = a.ask(cmd="report", wait_rooms=[r for r, _ in others], timeout=10)
        for r, item in others:
            assert enc.manager.room_status(r) == "success", (r, repr(enc.manager.failure_reason(r)))
            assert report_a["digest"][str(r)] == enc.digest(r, 0, item.n_tokens)
        enc.poll_until(lambda: enc.executor.ring.live == 0)  # the quarantines end: the release notices go out
        deadline = time.monotonic() + 60  # only keeps a broken build from hanging
        while True:
            report_b = b.ask(cmd="report", wait_rooms=[r for r, _ in stopped], timeout=1)
            if all(len(report_b["notices"].get(str(r), [])) >= 2 for r, _ in stopped) or time.monotonic() > deadline:
                break
        for r, item in stopped:
            assert report_b["status"][str(r)] == ["failed"]
            # Released only after the quarantine of the extent its write read: by now.
            assert report_b["notices"][str(r)] == ["failed", "released"], report_b["notices"][str(r)]
            untouched = hashlib.sha256(bytes(item.n_tokens * enc.hidden * 4)).hexdigest()
            assert report_b["digest"][str(r)] in (untouched, enc.digest(r, 0, item.n_tokens)), r
        assert report_b["protocol_errors"] == [] and report_b["open_regions"] == {"50000": "written"}
    finally:
        a.close()
        b.close()
        enc.close()


@over_each_transport_with_all
def test_a_stopped_receiver_with_work_pending_is_found_by_the_heartbeat(transport):
    """SIGSTOP: the peer accepts TCP and answers nothing; its writes would wait out the engine's timeouts.
    The probe of a busy peer goes unanswered, so the peer goes down at its connect deadline (within twice
    the connect deadline of the stop) and fails its rooms; the other receiver's rooms succeed."""
    rng = random.Random(11)
    enc = EncodeSide(False, transport=transport, extents=8, quarantine_s=300.0, write_timeout=3000.0,
                     announce_timeout=3000.0,
                     park_timeout=3000.0)
    connect = enc.manager.peers.connect_timeout
    a, b = enc.receiver(), enc.receiver()
    try:
        rooms, _, stopped = rooms_with_b_stopped(enc, a, b, {70_000 + k: image(rng, 70_000 + k, enc.model.tower)
                                                          for k in range(12)})
        enc.run(stopped[:1])  # one write in flight to b: work pending, and it never reports
        stopped_at = time.monotonic()
        peer = enc.manager.peers.get(b.session)
        enc.poll_until(lambda: peer.state != "up")
        found = time.monotonic() - stopped_at
        assert peer.state == "down", peer.state
        assert reason_kind(enc.manager, stopped[0][0]) is ReasonKind.PEER_DOWN
        print(f"stopped receiver ({transport}) found by the heartbeat {found:.1f} s after the stop "
              f"(connect deadline {connect} s; the bound is {2 * connect} s, here on a real clock)")
        others = [(r, item) for r, (item, x) in rooms.items() if x is a]
        enc.run(others)
        enc.settle([r for r, _ in others])
        report_a = a.ask(cmd="report", wait_rooms=[r for r, _ in others], timeout=10)
        for r, item in others:
            assert enc.manager.room_status(r) == "success", (r, repr(enc.manager.failure_reason(r)))
            assert report_a["digest"][str(r)] == enc.digest(r, 0, item.n_tokens)
    finally:
        b.proc.send_signal(signal.SIGCONT)
        a.close()
        b.close()
        enc.close()


def test_a_read_that_gave_up_is_answered_late_into_a_retired_page_never_handed_out_again():
    """The engine's synchronous read returns -1 after MC_TRANSFER_TIMEOUT but is not cancelled: a
    receiver stopped during the heartbeat's read of its ownership page and resumed after the engine
    gave up still sends the page, and the engine writes it where it was told. Before, that was a
    buffer of the heartbeat's own, freed by then: the encoder crashed (SIGSEGV) on slow links."""
    enc = EncodeSide(False)
    b = enc.receiver()
    t, key = enc.transport, enc.instance[0].decode()
    try:
        assert t._contact(b.session, key) == (True, "", key)  # first contact: segment open, page read
        b.proc.send_signal(signal.SIGSTOP)
        wait_stopped(b.proc.pid)
        # The read a heartbeat or first contact makes (a stopped peer's probe fails at once, so the
        # read is made directly, as over a slow link whose probe still answers); it gives up in 5 s.
        owner, rc = t._read_owner(t._names.get(b.session, b.session), key)
        assert owner is None and rc != 0
        (page,) = t.pages.retired(key)
        assert t.stats["read_pages_retired"] == 1
        b.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 120  # only keeps a broken build from hanging
        while ctypes.string_at(page, OWNER_PAGE) != owner_page(key):
            assert time.monotonic() < deadline, "the late reply never landed"
            time.sleep(0.01)
        # The page the late reply landed in stays out of use: later reads take other pages.
        taken = [t.pages.take(key) for _ in range(2 * t.pages.pages)]
        assert page not in taken
        for p in taken:
            t.pages.give_back(p, True, key)
        assert t._contact(b.session, key, probe=True) == (True, "", None)  # resumed: the heartbeat reads again
    finally:
        b.proc.send_signal(signal.SIGCONT)
        b.close()
        enc.close()


@over_each_transport_with_all
def test_withdrawn_region_is_acknowledged_then_carved_again(transport):
    enc = EncodeSide(False, transport=transport, extents=2)
    a = enc.receiver()
    try:
        room = 60_000
        first = a.ask(cmd="expect", room=room, span=4, hidden=enc.hidden)["dst_ptr"]
        a.ask(cmd="register", rooms=[room])
        again = a.ask(cmd="expect", room=room + 1, span=4, hidden=enc.hidden)["dst_ptr"]
        assert again != first  # offered, not released: its memory is not handed out
        a.ask(cmd="withdraw", rooms=[room])
        enc.settle([room], timeout=10)
        assert enc.manager.room_status(room) == "failed" and reason_kind(enc.manager, room) is ReasonKind.WITHDRAWN
        deadline = time.monotonic() + 60  # only keeps a broken build from hanging
        while True:
            report = a.ask(cmd="report", wait_rooms=[room], timeout=1)
            if len(report["notices"].get(str(room), [])) >= 2 or time.monotonic() > deadline:
                break
        assert report["notices"][str(room)] == ["failed", "withdrawn"]
        assert report["protocol_errors"] == [] and str(room) not in report["open_regions"]
        assert a.ask(cmd="expect", room=room + 2, span=4, hidden=enc.hidden)["dst_ptr"] == first  # reused
        assert enc.control.stats["withdraws"] == 1
    finally:
        a.close()
        enc.close()


def test_demo_over_mooncake_passes_its_own_checks(capsys):
    from epd_ring.executor.tools.cli import main

    assert main(["demo", "--transport", "mooncake", "--rooms", "80", "--seed", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "extents leaked: 0" in out and "differing from the tower output: 0" in out and "RESULT: ok" in out


def test_mooncake_bench_prints_controller_and_raw_figures(capsys):
    from epd_ring.executor.tools.bench_mooncake import run

    figures = run(sizes=(1 << 20,), extents=2, seconds=0.05)
    out = capsys.readouterr().out
    assert "ctrl GB/s" in out and "raw GB/s" in out and figures[1 << 20][0] > 0


class HostilePeer:
    """A receiver's handshake port played by an attacker, on loopback.

    - `trickle`: answers the engine's probe, then sends its descriptor one byte every 10 s (each
      byte well inside the engine's 60 s per read: the engine would wait for hours);
    - `silent`: accepts and never answers (probe-then-silence: the kernel accepts for it);
    - `blackhole`: its listen queue is full, so a connection attempt gets no answer at all."""

    def __init__(self, kind: str):
        import socket
        import threading

        self.kind, self.stop, self.held = kind, threading.Event(), []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0 if kind == "blackhole" else 64)
        self.session = f"127.0.0.1:{self.sock.getsockname()[1]}"
        if kind == "blackhole":
            filler = socket.create_connection(self.sock.getsockname())  # the queue's one place, never accepted
            self.held.append(filler)
        else:
            threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            if self.kind == "trickle":
                threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn):
        import json

        from epd_ring.executor.drivers.handshake import HandshakeError, frame, read_frame
        try:
            kind, _ = read_frame(conn, time.monotonic() + 60)
            reply = frame(kind, json.dumps({"name": self.session, "buffers": [{"addr": 4096, "length": 64}]})
                          .encode())
            if kind != 1:  # the probe is answered at once: only the segment's descriptor is trickled
                conn.sendall(reply)
                return
            for b in reply:
                if self.stop.wait(10.0):
                    return
                conn.sendall(bytes([b]))
        except (OSError, HandshakeError):
            pass

    def close(self):
        self.stop.set()
        self.sock.close()
        for c in self.held:
            c.close()


class SilentPeer(HostilePeer):
    """A 'peer' that accepts TCP and never answers: the engine's handshake would wait 60 s on it."""

    def __init__(self):
        super().__init__("silent")


def timed(worst: list, name: str, fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    took = time.perf_counter() - t
    if took > worst[0]:
        worst[0] = took
        worst[1:] = [name]
    return out


class TowerClock:
    """The time an executor spends in its tower, so a figure for `execute` can leave it out: the
    tower is the engine's own compute, which no peer can prolong; the rest is ours."""

    def __init__(self, executor: EncodeExecutor):
        self.spent = 0.0
        features = executor._feature_fn

        def feature_fn(modality):
            fn = features(modality)

            def run(items):
                t = time.perf_counter()
                try:
                    return fn(items)
                finally:
                    self.spent += time.perf_counter() - t
            return run

        executor._feature_fn = feature_fn

    def execute(self, ours: list, executor: EncodeExecutor, batch) -> int:
        """`executor.execute(batch)`, keeping in `ours` (as `timed` does) its slowest call less its tower time."""
        t, spent = time.perf_counter(), self.spent
        out = executor.execute(batch)
        took = time.perf_counter() - t - (self.spent - spent)
        if took > ours[0]:
            ours[0] = took
            ours[1:] = ["execute less the tower"]
        return out


@over_each_transport_with_all
def test_a_silent_peer_holds_nobody_and_its_rooms_fail_at_the_connect_deadline(transport):
    from epd_ring.executor import ReceiverFrame

    rng = random.Random(6)
    enc = EncodeSide(False, transport=transport, extents=8)
    # Far beyond the run (and within the tombstones' TTL): the test moves the clock past it once
    # the healthy rooms are done. Waiting on the peer would show as an order of events, not a speed.
    connect_timeout = 300.0
    enc.manager.peers.connect_timeout = connect_timeout
    enc.manager.announce_timeout = 10 * connect_timeout  # its rooms never get a sender: not this deadline
    # The contact's own deadline too (a real clock's): the peer must still be contacted once the
    # healthy rooms are done, however long a loaded machine takes for them.
    enc.transport.handshake_timeout_s = connect_timeout
    a = enc.receiver()
    silent = SilentPeer()
    try:
        rooms = {}
        for k in range(101):
            room = 60_000 + k
            item = image(rng, room, enc.model.tower)
            a.ask(cmd="expect", room=room, span=item.n_tokens, hidden=enc.hidden)
            rooms[room] = item
        a.ask(cmd="register", rooms=list(rooms))
        warm = 60_000  # first contact with a, and the tower's first run, before anything is timed
        enc.run([(warm, rooms.pop(warm))])
        enc.settle([warm])
        # Frames naming the silent peer, as a hostile or broken receiver would send them.
        stuck = [69_000 + k for k in range(3)]
        t0 = time.monotonic()
        for room in stuck:
            enc.manager.register_receiver(ReceiverFrame(
                room=room, session=silent.session, dst_ptr=4096, dst_deep_ptr=0, n_tokens=4, row_start=0,
                span=4, hidden=enc.hidden, dtype="torch.float32", has_deepstack=False, n_receivers=1))
        assert enc.manager.peers.get(silent.session).state == "connecting"
        worst = [0.0, ""]  # the slowest loop call, for the log
        items = list(rooms.items())
        for i in range(0, len(items), 8):
            batch = items[i:i + 8]
            for room, _ in batch:
                enc.executor.register(f"r{room}", "127.0.0.1", 0, room)
            while enc.executor.has_deferred():
                timed(worst, "poll", enc.executor.poll)
                time.sleep(0.001)
            timed(worst, "execute", enc.executor.execute, [(f"r{room}", item) for room, item in batch])
            for room, item in batch:
                enc.expected[room] = item.encoded
            timed(worst, "poll", enc.executor.poll)
        submitted_at = time.monotonic() - t0
        enc.settle(list(rooms))
        done_at = time.monotonic() - t0
        # The order of events: every healthy room is done while the silent peer is still being
        # contacted, so the loop never waited on it (a blocking first contact would have ended
        # in the engine's handshake failing, and the peer would be down by now).
        for room in rooms:
            assert enc.manager.room_status(room) == "success", (room, enc.manager.failure_reason(room))
        assert enc.manager.peers.get(silent.session).state == "connecting"
        assert all(enc.manager.room_status(r) not in ("success", "failed") for r in stuck)
        # The first poll that reads the clock past the connect deadline fails its rooms.
        timed(worst, "poll", enc.executor.poll)
        assert all(enc.manager.room_status(r) not in ("success", "failed") for r in stuck)
        enc.clock.skip(connect_timeout)
        timed(worst, "poll", enc.executor.poll)
        for room in stuck:
            assert enc.manager.room_status(room) == "failed"
            assert reason_kind(enc.manager, room) is ReasonKind.PEER_DOWN
        report = a.ask(cmd="report", wait_rooms=list(rooms), timeout=20)
        for room, item in rooms.items():
            assert enc.manager.room_status(room) == "success", (room, enc.manager.failure_reason(room))
            assert report["digest"][str(room)] == enc.digest(room, 0, item.n_tokens)
        # The bound on one loop call is 50 ms; it depends on the machine, so it is shown.
        print(f"\nsilent peer ({transport}): {len(rooms)} rooms to a healthy receiver done {done_at:.2f} s after "
              f"the frames (the loop had submitted them all at {submitted_at:.2f} s) while the peer was still "
              f"contacted; slowest poll()/execute() {worst[0] * 1e3:.1f} ms ({worst[1]}; the issue's bound is 50 ms; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    finally:
        a.close()
        silent.close()
        enc.close()


@over_each_transport_with_all
def test_sigkilled_receiver_fails_its_queued_rooms_together_and_others_succeed(transport):
    rng = random.Random(7)
    # Far beyond the run: the queued rooms can fail only by their peer going down, all together,
    # never one by one at a write deadline (which would have shown only as a speed before).
    write_timeout = 600.0
    # An arena of three of the largest images holds about as many of these mixed ones in flight as
    # eight extents did: the rest of b's rooms are still waiting for bytes when it dies.
    enc = EncodeSide(False, transport=transport, quarantine_s=0.5, write_timeout=write_timeout,
                     arena_bytes=3 * IMAGE_BYTES)
    a, b = enc.receiver(), enc.receiver()
    try:
        rooms = {}
        for k in range(44):
            room = 70_000 + k
            item = image(rng, room, enc.model.tower)
            rcv = b if k < 2 or k >= 24 else a
            rcv.ask(cmd="expect", room=room, span=item.n_tokens, hidden=enc.hidden)
            rooms[room] = (item, rcv)
        for rcv in (a, b):
            rcv.ask(cmd="register", rooms=[r for r, (_, x) in rooms.items() if x is rcv])
        warm = [(r, rooms[r][0]) for r in (70_000, 70_001)]  # b is up and has taken writes
        enc.run(warm)
        enc.settle([r for r, _ in warm])
        assert all(enc.manager.room_status(r) == "success" for r, _ in warm)
        queued = [r for r, (_, x) in rooms.items() if x is b and r not in (70_000, 70_001)]
        assert len(queued) == 20
        deadline = time.monotonic() + 60  # only keeps a broken build from hanging
        # Their frames are in (each room announced by b, its sender not yet registered), so the
        # 20 rooms are queued for b when it dies. (This waited for "ready", which these rooms
        # never reach, so it was a 5 s sleep that a loaded machine could outrun.)
        while not all(enc.manager.room_status(r) == "announced" for r in queued) and time.monotonic() < deadline:
            enc.executor.poll()
            time.sleep(0.01)
        assert all(enc.manager.room_status(r) == "announced" for r in queued)
        b.proc.kill()
        b.proc.wait()
        t0 = time.monotonic()
        rest = [(r, item) for r, (item, _) in rooms.items() if r not in (70_000, 70_001)]
        enc.run(rest)
        enc.settle(queued, timeout=120)  # only keeps a broken build from hanging
        took = time.monotonic() - t0
        others = [r for r, (_, x) in rooms.items() if x is a]
        enc.settle(others)
        assert all(enc.manager.room_status(r) == "failed" for r in queued)
        assert enc.manager.peers.get(b.session).state == "down"
        # Each failed with b: its write to b failed (those in flight when it died), or b went down
        # and failed the rest together; none waited for the write deadline.
        kinds = [reason_kind(enc.manager, r) for r in queued]
        assert set(kinds) <= {ReasonKind.PEER_DOWN, ReasonKind.WRITE_FAILED, ReasonKind.WRITE_TIMED_OUT}, kinds
        assert ReasonKind.PEER_DOWN in kinds, kinds
        report = a.ask(cmd="report", wait_rooms=others, timeout=10)
        for r in others:
            assert enc.manager.room_status(r) == "success", (r, enc.manager.failure_reason(r))
            assert report["digest"][str(r)] == enc.digest(r, 0, rooms[r][0].n_tokens)
        print(f"\nSIGKILLed receiver ({transport}): its {len(queued)} queued rooms all failed {took:.2f} s after "
              f"the kill (the write deadline is {write_timeout} s); {len(others)} other rooms succeeded")
    finally:
        a.close()
        b.close()
        enc.close()


@pytest.mark.parametrize("attack", ["trickle", "silent", "blackhole"])
@over_each_transport
def test_no_peer_holds_an_honest_receivers_writes_nor_a_new_receivers_first_contact(attack, request, transport):
    """Three attacker sessions of one kind keep being named in frames while an honest receiver's rooms
    flow and a new honest receiver arrives. Before, the engine did the handshake itself under the
    mutex every submit takes: a trickled descriptor held every write for hours, and the new
    receiver's first contact queued behind it. Now the handshake is ours, with a total deadline, and
    the engine opens segments from our relay: the honest rooms and the new receiver's first room
    succeed, and the attackers' rooms fail at their connect deadline (5 s, the default)."""
    if transport == "nixl" and attack != "blackhole" and not NIXL_ALL:
        pytest.skip("NIXL's contact fetches metadata with Mooncake's handshake code: the blackhole covers it; "
                    "the others with EPD_RING_NIXL_ALL=1 (CI's time)")
    from epd_ring.executor import ReceiverFrame

    rng = random.Random(12)
    enc = EncodeSide(False, transport=transport, extents=8)
    enc.manager.announce_timeout = 600.0  # the attackers' rooms get no sender: not this deadline
    a = enc.receiver()
    attackers = [HostilePeer(attack) for _ in range(3)]
    c = None
    try:
        arrived: dict[int, float] = {}  # room -> when its request arrived (the latency is stamped from it)
        latency: dict[int, float] = {}

        def run(rooms: dict[int, EncodeItem], rcv) -> None:
            for room, item in rooms.items():
                rcv.ask(cmd="expect", room=room, span=item.n_tokens, hidden=enc.hidden)
            rcv.ask(cmd="register", rooms=list(rooms))
            for room, item in rooms.items():
                arrived[room] = time.monotonic()
                enc.run([(room, item)])

        def watch() -> None:
            enc.executor.poll()
            enc.executor.reap_concluded_senders(set())
            for room, t in arrived.items():
                if room not in latency and enc.manager.room_status(room) == "success":
                    latency[room] = time.monotonic() - t

        warm = {80_000: image(rng, 80_000, enc.model.tower)}  # a's first contact, before the attack
        run(warm, a)
        enc.settle(list(warm))
        c = enc.receiver()  # started now (a process takes seconds to start); it sends nothing yet
        honest: dict[int, EncodeItem] = {}
        stuck: list[int] = []
        started = time.monotonic()
        for k in range(24):  # about 12 s of traffic: past two handshake deadlines of each attacker
            for j, peer in enumerate(attackers):
                room = 89_000 + 10 * k + j
                stuck.append(room)
                enc.manager.register_receiver(ReceiverFrame(
                    room=room, session=peer.session, dst_ptr=4096, dst_deep_ptr=0, n_tokens=4, row_start=0,
                    span=4, hidden=enc.hidden, dtype="torch.float32", has_deepstack=False, n_receivers=1))
            batch = {80_001 + k: image(rng, 80_001 + k, enc.model.tower)}
            honest.update(batch)
            run(batch, a)
            if k == 4:  # a new honest receiver's first frame: its first contact is made during the attack
                first = {81_000: image(rng, 81_000, enc.model.tower)}
                honest.update(first)
                run(first, c)
            pause = time.monotonic() + 0.5
            while time.monotonic() < pause:
                watch()
                time.sleep(0.005)
        enc.settle(list(honest), timeout=120)
        watch()
        for room in honest:
            assert enc.manager.room_status(room) == "success", (room, repr(enc.manager.failure_reason(room)))
        enc.settle(stuck, timeout=120)
        assert {reason_kind(enc.manager, r) for r in stuck} == {ReasonKind.PEER_DOWN}
        if transport == "mooncake":
            assert enc.transport.relay.expired == 0 and enc.transport.stats["opens_stalled"] == 0
        for rcv, rooms in ((a, [r for r in honest if r != 81_000]), (c, [81_000])):
            report = rcv.ask(cmd="report", wait_rooms=rooms, timeout=20)
            for room in rooms:
                assert report["digest"][str(room)] == enc.digest(room, 0, honest[room].n_tokens)
        worst = max(latency[r] for r in honest if r != 81_000)  # the warm room (first contact) is not timed
        figure(request, f"hostile handshake ({attack}, {transport})",
               f"honest receiver's worst room latency {worst * 1e3:.0f} ms over {len(honest) - 1} "
               f"rooms (stamped from the request's arrival); a new receiver's first room "
               f"{latency[81_000] * 1e3:.0f} ms (its connect deadline {enc.manager.peers.connect_timeout} s); "
               f"{len(stuck)} attacker rooms failed peer_down; {time.monotonic() - started:.1f} s in all, "
               f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    finally:
        a.close()
        if c is not None:
            c.close()
        for peer in attackers:
            peer.close()
        enc.close()
