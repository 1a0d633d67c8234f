"""NixlTransport against real NIXL agents over UCX's TCP transport on 127.0.0.1.

What the e2e suite (tests/test_mooncake_e2e.py, parametrised by transport) cannot show from the
outside: a blackholed `add_remote_agent` holds one connector thread, never the agent the loop
writes with; a stopped peer's transfer, which NIXL leaves in progress for ever, fails at our own
deadline and its handle is released (cancelled) before the write reports.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

if not os.environ.get("EPD_RING_REQUIRE_NIXL"):
    pytest.importorskip("nixl_cu12")
    pytest.importorskip("zmq")

from helpers import wait_stopped

from epd_ring.executor.core.transport import Outcome
from epd_ring.executor.drivers import nixl
from epd_ring.executor.drivers.nixl import NixlTransport
from epd_ring.executor.drivers.receiver import ReceiverProcess, ReferenceReceiver

NOWHERE = "tcp://127.0.0.1:9"  # no encoder: these receivers only hold memory and serve their metadata


def reports(t: NixlTransport, session: str, deadline_s: float = 60.0) -> tuple:
    """The contact report for `session` (waited for within a generous bound)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for rep in t.peer_reports():
            if rep[0] == session:
                return rep
        time.sleep(0.005)
    raise AssertionError(f"no contact report for {session}")


def outcomes(t: NixlTransport, handles: list[int], deadline_s: float = 60.0) -> dict[int, Outcome]:
    """The outcomes of `handles` (waited for within a generous bound)."""
    got: dict[int, Outcome] = {}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and set(got) != set(handles):
        got.update(t.poll())
        time.sleep(0.002)
    assert set(got) == set(handles), f"writes {set(handles) - set(got)} never reported"
    return got


def outcome(t: NixlTransport, handle: int, deadline_s: float = 60.0) -> Outcome:
    return outcomes(t, [handle], deadline_s)[handle]


def test_a_blackholed_add_holds_a_connector_thread_never_the_writing_agent(monkeypatch):
    """Every agent's add of the blackholed receiver's metadata blocks (as UCX's connect does for the
    kernel's SYN retries, 134 s) until the test lets it go. Meanwhile a healthy receiver is contacted
    and written to, byte for byte, and the loop's polls never find the agent held."""
    gate = threading.Event()
    holes: list[bytes] = []
    entered = threading.Event()
    real_load = nixl.load_agent

    def load_agent(name, **kw):
        agent = real_load(name, **kw)
        add = agent.add_remote_agent

        def add_remote_agent(meta):
            if meta in holes:
                entered.set()
                assert gate.wait(120), "never let go"
            return add(meta)

        agent.add_remote_agent = add_remote_agent
        return agent

    monkeypatch.setattr(nixl, "load_agent", load_agent)
    t = NixlTransport()
    hole = ReferenceReceiver(NOWHERE, insecure=True, transport="nixl", capacity=1 << 16)
    good = ReferenceReceiver(NOWHERE, insecure=True, transport="nixl", capacity=1 << 20)
    ring = torch.randint(0, 255, (1 << 16,), dtype=torch.uint8)
    try:
        t.register_memory([(ring.data_ptr(), ring.numel())], owner="ring")
        holes.append(hole.target.agent.get_agent_metadata())
        assert t.connect(hole.session, 1) is None
        assert entered.wait(60)  # its add is blocked on a connector thread now
        assert t.connect(good.session, 1) is None
        assert reports(t, good.session) == (good.session, 1, True, "", "")  # its owner page names no key
        frame = good.expect(1, span=16, hidden=64)
        n = 16 * 64 * 4
        handle = t.submit_write(good.session, [(ring.data_ptr(), frame.dst_ptr, n)])
        assert outcome(t, handle) is Outcome.DONE
        assert torch.equal(good.views[1][0].contiguous().view(torch.uint8).flatten(), ring[:n])
        assert t.connector.in_progress == 1  # the blackholed contact: still in its add
        assert t.stats["polls_deferred"] == 0 and t.stats["submits_handed"] == 0
        assert not [r for r in t.peer_reports() if r[0] == hole.session]
    finally:
        gate.set()
        t.close()
        hole.close()
        good.close()


class FakeAgent:
    """NIXL's agent as NixlTransport calls it, without UCX: a transfer stays in progress until the test
    ends it, and an add of `hole`'s metadata by a writing agent blocks until `gate` is set."""

    backends = ("UCX",)
    refuse_deregister = False

    def __init__(self, name: str, hole: bytes, gate: threading.Event, entered: threading.Event):
        self.name, self.hole, self.gate, self.entered = name, hole, gate, entered
        self.handles: list[FakeHandle] = []
        self.registered: list[object] = []
        self.deregistered: list[object] = []

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def register_memory(self, regions, _kind):
        reg = object()
        self.registered.append(reg)
        return reg

    def deregister_memory(self, reg) -> None:
        if self.refuse_deregister:
            raise RuntimeError("nixlNotFoundError")
        self.deregistered.append(reg)

    def get_xfer_descs(self, descs, _kind):
        return descs

    def initialize_xfer(self, *_args) -> FakeHandle:
        self.handles.append(FakeHandle())
        return self.handles[-1]

    def transfer(self, handle: FakeHandle, _notif: bytes = b"") -> str:
        return handle.state

    def check_xfer_state(self, handle: FakeHandle) -> str:
        return handle.state

    def add_remote_agent(self, meta: bytes) -> None:
        if meta == self.hole and self.name.startswith("epd-ring-tx"):  # the prober's add goes through
            self.entered.set()
            assert self.gate.wait(60), "never let go"

    def remove_remote_agent(self, _name: str) -> None:
        pass


class FakeHandle:
    def __init__(self):
        self.state, self.released = "PROC", 0

    def release(self) -> None:
        self.released += 1


def test_a_write_past_its_deadline_is_named_overdue_while_a_blocked_add_holds_the_agent(monkeypatch):
    """A peer lets the prober's add through and blackholes the writing agent's: the connector thread
    holds the agent. A healthy peer's write passes our deadline meanwhile: the deferred poll names it
    overdue at once (once), without a call into NIXL; its handle is released, and the write reports
    TIMED_OUT, only once a poll has the agent again (NIXL may touch its memory until then). A write
    handed to the submit thread meanwhile is never posted once past its deadline."""
    gate, entered = threading.Event(), threading.Event()
    agents: list[FakeAgent] = []

    def load_agent(name, **_kw):
        agents.append(FakeAgent(name, b"epd-ring-rx-hole", gate, entered))
        return agents[-1]

    monkeypatch.setattr(nixl, "load_agent", load_agent)
    now = [0.0]
    t = NixlTransport(write_timeout_s=10.0, prove_ownership=False, clock=lambda: now[0])
    peers = {s: nixl.descriptor(FakeAgent(f"epd-ring-rx-{s}", b"", gate, entered), 4096) for s in ("good", "hole")}
    t.fetch = lambda session, _timeout: peers[session]
    try:
        assert t.connect("good", 1) is None
        assert reports(t, "good")[2] is True
        handle = t.submit_write("good", [(4096, 8192, 256)])
        (xfer,) = agents[0].handles
        assert t.connect("hole", 1) is None
        assert entered.wait(60)  # the writing agent's add is blocked, holding the agent
        handed = t.submit_write("good", [(4096, 8192, 256)])
        assert t.stats["submits_handed"] == 1
        assert t.poll() == [] and t.overdue() == []
        now[0] += 10.0  # our deadline
        assert t.poll() == [] and t.overdue() == [handle, handed]
        assert t.poll() == [] and t.overdue() == []  # named once
        assert xfer.released == 0 and t.in_flight == 2  # NIXL may still touch its memory
        gate.set()
        assert reports(t, "hole")[2] is True  # the add came back: the agent is free
        assert outcomes(t, [handle, handed]) == {handle: Outcome.TIMED_OUT, handed: Outcome.TIMED_OUT}
        assert xfer.released == 1 and agents[0].handles == [xfer] and t.in_flight == 0
    finally:
        gate.set()
        t.close()


def test_a_targets_close_deregisters_its_memory_before_it_lets_go_of_the_agent(monkeypatch):
    agents: list[FakeAgent] = []

    def load_agent(name, **_kw):
        agents.append(FakeAgent(name, b"", threading.Event(), threading.Event()))
        return agents[-1]

    monkeypatch.setattr(nixl, "load_agent", load_agent)
    page, buffer = torch.zeros(64, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    target = nixl.NixlTarget("127.0.0.1", page, buffer)
    (agent,) = agents
    assert len(agent.registered) == 2 and agent.deregistered == []
    agent.refuse_deregister = True
    target.close()
    assert target.agent is agent and target.memory == (page, buffer)  # NIXL may still expose it: held
    agent.refuse_deregister = False
    target.close()
    assert sorted(map(id, agent.deregistered)) == sorted(map(id, agent.registered))
    assert target.agent is None and target.memory == ()
    target.close()  # idempotent
    assert len(agent.deregistered) == 2


def _device(root, name: str, operstate: str, carrier: str | None) -> None:
    """A network device as /sys/class/net shows it; `carrier` None: unreadable, as a device set down."""
    (root / name).mkdir(exist_ok=True)
    (root / name / "operstate").write_text(operstate + "\n")
    if carrier is None:
        (root / name / "carrier").unlink(missing_ok=True)
    else:
        (root / name / "carrier").write_text(carrier + "\n")


def test_links_count_a_device_up_only_with_carrier_and_never_loopback(tmp_path):
    _device(tmp_path, "lo", "unknown", "1")
    _device(tmp_path, "eth0", "lowerlayerdown", "0")  # a veth whose other end (its switch port) is down
    _device(tmp_path, "eth1", "down", None)  # set down
    for devices in ("eth0", None, "all", "eth0,eth1", "^eth1"):
        assert not nixl.Links(devices, str(tmp_path)).up(), devices
    assert nixl.Links("lo", str(tmp_path)).up()  # named, loopback is what UCX uses: always up
    assert nixl.Links("mlx5_0:1", str(tmp_path)).up()  # no network device: UCX's to judge
    _device(tmp_path, "eth0", "up", "1")
    for devices in ("eth0", None, "all", "eth0,eth1", "^eth1"):
        assert nixl.Links(devices, str(tmp_path)).up(), devices
    assert not nixl.Links("eth1", str(tmp_path)).up()
    assert not nixl.Links("^eth0", str(tmp_path)).up()


def test_a_target_started_with_its_link_down_makes_its_agent_at_the_first_request_once_it_is_up(monkeypatch, tmp_path):
    """UCX lists its devices once, as an agent is made: one made while the link was down would never
    be reached. The session is served from the start; no metadata until the link is up."""
    from epd_ring.executor.drivers import handshake

    agents: list[FakeAgent] = []

    def load_agent(name, **_kw):
        agents.append(FakeAgent(name, b"", threading.Event(), threading.Event()))
        return agents[-1]

    monkeypatch.setattr(nixl, "load_agent", load_agent)
    _device(tmp_path, "eth0", "lowerlayerdown", "0")
    page, buffer = torch.zeros(64, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    target = nixl.NixlTarget("127.0.0.1", page, buffer, links=nixl.Links("eth0", str(tmp_path)))
    try:
        assert agents == [] and target.session.startswith("127.0.0.1:")
        with pytest.raises(handshake.HandshakeError):
            handshake.fetch(target.session, 10.0)  # closed unanswered: the encoder tries again later
        assert agents == []
        _device(tmp_path, "eth0", "up", "1")
        name, _meta, owner = nixl.parse_descriptor(handshake.fetch(target.session, 10.0))
        (agent,) = agents
        assert (name, owner) == (agent.name, page.data_ptr()) and len(agent.registered) == 2
        assert nixl.parse_descriptor(handshake.fetch(target.session, 10.0))[0] == name
        assert len(agents) == 1  # made once
    finally:
        target.close()
    assert sorted(map(id, agent.deregistered)) == sorted(map(id, agent.registered))
    assert target.agent is None and target.memory == ()


def test_a_stopped_peer_fails_at_our_write_deadline_and_its_transfer_is_cancelled():
    """NIXL keeps a stopped peer's transfer in progress with no timeout of its own: only our deadline
    (on the transport's clock, moved by the test) ends it, with TIMED_OUT (not FAILED: NIXL had not
    ended it), once its handle is released (which cancels); nothing is reported before that, however
    often it is polled. 32 MiB, more than the sockets' buffers hold: a stopped peer cannot take it."""
    now = [0.0]
    t = NixlTransport(write_timeout_s=30.0, clock=lambda: now[0])
    b = ReceiverProcess(NOWHERE, transport="nixl")
    ring = torch.zeros(32 << 20, dtype=torch.uint8)
    try:
        t.register_memory([(ring.data_ptr(), ring.numel())], owner="ring")
        assert t.connect(b.session, 1) is None
        assert reports(t, b.session)[2] is True
        dst = b.ask(cmd="expect", room=1, span=(32 << 20) // 256, hidden=64)["dst_ptr"]
        b.proc.send_signal(signal.SIGSTOP)
        wait_stopped(b.proc.pid)
        handle = t.submit_write(b.session, [(ring.data_ptr(), dst, 32 << 20)])
        now[0] = 30.0 - 1e-3  # just short of our deadline
        for _ in range(100):
            assert t.poll() == []
        now[0] = 30.0  # our deadline
        assert outcome(t, handle, 10.0) is Outcome.TIMED_OUT
        assert t.stats["timed_out"] == 1 and t.in_flight == 0
    finally:
        b.proc.send_signal(signal.SIGCONT)
        b.close()
        t.close()


def test_a_write_outside_the_peers_registered_memory_fails_alone():
    t = NixlTransport()
    good = ReferenceReceiver(NOWHERE, insecure=True, transport="nixl", capacity=1 << 16)
    ring = torch.arange(4096, dtype=torch.uint8)
    try:
        t.register_memory([(ring.data_ptr(), ring.numel())], owner="ring")
        assert t.connect(good.session, 1) is None
        assert reports(t, good.session)[2] is True
        bad = t.submit_write(good.session, [(ring.data_ptr(), 4096, 256)])  # nowhere the peer registered
        unknown = t.submit_write("127.0.0.1:1", [(ring.data_ptr(), 4096, 256)])  # never contacted
        frame = good.expect(1, span=1, hidden=64)
        ok = t.submit_write(good.session, [(ring.data_ptr(), frame.dst_ptr, 256)])
        got = outcomes(t, [bad, unknown, ok])
        assert got == {bad: Outcome.FAILED, unknown: Outcome.FAILED, ok: Outcome.DONE}
    finally:
        t.close()
        good.close()


def test_the_bench_measures_the_controller_and_raw_nixl_at_each_size():
    from epd_ring.executor.tools.bench_nixl import run

    lines: list[str] = []
    got = run(sizes=(1 << 10, 1 << 20), items=16, mooncake=False, echo=lines.append)
    assert set(got) == {1 << 10, 1 << 20}
    for by_path in got.values():
        assert set(by_path) == {"nixl (controller)", "nixl (raw)"}
        assert all(mb > 0 and per_s > 0 for mb, per_s in by_path.values())
    assert len(lines) == 4  # a title, a header, a row per size
