"""The docs' embedding loop runs as written: examples/embed.py, end to end, in a subprocess."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_embedding_example_runs_and_checks_its_own_deliveries(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "embed.py")], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stderr == ""  # no warning either
    out = p.stdout
    assert "refused req-dup: room 1003 already has a sender" in out  # RoomConflict shown, not raised
    assert out.count("success, receiver told ['success'], bytes equal the tower's: True") == 10
    assert "ring: arena of 16384 B" in out  # dump_state() returned a string and it was printed
    assert "drained: clean=True" in out and out.rstrip().endswith("OK")


def test_wheel_ships_license_and_py_typed(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True)
    wheel = next(tmp_path.glob("epd_ring-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in ("fsm", "executor", "models"):
        assert f"epd_ring/{pkg}/py.typed" in names, pkg
    assert "epd_ring/__main__.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: MIT" in meta and "Classifier: Typing :: Typed" in meta
    assert "Requires-Dist: numpy" in meta
