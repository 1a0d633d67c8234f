"""The receiver's regions of an ended encoder incarnation, held until no write of it can land.

A process killed with writes on the wire leaves its sockets to its kernel, which goes on sending
what they hold: an orphaned TCP socket retransmits for up to minutes, and a cut that heals lets
those bytes through, into whatever the region's memory holds by then. They can reach our memory
only through a socket this process still holds, and only while the peer's side is open or bytes it
sent wait unread. So a region of a dead incarnation comes back once `reclaim_s` passed and each
connection into our engine that was open when we lost the encoder is done: closed here, or closed
by the peer with all it sent read (an engine may keep a dead peer's socket: UCX does). At the
latest it comes back `reclaim_max_s` after (a connection whose peer's kernel gave up stays open here
with nothing more to deliver). The connections are read from Linux's /proc; where it cannot be
read, the timer alone decides (docs/mooncake.md, "Encoder incarnations").
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import Any

from epd_ring.fsm import REGION

from ..core import settings

_LISTEN = "0A"
# TCP states (include/net/tcp_states.h) in which the peer may still send: established, the opening
# handshake, and our side closed while the peer's is open (FIN_WAIT1/2). In the others the peer's
# FIN came, so all it will ever send is in our receive queue, or was read.
_PEER_SENDING = frozenset({"01", "02", "03", "04", "05", "0C"})
_LOOK_EVERY_S = 0.2  # how often a region held for connections reads the tables again
# A probe after 1 s idle, then every second; 10 unanswered end the connection.
_PROBES = (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 10))

Connection = tuple[str, str, int]  # (local address, remote address, socket inode), as /proc/net/tcp* has them


class Inbound:
    """The TCP connections into this process's engine through which bytes may still come: accepted
    by a socket it listens on, made after this object (so not the integrator's own servers), other
    than ports `exclude`d and the engine's connections to itself, whose peer has not closed its
    side or whose bytes are not all read."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self.excluded: set[int] = set()
        self.before = self._listening(self._ours(), self._rows())
        self.probed: set[int] = set()  # inodes given keepalive probes (`probe`)

    def exclude(self, port: int) -> None:
        """A port of ours that is not the engine's (the status socket's)."""
        self.excluded.add(port)

    def open(self) -> frozenset[Connection]:
        ours, rows = self._ours(), self._rows()
        engine = self._listening(ours, rows) - self.before - self.excluded
        mine = {_endpoint(local) for local, _, _, _, inode in rows if inode in ours}
        return frozenset((local, remote, inode) for local, remote, state, unread, inode in rows
                         if (state in _PEER_SENDING or unread) and inode in ours and _port(local) in engine
                         and _endpoint(remote) not in mine)

    def probe(self, connections: frozenset[Connection]) -> None:
        """Keepalive probes on these connections (once each): one whose peer is gone for good (a
        reset lost in a cut, a kernel that gave up) stays established here, and nothing else would
        end it. The peer's host answers a probe with a reset, or none comes back: either way our
        kernel closes it, and whatever the dead peer's kernel might still send is refused. A live
        peer answers and nothing changes (a pause of its link longer than the probes ends it, as
        a reset would)."""
        wanted = {inode for _, _, inode in connections} - self.probed
        if not wanted:
            return
        self.probed |= wanted
        for inode, fd in self._ours().items():
            if inode in wanted:
                _keepalive(fd, inode)

    @staticmethod
    def _listening(ours: dict[int, int], rows: list[tuple[str, str, str, bool, int]]) -> set[int]:
        return {_port(local) for local, _, state, _, inode in rows if state == _LISTEN and inode in ours}

    def _ours(self) -> dict[int, int]:
        """The inodes of this process's sockets, and a descriptor of each."""
        fds = os.path.join(self.proc, "self", "fd")
        inodes: dict[int, int] = {}
        try:
            names = os.listdir(fds)
        except OSError:
            return inodes
        for name in names:
            try:
                link = os.readlink(os.path.join(fds, name))
            except OSError:
                continue  # closed since the listing
            if link.startswith("socket:[") and link.endswith("]") and link[8:-1].isdecimal() and name.isdecimal():
                inodes[int(link[8:-1])] = int(name)
        return inodes

    def _rows(self) -> list[tuple[str, str, str, bool, int]]:
        """(local, remote, state, bytes not yet read, inode) of every TCP socket of this network
        namespace."""
        rows = []
        for table in ("tcp", "tcp6"):
            try:
                with open(os.path.join(self.proc, "self", "net", table)) as f:
                    lines = f.read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if len(fields) > 9 and fields[9].isdecimal():
                    unread = fields[4].rpartition(":")[2].strip("0") != ""
                    rows.append((fields[1], fields[2], fields[3], unread, int(fields[9])))
        return rows


def _keepalive(fd: int, inode: int) -> None:
    try:
        dup = os.dup(fd)
    except OSError:
        return  # closed since
    try:
        if os.fstat(dup).st_ino != inode:
            return  # the number was reused by another socket
        sock = socket.socket(fileno=dup)  # owns the duplicate only: closing it leaves the engine's
        dup = -1
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in _PROBES:
                if hasattr(socket, option):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    except OSError:
        pass  # not a TCP socket any more, or gone: nothing to probe
    finally:
        if dup >= 0:
            os.close(dup)


def _endpoint(address: str) -> tuple[bytes, int]:
    """(address bytes, port) of a /proc/net/tcp* "HEX:PORT", an IPv4-mapped IPv6 address as IPv4."""
    host, _, port = address.rpartition(":")
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":
        raw = raw[12:]
    return raw, int(port, 16)


def _port(address: str) -> int:
    return int(address.rpartition(":")[2], 16)


class Reclaim:
    """When the regions of an ended incarnation come back (module docstring). The receiver tells
    it when the connection to its encoder was `lost`, `kept` (the same encoder answered again) and
    which regions it `hold`s; `due` says which of them may come back."""

    def __init__(self, reclaim_s: float, reclaim_max_s: float, inbound: Any = None):
        reclaim_s = settings.seconds("reclaim_s", reclaim_s)
        self.reclaim_s, self.reclaim_max_s = reclaim_s, max(reclaim_s, settings.seconds("reclaim_max_s", reclaim_max_s))
        self.inbound = Inbound() if inbound is None else inbound
        self.at_loss: frozenset[Connection] | None = None  # open when we lost the encoder
        self._open: frozenset[Connection] = frozenset()
        self._looked_at: float | None = None
        self.waited: set[int] = set()  # rooms whose region waited past `reclaim_s` for a dead connection
        self.overdue = 0  # regions that came back at `reclaim_max_s` with a dead connection still open

    def lost(self) -> None:
        # Its connections then are the dead one's (a new process has none before it is up and
        # reached): ours since, the new incarnation's.
        self.at_loss = (self.at_loss or frozenset()) | self._read()

    def kept(self) -> None:
        self.at_loss = None

    def dead(self) -> frozenset[Connection]:
        """The ended incarnation's connections: those open when we lost it (else those open now)."""
        dead = self._read() if self.at_loss is None else self.at_loss
        self.at_loss = None
        return dead

    def hold(self, region: Any, now: float, dead: frozenset[Connection]) -> None:
        region.reclaim_at = now + self.reclaim_s
        region.reclaim_by = now + self.reclaim_max_s
        region.lingering = dead

    def due(self, regions: Iterable[Any], now: float) -> list[Any]:
        """The held regions whose time passed and whose dead connections are all closed here."""
        ready = []
        for region in regions:
            if region.reclaim_at is None or now < region.reclaim_at:
                continue
            if region.lingering:
                if now < region.reclaim_by:
                    region.lingering &= self._still_open(now)
                    if region.lingering:
                        self.waited.add(region.room)
                        self.inbound.probe(region.lingering)
                        continue
                else:
                    self.overdue += 1
                    region.lingering = frozenset()
            ready.append(region)
        return ready

    def release(self, regions: Iterable[Any], now: float) -> list[Any]:
        """The held regions that come back now, each stepped to `released`: a `failed` one by the
        release the dead encoder never sent, a withdrawn one once the new incarnation acknowledged
        (if it was asked)."""
        back = []
        for region in self.due(regions, now):
            if region.state == "failed":
                REGION.step(region, "release")
            elif not region.needs_ack or region.acked:
                REGION.step(region, "ack")
            else:
                continue
            back.append(region)
        return back

    def _read(self) -> frozenset[Connection]:
        # What `due` compares with is never older than a set it is compared against: a connection
        # missing from a later reading is closed (an inode is not reused while its socket lives).
        self._looked_at = None
        return self.inbound.open()

    def _still_open(self, now: float) -> frozenset[Connection]:
        if self._looked_at is None or not 0 <= now - self._looked_at < _LOOK_EVERY_S:
            self._open, self._looked_at = self.inbound.open(), now
        return self._open
