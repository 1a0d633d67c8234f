"""Settings: each one checked by name at construction (manager, peer table, executor), the shared
number checks, the defaults, and what the default timeouts do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import ManagerRig, TableTower, drive, reason_kind, reason_text

from epd_ring.executor import EncodeExecutor, EncodeManager, FakeClock, LoopbackTransport, MonotonicClock
from epd_ring.executor.core import settings
from epd_ring.executor.core.reasons import ReasonKind
from epd_ring.executor.core.settings import count, seconds

# -- the shared number checks ------------------------------------------------------------------

def refusal(err, setting: str, value, rule: str) -> bool:
    """A refused setting names itself first, the rule it broke, and the value it was given."""
    message = str(err.value)
    return message.startswith(f"{setting} ") and rule in message and message.endswith(repr(value))


def test_seconds_accepts_every_finite_non_negative_number_as_a_float():
    for value, want in ((0, 0.0), (0.5, 0.5), (3, 3.0), (1e9, 1e9)):
        got = seconds("park_timeout", value)
        assert got == want and type(got) is float


@pytest.mark.parametrize("value, rule", [
    (True, "number"), ("5", "number"), (None, "number"),
    (float("nan"), ">= 0"), (float("inf"), ">= 0"), (-0.001, ">= 0"), (-1, ">= 0"),
])
def test_seconds_refuses_with_a_message_naming_the_setting(value, rule):
    with pytest.raises(ValueError) as err:
        seconds("park_timeout", value)
    assert refusal(err, "park_timeout", value, rule)


def test_count_accepts_integers_at_or_above_the_minimum_which_defaults_to_zero():
    assert count("max_deferred", 0) == 0 and count("max_deferred", 7) == 7
    assert count("max_tombstones", 1, 1) == 1


@pytest.mark.parametrize("value, minimum, rule", [
    (False, 0, "integer"), ("3", 0, "integer"), (2.0, 0, "integer"), (-1, 0, ">= 0"), (0, 1, ">= 1"),
])
def test_count_refuses_with_a_message_naming_the_setting(value, minimum, rule):
    with pytest.raises(ValueError) as err:
        count("max_deferred", value, minimum)
    assert refusal(err, "max_deferred", value, rule)


# -- the manager -------------------------------------------------------------------------------

DURATIONS = ["park_timeout", "announce_timeout", "write_timeout", "quarantine_s", "tombstone_ttl"]


BOUNDS = ["max_tombstones", "max_announced", "max_announced_per_identity", "max_sessions_per_identity"]


@pytest.mark.parametrize("name", DURATIONS)
def test_a_bad_duration_is_refused_naming_its_setting(name):
    t = LoopbackTransport(FakeClock())
    for bad, rule in [(-1, ">= 0"), (float("nan"), ">= 0"), ("5", "number"),
                      (None if name != "announce_timeout" else "x", "number")]:
        with pytest.raises(ValueError) as e:
            EncodeManager(t, **{name: bad})
        assert refusal(e, name, bad, rule)
    assert getattr(EncodeManager(t, **{name: 0}), name) == 0.0  # zero is a valid duration


@pytest.mark.parametrize("name", BOUNDS)
def test_a_bad_bound_is_refused_naming_its_setting(name):
    t = LoopbackTransport(FakeClock())
    for bad, rule in [(0, ">= 1"), (-5, ">= 1"), (2.0, "integer"), (None, "integer")]:
        with pytest.raises(ValueError) as e:
            EncodeManager(t, **{name: bad})
        assert refusal(e, name, bad, rule)
    m = EncodeManager(t, **{name: 1})  # one is the smallest bound that still lets work through
    assert (m.max_tombstones, m.max_announced, m.tenancy.max_announced_per_identity,
            m.tenancy.max_sessions_per_identity)[BOUNDS.index(name)] == 1


def test_peer_settings_reach_the_peer_table():
    t = LoopbackTransport(FakeClock())
    m = EncodeManager(t, connect_timeout=2.5, peer_backoff=7.0, peer_fail_threshold=2, max_peers=9)
    assert (m.peers.connect_timeout, m.peers.backoff, m.peers.fail_threshold, m.peers.max_peers) == (2.5, 7.0, 2, 9)
    with pytest.raises(ValueError) as e:
        EncodeManager(t, connect_timeout=0)
    assert refusal(e, "connect_timeout", 0, "> 0")


def test_the_parked_bound_is_checked_and_set_by_the_manager_or_as_a_share_of_the_ring():
    t = LoopbackTransport(FakeClock())
    for bad, rule in [(0, ">= 1"), (-5, ">= 1"), (2.0, "integer"), ("x", "integer"), (True, "integer")]:
        with pytest.raises(ValueError) as e:
            EncodeManager(t, max_parked_bytes=bad)
        assert refusal(e, "max_parked_bytes", bad, rule)
    assert EncodeManager(t).max_parked_bytes is None  # the manager alone sets no bound
    assert EncodeManager(t, max_parked_bytes=1).max_parked_bytes == 1
    # The executor sets its share of the arenas (half by default) unless the manager has a bound.
    m = EncodeManager(t)
    EncodeExecutor(m, TableTower(n_deep=3), "cpu", arena_bytes=4096)
    assert m.max_parked_bytes == (4096 + 3 * 4096) // 2
    m = EncodeManager(t)
    EncodeExecutor(m, TableTower(), "cpu", arena_bytes=4096, parked_ring_share=0.25)
    assert m.max_parked_bytes == 1024
    m = EncodeManager(t, max_parked_bytes=640)
    EncodeExecutor(m, TableTower(), "cpu", arena_bytes=4096, parked_ring_share=0.25)
    assert m.max_parked_bytes == 640
    m = EncodeManager(t)
    EncodeExecutor(m, TableTower(), "cpu", arena_bytes=4096, parked_ring_share=1.0)
    assert m.max_parked_bytes is None


def test_defaults():
    clock = FakeClock()
    t = LoopbackTransport(clock)
    m = EncodeManager(t)
    assert m.clock is clock  # the transport's clock when none is given
    assert (m.park_timeout, m.announce_timeout, m.write_timeout, m.quarantine_s, m.tombstone_ttl) == (
        120.0, 120.0, 60.0, 30.0, 600.0)
    assert (m.max_tombstones, m.max_announced) == (65536, 4096)
    assert (m.tenancy.max_sessions_per_identity, m.tenancy.max_announced_per_identity) == (256, 1024)
    assert (m.peers.connect_timeout, m.peers.backoff, m.peers.fail_threshold, m.peers.max_peers) == (5.0, 5.0, 3, 4096)
    assert m.polled_at is None and m.observer is None and len(m.deadlines) == 0
    assert m.rooms == {} and len(m.tombstones) == 0 and m.pinned == {} and not m.stats
    assert m.oldest_write_age() == 0.0 and m.writes_in_flight == 0 and m.snapshot() == {}


def test_default_timeouts_at_work():
    b = ManagerRig(park_timeout=120.0, write_timeout=60.0, quarantine_s=30.0)
    m = drive(EncodeManager(b.t, b.clock))  # all defaults, on the bench's transport and ring
    b.m = m
    b.ring.actions = m.actions  # the bench's ring is coupled to the manager under test
    assert m.register_receiver(b.frame(1, "p1"))
    assert m.deadline_of(1) == 120.0  # announce waits as long as park unless told otherwise
    assert m.bind_sender(2) == "registered" and m.submit_chunk(2, b.chunk())
    assert m.deadline_of(2) == 120.0
    assert m.bind_sender(1) == "ready"
    b.t.inject("timeout")
    assert m.submit_chunk(1, b.chunk())
    m.poll()  # the write timed out: its extent waits out the quarantine
    assert reason_kind(m, 1) is ReasonKind.WRITE_TIMED_OUT
    assert b.ring.counts()["quarantined"] == 1
    b.clock.advance(29.999)
    m.poll()
    assert b.ring.counts()["quarantined"] == 1
    b.clock.advance(0.001)
    m.poll()
    assert b.ring.counts()["quarantined"] == 0
    b.clock.advance(90.0)  # t = 120: room 2's park deadline
    m.poll()
    assert reason_kind(m, 2) is ReasonKind.PARK_TIMEOUT
    # a write with no report fails its room at the default write deadline
    assert m.bind_sender(3) == "registered" and m.register_receiver(b.frame(3, "p3"))
    b.t.inject("hold")
    assert m.submit_chunk(3, b.chunk())
    b.clock.advance(59.999)
    m.poll()
    assert m.room_status(3) == "transferring" and m.oldest_write_age() == pytest.approx(59.999)
    b.clock.advance(0.001)
    m.poll()
    assert reason_kind(m, 3) is ReasonKind.WRITE_DEADLINE and "p3" in reason_text(m, 3).split()


def test_clock_comes_from_the_caller_then_the_transport_then_the_system():
    from epd_ring.executor import Transport

    class Bare(Transport):
        def register_memory(self, regions, owner=None):
            pass

        def submit_write(self, session, bufs):
            return 1

        def poll(self):
            return []

        def notify(self, frame, room, status, reason=""):
            pass

    assert EncodeManager(LoopbackTransport(FakeClock(100.0)), FakeClock(5.0)).clock.now() == 5.0
    assert EncodeManager(LoopbackTransport(FakeClock(100.0))).clock.now() == 100.0
    assert isinstance(EncodeManager(Bare()).clock, MonotonicClock)
    t = Bare()
    assert EncodeManager(t).transport is t


# -- the peer table ----------------------------------------------------------------------------

def test_peer_table_settings_are_checked_by_name_and_default_like_the_manager():
    from epd_ring.executor.core.peers import PeerTable
    from epd_ring.executor.core.timers import Deadlines

    clock = FakeClock()
    t = LoopbackTransport(clock)
    plain = PeerTable(t, clock, Deadlines())
    m = EncodeManager(LoopbackTransport(clock), clock).peers
    # one set of defaults, whether the table is built alone or by the manager
    assert (plain.connect_timeout, plain.backoff, plain.fail_threshold, plain.max_peers) == \
        (m.connect_timeout, m.backoff, m.fail_threshold, m.max_peers) == (5.0, 5.0, 3, 4096)
    # the table's arguments are named as the manager's settings are
    bad = [(dict(connect_timeout=0), "connect_timeout", "> 0"),
           (dict(connect_timeout="soon"), "connect_timeout", "number"),
           (dict(backoff=-1.0), "peer_backoff", ">= 0"), (dict(fail_threshold=0), "peer_fail_threshold", ">= 1"),
           (dict(max_peers=0), "max_peers", ">= 1"), (dict(probe_interval=-1.0), "peer_probe_interval", ">= 0"),
           (dict(max_bytes=0), "max_peer_bytes", ">= 1"),
           (dict(max_peers_per_identity=0), "max_peers_per_identity", ">= 1")]
    for kw, setting, rule in bad:
        with pytest.raises(ValueError) as e:
            PeerTable(t, clock, Deadlines(), **kw)
        assert refusal(e, setting, *kw.values(), rule)
    one = PeerTable(t, clock, Deadlines(), fail_threshold=1, max_peers=1)  # 1 is allowed for both
    assert (one.fail_threshold, one.max_peers) == (1, 1)


# -- the executor ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, n_deep, setting, rule", [
    (dict(arena_bytes=0), 0, "arena_bytes", ">= 64"),
    (dict(arena_bytes=100), 0, "arena_bytes", "multiple of 64"),
    (dict(arena_bytes=4096.0), 0, "arena_bytes", "integer"),
    (dict(max_item_bytes=0), 0, "max_item_bytes", ">= 1"),
    (dict(deep_arena_bytes=-64), 3, "deep_arena_bytes", ">= 0"),
    (dict(deep_arena_bytes=100), 3, "deepstack arena bytes", "multiple of 64"),  # the ring's own check
    (dict(ring_slots=0), 0, "ring_slots", ">= 1"),
    (dict(ring_slots=2.0), 0, "ring_slots", "integer"),
    (dict(ring_bytes=0), 0, "ring_bytes", ">= 1"),
    (dict(ring_bytes="4096"), 0, "ring_bytes", "integer"),
    (dict(ring_bytes=1), 0, "ring_bytes", "multiple of 64"),
    (dict(max_deferred=-1), 0, "max_deferred", ">= 0"),
    (dict(max_deferred=True), 0, "max_deferred", "integer"),
    (dict(peer_ring_share=0), 0, "peer_ring_share", "(0, 1]"),
    (dict(parked_ring_share=0), 0, "parked_ring_share", "(0, 1]"),
    (dict(parked_ring_share=1.5), 0, "parked_ring_share", "(0, 1]"),
    (dict(parked_ring_share=float("nan")), 0, "parked_ring_share", "(0, 1]"),
    (dict(parked_ring_share=True), 0, "parked_ring_share", "(0, 1]"),
    (dict(parked_ring_share="0.5"), 0, "parked_ring_share", "(0, 1]"),
    (dict(identity_ring_share=0), 0, "identity_ring_share", "(0, 1]"),
    (dict(identity_ring_share=2.0), 0, "identity_ring_share", "(0, 1]"),
    (dict(max_pieces=0), 0, "max_pieces", "from 1 to 8"),  # the ring's own check
    (dict(max_pieces=9), 0, "max_pieces", "from 1 to 8"),
    (dict(max_pieces=2.0), 0, "max_pieces", "integer"),
    (dict(max_pieces=True), 0, "max_pieces", "integer"),
    (dict(), -1, "model.num_deepstack_embeddings", ">= 0"),
    (dict(), 1.5, "model.num_deepstack_embeddings", "integer"),
])
def test_constructor_refuses_bad_sizes_naming_the_setting(kw, n_deep, setting, rule):
    clock = FakeClock()
    manager = EncodeManager(LoopbackTransport(clock), clock)
    tower = TableTower()
    tower.num_deepstack_embeddings = n_deep
    base = {} if set(kw) & {"ring_slots", "ring_bytes", "arena_bytes"} else {"arena_bytes": 4096}
    with pytest.raises(ValueError) as err:
        EncodeExecutor(manager, tower, "cpu", **{**base, **kw})
    assert refusal(err, setting, next(iter(kw.values())) if kw else n_deep, rule)


def test_fixed_extent_settings_map_onto_the_arena_and_do_not_mix_with_it():
    clock = FakeClock()
    manager = EncodeManager(LoopbackTransport(clock), clock)
    # ring_slots x ring_bytes: an arena that holds that many of the largest items, each capped at ring_bytes
    ex = EncodeExecutor(manager, TableTower(n_deep=3), "cpu", ring_slots=3, ring_bytes=128)
    assert (ex.ring.arena_bytes, ex.ring.max_item_bytes, ex.ring.deep_bytes, ex.max_deferred) == (384, 128, 1152, 24)
    # either one alone takes the other's default: 64 extents, or 256 MiB per extent
    ex = EncodeExecutor(manager, TableTower(), "cpu", ring_bytes=128)
    assert (ex.ring.arena_bytes, ex.ring.max_item_bytes) == (64 * 128, 128)
    assert settings.arena(None, None, 3, None) == (3 * (256 << 20), 256 << 20, 3)
    for mixed in (dict(ring_slots=3, arena_bytes=4096), dict(ring_bytes=128, max_item_bytes=64)):
        with pytest.raises(ValueError, match="arena_bytes"):
            EncodeExecutor(manager, TableTower(), "cpu", **mixed)


def test_constructor_defaults_and_smallest_sizes():
    clock = FakeClock()
    manager = EncodeManager(LoopbackTransport(clock), clock)
    ex = EncodeExecutor(manager, TableTower(), "cpu")
    assert (ex.ring.arena_bytes, ex.ring.max_item_bytes, ex.max_deferred) == (2 << 30, None, 8 * 64)
    assert ex.ring.deep is None
    ex = EncodeExecutor(manager, TableTower(n_deep=3), "cpu", arena_bytes=64, max_deferred=0)
    assert (ex.ring.arena_bytes, ex.ring.deep_bytes, ex.max_deferred) == (64, 3 * 64, 0)
    ex = EncodeExecutor(manager, TableTower(n_deep=3), "cpu", arena_bytes=64, deep_arena_bytes=128)
    assert ex.ring.deep_bytes == 128  # a deepstack arena of its own size


def test_a_public_call_refusing_an_argument_names_the_call_and_the_argument():
    m = EncodeManager(LoopbackTransport(FakeClock()))
    for call, name in ((lambda: m.fail_room("7", "why"), "fail_room: room_id"),
                       (lambda: m.withdraw(-1, "s"), "withdraw: room_id"),
                       (lambda: m.withdraw(1, 5), "withdraw: session"),
                       (lambda: m.withdraw(1, "s", 5), "withdraw: status_endpoint"),
                       (lambda: m.withdraw(1, "s", "", 5), "withdraw: identity")):
        with pytest.raises((TypeError, ValueError)) as err:
            call()
        assert str(err.value).startswith(f"{name} "), name


def test_a_port_is_0_to_65535_and_a_refusal_names_it():
    assert settings.port("bootstrap_port", 65535) == 65535 and settings.port("bootstrap_port", 0) == 0
    with pytest.raises(ValueError) as err:
        settings.port("bootstrap_port", 65536)
    assert refusal(err, "bootstrap_port", 65536, "0 to 65535")
    with pytest.raises(ValueError) as err:
        settings.port("bootstrap_port", "80")
    assert refusal(err, "bootstrap_port", "80", "integer")


def test_register_refuses_a_bad_bootstrap_address_naming_the_argument():
    clock = FakeClock()
    ex = EncodeExecutor(EncodeManager(LoopbackTransport(clock), clock), TableTower(), "cpu", arena_bytes=4096)
    for host, port, setting, rule, kind in (("h", 65536, "bootstrap_port", "0 to 65535", ValueError),
                                             ("h", "80", "bootstrap_port", "integer", ValueError),
                                             ("h", -1, "bootstrap_port", ">= 0", ValueError),
                                             (b"h", 80, "bootstrap_host", "str", TypeError)):
        with pytest.raises(kind) as err:
            ex.register("r", host, port, 1)
        assert refusal(err, setting, port if setting == "bootstrap_port" else host, rule)
    assert not ex.senders  # nothing of a refused call was kept
    ex.register("r", "h", 65535, 1)
    assert "r" in ex.senders
