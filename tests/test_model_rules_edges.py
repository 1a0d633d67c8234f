"""Edges of the model's rules and events (models/rules.py, events.py, events_peers.py, events_withdraws.py,
ring.py, seed.py) that the smallest pinned spaces (test_model_pins.py) do not reach: each test here stands
for survivors of the mutation pass (tests/mutation/survivors.md, issue 32) and runs in a fraction of a
second without SPIN.

Most walk a small space whole (the explorer's canonical states) and check what every step must be: the
events it names are the vocabulary SPIN's model and the conformance harness know, a violation says what
it saw, a flag keeps its declared values. The pinned figures below are for spaces the pins leave out:
two receivers (two peers, two unsure writes, two channels) and a deferred queue two deep.
"""

from __future__ import annotations

import pytest

from epd_ring.fsm import couplings
from epd_ring.models.explore import canonical, explore
from epd_ring.models.promela import EVENTS
from epd_ring.models.rules import Rules
from epd_ring.models.spec import Config, Spec
from epd_ring.models.state import CH_HELD, CH_SENT, CONTENT, REL, SS

C = Config


def _steps(cfg: Config, past_broken_states: bool = False) -> list:
    """Every step from every canonical state of the space (a violating step or state is not walked on, as the
    explorer walks; with `past_broken_states` a state that breaks an invariant is)."""
    spec = Spec(cfg)
    start = canonical(spec.initial())
    seen = {start}
    frontier = [start]
    out = []
    while frontier:
        nxt = []
        for state in frontier:
            for step in spec.successors(state):
                out.append((state, step))
                if step.violation or (not past_broken_states and spec.invariant(step.state)):
                    continue
                s = canonical(step.state)
                if s not in seen:
                    seen.add(s)
                    nxt.append(s)
        frontier = nxt
    return out


# config -> event names it must take (besides the common ones)
VOCABULARY = {
    C(1, 2, 1, 1, peers=True, sizes=(1,)): {"frame", "frame_after_backoff", "connected", "probe_refused"},
    C(1, 1, 2, 1, channels=True): {"withdraw", "deliver", "withdraw_seen"},
    C(1, 1, 2, 1, late_landing=True): {"late_landing", "withdraw"},
    C(1, 1, 2, 2, regions=False): {"late_landing", "write_unsure"},
}


@pytest.mark.parametrize("cfg", list(VOCABULARY), ids=str)
def test_every_event_the_spec_takes_is_one_spin_and_the_harness_know_and_names_no_missing_receiver(cfg):
    names = set()
    for _, step in _steps(cfg):
        names.add(step.event[0])
        assert step.event[0] in EVENTS, step.event
        assert None not in step.event, step.event
        if not cfg.regions and step.event[0] in ("write_done", "write_unsure", "late_landing"):
            assert len(step.event) == 2, step.event  # without regions no receiver is named
    assert VOCABULARY[cfg] <= names


@pytest.mark.parametrize("cfg", [C(1, 2, 1, 1, late_landing=True), C(1, 2, 1, 1, variant="reuse-when-terminal")],
                         ids=str)
def test_every_violating_step_says_what_it_saw(cfg):
    # a late write landing on another room's bytes breaks an invariant of the state before it lands (the
    # explorer stops there): the step's own flag is seen past it
    kinds = {}
    for _, step in _steps(cfg, past_broken_states=cfg.late_landing):
        if step.violation:
            assert isinstance(step.detail, str) and step.detail, step
            kinds.setdefault(step.event[0], set()).add(step.violation)
    if cfg.late_landing:
        assert kinds["late_landing"] == {"overwrite-under-late-write", "write-into-released-region"}
    else:
        assert "overlap-of-busy-extent" in kinds["tower"] | kinds.get("serve", set())


def test_with_channels_a_release_the_encoder_sent_is_a_flag_of_one_bit():
    rels = {x[REL] for state, _ in _steps(C(1, 1, 2, 1, channels=True)) for r in state[0] for x in r[8]}
    assert rels == {0, 1}


# config -> (states, transitions, finals, fair ends, violation kinds): spaces the pins leave out (two receivers:
# two peers, two unsure writes, two channels; a deferred queue two deep; two rooms' quarantines; two sizes larger
# than the arena), each well under a second
SPACES = {
    C(1, 1, 2, 2): (108, 231, 7, 9, []),
    C(1, 1, 2, 1, peers=True, sizes=(1,)): (249, 661, 16, 18, []),
    C(1, 1, 2, 1, variant="blocking-contact", peers=True, sizes=(1,)): (176, 327, 16, 18, ["loop-waits-on-peer"]),
    C(1, 1, 2, 1, channels=True): (531, 1341, 10, 13, []),
    # no write deadline with peers: the peers' part takes the variant too (no write_deadline event)
    C(1, 1, 1, 1, variant="no-write-deadline", peers=True, sizes=(1,)): (69, 147, 8, 10, ["region-never-released",
                                                                                          "room-never-concludes"]),
    C(1, 1, 2, 1, late_landing=True): (75, 148, 5, 11, ["write-into-released-region"]),
    C(1, 1, 2, 2, regions=False): (80, 159, 7, 7, []),
    C(1, 3, 1, 0, sizes=(1,)): (926, 3181, 4, 31, []),
    C(1, 1, 1, 1, sizes=(1, 2, 3)): (37, 70, 4, 5, []),  # two sizes larger than the arena: each fails its room
    C(2, 2, 1, 2): (2372, 8841, 11, 33, []),
    C(1, 1, 2, 2, variant="seed"): (107, 171, 3, 13, ["deadline-extended", "receiver-not-told", "room-never-concludes",
                                                      "write-for-concluded-room", "write-into-released-region"]),
}


@pytest.mark.parametrize("cfg", list(SPACES), ids=str)
def test_each_space_the_pins_leave_out_has_its_pinned_size_and_violations(cfg):
    r = explore(cfg)
    assert (r.states, r.transitions, r.finals, r.fair_ends, sorted(r.violations)) == SPACES[cfg]



def _room(rs: str, ch: int) -> tuple:
    return (rs, 1, ch, 1, "", 0, 0, 0, (), 1, 0)


@pytest.mark.parametrize("rs,ch,reusable", [("success", CH_SENT, True), ("failed", CH_SENT, True),
                                            ("failed", CH_HELD, False), ("transferring", CH_SENT, False)])
def test_the_seed_reuses_a_cell_once_its_bytes_room_concluded_unless_its_chunk_is_parked(rs, ch, reusable):
    # the explorer's walk of the small seed spaces breaks an invariant before a cell holds a succeeded room's
    # bytes, so the seed's leasing rule is read directly
    ring = Spec(C(1, 2, 1, 1, variant="seed")).ring
    rooms = (_room(rs, ch), _room("registered", 0))
    assert ring.leasable(rooms, (("free", 0, False, 1), ("free", -1, False, 1))) == [reusable, True]


def test_a_freed_cell_forgets_whose_bytes_it_held_and_a_busy_one_stays_charged_to_its_identity():
    # with identities a busy cell no room covers keeps the identity it is charged to until it is free (Events._emit,
    # models/shares.py); once free it holds nobody's bytes, so states that differ only in stale charges are one
    freed = set()
    for state, step in _steps(C(1, 2, 1, 1, regions=False, sizes=(1,), identities=2)):
        for before, after in zip(state[1], step.state[1]):
            assert after[SS] != "free" or after[CONTENT] == -1, (step.event, after)
            if before[SS] != "free" and before[CONTENT] < -1:
                if after[SS] == "free":
                    freed.add(before[CONTENT])
                else:
                    assert after[CONTENT] == before[CONTENT], (step.event, before, after)
    assert freed == {-2, -3}  # each identity's charged cell was freed somewhere


def test_a_changed_table_runs_its_actions_on_the_move_it_names_with_the_event_that_moved_it(monkeypatch):
    # fsm/couplings.py decides what follows a move (an extent's entry into a state, a room's event): each action is
    # `_<action>(draft, index, cause)`, the cause the event that moved it, as the Promela model's `inline`s get it
    calls = []
    monkeypatch.setattr(Rules, "_resume_rooms", lambda self, d, index, cause: calls.append((index, cause)))
    monkeypatch.setitem(couplings.ON_ENTER, ("extent", "copying"), ("resume_rooms",))
    monkeypatch.setitem(couplings.ON_EVENT, ("room", "bind_sender"), ("resume_rooms",))
    spec = Spec(C(1, 1, 1, 0, sizes=(1,)))
    state = spec.initial()
    for event in [("register", 0), ("tower", 0, 1)]:
        calls.clear()
        state = next(st.state for st in spec.successors(state) if st.event == event)
        assert calls == [(0, "bind_sender" if event[0] == "register" else "lease")], event
