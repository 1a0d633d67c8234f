"""The compiled core's build for tests/test_compiled.py (setup.py with EPD_RING_COMPILE=1), in build/compiled.

It takes about two minutes of one core, mostly mypyc's own analysis. A whole run starts it as the run
starts (`start`, from conftest's `pytest_configure`, before the workers), so it goes on beside the
other tests instead of after them on one worker; the test waits for it (`ready`), or builds it itself
when nothing started it. A build is kept while the sources it was made from are unchanged.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "compiled"
STAMP, BUILDING, FAILED = OUT / "SOURCES", OUT / "BUILDING", OUT / "FAILED"
WAIT_S = 1800  # a build on a loaded machine: minutes; a stuck one fails the test, not the run


def available() -> bool:
    return importlib.util.find_spec("mypyc") is not None and shutil.which("gcc") is not None


def digest() -> str:
    """The sources a build is made from: setup.py, the core's and fsm/'s modules."""
    h = hashlib.sha256()
    for path in sorted([ROOT / "setup.py", *(ROOT / "executor" / "core").glob("*.py"), *(ROOT / "fsm").glob("*.py")]):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _fresh() -> bool:
    return STAMP.is_file() and STAMP.read_text() == digest()


def _running() -> bool:
    try:
        os.kill(int(BUILDING.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


# The build, as a child process: its outcome is in the files it leaves (the stamp, or FAILED with the log).
_SCRIPT = """
import os, subprocess, sys
from pathlib import Path
root, out, digest = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
done = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(out), "build",
                       "--build-base", str(out), "--build-lib", str(out / "lib")], cwd=root,
                      env={**os.environ, "EPD_RING_COMPILE": "1"}, capture_output=True, text=True)
if done.returncode == 0:
    (out / "SOURCES").write_text(digest)
else:
    (out / "FAILED").write_text(done.stdout[-4000:] + done.stderr[-4000:])
(out / "BUILDING").unlink(missing_ok=True)
"""


def start() -> subprocess.Popen | None:
    """Start a build unless the one here is fresh or one is under way; the process, or None."""
    if not available() or _fresh() or _running():
        return None
    for old in (OUT / "lib", STAMP, FAILED):
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(ROOT), str(OUT), digest()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    BUILDING.write_text(str(proc.pid))  # before any worker asks: the workers start after this
    return proc


def ready() -> Path:
    """The build's library folder once a fresh build is there (started here if none is under way)."""
    proc = start()
    deadline = time.monotonic() + WAIT_S
    while _running() and time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.5)
    if proc is not None:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    assert not FAILED.is_file(), FAILED.read_text()
    assert _fresh(), "the compiled core's build did not finish (or its sources changed meanwhile)"
    return OUT / "lib"


def selected(args: list[str]) -> bool:
    """Whether a run with these arguments runs tests/test_compiled.py (the whole suite, or that file)."""
    tests = ROOT / "tests"
    for arg in args or ["tests"]:
        path = (Path.cwd() / arg.split("::")[0]).resolve()
        if path in (tests, ROOT) or path.name == "test_compiled.py":
            return True
    return False
