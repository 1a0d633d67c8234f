"""The command line as a user meets it: the real entry point in a subprocess, its exit code and stderr.

Exit codes (see `epd-ring --help`): 0 ok, 1 a finding, 2 usage or input error,
3 environment (a missing program or extra), 70 internal error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hazards"


def cli(*args: str, env: dict | None = None, timeout: float = 300, module: str = "epd_ring",
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd or ROOT)


def one_line_error(p: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert p.returncode == code, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args, needle", [
    (["check", "--slots", "0"], "--slots: must be >= 1, got 0"),
    (["check", "--slots", "-1"], "--slots: must be >= 1, got -1"),
    (["check", "--receivers", "0"], "--receivers: must be >= 1"),
    (["check", "--faults", "-1"], "--faults: must be >= 0"),
    (["bench", "--items", "0"], "--items: must be >= 1"),
    (["bench", "--sizes", "0"], "--sizes: must be >= 1"),
    (["demo", "--slots", "0"], "--slots: must be >= 1"),
    (["demo", "--batch", "0"], "--batch: must be >= 1"),
    (["demo", "--rooms", "-5"], "--rooms: must be >= 1"),
    (["demo", "--fault-rate", "2"], "--fault-rate: must be between 0 and 1"),
    (["demo", "--slots", "six"], "expected an integer"),
    (["--log-level", "loud", "check"], "--log-level"),
    (["bench", "--transport", "mooncake", "--seed", "x.py"], "--seed"),
    (["bench", "--seed", "/no/such/seed.py"], "no such file"),
    (["demo", "--requests", "4"], "apply only to --model qwen3-vl-tiny"),
    (["demo", "--model", "qwen3-vl-tiny", "--fault-rate", "0.1"], "--fault-rate apply to the tiny-tower demo"),
    (["demo", "--timeline", "/no/such/folder/t.svg"], "no such folder"),
])
def test_bad_values_are_refused_on_one_line_with_exit_2(args, needle):
    one_line_error(cli(*args), 2, "epd-ring", needle)


def test_replay_refuses_unreadable_or_malformed_traces(tmp_path):
    one_line_error(cli("check", "--replay", str(tmp_path / "missing.json")), 2, "cannot read")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    one_line_error(cli("check", "--replay", str(bad)), 2, "not valid JSON")
    bad.write_text('{"foo": 1}')
    one_line_error(cli("check", "--replay", str(bad)), 2, "not a saved trace")
    trace = json.loads((FIXTURES / "seed--H16.json").read_text())
    trace["events"][1] = ["no_such_event", 0]
    bad.write_text(json.dumps(trace))
    one_line_error(cli("check", "--replay", str(bad)), 2, "not enabled at step")


@pytest.mark.parametrize("flag", [["--variant", "project"], ["--slots", "5"]])
def test_replay_refuses_flags_it_would_ignore(flag):
    one_line_error(cli("check", "--replay", str(FIXTURES / "seed--H16.json"), *flag), 2, flag[0],
                   "cannot be combined")


def test_exit_1_is_a_finding_and_0_is_clean():
    p = cli("check", "--replay", str(FIXTURES / "seed--H16.json"))
    assert p.returncode == 1 and "violation:" in p.stdout and "Traceback" not in p.stderr
    p = cli("check", "--slots", "1", "--rooms", "1", "--receivers", "1", "--quiet")
    assert p.returncode == 0 and "no violation" in p.stdout


def test_internal_errors_are_exit_70_not_1(monkeypatch, capsys):
    # A bug must not read as a finding. (In process: a crash cannot be provoked from outside.)
    from epd_ring.executor.tools import cli as cli_module, demo

    def broken(**_):
        raise RuntimeError("boom")

    monkeypatch.setattr(demo, "run", broken)
    assert cli_module.main(["demo"]) == 70
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: boom" in err and "Traceback" not in err
    assert cli_module.main(["-v", "demo"]) == 70
    assert "Traceback" in capsys.readouterr().err


def test_missing_dot_is_an_environment_error_naming_the_install(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no `dot` on it
    one_line_error(cli("diagrams", "--dir", str(tmp_path / "d"), env=env), 3, "apt-get install graphviz")


def test_missing_extra_is_an_environment_error_naming_the_install(tmp_path):
    # A `zmq` that cannot be imported, as on a plain install without the mooncake extra.
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "zmq.py").write_text("raise ModuleNotFoundError(\"No module named 'zmq'\", name='zmq')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker))
    # find_spec sees the shadowing module; what matters is the one-line answer and exit 3.
    p = cli("demo", "--transport", "mooncake", "--rooms", "1", env=env)
    one_line_error(p, 3, "pip install 'epd-ring[mooncake]'")
    p = cli("demo", "--metrics-port", "0", "--rooms", "1", env=dict(os.environ, PYTHONPATH=str(_blocked(
        tmp_path, "prometheus_client"))))
    if "unrecognized arguments" not in p.stderr:  # --metrics-port lands with the metrics step
        one_line_error(p, 3, "pip install 'epd-ring[metrics]'")


def _blocked(tmp_path: Path, module: str) -> Path:
    d = tmp_path / f"block-{module}"
    d.mkdir()
    (d / f"{module}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{module}'\", name='{module}')\n")
    return d


def test_version_and_python_dash_m(tmp_path):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    p = cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"epd-ring {version}"
    p = cli("--help")
    assert p.returncode == 0 and "Exit codes" in p.stdout and "internal error" in p.stdout
    # From anywhere once installed: the wheel's `epd_ring/__main__.py`, outside the source tree.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel = next((tmp_path / "dist").glob("epd_ring-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    p = cli("--version", cwd=tmp_path, env=env)
    assert p.returncode == 0 and p.stdout.strip() == f"epd-ring {version}", p.stderr


def test_help_names_defaults():
    p = cli("demo", "--help")
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    for needle in ("--slots SLOTS ring slots (default: 6)", "(default: 0.25)", "(default: 2000 on loopback, 300 on"):
        assert needle in text, needle
    assert "(default: None)" not in text and "(default: False)" not in text


def test_json_outputs_parse():
    p = cli("check", "--slots", "1", "--rooms", "2", "--receivers", "1", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["violation"] is False and report["runs"][0]["states"] > 0
    p = cli("check", "--replay", str(FIXTURES / "seed--H16.json"), "--json")
    assert p.returncode == 1 and json.loads(p.stdout)["violation"]["kind"]
    p = cli("bench", "--items", "50", "--sizes", "1", "8", "--json")
    assert p.returncode == 0, p.stderr
    figures = json.loads(p.stdout)["us_per_item"]
    assert set(figures) == {"1", "8"} and all(v["ours"] > 0 for v in figures.values())
    p = cli("demo", "--rooms", "60", "--slots", "3", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["ok"] is True and sum(report["outcomes"].values()) == 60 and report["slots_leaked"] == 0


def test_quiet_verbose_and_log_level():
    quiet = cli("demo", "--rooms", "60", "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    loud = cli("demo", "--rooms", "60", "-v")
    assert loud.returncode == 0 and "INFO epd_ring.manager: room" in loud.stderr
    assert "ETA" in loud.stderr  # progress, off a terminal: a line per tenth with an ETA
    p = cli("--log-level", "info", "check", "--slots", "1", "--rooms", "1", "--receivers", "1", "-q")
    assert p.returncode == 0 and p.stderr == ""


def test_demo_flags_are_honoured_not_rewritten():
    p = cli("demo", "--rooms", "40", "--fault-rate", "0", "--json")
    report = json.loads(p.stdout)
    assert p.returncode == 0 and report["outcomes"] == {"success": 40}
    assert set(report["by_injection"]) == {"none"}


def test_bench_small_values_run():
    # --items 1 divided by zero, a ring of fewer than 4 slots held a rule that faulted live writes.
    p = cli("bench", "--items", "1", "--sizes", "1", "2", "-q")
    assert p.returncode == 0, p.stderr
    assert re.search(r"^\s+1\s+\d", p.stdout, re.M)


def test_no_warning_before_the_demo_output():
    # The plain install must not greet a user with torch's "Failed to initialize NumPy".
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("numpy") for d in deps)
    p = cli("demo", "--rooms", "30", "-q")
    assert p.returncode == 0 and "Warning" not in p.stderr and p.stderr == ""


def test_receiver_entry_point_handles_its_arguments():
    module = "epd_ring.executor.drivers.receiver"
    p = cli("--help", module=module)
    assert p.returncode == 0 and "tcp://HOST:PORT" in p.stdout
    p = cli(module=module)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "endpoint" in p.stderr
    one_line_error(cli("not-an-endpoint", module=module), 2, "tcp://HOST:PORT")


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
    p = cli("demo", "--transport", "mooncake", "--rooms", "24", "--fault-rate", "0", "--json", "--quiet")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["outcomes"] == {"success": 24} and set(report["by_injection"]) == {"none"}
    assert not re.search(r"^[IWEF]\d{4} ", p.stderr, re.M), p.stderr


@pytest.mark.parametrize("args, needle", [
    (["check", "--spin-collapse"], "--spin-collapse apply only to --engine spin"),
    (["check", "--engine", "spin", "--compare-symmetry"], "apply to the explorer, not --engine spin"),
    (["check", "--engine", "spin", "--spin-hash", "0"], "--spin-hash: must be >= 1"),
])
def test_check_engine_flags_are_honoured_or_refused(args, needle):
    one_line_error(cli(*args), 2, needle)
