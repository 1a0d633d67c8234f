"""The package is declared in pyproject.toml; this file adds only the compiled core.

With EPD_RING_COMPILE=1 the hot modules of the sans-I/O core (`COMPILED`) are compiled to C
extensions by mypyc, beside their sources, which stay the reference: an import finds the
extension first. Without it (the default) nothing is compiled. docs/figures.md ("The compiled
core") has what it measures; tests/test_compiled.py builds it and runs the lockstep walk, the
suites that drive the core by its calls, and the bench on it.

mypyc (mypy, the `lint` extra) must be importable where the build runs:
`EPD_RING_COMPILE=1 pip install --no-build-isolation .`, or `python setup.py build` for a tree.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup

# The core's modules compiled, by their file under executor/core/: those on the per-item path. Left
# as Python: `frames` and `settings`, which check what callers and the network hand in (compiled,
# a field read as an int is converted first: True would pass for 1); `reasons` (`Reason` subclasses
# str), `transport` (`TransportError` subclasses RuntimeError) and `tower` (a runtime-checkable
# Protocol), which mypyc does not compile; `effects` (named tuples, whose equality is set after the
# class: a compiled function is no method); `loopback`, a test transport that tests subclass; and
# `observe`, `ratelog` and `__init__`, off the per-item path.
COMPILED = ("admission", "arena", "clock", "drain", "executor", "holds", "lifecycle", "manager", "peers", "pump",
            "regions", "ring", "rooms", "shares", "staging", "tenancy", "timers", "tombstones", "writes")


def _compiled_core() -> list:
    if os.environ.get("EPD_RING_COMPILE") != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:  # a build in pip's isolated environment has no mypy
        raise SystemExit("EPD_RING_COMPILE=1 needs mypyc (pip install mypy) where the build runs: "
                         "pip install --no-build-isolation ...") from exc
    root = Path(__file__).resolve().parent
    os.chdir(root)  # setuptools takes the generated sources' paths relative to this folder
    # The folders install under the `epd_ring` namespace (pyproject's package-dir), and mypyc names
    # a module by its path: lay the namespace out as links (as .ci/typecheck does) and compile there.
    tree = Path("build", "compile-src")
    (tree / "epd_ring").mkdir(parents=True, exist_ok=True)
    for folder in ("fsm", "executor", "models"):
        link = tree / "epd_ring" / folder
        if not link.is_symlink():
            link.symlink_to(root / folder)
    os.environ["MYPYPATH"] = str(tree)
    paths = [(tree / "epd_ring" / "executor" / "core" / f"{name}.py").as_posix() for name in COMPILED]
    extensions = mypycify(["--explicit-package-bases", *paths], opt_level="3", target_dir="build/mypyc")
    for ext in extensions:  # mypyc names its generated sources by absolute path; setuptools wants them relative
        ext.sources = [os.path.relpath(source) for source in ext.sources]
    return extensions


setup(ext_modules=_compiled_core())
