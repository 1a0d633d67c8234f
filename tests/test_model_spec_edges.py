"""Edges of the spec's state layout and checks, and of the Promela generator and its read-back, that the
smallest pinned spaces (test_model_pins.py) do not reach: each test here stands for survivors of the
mutation pass (tests/mutation/survivors.md, issue 32) and runs in a fraction of a second without SPIN.

The spec's checks are driven on states built by hand (a room's tuple: models/state.py), the Promela
read-back on the lines SPIN's `show_state` prints, written here from a spec state by an encoder of its
own (models/promela_search.py's printf format), and the generator through what its text must contain
for the declared tables and switches.
"""

from __future__ import annotations

import itertools
import re

import pytest

from epd_ring.fsm import EXTENT, PEER, ROOM, couplings
from epd_ring.models import liveness, promela, promela_events, promela_peers, promela_shares
from epd_ring.models.explore import canonical, explore
from epd_ring.models.promela import (
    EXTENT_STATES,
    HALTS,
    NONE,
    REGION_STATES,
    ROOM_STATES,
    TOLD_VALUES,
    Disagreement,
    _parse_state,
    generate,
    pan_figure,
    parse_trail,
    rebuild,
)
from epd_ring.models.spec import PEER_VARIANTS, VARIANTS, Config, Spec
from epd_ring.models.state import (
    _PEER_RANK,
    _REGION_RANK,
    CH_COPYING,
    CH_HELD,
    CH_SENT,
    CHAN_CAP,
    TOLD_TWICE,
    W_FLIGHT,
    W_IDLE,
    WD_ACKED,
    WD_SENT,
    Draft,
    chan_len,
    chan_notices,
    chan_push,
    extent,
    told_after,
)

C = Config


# -- models/state.py ------------------------------------------------------------------------------------
def test_a_channel_reads_back_its_notices_in_the_order_they_were_pushed():
    ch = 0
    for notice in ("success", "released", "withdrawn"):
        ch = chan_push(ch, notice)
    assert chan_notices(ch) == ["success", "released", "withdrawn"]
    assert chan_len(ch) == CHAN_CAP
    assert chan_notices(chan_push(chan_push(0, "failed"), "released")) == ["failed", "released"]


def test_a_full_channel_refuses_one_more_notice():
    ch = 0
    for _ in range(CHAN_CAP):
        ch = chan_push(ch, "released")
    with pytest.raises(AssertionError):
        chan_push(ch, "released")


def test_a_cell_that_starts_no_extent_is_an_extent_of_itself_alone():
    cells = [("sending", 0, False, 2), ("sending", 0, False, 0), ("free", -1, False, 1)]
    assert list(extent(cells, 0)) == [0, 1]
    assert list(extent(cells, 1)) == [1]
    assert list(extent(cells, 2)) == [2]


def test_a_second_outcome_is_told_twice_and_other_notices_keep_what_was_told():
    assert told_after("", "success") == "success"
    assert told_after("success", "failed") == TOLD_TWICE
    assert told_after("failed", "failed") == TOLD_TWICE
    assert told_after("success", "released") == "success"


def test_a_draft_keeps_the_first_violation_flagged():
    d = Draft([], [], (), 0, ())
    d.flag(None)
    assert d.violation is None
    d.flag("first", "one")
    d.flag("second", "two")
    d.flag(None, "three")
    assert (d.violation, d.detail) == ("first", "one")


# -- models/spec.py: Config ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(cells=0), dict(rooms=0), dict(receivers=0), dict(faults=-1),
                                dict(sizes=()), dict(sizes=(0, 1)), dict(sizes=(16,)), dict(sizes=(2, 1)),
                                dict(sizes=(1, 1)), dict(channels=True, regions=False),
                                dict(late_landing=True, regions=False), dict(channels=True, variant="seed"),
                                dict(late_landing=True, variant="seed"), dict(variant="nope")])
def test_a_config_outside_the_model_is_refused(kw):
    with pytest.raises(ValueError):
        Config(**kw)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_identities_take_the_projects_rules_or_those_without_a_write_deadline(variant):
    if variant in ("project", "no-write-deadline"):
        assert Config(cells=2, rooms=2, variant=variant, identities=2).identities == 2
    else:
        with pytest.raises(ValueError, match="identities"):
            Config(cells=2, rooms=2, variant=variant, identities=2)


def test_the_largest_sizes_and_fewest_faults_are_a_config():
    assert Config(cells=1, rooms=1, receivers=1, faults=0, sizes=(1, 15)).sizes == (1, 15)
    assert Config(sizes=(15,)).sizes == (15,)


def test_sizes_given_as_a_list_read_back_as_a_tuple_and_the_config_stays_hashable():
    cfg = Config(sizes=[1, 2])
    assert type(cfg.sizes) is tuple and cfg.sizes == (1, 2)
    assert cfg == Config(sizes=(1, 2)) and hash(cfg) == hash(Config(sizes=(1, 2)))


# -- models/spec.py: the checks on states built by hand ----------------------------------------------------
def _room(rs="registered", snd=1, ch=0, reg=1, told=0, ok=0, infl=0, ghost=0, rcv=(), size=0, at=-1):
    return (rs, snd, ch, reg, told, ok, infl, ghost, tuple(rcv), size, at)


def _state(rooms, cells=(("free", -1, False, 1),), peers=()):
    return (tuple(rooms), tuple(cells), (), 1, None, tuple(peers))


def _kind(cfg, state):
    found = Spec(cfg).invariant(state)
    return found[0] if found else None


def test_a_room_served_by_a_down_peer_must_have_concluded():
    cfg = C(1, 1, 1, 1, peers=True, sizes=(1,))
    assert _kind(cfg, _state([_room(rcv=[("offered", W_IDLE, "")])], peers=["down"])) == "room-of-down-peer-live"
    assert _kind(cfg, _state([_room(rcv=[("offered", W_IDLE, "")])], peers=["up"])) is None


def test_a_room_without_an_extent_is_overlapped_by_nothing():
    # its size is known (the tower ran) but it holds no cell: the last cell's tenant is no overlap of it
    cfg = C(1, 2, 1, 1)
    rooms = [_room(ch=CH_HELD, infl=1, ghost=1, size=1, rcv=[("offered", W_FLIGHT, "")]),
             _room(ch=2, size=1, at=0, rcv=[("offered", W_IDLE, "")])]
    assert _kind(cfg, _state(rooms, cells=[("copying", 1, False, 1)])) is None


def test_success_needs_every_receiver_written():
    cfg = C(1, 1, 2, 1)
    room = _room(rs="success", snd=1, ch=CH_SENT, reg=2, told=2, ok=1,
                 rcv=[("written", W_IDLE, "success"), ("written", W_IDLE, "success")])
    assert _kind(cfg, _state([room])) == "success-without-all-writes"


def test_a_receiver_told_success_while_a_write_into_it_may_land_is_a_success_under_write():
    cfg = C(1, 1, 1, 1)
    room = _room(rs="success", ch=CH_SENT, told=1, ok=1, infl=1, rcv=[("written", W_FLIGHT, "success")])
    assert _kind(cfg, _state([room])) == "success-under-write"


@pytest.mark.parametrize("rs, region, told", [("failed", "written", "failed"), ("success", "failed", "success")])
def test_a_region_whose_outcome_is_not_its_rooms_is_a_wrong_outcome(rs, region, told):
    cfg = C(1, 1, 1, 1)
    room = _room(rs=rs, ch=CH_SENT, told=1, ok=1, rcv=[(region, W_IDLE, told)])
    assert _kind(cfg, _state([room])) == "wrong-outcome"


def test_a_receiver_told_two_outcomes_is_told_twice():
    cfg = C(1, 1, 1, 1)
    room = _room(rs="failed", ch=CH_SENT, told=1, rcv=[("failed", W_IDLE, TOLD_TWICE)])
    assert _kind(cfg, _state([room])) == "told-twice"


def _final_room(rcv):
    return _room(rs="success", snd=2, ch=CH_SENT, reg=1, told=1, ok=1, rcv=rcv)


def test_a_final_state_has_every_receiver_told_its_rooms_outcome():
    spec = Spec(C(1, 1, 1, 1))
    assert spec.is_final(_state([_final_room([("written", W_IDLE, "success")])]))
    assert not spec.is_final(_state([_final_room([("written", W_IDLE, "")])]))
    assert not spec.is_final(_state([_final_room([("written", W_FLIGHT, "success")])]))


def test_with_channels_a_final_state_has_no_notice_on_its_way_and_no_withdraw_unanswered():
    spec = Spec(C(1, 1, 1, 1, channels=True))
    assert spec.is_final(_state([_final_room([("written", W_IDLE, "success", 0, WD_ACKED, 0)])]))
    assert not spec.is_final(_state([_final_room([("written", W_IDLE, "success", 0, WD_SENT, 0)])]))
    assert not spec.is_final(_state([_final_room([("written", W_IDLE, "success", 3, WD_ACKED, 0)])]))


# -- models/promela.py: reading SPIN's printfs back ---------------------------------------------------------
def _show_state(cfg, state) -> list[str]:
    """The lines promela_search.show_state prints for `state` (an encoder of our own, from its printfs)."""
    rooms, cells, deferred, faults, halt, peers = state[:6]
    codes = {v: k for k, v in HALTS.items()}
    out = [" ".join(["ST", str(codes[halt]), str(faults), str(len(deferred)), *map(str, deferred)])]
    for r in rooms:
        f = [ROOM_STATES.index(r[0]), *r[1:8], r[9], NONE if r[10] < 0 else r[10]]
        for j in range(cfg.receivers):
            x = r[8][j] if j < len(r[8]) else None
            f += [REGION_STATES.index(x[0]) + 1, x[1], TOLD_VALUES.index(x[2])] if x else [0, 0, 0]
            if cfg.channels:
                f += [int(v) for v in x[3:]] if x else [0, 0, 0]
        out.append(("RX" if cfg.channels else "RM") + "".join(f" {int(v)}" for v in f))
    # a cell's content: NONE for no room, FORGOT + v for a busy cell of identity v no room covers (-2 - v)
    content = {-1: NONE, **{-2 - v: promela_shares.FORGOT + v for v in range(8)}}
    out += [f"SL {EXTENT_STATES.index(s[0]) + 1} {content.get(s[1], s[1])} {int(s[2])} {s[3]}" for s in cells]
    if cfg.peers:
        out.append("PE" + "".join(f" {promela_peers.PEER_STATES.index(p)}" for p in peers))
    return out


def _some_states(cfg, limit=400):
    """Canonical states of `cfg`, breadth first from the initial one."""
    spec = Spec(cfg)
    seen, todo = {canonical(spec.initial())}, [canonical(spec.initial())]
    while todo and len(seen) < limit:
        for step in spec.successors(todo.pop(0)):
            c = canonical(step.state)
            if c not in seen and c[4] in HALTS.values():
                seen.add(c)
                todo.append(c)
    return seen


@pytest.mark.parametrize("cfg", [C(2, 2, 2, 1), C(1, 1, 2, 1, channels=True), C(2, 1, 1, 1, channels=True),
                                 C(1, 2, 2, 1, peers=True, sizes=(1,))], ids=str)
def test_every_state_spin_prints_reads_back_as_the_spec_state(cfg):
    states = _some_states(cfg)
    assert any(r[8] for s in states for r in s[0]) and any(r[10] >= 0 for s in states for r in s[0])
    for state in states:
        assert _parse_state(_show_state(cfg, state)) == state


def test_a_cell_no_room_covers_reads_back_charged_to_its_identity():
    cfg = C(2, 2, 1, 1, regions=False, identities=2)
    states = [s for s in _some_states(cfg, 2000) if any(c[1] < -1 for c in s[1])]
    assert {c[1] for s in states for c in s[1] if c[1] < -1} == {-2, -3}  # each identity's
    for state in states:  # SPIN prints no owner: a room's is its index's (promela_shares.py, rebuild)
        assert _parse_state(_show_state(cfg, state)) == (tuple(r[:-1] for r in state[0]), *state[1:])


@pytest.mark.parametrize("cfg", [C(2, 2, 1, 1, restarts=2), C(2, 2, 1, 1, regions=False, identities=2)], ids=str)
def test_a_states_description_names_every_room_its_owner_and_whose_bytes_an_uncovered_cell_holds(cfg):
    from epd_ring.models.state import CONTENT, LEN, OWNER, SND, SND_DEAD, SS, UNSURE

    spec, seen = Spec(cfg), set()
    for state in _some_states(cfg, 2000):
        parts = spec.describe_parts(state)
        rooms = [p for p in parts if p.startswith("room")]
        assert len(rooms) == cfg.rooms, parts  # an orphan among them too
        for i, r in enumerate(state[0]):
            owner = f"@{r[OWNER]}" if r[SND] != SND_DEAD and len(r) > OWNER else ""
            assert rooms[i].startswith(f"room{i}{owner}="), (i, parts)
            seen.add("orphan" if r[SND] == SND_DEAD else "owner" if owner else "room")
        for k, cell in enumerate(state[1]):
            if cell[LEN] and cell[CONTENT] < -1:  # a busy cell no room covers: the identity it is charged to
                where = f"cell{k}" if cell[LEN] == 1 else f"cells{k}-{k + cell[LEN] - 1}"
                assert f"{where}={cell[SS]}<@{-2 - cell[CONTENT]}{'!' if cell[UNSURE] else ''}" in parts, parts
                seen.add(cell[CONTENT])
        if cfg.restarts:  # state[6]: the restarts left; the incarnation is the count of those that happened
            assert [p for p in parts if p.startswith("incarnation")] == (
                [f"incarnation{cfg.restarts - state[6]}"] if state[6] < cfg.restarts else [])
            seen.add(f"incarnation{cfg.restarts - state[6]}")
    assert seen >= ({"orphan", "room", "incarnation1", "incarnation2"} if cfg.restarts else {"owner", -2, -3})


def test_a_description_names_what_is_left_of_an_extent_whose_first_cell_was_overwritten():
    # room 0's two cells, then (a lease that did not check its chunk was parked) room 1's item in its first cell:
    # the second cell, still room 0's, is described on its own; an extent whole is described once
    spec = Spec(C(2, 2, 1, 1, variant="no-parked-check"))
    rooms = (_room("parked", ch=CH_HELD, reg=0, size=2, at=0), _room(ch=CH_COPYING, reg=0, size=1, at=0))

    def cells(state):
        return {p.split("=")[0]: p for p in spec.describe_parts(state) if p.startswith("cell")}

    whole = cells(_state(rooms[:1] + (_room(snd=0, reg=0),), (("parked", 0, False, 2), ("parked", 0, False, 0))))
    assert list(whole) == ["cells0-1"]
    split = cells(_state(rooms, (("copying", 1, False, 1), ("parked", 0, False, 0))))
    assert list(split) == ["cell0", "cell1"] and "room1" in split["cell0"] and "room0" in split["cell1"]


def test_a_trail_reads_back_as_its_events_and_states_and_its_violation():
    cfg = C(1, 1, 2, 1, channels=True)
    states = sorted(_some_states(cfg, 30), key=repr)[:3]
    text = "\n".join(f"EV {promela.EVENTS.index('frame')} {n}\n" + "\n".join(_show_state(cfg, s))
                     for n, s in enumerate(states))
    text += f"\nVIOLATION {promela.CODE['deadlock']}\n"
    steps, kind = parse_trail("spin: some banner\n" + text)
    assert steps == [("frame", n, s) for n, s in enumerate(states)] and kind == "deadlock"
    peer_cfg = C(1, 1, 1, 1, peers=True, sizes=(1,))
    state = canonical(Spec(peer_cfg).initial())
    steps, kind = parse_trail("EV 1 0\n" + "\n".join(_show_state(peer_cfg, state)))
    assert steps == [("frame", 0, state)] and kind is None


def test_a_trail_where_a_declared_machine_refused_a_move_is_a_disagreement():
    with pytest.raises(Disagreement):
        parse_trail("EV 1 0\nMODELBUG room registered frame\n")


def test_a_figure_pan_did_not_print_is_the_default():
    assert pan_figure(r"errors: (\d+)", "pan: nothing") == 0
    assert pan_figure(r"errors: (\d+)", "errors: 3") == 3
    assert pan_figure(r"x ([\d.e+]+)", "x 1.5e+02", float, 0.0) == 150.0


# -- models/promela.py: rebuilding SPIN's steps on the spec ---------------------------------------------
def _as_spin(cfg, state):
    """The canonical state as SPIN prints it: with identities, its rooms without their owner."""
    c = canonical(state)
    return (tuple(r[:-1] for r in c[0]), *c[1:]) if cfg.identities > 1 else c


def _spin_steps(cfg, kind):
    """The explorer's shortest trace to `kind`, as SPIN's steps: (event name, argument, state as SPIN prints it)."""
    v = explore(cfg).violations[kind]
    return [(event[0], 0, _as_spin(cfg, state)) for event, state in v.trace[1:]]


@pytest.mark.parametrize("cfg, kind, other", [
    (C(1, 2, 1, 1, variant="busy-wait"), "deadlock", "overwrite-under-chunk"),
    (C(1, 2, 1, 1, variant="no-write-deadline"), "room-never-concludes", "deadlock"),
    (C(1, 2, 1, 1, variant="no-parked-check"), "overwrite-under-chunk", "overwrite-under-write"),
    # an identity starved by its own write the transport never reports: no fairness of F1 in this variant
    (C(2, 2, 1, 0, variant="no-write-deadline", sizes=(1,), identities=2), "identity-starved", "deadlock")], ids=str)
def test_spins_steps_to_a_violation_rebuild_on_the_spec_and_the_wrong_kind_is_a_disagreement(cfg, kind, other):
    steps = _spin_steps(cfg, kind)
    trace = rebuild(Spec(cfg), steps, kind)
    assert [_as_spin(cfg, s) for _, s in trace[1:]] == [s for _, _, s in steps]
    with pytest.raises(Disagreement):
        rebuild(Spec(cfg), steps, other)
    with pytest.raises(Disagreement):  # the path, one step short, reaches no violation
        rebuild(Spec(cfg), steps[:-1], kind)


def test_a_spin_step_whose_state_the_event_does_not_reach_is_a_disagreement():
    cfg = C(1, 2, 1, 1, variant="busy-wait")
    steps = _spin_steps(cfg, "deadlock")
    event, arg, _ = steps[1]
    bad = [steps[0], (event, arg, steps[0][2])]  # the right event, a state it does not reach
    with pytest.raises(Disagreement):
        rebuild(Spec(cfg), bad, "deadlock")
    misnamed = [("withdraw", 0, steps[0][2]), *steps[1:]]  # a state the spec reaches, by another event
    assert steps[0][0] != "withdraw"
    with pytest.raises(Disagreement):
        rebuild(Spec(cfg), misnamed, "deadlock")


# -- models/promela*.py: the generator ----------------------------------------------------------------------
def _inlines(text: str) -> dict[str, str]:
    """Each `inline name(...) { ... }` of a generated model, by name (its text up to the next one)."""
    parts = re.split(r"^(?=inline \w+\()", text, flags=re.M)
    return {re.match(r"inline (\w+)\(", p).group(1): p for p in parts if p.startswith("inline ")}


@pytest.mark.parametrize("cfg", [C(2, 2, 2, 1, channels=True, late_landing=True), C(2, 2, 2, 1, peers=True),
                                 C(2, 2, 1, 1, regions=False), C(2, 2, 1, 1, variant="seed")], ids=str)
def test_a_room_arm_is_about_one_receiver_exactly_when_it_names_the_receiver(cfg):
    arms = promela_events.room_arms("x", "y", cfg)
    assert {name for name, *_ in arms} >= {"register", "frame", "tower", "copied", "expire", "abort"}
    for name, guard, act, per_receiver in arms:
        if cfg.regions:
            assert per_receiver == bool(re.search(r"\by\b", guard + act)), (name, guard, act)
        else:  # without regions a write is about the room: its family still says receiver, as receiver 0
            assert not re.search(r"\by\b", guard + act), (name, guard, act)


@pytest.mark.parametrize("machine, event, guard", [("room", "add_receiver", "all_receivers"),
                                                   ("extent", "settle", "write_unsure")])
def test_a_dropped_guard_leaves_that_one_move_without_it_and_every_other_inline_as_it_was(machine, event, guard):
    cfg = C(2, 2, 2, 1)
    whole, broken = _inlines(generate(cfg)), _inlines(generate(cfg, drop_guard=(machine, event, guard)))
    assert whole.keys() == broken.keys()
    assert [name for name in whole if whole[name] != broken[name]] == [f"{machine}_{event}"]
    emitted = {"all_receivers": "(rallr)", "write_unsure": "cell[sx].unsure"}[guard]
    assert broken[f"{machine}_{event}"].count(emitted) < whole[f"{machine}_{event}"].count(emitted)
    # each source still moves: its first declared destination, now taken without that guard, is still set
    table = {"room": ROOM, "extent": EXTENT}[machine].table
    sets = {"room": "rout = R_{}", "extent": "cell[sx].ss = S_{}"}[machine]
    for (src, ev), options in table.items():
        if ev == event:
            arm = next(a for a in broken[f"{machine}_{event}"].split("\n  :: ") if f"_{src} -> " in a)
            assert sets.format(options[0][0]) in arm and "MODELBUG" not in arm.split(" :: else")[0]


@pytest.mark.parametrize("machine, event, index", [("room", "fail", "mx"), ("peer", "connected", "px"),
                                                   ("extent", "release", "sx")])
def test_a_move_runs_the_actions_the_table_lists_for_its_event_in_their_order(monkeypatch, machine, event, index):
    monkeypatch.setitem(couplings.ON_EVENT, (machine, event), ("resume_rooms", "fail_rooms"))
    move = _inlines(generate(C(1, 2, 2, 1, peers=True, sizes=(1,))))[f"move_{machine}_{event}"]
    assert f"resume_rooms({index}, C_{event}); fail_rooms({index}, C_{event})" in move


@pytest.mark.parametrize("kw", [dict(rooms=15), dict(cells=15), dict(receivers=7), dict(faults=200)])
def test_the_generator_takes_each_bound_at_its_largest_and_refuses_one_more(kw):
    small = dict(cells=1, rooms=1, receivers=1, faults=1, regions=False, sizes=(1,))
    assert generate(C(**{**small, **kw})).startswith("#define")
    (name, largest), = kw.items()
    with pytest.raises(ValueError):
        generate(C(**{**small, name: largest + 1}))


def test_identities_are_generated_only_where_the_shares_are_a_property_of_the_design():
    assert generate(C(2, 3, 1, 1, sizes=(1,), identities=2)).startswith("#define")
    for refused in (C(2, 3, 1, 1, identities=2), C(1, 3, 1, 1, sizes=(1,), identities=2)):  # liveness.checks_shares
        with pytest.raises(ValueError):
            generate(refused)


def test_each_step_resets_the_shares_scratch_so_no_stale_value_splits_a_state():
    step = re.compile(r"post\(\); ev = 0; x = 0; y = 0(.*)\n")
    assert step.search(generate(C(2, 3, 1, 1, sizes=(1,)))).group(1) == ""  # one identity: the model as it was
    assert step.search(generate(C(2, 3, 1, 1, sizes=(1,), identities=2))).group(1) == "; " + promela_shares.RESET


def test_each_move_the_model_refuses_names_its_machine_and_event():
    # parse_trail turns a MODELBUG line into a Disagreement that names the machine, state and event
    machines = {"room": ROOM, "extent": EXTENT, "peer": PEER}
    labels = [label.split() for label in re.findall(r'MODELBUG ([^\\"]*)', generate(C(2, 2, 2, 1, peers=True)))]
    assert all(w[0] in (*machines, "region", "seed", "channel") for w in labels), labels
    named = [w for w in labels if w[0] in machines]
    assert {w[0] for w in named} == set(machines) and any(len(w) == 3 for w in named)
    for w in named:
        assert w[-1] in {ev for _, ev in machines[w[0]].table} and (len(w) == 2 or w[1] in machines[w[0]].states), w


# -- the generated model's predicates, evaluated: the Promela macros against the spec's Python ----------------
def _defines(text: str) -> dict[str, tuple[list[str] | None, str]]:
    """`#define NAME body` and `#define NAME(a, b) body` lines of a generated model."""
    out: dict[str, tuple[list[str] | None, str]] = {}
    for line in text.splitlines():
        m = re.match(r"#define (\w+)(\(([^)]*)\))? (.*)$", line)
        if m:
            out[m.group(1)] = ([a.strip() for a in m.group(3).split(",")] if m.group(2) else None, m.group(4))
    return out


def _expand(expr: str, defs) -> str:
    """The C preprocessor's expansion of `expr`, enough for the model's macros (no recursion, no #)."""
    for _ in range(5000):
        m = next((m for m in re.finditer(r"\b([A-Za-z_]\w*)\b", expr) if m.group(1) in defs), None)
        if m is None:
            return expr
        params, body = defs[m.group(1)]
        if params is None:
            expr = expr[:m.start()] + f"({body})" + expr[m.end():]
            continue
        depth, k, args, start = 0, m.end(), [], m.end() + 1
        assert expr[k] == "("
        while True:
            c = expr[k]
            depth += c == "("
            depth -= c == ")"
            if (c == "," and depth == 1) or depth == 0:
                args.append(expr[start:k].strip())
                start = k + 1
            if depth == 0:
                break
            k += 1
        for p, a in zip(params, args, strict=True):
            body = re.sub(rf"\b{p}\b", f"({a})", body)
        expr = expr[:m.start()] + f"({body})" + expr[k + 1:]
    raise AssertionError(f"no end to expanding {expr[:200]}")


# keyed by the defines' id, so each entry keeps its defines alive: a freed dict's id is reused by the next
# test's, which then read the previous variant's macros (seen under mutmut's trampolines, where the heap differs)
_COMPILED: dict[tuple[int, str], tuple[dict, object]] = {}


def _promela_value(expr: str, defs, **arrays) -> int:
    """`expr` of the generated model, expanded and evaluated on `arrays` (lists of namespaces)."""
    key = (id(defs), expr)
    if key not in _COMPILED:
        py = _expand(expr, defs).replace("&&", " and ").replace("||", " or ")
        _COMPILED[key] = (defs, compile(re.sub(r"!(?!=)", " not ", py), expr, "eval"))
    return int(bool(eval(_COMPILED[key][1], {}, arrays)))  # our own generated text


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _rings(cfg):
    """Every arena of cfg.cells cells (state, tenant) with two rooms whose state and chunk vary."""
    states = ["free", "parked", "sending"]
    tenants = [-1, 0, 1]
    for cells in itertools.product(itertools.product(states, tenants), repeat=cfg.cells):
        for rs0, rs1 in (("registered", "success"), ("failed", "ready")):
            for ch in (CH_HELD, CH_SENT):
                yield [list(c) for c in cells], [(rs0, 1, ch), (rs1, 1, CH_SENT)]


@pytest.mark.parametrize("variant, sizes", [("project", (1, 2, 3)), ("no-parked-check", (1, 2, 3)),
                                           ("reuse-when-terminal", (1, 2, 3)), ("seed", (1, 2, 3)),
                                           ("project", (2, 3))])
def test_where_the_model_may_lease_an_extent_is_where_the_spec_may(variant, sizes):
    # sizes (2, 3): no extent may start at the last cell, whatever is free
    cfg = C(cells=3, rooms=2, variant=variant, sizes=sizes)
    spec = Spec(cfg)
    defs = _defines(generate(cfg))
    code = {name: n for name, n in ((s, int(defs[f"S_{s}"][1])) for s in EXTENT_STATES)}
    rs_code = {s: int(defs[f"R_{s}"][1]) for s in ROOM_STATES}
    for cells, rooms in _rings(cfg):
        spec_cells = [(ss, tenant, False, 1) for ss, tenant in cells]
        spec_rooms = [(rs, 1, ch, 1, 0, 0, 0, 0, (), 1, -1) for rs, _, ch in rooms]
        cell = [_Obj(ss=code[ss], content=NONE if t < 0 else t) for ss, t in cells]
        room = [_Obj(rs=rs_code[rs], ch=ch) for rs, _, ch in rooms]
        for z in cfg.sizes:
            ours = {place[0] for place in spec.ring.placements(spec_rooms, spec_cells, z)}  # runs: their first cells
            theirs = {o for o in range(cfg.cells) if _promela_value(f"FITS_{o}({z})", defs, cell=cell, room=room)}
            assert theirs == ours, (variant, cells, rooms, z)
            assert _promela_value(f"FITS({z})", defs, cell=cell, room=room) == bool(ours)


@pytest.mark.parametrize("cfg", [C(1, 1, 2, 1), C(1, 1, 1, 1, regions=False)], ids=str)
def test_the_model_holds_an_extent_for_a_room_exactly_when_the_spec_does(cfg):
    spec = Spec(cfg)
    defs = _defines(generate(cfg))
    for infl, ghost, writes in ((0, 0, (W_IDLE, W_IDLE)), (1, 0, (W_FLIGHT, W_IDLE)), (0, 1, (W_IDLE, 2)),
                                (0, 0, (W_IDLE, 3)), (1, 1, (W_IDLE, W_IDLE))):
        rcv = tuple(("offered", w, "") for w in writes[:cfg.receivers]) if cfg.regions else ()
        r = _room(infl=infl, ghost=ghost, rcv=rcv)
        room = [_Obj(infl=infl, ghost=ghost, rw=list(writes))]
        assert _promela_value("HOLDS(0)", defs, room=room) == spec._holds_extent(r), (infl, ghost, writes)


def _namespace(cfg, state, defs) -> dict:
    """SPIN's variables for a canonical spec state (models/promela.py's encoding, as _show_state prints it)."""
    f_rooms = [_Obj(rs=ROOM_STATES.index(r[0]), snd=r[1], ch=r[2], reg=r[3], told=r[4], ok=r[5], infl=r[6],
                    ghost=r[7], sz=r[9], sl=NONE if r[10] < 0 else r[10],
                    rg=[REGION_STATES.index(x[0]) + 1 for x in r[8]] + [0] * (cfg.receivers - len(r[8])),
                    rw=[x[1] for x in r[8]] + [0] * (cfg.receivers - len(r[8])),
                    rt=[TOLD_VALUES.index(x[2]) for x in r[8]] + [0] * (cfg.receivers - len(r[8])),
                    rc=[x[3] if len(x) > 3 else 0 for x in r[8]] + [0] * (cfg.receivers - len(r[8])),
                    rd=[x[4] if len(x) > 3 else 0 for x in r[8]] + [0] * (cfg.receivers - len(r[8])),
                    rr=[int(x[5]) if len(x) > 3 else 0 for x in r[8]] + [0] * (cfg.receivers - len(r[8])))
               for r in state[0]]
    cells = [_Obj(ss=EXTENT_STATES.index(s[0]) + 1, content=NONE if s[1] < 0 else s[1], unsure=int(s[2]),
                  span=s[3]) for s in state[1]]
    peers = [promela_peers.PEER_STATES.index(p) for p in state[5]] or [0] * cfg.receivers
    told = {int(defs[f"R_{s}"][1]): int(defs[f"T_{s.upper()}"][1]) for s in ("success", "failed")}
    return dict(room=f_rooms, cell=cells, peer=peers, hlt={v: k for k, v in HALTS.items()}[state[4]],
                dlen=len(state[2]), faults=state[3],
                TOLD_OF=lambda rs: told.get(rs, int(defs["T_NONE"][1])),
                REGRANK=lambda g: _REGION_RANK[REGION_STATES[g - 1]] if g else 0,
                PEERRANK=lambda p: _PEER_RANK[promela_peers.PEER_STATES[p]])


@pytest.mark.parametrize("cfg", [C(2, 2, 2, 1), C(1, 1, 2, 1, channels=True), C(2, 1, 1, 1, channels=True),
                                 C(1, 2, 2, 1, peers=True, sizes=(1,)), C(1, 2, 1, 1, regions=False),
                                 C(1, 2, 1, 1, late_landing=True), C(1, 2, 1, 1, variant="seed")], ids=str)
def test_the_models_final_states_liveness_judge_and_rank_are_the_specs(cfg):
    spec = Spec(cfg)
    defs = {k: v for k, v in _defines(generate(cfg)).items() if k not in ("TOLD_OF", "REGRANK", "PEERRANK")}
    for state in _some_states(cfg, 250):
        ns = _namespace(cfg, state, defs)
        assert _promela_value("FINAL", defs, **ns) == spec.is_final(state), state
        done = [_promela_value(d, defs, **ns) for d in ("ROOMS_DONE", "REGIONS_DONE", "SENDERS_DONE")]
        kinds = (*(k for k, ok in zip(liveness.KINDS, done) if not ok), None)
        assert kinds[0] == (liveness.judge(state) or (None,))[0], state
        rank = eval(compile(_expand("RANK", defs).replace("&&", " and ").replace("||", " or "), "RANK", "eval"),
                    {}, ns)
        assert rank == spec.rank(state), state


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - PEER_VARIANTS))
def test_the_models_variant_switches_are_on_exactly_where_the_specs_rules_take_that_variant(variant):
    cfg = C(1, 1, 1, 1, variant=variant)
    spec, defs = Spec(cfg), _defines(generate(cfg))
    switches = {"SEED": type(spec).__name__ == "SeedSpec", "NO_PARKED_CHECK": spec.ring.no_parked_check,
                "BUSY_WAIT": spec.busy_wait, "REAP_CRASH": spec.ring.reap_crash,
                "NO_WRITE_DEADLINE": spec.peer_events.no_write_deadline}
    assert {name: _promela_value(name, defs) for name in switches} == switches


@pytest.mark.parametrize("variant", ["project", "seed"])
def test_the_model_arms_a_deadline_in_exactly_the_states_the_spec_does(variant):
    cfg = C(1, 1, 1, 1, variant=variant)
    spec, defs = Spec(cfg), _defines(generate(cfg))
    for machine, states, prefix in (("room", ROOM_STATES, "R"), ("extent", EXTENT_STATES, "S")):
        armed = {s for s in states if _promela_value(f"ARMED_{machine.upper()}({prefix}_{s})", defs)}
        assert armed == set(spec._armed[machine]), machine
    assert spec._armed["room"] != Spec(C(1, 1, 1, 1, variant="project" if variant == "seed" else "seed"))._armed["room"]


@pytest.mark.parametrize("cfg", [C(1, 2, 2, 1, peers=True, sizes=(1,)), C(1, 2, 1, 1, variant="no-write-deadline"),
                                 C(1, 2, 2, 1, channels=True), C(2, 2, 1, 1)], ids=str)
def test_the_models_liveness_arm_assumes_fair_exactly_the_events_the_spec_does(cfg):
    text = generate(cfg)
    fair_events = liveness.fair_events(cfg.variant)
    enabled, fair = [], []
    for line in text[text.index("active proctype"):].splitlines():
        if not re.match(r"    :: .*\bev = \d+;", line):
            continue
        if line.startswith("    :: if :: "):
            picks = line[len("    :: if :: "):line.index(" fi; ev = ")].split(" :: ")
            guards = [g.rsplit(" -> x = ", 1)[0] for g in picks]
        else:
            guards = ["(" + line[len("    :: "):line.index(" -> ev = ")] + ")"]
        event = promela.EVENTS[int(re.search(r"ev = (\d+);", line).group(1))]
        enabled += guards
        fair += guards if event in fair_events else []
    assert fair and len(fair) < len(enabled)
    assert "  :: atomic { !(" + " || ".join(enabled) + ") -> d_step" in text
    assert "  :: atomic { LIVE && !(" + " || ".join(fair) + ") && (" + " || ".join(enabled) + ")" in text


@pytest.mark.parametrize("cfg", [C(2, 2, 2, 1), C(1, 2, 1, 1, late_landing=True), C(1, 1, 2, 1, channels=True),
                                 C(1, 2, 1, 1, regions=False), C(1, 2, 2, 1, late_landing=True)], ids=str)
def test_each_room_arms_guard_holds_exactly_where_the_spec_offers_its_event(cfg):
    """The guards SPIN's room events are taken under, evaluated on spec states: for each room the events whose
    guard holds are the events the spec offers it, and for an event about one receiver, the kinds of receiver
    it may be about are the spec's (which takes one receiver of each kind)."""
    spec = Spec(cfg)
    defs = {k: v for k, v in _defines(generate(cfg)).items() if k not in ("TOLD_OF", "REGRANK", "PEERRANK")}
    names = {name for name, *_ in promela_events.room_arms("0", "0", cfg)}
    receivers = range(cfg.receivers) if cfg.regions else [0]
    for state in _some_states(cfg, 150):
        ns = {**_namespace(cfg, state, defs), "stop": 0}
        steps = [s.event for s in spec.successors(state) if len(s.event) > 1 and s.event[0] in names]
        for i, r in enumerate(state[0]):
            held = {(name, j) for j in receivers for name, guard, _, _ in promela_events.room_arms(str(i), str(j), cfg)
                    if _promela_value(guard, defs, **ns)}
            assert {name for name, _ in held} == {e[0] for e in steps if e[1] == i}, (state, i)
            if cfg.regions:
                per = {name for name, *_, about_one in promela_events.room_arms("0", "0", cfg) if about_one}
                assert ({(name, r[8][j]) for name, j in held if name in per}
                        == {(e[0], r[8][e[2]]) for e in steps if e[1] == i and e[0] in per}), (state, i)


@pytest.mark.parametrize("cfg", [C(2, 2, 2, 1), C(1, 2, 1, 1, regions=False)], ids=str)
def test_each_room_events_arm_picks_each_room_and_receiver_once_and_chooses_a_place_outside_its_d_step(cfg):
    text = generate(cfg)
    arms = [line for line in text[text.index("active proctype"):].splitlines() if line.startswith("    :: if :: ")]
    for n, (name, _, act, about_one) in enumerate(promela_events.room_arms("x", "y", cfg)):
        line = arms[n]
        assert f"; ev = {promela.EVENTS.index(name)}; " in line, (name, line)
        picks = re.findall(r" -> (x = \d+(?:; y = \d+)?)(?= ::| fi)", line)
        one = about_one and cfg.regions
        assert picks == [f"x = {i}" + (f"; y = {j}" if one else "") for i in range(cfg.rooms)
                         for j in (range(cfg.receivers) if one else [None])], (name, picks)
        chooses = "ev_tower(" in act  # the tower's item picks its place inside: no d_step around that choice
        assert line.endswith(f"d_step {{ pre() }}; {act}" if chooses else f"d_step {{ pre(); {act} }}"), line


def test_the_seeds_extent_moves_in_the_model_are_the_seed_specs():
    """The seed's extents have no machine: each move sets the state SeedSpec names (and a lease clears unsure);
    a move the seed does not make is a model bug in both engines."""
    cfg = C(1, 1, 1, 1, variant="seed")
    spec, text = Spec(cfg), generate(cfg)
    defs = _defines(text)
    for event in sorted({ev for _, ev in EXTENT.table}):
        body = _inlines(text)[f"move_extent_{event}"]
        seed = body[body.index("if :: SEED -> ") + len("if :: SEED -> "):body.index(" :: else -> extent_")]
        extent = ["sending", 0, True, 1]
        if event not in type(spec).EXTENT_MOVES:
            assert "MODELBUG" in seed
            with pytest.raises(KeyError):
                spec._extent_step(extent, event)
            continue
        cell = [_Obj(ss=int(defs["S_sending"][1]), unsure=1)]
        for assignment in seed.split("; "):
            target, value = assignment.split(" = ")
            setattr(cell[0], target.removeprefix("cell[sx]."), int(_expand(value, defs).strip("()")))
        spec._extent_step(extent, event)
        assert (EXTENT_STATES[cell[0].ss - 1], bool(cell[0].unsure)) == (extent[0], extent[2]), event


def test_all_up_holds_exactly_when_every_peer_is_up():
    cfg = C(1, 1, 2, 1, peers=True, sizes=(1,))
    defs = _defines(generate(cfg))
    states = promela_peers.PEER_STATES
    for peers in itertools.product(range(len(states)), repeat=cfg.receivers):
        assert _promela_value("ALL_UP", defs, peer=list(peers)) == all(states[p] == "up" for p in peers)


def test_staging_may_start_an_extent_at_every_cell_where_it_fits_and_nowhere_else():
    cfg = C(3, 1, 1, 1)
    stage = _inlines(generate(cfg))["stage"]
    choice = stage[stage.index(":: else ->\n     if\n") + len(":: else ->\n     if\n"):stage.index("\n     fi;")]
    picks = [re.fullmatch(r"\s*:: FITS_(\d+)\(room\[gx\]\.sz\) -> ls = (\d+)", line) for line in choice.split("\n")]
    assert all(picks) and [(int(m.group(1)), int(m.group(2))) for m in picks] == [(s, s) for s in range(cfg.cells)]


def test_without_regions_a_write_late_landing_or_withdraw_is_about_receiver_zero():
    plain = promela_events.room_arms("x", "y", C(2, 2, 2, 1, regions=False))
    with_regions = {(name, act) for name, _, act, _ in promela_events.room_arms("x", "0", C(2, 2, 2, 1))}
    about_one = [(name, act) for name, _, act, per in plain if per]
    assert about_one and set(about_one) <= with_regions


def _key_fields(text: str) -> list[list[tuple[int, str]]]:
    """Each KEYcOF int of the canonical key: its fields, most significant first, as (bits, expression)."""
    out = []
    for line in text.splitlines():
        if re.match(r"#define KEY\d+OF\(", line):
            out.append([(int(b), e) for b, e in re.findall(r"\) << (\d+)\) \| \((.+?)\)(?=\) << |\)$)", line)])
    return out


@pytest.mark.parametrize("k", [2, 3, 4])
def test_the_keys_owner_field_is_as_wide_as_the_identities_need_and_no_wider(k):
    cfg = C(k, k, 1, 1, sizes=(1,), identities=k, regions=False)
    (bits,) = [b for chunk in _key_fields(generate(cfg)) for b, e in chunk if e == "OWN(KI)"]
    assert 2 ** (bits - 1) <= k - 1 < 2 ** bits


@pytest.mark.parametrize("cfg", [C(2, 2, 2, 1), C(1, 1, 2, 1), C(1, 1, 2, 1, channels=True)], ids=str)
def test_each_field_of_the_models_canonical_key_holds_every_value_it_takes_and_each_key_int_fits(cfg):
    text = generate(cfg)
    defs = {k: v for k, v in _defines(text).items() if k not in ("TOLD_OF", "REGRANK", "PEERRANK")}
    chunks = _key_fields(text)
    assert chunks and all(0 < sum(b for b, _ in chunk) <= 31 for chunk in chunks)  # a signed int, compared as one
    params = {"KPOS": cfg.cells, "KSAME": 1, "KDPOS": cfg.rooms}  # the largest value each argument takes
    spaces = [_namespace(cfg, state, defs) for state in _some_states(cfg, 300)]
    for b, expr in (field for chunk in chunks for field in chunk):
        if expr in params:
            assert params[expr] < 2 ** b, expr
            continue
        code = [compile(_expand(expr.replace("KI", str(i)), defs), expr, "eval") for i in range(cfg.rooms)]
        for ns in spaces:
            for c in code:
                value = eval(c, {}, ns)
                assert 0 <= value < 2 ** b, (expr, value, b)
