"""`Inbound`: the connections into a receiver's engine, read from Linux's /proc, that a dead
encoder's kernel may still deliver through (executor/drivers/orphans.py). The receiver's use of
them across a restart is in tests/test_reconnect.py and the multi-host suite."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from epd_ring.executor.drivers.orphans import Inbound

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def _row(local: str, remote: str, state: str, inode: int, unread: int = 0) -> str:
    return f"   0: {local} {remote} {state} 00000000:{unread:08X} 00:00000000 00000000     0        0 {inode} 1 0\n"


def _proc(root, sockets: dict[int, int], tcp: list[str], tcp6: list[str] = ()) -> None:
    """A /proc/self: fd number -> socket inode, and the namespace's TCP tables."""
    fds, net = root / "self" / "fd", root / "self" / "net"
    fds.mkdir(parents=True, exist_ok=True)
    net.mkdir(parents=True, exist_ok=True)
    for f in fds.iterdir():
        f.unlink()
    for fd, inode in sockets.items():
        os.symlink(f"socket:[{inode}]", fds / str(fd))
    os.symlink("pipe:[77]", fds / "99")
    (net / "tcp").write_text(HEADER + "".join(tcp))
    (net / "tcp6").write_text(HEADER + "".join(tcp6))


def test_inbound_counts_accepted_connections_into_the_ports_opened_after_it_and_nothing_else(tmp_path):
    pre = "0100007F:1F90"  # 127.0.0.1:8080, served before the engine
    _proc(tmp_path, {3: 100}, [_row(pre, "00000000:0000", "0A", 100)])
    inbound = Inbound(str(tmp_path))
    engine, status = "0200000A:3A98", "0200000A:4E20"  # 10.0.0.2:15000 and :20000
    peer = "0100000A:C350"
    _proc(tmp_path, {3: 100, 4: 101, 5: 102, 6: 103, 7: 104, 8: 105, 9: 106, 10: 108, 11: 109, 12: 110, 13: 111,
                     14: 112, 15: 113, 16: 114},
          [_row(pre, "00000000:0000", "0A", 100),
           _row(engine, "00000000:0000", "0A", 101),
           _row(engine, peer, "01", 102),                      # into the engine: counted
           _row(engine, "0100000A:C355", "08", 110),           # its peer closed, all read: done
           _row(engine, "0100000A:C356", "08", 111, unread=5),  # its peer closed, 5 bytes unread
           _row(engine, "0100000A:C357", "05", 112),           # ours closed, the peer may still send
           _row("0200000A:C358", engine, "01", 113),           # the engine's connection to itself
           _row(engine, "0200000A:C358", "01", 114),
           _row(pre, peer, "01", 103),                         # into a server that was there before
           _row(status, "00000000:0000", "0A", 104),
           _row(status, peer, "01", 105),                      # into the status socket, excluded below
           _row("0200000A:C351", "0100000A:3A98", "01", 106),  # ours, outbound
           _row(engine, "0100000A:C352", "01", 107),           # another process's socket
           _row(engine, "0100000A:C353", "06", 0)],            # TIME_WAIT: no longer anyone's
          [_row("00000000000000000000000000000000:3A98", "0000000000000000FFFF00000100000A:C354", "08", 108, 1),
           _row("00000000000000000000000000000000:3A98", "00000000000000000000000000000000:0000", "0A", 109)])
    inbound.exclude(0x4E20)
    assert inbound.open() == {(engine, peer, 102), (engine, "0100000A:C356", 111), (engine, "0100000A:C357", 112),
                              ("00000000000000000000000000000000:3A98", "0000000000000000FFFF00000100000A:C354", 108)}


def test_inbound_without_proc_knows_of_no_connection(tmp_path):
    assert Inbound(str(tmp_path / "nowhere")).open() == frozenset()


class Peer:
    """Another process connected to `port` on loopback (a connection from ourselves is the engine's
    own, and not counted): `send` writes, `close` closes its side."""

    def __init__(self, *ports: int):
        code = ("import socket, sys\n"
                f"socks = [socket.create_connection(('127.0.0.1', p)) for p in {list(ports)}]\n"
                "print('up', flush=True)\n"
                "for line in sys.stdin:\n"
                "    if line.startswith('send'):\n"
                "        socks[-1].sendall(b'late')\n"
                "    else:\n"
                "        [s.close() for s in socks]\n"
                "    print('done', flush=True)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline() == "up\n"

    def ask(self, what: str) -> None:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "done\n"

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _inodes(inbound: Inbound) -> set[int]:
    return {inode for _, _, inode in inbound.open()}


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")


@linux
def test_inbound_sees_a_real_accepted_connection_until_this_process_closes_it():
    before = socket.create_server(("127.0.0.1", 0))
    inbound = Inbound()
    server = socket.create_server(("127.0.0.1", 0))
    peer = Peer(before.getsockname()[1], server.getsockname()[1])
    old, _ = before.accept()
    conn, _ = server.accept()
    ours = socket.create_connection(server.getsockname())  # the engine's connection to itself
    own, _ = server.accept()
    try:
        assert _inodes(inbound) == {os.fstat(conn.fileno()).st_ino}
        conn.close()  # the peer's side stays open: nothing more can reach us through ours
        assert _inodes(inbound) == set()
    finally:
        peer.end()
        for s in (old, conn, own, ours, before, server):
            s.close()


@pytest.fixture
def accepted():
    """(an `Inbound` made first, a connection our server accepted from another process, that process)."""
    inbound = Inbound()
    server = socket.create_server(("127.0.0.1", 0))
    peer = Peer(server.getsockname()[1])
    conn, _ = server.accept()
    try:
        yield inbound, conn, peer
    finally:
        peer.end()
        conn.close()
        server.close()


@linux
def test_inbound_drops_a_connection_its_peer_closed_once_all_it_sent_is_read(accepted):
    # As UCX does with a dead peer's socket: kept open here, with nothing more to come.
    inbound, conn, peer = accepted
    inode = os.fstat(conn.fileno()).st_ino
    peer.ask("send")
    peer.ask("close")  # its FIN follows its bytes
    assert conn.recv(4, socket.MSG_PEEK) == b"late"
    assert inode in _inodes(inbound)  # closed by the peer, 4 bytes unread
    assert conn.recv(4) == b"late" and conn.recv(4) == b""  # the bytes, then the FIN
    assert inode not in _inodes(inbound)


@linux
def test_a_probed_connection_gets_keepalive_and_stays_the_engines(accepted):
    inbound, conn, peer = accepted
    assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
    inbound.probe(inbound.open())
    assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1
    peer.ask("send")  # the engine's socket is open and its own
    assert conn.recv(4) == b"late"
