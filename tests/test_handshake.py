"""Our side of the engine's segment handshake: a total deadline on the peer, a relay the engine opens from."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from epd_ring.executor.drivers import handshake
from epd_ring.executor.drivers.handshake import METADATA, HandshakeError, Relay, fetch, frame, read_frame

DESC = json.dumps({"name": "10.0.0.2:15000", "buffers": [{"addr": 4096, "length": 64}], "tcp_data_port": 15100,
                   "timestamp": "1"}).encode()


class Peer:
    """A handshake port on loopback: `answer(conn)` serves each connection, in a thread of its own."""

    def __init__(self, answer):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.session = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer, self.stop, self.requests = answer, threading.Event(), []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            try:
                self.requests.append(read_frame(conn, time.monotonic() + 30))
                self.answer(conn, self.stop)
            except (OSError, HandshakeError):
                pass

    def close(self):
        self.stop.set()
        self.sock.close()


def honest(conn, stop):
    conn.sendall(frame(METADATA, DESC))


def trickle(conn, stop):
    """The whole reply, one byte at a time, each well inside any per-read timeout."""
    for b in frame(METADATA, DESC):
        if stop.wait(0.2):
            return
        conn.sendall(bytes([b]))


def silent(conn, stop):
    stop.wait(60)


def within(guard_s: float, fn, *args):
    """`fn(*args)` on a thread; its result or exception, or AssertionError if it is still running
    after `guard_s` (which only keeps a broken build from hanging the run)."""
    out: list = []

    def run():
        try:
            out.append((True, fn(*args)))
        except Exception as exc:
            out.append((False, exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(guard_s)
    assert out, f"{fn.__name__} still waiting after {guard_s} s"
    ok, value = out[0]
    if not ok:
        raise value
    return value


def test_fetch_reads_the_peers_descriptor_asking_with_a_metadata_request():
    peer = Peer(honest)
    try:
        assert fetch(peer.session, 10.0) == DESC
        assert peer.requests[0][0] == METADATA
    finally:
        peer.close()


@pytest.mark.parametrize("answer", [trickle, silent])
def test_a_peer_that_trickles_or_goes_silent_gets_no_more_than_the_total_deadline(answer):
    # Before: the engine fetched the descriptor itself, with a 60 s timeout per read under the
    # mutex every submit takes, so a reply sent a byte at a time held every write for hours.
    peer = Peer(answer)
    now = [0.0]

    def clock():  # each look at the clock is half a second later: a deadline of 2 s is 4 looks
        now[0] += 0.5
        return now[0]

    try:
        with pytest.raises(HandshakeError):
            within(60, fetch, peer.session, 2.0, clock)
    finally:
        peer.close()


def test_a_refused_peer_and_a_reply_that_is_not_a_descriptor_fail_the_handshake():
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    session = f"127.0.0.1:{gone.getsockname()[1]}"
    gone.close()
    with pytest.raises(HandshakeError):
        fetch(session, 5.0)
    for body, kind in ((b"not json", METADATA), (b'{"name": "x"}', METADATA), (DESC, 3)):
        peer = Peer(lambda conn, stop, body=body, kind=kind: conn.sendall(frame(kind, body)))
        try:
            with pytest.raises(HandshakeError):
                fetch(peer.session, 5.0)
        finally:
            peer.close()
    huge = Peer(lambda conn, stop: conn.sendall(handshake._HEADER.pack(1 << 40, METADATA)))
    try:
        with pytest.raises(HandshakeError):
            fetch(huge.session, 5.0)
    finally:
        huge.close()
    for session in ("nohostport", "h:0", "h:99999", ":15000", "h:x"):
        with pytest.raises(HandshakeError):
            fetch(session, 1.0)


def engine_like(name: str) -> int:
    """What the engine does with a segment name: dial it, send its own descriptor, read the reply."""
    host, port = handshake.split_session(name)
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(frame(METADATA, b'{"name": "encoder"}'))
        kind, body = read_frame(s, time.monotonic() + 30)
    return 0 if kind == METADATA and body == DESC else -1


def test_the_relay_answers_the_engine_with_the_fetched_descriptor_under_a_name_never_used_again():
    relay = Relay(timeout_s=30.0)
    names = {relay.open(DESC, engine_like) for _ in range(3)}
    assert {rc for _, rc in names} == {0} and len(names) == 3
    for name, _ in names:
        host, _port = handshake.split_session(name)
        assert host.startswith("127.") and host != "127.0.0.1"
    assert relay.served == 3


def test_the_relay_closes_at_its_deadline_so_an_engine_waiting_on_it_fails_at_once():
    # An engine that dials and waits: the relay answers only once it has read a request, so this
    # one is cut at the deadline, and its read ends then, not at the engine's 60 s.
    def dial_and_wait(name):
        host, port = handshake.split_session(name)
        with socket.create_connection((host, port), timeout=30) as s:
            s.settimeout(60)
            return len(s.recv(1))  # 0: closed by the relay

    now = [0.0]

    def clock():
        now[0] += 0.25
        return now[0]

    relay = Relay(timeout_s=1.0, clock=clock)
    name, got = within(60, relay.open, DESC, dial_and_wait)
    assert got == 0 and relay.expired == 1 and relay.served == 0
    # The listener is gone: dialling the name again is refused, never left waiting.
    with pytest.raises(OSError):
        socket.create_connection(handshake.split_session(name), timeout=5).close()


def test_descriptors_are_the_same_segment_whatever_time_they_were_stamped():
    a = json.loads(DESC)
    b = dict(a, timestamp="2")
    c = dict(a, tcp_data_port=15101)
    assert handshake.same_segment(DESC, json.dumps(b).encode())
    assert not handshake.same_segment(DESC, json.dumps(c).encode())
