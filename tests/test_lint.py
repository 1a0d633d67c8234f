"""ruff and mypy pass, as CI runs them; skipped where the `lint` extra is not installed.

Both take a second or two (mypy checks only what [tool.mypy] names in pyproject.toml), so the
test command catches what CI would refuse.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="the lint extra is not installed")
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_mypy_finds_nothing():
    pytest.importorskip("mypy", reason="the lint extra is not installed")
    p = subprocess.run([str(ROOT / ".ci" / "typecheck")], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHON": sys.executable})
    assert p.returncode == 0, p.stdout + p.stderr
