#!/usr/bin/env bash
# Mutation testing of fsm/ and executor/core/ with mutmut 3 and a fast test selection.
#
#   tests/mutation/run_mutmut.sh            # build the staging tree, run every mutant, print the survivors
#   MUTMUT_CHILDREN=1 tests/mutation/run_mutmut.sh
#
# mutmut 3 derives a mutant's module from its path under src/, and our folders install under
# `epd_ring.` (fsm/ -> epd_ring.fsm), so the run happens in a staging copy laid out as
# src/epd_ring/{fsm,executor,models} with the tests beside it. Results stay in $MUTMUT_WORK
# (mutants/, the cache mutmut resumes from); the score and what is alive are printed at the end
# (tests/mutation/score.py), equivalents keyed by diff in tests/mutation/equivalent.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${MUTMUT_WORK:-/tmp/epd-ring-mutmut}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
CHILDREN="${MUTMUT_CHILDREN:-2}"

mkdir -p "$WORK/src/epd_ring"
# refresh sources and tests; keep mutants/ so an interrupted run resumes
rm -rf "$WORK/src/epd_ring/fsm" "$WORK/src/epd_ring/executor" "$WORK/src/epd_ring/models" "$WORK/tests" "$WORK/docs"
cp -a "$ROOT/fsm" "$ROOT/executor" "$ROOT/models" "$WORK/src/epd_ring/"
cp -a "$ROOT/tests" "$WORK/tests"
mkdir -p "$WORK/docs" && cp -a "$ROOT/docs/diagrams" "$WORK/docs/diagrams"  # test_diagrams checks the committed ones
find "$WORK/src" "$WORK/tests" -name __pycache__ -prune -exec rm -rf {} +
: > "$WORK/src/epd_ring/__init__.py"
cat > "$WORK/pyproject.toml" <<'TOML'
[tool.mutmut]
source_paths = ["src/epd_ring/fsm", "src/epd_ring/executor/core"]
also_copy = ["src/epd_ring/__init__.py", "src/epd_ring/executor/__init__.py", "src/epd_ring/executor/drivers",
             "src/epd_ring/executor/tools", "src/epd_ring/models", "docs/diagrams"]
# the unit tests by topic (machines, frames, rooms, tombstones, writes, peers, regions, drain, the
# executor and its items, the ring, the loopback transport, settings, ownership), and the two stateful
# suites on a small hypothesis profile (EPD_RING_HYPOTHESIS=mutmut below); the model suites are too
# slow per mutant. mutmut runs, per mutant, only the selected tests that reach the mutated function.
pytest_add_cli_args_test_selection = ["tests/test_fsm.py", "tests/test_fsm_compile.py", "tests/test_diagrams.py",
                                      "tests/test_frames.py", "tests/test_rooms.py", "tests/test_late_frames.py",
                                      "tests/test_trust.py", "tests/test_tombstones.py", "tests/test_writes.py",
                                      "tests/test_peers.py", "tests/test_regions.py", "tests/test_drain.py",
                                      "tests/test_executor.py", "tests/test_items.py", "tests/test_ring.py",
                                      "tests/test_loopback.py", "tests/test_core_edges.py", "tests/test_settings.py",
                                      "tests/test_defects.py", "tests/test_stateful.py"]
# deselected: a subprocess demo (no mutant reaches it), the 10,000-room bound (2.5 s, and it runs
# for every surviving mutant of the manager) and two graphviz renderings (the freshness check
# below them catches a wrong diagram)
pytest_add_cli_args = ["-p", "no:cacheprovider",
                       "--deselect", "tests/test_drain.py::test_demo_drains_on_sigterm_and_ctrl_c",
                       "--deselect", "tests/test_executor.py::test_senders_and_tombstones_stay_bounded_over_10000_rooms",
                       "--deselect", "tests/test_diagrams.py::test_check_names_stale_files",
                       "--deselect", "tests/test_diagrams.py::test_rendering_is_deterministic"]
# log lines: their wording is not behaviour
do_not_mutate_patterns = ["^\\s*(\\w+\\.)*log\\.(debug|info|warning|error)\\("]
# torch is not fork-safe after import in every setup
process_isolation = "forkserver"
use_git_change_detection = false

[tool.pytest.ini_options]
testpaths = ["tests"]
TOML
cd "$WORK"
export EPD_RING_HYPOTHESIS=mutmut OMP_NUM_THREADS=1
nice -n 10 "$PY" -m mutmut run --max-children "$CHILDREN"
"$PY" "$ROOT/tests/mutation/score.py" --list
