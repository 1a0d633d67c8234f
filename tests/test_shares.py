"""Fair shares by identity (issue 30): one identity, one stuck receiver or one slow peer cannot starve
another identity's rooms. Loopback transport, fake clock; the four cases of the issue, each with a
victim identity "V" and an attacker "A" on an arena of eight items."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import Calls, make_rig, managed, reason_kind

from epd_ring.executor import Outcome
from epd_ring.executor.core.reasons import ReasonKind
from epd_ring.executor.core.ring import Ring

ITEM_COST = Ring.extent_cost(3 * 8 * 4)  # one three-token item of the rig's tower


def rig8(**kw):
    return make_rig(arena_bytes=8 * ITEM_COST, **kw)


def room(rig, k, session, key, *, frame=True):
    """Register room k's request for identity `key` (and its receiver's frame): (request id, item)."""
    rid = f"req-{k}"
    rig.executor.register(rid, "prefill", 1, k, receiver=key)
    if frame:
        rig.manager.register_receiver(rig.frame(k, session, 3, identity=key))
    return rid, rig.item(3, k)


def run(rig, *items):
    rig.executor.execute(list(items))
    rig.executor.poll()


def turn(rig, queue):
    """One turn of the loop docs/embedding.md teaches: tick, then a tower run if the arena can take it."""
    rig.executor.poll()
    if queue and rig.executor.can_take():
        rig.executor.execute([queue.pop(0)])


def held(rig, key):
    return rig.manager.shares.of(key).held


def known(rig, *keys):
    """Each identity's first room, so the shares know them all (the ring splits among identities seen)."""
    for n, key in enumerate(keys):
        rig.receiver(f"first-{key}")
        run(rig, room(rig, 10_000 + n, f"first-{key}", key))
        assert rig.manager.room_status(10_000 + n) == "success"


# -- 1: the loop's gate asks whether the arena can take an item, not whether anything is deferred -----

def test_a_send_deferred_by_its_own_bound_does_not_close_the_loop_for_other_identities():
    rig = rig8()
    rig.receiver("a")
    rig.receiver("v")
    rig.transport.inject("hold", session="a", count=1 << 30)  # a stuck receiver: its writes never report
    queue = [room(rig, k, "a", "A") for k in range(5)]
    for _ in range(5):
        turn(rig, queue)
    assert rig.executor.deferred_requests() == ["req-4"]  # past a's bound: it waits, passed over
    assert rig.executor.has_deferred()  # the seed's meaning stands
    queue.append(room(rig, 100, "v", "V"))
    turn(rig, queue)  # no clock advance: the victim's room is not kept waiting for a's to fail
    rig.executor.poll()
    assert rig.manager.room_status(100) == "success" and rig.delivered_ok(100, "v", rig.item(3, 100))
    assert rig.executor.can_take()


def test_the_gate_closes_when_the_deferred_queue_holds_all_it_may_though_every_send_is_passed_over():
    rig = rig8(max_deferred=2)
    rig.receiver("a")
    rig.transport.inject("hold", session="a", count=1 << 30)
    for k in range(5):  # past a's bound (half the ring) from the fifth on: passed over, nobody waits for bytes
        run(rig, room(rig, k, "a", "A"))
    assert rig.executor.deferred_count == 1 and rig.executor.can_take()
    run(rig, room(rig, 5, "a", "A"))
    assert rig.executor.deferred_count == 2 and not rig.executor.can_take()  # a third would find no place


def test_the_gate_closes_while_a_send_within_every_bound_waits_for_bytes_and_opens_when_they_free():
    rig = rig8()
    sessions = [f"p{k}" for k in range(9)]
    for s in sessions:
        rig.transport.inject("hold", session=s)
    run(rig, *(room(rig, k, sessions[k], "") for k in range(8)))  # eight receivers, one item each: full
    assert rig.executor.ring.live == 8 and rig.executor.can_take()
    run(rig, room(rig, 8, sessions[8], ""))
    assert rig.executor.deferred_requests() == ["req-8"] and not rig.executor.can_take()
    rig.transport.complete(rig.transport.held[0], Outcome.DONE)
    rig.executor.poll()
    assert rig.executor.can_take() and not rig.executor.has_deferred()


def test_the_gate_closes_as_soon_as_execute_defers_a_send_for_bytes_not_at_the_next_tick():
    # A loop may ask the gate right after `execute`: a send it just deferred for bytes closes it then.
    rig = rig8()
    sessions = [f"p{k}" for k in range(9)]
    for s in sessions:
        rig.transport.inject("hold", session=s)
    run(rig, *(room(rig, k, sessions[k], "") for k in range(8)))
    rig.executor.execute([room(rig, 8, sessions[8], "")])
    assert rig.executor.deferred_requests() == ["req-8"] and not rig.executor.can_take()
    # and a send deferred by a bound (a stuck receiver's peer holds half the ring) leaves it open then
    rig = rig8()
    rig.receiver("a")
    rig.transport.inject("hold", session="a", count=1 << 30)
    for k in range(4):
        run(rig, room(rig, k, "a", "A"))
    rig.executor.execute([room(rig, 4, "a", "A")])
    assert rig.executor.deferred_requests() == ["req-4"] and rig.executor.can_take()


# -- 2: quarantined extents count against the identity whose receivers caused them ------------------

@pytest.mark.parametrize("fault", ["fail", "timeout"])
def test_an_identity_whose_writes_fail_cannot_fill_the_ring_with_quarantined_extents(fault):
    rig = rig8(quarantine_s=30.0)
    known(rig, "V", "A")
    rig.receiver("a")
    rig.receiver("v")
    rig.transport.inject(fault, session="a", count=1 << 30)
    for step in range(40):  # 10 s of an attacker whose every write fails, 30 s quarantine each
        a, v = 2 * step, 2 * step + 1
        run(rig, room(rig, a, "a", "A"))
        run(rig, room(rig, v, "v", "V"))
        rig.executor.poll()
        assert rig.manager.room_status(v) == "success", step  # at once: never deferred
        assert held(rig, "A") <= 4 * ITEM_COST  # quarantined bytes are A's, within its half
        rig.clock.advance(0.25)
    assert any(s.state == "quarantined" for s in rig.executor.ring.extents.values())
    assert reason_kind(rig.manager, 0) in (ReasonKind.WRITE_FAILED, ReasonKind.WRITE_TIMED_OUT)


# -- 3: all sessions of one key share one budget ------------------------------------------------------

def test_an_identity_with_many_sessions_holds_one_share_not_one_per_session():
    rig = rig8(write_timeout=120.0)
    rig.manager.shares.idle_s = 1e9  # V stays known through the 120 s below (forgetting: its own test)
    known(rig, "V", "A")
    rig.receiver("v")
    for s in range(4):
        rig.receiver(f"a{s}")
        rig.transport.inject("hold", session=f"a{s}", count=1 << 30)
    for k in range(16):  # each session's peer alone may hold half the ring
        run(rig, room(rig, k, f"a{k % 4}", "A"))
    assert held(rig, "A") == 4 * ITEM_COST and rig.executor.ring.live == 4
    assert rig.manager.stats["identity_held_back"] > 0
    for k in range(100, 120):
        run(rig, room(rig, k, "v", "V"))
        assert rig.manager.room_status(k) == "success"
    rig.clock.advance(120.0)
    rig.executor.poll()
    assert {reason_kind(rig.manager, k) for k in range(4, 16)} == {ReasonKind.CAPACITY}


# -- 4: parked chunks and deferred places are per identity ---------------------------------------------

def test_an_identity_parking_rooms_takes_neither_the_victims_parked_share_nor_its_deferred_places():
    rig = rig8(max_deferred=8, park_timeout=60.0)
    known(rig, "V", "A")
    rig.receiver("v")
    for k in range(20):  # rooms whose receivers never register, and more than the queue holds
        run(rig, room(rig, k, "a", "A", frame=False))
    assert rig.manager.shares.of("A").parked == 4 * ITEM_COST  # its parked bound (half the ring)
    assert len(rig.manager.shares.of("A").queue) == 4  # its part of the queue (half of 8)
    assert reason_kind(rig.manager, 19) is ReasonKind.DEFERRED_FULL
    for k in range(100, 110):  # the victim's frames come 0.1 s after its items
        run(rig, room(rig, k, "v", "V", frame=False))
        assert rig.manager.is_parked(k)
        rig.clock.advance(0.1)
        rig.manager.register_receiver(rig.frame(k, "v", 3, identity="V"))
        rig.executor.poll()
        assert rig.manager.room_status(k) == "success"


def test_an_identity_that_filled_the_queue_alone_gives_places_up_to_a_newcomer():
    rig = rig8(max_deferred=8, park_timeout=60.0)
    known(rig, "A")
    obs = rig.manager.observer = Calls("undeferred")
    for k in range(12):
        run(rig, room(rig, k, "a", "A", frame=False))
    assert rig.executor.deferred_count == 8  # alone, all of it
    rig.receiver("v")
    rig.transport.inject("hold", session="v", count=1 << 30)
    for k in range(100, 108):
        run(rig, room(rig, k, "v", "V"))
    # The ring's free half took V's first four; V's next four took places A held past its new part
    # (its newest sends fail), and no room of V's failed.
    assert [rig.manager.room_status(k) for k in range(100, 104)] == ["transferring"] * 4
    assert rig.executor.deferred_requests() == [f"req-{k}" for k in (4, 5, 6, 7, 104, 105, 106, 107)]
    assert rig.executor.stats["deferred_evicted"] == 4
    assert all(reason_kind(rig.manager, k) is ReasonKind.DEFERRED_FULL for k in range(8, 12))
    # each evicted send left the queue as far as the observer knows (a metrics driver keeps each
    # deferred room's start until then)
    assert {("undeferred", k) for k in range(8, 12)} <= set(obs.calls)


def test_a_send_whose_sender_was_reaped_can_be_evicted_and_fails_no_room():
    # W's large head waits for bytes, so the serving stops there and never reaches W's second send, whose
    # room ended and whose sender was reaped; a third identity shrinks the parts and W is first past its own
    rig = rig8(max_deferred=4, park_timeout=60.0)
    known(rig, "A", "W")
    ex, m = rig.executor, rig.manager
    rig.receiver("a")
    rig.transport.inject("hold", session="a", count=1 << 30)
    for k in range(4):  # A's whole share: half the ring
        run(rig, room(rig, k, "a", "A"))
    rig.receiver("w")
    ex.register("req-10", "prefill", 1, 10, receiver="W")
    m.register_receiver(rig.frame(10, "w", 20, identity="W"))
    ex.execute([("req-10", rig.item(20, 10))])  # more than the free half: it waits for bytes
    run(rig, room(rig, 11, "w", "W"))
    for k in (4, 5):  # past A's share: held back
        run(rig, room(rig, k, "a", "A"))
    assert ex.deferred_requests() == ["req-10", "req-11", "req-4", "req-5"] and ex.deferred_count == 4
    m.fail_room(11, "aborted")
    ex.reap_concluded_senders()
    rig.receiver("v")
    ex.execute([room(rig, 20, "v", "V")])
    assert ex.stats["deferred_evicted"] == 1 and ex.deferred_requests() == ["req-10", "req-4", "req-5", "req-20"]
    assert m.room_status(20) == "ready" and m.room_status(10) == "ready" and reason_kind(m, 11) is ReasonKind.CALLER


@pytest.mark.parametrize("case", ["staged", "reaped", "concluded", "changed"])
def test_a_send_behind_a_held_back_one_leaves_the_queue_and_the_held_back_one_keeps_its_place(case):
    # One identity's queue: room 8's send, held back by its receiver's peer bound (a holds half the ring),
    # then room 9's, within every bound, waiting for bytes. Bytes come free: room 9's send is the one that
    # leaves the queue (staged, dropped with its reaped sender, dropped for its concluded room, or failed
    # for an item changed since), never the held-back one ahead of it.
    rig = rig8(max_deferred=8, park_timeout=60.0)
    ex, m, t = rig.executor, rig.manager, rig.transport
    obs = m.observer = Calls("undeferred")
    for session in ("a", "b", "c"):
        rig.receiver(session)
        t.inject("hold", session=session, count=1 << 30)
    for k in range(8):  # a at its peer's bound, then the ring full
        run(rig, room(rig, k, "a" if k < 4 else "b" if k < 7 else "c", "A"))
    run(rig, room(rig, 8, "a", "A"))
    run(rig, room(rig, 9, "c", "A"))
    assert ex.deferred_requests() == ["req-8", "req-9"] and ex.stats["held_back"] == 1
    if case in ("reaped", "concluded"):
        m.fail_room(9, "aborted")
        if case == "reaped":
            ex.reap_concluded_senders()
    elif case == "changed":
        m.shares.of("A").queue[1][1].encoded = None  # the caller dropped its embedding meanwhile
    t.complete(t.held[4])  # one of b's writes: its extent comes free
    ex.poll()
    ex.poll()
    assert ex.deferred_requests() == ["req-8"]
    stat = {"staged": "told_success", "reaped": "deferred_dropped", "concluded": "items_for_concluded_rooms",
            "changed": "failed"}[case]
    assert ex.stats[stat] == 1
    assert obs.calls == ([] if case == "reaped" else [("undeferred", 9)])
    want = {"staged": None, "reaped": ReasonKind.CALLER, "concluded": ReasonKind.CALLER, "changed": ReasonKind.ITEM}
    assert m.room_status(9) == ("transferring" if case == "staged" else "failed")
    assert case == "staged" or reason_kind(m, 9) is want[case]


def test_with_every_identity_at_its_part_a_full_queue_fails_the_newcomers_send_and_evicts_none():
    # a fixed part (half the queue each) and three identities: two fill the queue exactly to their parts
    rig = rig8(max_deferred=8, park_timeout=60.0, identity_ring_share=0.5)
    for key in ("A", "V"):
        for k in range(8):  # half the ring parked, half the queue deferred
            run(rig, room(rig, ord(key) * 100 + k, key.lower(), key, frame=False))
    assert rig.executor.deferred_count == 8
    assert [len(rig.manager.shares.of(key).queue) for key in ("A", "V")] == [4, 4]
    run(rig, room(rig, 1, "c", "C", frame=False))
    assert reason_kind(rig.manager, 1) is ReasonKind.DEFERRED_FULL  # nobody was past its part
    assert rig.executor.stats["deferred_evicted"] == 0 and rig.executor.deferred_count == 8


def test_no_deferred_place_at_all_fails_a_send_that_does_not_fit_whatever_the_identitys_part():
    rig = rig8(max_deferred=0, identity_ring_share=0.5)
    rig.receiver("a")
    rig.transport.inject("hold", session="a", count=1 << 30)
    for k in range(5):  # half the ring each identity: the fifth is held back, and nothing may wait
        run(rig, room(rig, k, "a", "A"))
    assert reason_kind(rig.manager, 4) is ReasonKind.DEFERRED_FULL
    assert rig.executor.deferred_count == 0 and rig.executor.stats["deferred_evicted"] == 0


def test_deferred_sends_are_served_round_robin_by_identity():
    rig = rig8(park_timeout=60.0, identity_ring_share=1.0)
    for s in ("a", "v"):
        rig.receiver(s)
        rig.transport.inject("hold", session=s, count=1 << 30)
    other = [f"o{k}" for k in range(8)]
    for s in other:
        rig.transport.inject("hold", session=s)
    run(rig, *(room(rig, 1000 + k, other[k], "O") for k in range(8)))  # the arena is full
    for k in range(6):
        run(rig, room(rig, k, "a", "A"))
    for k in range(100, 103):
        run(rig, room(rig, k, "v", "V"))
    assert rig.executor.deferred_requests()[:6] == [f"req-{k}" for k in range(6)]
    for h in list(rig.transport.held)[:4]:  # four items' bytes free: A, V, A, V are served
        rig.transport.complete(h, Outcome.DONE)
    rig.executor.poll()
    served = {k for k in (*range(6), *range(100, 103)) if rig.manager.room_status(k) == "transferring"}
    assert served == {0, 1, 100, 101}


def test_a_room_claimed_by_a_frame_moves_its_charge_to_that_identity():
    rig = rig8(park_timeout=60.0)
    rig.executor.register("req-1", "prefill", 1, 1)  # no identity named by the engine
    run(rig, ("req-1", rig.item(3, 1)))
    assert rig.manager.is_parked(1) and held(rig, None) == ITEM_COST
    rig.transport.inject("hold", session="a")
    rig.manager.register_receiver(rig.frame(1, "a", 3, identity="A"))
    rig.executor.poll()
    assert held(rig, None) == 0 and held(rig, "A") == ITEM_COST
    assert rig.manager.shares.of(None).parked == 0 == rig.manager.shares.of("A").parked
    rig.transport.complete(rig.transport.held[0], Outcome.DONE)
    rig.executor.poll()
    assert rig.manager.room_status(1) == "success" and held(rig, "A") == 0


def test_identity_ring_share_is_checked_and_a_fixed_share_holds_before_a_second_identity_comes():
    with pytest.raises(ValueError, match="identity_ring_share"):
        rig8(identity_ring_share=0)
    rig = rig8(identity_ring_share=0.25, write_timeout=5.0)
    rig.transport.inject("hold", count=1 << 30)
    for k in range(4):
        run(rig, room(rig, k, f"a{k}", "A"))
    assert held(rig, "A") == 2 * ITEM_COST and rig.executor.deferred_requests() == ["req-2", "req-3"]
    rig.clock.advance(5.0)
    rig.executor.poll()
    assert reason_kind(rig.manager, 2) is ReasonKind.CAPACITY  # a bounded wait, like a peer's bound


def test_the_fairness_bench_meets_its_goal_on_a_short_run_of_two_cases():
    """The bench's own check, on its fake clock: the victim loses no room and its p99 stays within 1.2x."""
    from epd_ring.executor.tools.bench_fairness import GOAL_P99_X, simulate

    for case in ("stuck", "parked+held"):
        base, hit = simulate(case, False, seconds=3.0), simulate(case, True, seconds=3.0)
        assert hit.victim_rooms == base.victim_rooms > 0 and hit.attacker_rooms > 0
        assert hit.victim_failed == 0 and hit.p99_ms <= GOAL_P99_X * base.p99_ms, case


# -- forgetting idle identities: the table is bounded, and shares grow back --------------------------

def test_an_identity_idle_for_idle_s_is_forgotten_and_the_others_shares_grow_back():
    rig = rig8()
    shares = rig.manager.shares
    known(rig, "A", "B", "C", "V")
    assert shares.named == 4 and shares.cap == 2 * ITEM_COST
    rig.clock.advance(shares.idle_s - 1)
    run(rig, room(rig, 1, "first-V", "V"))  # V stays active; A, B and C hold nothing and defer nothing
    assert shares.named == 4  # idle, but not for idle_s yet: a victim between two rooms keeps its share
    rig.clock.advance(1)
    assert shares.of("V").held == 0 and shares.named == 1 and shares.cap is None  # V alone: the whole ring
    assert set(shares.by_identity) == {"V"}
    run(rig, room(rig, 2, "first-A", "A"))  # A comes back: a newcomer, named again
    assert shares.named == 2 and shares.cap == 4 * ITEM_COST


def test_forgetting_counts_the_identities_forgotten_and_leaves_the_ones_idle_for_less():
    rig = rig8()
    shares = rig.manager.shares
    assert not shares.idle_since and shares.forget_idle() == 0  # nobody at all
    known(rig, "A", "B", "C", "V")
    rig.clock.advance(10)
    for k, key in enumerate(("C", "V")):  # C and V busy again: idle from now on
        run(rig, room(rig, k, f"first-{key}", key))
    assert shares.forget_idle() == 0 and shares.named == 4  # nobody idle for idle_s yet
    rig.clock.advance(shares.idle_s - 10)
    assert shares.forget_idle() == 2  # A and B, idle since before C and V
    assert shares.named == 2 and set(shares.by_identity) == {"C", "V"} and shares.cap == 4 * ITEM_COST
    assert shares.forget_idle() == 0


def test_an_identity_that_holds_or_defers_is_never_forgotten():
    rig = rig8(park_timeout=1000.0)
    shares = rig.manager.shares
    known(rig, "V")
    for k in range(2):  # parked: its receivers never register
        run(rig, room(rig, k, "a", "A", frame=False))
    assert shares.of("A").held > 0 and not shares.of("A").queue
    rig.clock.advance(10 * shares.idle_s)
    run(rig, room(rig, 100, "first-V", "V"))
    assert "A" in shares.by_identity and shares.of("A").held > 0  # V was idle too, but came back
    assert shares.named == 2


def test_a_share_table_without_a_clock_charges_and_forgets_nobody():
    # The table a worker builds before its executor gives it the clock (`Holds`), and a test's own:
    # its shares hold and give back bytes like any, and nothing is marked idle or forgotten.
    from epd_ring.executor.core.shares import Shares

    shares = Shares(8 * ITEM_COST, 4)
    a = shares.of("A")
    a.charge(ITEM_COST)
    assert a.held == ITEM_COST and not a.idle
    a.charge(-ITEM_COST)
    assert a.held == 0 and a.idle
    assert not shares.idle_since and shares.forget_idle() == 0 and shares.of("A") is a


def test_a_manager_without_an_executor_bounds_no_identity():
    # A bare manager (its own placeholder table, no ring to size a share by): however much two
    # identities' rooms hold, no room of either is held back by identity.
    from types import SimpleNamespace

    _clock, _t, m = managed()
    for k, key in ((1, "A"), (2, "B"), (3, "A")):
        m.bind_sender(k, key)
    m.holds.hold(1, 1 << 20, extent=SimpleNamespace())
    m.holds.hold(2, 1 << 20, extent=SimpleNamespace())
    assert m.holds.shares.of("A").held == 1 << 20
    assert not m.holds.held_back(3, 1 << 20)
    assert m.holds.shares.cap is None


@pytest.mark.parametrize("idle_s", [0, 0.5])
def test_a_share_table_may_forget_at_once_or_within_a_second(idle_s):
    # idle_s is a duration >= 0: 0 forgets an idle identity at the next look, a fraction of a second
    # is as good a horizon as any; only a negative one is refused.
    from epd_ring.executor.core.shares import Shares

    now = [0.0]
    shares = Shares(8 * ITEM_COST, 4, clock=lambda: now[0], idle_s=idle_s)
    shares.of("A")
    now[0] = idle_s
    assert shares.forget_idle() == 1
    with pytest.raises(ValueError):
        Shares(8 * ITEM_COST, 4, idle_s=-0.1)


def test_one_identity_has_the_whole_ring_and_queue_and_two_have_half_each_at_least_one():
    from epd_ring.executor.core.shares import Shares

    shares = Shares(3, 1)
    shares.of("A")
    assert shares.cap is None and shares.queue_cap == 1
    shares.of("B")
    assert shares.cap == 1 and shares.queue_cap == 1  # half of 3 B rounds down; never below 1
    shares = Shares(1, 9)
    shares.of("A"), shares.of("B"), shares.of("C")
    assert shares.cap == 1 and shares.queue_cap == 3
    assert Shares(100, 10, fraction=1.0).queue_cap == 10 and Shares(100, 10, fraction=1.0).cap is None
    alone = Shares(100, 0)  # no deferred place at all (max_deferred=0): one identity alone has none either
    alone.of("A")
    assert alone.queue_cap == 0 and alone.over_queue() is None
