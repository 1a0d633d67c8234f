"""Packaging, and the main job and benchmark as smoke tests (README and the docs: test_docs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_under_one_namespace(installed_wheel, tmp_path):
    wheel, target = installed_wheel
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"epd_ring"}
    for module in ("fsm/machines.py", "executor/core/manager.py", "executor/drivers/control.py",
                   "executor/tools/cli.py", "models/spec.py"):
        assert f"epd_ring/{module}" in names, module
    # A name of the facade resolves (they load on first use) from the installed tree.
    code = ("import epd_ring.fsm, epd_ring.executor, epd_ring.models, importlib.util; "
            "print(epd_ring.fsm.__file__); assert importlib.util.find_spec('fsm') is None; "
            "import sys; print(sys.modules[epd_ring.executor.Ring.__module__].__file__)")
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout
    assert all(line.startswith(str(target)) for line in out.splitlines()), out


def test_demo_main_job_passes_its_own_checks(capsys):
    from epd_ring.executor.tools.cli import main

    assert main(["demo", "--rooms", "300", "--extents", "4", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "extents leaked: 0" in out and "differing from the tower output: 0" in out
    assert "items/s" in out
    assert "rooms concluded" in captured.err and "ETA" in captured.err  # progress goes to stderr


def test_bench_runs_its_cycle_and_prints_figures(capsys):
    from epd_ring.executor.tools.cli import main

    assert main(["bench", "--items", "300", "--sizes", "16", "64"]) == 0
    out = capsys.readouterr().out
    assert "us/item" in out and "64" in out


def test_deep_profile_explores_more_than_ci():
    from hypothesis import settings

    ci, deep = settings.get_profile("ci"), settings.get_profile("deep")
    assert ci.derandomize and ci.database is None
    assert deep.max_examples >= 4 * ci.max_examples and deep.stateful_step_count > ci.stateful_step_count


SEED = ROOT.parent / "shared" / "seeds" / "encode_executor.py"


def test_bench_measures_the_seed_from_its_file_in_the_same_run(capsys):
    import pytest

    if not SEED.is_file():
        pytest.skip(f"no seed at {SEED}")
    from epd_ring.executor.tools.cli import main

    before = set(sys.modules)
    assert main(["bench", "--items", "300", "--sizes", "16", "--seed", str(SEED)]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["16"])
    ours, seed, ratio = float(row[1]), float(row[2]), float(row[3].rstrip("x"))
    assert ours > 0 and seed > 0 and abs(ratio - ours / seed) < 0.01
    assert "no extent held" in out
    # The stand-ins for the engine's modules do not stay behind.
    assert not any(m.startswith("tokenspeed") for m in set(sys.modules) - before)


def test_bench_without_seed_prints_only_its_own_figures(capsys):
    from epd_ring.executor.tools.cli import main

    assert main(["bench", "--items", "200", "--sizes", "16"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["16"])
    assert row[2] == "-" and "seed:" not in out and "no extent held" not in out


def test_seed_loader_refuses_a_missing_file_or_a_file_without_the_executor(tmp_path):
    import pytest

    from epd_ring.executor.tools.seed_bench import load_seed

    with pytest.raises(FileNotFoundError):
        load_seed(tmp_path / "absent.py")
    other = tmp_path / "other.py"
    other.write_text("X = 1\n")
    with pytest.raises(ValueError, match="DisaggEncodeExecutor"):
        load_seed(other)
