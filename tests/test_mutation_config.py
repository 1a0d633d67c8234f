"""The mutation pass's configuration (tests/mutation/run_mutmut.sh) says what it means: the tests it
selects and deselects exist, and the lines it leaves alone are wording (help and exception messages),
not behaviour. The pass itself takes hours and is not run here."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "mutation" / "run_mutmut.sh"
MUTATED = ("fsm", "executor/core", "models")


@pytest.fixture(scope="module")
def config() -> dict:
    text = SCRIPT.read_text()
    body = text.split("<<'TOML'\n", 1)[1].split("\nTOML\n", 1)[0]
    return tomllib.loads(body)["tool"]["mutmut"]


def mutated_lines():
    for folder in MUTATED:
        for path in sorted((ROOT / folder).glob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                yield f"{path.relative_to(ROOT)}:{n}", line


def test_the_selection_has_the_command_line_spin_and_hostile_edge_suites(config):
    selected = config["pytest_add_cli_args_test_selection"]
    assert {"tests/test_cli.py", "tests/test_spin.py", "tests/test_hostile_edges.py"} <= set(selected)
    assert [f for f in selected if not (ROOT / f).is_file()] == []


# Test files the pass does not run, each with why: what runs the drivers, tools, a real engine or a
# real process (mutmut's trampolines reach none of them), what reads the source (which mutmut
# rewrites), and what checks the house rather than behaviour. A new test file must be named here or
# selected: a suite left out by mistake was twice the reason a pass under-counted.
NOT_SELECTED = {
    "tests/test_bench_arena.py": "a tool's figures (executor/tools), reached by the arena's own tests",
    "tests/test_bench_cycle.py": "the bench's figures: a tool, and timing",
    "tests/test_compiled.py": "builds the compiled core from the checkout's sources (minutes), not mutmut's copy",
    "tests/test_control.py": "the control plane's driver over real sockets",
    "tests/test_control_edges.py": "the control plane's driver over real sockets",
    "tests/test_core_shape.py": "reads the core's source, which mutmut rewrites",
    "tests/test_docs.py": "the docs site and its pages",
    "tests/test_examples.py": "the examples, run as processes",
    "tests/test_handshake.py": "the CURVE handshake's driver",
    "tests/test_keys_e2e.py": "keys over the real control plane",
    "tests/test_layout.py": "reads the source tree's layout and sizes",
    "tests/test_lint.py": "ruff and mypy",
    "tests/test_mooncake_e2e.py": "a real Mooncake engine",
    "tests/test_multihost.py": "network namespaces and real processes",
    "tests/test_mutation_config.py": "this file",
    "tests/test_nixl.py": "a real NIXL engine",
    "tests/test_nixl_dynamo.py": "a real NIXL engine and Dynamo's receiver",
    "tests/test_orphans.py": "the receiver's /proc reader, a driver",
    "tests/test_pages.py": "the docs site's pages",
    "tests/test_project.py": "packaging and the README's commands",
    "tests/test_qwen3vl.py": "a real model over real engines",
    "tests/test_reconnect.py": "the receiver and control plane over real sockets",
    "tests/test_timeline.py": "a tool's output",
    "tests/test_transports.py": "the real engines' transports",
    "tests/test_vllm_e2e.py": "real vLLM processes",
    "tests/test_vllm_scheduler.py": "vLLM's scheduler with our connector, a driver",
    "tests/test_vllm_worker_edges.py": "vLLM's worker with our connector, a driver",
    "tests/test_vllm_workers.py": "vLLM's workers with our connector, a driver",
}


def test_every_test_file_is_selected_or_named_with_its_reason(config):
    selected = set(config["pytest_add_cli_args_test_selection"])
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")}
    assert sorted(files - selected - set(NOT_SELECTED)) == []
    assert sorted(selected & set(NOT_SELECTED)) == []
    assert sorted(set(NOT_SELECTED) - files) == []


def test_every_deselected_test_is_selected_and_exists(config):
    args = config["pytest_add_cli_args"]
    nodes = [args[i + 1] for i, a in enumerate(args) if a == "--deselect"]
    assert nodes
    selected = set(config["pytest_add_cli_args_test_selection"])
    for node in nodes:
        path, name = node.split("::")[:2]
        assert path in selected, node
        name = name.split("[")[0]
        assert re.search(rf"^(def {name}\(|{name} = |class {name}\b)", (ROOT / path).read_text(), re.M), node


def test_help_and_exception_messages_are_left_alone_and_nothing_else(config):
    patterns = [re.compile(p) for p in config["do_not_mutate_patterns"]]

    def skipped(line: str) -> bool:
        return any(p.search(line) for p in patterns)

    helps = [(where, line) for where, line in mutated_lines() if "help=" in line.split("#")[0]]
    assert len(helps) > 20 and [where for where, line in helps if not skipped(line)] == []
    # an exception whose arguments are its message only: the first is a string, or starts the next line
    messages = [(where, line) for where, line in mutated_lines()
                if re.match(r"\s*raise (\w+\.)*\w+\((f?[\"']|$)", line)]
    assert len(messages) > 50 and [where for where, line in messages if not skipped(line)] == []
    # no other line: an exception that carries data, a call with help= later on, a plain statement
    for line in ['        raise InvalidTransition(self.name, state, event, obj)',
                 '    p.add_argument("--cells", type=count_at_least(1), default=None,',
                 '            self._close(key)', '        log = logging.getLogger("epd_ring")']:
        assert not skipped(line), line


def _mutation_module(name: str, path: Path | None = None):
    """A script of tests/mutation/ (not a package), or the file at `path`, loaded as a module of its own."""
    import importlib.util

    path = path or ROOT / "tests" / "mutation" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"mutation_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_pass_record_brings_its_verdicts_to_another_machine_of_the_same_commit(tmp_path):
    record = _mutation_module("record")
    first, second, other = tmp_path / "first", tmp_path / "second", tmp_path / "other"
    meta = {"exit_code_by_key": {"epd_ring.fsm.core.x_step__mutmut_1": 1, "epd_ring.fsm.core.x_step__mutmut_2": 0,
                                 "epd_ring.fsm.core.x_step__mutmut_3": None},
            "hash_by_function_name": {"x_step": "abc"}, "type_check_error_by_key": {},
            "durations_by_key": {"epd_ring.fsm.core.x_step__mutmut_1": 0.5}, "estimated_durations_by_key": {}}
    (first / "mutants" / "src" / "epd_ring" / "fsm").mkdir(parents=True)
    (first / "mutants" / "src" / "epd_ring" / "fsm" / "core.py.meta").write_text(json.dumps(meta))
    for d, commit in ((first, "a" * 40), (second, "a" * 40), (other, "b" * 40)):
        d.mkdir(exist_ok=True)
        (d / "COMMIT").write_text(commit + "\n")
        (d / "pyproject.toml").write_text(_PYPROJECT.format(files='"tests/test_fsm.py", "tests/test_ring.py"',
                                                             deselected='"--deselect", "tests/test_ring.py::slow"'))
    out = tmp_path / "record.json.gz"
    assert record.main(["save", str(first), str(out)]) == 0
    assert record.main(["restore", str(out), str(other)]) == 2  # another commit's pass: refused
    assert not (other / "mutants").exists()
    assert record.main(["restore", str(out), str(second)]) == 0
    assert json.loads((second / "mutants" / "src" / "epd_ring" / "fsm" / "core.py.meta").read_text()) == meta
    assert record.main(["restore", str(out), str(second)]) == 2  # verdicts there already: not overwritten
    assert record.main(["save", str(other), str(out.with_name("none.json.gz"))]) == 2  # nothing decided to keep
    # a carried pass has not run the record's survivors again yet: verify_kills reads them from the record
    verify = _mutation_module("verify_kills")
    assert verify.record_survivors(str(out), "epd_ring.fsm") == ["epd_ring.fsm.core.x_step__mutmut_2"]
    assert verify.record_survivors(str(out), "epd_ring.models") == []


_PYPROJECT = """[tool.mutmut]
pytest_add_cli_args_test_selection = [{files}]
pytest_add_cli_args = ["-p", "no:cacheprovider", {deselected}]
"""


def test_a_record_carried_onto_a_later_commit_keeps_only_its_kills_and_only_if_no_test_was_taken_away(tmp_path):
    record = _mutation_module("record")
    then, later, narrower = tmp_path / "then", tmp_path / "later", tmp_path / "narrower"
    codes = {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 0, "m.x_f__mutmut_3": 33, "m.x_f__mutmut_4": 24}
    (then / "mutants").mkdir(parents=True)
    (then / "mutants" / "m.py.meta").write_text(json.dumps(
        {"exit_code_by_key": codes, "hash_by_function_name": {"x_f": "h"}, "type_check_error_by_key": {},
         "durations_by_key": {}, "estimated_durations_by_key": {}}))
    selections = {then: ('"tests/a.py"', '"--deselect", "tests/a.py::slow"'),
                  later: ('"tests/a.py", "tests/b.py"', '"--deselect", "tests/a.py::slow"'),  # a file more
                  narrower: ('"tests/a.py"', '"--deselect", "tests/a.py::slow", "--deselect", "tests/a.py::t"')}
    for d, (files, deselected) in selections.items():
        d.mkdir(exist_ok=True)
        (d / "COMMIT").write_text(("a" if d is then else "b") * 40)
        (d / "pyproject.toml").write_text(_PYPROJECT.format(files=files, deselected=deselected))
    out = tmp_path / "record.json.gz"
    assert record.main(["save", str(then), str(out)]) == 0
    assert record.main(["restore", str(out), str(narrower), "--carry"]) == 2  # a test that ran then does not now
    assert not (narrower / "mutants").exists()
    assert record.main(["restore", str(out), str(later), "--carry"]) == 0
    carried = json.loads((later / "mutants" / "m.py.meta").read_text())["exit_code_by_key"]
    # the kill and the timeout stand; the survivor and the one no test reached meet today's tests
    assert carried == {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": None, "m.x_f__mutmut_3": None, "m.x_f__mutmut_4": 24}
    # a survivor whose diff (written by save where mutmut is) is claimed equivalent is not run again
    claims = _mutation_module("claims")
    func, before, after = sorted(claims.equivalents())[0]
    rec = json.loads(gzip.decompress(out.read_bytes()))
    rec["metas"]["m.py.meta"]["exit_code_by_key"][func + "__mutmut_9"] = 0
    rec["survivor_diffs"] = {func + "__mutmut_9": [before, after], "m.x_f__mutmut_2": ["x = 1", "x = 2"]}
    out.write_bytes(gzip.compress(json.dumps(rec).encode()))
    for p in (later / "mutants").rglob("*.meta"):
        p.unlink()
    assert record.main(["restore", str(out), str(later), "--carry"]) == 0
    carried = json.loads((later / "mutants" / "m.py.meta").read_text())["exit_code_by_key"]
    assert carried[func + "__mutmut_9"] == 0 and carried["m.x_f__mutmut_2"] is None
    # carried in place (the pass's directory still there): refused on the same grounds, before any verdict moves
    meta_before = (then / "mutants" / "m.py.meta").read_text()
    assert record.main(["carry", str(then), str(narrower / "pyproject.toml")]) == 2
    assert (then / "mutants" / "m.py.meta").read_text() == meta_before


def test_the_records_killed_exit_codes_are_mutmuts_for_what_the_score_counts_killed():
    stats = pytest.importorskip("mutmut.stats")
    score = _mutation_module("score")
    table = dict(stats.status_by_exit_code)
    killed = {code for code, status in table.items() if status in score.KILLED} | {score.ABORT}
    assert killed == _mutation_module("record").KILLED


def test_under_mutmut_the_collected_heap_is_frozen_before_the_fork_server_forks(monkeypatch):
    import gc
    import sys
    import types

    pytest_collection_finish = _mutation_module("conftest", ROOT / "tests" / "conftest.py").pytest_collection_finish
    monkeypatch.delitem(sys.modules, "mutmut", raising=False)
    gc.unfreeze()
    pytest_collection_finish(None)
    assert gc.get_freeze_count() == 0  # an ordinary run is left alone
    monkeypatch.setitem(sys.modules, "mutmut", types.ModuleType("mutmut"))
    try:
        pytest_collection_finish(None)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
