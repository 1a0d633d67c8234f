"""Hosts for the multi-host suite: Linux network namespaces joined by a bridge, made and removed here.

One namespace per host (the encoder, each receiver) and one for the switch, which holds a
bridge. Each host has one veth pair: `eth0` inside the host, its other end a port of the
bridge in the switch namespace. Nothing is created in the namespace the tests run in, and
every name is fixed and ours (`NAMES`), so a run removes exactly what it made, and the
leftovers of a run that died, by exact name, before it starts. A partition takes a host's
switch port down: the host's own link stays up, as when a cable or a switch port fails. A slow
link is a token-bucket filter (`tc ... tbf`) on both ends of a host's pair: its switch port (what
the host is sent) and its `eth0` (what it sends); removed as the root qdisc of those two devices.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence

PREFIX = "epdmh"  # every namespace this module makes is named PREFIX-<host>
SWITCH = f"{PREFIX}-sw"
BRIDGE = "br0"  # inside the switch namespace only
SUBNET = "10.99.0"  # addresses only on links made here
HOSTS = {"enc": 1, "b": 2, "c": 3}  # host -> last octet of its address
LOCK = "/tmp/epd-ring-netns.lock"
NAMES = [SWITCH, *(f"{PREFIX}-{h}" for h in HOSTS)]


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`, a sandbox without CAP_NET_ADMIN)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], capture_output=True, text=True, timeout=10, check=check)


def namespace(host: str) -> str:
    return f"{PREFIX}-{host}"


def address(host: str) -> str:
    return f"{SUBNET}.{HOSTS[host]}"


def port(host: str) -> str:
    """The host's port on the switch (a name inside the switch namespace only)."""
    return f"{host}-p"


def remove(names: Iterable[str] = NAMES) -> None:
    """Delete our namespaces by exact name; their links and bridge go with them."""
    for name in names:
        if name in NAMES:  # never anything not ours
            _ip("netns", "del", name, check=False)


def leftovers() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout.split()
    return [n for n in NAMES if n in listed]


class Hosts:
    """The hosts of one test: `up()` makes them, `down()` removes them (both idempotent)."""

    def __init__(self, hosts: Sequence[str] = ("enc", "b", "c")):
        self.hosts = list(hosts)
        self._lock: int | None = None

    def up(self) -> Hosts:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("no `ip` command (iproute2)")
        # The names are fixed: a second run on this machine (another checkout's) waits for the first.
        self._lock = os.open(LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        remove()  # a run that died left them: ours by exact name
        try:
            _ip("netns", "add", SWITCH)
        except subprocess.CalledProcessError as exc:
            raise NetnsUnavailable(f"cannot create a network namespace: {exc.stderr.strip()}") from None
        try:
            _ip("-n", SWITCH, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", SWITCH, "link", "set", BRIDGE, "up")
            for host in self.hosts:
                self._add(host)
        except BaseException:
            self.down()
            raise
        return self

    def _add(self, host: str) -> None:
        ns = namespace(host)
        _ip("netns", "add", ns)
        # Made inside the switch namespace, its peer moved straight into the host's.
        _ip("-n", SWITCH, "link", "add", port(host), "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", SWITCH, "link", "set", port(host), "master", BRIDGE)
        _ip("-n", SWITCH, "link", "set", port(host), "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{address(host)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")

    def down(self) -> None:
        remove()
        if self._lock is not None:
            os.close(self._lock)  # and with it the lock
            self._lock = None

    def reboot(self, host: str) -> None:
        """The host comes back with a fresh network stack (its sockets, TIME_WAIT included, gone),
        the same address and the same switch port. Its processes must be gone first."""
        _ip("netns", "del", namespace(host), check=False)
        _ip("-n", SWITCH, "link", "del", port(host), check=False)
        self._add(host)

    def cut(self, *hosts: str) -> None:
        """Partition: the hosts' switch ports go down (their own links stay up)."""
        for host in hosts:
            _ip("-n", SWITCH, "link", "set", port(host), "down")

    def heal(self, *hosts: str) -> None:
        for host in hosts:
            _ip("-n", SWITCH, "link", "set", port(host), "up")

    def _ends(self, host: str) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of the host's link."""
        return [(SWITCH, port(host)), (namespace(host), "eth0")]

    def limit(self, host: str, rate: str = "4mbit", queue: str = "1s") -> None:
        """A slow link: each way limited to `rate`, with up to `queue` of packets waiting (a deep
        queue, as a congested link has: what is sent behind a write waits for it)."""
        if shutil.which("tc") is None:
            raise NetnsUnavailable("no `tc` command (iproute2)")
        for ns, dev in self._ends(host):
            _tc("-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "16kb",
                "latency", queue)

    def unlimit(self, host: str) -> None:
        for ns, dev in self._ends(host):
            _tc("-n", ns, "qdisc", "del", "dev", dev, "root", check=False)  # none there: nothing to do

    def throttled(self, host: str) -> int:
        """How many times the limit held a packet back on the way to the host (tbf's `overlimits`)."""
        out = _tc("-s", "-n", SWITCH, "qdisc", "show", "dev", port(host)).stdout.split()
        return int(out[out.index("overlimits") + 1]) if "tbf" in out and "overlimits" in out else 0

    def prefix(self, host: str) -> list[str]:
        """A command prefix that runs a process on `host`."""
        return ["ip", "netns", "exec", namespace(host)]

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.down()
