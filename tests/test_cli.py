"""The command line as a user meets it: exit codes, stdout and stderr.

Exit codes (see `epd-ring --help`): 0 ok, 1 a finding, 2 usage or input error,
3 environment (a missing program or extra), 70 internal error.

Most tests call `cli.main` in this process (the `epd` fixture), which is what the entry point
runs; a few run a real process where only a process can show it: the entry point itself, an
installed wheel, what is imported before an answer, and native code writing to fd 2.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import tomllib

from epd_ring.executor.tools import cli as cli_module

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hazards"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str, env: dict | None = None, timeout: float = 300, module: str = "epd_ring",
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    """A real `python -m MODULE ARGS` process."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd or ROOT)


@pytest.fixture
def epd(capsys):
    """`epd-ring ARGS` in this process, answered as a process would: (exit code, stdout, stderr)."""
    return lambda *args: _in_process(capsys, cli_module.main, list(args))


def _in_process(capsys, main, argv: list[str]) -> Ran:
    root, ours = logging.getLogger(), logging.getLogger("epd_ring")
    handlers, level, our_level = root.handlers[:], root.level, ours.level
    # A process starts with the epd_ring loggers unset; conftest quiets them for the suite.
    ours.setLevel(logging.NOTSET)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse answers --help, --version and usage errors by exiting
        code = 0 if exc.code is None else exc.code
    finally:
        # main() points the root logger at this test's captured stderr; the next test has its own.
        root.handlers[:] = handlers
        root.setLevel(level)
        ours.setLevel(our_level)
    out = capsys.readouterr()
    return Ran(code, out.out, out.err)


def one_line_error(p: Ran | subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert p.returncode == code, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


USAGE_ERRORS = [
    (["check", "--cells", "0"], "--cells: must be >= 1, got 0"),
    (["check", "--cells", "-1"], "--cells: must be >= 1, got -1"),
    (["check", "--sizes", "2,1"], "--sizes: expected ascending cell counts"),
    (["check", "--slots", "3"], "--slots is gone"),
    (["check", "--receivers", "0"], "--receivers: must be >= 1"),
    (["check", "--faults", "-1"], "--faults: must be >= 0"),
    (["bench", "--items", "0"], "--items: must be >= 1"),
    (["bench", "--sizes", "0"], "--sizes: must be >= 1"),
    (["demo", "--extents", "0"], "--extents: must be >= 1"),
    (["demo", "--batch", "0"], "--batch: must be >= 1"),
    (["demo", "--rooms", "-5"], "--rooms: must be >= 1"),
    (["demo", "--fault-rate", "2"], "--fault-rate: must be between 0 and 1"),
    (["demo", "--extents", "six"], "expected an integer"),
    (["--log-level", "loud", "check"], "--log-level"),
    (["bench", "--transport", "mooncake", "--seed", "x.py"], "--seed"),
    (["bench", "--transport", "mooncake", "--sizes", "2048"], "--sizes"),
    (["bench", "--seed", "/no/such/seed.py"], "no such file"),
    (["bench", "--blocks", "3"], "--blocks applies only to --against"),
    (["bench", "--runs", "2"], "--runs applies only to --startup"),
    (["bench", "--startup", "--sizes", "64"], "--sizes apply to the controller bench"),
    (["bench", "--startup", "--transport", "mooncake"], "--transport mooncake apply to the controller bench"),
    (["bench", "--against", "/no/such/python"], "not an executable Python"),
    (["bench", "--against", sys.executable, "--sizes", "64", "1024"], "one ring size"),
    (["demo", "--requests", "4"], "apply only to --model qwen3-vl-tiny"),
    (["demo", "--model", "qwen3-vl-tiny", "--fault-rate", "0.1"], "--fault-rate apply to the tiny-tower demo"),
    (["demo", "--timeline", "/no/such/folder/t.svg"], "no such folder"),
    (["check", "--spin-collapse"], "--spin-collapse apply only to --engine spin"),
    (["check", "--engine", "spin", "--compare-symmetry"], "apply to the explorer, not --engine spin"),
    (["check", "--engine", "spin", "--spin-hash", "0"], "--spin-hash: must be >= 1"),
    (["check", "--engine", "explorer", "--spin-no-regions"], "--spin-no-regions apply only to --engine spin"),
    (["check", "--engine", "explorer", "--spin-memlim", "512"], "--spin-memlim apply only to --engine spin"),
    (["check", "--engine", "spin", "--spin-memlim", "0"], "--spin-memlim: must be >= 1"),
    (["bench-arena", "--budget", "0"], "--budget: must be at least 1MiB"),
    (["bench-arena", "--budgets", "1GiB", "2XB"], "expected a size"),
    (["bench-arena", "--rate", "0"], "--rate: must be a finite number > 0"),
    (["no-such-command"], "invalid choice"),
]


@pytest.mark.parametrize("args, needle", USAGE_ERRORS)
def test_bad_values_are_refused_on_one_line_with_exit_2(epd, args, needle):
    one_line_error(epd(*args), 2, "epd-ring", needle)


def test_demos_deprecated_slots_flag_sets_extents_and_names_the_new_flag(capsys):
    args = cli_module.build_parser().parse_args(["demo", "--slots", "3"])  # the deprecated flag
    assert args.extents == 3
    assert "--extents" in capsys.readouterr().err
    assert cli_module.build_parser().parse_args(["demo"]).extents == 6  # the deprecated flag sets no default
    assert capsys.readouterr().err == ""


def test_demo_run_takes_its_deprecated_slots_argument_as_extents():
    from epd_ring.executor.tools import demo

    # Refused before anything runs: the value went to `extents`, and its check names it.
    with pytest.warns(DeprecationWarning, match="extents="), pytest.raises(ValueError, match="extents must be >= 1"):
        demo.run(slots=0)  # the deprecated name
    with pytest.raises(TypeError, match="rings"):
        demo.run(rings=3)


# What a real process has imported when it answers: torch takes seconds to import, and none
# of these answers needs it.
_IMPORTS_PROBE = """
import json, sys
import epd_ring.executor  # the facade loads nothing until a name is asked for
from epd_ring.executor.tools.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    try:
        codes.append(main(argv))
    except SystemExit as exc:
        codes.append(exc.code)
print(json.dumps({"codes": codes, "torch": "torch" in sys.modules}))
"""


def test_version_help_and_usage_errors_answer_without_importing_torch():
    argvs = [["--version"], ["--help"], ["demo", "--help"], ["bench-arena", "--help"],
             *(args for args, _ in USAGE_ERRORS)]
    p = subprocess.run([sys.executable, "-c", _IMPORTS_PROBE, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    answer = json.loads(p.stdout.strip().splitlines()[-1])
    assert answer["codes"] == [0, 0, 0, 0] + [2] * len(USAGE_ERRORS), answer
    assert answer["torch"] is False


# `--version` and `--help` answer from the command line's own module: neither torch nor the model
# (epd_ring.models, which loads the machines and with them transitions.extensions, seconds under load).
_LOADED_PROBE = """
import json, sys
from epd_ring.executor.tools.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""
HEAVY = ("torch", "transitions", "epd_ring.models", "epd_ring.fsm", "epd_ring.executor.core", "numpy")


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_load_neither_torch_nor_the_model(flag):
    p = subprocess.run([sys.executable, "-c", _LOADED_PROBE, flag], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr
    answer = json.loads(p.stdout.strip().splitlines()[-1])
    assert answer["code"] in (0, None)
    assert "epd_ring.executor.tools.cli" in answer["modules"]  # the probe sees what main() loaded
    assert [m for m in answer["modules"] if m.split(".")[0] in HEAVY or m.startswith(HEAVY)] == []


def test_check_loads_its_flags_from_the_model_only_when_chosen(epd):
    # the flags came back: help lists them and a bad value is refused by the model's own check
    p = epd("check", "--help")
    assert p.returncode == 0 and "--cells" in p.stdout and "--engine" in p.stdout and "--json" in p.stdout
    one_line_error(epd("check", "--variant", "nobody"), 2, "--variant")


def test_bench_startup_prints_the_time_of_version_and_help(epd):
    p = epd("bench", "--startup", "--runs", "1")
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line.split()[1:] for line in p.stdout.splitlines() if line.split()[:1] in
            (["--version"], ["--help"])}
    assert set(rows) == {"--version", "--help"} and all(float(x) > 0 for row in rows.values() for x in row)
    p = epd("bench", "--startup", "--runs", "1", "--json")
    assert p.returncode == 0, p.stderr
    figures = json.loads(p.stdout)["startup"]
    assert set(figures) == {"--version", "--help"}
    assert all(f["best_ms"] <= f["median_ms"] and f["imports_ms"] > 0 for f in figures.values())


def test_the_facade_lists_and_resolves_every_public_name():
    import epd_ring.executor as facade
    import epd_ring.executor.core as core

    assert set(core.__all__) <= set(facade.__all__), set(core.__all__) - set(facade.__all__)
    for name in core.__all__:
        assert getattr(facade, name) is getattr(core, name), name
    assert set(facade.__all__) <= set(dir(facade))
    with pytest.raises(AttributeError):
        facade.no_such_name  # noqa: B018


def test_replay_refuses_unreadable_or_malformed_traces(epd, tmp_path):
    one_line_error(epd("check", "--replay", str(tmp_path / "missing.json")), 2, "cannot read")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    one_line_error(epd("check", "--replay", str(bad)), 2, "not valid JSON")
    bad.write_text('{"foo": 1}')
    one_line_error(epd("check", "--replay", str(bad)), 2, "not a saved trace")
    trace = json.loads((FIXTURES / "seed--H16.json").read_text())
    trace["events"][1] = ["no_such_event", 0]
    bad.write_text(json.dumps(trace))
    one_line_error(epd("check", "--replay", str(bad)), 2, "not enabled at step")


@pytest.mark.parametrize("flag", [["--variant", "project"], ["--cells", "5"]])
def test_replay_refuses_flags_it_would_ignore(epd, flag):
    one_line_error(epd("check", "--replay", str(FIXTURES / "seed--H16.json"), *flag), 2, flag[0],
                   "cannot be combined")


def test_exit_1_is_a_finding_and_0_is_clean(epd):
    p = epd("check", "--replay", str(FIXTURES / "seed--H16.json"))
    assert p.returncode == 1 and "violation:" in p.stdout and "Traceback" not in p.stderr
    p = epd("check", "--cells", "1", "--rooms", "1", "--receivers", "1", "--quiet")
    assert p.returncode == 0 and "no violation" in p.stdout


def test_internal_errors_are_exit_70_not_1(epd, monkeypatch):
    # A bug must not read as a finding. (A crash cannot be provoked from outside.)
    from epd_ring.executor.tools import demo

    def broken(**_):
        raise RuntimeError("boom")

    monkeypatch.setattr(demo, "run", broken)
    p = epd("demo")
    assert p.returncode == 70
    assert "internal error: RuntimeError: boom" in p.stderr and "Traceback" not in p.stderr
    p = epd("-v", "demo")
    assert p.returncode == 70 and "Traceback" in p.stderr


def test_missing_dot_is_an_environment_error_naming_the_install(epd, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` on it
    one_line_error(epd("diagrams", "--dir", str(tmp_path / "d")), 3, "apt-get install graphviz")


def test_missing_extra_is_an_environment_error_naming_the_install(epd, monkeypatch):
    # None in sys.modules: the module cannot be imported, as on a plain install without the extra.
    monkeypatch.setitem(sys.modules, "zmq", None)
    one_line_error(epd("demo", "--transport", "mooncake", "--rooms", "1"), 3, "pip install 'epd-ring[mooncake]'")
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    one_line_error(epd("demo", "--metrics-port", "0", "--rooms", "1"), 3, "pip install 'epd-ring[metrics]'")


@pytest.mark.parametrize("module, code, needle", [
    ("zmq", 3, "pip install 'epd-ring[mooncake]'"),
    ("transformers", 3, "pip install 'epd-ring[qwen]'"),
    ("no_such_dependency", 70, "internal error"),  # not an extra: a bug in the package
])
def test_an_import_failing_inside_a_command_names_the_extra_or_is_internal(epd, monkeypatch, module, code, needle):
    from epd_ring.executor.tools import demo

    def needs(**_):
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)

    monkeypatch.setattr(demo, "run", needs)
    one_line_error(epd("demo"), code, needle)


def test_version_and_help(epd):
    p = epd("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"epd-ring {VERSION}"
    p = epd("--help")
    assert p.returncode == 0 and "Exit codes" in p.stdout and "internal error" in p.stdout


def test_python_dash_m_runs_the_entry_point_in_the_tree_and_installed(installed_wheel, tmp_path):
    p = cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"epd-ring {VERSION}", p.stderr
    one_line_error(cli("check", "--cells", "0"), 2, "--cells")
    # From anywhere once installed: the wheel's `epd_ring/__main__.py`, outside the source tree.
    _, site = installed_wheel
    p = cli("--version", cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)))
    assert p.returncode == 0 and p.stdout.strip() == f"epd-ring {VERSION}", p.stderr


def test_help_names_defaults(epd):
    p = epd("demo", "--help")
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    for needle in ("--extents EXTENTS ring extents (default: 6)", "(default: 0.25)",
                   "(default: 2000 on loopback, 300 on"):
        assert needle in text, needle
    assert "(default: None)" not in text and "(default: False)" not in text


def test_json_outputs_parse(epd):
    p = epd("check", "--cells", "1", "--rooms", "2", "--receivers", "1", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["violation"] is False and report["runs"][0]["states"] > 0
    p = epd("check", "--replay", str(FIXTURES / "seed--H16.json"), "--json")
    assert p.returncode == 1 and json.loads(p.stdout)["violation"]["kind"]
    p = epd("bench", "--items", "50", "--sizes", "1", "8", "--json")
    assert p.returncode == 0, p.stderr
    figures = json.loads(p.stdout)["us_per_item"]
    assert set(figures) == {"1", "8"} and all(v["ours"] > 0 for v in figures.values())
    # this tree against itself: both sides ran their blocks and checked the bytes they wrote
    p = epd("bench", "--against", sys.executable, "--blocks", "2", "--items", "50", "--json")
    assert p.returncode == 0, p.stderr
    ab = json.loads(p.stdout)
    assert ab["this_min"] > 0 and ab["other_min"] > 0 and ab["ratio_min"] > 0
    p = epd("demo", "--rooms", "60", "--extents", "3", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["ok"] is True and sum(report["outcomes"].values()) == 60 and report["extents_leaked"] == 0


def test_every_option_of_the_model_commands_says_what_it_does(monkeypatch, capsys):
    """Each option has its help (the mutation pass leaves help text alone, not whether there is one)."""
    import argparse

    from epd_ring.models import walk
    from epd_ring.models.check import add_arguments

    given: list[tuple[str, object]] = []
    add = argparse.ArgumentParser.add_argument

    def recording(self, *names, **kw):
        given.append((names[0], kw.get("help")))
        return add(self, *names, **kw)

    monkeypatch.setattr(argparse.ArgumentParser, "add_argument", recording)
    add_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        walk.main(["--help"])
    capsys.readouterr()
    options = [(name, text) for name, text in given if name.startswith("--") and name != "--help"]
    assert {"--cells", "--engine", "--spin-no-regions", "--min-coverage"} <= {name for name, _ in options}
    assert [name for name, text in options if not (isinstance(text, str) and text)] == []


def test_engine_explorer_is_the_default_check(capsys):
    """`--engine explorer` names the default: the same space and the same finding as no --engine."""
    from epd_ring.executor.tools.cli import main

    reports = []
    for engine in ([], ["--engine", "explorer"]):
        for variant in ("project", "busy-wait"):
            code = main(["check", *engine, "--cells", "2", "--sizes", "1,2", "--rooms", "2", "--receivers", "1",
                         "--variant", variant, "--json"])
            report = json.loads(capsys.readouterr().out)
            reports.append((code, report["violation"], [(r["states"], r["transitions"], r["violations"])
                                                        for r in report["runs"]]))
    assert reports[:2] == reports[2:] and [r[:2] for r in reports[:2]] == [(0, False), (1, True)]


def test_quiet_verbose_and_log_level(epd):
    quiet = epd("demo", "--rooms", "60", "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    loud = epd("demo", "--rooms", "60", "-v")
    assert loud.returncode == 0 and "INFO epd_ring.manager: room" in loud.stderr
    assert "ETA" in loud.stderr  # progress, off a terminal: a line per tenth with an ETA
    p = epd("--log-level", "info", "check", "--cells", "1", "--rooms", "1", "--receivers", "1", "-q")
    assert p.returncode == 0 and p.stderr == ""


def test_demo_flags_are_honoured_not_rewritten(epd):
    p = epd("demo", "--rooms", "40", "--fault-rate", "0", "--json")
    report = json.loads(p.stdout)
    assert p.returncode == 0 and report["outcomes"] == {"success": 40}
    assert set(report["by_injection"]) == {"none"}


def test_bench_small_values_run(epd):
    # --items 1 divided by zero, a ring of fewer than 4 extents held a rule that faulted live writes.
    p = epd("bench", "--items", "1", "--sizes", "1", "2", "-q")
    assert p.returncode == 0, p.stderr
    assert re.search(r"^\s+1\s+\d", p.stdout, re.M)


def test_no_warning_before_the_demo_output():
    # The plain install must not greet a user with torch's "Failed to initialize NumPy": a real
    # process, since only a first import of torch prints it.
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("numpy") for d in deps)
    p = cli("demo", "--rooms", "30", "-q")
    assert p.returncode == 0 and "Warning" not in p.stderr and p.stderr == ""


def test_receiver_entry_point_handles_its_arguments(capsys):
    from epd_ring.executor.drivers.receiver import main as receiver_main

    p = _in_process(capsys, receiver_main, ["--help"])
    assert p.returncode == 0 and "tcp://HOST:PORT" in p.stdout
    p = _in_process(capsys, receiver_main, [])
    assert p.returncode == 2 and "Traceback" not in p.stderr and "endpoint" in p.stderr
    one_line_error(_in_process(capsys, receiver_main, ["not-an-endpoint"]), 2, "tcp://HOST:PORT")


def test_receiver_entry_point_checks_its_address_options(capsys):
    # Another host's receiver advertises its own address; a malformed one is a usage error,
    # not an engine started on a name nobody can reach.
    from epd_ring.executor.drivers.receiver import main as receiver_main

    p = _in_process(capsys, receiver_main, ["--help"])
    assert "--hostname" in p.stdout and "--status-address" in p.stdout
    for bad in (["--hostname", "a b"], ["--hostname", "h:1"], ["--status-address", "h:99999"],
                ["--status-address", "tcp://h:1"]):
        one_line_error(_in_process(capsys, receiver_main, ["tcp://127.0.0.1:5555", *bad]), 2, bad[0])


def test_engine_log_lines_are_dropped_under_quiet():
    # The filter itself: glog-format lines written to fd 2 by native code are dropped, ours pass.
    code = ("import os, sys\n"
            "from epd_ring.executor.tools.enginelog import engine_log_filtered\n"
            "with engine_log_filtered(True):\n"
            "    os.write(2, b'E1130 04:24:56.011078 11536 tcp_transport_session_impl.h:678] ClientSession: x\\n')\n"
            "    print('epd-ring: error: ours', file=sys.stderr, flush=True)\n"
            "os.write(2, b'after\\n')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == "epd-ring: error: ours\nafter\n", p.stderr


@pytest.mark.skipif(not os.environ.get("EPD_RING_REQUIRE_MOONCAKE") and (
        __import__("importlib").util.find_spec("mooncake") is None
        or __import__("importlib").util.find_spec("zmq") is None), reason="needs the mooncake extra")
def test_mooncake_demo_honours_rooms_and_fault_rate_and_is_quiet():
    # A real process: the engine's native log lines go to fd 2, which only a process shows.
    p = cli("demo", "--transport", "mooncake", "--rooms", "24", "--fault-rate", "0", "--json", "--quiet")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["outcomes"] == {"success": 24} and set(report["by_injection"]) == {"none"}
    assert not re.search(r"^[IWEF]\d{4} ", p.stderr, re.M), p.stderr
