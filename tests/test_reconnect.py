"""The reference receiver across a lost connection and an encoder's restart (issue 29), on one host.

What a receiver sends on a connection that dies (its encoder's heartbeat ended it during a cut)
is lost: once it connects again it sends every frame of a region still `offered` and every
withdraw not yet acknowledged again. An encoder that comes back as a new incarnation (the same
address and keys, a new process) held none of the rooms the receiver offered to the one before:
those fail at the receiver, once, and every region comes back. The multi-host suite does both
over real cuts and a kill -9 (tests/test_multihost.py).
"""

from __future__ import annotations

import os

import pytest

if not os.environ.get("EPD_RING_REQUIRE_MOONCAKE"):
    pytest.importorskip("mooncake.engine")
    pytest.importorskip("zmq")

from helpers import drive
from test_hostile_edges import cut_the_one_connection

from epd_ring.executor import EncodeManager, FakeClock, LoopbackTransport, ReasonKind
from epd_ring.executor.drivers.control import ZmqControlPlane, generate_keypair
from epd_ring.executor.drivers.receiver import ReferenceReceiver

CAPACITY = 1 << 16


class _Cut:
    """A frame socket whose sends go nowhere: what a receiver writes into a connection that dies."""

    def __init__(self) -> None:
        self.lost: list[list[bytes]] = []

    def send_multipart(self, parts, *args, **kw) -> None:
        self.lost.append(parts)


@pytest.fixture
def receiver(side):
    """(the encoder's side, a receiver of its, the receiver's clock): its notices reach the receiver."""
    s = side()
    s.manager.pump.transport.notify = s.control.push_status  # as the Mooncake transport's notifier does
    keys = generate_keypair()
    s.control.allow(keys[0])
    now = [0.0]
    r = ReferenceReceiver(s.control.endpoint, capacity=CAPACITY, keypair=keys, encoder_key=s.keys[0],
                          reclaim_s=5.0, give_up_s=60.0, clock=lambda: now[0])
    r.keys = keys
    try:
        s.pump(lambda: r.incarnation == s.control.incarnation, timeout=30, poll=lambda: both(s.manager.poll, r))
        yield s, r, now
    finally:
        r.close()


def both(tick, r) -> int:
    """A turn of the encode loop (its control plane read, its notices sent) and of the receiver."""
    return tick() + r.poll(5)


def test_frames_and_withdraws_lost_with_a_connection_go_out_again_once_it_is_back(receiver):
    # Before: they were lost for good (the frame's room never heard of this receiver, the withdrawn
    # region was never acknowledged), so neither region ever came back.
    s, r, _ = receiver
    m = s.manager
    r.expect(1, span=4, hidden=8)
    r.expect(2, span=4, hidden=8)
    r.expect(3, span=4, hidden=8)
    r.register(1)
    r.register(3)
    s.pump(lambda: m.room_status(1) == m.room_status(3) == "announced", timeout=30,
           poll=lambda: both(s.manager.poll, r))
    push, r.push = r.push, _Cut()
    r.withdraw(1)
    r.register(2)
    assert len(r.push.lost) == 2
    r.push = push
    assert cut_the_one_connection(s.control.guard)  # the encoder ends the connection (its heartbeat, in a cut)
    s.pump(lambda: 1 not in r.regions and m.room_status(2) == "announced" and m.stats["duplicate_frames"],
           timeout=30, poll=lambda: both(s.manager.poll, r))  # room 3's frame goes out after room 2's
    assert m.failure_reason(1).kind == ReasonKind.WITHDRAWN
    assert r.notices[1] == ["failed", "withdrawn"]
    # Room 3's frame went out again too: the encoder had it already, and takes it once.
    assert m.stats["duplicate_frames"] == 1 and m.room_status(3) == "announced"
    for room in (2, 3):
        m.fail_room(room, "the sender never came")
    s.pump(lambda: not r.regions, timeout=30, poll=lambda: both(s.manager.poll, r))
    assert r.status == {1: ["failed"], 2: ["failed"], 3: ["failed"]}
    assert r.protocol_errors == [] and r._extents.free == [(0, CAPACITY)]


def test_an_outcome_told_again_for_a_frame_sent_again_is_not_a_second_outcome(receiver):
    # Its outcome was on its way when the frame went out again, and the encoder answers the frame
    # from the room's tombstone (`failed` again while a write may still land, its release to come).
    # Before: a protocol error at the receiver.
    s, r, _ = receiver
    r.expect(4, span=4, hidden=8)
    frame = r.frames[4]._replace(identity=r.keys[0].decode())
    r.regions[4].resent = True
    for status in ("failed", "failed", "released"):
        s.control.push_status(frame, 4, status)
    s.pump(lambda: not r.regions, timeout=30, poll=lambda: r.poll(5))
    assert r.status[4] == ["failed"] and r.repeated_notices == [(4, "failed")]
    assert r.protocol_errors == []


def test_a_new_incarnation_fails_the_rooms_of_the_one_before_and_every_region_comes_back(receiver):
    # Before: nothing told the receiver. Its `offered` regions came back only if it withdrew them,
    # and the `failed` one (its release was the dead encoder's to send) never did.
    s, r, now = receiver
    old = s.control
    r.expect(5, span=4, hidden=8)  # offered to the old incarnation
    r.expect(6, span=4, hidden=8)  # told failed by it; its release never comes
    r.expect(8, span=4, hidden=8)  # succeeded: its bytes are the room's, untouched by the restart
    for room in (5, 6, 8):
        r.register(room)
    s.pump(lambda: all(s.manager.room_status(x) == "announced" for x in (5, 6, 8)), timeout=30,
           poll=lambda: both(s.manager.poll, r))
    frame6 = r.frames[6]._replace(identity=r.keys[0].decode())
    old.push_status(frame6, 6, "failed")
    old.push_status(r.frames[8]._replace(identity=r.keys[0].decode()), 8, "success")
    s.pump(lambda: r.regions[6].state == "failed" and r.regions[8].state == "written", timeout=30,
           poll=lambda: both(s.manager.poll, r))
    r.expect(7, span=4, hidden=8)
    endpoint = old.endpoint
    old.close()  # the encoder dies: a new process binds the same address with the same keys
    s.pump(lambda: r._lost_since is not None, timeout=30, poll=lambda: r.poll(5))
    r.withdraw(7)  # withdrawn while nobody listens: queued, it reaches whoever comes next, and is acked
    clock = FakeClock()
    manager = drive(EncodeManager(LoopbackTransport(clock), clock))
    new = ZmqControlPlane(manager.pump, bind=endpoint, keypair=s.keys, allowed_keys=[r.keys[0]])
    try:
        manager.pump.transport.notify = new.push_status
        assert new.incarnation != old.incarnation
        s.pump(lambda: r.incarnation == new.incarnation and r.regions[5].acked and 7 not in r.regions,
               timeout=30, poll=lambda: both(manager.poll, r))
        # Room 5 failed here, once; the new encoder was asked to forget it and did (it never held it).
        # Room 7, withdrawn while nobody listened, is failed here too when the new incarnation's
        # answer comes before the acknowledgement of its withdraw (the order is the machine's pace):
        # either way it is told at most once.
        status = dict(r.status)
        seven = status.pop(7, None)
        assert status == {5: ["failed"], 6: ["failed"], 8: ["success"]} and seven in (None, ["failed"])
        assert r.concluded_here - {7} == {5} and r.notices[5] == ["withdrawn"] and r.repeated_notices == []
        # Held for the dead process's writes still on the wire, then back.
        assert r.regions[5].state == "withdrawing" and r.regions[6].state == "failed"
        now[0] += 5.0
        r.poll()
        assert set(r.regions) == {8} and r.protocol_errors == []
        r.consume(8)
        assert r._extents.free == [(0, CAPACITY)]
    finally:
        new.close()


def test_a_receiver_that_loses_its_encoder_past_its_bound_fails_its_rooms_and_takes_its_regions_back(receiver):
    s, r, now = receiver
    _lose_the_encoder(s, r, 9)
    now[0] += 59.0
    r.poll()
    assert r.regions[9].state == "offered" and r.status == {}  # within its bound: kept
    now[0] += 1.0
    r.poll()
    assert r.status == {9: ["failed"]} and r.regions[9].reclaim_at is not None
    now[0] += 5.0
    r.poll()
    assert r.regions == {} and r._extents.free == [(0, CAPACITY)] and r.protocol_errors == []


class _Connections:
    """An `Inbound` whose open connections the test sets: what the receiver's engine holds."""

    def __init__(self, *open_now) -> None:
        self.now = set(open_now)

    def open(self) -> frozenset:
        return frozenset(self.now)

    def exclude(self, port: int) -> None:
        pass

    def probe(self, connections) -> None:
        self.probed = set(connections)


def _lose_the_encoder(s, r, room: int) -> None:
    r.expect(room, span=4, hidden=8)
    r.register(room)
    s.pump(lambda: s.manager.room_status(room) == "announced", timeout=30, poll=lambda: both(s.manager.poll, r))
    s.control.close()  # the encoder is gone (closed again, harmlessly, at teardown)
    s.pump(lambda: r._lost_since is not None, timeout=30, poll=lambda: r.poll(5))
    # Its listening socket closes in zmq's own thread: on a loaded machine the receiver may reconnect in
    # that window and lose that connection again later, after the test's own connections were made. These
    # tests are about what the first loss leaves, so the receiver hears of no connection after it.
    r.push.disable_monitor()
    while r._handshakes.poll(0):
        r._handshakes.recv_multipart()


def test_an_orphaned_region_waits_for_the_connections_its_dead_encoder_had_into_the_engine(receiver):
    # Stop 39's CI: a kill -9 with writes on a cut link; the dead process's kernel delivered them after
    # the heal, into a region reclaimed at `reclaim_s` and reused by the new incarnation's room.
    s, r, now = receiver
    dead, new = ("10.0.0.2:3A98", "10.0.0.1:C350", 11), ("10.0.0.2:3A98", "10.0.0.1:C351", 12)
    conns = _Connections(dead)
    r.reclaim.inbound = conns
    _lose_the_encoder(s, r, 9)
    conns.now.add(new)  # made after we lost the encoder: not the dead one's
    now[0] += 60.0
    r.poll()
    assert r.status == {9: ["failed"]}
    now[0] += 5.0 + 60.0  # past `reclaim_s`: the dead connection is still open, so are its writes
    r.poll()
    assert set(r.regions) == {9} and r.reclaim.waited == {9} and conns.probed == {dead}
    conns.now.discard(dead)
    now[0] += 1.0
    r.poll()
    assert r.regions == {} and r._extents.free == [(0, CAPACITY)] and r.reclaim.overdue == 0
    assert r.protocol_errors == []


def test_an_orphaned_region_waits_for_a_dead_connection_at_most_reclaim_max_s(receiver):
    # A connection whose peer's kernel gave up stays open here with nothing more to deliver.
    s, r, now = receiver
    r.reclaim.inbound = _Connections(("10.0.0.2:3A98", "10.0.0.1:C350", 11))
    _lose_the_encoder(s, r, 9)
    now[0] += 60.0
    r.poll()
    held_until = r.regions[9].reclaim_by
    assert held_until == now[0] + 300.0  # the default bound
    now[0] = held_until - 1.0
    r.poll()
    assert set(r.regions) == {9}
    now[0] = held_until
    r.poll()
    assert r.regions == {} and r.reclaim.overdue == 1 and r._extents.free == [(0, CAPACITY)]


def test_a_receiver_refuses_a_reclaim_bound_that_is_not_seconds(side):
    s = side()
    for bad in (-1.0, float("nan"), "30"):
        with pytest.raises(ValueError, match="reclaim_max_s"):
            ReferenceReceiver(s.control.endpoint, capacity=CAPACITY, keypair=generate_keypair(),
                              encoder_key=s.keys[0], reclaim_max_s=bad)


class _Unread:
    """A status socket with nothing to read: the receiver takes its connection events first."""

    def poll(self, *args) -> int:
        return 0


def test_an_answer_to_an_earlier_hello_read_after_a_reconnection_is_not_the_new_encoders(receiver):
    # Found in the multi-host suite: a receiver that did not poll across a restart read its old
    # encoder's answer to a hello of the connection before after it had connected to the new one.
    # Taken as the same encoder answering, it sent its frames again to the new one (or, read after
    # the new one's, it took the dead one for current). Each hello is numbered now, and the answer
    # repeats the number.
    s, r, _ = receiver
    old = s.control
    r.expect(5, span=4, hidden=8)
    r.register(5)
    s.pump(lambda: s.manager.room_status(5) == "announced", timeout=30, poll=lambda: both(s.manager.poll, r))
    r.push.send_multipart(r._hello())  # answered, and not read before the restart
    s.pump(lambda: r.status_sock.poll(0), timeout=30, poll=s.manager.poll)
    endpoint = old.endpoint
    old.close()
    clock = FakeClock()
    manager = drive(EncodeManager(LoopbackTransport(clock), clock))
    new = ZmqControlPlane(manager.pump, bind=endpoint, keypair=s.keys, allowed_keys=[r.keys[0]])
    status_sock, r.status_sock = r.status_sock, _Unread()
    try:
        manager.pump.transport.notify = new.push_status
        s.pump(lambda: r.handshakes == 2, timeout=30, poll=lambda: both(manager.poll, r))
        r.status_sock = status_sock
        s.pump(lambda: r.incarnation == new.incarnation and r.regions[5].acked, timeout=30,
               poll=lambda: both(manager.poll, r))
        for _ in range(20):  # whatever else was queued is read too
            both(manager.poll, r)
        assert new.stats["frames"] == 0  # room 5 was the dead one's: withdrawn, never offered again
        assert r.status == {5: ["failed"]} and r.concluded_here == {5} and r.notices[5] == ["withdrawn"]
        assert r.incarnation == new.incarnation and r.stale_answers >= 1
    finally:
        r.status_sock = status_sock
        new.close()
