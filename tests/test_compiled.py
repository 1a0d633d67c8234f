"""The compiled core (setup.py with EPD_RING_COMPILE=1: the core's hot modules compiled by mypyc).

Built once per change of the core's sources (tests/compiled_build.py), then run in a child process whose
`epd_ring` is a tree of this checkout's sources with the compiled modules beside them: the lockstep
walk checks it against the model on every edge the core can take, the stateful suites drive it at
random, the suites that use only its public calls run on it, and the bench's cycle checks the bytes
it wrote and reports it as compiled. The rest of the suite runs the sources themselves (tests
replace functions in the core's modules, which a compiled caller never looks up again).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import compiled_build
import pytest

ROOT = compiled_build.ROOT
OUT = compiled_build.OUT
SEED = ROOT.parent / "shared" / "seeds" / "encode_executor.py"

pytestmark = pytest.mark.skipif(not compiled_build.available(), reason="needs mypyc (the lint extra's mypy) and gcc")


def _compiled_list() -> tuple[str, ...]:
    namespace: dict = {}
    # setup.py calls setup() at its end: read only what comes before, the list it compiles
    source = (ROOT / "setup.py").read_text().split("\ndef _compiled_core", 1)[0]
    exec(compile(source, "setup.py", "exec"), namespace)
    return namespace["COMPILED"]


COMPILED = _compiled_list()


@pytest.fixture(scope="module")
def tree() -> Path:
    """`epd_ring` as installed, with the compiled core: links to this checkout's sources, and the
    extensions built from them (tests/compiled_build.py: started as the run started, or here)."""
    built = compiled_build.ready()
    root = OUT / "tree"
    shutil.rmtree(root, ignore_errors=True)
    pkg = root / "epd_ring"
    (pkg / "executor" / "core").mkdir(parents=True)
    for name in ("fsm", "models"):
        (pkg / name).symlink_to(ROOT / name)
    (pkg / "__main__.py").symlink_to(ROOT / "epd_ring" / "__main__.py")
    for entry in (ROOT / "executor").iterdir():
        if entry.name not in ("core", "__pycache__"):
            (pkg / "executor" / entry.name).symlink_to(entry)
    for source in (ROOT / "executor" / "core").glob("*.py"):
        (pkg / "executor" / "core" / source.name).symlink_to(source)
    for ext in built.glob("*__mypyc*"):  # the modules' shared library, a top-level module
        shutil.copy(ext, root / ext.name)
    for ext in (built / "epd_ring" / "executor" / "core").glob("*.so"):
        shutil.copy(ext, pkg / "executor" / "core" / ext.name)
    return root


def _run(tree: Path, code: str, timeout: float = 600) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def test_the_hot_modules_of_the_core_run_compiled_and_the_rest_from_source(tree):
    out = _run(tree, """
        from epd_ring.executor.tools.bench import compiled_core
        import epd_ring.executor.core.frames as frames, epd_ring.executor.core.reasons as reasons
        print(",".join(compiled_core()))
        print(frames.__file__, reasons.__file__)
    """)
    compiled, sources = out.splitlines()
    assert compiled.split(",") == sorted(COMPILED)
    assert all(path.endswith(".py") for path in sources.split())


def test_the_compiled_core_keeps_lockstep_with_the_model_on_every_edge_it_can_take(tree):
    out = _run(tree, """
        import logging
        from epd_ring.executor.tools.bench import compiled_core
        from epd_ring.models.spec import Config
        from epd_ring.models.walk import walk
        assert "lifecycle" in compiled_core()
        logging.disable(logging.CRITICAL)  # the walk's injected faults log as they happen
        for cfg in (Config(3, 3, 1, 0, pieces=2), Config(2, 2, 2, 1)):
            w = walk(cfg)
            print(cfg, w.edges, len(w.failures))
            assert w.failures == [], w.failures[:3]
    """)
    edges = [int(line.split()[-2]) for line in out.splitlines()]
    assert len(edges) == 2 and min(edges) > 1000


# Suites that drive the core only through its public calls (the others replace its functions, hand it
# stand-ins where it names a class, or assert a refusal's wording: compiled, an argument of the wrong
# type is refused by the call's signature, before its own check names it).
SUITES = ("test_stateful.py", "test_items.py", "test_regions.py", "test_ring.py", "test_arena.py", "test_writes.py",
          "test_tombstones.py", "test_late_frames.py", "test_trust.py")


def test_the_suites_that_drive_the_core_by_its_calls_pass_on_the_compiled_core(tree):
    # the suites import the core as users do; a compiled module there is the one they drive
    out = _run(tree, f"""
        import sys, pytest
        from epd_ring.executor.tools.bench import compiled_core
        assert "staging" in compiled_core()
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *[f"tests/{{name}}" for name in {SUITES!r}]]))
    """, timeout=900)
    assert " passed" in out and "failed" not in out


def test_the_bench_measures_the_compiled_core_and_checks_its_bytes(tree):
    out = _run(tree, f"""
        from pathlib import Path
        from epd_ring.executor.tools import bench, seed_bench
        cycle, check = bench.our_cycle(8, 4)
        cycle(300)
        check(300)  # every room succeeded, the arena is as it was, the receiver holds the tower's bytes
        lines, figures = [], {{}}
        seed = {str(SEED)!r}
        bench.run(items=200, sizes=(8,), seed_path=seed if Path(seed).is_file() else None, quiet=True,
                  echo=lines.append, figures=figures)
        print(len(figures["compiled"]))
        print(lines[1])
    """)
    count, line = out.splitlines()[-2:]
    assert int(count) == len(COMPILED) and "compiled" in line


def test_the_main_job_runs_on_the_compiled_core_and_every_byte_it_delivers_is_the_towers(tree):
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-m", "epd_ring", "demo"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # under injected faults: outcomes against injections, delivered bytes against the tower's, no leak
    assert "RESULT: ok" in done.stdout and "extents leaked: 0" in done.stdout
