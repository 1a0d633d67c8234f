"""The model's commands and pictures (`check`, `walk`, `fixtures`, the state graphs, the liveness verdict):
what the mutation pass over them found untested (issue 32). Each test asserts what a command does (the
flags it reads, what it refuses, its exit code, the report it fills, the files it writes, the graph it
draws), never its wording. All run at the smallest bounds: the mutation pass runs them for every mutant."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from epd_ring.models import check
from epd_ring.models.check import CheckInputError
from epd_ring.models.spec import Config

HAZARDS = Path(__file__).parent / "fixtures" / "hazards"
TRACE = HAZARDS / "seed--H16.json"
SMALL = ["--cells", "1", "--rooms", "2", "--receivers", "1", "--faults", "1"]
TINY = ["--cells", "1", "--rooms", "1", "--receivers", "1", "--faults", "0"]


def named(flag: str, refused: pytest.ExceptionInfo) -> bool:
    """Whether a refusal names `flag` (the flag itself, not a word that contains it)."""
    return flag.split("=")[0] in str(refused.value).replace(",", " ").split()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    return parser.parse_args(argv)


def run_check(args, **kw) -> tuple[int, dict, list]:
    lines: list = []
    report: dict = {}
    return check.run(args, out=lines.append, report=report, **kw), report, lines


def clean_trace(tmp_path: Path) -> Path:
    """A saved trace cut before its violation: it replays clean."""
    data = json.loads(TRACE.read_text())
    data["events"] = data["events"][:2]
    path = tmp_path / "clean.json"
    path.write_text(json.dumps(data))
    return path


# -- check: its flags ----------------------------------------------------------------------------

def test_every_flag_of_check_is_read_under_its_own_name_and_type():
    args = parse(["--cells", "2", "--sizes", "1", "--slots", "3", "--rooms", "4", "--receivers", "1", "--faults", "0",
                  "--variant", "seed", "--peers", "--channels", "--late-landing", "--restarts", "1",
                  "--identities", "2", "--no-symmetry", "--compare-symmetry", "--save-traces", "D", "--replay", "F",
                  "--engine", "spin", "--spin-opt=-O2", "--spin-collapse", "--spin-hash", "1", "--spin-memlim", "1",
                  "--spin-keep", "K", "--spin-no-regions"])
    assert (args.cells, args.sizes, args.slots, args.rooms, args.receivers, args.faults) == (2, (1,), 3, 4, 1, 0)
    assert (args.variant, args.restarts, args.identities, args.engine) == ("seed", 1, 2, "spin")
    assert args.peers is args.channels is args.late_landing is args.no_symmetry is args.compare_symmetry is True
    assert (args.save_traces, args.replay, args.spin_opt, args.spin_hash, args.spin_memlim, args.spin_keep) == (
        "D", "F", "-O2", 1, 1, "K")
    assert args.spin_collapse is args.spin_no_regions is True


def test_check_flags_left_out_are_unset_so_replay_can_tell_them_from_given_ones():
    args = parse([])
    assert [k for k in (*check.DEFAULTS, "slots", "spin_hash", "spin_memlim", "spin_keep", "spin_opt", "save_traces",
                        "replay") if getattr(args, k) is not None] == []
    assert not (args.peers or args.channels or args.late_landing or args.spin_collapse or args.spin_no_regions)
    assert (args.restarts, args.identities, args.engine) == (0, 1, "explorer")
    assert parse(["--engine", "explorer"]).engine == "explorer"
    # each count's floor is a value it takes: no restart, one identity
    assert (parse(["--restarts", "0"]).restarts, parse(["--identities", "1"]).identities) == (0, 1)


@pytest.mark.parametrize("argv", [["--variant", "no-such-variant"], ["--spin-hash", "0"], ["--spin-memlim", "0"],
                                  ["--cells", "0"], ["--faults", "-1"], ["--peers", "x"], ["--engine", "other"],
                                  ["--restarts", "-1"], ["--identities", "0"]],
                         ids=str)
def test_check_refuses_a_bad_value_in_its_parser(argv):
    with pytest.raises(SystemExit):
        parse(argv)


# -- check: filling defaults and refusing what the engine would ignore ------------------------------

def test_defaults_fill_a_namespace_that_has_none_of_the_flags():
    args = argparse.Namespace()
    check.apply_defaults(args)
    assert {k: getattr(args, k) for k in check.DEFAULTS} == check.DEFAULTS


def test_spin_gets_its_memory_limit_by_default_and_keeps_a_given_one():
    args = argparse.Namespace(engine="spin")
    check.apply_defaults(args)
    assert args.spin_memlim == 8192 and {k: getattr(args, k) for k in check.DEFAULTS} == check.DEFAULTS
    args = parse(["--engine", "spin", "--spin-memlim", "100"])
    check.apply_defaults(args)
    assert args.spin_memlim == 100


def test_a_replay_namespace_gets_no_size_defaults():
    args = argparse.Namespace(replay="x.json")
    check.apply_defaults(args)
    assert [k for k in check.DEFAULTS if hasattr(args, k)] == []


@pytest.mark.parametrize("flag", [["--replay", "x.json"], ["--no-symmetry"], ["--compare-symmetry"],
                                  ["--restarts", "1"]], ids=str)
def test_spin_refuses_each_explorer_flag_and_names_it(flag):
    with pytest.raises(CheckInputError) as refused:
        check.apply_defaults(parse(["--engine", "spin", *flag]))
    assert named(flag[0], refused)


@pytest.mark.parametrize("flag", [["--spin-opt=-O2"], ["--spin-collapse"], ["--spin-hash", "2"],
                                  ["--spin-memlim", "10"], ["--spin-keep", "K"], ["--spin-no-regions"]], ids=str)
def test_the_explorer_refuses_each_spin_flag_and_names_it(flag):
    with pytest.raises(CheckInputError) as refused:
        check.apply_defaults(parse(flag))
    assert named(flag[0], refused)


def test_the_gone_slots_flag_is_refused():
    with pytest.raises(CheckInputError):
        check.apply_defaults(parse(["--slots", "2"]))


# -- check --replay -------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", [["--cells", "1"], ["--rooms", "1"], ["--receivers", "1"], ["--faults", "0"],
                                  ["--variant", "seed"], ["--sizes", "1"], ["--no-symmetry"], ["--compare-symmetry"],
                                  ["--save-traces", "D"], ["--channels"], ["--late-landing"], ["--restarts", "1"],
                                  ["--identities", "2"], ["--pieces", "2"]], ids=str)
def test_replay_refuses_each_flag_the_trace_fixes_and_names_it(flag):
    with pytest.raises(CheckInputError) as refused:
        run_check(parse(["--replay", str(TRACE), *flag]))
    assert named(flag[0], refused)


def test_replay_reports_the_trace_its_config_its_steps_and_the_violations_kind_and_detail():
    rc, report, _lines = run_check(parse(["--replay", str(TRACE)]))
    data = json.loads(TRACE.read_text())
    assert rc == 1
    assert (report["replay"], report["config"], report["steps"]) == (str(TRACE), data["config"], len(data["events"]))
    assert set(report["violation"]) == {"kind", "detail"} and report["violation"]["kind"] == data["violation"]


def test_a_clean_replay_exits_0_and_reports_no_violation(tmp_path):
    path = clean_trace(tmp_path)
    rc, report, _lines = run_check(parse(["--replay", str(path)]))
    assert rc == 0 and report["violation"] is None and report["steps"] == 2


def test_replay_runs_on_a_namespace_without_the_later_flags(tmp_path):
    args = argparse.Namespace(replay=str(clean_trace(tmp_path)), no_symmetry=False, compare_symmetry=False,
                              save_traces=None)
    assert run_check(args)[0] == 0


@pytest.mark.parametrize("content", ["[1, 2]", '{"config": "x", "events": []}', '{"events": []}',
                                     '{"config": {"cells": 1}, "events": "x"}', '{"config": {"cells": 1}}'], ids=str)
def test_a_file_that_is_no_saved_trace_is_refused_on_loading(tmp_path, content):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(CheckInputError):
        check._load_trace(str(path))


# -- check: exploring ----------------------------------------------------------------------------

def test_check_without_a_report_still_runs_and_one_run_is_with_symmetry_unless_told():
    lines: list = []
    assert check.run(parse(TINY), out=lines.append) == 0
    _, report, _ = run_check(parse(TINY))
    assert [r["symmetry"] for r in report["runs"]] == [True]
    _, report, _ = run_check(parse([*TINY, "--no-symmetry"]))
    assert [r["symmetry"] for r in report["runs"]] == [False]


def test_check_runs_on_a_namespace_with_only_the_first_flags():
    args = argparse.Namespace(replay=None, no_symmetry=False, compare_symmetry=False, save_traces=None,
                              cells=1, rooms=1, receivers=1, faults=0, variant=None, sizes=None)
    rc, report, _ = run_check(args)
    assert rc == 0
    assert (report["config"]["peers"], report["config"]["channels"], report["config"]["late_landing"]) == (
        False, False, False)
    assert report["config"]["variant"] == "project" and report["config"]["sizes"] == (1, 2)
    assert not {"restarts", "identities", "pieces"} & set(report["config"])  # none, one, one: left out


def test_a_configuration_the_model_cannot_take_is_refused_with_the_models_own_reason():
    with pytest.raises(ValueError) as model:
        Config(1, 1, 1, 0, identities=2)  # an identity without a room
    with pytest.raises(CheckInputError) as refused:
        run_check(parse([*TINY, "--identities", "2"]))
    assert str(refused.value) == str(model.value)


@pytest.mark.parametrize("flag, key, value", [(["--peers"], "peers", True), (["--channels"], "channels", True),
                                              (["--late-landing"], "late_landing", True),
                                              (["--sizes", "1"], "sizes", (1,)), (["--restarts", "1"], "restarts", 1),
                                              (["--identities", "2"], "identities", 2),
                                              (["--pieces", "2"], "pieces", 2)], ids=str)
def test_check_explores_the_configuration_its_flags_give(monkeypatch, flag, key, value):
    seen = []
    real = check.explore
    monkeypatch.setattr(check, "explore", lambda cfg, **kw: seen.append(cfg) or real(cfg, **kw))
    _, report, _ = run_check(parse([*(SMALL if key == "identities" else TINY), *flag]))  # a room per identity
    assert getattr(seen[0], key) == value and report["config"][key] == value


def test_check_with_the_spin_engine_is_not_run_in_process():
    with pytest.raises(SystemExit):
        run_check(parse([*TINY, "--engine", "spin"]))


def test_each_run_reports_its_figures_and_the_fairness_its_variant_assumes():
    from epd_ring.models import liveness

    _, report, _ = run_check(parse([*SMALL, "--variant", "no-write-deadline"]))
    run = report["runs"][0]
    assert {"symmetry", "states", "transitions", "depth", "finals", "seconds", "represented", "violations",
            "fairness", "fair_ends"} <= set(run)
    assert run["fairness"] == list(liveness.assumptions("no-write-deadline")) != list(liveness.assumptions("project"))
    assert report["violation"] is True


def test_check_hands_its_progress_display_the_explorers_figures(monkeypatch):
    bars = []

    class Bar:
        def __init__(self, label):
            self.label, self.updates, self.closed = label, [], False
            bars.append(self)

        def update(self, states, **fields):
            self.updates.append((states, fields))

        def close(self):
            self.closed = True

    real = check.explore

    def explore(cfg, progress=None, **kw):
        progress(100, 4.0, 3)  # as the explorer does each second
        return real(cfg, **kw)

    monkeypatch.setattr(check, "explore", explore)
    run_check(parse([*TINY, "--compare-symmetry"]), progress=Bar)
    assert len(bars) == 2 and all(isinstance(b.label, str) and b.label and b.closed for b in bars)
    assert bars[0].updates == [(100, {"states_per_s": "25", "depth": 3})]


def test_saved_traces_go_into_a_folder_made_with_its_parents(tmp_path):
    folder = tmp_path / "a" / "b"
    rc, _report, _ = run_check(parse([*SMALL, "--variant", "no-parked-check", "--save-traces", str(folder)]))
    assert rc == 1 and sorted(p.stem.split("--")[0] for p in folder.iterdir()) == ["no-parked-check"]


# -- walk ------------------------------------------------------------------------------------------

@pytest.fixture
def quiet_log():
    import logging

    log = logging.getLogger("epd_ring")
    level = log.level
    log.setLevel(logging.CRITICAL)  # the harness injects tower errors: events here, not news
    yield
    log.setLevel(level)


@pytest.mark.parametrize("cfg, figures", [
    (Config(2, 1, 1, 0, sizes=(1,)), (16, 20, 16, 18, 20, {"clock": 2, "not by clock": 0})),
    # three cells: with one-cell items any cell is as good as another, not only the mirror image
    (Config(3, 1, 1, 0, sizes=(1,)), (16, 20, 16, 18, 20, {"clock": 2, "not by clock": 0})),
    (Config(2, 1, 1, 0), (20, 28, 20, 22, 28, {"clock": 3, "not by clock": 0})),
    (Config(1, 1, 1, 1, sizes=(1,)), (37, 66, 37, 56, 66, {"clock": 6, "not by clock": 0}))], ids=str)
def test_the_walk_covers_its_pinned_quotient_of_the_spec(quiet_log, cfg, figures):
    from epd_ring.models.walk import walk

    w = walk(cfg)
    assert (w.spec_states, w.spec_edges, w.states, w.nodes, w.edges, w.deadlines) == figures
    assert w.failures == [] and 0 <= w.seconds < 3600


def test_the_walk_stops_adding_nodes_at_its_bound(quiet_log):
    from epd_ring.models.walk import walk

    assert walk(Config(2, 1, 1, 0, sizes=(1,)), max_states=5).nodes == 5


def _failing_step(monkeypatch, exc_type, first_only=False):
    """Make the harness raise `exc_type` on the first event of the initial state (every time, or once)."""
    from epd_ring.models import conformance

    real = conformance.Harness.step
    raised = []

    def step(self, ev):
        if ev == ("register", 0) and not (first_only and raised):
            raised.append(ev)
            raise exc_type("the implementation left the spec here")
        return real(self, ev)

    monkeypatch.setattr(conformance.Harness, "step", step)
    return raised


def test_a_nonconforming_edge_is_recorded_with_its_path_and_the_rest_is_still_walked(monkeypatch, quiet_log):
    from epd_ring.models.walk import walk

    _failing_step(monkeypatch, AssertionError)
    w = walk(Config(1, 1, 1, 1))
    assert w.failures and all(path[-1] == ("register", 0) and msg == "the implementation left the spec here"
                              for path, msg in w.failures)
    assert next(path for path, _ in w.failures) == [("register", 0)]
    assert w.states > 1 and w.edges > 0  # the initial state's other events were still walked


def test_an_edge_whose_deadline_is_not_the_clocks_next_is_counted_and_the_rest_is_still_walked(monkeypatch, quiet_log):
    from epd_ring.models.conformance_clock import NotByClock
    from epd_ring.models.walk import walk

    raised = _failing_step(monkeypatch, NotByClock)
    w = walk(Config(1, 1, 1, 1))
    assert w.deadlines["not by clock"] == len(raised) >= 1 and w.failures == []
    assert w.states > 1 and w.edges > 0


class _Clock:
    """A stand-in for the walk's `time`: each reading is `step` seconds after the last."""

    def __init__(self, step: float):
        self.now, self.step = 1e6, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def test_the_walk_reports_its_progress_every_5_seconds_of_its_clock(monkeypatch, quiet_log):
    from epd_ring.models import walk as walk_module

    cfg = Config(2, 1, 1, 0, sizes=(1,))
    seen: list = []
    monkeypatch.setattr(walk_module, "time", _Clock(5.0))  # 5 s between two readings: a report each node
    w = walk_module.walk(cfg, progress=lambda x: seen.append((x, x.states, x.nodes, x.seconds)))
    assert len(seen) == w.nodes and all(x is w and 0 < seconds < 1e5 and states >= 1 and nodes >= 1
                                        for x, states, nodes, seconds in seen)
    assert w.seconds < 1e5
    seen.clear()
    monkeypatch.setattr(walk_module, "time", _Clock(0.0))  # a clock that stands still: no report
    walk_module.walk(cfg, progress=seen.append)
    assert seen == []
    monkeypatch.setattr(walk_module, "time", _Clock(5.0))
    assert walk_module.walk(cfg).failures == []  # no progress callable: none called


def test_a_replay_without_a_plan_follows_its_path(quiet_log):
    from epd_ring.models.walk import replay

    cfg = Config(1, 1, 1, 1)
    h = replay(cfg, [("register", 0)], (1,))
    assert h.step(("frame", 0)) is not None


def test_the_spec_graph_refuses_a_spec_that_breaks_its_own_checks():
    from epd_ring.models.spec import Spec
    from epd_ring.models.walk import spec_graph

    for variant in ("no-parked-check", "seed"):
        with pytest.raises(ValueError):
            spec_graph(Spec(Config(1, 2, 1, 1, variant=variant)))


def _reachable(cfg: Config, limit: int = 400) -> list[tuple]:
    from epd_ring.models.spec import Spec

    spec = Spec(cfg)
    seen, order = {spec.initial()}, [spec.initial()]
    for state in order:
        for st in spec.successors(state):
            if st.state not in seen and len(order) < limit:
                seen.add(st.state)
                order.append(st.state)
    return order


def test_relabelling_cells_keeps_rooms_without_an_extent_and_is_the_same_for_moved_cells():
    from epd_ring.models.spec import EXTENTI
    from epd_ring.models.walk import canonical_cells

    # with identities a room has a field after its extent's (its owner): relabelling keeps it
    for state in _reachable(Config(2, 2, 1, 0, sizes=(1,))) + _reachable(Config(2, 2, 1, 0, sizes=(1,), identities=2)):
        c = canonical_cells(state)
        assert sorted(r[EXTENTI] < 0 for r in c[0]) == sorted(r[EXTENTI] < 0 for r in state[0])
        assert sorted((*r[:EXTENTI], *r[EXTENTI + 1:]) for r in c[0]) == sorted(
            (*r[:EXTENTI], *r[EXTENTI + 1:]) for r in state[0])  # only the extents' labels change
        swapped = (tuple(r if r[EXTENTI] < 0 else (*r[:EXTENTI], 1 - r[EXTENTI], *r[EXTENTI + 1:]) for r in state[0]),
                   (state[1][1], state[1][0]), *state[2:])
        assert canonical_cells(swapped) == c


def test_reading_the_arena_from_its_other_end_twice_gives_the_state_back():
    from epd_ring.models.spec import EXTENTI, LEN
    from epd_ring.models.walk import canonical_mirror, reflect

    states = _reachable(Config(3, 2, 1, 0), 3000) + _reachable(Config(2, 2, 1, 0, identities=2), 300)
    assert any(max(cell[LEN] for cell in s[1]) == 2 for s in states)  # some extent of two cells is in there
    for state in states:
        assert reflect(reflect(state)) == state
        assert canonical_mirror(reflect(state)) == canonical_mirror(state)
        assert [r[EXTENTI] < 0 for r in reflect(state)[0]] == [r[EXTENTI] < 0 for r in state[0]]


def test_the_walk_command_exits_0_at_full_coverage_and_1_on_a_nonconforming_edge(monkeypatch, capsys, quiet_log):
    import logging

    from epd_ring.models import walk as walk_command

    logging.getLogger("epd_ring").setLevel(logging.NOTSET)
    assert walk_command.main(["2", "1", "1", "0", "--sizes", "1", "--min-coverage", "1.0"]) == 0
    assert logging.getLogger("epd_ring").level == logging.CRITICAL  # the injected tower errors are not logged
    _failing_step(monkeypatch, AssertionError)
    assert walk_command.main(["2", "1", "1", "0", "--sizes", "1"]) == 1


# -- fixtures ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--write"], ["--write", "a", "b"], ["a", "b"], ["--other", "a"]], ids=str)
def test_the_fixtures_command_wants_exactly_write_and_a_folder(argv):
    from epd_ring.models import fixtures

    assert fixtures.main(argv) == 2


def test_the_fixtures_command_makes_its_folder_with_its_parents(tmp_path, monkeypatch):
    from epd_ring.models import fixtures

    monkeypatch.setattr(fixtures, "hazard_traces", lambda: {"x.json": "{}"})
    assert fixtures.main(["--write", str(tmp_path / "a" / "b")]) == 0
    assert (tmp_path / "a" / "b" / "x.json").read_text() == "{}"


# -- the pictures ------------------------------------------------------------------------------------

def _dot(text: str) -> tuple[dict[int, dict], list[tuple[int, int, str, dict]]]:
    """Nodes (id -> attributes) and edges of a graph written by graphs.py; anything else is refused."""
    import re

    attr = r'(\w+)="((?:[^"\\]|\\.)*)"'
    assert text.endswith("}\n") and text.count("\n}\n") == 1
    nodes, edges = {}, []
    for line in text.splitlines():
        if m := re.fullmatch(r"  [nvt](\d+) \[(.*)\];", line):
            assert int(m.group(1)) not in nodes
            nodes[int(m.group(1))] = dict(re.findall(attr, m.group(2)))
            assert re.fullmatch(rf"{attr}( {attr})*", m.group(2)), line
        elif m := re.fullmatch(r'  [nvt](\d+) -> [nvt](\d+) \[label="([^"]*)"(.*)\];', line):
            extra = dict(re.findall(attr, m.group(4)))
            assert m.group(4) in ("", ' color="#b71c1c" fontcolor="#b71c1c"'), line
            edges.append((int(m.group(1)), int(m.group(2)), m.group(3), extra))
    return nodes, edges


@pytest.mark.parametrize("cfg", [Config(1, 1, 1, 1), Config(1, 2, 1, 1, sizes=(1,)),
                                 Config(1, 2, 1, 1, variant="busy-wait", sizes=(1,))], ids=str)
def test_the_state_graph_starts_at_node_0_marks_only_it_and_every_quiescent_end(quiet_log, cfg):
    from epd_ring.models.explore import canonical
    from epd_ring.models.graphs import state_graph_dot
    from epd_ring.models.spec import Spec

    spec = Spec(cfg)
    nodes, edges = _dot(state_graph_dot(cfg))
    assert sorted(nodes) == list(range(len(nodes))) and all(a.get("label") for a in nodes.values())
    from epd_ring.models.graphs import short

    described = {short(spec, canonical(s)) for s in _reachable(cfg, 100_000)}
    assert all(a["label"] in described for n, a in nodes.items() if a.get("fillcolor") != "#f4b6b6")
    assert [n for n, a in nodes.items() if "penwidth" in a] == [0] and nodes[0]["penwidth"] == "2"
    first = {(canonical(st.state), st.event[0]) for st in spec.successors(spec.initial())}
    assert len({(b, ev) for a, b, ev, _ in edges if a == 0}) == len(first)
    ends = [s for s in _reachable(cfg, 100_000) if not spec.successors(s) and spec.is_final(s)]
    from epd_ring.fsm.diagrams import KIND_STYLE

    green = [n for n, a in nodes.items() if a.get("fillcolor") == KIND_STYLE["free"]["fillcolor"]]
    assert len(green) == len({canonical(s) for s in ends}) >= 1
    if cfg.variant == "project":
        assert [e for e in edges if e[3]] == []  # a clean variant draws no red edge


def test_the_state_graph_draws_each_broken_check_in_red_where_it_breaks(quiet_log):
    from epd_ring.models.explore import explore
    from epd_ring.models.graphs import state_graph_dot

    cfg = Config(1, 2, 1, 1, variant="seed")
    text = state_graph_dot(cfg)
    nodes, edges = _dot(text)
    import re

    assert sorted(set(re.findall(r'\\n([a-z-]+)"', text))) == sorted(
        k for k in explore(cfg).violations if k not in ("deadlock", "room-never-concludes"))
    red = [e for e in edges if e[3]]
    assert red and all("fillcolor" in nodes[b] and nodes[b]["fillcolor"] == "#f4b6b6" for _, b, _, _ in red)


def test_a_room_sees_its_extents_state_and_whether_another_room_overlaps_it():
    from epd_ring.models.graphs import room_view
    from epd_ring.models.spec import EXTENTI, SS

    for state in _reachable(Config(2, 2, 1, 0, sizes=(1,)), 2000):
        for i, r in enumerate(state[0]):
            s = r[EXTENTI]
            # where the design holds, a room's extent is never overlapped
            assert room_view(state, i)[7] == ((state[1][s][SS], True) if s >= 0 else ("", True))
    overlapped = [room_view(st, i)[7] for st in _reachable(Config(2, 2, 1, 1, variant="seed", sizes=(1,)), 3000)
                  for i in range(2)]
    assert any(mine is False for _, mine in overlapped)  # the seed's hazard: an extent reused under a chunk


def test_the_room_view_marks_the_quiescent_views_and_draws_a_halted_loop():
    from epd_ring.models.graphs import room_view_dot

    for variant in ("project", "busy-wait"):
        nodes, edges = _dot(room_view_dot(Config(variant=variant, cells=1, rooms=2, receivers=1, faults=1, sizes=(1,))))
        assert sorted(nodes) == list(range(len(nodes))) and [n for n, a in nodes.items() if "penwidth" in a] == [0]
        assert not any(ev.endswith("(other room)") and ev.split()[0] in ("release", "serve", "reap")
                       for _, _, label, _ in edges for ev in label.split(" | "))


@pytest.mark.parametrize("variant", ["project", "busy-wait"])
def test_the_room_view_marks_as_quiescent_exactly_the_views_of_quiescent_states(variant):
    from epd_ring.fsm.diagrams import KIND_STYLE
    from epd_ring.models.graphs import room_view, room_view_dot
    from epd_ring.models.spec import Spec

    cfg = Config(cells=1, rooms=2, receivers=1, faults=1, sizes=(1,), variant=variant)
    spec = Spec(cfg)
    nodes, _ = _dot(room_view_dot(cfg))
    quiescent = {room_view(s) for s in _reachable(cfg, 100_000) if not spec.successors(s) and spec.is_final(s)}
    green = [n for n, a in nodes.items() if a.get("fillcolor") == KIND_STYLE["free"]["fillcolor"]]
    assert len(green) == len(quiescent) >= 1


def test_a_hazard_trace_without_a_hazard_name_is_drawn():
    from epd_ring.models.graphs import trace_dot

    data = json.loads(TRACE.read_text())
    data.pop("hazard", None)
    nodes, edges = _dot(trace_dot("t", data))
    assert len(nodes) == len(data["events"]) + 1 and len(edges) == len(data["events"])


def test_the_walk_commands_floor_is_none_unless_given_and_peers_is_a_switch(monkeypatch, capsys, quiet_log):
    from epd_ring.models import walk as walk_command

    seen = []

    def half(cfg, progress=None):
        seen.append(cfg)
        return walk_command.Walk(cfg, spec_states=2, spec_edges=2, states=1, edges=1)

    monkeypatch.setattr(walk_command, "walk", half)
    assert walk_command.main(["1", "1", "1", "0"]) == 0  # half the edges, and no floor asked for
    assert walk_command.main(["1", "1", "1", "0", "--min-coverage", "0.6"]) == 1
    assert walk_command.main(["1", "1", "1", "0", "--peers", "--sizes", "1"]) == 0
    assert walk_command.main(["2", "2", "1", "0", "--sizes", "1", "--identities", "2"]) == 0
    assert [c.peers for c in seen] == [False, False, True, False] and seen[2].sizes == (1,)
    assert [(c.cells, c.rooms, c.receivers, c.faults, c.identities) for c in seen][2:] == [(1, 1, 1, 0, 1),
                                                                                       (2, 2, 1, 0, 2)]
