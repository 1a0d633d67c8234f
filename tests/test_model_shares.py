"""Shares by identity in the model (Config.identities, `epd-ring check --identities K`; issue 30).

Each identity's rooms hold at most its share of the arena, every extent charged from lease until free
(quarantined ones included), and its deferred sends wait in a FIFO of its own, the FIFOs served
round-robin (models/shares.py). The property (models/liveness.py, `starved`): an identity within its
share is always eventually served whatever another identity does, assuming fairness only of its own
events and the encode loop's. Each half of the design is shown needed by a mutant the property catches.
"""

from __future__ import annotations

import itertools

import pytest
from helpers import reachable_states

from epd_ring.executor.tools import spin as spin_tool
from epd_ring.models import liveness
from epd_ring.models.explore import explore
from epd_ring.models.shares import Shares
from epd_ring.models.spec import CONCLUDED, CONTENT, EXTENTI, OWNER, RS, SS, Config, Spec
from epd_ring.models.state import CH, CH_COPYING, CH_DEFERRED, CH_DROPPED, CH_NONE, SIZE, SND, Draft

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


# -- Shares' methods on hand-built states ------------------------------------------------------------------
# The explorations above do not tell the serving round's details apart (which send a turn takes, where a
# send queues, what a cap of a given arena is); these call `Shares` directly on small states built here.
# A room is the spec's twelve fields (RS, SND, CH, ..., SIZE, EXTENTI, OWNER); a cell `(ss, content, unsure,
# len)`, a busy cell no room covers any more keeping its identity v as content `-2 - v` (`Shares.forgotten`).
# Serving uses the spec's own ring (`Spec.ring`: its `stage`, `fits`, `placements`), one draft per placement.


def _room(owner: int, size: int = 1, rs: str = "registered", snd: int = 1, ch: int = CH_DEFERRED) -> list:
    """A room of `owner` whose chunk of `size` cells waits deferred (a sender bound, nothing leased)."""
    return [rs, snd, ch, 0, "", 0, 0, 0, (), size, -1, owner]


def _free() -> list:
    return ["free", -1, False, 1]


def _charged(v: int) -> list:
    """A quarantined cell whose room let it go: still charged to identity v until it is free."""
    return ["quarantined", -2 - v, False, 1]


def _serve(cfg: Config, rooms: list, cells: list, deferred: tuple) -> list[Draft]:
    """Every draft one serving round may reach from the given state, with the spec's ring."""
    spec = Spec(cfg)
    d = Draft([list(r) for r in rooms], [list(c) for c in cells], deferred, 0, ())
    # a round that never ends (a mutant's) hangs here: the pass's timeout counts it killed
    return list(spec.shares.serve(d, spec.ring.stage, spec.ring.fits))


def _outcome(d: Draft) -> tuple:
    """What a round did: the rooms it staged (copying into an extent), the queue it left, whether one waits."""
    return tuple(i for i, r in enumerate(d.rooms) if r[CH] == CH_COPYING), d.deferred, d.waits


def test_an_identitys_cap_is_its_fraction_of_the_arena_rounded_down_and_at_least_one():
    # the module's docstring: `cap` cells, the arena's cells times 1/k rounded down, at least one
    assert Shares(Config(cells=5, rooms=2, identities=2)).cap == 2
    assert Shares(Config(cells=7, rooms=3, identities=3)).cap == 2
    assert Shares(Config(cells=1, rooms=2, identities=2)).cap == 1
    assert type(Shares(Config(cells=5, rooms=2, identities=2)).cap) is int  # a count of cells, not 2.5
    # one identity: no share at all, so no cap
    assert Shares(Config(cells=2, rooms=2)).cap is None


def test_with_one_identity_nothing_is_ever_held_back():
    # k = 1: nothing here runs; rooms have no OWNER field and even a full arena holds nobody back
    shares = Shares(Config(cells=1, rooms=2))
    rooms = [r[:OWNER] for r in (_room(0, size=1), _room(0, size=1))]
    cells = [["copying", 0, False, 1]]
    assert shares.held_back(rooms, cells, 1) is False


def test_held_counts_every_busy_cell_charged_to_the_identity_and_nothing_free():
    shares = Shares(Config(cells=6, rooms=4, identities=2))
    rooms = [_room(0, size=2), _room(0), _room(1), _room(1)]
    cells = [
        _charged(0),                     # quarantined, forgotten by its room: still identity 0's
        ["copying", 0, False, 2],        # room 0's two-cell extent: both cells count
        ["copying", 0, False, 0],
        ["free", 1, False, 1],           # free, though it still names room 1's bytes: charged to nobody
        ["sending", 2, False, 1],        # room 2 is identity 1's
        _free(),
    ]
    assert shares.held(rooms, cells, 0) == 3
    assert shares.held(rooms, cells, 1) == 1
    cells[4] = _charged(1)  # the same cell forgotten by room 2: identity 1's all the same
    assert shares.held(rooms, cells, 1) == 1


def test_a_send_is_held_back_only_when_its_identity_holds_something_and_would_pass_its_cap():
    shares = Shares(Config(cells=4, rooms=2, identities=2))  # cap 2 cells each
    rooms = [_room(0, size=3), _room(1, size=1)]
    free = [_free() for _ in range(4)]
    # holding nothing, an identity may always take one chunk, even one larger than its share
    assert not shares.held_back(rooms, free, 0)
    one = [_charged(0), _free(), _free(), _free()]
    rooms[0][SIZE] = 1
    assert not shares.held_back(rooms, one, 0)  # 1 held + 1 = its cap: allowed
    rooms[0][SIZE] = 2
    assert shares.held_back(rooms, one, 0)  # 1 held + 2 > 2: held back
    assert not shares.held_back(rooms, one, 1)  # identity 1 holds nothing of it
    full = [_charged(1), _charged(1), _free(), _free()]
    assert shares.held_back(rooms, full, 1)  # at its cap, even one more cell is too many


def test_enqueue_puts_a_send_behind_its_identitys_last_deferred_one():
    shares = Shares(Config(cells=4, rooms=5, identities=2))
    rooms = [_room(0), _room(0), _room(0), _room(1), _room(1)]  # rooms 0-2 identity 0's, 3-4 identity 1's
    # identity 0's queue is (0, 1): room 2 joins it there, ahead of identity 1's sends
    assert shares.enqueue(rooms, (0, 1, 3, 4), 2) == (0, 1, 2, 3, 4)
    assert shares.enqueue(rooms, (3, 0, 1), 4) == (3, 4, 0, 1)
    # an identity new to the round joins at its end
    assert shares.enqueue(rooms, (0, 1), 3) == (0, 1, 3)
    assert shares.enqueue(rooms, (), 3) == (3,)


def test_rotate_moves_the_served_identitys_sends_behind_the_others_in_their_order():
    shares = Shares(Config(cells=4, rooms=5, identities=2))
    rooms = [_room(0), _room(0), _room(0), _room(1), _room(1)]
    assert shares.rotate(rooms, (0, 1, 3, 4), 0) == (3, 4, 0, 1)
    assert shares.rotate(rooms, (0, 1, 3, 4), 1) == (0, 1, 3, 4)
    assert shares.rotate(rooms, (1, 3, 0), 0) == (3, 1, 0)


def test_servable_says_whether_the_rounds_first_move_drops_or_stages_a_send():
    spec = Spec(Config(cells=2, rooms=2, identities=2))  # cap 1 cell each
    shares, place = spec.shares, spec.ring.placements
    rooms = [_room(0), _room(1)]
    full = [_charged(0), _charged(1)]  # each identity at its cap, no cell free
    # a send that waits (held back, or fitting nowhere) changes nothing
    assert not shares.servable(rooms, full, (0,), place)
    assert not shares.servable(rooms, full, (0, 1), place)
    # its room concluded: the round drops it, which is a change even with the arena full
    rooms[0][RS] = "failed"
    assert shares.servable(rooms, full, (0,), place)
    # its sender reaped: dropped as well (the sender alone decides it, as in the ring's one-FIFO serving)
    rooms[1][SND] = 2
    assert shares.servable(rooms, full, (1,), place)


def test_servable_passes_over_an_identitys_held_back_send_to_its_next():
    spec = Spec(Config(cells=4, rooms=3, identities=2))  # cap 2 cells each
    shares, place = spec.shares, spec.ring.placements
    rooms = [_room(0, size=2), _room(0, size=1), _room(1)]
    cells = [_charged(0), _free(), _free(), _free()]  # identity 0 holds one cell
    # room 0 (1 + 2 > 2) is held back; room 1 behind it (1 + 1) fits a free cell: the round stages it
    assert shares.servable(rooms, cells, (0, 1), place)
    assert not shares.servable(rooms, cells, (0,), place)  # held back alone: nothing to do
    cells[1:] = [["copying", 2, False, 1]] * 3  # no cell free: room 1 would wait
    assert not shares.servable(rooms, cells, (0, 1), place)


def test_serve_takes_one_send_per_identity_per_turn_round_robin_until_one_waits_for_cells():
    # cap 5 each; identity 0 holds 3 cells, identity 1 two, the five free cells all apart (no run of two)
    cfg = Config(cells=10, rooms=4, identities=2, sizes=(1, 2))
    rooms = [_room(0), _room(0), _room(1), _room(1, size=2)]
    cells = [_free(), _charged(0), _free(), _charged(0), _free(), _charged(0), _free(), _charged(1), _free(),
             _charged(1)]
    out = _serve(cfg, rooms, cells, (0, 1, 2, 3))
    # turn 1: room 0 then room 2; turn 2: room 1, then room 3 (within identity 1's share: 3 + 2 = 5) fits
    # nowhere and waits for bytes, stopping the round: one draft per placement of each send staged
    assert {_outcome(d) for d in out} == {((0, 1, 2), (3,), True)}
    places = [tuple(d.rooms[i][EXTENTI] for i in (0, 2, 1)) for d in out]
    assert sorted(places) == sorted(itertools.permutations((0, 2, 4, 6, 8), 3))


def test_serve_passes_over_a_held_back_send_which_keeps_its_place_and_ends_when_nothing_moves():
    # cap 2 each: identity 0 holds one cell, identity 1 two (its cap); one cell free
    cfg = Config(cells=4, rooms=3, identities=2)
    rooms = [_room(0), _room(0), _room(1)]
    cells = [_charged(0), _charged(1), _charged(1), _free()]
    out = _serve(cfg, rooms, cells, (0, 1, 2))
    # identity 0 is served room 0 and goes behind identity 1 (passed over: room 2 is held back); next turn
    # room 1 is held back too (2 + 1 > 2): the round ends with both still queued, nobody waiting for bytes
    assert [_outcome(d) for d in out] == [((0,), (2, 1), False)]
    assert out[0].rooms[0][EXTENTI] == 3


def test_serve_passes_over_every_held_back_send_of_an_identity_to_the_first_within_its_share():
    # cap 2 each; identity 0 holds one cell: its sends of two cells are held back, its send of one is not
    cfg = Config(cells=4, rooms=7, identities=2, sizes=(1, 2))
    rooms = [_room(0, size=2), _room(0, size=2), _room(0, size=2), _room(0), _room(1, ch=CH_NONE),
             _room(1, ch=CH_NONE), _room(1, ch=CH_NONE)]
    cells = [_charged(0), _free(), _free(), _free()]
    out = _serve(cfg, rooms, cells, (0, 1, 2, 3))
    # room 3 is staged in identity 0's first turn (one draft per free cell), the others keep their places
    assert [_outcome(d) for d in out] == [((3,), (0, 1, 2), False)] * 3
    assert sorted(d.rooms[3][EXTENTI] for d in out) == [1, 2, 3]


def test_serve_drops_concluded_and_reaped_sends_without_using_up_their_identitys_turn():
    cfg = Config(cells=4, rooms=3, identities=2)
    rooms = [_room(0, rs="failed"), _room(0), _room(1, snd=2)]  # room 0 concluded, room 2's sender reaped
    out = _serve(cfg, rooms, [_free() for _ in range(4)], (0, 1, 2))
    # identity 0's turn drops room 0 and goes on to stage room 1; identity 1's drops room 2; nothing is left
    assert [_outcome(d) for d in out] == [((1,), (), False)] * 4
    assert all(d.rooms[0][CH] == d.rooms[2][CH] == CH_DROPPED for d in out)
