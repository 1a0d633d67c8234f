"""The control plane's wire format and its never-blocking status pushes; Mooncake start-up errors."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

if not os.environ.get("EPD_RING_REQUIRE_MOONCAKE"):
    pytest.importorskip("zmq")

import zmq

sys.path.insert(0, str(Path(__file__).parent))
from helpers import drive

from epd_ring.executor import EncodeManager, FakeClock, FrameError, LoopbackTransport, ReceiverFrame
from epd_ring.executor.core.frames import WIRE_MAGIC, frame_from_parts, frame_to_parts
from epd_ring.executor.drivers.control import ZmqControlPlane

FRAME = ReceiverFrame(7, "127.0.0.1:1234", 0xFFFF_FFFF_FFFF_F000, 0x1000, 5, 2, 9, 64, "torch.bfloat16", True, 2,
                      "tcp://127.0.0.1:5555", 3)


def test_wire_round_trip_keeps_full_64_bit_pointers():
    assert frame_from_parts(frame_to_parts(FRAME)) == FRAME


@pytest.mark.parametrize("index, value, needle", [
    (0, b"other/1", "magic"),
    (1, b"-7", "room"),
    (1, b"7.0", "room"),
    (3, b"\0" * 7, "dst_ptr"),
    (5, b"", "n_tokens"),
    (5, b"9" * 30, "n_tokens"),
    (9, b"\xff\xfe", "dtype"),
    (10, b"yes", "has_deepstack"),
    (12, b"x" * 300, "status_endpoint"),
    (13, b"-1", "deep_levels"),
])
def test_each_malformed_part_is_named(index, value, needle):
    parts = frame_to_parts(FRAME)
    parts[index] = value
    with pytest.raises(FrameError, match=needle):
        frame_from_parts(parts)
    with pytest.raises(FrameError, match="parts"):
        frame_from_parts(parts[:-1])


def test_frames_are_polled_without_blocking_and_bad_ones_refused_alone():
    clock = FakeClock()
    manager = drive(EncodeManager(LoopbackTransport(clock), clock))  # its poll() is the pump's tick
    control = ZmqControlPlane(manager.pump, insecure=True)
    try:
        assert control.endpoint.startswith("tcp://127.0.0.1:")
        assert manager.poll() == 0  # nothing queued: returns at once
        push = control.ctx.socket(zmq.PUSH)
        push.connect(control.endpoint)
        push.send_multipart([b"junk"])
        push.send_multipart(frame_to_parts(FRAME._replace(room=8, n_receivers=1, n_tokens=9, row_start=0)))
        push.send_multipart([WIRE_MAGIC] + [b"1"] * 13)
        n = 0
        for _ in range(200):
            n += manager.poll()
            if n >= 3:
                break
            zmq.select([control.pull], [], [], 0.05)
        assert control.stats["frames_refused"] == 2 and control.stats["frames"] == 1
        assert manager.room_status(8) == "announced"
        push.close(linger=0)
    finally:
        control.close()


@pytest.mark.parametrize("parts, needle", [
    ([b"epd-ring/withdraw/1", b"x7", b"s", b""], "room"),
    ([b"epd-ring/withdraw/1", b"7", b"", b""], "session"),
    ([b"epd-ring/withdraw/1", b"7", b"s" * 300, b""], "session"),
    ([b"epd-ring/withdraw/1", b"7", b"s"], "not a withdraw"),
])
def test_each_malformed_withdraw_is_named(parts, needle):
    from epd_ring.executor.core.regions import WithdrawError, withdraw_from_parts, withdraw_to_parts

    assert withdraw_from_parts(withdraw_to_parts(7, "s", "tcp://10.0.0.1:1"))[:3] == (7, "s", "tcp://10.0.0.1:1")
    with pytest.raises(WithdrawError, match=needle):
        withdraw_from_parts(parts)


def test_a_withdraw_on_the_frame_socket_fails_its_room_and_a_bad_one_is_refused_alone():
    from epd_ring.executor.core.regions import WITHDRAW_MAGIC, withdraw_to_parts

    clock = FakeClock()
    transport = LoopbackTransport(clock)
    manager = drive(EncodeManager(transport, clock))  # its poll() is the pump's tick
    control = ZmqControlPlane(manager.pump, insecure=True)
    try:
        f = FRAME._replace(room=8, n_receivers=1, n_tokens=9, row_start=0)
        transport.add_receiver(f.session)
        push = control.ctx.socket(zmq.PUSH)
        push.connect(control.endpoint)
        push.send_multipart(frame_to_parts(f))
        push.send_multipart([WITHDRAW_MAGIC, b"-8", b"s", b""])
        push.send_multipart(withdraw_to_parts(8, f.session, f.status_endpoint))
        n = 0
        for _ in range(200):
            n += manager.poll()
            if n >= 3:
                break
            zmq.select([control.pull], [], [], 0.05)
        assert control.stats["withdraws_refused"] == 1 and control.stats["withdraws"] == 1
        assert manager.room_status(8) == "failed" and "withdrew" in manager.failure_reason(8)
        rcv = transport.receivers[f.session]
        assert rcv.statuses(8) == ["failed"] and rcv.releases(8) == ["withdrawn"]
        push.close(linger=0)
    finally:
        control.close()


def test_status_pushes_to_a_dead_receiver_drop_instead_of_blocking():
    control = ZmqControlPlane(push_hwm=4, insecure=True)
    try:
        dead = FRAME._replace(status_endpoint="tcp://127.0.0.1:9")  # nothing listens there
        for room in range(200):
            control.push_status(dead, room, "failed", "test")
        assert control.stats["status_dropped"] > 0
        assert control.stats["status_sent"] + control.stats["status_dropped"] == 200
        control.push_status(FRAME._replace(status_endpoint=""), 1, "failed")
        assert control.stats["status_without_endpoint"] == 1
    finally:
        control.close()


def test_mooncake_registration_failure_is_raised_at_start_up():
    pytest.importorskip("mooncake.engine") if not os.environ.get("EPD_RING_REQUIRE_MOONCAKE") else None
    import torch

    from epd_ring.executor import TransportError
    from epd_ring.executor.drivers.mooncake import MooncakeTransport

    t = MooncakeTransport(expose_ring=True)
    buf = torch.zeros(4096, dtype=torch.uint8)
    t.register_memory([(buf.data_ptr(), 4096)], owner=buf)
    with pytest.raises(TransportError, match="overlaps a registered region"):
        t.register_memory([(buf.data_ptr() + 1024, 1024)])
    assert t.session.startswith("127.0.0.1:")


def test_a_peer_of_the_engine_cannot_read_or_overwrite_the_ring_over_tcp():
    # Before: any process reaching the engine read a parked embedding out of the ring
    # (get_first_buffer_address, then a read) and overwrote it; the room still reported success.
    pytest.importorskip("mooncake.engine") if not os.environ.get("EPD_RING_REQUIRE_MOONCAKE") else None
    import torch

    from epd_ring.executor.drivers.mooncake import MooncakeTransport, load_engine

    t = MooncakeTransport()
    assert not t.expose_ring
    ring = torch.full((4096,), 7, dtype=torch.uint8)
    t.register_memory([(ring.data_ptr(), 4096)], owner=ring)
    attacker, _ = load_engine()
    loot = torch.zeros(4096, dtype=torch.uint8)
    assert attacker.register_memory(loot.data_ptr(), 4096) == 0
    assert attacker.transfer_sync_read(t.session, loot.data_ptr(), ring.data_ptr(), 4096) != 0
    assert attacker.transfer_sync_write(t.session, loot.data_ptr(), ring.data_ptr(), 4096) != 0
    assert int(loot.sum()) == 0 and bool((ring == 7).all())


def test_notices_name_their_region_to_a_receiver_that_reads_it_and_not_to_an_older_one():
    control = ZmqControlPlane(insecure=True)
    pull = control.ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        at = FRAME._replace(status_endpoint=f"tcp://127.0.0.1:{port}")
        control.push_status(at._replace(region_notices=True), 7, "released")
        control.push_status(at, 7, "released")  # a /2 frame: an older receiver
        assert pull.poll(5000)
        named = pull.recv_multipart()
        assert pull.poll(5000)
        plain = pull.recv_multipart()
        assert named[:3] == [b"7", b"released", FRAME.session.encode()] and int(named[4]) == FRAME.dst_ptr
        room, status, _session, _reason = plain  # what an older receiver unpacks
        assert (room, status) == (b"7", b"released")
    finally:
        pull.close(linger=0)
        control.close()


def test_the_reference_receiver_applies_a_notice_only_to_the_region_it_names():
    pytest.importorskip("mooncake.engine") if not os.environ.get("EPD_RING_REQUIRE_MOONCAKE") else None
    from epd_ring.executor.drivers.receiver import ReferenceReceiver

    r = ReferenceReceiver("tcp://127.0.0.1:9", capacity=1 << 16, insecure=True)
    push = r.ctx.socket(zmq.PUSH)
    push.connect(r.status_endpoint)
    try:
        frame = r.expect(5, span=4, hidden=8)
        assert frame.region_notices and frame_from_parts(frame_to_parts(frame)).region_notices

        def tell(*parts: bytes) -> None:
            push.send_multipart([b"5", *parts[:1], r.session.encode(), b"", *parts[1:]])
            assert r.poll(5000) == 1

        tell(b"failed", b"%d" % (frame.dst_ptr + 4096))  # another region of room 5: not this one
        assert r.regions[5].state == "offered" and r.foreign_notices == [(5, "failed", frame.dst_ptr + 4096)]
        tell(b"failed", b"%d" % frame.dst_ptr)
        tell(b"released")  # an encoder that does not name regions: the room's one region
        assert 5 not in r.regions and r.notices[5] == ["failed", "released"] and r.protocol_errors == []
        # A predecessor's notices (a receiver restarted on the same status address): a region
        # not held, or another session, is foreign; an unnamed one for no region is an error.
        tell(b"released", b"%d" % frame.dst_ptr)
        push.send_multipart([b"6", b"failed", b"10.0.0.9:1", b""])
        assert r.poll(5000) == 1
        assert r.foreign_notices[1:] == [(5, "released", frame.dst_ptr), (6, "failed", None)]
        assert r.protocol_errors == []
        tell(b"released")
        assert len(r.protocol_errors) == 1
    finally:
        push.close(linger=0)
        r.close()
