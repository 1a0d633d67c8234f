"""Conformance driven from the spec's graph: the implementation walks every edge of the spec at a small
bound, and a core that leaves the spec is caught by the walk."""

from __future__ import annotations

import logging

import pytest

from epd_ring.executor.core import EncodeManager
from epd_ring.models.spec import Config
from epd_ring.models.walk import walk


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.CRITICAL, logger="epd_ring")  # injected tower errors are events here


@pytest.mark.parametrize("cfg", [Config(2, 2, 2, 1, sizes=(1,)), Config(2, 2, 1, 1),
                                 Config(1, 2, 1, 1, peers=True, sizes=(1,))], ids=str)
def test_the_implementation_walks_every_spec_edge(cfg):
    w = walk(cfg)
    print(w.summary())
    assert w.failures == []
    assert w.spec_edges > 1000 and w.edge_coverage == 1.0 and w.state_coverage == 1.0
    # every deadline fires through the clock and poll(): the walk knows the path, so each is the next due
    assert w.deadlines["clock"] > 100 and w.deadlines["not by clock"] == 0


def test_the_implementation_walks_every_spec_edge_with_two_faults():
    """The walks above allow one fault. A region of a failed room whose write then reports failure
    must wait out the quarantine, not be released on that report: only two faults reach it."""
    w = walk(Config(1, 1, 2, 2))
    assert w.failures == []
    assert w.spec_edges > 200 and w.edge_coverage == 1.0 and w.state_coverage == 1.0


def test_a_core_that_ignores_withdraws_is_caught_by_the_walk(monkeypatch):
    monkeypatch.setattr(EncodeManager, "withdraw", lambda self, room, session: None)
    w = walk(Config(1, 2, 1, 1, sizes=(1,)))
    assert w.failures and all(any(ev[0] == "withdraw" for ev in path) for path, _ in w.failures)


def test_a_late_receiver_told_by_the_reason_its_room_failed_with_is_caught_by_the_walk(monkeypatch):
    """A room failed by its park deadline is the spec state of one failed otherwise (an announce deadline's
    room whose sender came later is reached in fewer events), so a walk keyed by spec states alone never
    sent a late frame to a park timeout's tombstone. The walk keys its states by each failed room's reason
    kind too: a core that tells such a receiver success leaves the spec."""
    from epd_ring.executor.core.admission import Admission
    from epd_ring.executor.core.reasons import ReasonKind, as_reason
    from epd_ring.fsm import ROOM

    tell_late = Admission.tell_late

    def success_after_park_timeout(self, frame, tomb):
        if tomb.owner is not None and tomb.state == "failed" and as_reason(tomb.reason).kind == ReasonKind.PARK_TIMEOUT:
            ROOM.step(tomb, "add_receiver")
            self.m.tell(frame, tomb.room, "success")
        else:
            tell_late(self, frame, tomb)

    monkeypatch.setattr(Admission, "tell_late", success_after_park_timeout)
    w = walk(Config(1, 1, 2, 1, sizes=(1,)))
    assert w.failures
    for path, _ in w.failures:  # the frame of a room whose park deadline failed it
        assert path[-1][0] == "frame" and ("expire", 0) in path and ("copied", 0) in path


def test_a_failure_recorded_under_another_reason_kind_is_caught_by_the_walk(monkeypatch):
    """The spec has no word for why a room failed; the harness compares each failed room's kind with the
    one the event that failed it gives (`conformance.FAILED_BY`)."""
    from epd_ring.executor.core import lifecycle
    from epd_ring.executor.core.reasons import ReasonKind

    monkeypatch.setitem(lifecycle._TIMED_OUT, "park", ReasonKind.ANNOUNCE_TIMEOUT)
    w = walk(Config(1, 1, 1, 1, sizes=(1,)))
    assert w.failures and all(path[-1] == ("expire", 0) for path, _ in w.failures)


def test_the_walk_takes_each_spec_state_once_per_history_and_counts_its_edges_once():
    from epd_ring.models.walk import walk as walk_

    w = walk_(Config(1, 1, 2, 1, sizes=(1,)))
    assert w.failures == [] and (w.edges, w.states) == (w.spec_edges, w.spec_states)
    assert w.nodes > w.states  # some spec states were reached with rooms failed for different reasons


@pytest.mark.parametrize("forget", ["reaped sender", "landed bytes"])
def test_the_walk_reads_the_implementation_not_its_own_bookkeeping(monkeypatch, forget):
    """abstract() takes the sender and the writes done from the core and the transport: a core whose
    record forgets that a sender came, or a transport whose receivers forget what landed, leaves the spec."""
    from epd_ring.executor.core.loopback import LoopbackReceiver

    if forget == "reaped sender":
        kept = EncodeManager.has_sender
        monkeypatch.setattr(EncodeManager, "has_sender", lambda self, room: room in self.rooms and kept(self, room))
        kind = "reap"
    else:
        monkeypatch.setattr(LoopbackReceiver, "landed", property(lambda self: [], lambda self, v: None), raising=False)
        kind = "write_done"
    w = walk(Config(1, 2, 1, 1, sizes=(1,)))
    assert w.failures and all(any(ev[0] == kind for ev in path) for path, _ in w.failures)


@pytest.mark.parametrize("late", ["connect", "probe"])
def test_a_peer_deadline_armed_a_second_late_is_caught(monkeypatch, late):
    """The spec has no clock: a contact's or a heartbeat's deadline armed late leaves its states as they
    were, and only the full state's comparison of every armed deadline's value shows it."""
    from epd_ring.executor.core.timers import Deadlines
    from epd_ring.models.conformance import Harness

    arm = Deadlines.arm
    monkeypatch.setattr(Deadlines, "arm", lambda self, when, kind, obj: arm(self, when + (kind == late), kind, obj))
    h = Harness(Config(1, 2, 1, 1, peers=True, sizes=(1,)))
    with pytest.raises(AssertionError, match=f"{late} deadline due at"):
        for event in [("register", 0), ("frame", 0), ("connected", 0), ("tower", 0, 1), ("probe_expired", 0)]:
            h.step(event)


@pytest.mark.parametrize("cfg", [Config(2, 2, 1, 1), Config(3, 2, 1, 1), Config(3, 2, 1, 1, sizes=(1,))], ids=str)
def test_the_walks_quotients_are_symmetries_of_the_spec(cfg):
    """Reading the arena from its other end (and, with items of one cell, any relabelling of cells) maps
    the spec's successors onto the successors of the image, so counting edges up to it loses nothing."""
    from itertools import permutations

    from epd_ring.models.explore import canonical
    from epd_ring.models.spec import EXTENTI, Spec
    from epd_ring.models.walk import reflect

    def permute(state, perm):
        cells = [None] * len(state[1])
        for c, to in enumerate(perm):
            cells[to] = state[1][c]
        rooms = tuple(r if r[EXTENTI] < 0 else (*r[:EXTENTI], perm[r[EXTENTI]]) for r in state[0])
        return (rooms, tuple(cells), *state[2:])

    maps = [reflect] + ([lambda s, p=p: permute(s, p) for p in permutations(range(cfg.cells))]
                        if cfg.sizes == (1,) else [])
    spec = Spec(cfg)
    seen, frontier, moved = {canonical(spec.initial())}, [spec.initial()], 0
    while frontier:
        st = frontier.pop()
        succ = spec.successors(st)
        for f in maps:
            image = f(st)
            assert {canonical(f(t.state)) for t in succ} == {canonical(t.state) for t in spec.successors(image)}
            moved += canonical(image) != canonical(st)
        for t in succ:
            if canonical(t.state) not in seen:
                seen.add(canonical(t.state))
                frontier.append(t.state)
    assert moved > 0  # the maps do move states: the check is not about identities


def test_the_walk_command_prints_coverage_and_fails_below_its_floor(capsys):
    from epd_ring.models.walk import main

    assert main(["1", "1", "2", "1", "--sizes", "1"]) == 0
    assert "edges (100.0%)" in capsys.readouterr().out
    assert main(["1", "1", "2", "1", "--sizes", "1", "--min-coverage", "1.01"]) == 1


def test_a_deadline_fired_out_of_the_clocks_order_fires_through_the_clock_on_a_replanned_harness():
    """Without a plan, the harness arms deadlines in the clock's order; when the spec fires a later one
    first, the harness rebuilds itself along the same events with that one foreseen, so it still fires
    through the clock and poll(), and the other stays pending."""
    from epd_ring.models.conformance import Harness

    h = Harness(Config(1, 2, 1, 1, sizes=(1,)))
    for ev in [("frame", 0), ("frame", 1)]:  # both rooms announced: room 0's deadline is due first
        h.step(ev)
    first = {rid: room.due for rid, room in h.manager.rooms.items()}
    assert first[h.room(0)] < first[h.room(1)]
    h.step(("expire", 1))
    assert (h.replans, h.fired["clock"]) == (1, 1)
    assert h.manager.room_status(h.room(1)) == "failed" and h.manager.room_status(h.room(0)) == "announced"
    assert h.manager.rooms[h.room(0)].timer  # still armed, and not yet due
    assert h.manager.rooms[h.room(0)].due > h.clock.now()


# Two identities, a cell each: identity 0 has two rooms, so its second send is held back by its share while
# identity 1's item is staged past it (issue 30: models/shares.py against executor/core/shares.py).
SHARES = Config(2, 3, 1, 0, sizes=(1,), identities=2)


def test_with_two_identities_the_core_keeps_the_specs_shares_and_queue():
    w = walk(SHARES)
    assert w.failures == []
    assert w.spec_edges > 1000 and w.edge_coverage == 1.0 and w.state_coverage == 1.0


@pytest.mark.parametrize("case, mutant", [("held", None), ("held", "no share"), ("quarantined", None),
                                           ("quarantined", "quarantine uncharged")])
def test_a_core_without_shares_leaves_the_spec(case, mutant, monkeypatch):
    """Identity 0's second item: held back by its share (the cell its first room holds, quarantined in the
    second case) in the spec; a core without the share, or that stops charging a quarantined extent, leases it."""
    from epd_ring.executor.core.ring import Ring
    from epd_ring.executor.core.shares import Shares
    from epd_ring.models.conformance import Harness

    path = [("register", 0), ("register", 1), ("tower", 0, 1), ("tower", 1, 1)]
    cfg = SHARES
    if mutant == "no share":
        monkeypatch.setattr(Shares, "over", lambda self, share, nbytes: False)
    if mutant == "quarantine uncharged":
        fire = Ring.fire

        def fire_uncharged(self, extent, event):
            dest = fire(self, extent, event)
            if extent.state == "quarantined" and extent.share is not None:
                extent.share.held -= extent.cost
                extent.share = None
            return dest

        monkeypatch.setattr(Ring, "fire", fire_uncharged)
    if case == "quarantined":
        cfg = Config(2, 3, 1, 1, sizes=(1,), identities=2)
        path = [("register", 0), ("frame", 0), ("tower", 0, 1), ("copied", 0), ("write_unsure", 0, 0),
                ("register", 1), ("tower", 1, 1)]
    h = Harness(cfg)
    for event in path[:-1]:
        h.step(event)
    if mutant is None:
        assert h.step(path[-1])[2] == (1,)  # deferred, held back by its identity's share
    else:
        with pytest.raises(AssertionError, match="spec allows only"):
            h.step(path[-1])


def test_with_two_identities_each_room_is_charged_and_withdrawn_as_its_own_identity():
    """Identity 0's second item is held back by its share; identity 1's item, after it, is staged in the
    other cell (its own share), and its receiver's withdraw, in its own identity's name, fails only its
    room. A harness that named one identity for every room, or withdrew in no identity's name, leaves
    the spec (the targeted part of the two identities' walk, which the mutation pass leaves out)."""
    from epd_ring.executor.core.reasons import ReasonKind
    from epd_ring.models.conformance import Harness

    h = Harness(Config(2, 3, 1, 1, sizes=(1,), identities=2))
    assert h.owner == (0, 0, 1) and len({h.key(i) for i in range(3)}) == 2
    for event in [("register", 0), ("register", 1), ("register", 2), ("tower", 0, 1), ("tower", 1, 1)]:
        h.step(event)
    assert h.step(("tower", 2, 1))[2] == (1,)  # room 1 still deferred; room 2 staged past it
    assert h.executor.ring.counts()["copying"] == 2
    h.step(("frame", 2))
    h.step(("withdraw", 2, 0))
    assert [h.manager.room_status(h.room(i)) for i in range(3)] == ["registered", "registered", "failed"]
    assert h.manager.failure_reason(h.room(2)).kind == ReasonKind.WITHDRAWN
