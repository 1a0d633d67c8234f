"""The loopback transport behaves like a one-sided engine: bounds, faults, late landings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import loopback_setup

from epd_ring.executor import FakeClock, LoopbackTransport, Outcome, TransportError
from epd_ring.executor.core.loopback import CONTACT_FAULTS, FAULT_KINDS, Fault, Notice, Regions

setup = loopback_setup


def test_write_lands_and_reports_done_on_next_poll():
    _, t, src, dst, _ = setup()
    h = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 64)])
    assert torch.equal(dst, src)
    assert t.poll() == [(h, Outcome.DONE)] and t.poll() == []


def test_out_of_bounds_or_dead_receiver_fails_without_writing():
    _, t, src, dst, rcv = setup()
    h1 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr() + 8, 64)])  # past the registered end
    h2 = t.submit_write("nobody", [(src.data_ptr(), dst.data_ptr(), 64)])
    rcv.kill()
    h3 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 64)])
    assert t.poll() == [(h1, Outcome.FAILED), (h2, Outcome.FAILED), (h3, Outcome.FAILED)]
    assert not dst.any()


@pytest.mark.parametrize("where", ["past-its-end", "before-every-region", "unregistered-since"])
def test_a_write_from_outside_the_registered_source_memory_fails_without_writing(where):
    # the engine reads only memory registered with it: a source past the region's end, below the lowest
    # region, or in a region taken back fails the write, and nothing lands
    _, t, src, dst, _ = setup()
    ptr, n = {"past-its-end": (src.data_ptr() + 8, 64), "before-every-region": (src.data_ptr() - 64, 8),
              "unregistered-since": (src.data_ptr(), 64)}[where]
    if where == "unregistered-since":
        t.unregister_memory(src)
    h = t.submit_write("r", [(ptr, dst.data_ptr(), n)])
    assert t.poll() == [(h, Outcome.FAILED)] and not dst.any() and t.bytes_landed == 0


def test_overlapping_or_empty_registration_is_refused():
    _, t, src, _, _ = setup()
    for ptr, n in ((src.data_ptr(), 64), (src.data_ptr() + 32, 64), (src.data_ptr() - 16, 32)):
        try:
            t.register_memory([(ptr, n)])
        except TransportError:
            continue
        raise AssertionError(f"overlap at {ptr:#x}+{n} accepted")
    try:
        t.register_memory([(src.data_ptr() + 4096, 0)])
    except TransportError:
        pass
    else:
        raise AssertionError("empty registration accepted")
    t.register_memory([(src.data_ptr() + 64, 64)])  # adjacent is fine


def test_timeout_that_lands_later_reads_the_source_when_it_lands():
    clock, t, src, dst, _ = setup()
    t.inject("timeout_land_later", delay=1.0, land_after=2.0)
    h = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 64)])
    clock.advance(1.0)
    assert t.poll() == [(h, Outcome.TIMED_OUT)] and not dst.any()
    src.fill_(7.0)  # the extent was rewritten before the stale write landed
    clock.advance(1.0)
    assert t.poll() == []
    assert t.late_landings == 1 and torch.equal(dst, torch.full((16,), 7.0))


def test_delay_hold_and_scripted_counts():
    clock, t, src, dst, _ = setup()
    t.inject("delay", delay=0.5)
    t.inject("hold", session="r", count=2)
    h1 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 4)])
    h2 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 4)])
    h3 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 4)])
    h4 = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 4)])  # rules used up: immediate
    assert t.poll() == [(h4, Outcome.DONE)]
    clock.advance(0.5)
    assert t.poll() == [(h1, Outcome.DONE)]
    assert t.held == [h2, h3]
    t.complete(h3, Outcome.TIMED_OUT)
    assert t.poll() == [(h3, Outcome.TIMED_OUT)]


# -- set-up and bad input ----------------------------------------------------------------------

def whole(src, dst):
    return [(src.data_ptr(), dst.data_ptr(), 64)]


def test_a_fresh_loopback_transport_and_its_registrations():
    t = LoopbackTransport()
    assert (t.policy, t.closed, t.bytes_landed, t.late_landings, t.submitted, t.contacts, t.unreached_writes) == \
        (None, False, 0, 0, 0, 0, 0)
    rcv = t.add_receiver("r")
    assert rcv.session == "r" and t.receivers == {"r": rcv}
    with pytest.raises(ValueError, match="'r'"):
        t.add_receiver("r")
    assert rcv.register(0x5000, 1) == 0x5000  # one byte is a region
    assert rcv.register(0x5001, 63) == 0x5001  # adjacent: allowed
    with pytest.raises(TransportError, match=r"\b0 bytes\b.*0x6000"):
        rcv.register(0x6000, 0)
    buf = torch.zeros(4)
    assert rcv.register(buf) == buf.data_ptr()
    assert rcv.regions.covers(0x5000, 64) is False and rcv.regions.covers(0x5001, 63)
    assert rcv.regions.remove_owner(buf) == 1 and len(rcv.regions) == 2  # a tensor owns its region
    src = torch.ones(4)
    t.register_memory([(src.data_ptr(), 16)], owner=src)
    assert t.submit_write("r", [(src.data_ptr(), 0x5000, 0)]) == 1  # handles count from 1


def test_unknown_fault_kinds_are_refused_naming_the_known_ones():
    assert FAULT_KINDS == ("fail", "delay", "timeout", "timeout_land_later", "hold")
    assert CONTACT_FAULTS == ("hang", "refuse", "slow")
    def names_the_known_ones(err, known):
        message = str(err.value)
        return "'explode'" in message and all(repr(k) in message for k in known)

    with pytest.raises(ValueError) as e:
        Fault("explode")
    assert names_the_known_ones(e, FAULT_KINDS)
    t = LoopbackTransport()
    with pytest.raises(ValueError) as e:
        t.inject("explode")
    assert names_the_known_ones(e, FAULT_KINDS)
    with pytest.raises(ValueError) as e:
        t.inject_contact("explode")
    assert names_the_known_ones(e, CONTACT_FAULTS)


def test_a_closed_transport_refuses_writes_with_a_clear_error():
    _, t, src, dst, _ = setup()
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.submit_write("r", whole(src, dst))
    assert t.submitted == 0 and not dst.any()


def test_removing_an_owner_drops_exactly_its_regions():
    regions = Regions()
    a, b = object(), object()
    regions.add(0x1000, 0x100, a)
    regions.add(0x2000, 0x100, b)
    regions.add(0x3000, 0x100, a)
    assert regions.remove_owner(a) == 2 and len(regions) == 1
    assert regions.covers(0x2000, 0x100) and regions.covers(0x2080, 0x80)
    assert not regions.covers(0x2080, 0x81)  # one past b's end
    assert not regions.covers(0x1000, 1) and not regions.covers(0x3000, 1)
    regions.add(0x1000, 0x100, a)  # a's old range is free to register again
    assert regions.remove_owner(object()) == 0
    assert regions.remove_owner(b) == 1 and len(regions) == 1
    assert regions.covers(0x1000, 0x100) and not regions.covers(0x2000, 1)


def test_regions_may_touch_but_not_overlap():
    regions = Regions()
    regions.add(0x2000, 0x100)
    regions.add(0x2100, 0x100)  # starts where the first ends
    regions.add(0x1f00, 0x100)  # ends where the first starts
    assert len(regions) == 3 and regions.covers(0x1f00, 0x100) and regions.covers(0x2100, 0x100)
    for ptr, n in ((0x1f80, 0x100), (0x20ff, 2), (0x1e00, 0x101)):
        with pytest.raises(TransportError):
            regions.add(ptr, n)
    assert len(regions) == 3


# -- the data path and its faults --------------------------------------------------------------

def test_writes_count_landed_bytes_and_writes_to_sessions_never_reached():
    _, t, src, dst, _ = setup()
    empty = (src.data_ptr(), dst.data_ptr(), 0)  # a zero-length part lands nothing
    h1 = t.submit_write("r", [*whole(src, dst), empty])
    h2 = t.submit_write("r", whole(src, dst))
    assert t.poll() == [(h1, Outcome.DONE), (h2, Outcome.DONE)]
    assert t.bytes_landed == 128 and t.submitted == 2
    # No contact answered ok for "r" yet: a real engine would open the segment in each submit.
    assert t.unreached_writes == 2
    assert t.connect("r", 1) is True and t.reached == {"r"}
    t.submit_write("r", whole(src, dst))
    assert t.unreached_writes == 2 and t.bytes_landed == 192 and t.contacts == 1


def test_a_dead_receiver_fails_writes_and_contact_until_it_revives():
    _, t, src, dst, rcv = setup()
    rcv.kill()
    h1 = t.submit_write("r", whole(src, dst))
    assert t.connect("r", 1) is False and t.reached == set()
    rcv.revive()
    assert rcv.alive is True
    h2 = t.submit_write("r", whole(src, dst))
    assert t.poll() == [(h1, Outcome.FAILED), (h2, Outcome.DONE)]
    assert torch.equal(dst, src)
    assert t.connect("r", 2) is True and t.reached == {"r"}


def test_a_policy_sees_each_write_without_a_scripted_rule():
    _, t, src, dst, _ = setup()
    seen = []

    def policy(session, bufs):
        seen.append((session, list(bufs)))
        return Fault("fail") if session == "r" else None

    t.policy = policy
    h1 = t.submit_write("r", whole(src, dst))
    t.inject("delay", delay=1.0)  # a scripted rule comes first: the policy is not asked
    h2 = t.submit_write("r", whole(src, dst))
    assert seen == [("r", whole(src, dst))]
    assert t.poll() == [(h1, Outcome.FAILED)] and not dst.any()
    t.clock.advance(1.0)
    assert t.poll() == [(h2, Outcome.DONE)] and torch.equal(dst, src)


def test_an_injected_failure_reports_after_its_delay_and_writes_nothing():
    clock, t, src, dst, _ = setup(at=10.0)
    t.inject("fail", delay=2.0)
    h = t.submit_write("r", whole(src, dst))
    assert t.poll() == [] and t.in_flight == 1
    clock.advance(1.5)
    assert t.poll() == []
    clock.advance(0.5)
    assert t.poll() == [(h, Outcome.FAILED)] and t.in_flight == 0
    assert not dst.any() and t.bytes_landed == 0


def test_a_delayed_write_lands_when_it_reports_and_fails_if_the_receiver_died_meanwhile():
    clock, t, src, dst, rcv = setup(at=10.0)
    t.inject("delay", delay=1.0, count=2)
    h1 = t.submit_write("r", whole(src, dst))
    assert t.poll() == [] and not dst.any()
    clock.advance(1.0)
    assert t.poll() == [(h1, Outcome.DONE)] and torch.equal(dst, src)
    dst.zero_()
    h2 = t.submit_write("r", whole(src, dst))
    rcv.kill()
    clock.advance(1.0)
    assert t.poll() == [(h2, Outcome.FAILED)] and not dst.any()
    assert t.late_landings == 0 and t.bytes_landed == 64


def test_an_injected_timeout_reports_after_its_delay_and_never_lands():
    clock, t, src, dst, _ = setup(at=10.0)
    t.inject("timeout", delay=2.0)
    h = t.submit_write("r", whole(src, dst))
    assert t.poll() == [] and t.held == [] and t.in_flight == 1
    clock.advance(1.5)
    assert t.poll() == []
    clock.advance(0.5)
    assert t.poll() == [(h, Outcome.TIMED_OUT)]
    clock.advance(100.0)
    assert t.poll() == [] and t.in_flight == 0 and t.held == []
    assert not dst.any() and t.late_landings == 0


def test_timeout_land_later_lands_at_once_by_default_and_reports_after_its_delay():
    clock, t, src, dst, _ = setup()
    t.inject("timeout_land_later", delay=2.0)  # land_after defaults to 0: the bytes land now
    h = t.submit_write("r", whole(src, dst))
    assert t.poll() == []  # the timeout is not reported before its delay
    assert torch.equal(dst, src) and t.late_landings == 1 and t.bytes_landed == 64
    clock.advance(2.0)
    assert t.poll() == [(h, Outcome.TIMED_OUT)] and t.in_flight == 0


def test_completing_held_writes_by_hand():
    _, t, src, dst, _ = setup()
    t.inject("hold", count=5)
    failed, not_landed, done, ghost1, ghost2 = (t.submit_write("r", whole(src, dst)) for _ in range(5))
    assert t.held == [failed, not_landed, done, ghost1, ghost2] and t.poll() == []
    t.complete(failed, Outcome.FAILED)  # by default a failed write neither lands nor lands later
    t.complete(not_landed, Outcome.DONE, land=False)  # reported done, nothing landed: failed
    assert t.poll() == [(failed, Outcome.FAILED), (not_landed, Outcome.FAILED)]
    assert not dst.any() and t.ghosts == []
    t.complete(done, Outcome.DONE, land_later=True)  # a done write has nothing left to land
    assert t.poll() == [(done, Outcome.DONE)] and torch.equal(dst, src) and t.ghosts == []
    dst.zero_()
    t.complete(ghost1, Outcome.TIMED_OUT, land_later=True)
    t.complete(ghost2, Outcome.FAILED, land_later=True)
    assert t.poll() == [(ghost1, Outcome.TIMED_OUT), (ghost2, Outcome.FAILED)]
    assert t.ghosts == [ghost1, ghost2] and not dst.any() and t.held == []
    # The bytes are read from the source when they land, not when the write was submitted.
    src.add_(100)
    assert t.land_ghost(ghost1) is True and torch.equal(dst, src)
    assert t.late_landings == 1 and t.ghosts == [ghost2]
    assert t.land_ghost(ghost2) is True and t.late_landings == 2 and t.ghosts == []
    # A ghost whose receiver died meanwhile does not land and is not counted.
    t.inject("hold")
    h = t.submit_write("r", whole(src, dst))
    t.complete(h, Outcome.FAILED, land_later=True)
    t.receivers["r"].kill()
    assert t.land_ghost(h) is False and t.late_landings == 2 and t.ghosts == []
    with pytest.raises(KeyError):
        t.land_ghost(h)


def test_notices_reach_live_receivers_only():
    _clock, t, _, _, rcv = setup(at=3.0)
    dead = t.add_receiver("dead")
    dead.kill()
    t.notify(SimpleNamespace(session="r"), 5, "success")
    t.notify(SimpleNamespace(session="r"), 6, "failed", "peer x is down")
    t.notify(SimpleNamespace(session="dead"), 5, "failed")
    t.notify(SimpleNamespace(session="nobody"), 5, "failed")  # not a receiver here: dropped
    assert rcv.notices == [Notice(5, "success", "", 3.0), Notice(6, "failed", "peer x is down", 3.0)]
    assert dead.notices == []


# -- first contact -----------------------------------------------------------------------------

def test_contact_faults_apply_to_their_session_for_their_count():
    _, t, _, _, _ = setup()
    t.add_receiver("a")
    t.inject_contact("refuse", session="a", count=2)
    assert t.connect("r", 1) is True  # another session is not affected
    assert [t.connect("a", n) for n in (1, 2, 3)] == [False, False, True]
    assert t.reached == {"r", "a"} and t.contacts == 4
    t.inject_contact("refuse")  # no session: the next contact with anyone
    assert t.connect("r", 2) is False and t.connect("r", 3) is True
    assert t.peer_reports() == []


def test_a_slow_contact_without_delay_answers_at_once():
    _, t, src, dst, rcv = setup()
    t.inject_contact("slow", session="r")
    assert t.connect("r", 1) is True and t.reached == {"r"}
    t.submit_write("r", whole(src, dst))
    assert t.unreached_writes == 0
    rcv.kill()
    t.inject_contact("slow", session="r")
    assert t.connect("r", 2) is False


def test_a_hung_contact_answers_by_hand_with_the_receivers_liveness_by_default():
    _, t, _, _, _ = setup()
    t.add_receiver("dead").kill()
    t.inject_contact("hang", count=4)
    assert t.connect("r", 1) is None and t.connect("dead", 2) is None
    assert t.connect("nobody", 3) is None and t.connect("told", 4) is None
    assert t.hung == {"r": 1, "dead": 2, "nobody": 3, "told": 4}
    assert t.answer("r") is True and t.reached == {"r"}
    assert t.answer("dead") is True and t.answer("nobody") is True
    assert t.answer("told", ok=True) is True  # told explicitly: no receiver needed
    assert t.answer("r") is False  # nothing hangs for it any more
    assert t.hung == {} and t.reached == {"r", "told"}
    assert t.peer_reports() == [("r", 1, True, ""), ("dead", 2, False, "refused"),
                                ("nobody", 3, False, "refused"), ("told", 4, True, "")]
    assert t.peer_reports() == []
    t.inject_contact("hang")
    t.connect("r", 5)
    assert t.answer("r", ok=False) is True
    assert t.peer_reports() == [("r", 5, False, "refused")]


def test_late_contact_answers_come_back_in_time_order():
    clock, t, _, _, _ = setup()
    t.add_receiver("b")
    t.inject_contact("refuse", session="b", delay=2.0)
    t.inject_contact("slow", session="r", delay=1.0)
    assert t.connect("b", 1) is None and t.connect("r", 7) is None
    assert t.peer_reports() == [] and t.reached == set()
    clock.advance(1.0)
    assert t.peer_reports() == [("r", 7, True, "")] and t.reached == {"r"}
    clock.advance(1.0)
    assert t.peer_reports() == [("b", 1, False, "refused")] and t.reached == {"r"}


def test_a_held_or_ghost_write_names_its_session_and_a_ghost_can_be_forgotten_unlanded():
    _, t, src, dst, _ = loopback_setup()
    t.inject("hold")
    held = t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 16)])
    assert t.session_of(held) == "r" and t.session_of(held + 100) is None
    t.complete(held, Outcome.TIMED_OUT, land=False, land_later=True)  # now a ghost: it may still land
    assert t.ghosts == [held] and t.session_of(held) == "r"
    assert t.forget_ghost(held) is True and t.ghosts == [] and t.session_of(held) is None
    assert t.forget_ghost(held) is False  # forgotten once
    t.poll()
    assert not dst.any()  # a forgotten ghost never lands


def test_a_receiver_keeps_the_writes_addressed_to_it_and_when_they_landed():
    """`submitted` lists every write to the receiver; `landed` says, for those whose bytes landed, how
    many notices it had got by then: bytes that came before an outcome tell apart from later ones."""
    _, t, src, dst, rcv = setup(record=True)
    bufs = [(src.data_ptr(), dst.data_ptr(), 64)]
    t.inject("hold", count=3)
    done, ghost, lost = (t.submit_write("r", bufs) for _ in range(3))
    assert rcv.submitted == [(h, dst.data_ptr(), 64) for h in (done, ghost, lost)] and rcv.landed == []
    t.complete(done, Outcome.DONE)
    t.complete(ghost, Outcome.TIMED_OUT, land_later=True)
    t.complete(lost, Outcome.FAILED)
    t.notify(SimpleNamespace(session="r"), 1, "failed")
    assert t.land_ghost(ghost)
    assert rcv.landed == [(done, 0), (ghost, 1)]  # the lost write never landed
    t.submit_write("nobody", bufs)  # no such receiver: nothing to keep
    assert len(rcv.submitted) == 3


def test_a_transport_not_made_to_record_keeps_nothing_per_write():
    # A long run (the bench, a demo) must not grow a list per write.
    _, t, src, dst, rcv = setup()
    for _ in range(3):
        t.submit_write("r", [(src.data_ptr(), dst.data_ptr(), 64)])
    assert t.bytes_landed == 3 * 64 and rcv.submitted == [] and rcv.landed == []
    assert LoopbackTransport(FakeClock()).record is False  # and not recording is the default


def test_a_recording_receiver_names_each_write_that_landed_at_once_late_or_as_a_ghost():
    clock, t, src, dst, rcv = setup(record=True)
    bufs = [(src.data_ptr(), dst.data_ptr(), 64)]
    now = t.submit_write("r", bufs)
    t.inject("delay", delay=1.0)
    late = t.submit_write("r", bufs)
    t.inject("timeout_land_later", delay=1.0, land_after=2.0)
    ghost = t.submit_write("r", bufs)
    assert rcv.landed == [(now, 0)]
    clock.advance(1.0)
    assert sorted(t.poll()) == sorted([(now, Outcome.DONE), (late, Outcome.DONE), (ghost, Outcome.TIMED_OUT)])
    clock.advance(1.0)
    t.poll()
    assert rcv.landed == [(now, 0), (late, 0), (ghost, 0)]
