"""The explorer's and the conformance harness's edges that the model's suites at their smallest bounds do
not reach (issue 32's survivors of models/explore.py and models/conformance*.py): the symmetry reduction
checked state by state against every relabelling of rooms, the transition checks and the bookkeeping of
a bounded or stopped exploration, traces that carry their configuration and the states they chose, and
the harness's refusals and failure paths. Each test is small: the mutation pass runs them for every mutant
of these modules."""

from __future__ import annotations

import itertools
import json
import logging
import random

import pytest

from epd_ring.models import explore as ex
from epd_ring.models.explore import (
    Result,
    _event_matches,
    _transition_check,
    canonical,
    event_name,
    explore,
    orbit_size,
    replay,
    trace_to_json,
)
from epd_ring.models.spec import CONTENT, RS, Config, Spec, Step


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.CRITICAL, logger="epd_ring")  # injected tower errors are events here


# -- the symmetry reduction, state by state ------------------------------------------------------
def relabel(state: tuple, perm: tuple[int, ...]) -> tuple:
    """The state with room i renamed perm[i] (written here, independently of `canonical`)."""
    rooms, cells, deferred = state[0], state[1], state[2]
    new_rooms: list = [None] * len(rooms)
    for i, r in enumerate(rooms):
        new_rooms[perm[i]] = r
    new_cells = tuple(c if c[CONTENT] < 0 else (*c[:CONTENT], perm[c[CONTENT]], *c[CONTENT + 1:]) for c in cells)
    return (tuple(new_rooms), new_cells, tuple(perm[i] for i in deferred), *state[3:])


def walked_states(cfg: Config, walks: int, length: int, seed: int) -> list[tuple]:
    """States met on seeded random walks over the spec (no reduction): many shapes, few of each."""
    spec, rng, out = Spec(cfg), random.Random(seed), {}
    for _ in range(walks):
        state = spec.initial()
        for _ in range(length):
            out[state] = None
            steps = [s for s in spec.successors(state) if not s.violation]
            if not steps:
                break
            state = rng.choice(steps).state
    return list(out)


# two and three rooms over two cells (extents of one and two cells, a deferred queue), and four rooms
# over one cell (a deferred queue of three, several runs of alike rooms)
SHAPES = [(Config(2, 3, 1, 1), 40, 30), (Config(1, 4, 1, 1, sizes=(1,)), 30, 30), (Config(2, 3, 2, 1), 15, 30)]


@pytest.mark.parametrize("cfg, walks, length", SHAPES, ids=lambda v: str(v) if isinstance(v, Config) else "")
def test_the_canonical_form_is_the_same_for_every_relabelling_and_orbit_size_counts_them(cfg, walks, length):
    """`canonical` is a relabelling of the state that every relabelling maps to (so it identifies exactly
    the states one permutation of rooms apart), and `orbit_size` is how many distinct relabellings there
    are, counted here by brute force."""
    rooms = cfg.rooms
    perms = list(itertools.permutations(range(rooms)))
    deferred_twice = runs = 0
    for state in walked_states(cfg, walks, length, seed=rooms):
        orbit = {relabel(state, p) for p in perms}
        c = canonical(state)
        assert c in orbit
        assert {canonical(s) for s in orbit} == {c}
        n = orbit_size(state)
        assert n == len(orbit) and type(n) is int
        deferred_twice += len(state[2]) >= 2
        runs += len(orbit) not in (1, len(perms))
    assert runs  # the walks met rooms alike in part
    assert deferred_twice or cfg.cells > 1  # and, in one cell, a queue of two or more


def test_a_state_whose_deferred_queue_is_a_list_has_the_tuple_canonical_form():
    spec = Spec(Config(1, 2, 1, 1))
    state = spec.initial()
    as_list = (state[0], state[1], list(state[2]), *state[3:])
    c = canonical(as_list)
    assert c == canonical(state) and type(c[2]) is tuple
    hash(c)


def test_represented_is_a_whole_number_of_states():
    r = explore(Config(1, 2, 1, 1))
    assert type(r.represented) is int and r.represented == 960


def test_with_identities_orbit_size_counts_the_relabellings_within_each_identitys_rooms():
    # two rooms of identity 0 and one of identity 1: only the first two may swap (Spec.owners)
    cfg = Config(2, 3, 1, 1, identities=2)
    owners = Spec(cfg).owners()
    perms = [p for p in itertools.permutations(range(cfg.rooms))
             if all(owners[p[i]] == owners[i] for i in range(cfg.rooms))]
    sizes = set()
    for state in walked_states(cfg, 10, 20, seed=3):
        n = orbit_size(state)
        assert n == len({relabel(state, p) for p in perms}) and type(n) is int
        sizes.add(n)
    assert sizes == {1, 2}


# -- the transition checks -------------------------------------------------------------------------
def _with_status(state: tuple, i: int, rs: str) -> tuple:
    rooms = list(state[0])
    rooms[i] = rooms[i][:RS] + (rs,) + rooms[i][RS + 1:]
    return (tuple(rooms), *state[1:])


@pytest.mark.parametrize("was, now, kind", [("failed", "success", "failure-not-sticky"),
                                            ("success", "failed", "status-not-forward")])
def test_a_concluded_room_that_moves_breaks_the_transition_check_of_its_kind(was, now, kind):
    spec = Spec(Config(1, 2, 1, 1))
    init = spec.initial()
    a, b = _with_status(init, 1, was), _with_status(init, 1, now)
    r = spec.rank(a)
    got = _transition_check(spec, a, b, r, r + 10)
    assert got is not None and got[0] == kind and "1" in got[1]
    assert _transition_check(spec, a, _with_status(init, 1, was), r, r + 10) is None
    # the cells are not rooms: a room's status is read from the rooms alone
    assert _transition_check(spec, init, init, r, r + 10) is None


def test_the_rank_check_uses_the_ranks_given_and_computes_only_those_missing():
    spec = Spec(Config(1, 2, 1, 1))
    s = spec.initial()
    r = spec.rank(s)
    assert _transition_check(spec, s, s) == ("model-cycle", _transition_check(spec, s, s)[1])
    assert _transition_check(spec, s, s, r, r)[0] == "model-cycle"  # equal ranks: no progress
    assert _transition_check(spec, s, s, r, r + 1) is None
    assert _transition_check(spec, s, s, r - 1, None) is None  # the next state's rank computed: r > r - 1
    assert _transition_check(spec, s, s, None, r + 1) is None  # this state's rank computed: r + 1 > r


def test_event_matches_takes_only_the_event_named_and_only_a_step_that_breaks_a_check():
    spec = Spec(Config(1, 2, 1, 1))
    state = spec.initial()
    steps = spec.successors(state)
    good = next(s for s in steps if not s.violation)
    assert _transition_check(spec, state, good.state) is None
    assert _event_matches(spec, state, good, good.event) is False  # a step that breaks nothing
    bad = Step(good.event, good.state, "crash", "")
    assert _event_matches(spec, state, bad, good.event) is True
    assert _event_matches(spec, state, bad, ("no-such-event", 0)) is False
    # a step into a state of no higher rank breaks the rank check
    looped = Step(good.event, state)
    assert _event_matches(spec, state, looped, good.event) is True


# -- a bounded, stopped or watched exploration -------------------------------------------------------
def test_the_result_keeps_its_configuration_and_whether_symmetry_was_used():
    cfg = Config(1, 1, 1, 1)
    on, off = explore(cfg), explore(cfg, symmetry=False)
    assert on.config is cfg and off.config is cfg
    assert on.symmetry is True and off.symmetry is False


def test_max_states_stops_after_the_state_that_reaches_it():
    cfg = Config(1, 2, 1, 1)
    first = explore(cfg, max_states=1)  # the initial state and its successors, then stop
    assert isinstance(first, Result) and 1 < first.states < 489
    again = explore(cfg, max_states=first.states)
    assert again.states == first.states  # reached exactly after the first state: nothing more


def test_stop_at_first_returns_the_result_with_its_violation():
    r = explore(Config(1, 2, 1, 1, variant="busy-wait"), stop_at_first=True)
    assert isinstance(r, Result) and list(r.violations) == ["deadlock"]


def test_an_identity_starved_is_reported_at_the_first_state_found_so_its_trace_is_the_shortest():
    # without a write deadline identity 0's own unreported write keeps its room: starved (nothing assumed fair of
    # the transport) from the first state its write is in flight, and in many deeper states after it
    cfg = Config(2, 2, 1, 0, variant="no-write-deadline", sizes=(1,), identities=2)
    v = explore(cfg).violations["identity-starved"]
    assert [e for e, _ in v.trace[1:]] == [("register", 0), ("frame", 0), ("tower", 0, 1), ("copied", 0)]


def test_a_step_back_into_a_state_already_seen_is_a_model_cycle_whose_trace_ends_with_that_step(monkeypatch):
    # a spec with a cycle (a made-up event from every later state back to the initial one): the explorer
    # reports the first step that closes it, its trace rebuilt up to that step into the known state
    cfg = Config(1, 1, 1, 0)
    successors = Spec.successors

    def with_a_way_back(spec, state):
        out = successors(spec, state)
        return out + [Step(("back",), spec.initial())] if state != spec.initial() else out

    monkeypatch.setattr(Spec, "successors", with_a_way_back)
    v = explore(cfg).violations["model-cycle"]
    (event, state), (before_event, before) = v.trace[-1], v.trace[-2]
    assert event == ("back",) and state == Spec(cfg).initial() and v.detail == "on back"
    assert before_event[0] != "back" and before != state
    assert [e for e, _ in v.trace].count(("back",)) == 1


class Ticks:
    """A clock that moves `step` seconds each time it is read, from 100."""

    def __init__(self, step: float) -> None:
        self.step, self.reads = step, 0

    def __call__(self) -> float:
        self.reads += 1
        return 100.0 + self.step * (self.reads - 1)


def test_progress_is_reported_every_second_of_the_explorations_clock(monkeypatch):
    clock, calls = Ticks(0.25), []
    monkeypatch.setattr(ex.time, "perf_counter", clock)
    r = explore(Config(1, 1, 1, 1), progress=lambda states, seconds, depth: calls.append((states, seconds, depth)))
    # read at the start, once per state with successors, and at the end
    assert r.seconds == 0.25 * (clock.reads - 1)
    assert [s for _, s, _ in calls] == [float(n) for n in range(1, len(calls) + 1)]
    assert len(calls) == (clock.reads - 2) // 4 > 2
    assert all(type(n) is int and 1 < n <= r.states for n, _, _ in calls)
    assert [n for n, _, _ in calls] == sorted(n for n, _, _ in calls)
    assert all(type(d) is int and 0 <= d <= r.depth for _, _, d in calls)
    assert calls[-1][2] > 0


def test_without_a_progress_callback_a_long_exploration_runs_through(monkeypatch):
    monkeypatch.setattr(ex.time, "perf_counter", Ticks(1.0))
    assert explore(Config(1, 1, 1, 1)).states == 37


# -- traces: their configuration, their first step, the choices they name -----------------------------
@pytest.mark.parametrize("cfg", [Config(1, 2, 1, 1, variant="seed", regions=False),
                                 Config(1, 2, 1, 1, channels=True, late_landing=True),
                                 Config(1, 2, 1, 1, restarts=1), Config(1, 2, 1, 1, identities=2)], ids=str)
def test_a_trace_carries_its_whole_configuration(cfg):
    data = json.loads(trace_to_json(cfg, ex.Violation("kind", "detail", [(("init",), Spec(cfg).initial())])))
    assert Config(**data["config"]) == cfg


def test_a_trace_and_its_replay_start_from_the_same_initial_step():
    cfg = Config(cells=1, rooms=2, receivers=1, faults=1, variant="reaped-deferred-crash")
    v = explore(cfg).violations["crash"]
    steps, _ = replay(json.loads(trace_to_json(cfg, v)))
    assert steps[0] == v.trace[0] and v.trace[0][0] == ("init",)


def _two_successors_by_one_event(spec: Spec):
    """A state and an event it has two successors by (a choice the event alone does not name)."""
    seen, frontier = {spec.initial()}, [spec.initial()]
    path: dict = {spec.initial(): []}
    while frontier:
        state = frontier.pop(0)
        by_event: dict = {}
        for s in spec.successors(state):
            if not s.violation:
                by_event.setdefault(s.event, []).append(s)
        for event, alike in by_event.items():
            if len({s.state for s in alike}) > 1:
                return path[state], event, alike
        for s in spec.successors(state):
            if s.state not in seen and not s.violation:
                seen.add(s.state)
                path[s.state] = [*path[state], s]
                frontier.append(s.state)
    raise AssertionError("no event with two successors")


def test_replay_follows_the_states_a_trace_names_where_one_event_has_several_successors():
    cfg = Config(2, 2, 1, 1)
    spec = Spec(cfg)
    before, event, alike = _two_successors_by_one_event(spec)
    for chosen in alike:
        taken = [*before, chosen]
        data = {"config": {"cells": 2, "rooms": 2, "receivers": 1, "faults": 1},
                "events": [list(s.event) for s in taken], "states": [repr(s.state) for s in taken]}
        steps, problem = replay(data)
        assert problem is None and steps[-1] == (event, chosen.state)
    # without the states, the first successor by that event
    steps, _ = replay({"config": data["config"], "events": data["events"]})
    assert steps[-1][1] == alike[0].state


def test_a_tower_event_without_a_size_is_named_without_failing():
    assert isinstance(event_name(("tower", 1)), str)


# -- the conformance harness: lockstep walks where the smallest bounds do not go ----------------------
from epd_ring.models.conformance import (  # noqa: E402
    Harness,
    check_full_state,
    coverage_targets,
    reach,
    replay_on_implementation,
)
from epd_ring.models.conformance_clock import fires  # noqa: E402
from epd_ring.models.spec import LEN, SS  # noqa: E402

# two receivers (parked rooms, partial registrations), two faults (an unsure write, then a late landing
# or a withdraw), peers (backoff, probes, a contact that expires), mixed sizes and a staging error
FAULTS = frozenset(("abort", "withdraw", "expire", "tower_error", "stage_error", "write_unsure", "refused",
                    "connect_expired", "probe_refused", "probe_expired", "write_deadline"))
WALKS = [Config(1, 2, 2, 2, sizes=(1,)), Config(1, 2, 1, 2, peers=True, sizes=(1,)), Config(2, 3, 1, 2),
         Config(1, 2, 2, 2, peers=True, sizes=(1,)), Config(2, 2, 2, 1)]


@pytest.mark.parametrize("cfg", WALKS, ids=str)
def test_seeded_random_walks_keep_the_implementation_in_lockstep_to_a_final_state(cfg):
    """Each walk takes events the spec enables until none is left: the implementation follows every one
    (`Harness.step` compares the whole state after each, `check_full_state` the deadlines and bytes) and
    ends where the spec does, every room concluded and every extent free."""
    rng = random.Random(7)
    seen: set[str] = set()
    for _ in range(12):
        h = Harness(cfg)
        while events := h.enabled():
            calm = [e for e in events if e[0] not in FAULTS]
            event = rng.choice(calm if calm and rng.random() < 0.7 else events)  # faults, but not always first
            seen.add(event[0])
            h.step(event)
        assert h.spec.is_final(h.state)
        assert h.abstract() == h.state
    assert {"register", "frame", "copied", "write_done"} <= seen


def _harness(cfg: Config, events) -> Harness:
    h = Harness(cfg)
    for event in events:
        assert event in h.enabled(), (event, h.enabled())
        h.step(event)
    return h


ONE = Config(1, 1, 1, 2, sizes=(1,))
SENT = [("register", 0), ("frame", 0), ("tower", 0, 1), ("copied", 0)]


def test_full_state_catches_a_room_whose_frames_are_not_those_sent():
    h = _harness(ONE, [("register", 0), ("frame", 0)])
    check_full_state(h)
    h.frames_sent[0] = 0  # the harness forgets the frame it sent: the room holds one not sent
    with pytest.raises(AssertionError):
        check_full_state(h)


@pytest.mark.parametrize("events, state", [([("frame", 0)], "announced"),
                                           ([("register", 0), ("tower", 0, 1), ("copied", 0)], "parked")])
def test_full_state_catches_an_announced_or_parked_room_without_a_deadline(events, state):
    h = _harness(ONE, events)
    room = h.manager.rooms[h.room(0)]
    assert room.state == state and room.timer
    check_full_state(h)
    room.timer = 0
    with pytest.raises(AssertionError):
        check_full_state(h)


def test_full_state_catches_a_deadline_due_at_another_time():
    h = _harness(ONE, SENT)
    (w,) = h.manager.writes.by_handle.values()
    check_full_state(h)
    w.due += 1.0
    with pytest.raises(AssertionError):
        check_full_state(h)
    w.due -= 1.0
    h.step(("write_unsure", 0, 0))
    (e,) = [e for e in h.executor.ring.extents.values() if e.state == "quarantined"]
    check_full_state(h)
    e.due += 1.0
    with pytest.raises(AssertionError):
        check_full_state(h)


def test_full_state_reads_a_receivers_bytes_as_room_labels():
    h = _harness(ONE, [*SENT, ("write_done", 0, 0)])
    buf = h.buffers[(0, 0)]
    check_full_state(h)
    buf[: buf.shape[0] // 2] = -1.0  # a receiver told success that holds its room's bytes in part only
    with pytest.raises(AssertionError):
        check_full_state(h)
    h = _harness(ONE, [("register", 0), ("frame", 0)])
    buf = h.buffers[(0, 0)]
    buf[0] = float(h.room(0))  # its own room's bytes in part, no outcome yet: allowed
    check_full_state(h)
    buf[0] = float(h.room(0) + 1)  # another room's bytes: never
    with pytest.raises(AssertionError):
        check_full_state(h)


# -- coverage targets and the shortest paths to them ---------------------------------------------------
def test_coverage_targets_name_two_cell_places_only_where_items_take_two_cells():
    one, two = set(coverage_targets(Config(1, 2, 1, 1, sizes=(1,)))), set(coverage_targets(Config(2, 2, 1, 1)))
    extra = {"extent of two cells", "deferred with a cell free"}
    assert not extra & one and two == one | extra
    assert "two deferred sends" in one


def test_coverage_targets_predicates_hold_exactly_where_they_say():
    t = coverage_targets(Config(2, 2, 1, 1))
    init = Spec(Config(2, 2, 1, 1)).initial()
    rooms, cells = init[0], init[1]

    def state(cells=cells, deferred=()):
        return (rooms, cells, deferred, *init[3:])

    assert not t["two deferred sends"](state(deferred=(0,)))
    assert t["two deferred sends"](state(deferred=(0, 1)))
    assert all(c[SS] == "free" for c in cells)
    assert t["deferred with a cell free"](state(deferred=(0,)))
    assert not t["deferred with a cell free"](state())
    busy = tuple(("staged", *c[SS + 1:]) for c in cells)
    assert not t["deferred with a cell free"](state(cells=busy, deferred=(0,)))
    two = ((cells[0][:LEN] + (2,) + cells[0][LEN + 1:]), *cells[1:])
    assert t["extent of two cells"](state(cells=two)) and not t["extent of two cells"](state())


def test_reach_gives_event_lists_the_spec_and_the_harness_take_in_order():
    cfg = Config(2, 2, 1, 1)
    targets = coverage_targets(cfg)
    found = reach(cfg, targets)
    assert {"two deferred sends", "extent of two cells"} - set(found) == {"two deferred sends"}
    sizes = Harness.room_sizes(cfg)
    spec = Spec(cfg)
    for name, events in found.items():
        state = spec.initial()
        for ev in events:
            assert ev[0] != "tower" or len(ev) < 3 or ev[2] == sizes[ev[1]]
            state = next(s.state for s in spec.successors(state) if s.event == ev)
        assert targets[name](state), name


def test_reach_explores_up_to_max_states_and_no_further():
    import inspect

    cfg = Config(1, 2, 1, 1)
    spec = Spec(cfg)
    init = spec.initial()
    first = {s.state for s in spec.successors(init) if not s.violation}
    moved = {"moved": lambda st: st != init}
    assert reach(cfg, moved, max_states=1 + len(first)) == {}  # the first level is known, not yet looked at
    assert list(reach(cfg, moved, max_states=2 + len(first))) == ["moved"]
    assert inspect.signature(reach).parameters["max_states"].default == 200_000


# -- a hazard's trace replayed on the implementation ---------------------------------------------------
FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "hazards"


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_a_hazard_whose_states_part_is_reported_where_they_part():
    report = replay_on_implementation(_fixture("seed--H15"))
    assert report["diverged_at"] == 5 and report["refused"] == [] and report["hazard_len"] == 6
    assert isinstance(report["final"], str)


def test_a_hazard_in_its_last_transition_is_reported_checked_on_the_implementation():
    data = _fixture("seed--H16")
    report = replay_on_implementation(data)
    assert report["diverged_at"] == len(data["events"]) == 4
    assert [(n, kind) for n, kind, _ in report["refused"]] == [(4, "deadline-extended")]


def test_events_the_design_does_not_allow_are_refused_and_skipped():
    """A seed trace whose tower and copy the project refuses (the receiver withdrew first): both are
    refused, numbered from one, and the walk goes on with the events after them."""
    data = {"config": {"cells": 1, "rooms": 2, "receivers": 1, "faults": 1, "variant": "seed", "sizes": [1]},
            "violation": "none", "events": [["frame", 1], ["withdraw", 1, 0], ["register", 1], ["tower", 1, 1],
                                            ["copied", 1], ["frame", 0], ["register", 0]]}
    report = replay_on_implementation(data)
    assert report["diverged_at"] == 2  # the seed's withdraw keeps the room's region; ours lets it go
    assert [(n, name) for n, name, _ in report["refused"]] == [(4, event_name(("tower", 1, 1))),
                                                               (5, event_name(("copied", 1)))]
    assert all(isinstance(where, str) for _, _, where in report["refused"])
    h = _harness(Config(1, 2, 1, 1, sizes=(1,)), [("frame", 1), ("withdraw", 1, 0), ("register", 1), ("frame", 0),
                                                  ("register", 0)])
    assert report["final"] == h.spec.describe(h.state)


# -- the harness's own refusals and its deadlines' names ------------------------------------------------
@pytest.mark.parametrize("sizes", [(1,), (1, 3)])
def test_a_harness_refuses_room_sizes_that_are_not_one_of_the_configurations_per_room(sizes):
    with pytest.raises(ValueError):
        Harness(Config(2, 2, 1, 1), room_sizes=sizes)


def test_each_deadline_event_fires_the_deadline_the_harness_keys_it_by():
    h = _harness(ONE, SENT)
    (w,) = h.manager.writes.by_handle.values()
    assert h.timing.deadline_key("write", w) in fires(("write_deadline", 0))
    h.step(("write_unsure", 0, 0))
    (e,) = [e for e in h.executor.ring.extents.values() if e.state == "quarantined"]
    assert h.timing.deadline_key("quarantine", e) in fires(("release", 0))
    room = _harness(ONE, [("frame", 0)]).manager.rooms[500]
    assert h.timing.deadline_key("announce", room) in fires(("expire", 0))


def test_a_refused_event_where_the_states_still_agree_is_where_they_part():
    """The harness gives room 0 an item of one cell: the trace's two-cell tower is refused while the
    states still agree, and that is where the implementation leaves the trace."""
    data = {"config": {"cells": 2, "rooms": 2, "receivers": 1, "faults": 1}, "violation": "none",
            "events": [["register", 0], ["frame", 0], ["tower", 0, 2], ["register", 1], ["frame", 1]]}
    report = replay_on_implementation(data)
    assert report["diverged_at"] == 3
    assert [n for n, _, _ in report["refused"]] == [3]


def test_a_transferring_rooms_count_of_writes_left_is_read_against_the_receivers_bytes():
    """Reading the implementation back checks the manager's count of writes left against the receivers
    whose bytes landed: a core that miscounts is caught there."""
    h = _harness(Config(1, 1, 2, 1, sizes=(1,)), [("register", 0), ("frame", 0), ("frame", 0), ("tower", 0, 1),
                                                   ("copied", 0), ("write_done", 0, 0)])
    room = h.manager.rooms[h.room(0)]
    assert room.state == "transferring" and room.chunk is None
    h.abstract()
    room.writes_left += 1
    with pytest.raises(AssertionError):
        h.abstract()
