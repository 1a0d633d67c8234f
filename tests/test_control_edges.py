"""The control plane as an attacker on its network would try it: authentication, identity, and
every edge bounded (parts, bytes, frames per poll and per peer, time per poll, sockets, logs).

Frames are sent from real ZMQ sockets to a real ZmqControlPlane; the manager behind it runs on a
fake clock and the loopback transport.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from pathlib import Path

import pytest

if not os.environ.get("EPD_RING_REQUIRE_MOONCAKE"):
    pytest.importorskip("zmq")

import zmq

sys.path.insert(0, str(Path(__file__).parent))
from helpers import drive

from epd_ring.executor import EncodeManager, FakeClock, LoopbackTransport, ReceiverFrame
from epd_ring.executor.core.frames import WIRE_MAGIC, frame_to_parts
from epd_ring.executor.drivers.control import (
    ZmqControlPlane,
    generate_keypair,
    keys_from_env,
    load_keypair,
    load_public_keys,
)

FRAME = ReceiverFrame(1, "127.0.0.1:1", 4096, 0, 1, 0, 1, 8, "torch.float32", False, 1)


class Side:
    """An encoder's control plane with an allow-list, and clients that connect to it."""

    def __init__(self, **kw):
        self.clock = FakeClock()
        # Driven as a worker drives it: its poll() is the pump's tick, which reads the control plane.
        self.manager = drive(EncodeManager(LoopbackTransport(self.clock), self.clock, **kw.pop("manager_kw", {})))
        self.keys = generate_keypair()
        self.control = ZmqControlPlane(self.manager.pump, keypair=self.keys, **kw)
        self.ctx = zmq.Context()
        self.socks = []

    def client(self, keypair=None, allow=True, curve=True) -> zmq.Socket:
        s = self.ctx.socket(zmq.PUSH)
        self.socks.append(s)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        if curve:
            keypair = keypair or generate_keypair()
            if allow:
                self.control.allow(keypair[0])
            s.curve_secretkey, s.curve_publickey, s.curve_serverkey = keypair[1], keypair[0], self.keys[0]
        s.connect(self.control.endpoint)
        return s

    def pump(self, until, timeout=300.0, poll=None) -> float:
        """Call `poll` (the manager's, unless given) until `until()` holds; return the longest single
        poll in this thread's CPU time, for the log (wall time also counts whatever else the shared
        machine ran meanwhile; `wall` keeps it). `most` keeps the most inputs one poll took, when
        `poll` says (the control plane's does). `timeout` only keeps a broken build from hanging."""
        poll = poll or self.manager.poll
        deadline = time.monotonic() + timeout
        longest = 0.0
        self.wall = 0.0
        self.most = 0
        while not until() and time.monotonic() < deadline:
            t0, c0 = time.perf_counter(), time.thread_time()
            took = poll()
            longest = max(longest, time.thread_time() - c0)
            self.wall = max(self.wall, time.perf_counter() - t0)
            if isinstance(took, int):
                self.most = max(self.most, took)
            if not until():
                zmq.select([self.control.pull, *([self.control.zap] if self.control.zap else [])], [], [], 0.01)
        return longest

    def close(self):
        for s in self.socks:
            s.close(0)
        self.ctx.term()
        self.control.close()


def test_running_without_authentication_needs_a_flag_and_warns(caplog):
    with pytest.raises(ValueError, match="insecure=True"):
        ZmqControlPlane()
    caplog.set_level(logging.WARNING, logger="epd_ring.control")
    control = ZmqControlPlane(insecure=True)
    control.close()
    assert any("WITHOUT authentication" in r.getMessage() for r in caplog.records)


def test_only_allow_listed_keys_get_a_frame_in_and_frames_carry_their_key(side):
    s = side()
    mine = generate_keypair()
    allowed = s.client(mine)
    stranger = s.client(allow=False)  # a valid CURVE key, not on the list
    s.client(curve=False).send_multipart(frame_to_parts(FRAME._replace(room=3)), zmq.NOBLOCK)  # no CURVE at all
    stranger.send_multipart(frame_to_parts(FRAME._replace(room=2)), zmq.NOBLOCK)
    allowed.send_multipart(frame_to_parts(FRAME._replace(room=1)))
    s.pump(lambda: s.manager.room_status(1) is not None)
    s.pump(lambda: s.control.stats["zap_denied"] >= 1, timeout=300)
    assert s.manager.rooms[1].owner == mine[0].decode()
    assert s.manager.rooms[1].frames["127.0.0.1:1"].identity == mine[0].decode()
    assert s.manager.room_status(2) is None and s.manager.room_status(3) is None
    assert s.control.stats["frames"] == 1 and s.control.stats["zap_denied"] >= 1


def test_keys_load_from_files_and_environment(tmp_path, monkeypatch):
    import zmq.auth

    pub_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "receiver")
    public, _secret = load_keypair(secret_file)
    assert load_public_keys(str(tmp_path)) == {public}
    assert load_public_keys(pub_file) == {public}
    other = generate_keypair()
    monkeypatch.setenv("EPD_RING_SECRET_KEY", other[1].decode())
    monkeypatch.setenv("EPD_RING_ALLOWED_KEYS", f"{pub_file},{other[0].decode()}")
    keypair, allowed = keys_from_env()
    assert keypair == other and allowed == {public, other[0]}
    with pytest.raises(ValueError):
        load_public_keys("short-key")


def test_part_count_is_checked_before_the_rest_is_read_and_the_peers_next_frame_is_kept(side):
    # Before: one message of 1M parts was read whole before its count was checked (2.2 s, +104 MB).
    s = side()
    c = s.client()
    huge = [b"x"] * 300_000
    c.send_multipart(huge)
    c.send_multipart(frame_to_parts(FRAME._replace(room=5)))
    longest = s.pump(lambda: s.manager.room_status(5) is not None, timeout=60)
    print(f"\n300k-part message: longest poll {longest * 1e3:.1f} ms of CPU ({s.wall * 1e3:.1f} ms wall)")
    assert s.control.stats["frames_too_many_parts"] == 1
    assert s.control.stats["parts_discarded"] == len(huge) - 14
    assert s.control.stats["parts_drained"] == len(huge) - 14  # the deprecated name, kept for one release
    assert s.manager.room_status(5) == "announced"


def test_an_oversized_part_is_refused_alone_and_the_connection_kept(side):
    # Before: a part over 4 KiB dropped the connection uncounted, and the peer's next 36 frames were lost.
    s = side()
    c = s.client()
    big = frame_to_parts(FRAME._replace(room=100))
    big[2] = b"s" * 5000
    c.send_multipart(big)
    for k in range(36):
        c.send_multipart(frame_to_parts(FRAME._replace(room=200 + k, session=f"127.0.0.1:{k + 2}")))
    s.pump(lambda: s.control.stats["frames"] >= 36)
    assert s.control.stats["frames_oversized"] == 1
    assert all(s.manager.room_status(200 + k) == "announced" for k in range(36))


def test_one_flooding_peer_gets_only_its_share_of_a_poll(side):
    s = side(max_frames_per_identity=32, max_frames_per_poll=256)
    flood, victim = s.client(), s.client()
    s.pump(lambda: s.control.stats["zap_allowed"] >= 2)  # both handshakes done
    taken = []  # frames each poll handed on

    def poll():
        before = s.control.stats["frames"]
        s.manager.poll()
        taken.append(s.control.stats["frames"] - before)

    def held_back() -> bool:
        return s.control.stats["frames_held_back"] > 0

    # The flood is in before the victim speaks: waited for (a poll found more of it than the flooder's
    # share and held the rest back), not slept for. A machine so loaded that the flood trickled in
    # under the share each poll just floods again.
    sent = 0
    while not held_back():
        assert sent < 20_000, "no poll ever found more than the flooder's share waiting"
        for _ in range(2000):
            flood.send_multipart(frame_to_parts(FRAME._replace(room=10_000 + sent, session="10.0.0.9:1")))
            sent += 1
        s.pump(lambda n=sent: held_back() or s.control.stats["frames"] >= n, timeout=300, poll=poll)
    victim.send_multipart(frame_to_parts(FRAME._replace(room=7, session="10.0.0.7:1")))
    # Polled until the victim's frame is in, however late a loaded machine delivers it; each
    # poll the flooder got at most its share, so the victim never waits for the whole flood.
    s.pump(lambda: s.manager.room_status(7) is not None, timeout=300, poll=poll)
    print(f"\nthe victim's frame was in after {len(taken)} polls, with {s.control.stats['frames']} of "
          f"{sent + 1} frames taken")
    assert s.manager.room_status(7) == "announced"
    assert sum(taken) == s.control.stats["frames"] and max(taken) <= 32 + 1  # the flooder's share, and the victim's


def test_poll_stays_short_under_a_100k_frame_flood(side, caplog):
    # Before: up to 166-286 ms per poll() and 18 MB of warnings for 100k refused frames.
    caplog.set_level(logging.WARNING, logger="epd_ring")
    s = side(manager_kw=dict(max_announced=4096, max_announced_per_identity=1024))
    c = s.client()
    junk = [WIRE_MAGIC, b"1", b"x"]
    for k in range(100_000):
        if k % 2:
            c.send_multipart(junk, zmq.NOBLOCK)
        else:
            c.send_multipart(frame_to_parts(FRAME._replace(room=k, status_endpoint="tcp://127.0.0.1:9")),
                             zmq.NOBLOCK)
    stats = s.control.stats
    done = lambda: stats["frames"] + stats["frames_refused"] + stats["frames_shed"] >= 100_000  # noqa: E731
    # The worker's long-lived objects frozen first, as a long-running process should after
    # start-up: otherwise a full collection of everything this test process holds (torch and
    # the suites before) lands in whichever poll triggers it.
    gc.collect()
    gc.freeze()
    try:
        longest = s.pump(done, timeout=300, poll=s.control.poll)
    finally:
        gc.unfreeze()
    # The bound is 20 ms a poll; how long a poll takes depends on the machine, so the log
    # shows it and the test checks what keeps it short: each poll reads a bounded number of frames
    # (however many wait), and refusals log a line per kind, not a line each.
    print(f"\n100k-frame flood: longest poll {longest * 1e3:.1f} ms of CPU ({s.wall * 1e3:.1f} ms wall; "
          f"the issue's bound is 20 ms), at most {s.most} frames a poll, {len(caplog.records)} log lines")
    assert done()
    assert 0 < s.most <= s.control.max_frames_per_poll
    assert len(caplog.records) < 100  # one line per kind per second, with counts
    assert any("more like it" in r.getMessage() for r in caplog.records)


def test_status_socket_pool_evicts_below_the_contexts_socket_limit(side):
    # Before: after 1,022 distinct status endpoints every new one failed (1,023 sockets per context).
    s = side(max_push_sockets=256)
    peer = generate_keypair()[0].decode()
    for k in range(2000):
        s.control.push_status(FRAME._replace(status_endpoint=f"tcp://127.0.0.1:{20000 + k}", identity=peer), k,
                              "failed", "test")
    assert s.control.stats["status_errors"] == 0
    assert s.control.stats["status_sent"] + s.control.stats["status_dropped"] == 2000
    assert len(s.control._push) <= 256 < s.control.ctx.MAX_SOCKETS
    assert s.control.stats["status_sockets_evicted"] == 2000 - 256


def test_a_poll_answers_at_most_max_zap_per_poll_handshakes(side):
    s = side(max_zap_per_poll=3)
    for _ in range(10):
        s.client(allow=False)  # valid CURVE keys, not on the list: each handshake asks ZAP (and retries)
    answered = lambda: s.control.stats["zap_allowed"] + s.control.stats["zap_denied"]  # noqa: E731
    most = 0
    deadline = time.monotonic() + 300  # only keeps a broken build from hanging
    while answered() < 10 and time.monotonic() < deadline:
        before = answered()
        s.control.poll()
        most = max(most, answered() - before)
        zmq.select([s.control.zap], [], [], 0.01)
    print(f"\nZAP: at most {most} answers in one poll")
    assert answered() >= 10 and s.control.stats["zap_allowed"] == 0
    assert most <= 3


def test_a_full_backlog_sheds_an_identitys_frames_and_counts_them(side):
    s = side(max_frames_per_identity=2, max_backlog=5)
    c = s.client()
    stats = s.control.stats
    done = lambda: stats["frames"] + stats["frames_shed"] >= sent  # noqa: E731
    # Sent again until a poll found more than the share and the backlog can hold: a machine so loaded
    # that the frames trickled in a few a poll only makes this take longer.
    sent = 0
    while not stats["frames_shed"]:
        assert sent < 2000, "no poll ever found more frames waiting than the backlog holds"
        for _ in range(200):
            c.send_multipart(frame_to_parts(FRAME._replace(room=1000 + sent, session=f"10.0.0.9:{sent + 1}")))
            sent += 1
        deadline = time.monotonic() + 300  # only keeps a broken build from hanging
        while not done() and time.monotonic() < deadline:
            s.control.poll()
            assert len(s.control._backlog) <= 5
            zmq.select([s.control.pull], [], [], 0.01)
        assert done()
    assert stats["frames"] + stats["frames_shed"] == sent  # each frame taken or shed, and counted


def test_a_poll_stops_reading_once_max_poll_s_has_passed(side):
    # max_poll_s=0: the clock is past the bound at its first look, every 8 frames.
    s = side(max_poll_s=0)
    c = s.client()
    stats = s.control.stats
    most = 0
    # Sent again until a poll found more than 8 frames waiting (so it looked at the clock): a machine so
    # loaded that they trickled in a few a poll only makes this take longer.
    sent = 0
    while not stats["polls_out_of_time"]:
        assert sent < 1000, "no poll ever found more than 8 frames waiting"
        for _ in range(100):
            c.send_multipart(frame_to_parts(FRAME._replace(room=2000 + sent, session=f"10.0.0.8:{sent + 1}")))
            sent += 1
        deadline = time.monotonic() + 300  # only keeps a broken build from hanging
        while stats["frames"] < sent and time.monotonic() < deadline:
            before = stats["frames"]
            s.control.poll()
            most = max(most, stats["frames"] - before)
            zmq.select([s.control.pull], [], [], 0.01)
        assert stats["frames"] == sent
    assert most <= 8


def test_fd_budget_counts_every_socket_the_control_plane_may_hold(monkeypatch, caplog):
    from epd_ring.executor.drivers import control as control_module

    keys = [generate_keypair()[0] for _ in range(3)]
    c = ZmqControlPlane(keypair=generate_keypair(), allowed_keys=keys)
    try:
        # The context's socket limit is 8 pools plus 64 (docs/trust.md), so eviction happens below it.
        assert c.ctx.MAX_SOCKETS == 8 * 512 + 64 == 4160
        # The interpreter's 256, every socket's mailbox, the status pool, the young and the silent
        # connections, 64 per allow-listed key: 5,440 with the defaults and no key, and 4 per engine peer.
        assert c.fd_budget() == 256 + 4160 + 512 + 2 * 256 + 64 * 3 == 5440 + 192
        assert c.fd_budget(peers=10) == c.fd_budget() + 40
        c.allow(generate_keypair()[0])
        assert c.fd_budget() == 5440 + 256
    finally:
        c.close()
    small = ZmqControlPlane(keypair=generate_keypair(), allowed_keys=keys, max_push_sockets=100,
                            max_pending_connections=10, max_connections_per_key=2)
    try:
        assert small.fd_budget() == 256 + (8 * 100 + 64) + 100 + 2 * 10 + 2 * 3
    finally:
        small.close()
    # A descriptor limit below the budget is warned of at construction.
    monkeypatch.setattr(control_module, "raise_fd_limit", lambda: (1000, 1000))
    caplog.set_level(logging.WARNING, logger="epd_ring.control")
    low = ZmqControlPlane(keypair=generate_keypair())
    low.close()
    assert any("fd_budget" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_the_figures_docs_trust_md_states_are_the_defaults():
    # docs/trust.md states these numbers as what an identity or a keyless client can do; a changed
    # default must change the page too.
    import inspect

    from epd_ring.executor.drivers.mooncake import Connector, MooncakeTransport

    def defaults(f):
        return {k: p.default for k, p in inspect.signature(f).parameters.items()}

    control, manager = defaults(ZmqControlPlane), defaults(EncodeManager)
    mooncake, connector = defaults(MooncakeTransport), defaults(Connector)
    assert {k: control[k] for k in ("max_frames_per_poll", "max_frames_per_identity", "max_backlog", "max_poll_s",
                                    "max_part_bytes", "max_message_bytes", "max_zap_per_poll", "max_push_sockets",
                                    "handshake_s", "max_connections_per_source", "max_pending_connections",
                                    "max_unread_bytes")} == dict(
        max_frames_per_poll=1024, max_frames_per_identity=256, max_backlog=4096, max_poll_s=0.010,
        max_part_bytes=4096, max_message_bytes=1 << 20, max_zap_per_poll=256, max_push_sockets=512, handshake_s=2.0,
        max_connections_per_source=32, max_pending_connections=256, max_unread_bytes=64 << 20)
    assert {k: manager[k] for k in ("max_announced", "max_announced_per_identity", "max_sessions_per_identity",
                                    "max_peers", "max_peers_per_identity")} == dict(
        max_announced=4096, max_announced_per_identity=1024, max_sessions_per_identity=256, max_peers=4096,
        max_peers_per_identity=256)
    assert {k: mooncake[k] for k in ("connector_threads", "contacts_per_identity", "open_stall_s", "stall_penalty_s",
                                     "max_respellings")} == dict(
        connector_threads=32, contacts_per_identity=2, open_stall_s=2.0, stall_penalty_s=300.0, max_respellings=64)
    assert (connector["waiting_per_identity"], connector["max_wait_s"]) == (64, 10.0)
