"""What one allow-listed key can do to other receivers, on the sans-I/O core (issue 21).

A session string is only a spelling: the engine resolves it, and many spellings reach one
receiver's memory. Where the transport proves ownership (Mooncake reads the key a receiver's
ownership page names, at first contact), a session belongs to the identity its own memory names,
whoever named it first and however it was spelled. Per-identity caps keep one key's flood of
sessions inside its own share of the peer table. The real engine's side is in test_keys_e2e.py.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_rig, reason_kind, run, untouched

from epd_ring.executor import ReasonKind
from epd_ring.executor.core.loopback import LoopbackTransport

VICTIM, ATTACKER, HONEST = "key-victim", "key-attacker", "key-honest"


class ProvingLoopback(LoopbackTransport):
    proves_ownership = True  # read when the manager is built, as it reads Mooncake's


class Proving:
    """Contacts answer on the next tick with the identity the receiver's memory names, as the
    Mooncake transport does; `alias` makes a second spelling reach the same memory."""

    def __init__(self, rig, owners: dict[str, str]):
        assert isinstance(rig.transport, ProvingLoopback), "build the rig with proving_rig()"
        self.t = t = rig.transport
        self.owners = owners  # receiver session -> the key its ownership page names
        self.canonical: dict[str, str] = {}
        t.connect = self.connect

    def alias(self, spelling: str, session: str) -> None:
        self.canonical[spelling] = session
        self.t.receivers[spelling] = self.t.receivers[session]  # the engine reaches the same memory

    def connect(self, session: str, attempt: int, identity: str = "", probe: bool = False):
        owner = self.owners.get(self.canonical.get(session, session))
        self.t._reports.append((session, attempt, owner is not None, "" if owner else "no ownership page", owner))
        return None


def proving_rig(**kw):
    return make_rig(transport_cls=ProvingLoopback, **kw)


def test_a_pre_claim_of_another_receivers_session_fails_the_claimers_room_and_the_owners_frames_are_answered():
    rig = proving_rig()
    Proving(rig, {"victim:1": VICTIM})
    # The attacker names the victim's session first, pointing into the victim's memory.
    rig.executor.register("req-9", "prefill-host", 8998, 9, receiver=ATTACKER)
    rig.manager.register_receiver(rig.frame(9, "victim:1", 2, identity=ATTACKER))
    # The victim's own frame comes while the contact is still under way.
    rig.executor.register("req-7", "prefill-host", 8998, 7, receiver=VICTIM)
    assert rig.manager.register_receiver(rig.frame(7, "victim:1", 2, identity=VICTIM))
    a, v = rig.item(2, 9), rig.item(2, 7)
    run(rig, ("req-9", a), ("req-7", v))
    assert rig.manager.room_status(7) == "success"
    assert rig.delivered_ok(7, "victim:1", v)
    assert rig.manager.room_status(9) == "failed" and reason_kind(rig.manager, 9) is ReasonKind.FOREIGN
    assert untouched(rig, 9, "victim:1")  # the attacker's rows were never written into the victim's memory
    assert ("success", "") in rig.told("victim:1", 7)
    assert rig.manager.stats["rooms_disowned"] == 1
    # From here on the session is the victim's: a later frame of the attacker is refused at once.
    rig.executor.register("req-10", "prefill-host", 8998, 10, receiver=ATTACKER)
    assert not rig.manager.register_receiver(rig.frame(10, "victim:1", 2, identity=ATTACKER))
    assert rig.manager.tenancy.session_owner("victim:1") == VICTIM


def test_no_spelling_of_another_receivers_session_leads_to_a_write_into_its_memory():
    rig = proving_rig(extents=8)
    proving = Proving(rig, {"victim:1": VICTIM})
    rig.executor.register("req-7", "prefill-host", 8998, 7, receiver=VICTIM)
    rig.manager.register_receiver(rig.frame(7, "victim:1", 2, identity=VICTIM))
    v = rig.item(2, 7)
    run(rig, ("req-7", v))
    assert rig.manager.room_status(7) == "success" and rig.delivered_ok(7, "victim:1", v)
    aliases = ["localhost:1", "LOCALHOST:1", "victim-host:1", "127.0.0.2:1", "127.1:1", "0.0.0.0:1", "victim:01",
               "0x7f000001:1", "2130706433:1"]
    for k, spelling in enumerate(aliases):
        proving.alias(spelling, "victim:1")
        room = 100 + k
        rig.executor.register(f"req-{room}", "prefill-host", 8998, room, receiver=ATTACKER)
        rig.manager.register_receiver(rig.frame(room, spelling, 2, identity=ATTACKER))
        run(rig, (f"req-{room}", rig.item(2, room)))
        assert rig.manager.room_status(room) == "failed", spelling
        assert reason_kind(rig.manager, room) is ReasonKind.FOREIGN, spelling
        assert untouched(rig, room, spelling), spelling
    assert rig.delivered_ok(7, "victim:1", v)  # the victim's delivered rows were never overwritten


def test_a_session_whose_memory_names_no_key_is_never_written():
    rig = proving_rig()
    Proving(rig, {})  # a receiver that registered no ownership page
    rig.executor.register("req-7", "prefill-host", 8998, 7, receiver=ATTACKER)
    rig.manager.register_receiver(rig.frame(7, "stranger:1", 2, identity=ATTACKER))
    run(rig, ("req-7", rig.item(2, 7)))
    assert reason_kind(rig.manager, 7) is ReasonKind.PEER_DOWN
    assert untouched(rig, 7, "stranger:1")


def test_one_keys_flood_of_sessions_fills_its_own_share_of_the_peer_table_and_another_key_registers_at_once():
    rig = make_rig(extents=8, announce_timeout=120.0)
    m = rig.manager
    gc.collect()
    gc.freeze()  # as a long-running worker does after start-up: a full collection is not the flood's
    t0 = time.perf_counter()
    worst = 0.0
    # The flood: 4 rooms with N = 1,024, 4,096 session strings, all from one key. Its
    # peers have live rooms, so none could be forgotten to make room.
    for r in range(4):
        for k in range(1024):
            f = rig.frame(1000 + r, f"flood-{r}-{k}:1", 1, n=1024, identity=ATTACKER, deep=False)
            t = time.perf_counter()
            m.register_receiver(f)
            worst = max(worst, time.perf_counter() - t)
    flood_s = time.perf_counter() - t0
    assert len(m.peers.by_session) <= m.peers.max_peers_per_identity < m.peers.max_peers
    assert m.peers.stats["peers_refused_identity"] > 0
    assert reason_kind(m, 1000) is ReasonKind.CAPACITY  # the flooder's own rooms pay for it
    # Another key registers at once, and its room goes through with no wait on the clock.
    at = rig.clock.now()
    rig.executor.register("req-1", "prefill-host", 8998, 1, receiver=HONEST)
    assert m.register_receiver(rig.frame(1, "honest:1", 2, identity=HONEST))
    item = rig.item(2, 1)
    run(rig, ("req-1", item))
    assert m.room_status(1) == "success" and rig.delivered_ok(1, "honest:1", item)
    print(f"\nflood of 4,096 sessions from one key: {len(m.peers.by_session)} peers held, {flood_s:.2f} s of frames, "
          f"slowest register_receiver {worst * 1e3:.2f} ms; another key's room waited {rig.clock.now() - at:.1f} s "
          "of the core's clock")
    gc.unfreeze()


def test_an_identitys_idle_peers_make_room_for_its_new_ones_and_only_its_own():
    rig = make_rig(max_peers_per_identity=2)
    m = rig.manager
    assert m.peers.contact("a:1", ATTACKER) and m.peers.contact("a:2", ATTACKER)
    assert m.peers.contact("h:1", HONEST)
    # a:1 and a:2 are idle (no live room): the attacker's third peer forgets its own oldest.
    assert m.peers.contact("a:3", ATTACKER) is not None
    assert "a:1" not in m.peers.by_session and "h:1" in m.peers.by_session
    assert m.peers.per_identity == {ATTACKER: 2, HONEST: 1}  # the forgotten peer no longer counts
    m.peers.get("a:2").rooms.add(1)
    m.peers.get("a:3").rooms.add(2)
    assert m.peers.contact("a:4", ATTACKER) is None  # both busy: refused, never someone else's
    assert m.peers.contact("h:2", HONEST) is not None


def test_one_identitys_hung_contacts_hold_its_own_share_of_the_connector_and_wait_behind_each_other():
    from epd_ring.executor.drivers.mooncake import Connector

    release = threading.Event()
    now = [0.0]

    def contact(session, identity):
        if identity == ATTACKER:
            release.wait(300)  # a listener that never answers, until the test lets go (300 s: a hang guard)
        return True, "", identity

    c = Connector(contact, threads=4, per_identity=2, waiting_per_identity=5, max_wait_s=10.0, clock=lambda: now[0])
    try:
        accepted = [c.start(f"silent-{k}:1", 1, ATTACKER) for k in range(8)]
        assert accepted == [True] * 7 + [False]  # 2 running, 5 waiting, the eighth refused
        assert c.stats["waited_identity"] == 5 and c.stats["refused_identity"] == 1
        # Another key's contact gets a thread at once, while the attacker's two still hang.
        assert c.start("honest:1", 1, HONEST)
        # While the attacker's hang (they are let go only below), so only a thread of its own answers it:
        # a loaded machine makes this slower, and only a build that queues it behind them runs out the guard.
        deadline = time.monotonic() + 300
        while not any(r[0] == "honest:1" for r in c.reports):
            assert time.monotonic() < deadline, "the honest contact waited behind the attacker's"
            time.sleep(0.001)
        assert ("honest:1", 1, True, "", HONEST) in c.reports
        # The attacker's waiting contacts outlive their wait: each is reported failed, not started.
        now[0] = 11.0
        release.set()
        deadline = time.monotonic() + 300  # only keeps a broken build from hanging
        while c.in_progress:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert c.stats["waited_too_long"] == 5 and c.stats["ok"] == 3
        failed = [r for r in c.reports if not r[2]]
        assert len(failed) == 5 and all("waited" in r[3] for r in failed)
    finally:
        release.set()
        c.close()


class CachingEngine:
    """The Mooncake engine's segment cache, as 0.3.13 keeps it, with our handshake in front: the
    transport fetches a session's descriptor (`descriptor`, what the receiver's handshake port gives),
    and the engine opens it under the name the relay hands it (`FakeRelay`), taking the segment's
    first buffer address then and keeping it for good. `hosts` maps a session to the receiver there
    now: (first buffer address, the page it holds)."""

    def __init__(self, hosts: dict[str, tuple[int, bytes]], probe_s: float = 0.0, open_s: float = 0.0):
        self.hosts, self.probe_s, self.open_s = hosts, probe_s, open_s
        self.opened: dict[str, bytes] = {}  # name -> the descriptor the relay handed the engine
        self.cached: dict[str, int] = {}  # name -> first buffer address when it was opened
        self.written: list[str] = []

    def descriptor(self, session: str, timeout_s: float) -> bytes:
        import json

        from epd_ring.executor.drivers.handshake import HandshakeError

        time.sleep(self.probe_s)
        if session not in self.hosts:
            raise HandshakeError("refused")
        return json.dumps({"name": session, "buffers": [{"addr": self.hosts[session][0]}]}).encode()

    def session_of(self, name: str) -> str:
        import json

        return json.loads(self.opened[name])["name"]

    def transfer_sync_read(self, name: str, local: int, remote: int, n: int) -> int:
        import ctypes
        import json

        if name not in self.cached:
            time.sleep(self.open_s)
            self.cached[name] = json.loads(self.opened[name])["buffers"][0]["addr"]
        if n == 0:
            return 0
        base, page = self.hosts[self.session_of(name)]
        if remote != base:
            return -1  # not within any buffer the receiver there registered
        ctypes.memmove(local, page, n)
        return 0

    def get_first_buffer_address(self, name: str) -> int:
        return self.cached[name]

    def transfer_submit_write(self, name: str, src: int, dst: int, n: int) -> int:
        self.written.append(name)
        return 1


class FakeRelay:
    """The relay's part: the engine opens each descriptor under a name never used before."""

    def __init__(self, engine: CachingEngine):
        self.engine, self.n = engine, 0

    def open(self, desc: bytes, engine_open) -> tuple[str, int]:
        self.n += 1
        name = f"127.1.0.{self.n}:1"
        self.engine.opened[name] = desc
        return name, engine_open(name)


def caching_transport(monkeypatch, engine: CachingEngine, **kw):
    from epd_ring.executor.drivers import mooncake

    monkeypatch.setattr(mooncake, "load_engine", lambda *a, **k: (engine, "10.0.0.1:15000"))
    t = mooncake.MooncakeTransport("10.0.0.1", **kw)
    t.fetch, t.relay = engine.descriptor, FakeRelay(engine)
    return t


def test_a_receiver_restarted_on_the_same_session_is_proven_at_its_new_buffer_and_written_there(monkeypatch):
    # Before: the page was read at the predecessor's first buffer from the engine's cache, and
    # failed for as long as the encoder lived (every room to the restarted receiver: peer_down).
    from epd_ring.executor.drivers.mooncake import owner_page

    session = "10.0.0.2:15000"
    engine = CachingEngine({session: (0x1000, owner_page(VICTIM))})
    t = caching_transport(monkeypatch, engine)
    assert t._contact(session, VICTIM) == (True, "", VICTIM)
    engine.hosts[session] = (0x9000, owner_page(VICTIM))  # restarted: same host:port, new buffers
    assert t._contact(session, VICTIM) == (True, "", VICTIM)
    assert t.stats["segments_opened_afresh"] == 1
    t.submit_write(session, [(1, 0x9000, 8)])
    (name,) = engine.written
    assert engine.cached[name] == 0x9000  # the loop writes through the segment just proven
    # A receiver whose memory never named a key costs no fresh segment, however often contacted.
    engine.hosts["10.0.0.3:15000"] = (0x2000, b"\0" * 64)
    for _ in range(3):
        assert t._contact("10.0.0.3:15000", HONEST)[0] is False
    assert t.stats["segments_opened_afresh"] == 1


def test_an_open_that_stalls_after_a_late_probe_answer_is_held_against_the_key_all_the_same(monkeypatch):
    # The peer answers its own probe: were the penalty kept for quick probes, an attacker would
    # answer late and stall the engine's opens again with every spelling.
    from epd_ring.executor.drivers.mooncake import owner_page

    engine = CachingEngine({"10.0.0.2:15000": (0x1000, owner_page(ATTACKER)),
                            "10.0.0.2:15001": (0x2000, owner_page(ATTACKER))}, probe_s=0.2, open_s=0.2)
    t = caching_transport(monkeypatch, engine, open_stall_s=0.05)
    assert t._contact("10.0.0.2:15000", ATTACKER) == (True, "", ATTACKER)
    assert t.stats["opens_stalled"] == 1
    assert t._contact("10.0.0.2:15001", ATTACKER)[0] is False
    assert t.stats["opens_refused_stalled"] == 1
    assert "10.0.0.2:15001" not in map(engine.session_of, engine.opened)  # refused without an open


def test_a_heartbeat_asks_the_receiver_not_the_engine(monkeypatch):
    # Before: the heartbeat read the ownership page through the engine: it queued behind another
    # key's open, and over a slow link behind the receiver's own writes on their lanes, so an
    # honest, busy receiver went down. Now it asks the receiver's handshake port, within its deadline.
    import threading

    from epd_ring.executor.drivers.mooncake import owner_page

    engine = CachingEngine({"10.0.0.2:15000": (0x1000, owner_page(VICTIM)),
                            "10.0.0.3:15000": (0x2000, owner_page(ATTACKER))})
    t = caching_transport(monkeypatch, engine)
    assert t._contact("10.0.0.2:15000", VICTIM) == (True, "", VICTIM)
    reads = len(engine.cached)

    def no_engine(*a):
        raise AssertionError("the heartbeat went through the engine")

    monkeypatch.setattr(engine, "transfer_sync_read", no_engine)
    with t._opening:  # another key's open, under way inside the engine
        done: list = []
        probe = threading.Thread(target=lambda: done.append(t._contact("10.0.0.2:15000", VICTIM, probe=True)))
        probe.start()
        probe.join(timeout=30)
        assert done == [(True, "", None)]
    assert len(engine.cached) == reads
    # Another process at that host:port now (its descriptor differs): the heartbeat fails, and a
    # stopped or gone receiver's handshake fails it too.
    engine.hosts["10.0.0.2:15000"] = (0x9000, owner_page(VICTIM))
    assert t._contact("10.0.0.2:15000", VICTIM, probe=True)[0] is False
    del engine.hosts["10.0.0.2:15000"]
    assert t._contact("10.0.0.2:15000", VICTIM, probe=True)[0] is False
    assert t.stats["heartbeats"] == 2 and t.stats["handshakes_failed"] == 1


@pytest.mark.parametrize("kw, setting", [
    (dict(stall_penalty_s=float("nan")), "stall_penalty_s"),  # compared false: the penalty was off
    (dict(stall_penalty_s=-1.0), "stall_penalty_s"),
    (dict(open_stall_s=-1), "open_stall_s"),
    (dict(open_stall_s=float("nan")), "open_stall_s"),
    (dict(open_stall_s=0), "open_stall_s"),  # every open would hold its key off
    (dict(max_respellings=-5), "max_respellings"),
    (dict(max_respellings=1.5), "max_respellings"),
    (dict(connector_threads=0), "connector_threads"),
    (dict(contacts_per_identity=0), "contacts_per_identity"),
    (dict(contacts_per_identity=True), "contacts_per_identity"),
    (dict(connect_timeout=0), "connect_timeout"),
    (dict(connect_timeout=float("inf")), "connect_timeout"),
    (dict(handshake_timeout_s=0), "handshake_timeout_s"),
    (dict(connect_timeout=2.0, handshake_timeout_s=3.0), "handshake_timeout_s"),  # past the connect deadline
    (dict(hostname=None), "hostname"),
    (dict(protocol=b"tcp"), "protocol"),
])
def test_mooncake_transport_settings_are_refused_before_the_engine_starts_naming_the_setting(monkeypatch, kw,
                                                                                              setting):
    # Before: stall_penalty_s=nan, open_stall_s=-1 and max_respellings=-5 were taken.
    from epd_ring.executor.drivers import mooncake

    def no_engine(*a, **k):
        raise AssertionError("the engine started before the settings were checked")

    monkeypatch.setattr(mooncake, "load_engine", no_engine)
    with pytest.raises((ValueError, TypeError), match=setting):
        mooncake.MooncakeTransport(**kw)


@pytest.mark.parametrize("kw, setting", [(dict(max_wait_s=float("nan")), "max_wait_s"),
                                         (dict(threads=0), "threads"), (dict(waiting_per_identity=-1),
                                                                        "waiting_per_identity")])
def test_connector_settings_are_refused_naming_the_setting(kw, setting):
    from epd_ring.executor.drivers.mooncake import Connector

    with pytest.raises(ValueError, match=setting):
        Connector(lambda session, identity: (True, "", None), **kw)


class Stalling(CachingEngine):
    """A first open of a spelling takes `open_s` on the transport's (fake) clock, not in real time."""

    def __init__(self, hosts, now: list, open_s: float):
        super().__init__(hosts)
        self.now, self.stall = now, open_s

    def transfer_sync_read(self, name, local, remote, n):
        if name not in self.cached:
            self.now[0] += self.stall
        return super().transfer_sync_read(name, local, remote, n)


def test_a_keys_stall_penalty_ends_after_stall_penalty_s(monkeypatch):
    from epd_ring.executor.drivers.mooncake import owner_page

    now = [0.0]
    engine = Stalling({"10.0.0.2:15000": (0x1000, owner_page(ATTACKER)),
                       "10.0.0.2:15001": (0x2000, owner_page(ATTACKER))}, now, open_s=5.0)
    t = caching_transport(monkeypatch, engine, clock=lambda: now[0], open_stall_s=2.0, stall_penalty_s=300.0)
    assert t._contact("10.0.0.2:15000", ATTACKER) == (True, "", ATTACKER)  # the open stalled 5 s
    assert t.stats["opens_stalled"] == 1
    now[0] += 299.0  # within the penalty: refused without an open
    assert t._contact("10.0.0.2:15001", ATTACKER)[0] is False
    assert "10.0.0.2:15001" not in map(engine.session_of, engine.opened)
    now[0] += 2.0  # past it: the key opens again
    assert t._contact("10.0.0.2:15001", ATTACKER) == (True, "", ATTACKER)
    assert t.stats["opens_refused_stalled"] == 1


def test_a_session_is_opened_afresh_at_most_max_respellings_times(monkeypatch):
    from epd_ring.executor.drivers.mooncake import owner_page

    session = "10.0.0.2:15000"
    engine = CachingEngine({session: (0x1000, owner_page(VICTIM))})
    t = caching_transport(monkeypatch, engine, max_respellings=2)
    assert t._contact(session, VICTIM) == (True, "", VICTIM)
    for k in range(2):  # each restart at new buffers costs one spelling
        engine.hosts[session] = (0x2000 + 0x1000 * k, owner_page(VICTIM))
        assert t._contact(session, VICTIM) == (True, "", VICTIM)
    engine.hosts[session] = (0x9000, owner_page(VICTIM))  # the third restart: the spellings are spent
    ok, _detail, owner = t._contact(session, VICTIM)
    assert not ok and owner is None
    assert t.stats["segments_opened_afresh"] == 2 and t.stats["respellings_refused"] == 1
    assert len(engine.cached) == 3  # the engine holds one descriptor per spelling, no more


def test_the_engines_handshake_connect_timeout_follows_the_connect_deadline(monkeypatch):
    # Before: unset, so the engine's connect waited its own 5 s whatever our deadline said.
    monkeypatch.delenv("MC_HANDSHAKE_CONNECT_TIMEOUT", raising=False)
    t = caching_transport(monkeypatch, CachingEngine({}), connect_timeout=7.5)
    assert os.environ["MC_HANDSHAKE_CONNECT_TIMEOUT"] == "8"  # whole seconds, rounded up
    assert t.handshake_timeout_s == pytest.approx(6.0)  # the handshake ends inside the deadline
    monkeypatch.setenv("MC_HANDSHAKE_CONNECT_TIMEOUT", "3")  # a user's own setting stands
    caching_transport(monkeypatch, CachingEngine({}), connect_timeout=7.5)
    assert os.environ["MC_HANDSHAKE_CONNECT_TIMEOUT"] == "3"


def test_each_key_whose_frames_make_peers_has_its_own_share_of_them():
    rig = make_rig(max_peers_per_identity=1)
    m = rig.manager
    for room, session, key in ((1, "a:1", ATTACKER), (2, "h:1", HONEST), (3, "a:2", ATTACKER)):
        rig.receiver(session)
        rig.executor.register(f"req-{room}", "prefill-host", 8998, room, receiver=key)
    assert m.register_receiver(rig.frame(1, "a:1", 2, identity=ATTACKER))
    assert m.register_receiver(rig.frame(2, "h:1", 2, identity=HONEST))  # the attacker's share is not the honest key's
    assert m.peers.per_identity == {ATTACKER: 1, HONEST: 1}
    assert not m.register_receiver(rig.frame(3, "a:2", 2, identity=ATTACKER))  # a:1 is busy: nothing to forget
    assert reason_kind(m, 3) is ReasonKind.CAPACITY


def test_every_room_of_another_key_on_a_proven_session_is_disowned_and_counted():
    rig = proving_rig()
    Proving(rig, {"victim:1": VICTIM})
    for room in (8, 9):
        rig.executor.register(f"req-{room}", "prefill-host", 8998, room, receiver=ATTACKER)
        assert rig.manager.register_receiver(rig.frame(room, "victim:1", 2, identity=ATTACKER))
    rig.executor.poll()
    assert all(reason_kind(rig.manager, r) is ReasonKind.FOREIGN for r in (8, 9))
    assert rig.manager.stats["rooms_disowned"] == 2
