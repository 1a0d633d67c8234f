"""Shares by identity in the model (Config.identities, `epd-ring check --identities K`; issue 30).

Each identity's rooms hold at most its share of the arena, every extent charged from lease until free
(quarantined ones included), and its deferred sends wait in a FIFO of its own, the FIFOs served
round-robin (models/shares.py). The property (models/liveness.py, `starved`): an identity within its
share is always eventually served whatever another identity does, assuming fairness only of its own
events and the encode loop's. Each half of the design is shown needed by a mutant the property catches.
"""

from __future__ import annotations

import pytest
from helpers import reachable_states

from epd_ring.executor.tools import spin as spin_tool
from epd_ring.models import liveness
from epd_ring.models.explore import explore
from epd_ring.models.shares import Shares
from epd_ring.models.spec import CONCLUDED, CONTENT, EXTENTI, OWNER, RS, SS, Config, Spec

# Two identities, two cells (one each), three rooms (two of identity 0, one of identity 1), items of one cell.
TWO = Config(cells=2, rooms=3, receivers=1, faults=1, sizes=(1,), identities=2)
needs_spin = pytest.mark.skipif(not spin_tool.available(), reason="needs spin and gcc (apt-get install -y spin gcc)")
SMALL = Config(cells=2, rooms=2, receivers=1, faults=1, sizes=(1,), identities=2)


def test_two_identities_are_served_within_their_shares_and_the_counts_are_pinned(explored):
    r = explored(TWO)
    assert (r.states, r.represented) == (17_472, 34_224)  # the orbits add up to the unreduced count
    assert r.violations == {}
    assert explored(SMALL).states == 1_460


def test_one_identity_leaves_the_state_as_it_was():
    # identities=1 is the default: rooms keep eleven fields and the pinned counts (test_model_pins.py) stand.
    assert Config(2, 2, 1, 1) == Config(2, 2, 1, 1, identities=1)
    assert all(len(r) == OWNER for st in reachable_states(Config(1, 2, 1, 1, sizes=(1,))) for r in st[0])


def test_no_identity_holds_more_than_its_share_and_the_queue_is_grouped_by_identity():
    cfg = Config(cells=2, rooms=4, receivers=1, faults=0, sizes=(1,), identities=2)  # two rooms each
    spec = Spec(cfg)
    cap = spec.shares.cap
    saw_both_deferred = False
    for st in reachable_states(cfg):
        rooms, cells, deferred = st[0], st[1], st[2]
        for v in range(cfg.identities):
            assert spec.shares.held(rooms, cells, v) <= cap
        owners = [rooms[i][OWNER] for i in deferred]
        # one FIFO per identity: each identity's sends are together, in the order the round serves them
        assert owners == sorted(owners, key=owners.index)
        saw_both_deferred |= len(set(owners)) == 2
    assert saw_both_deferred


def test_a_quarantined_extent_stays_charged_after_its_room_let_it_go():
    # regions off: a landed late write leaves its extent at once; the cell must still count for its identity
    cfg = Config(cells=2, rooms=2, receivers=1, faults=1, sizes=(1,), identities=2, regions=False)
    spec = Spec(cfg)
    seen = {spec.shares.owner_of_cell(st[0], sl[CONTENT])
            for st in reachable_states(cfg) for sl in st[1] if sl[SS] == "quarantined" and sl[CONTENT] < -1}
    assert seen == {0, 1}  # each identity's, charged to its own identity (room k is identity k's)
    assert explore(cfg).violations == {}


@pytest.mark.parametrize("mutant, attr, value", [
    ("one global FIFO", "one_fifo", True),
    ("quarantined extents charged to nobody", "uncharged", ("quarantined",)),
])
def test_each_half_of_the_design_is_needed(mutant, attr, value, monkeypatch):
    """Without it an identity's room waits on another identity's events: its park deadline, its quarantine."""
    monkeypatch.setattr(Shares, attr, value)
    assert explore(SMALL).violations == {}  # one room each: nothing to wait behind
    r = explore(TWO)
    assert sorted(r.violations) == ["identity-starved"], mutant
    last = r.violations["identity-starved"].trace[-1][1]
    rooms = last[0]
    victim = next(r for r in rooms if r[OWNER] == 1)
    assert victim[RS] not in CONCLUDED and liveness.began(victim)


def test_the_property_is_judged_only_where_it_is_one():
    assert liveness.checks_shares(TWO)
    assert not liveness.checks_shares(Config(cells=3, rooms=2, sizes=(1, 2), identities=2))  # scattered bytes
    assert not liveness.checks_shares(Config(cells=1, rooms=2, sizes=(1,), identities=2))  # no cell each
    assert not liveness.checks_shares(Config(cells=2, rooms=2, sizes=(1,)))
    with pytest.raises(ValueError, match="identities"):
        Config(cells=2, rooms=2, identities=2, peers=True)
    with pytest.raises(ValueError, match="identities"):
        Config(cells=2, rooms=1, identities=2)


def test_a_send_passed_over_by_its_own_share_keeps_no_other_identity_behind_it():
    # identity 0 holds its cell and its next send waits deferred; identity 1's item takes the free cell at once
    spec = Spec(TWO)
    state = spec.initial()
    for event in [("register", 0), ("register", 1), ("register", 2), ("tower", 1, 1), ("tower", 0, 1)]:
        state = next(st.state for st in spec.successors(state) if st.event == event)
    assert state[2] == (0,) and spec.shares.held_back(state[0], state[1], 0)
    after = [st.state for st in spec.successors(state) if st.event == ("tower", 2, 1)]
    assert after and all(s[2] == (0,) and s[0][2][EXTENTI] >= 0 for s in after)  # room 2 leased a cell


@needs_spin
@pytest.mark.parametrize("mutant", [None, "uncharged"])
def test_spin_stores_the_explorers_states_and_finds_the_same_starvation(mutant, monkeypatch):
    if mutant:
        monkeypatch.setattr(Shares, "uncharged", ("quarantined",))
    r, e = spin_tool.check(TWO), explore(TWO)
    assert r.states == e.states
    assert sorted(r.violations) == sorted(e.violations) == (["identity-starved"] if mutant else [])


@needs_spin
@pytest.mark.parametrize("mutant", [None, "uncharged"])
def test_spins_count_and_verdict_on_two_identities_are_the_explorers_pinned_ones(mutant, monkeypatch):
    # SPIN alone against the explorer's pinned count (the test above it runs both engines at full cost):
    # the generator's shares (its deferred queues by identity, the starvation arms) in the mutation pass
    if mutant:
        monkeypatch.setattr(Shares, "uncharged", ("quarantined",))
    r = spin_tool.check(TWO)
    if mutant:
        assert sorted(r.violations) == ["identity-starved"]
    else:
        assert (r.states, sorted(r.violations)) == (17_472, [])
