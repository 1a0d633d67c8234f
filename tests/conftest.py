"""Hypothesis profiles: `ci` (default) is derandomized and bounded; `deep` explores far more.

Select with EPD_RING_HYPOTHESIS=deep (or ci). Also the fixtures that cost seconds and are
shared by every test of a run that needs them (the wheel, built and installed once; the model's
explorations, each configuration explored once).
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, max_examples=400, stateful_step_count=50,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.register_profile(
    "deep", deadline=None, max_examples=2000, stateful_step_count=150,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
# The mutation runner needs the first falsifying example fast, not the smallest one.
settings.register_profile("mutants", settings.get_profile("ci"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
# mutmut's runs: the stateful suites on a few examples, as one fast detector among the unit tests.
settings.register_profile("mutmut", settings.get_profile("mutants"), max_examples=40)
# The same, from random seeds: how robustly the suite kills each mutant.
settings.register_profile("mutants-random", settings.get_profile("mutants"), derandomize=False)
settings.load_profile(os.environ.get("EPD_RING_HYPOTHESIS", "ci"))

# Injected faults log errors on purpose; keep test output readable.
logging.getLogger("epd_ring").setLevel(logging.CRITICAL)

# The mutation runner imports a patched copy of the tree; make sure that is what runs.
_expect = os.environ.get("EPD_RING_EXPECT_ROOT")
if _expect:
    import epd_ring.executor

    assert epd_ring.executor.__file__.startswith(_expect), (
        f"expected the mutant tree at {_expect}, imported {epd_ring.executor.__file__}")


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory) -> tuple[Path, Path]:
    """(the project's wheel, a folder it is pip-installed into): built once per run, for the
    tests that look inside it or run it from outside the source tree."""
    where = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(where / "dist"), str(ROOT)], check=True)
    wheel = next((where / "dist").glob("epd_ring-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(where / "site"),
                    str(wheel)], check=True)
    return wheel, where / "site"


@pytest.fixture(scope="session")
def explored():
    """`explore(cfg, symmetry=...)`, each (configuration, symmetry) explored once per run: several
    tests read the same space (the unreduced ones take tens of seconds). The results are read,
    never changed."""
    from epd_ring.models.explore import explore

    @functools.cache
    def run(cfg, *, symmetry: bool = True):
        return explore(cfg, symmetry=symmetry)

    return run


@pytest.fixture
def side():
    """`side(**kw)`: a control plane with its own sockets (test_control_edges.Side), closed after the
    test; used by the control plane's edge tests and the hostile-edge tests."""
    from test_control_edges import Side

    sides = []

    def make(**kw):
        sides.append(Side(**kw))
        return sides[-1]

    yield make
    for s in sides:
        s.close()


def pytest_collection_modifyitems(config, items):
    """Under mutmut (tests/mutation/run_mutmut.sh), which runs each mutant's tests with -x: the model's
    suites run after the unit tests for a mutant outside models/, and SPIN (seconds to compile) after
    the explorer for every mutant, so a mutant killed early never pays for them."""
    mutant = os.environ.get("MUTANT_UNDER_TEST")
    if mutant:
        models = mutant.startswith("epd_ring.models.")
        # then the quickest first: a mutant is killed by its first failing test
        items.sort(key=lambda item: (not models and item.path.name in _MODEL_SUITES, "spin" in item.nodeid.lower(),
                                     _DURATIONS.get(item.nodeid, 0.0)))


def pytest_collection_finish(session):
    """Under mutmut, whose fork server collects the tests once and forks a child for each mutant: every
    object alive now leaves the cyclic collector's reach. A child's collections would otherwise walk the
    whole warm heap (torch, the test modules), writing to every page of it; frozen, a child collected
    its tests in a quarter of the time (0.25 s, not 0.9 s, for a core function's 210 tests)."""
    if "mutmut" in sys.modules:
        gc.freeze()


def _stats_durations() -> dict[str, float]:
    """Each test's time in mutmut's stats run: mutmut runs the tests from its mutants/ folder, where the
    stats are kept (nowhere else is there such a file). Read when this file is imported, which mutmut's
    fork server does before it forks: every mutant shares the one reading."""
    try:
        return json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return {}


_DURATIONS = _stats_durations()


_MODEL_SUITES = frozenset({"test_model.py", "test_model_pins.py", "test_model_channels.py", "test_model_invariants.py",
                           "test_liveness.py", "test_conformance.py", "test_couplings.py"})


def pytest_terminal_summary(terminalreporter):
    """The figures tests measured (`("figure", line)` in a report's user_properties), one section."""
    lines = [value for reports in terminalreporter.stats.values() for rep in reports
             if getattr(rep, "when", None) == "teardown" for key, value in getattr(rep, "user_properties", ())
             if key == "figure"]
    if lines:
        terminalreporter.section("figures")
        for line in lines:
            terminalreporter.write_line(line)


_HOGS: list[subprocess.Popen] = []


def pytest_configure(config):
    """EPD_RING_HOGS=N: N processes that each spin one core for the whole run, started once (by the
    controller, not by each xdist worker), so the suite can be run as a loaded machine runs it. A
    verdict that changes under them is a test that depends on the machine's pace (docs/testing.md)."""
    if not hasattr(config, "workerinput") and "mutmut" not in sys.modules and not os.environ.get("MUTANT_UNDER_TEST"):
        import compiled_build

        if compiled_build.selected(config.args):
            compiled_build.start()  # beside the other tests, not after them (tests/compiled_build.py)
    n = int(os.environ.get("EPD_RING_HOGS", "0") or 0)
    if n and not hasattr(config, "workerinput"):
        spin = "while True: pass"
        _HOGS.extend(subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n))


def pytest_unconfigure(config):
    for hog in _HOGS:
        hog.kill()
        hog.wait()
    _HOGS.clear()


def pytest_report_header(config):
    if _HOGS:
        return f"EPD_RING_HOGS: {len(_HOGS)} CPU hogs running beside the tests"
    return None
