"""Re-check a finished mutmut run's survivors against tests written after it, and give the score.

    cd $MUTMUT_WORK && python /path/to/tests/mutation/rescore.py [--write] TEST_FILE...

A full mutmut run takes about 40 minutes on two cores; tests written for its survivors only need
to be run against those survivors. For each mutant the run left "survived" or "no tests", this
forks a child of one warm process (torch and the package imported once), switches the mutant on
with mutmut's MUTANT_UNDER_TEST and runs the given test files with pytest -x; a failing test (or a
crash, or a hang past --timeout) kills it. The files are copied into mutants/tests first and must
pass with no mutant active.

It prints killed / all mutants of the functions re-checked (no equivalents set aside: those are
keyed by diff and applied by tests/mutation/score.py). With --write, the new verdicts go into
mutmut's own result files, so `mutmut results` and `score.py --list` show what is left. A recorded
score is one pass's (score.py after run_mutmut.sh), never a run plus re-checks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# mutmut's verdicts that count as killed: a test failed, the mutant hung, or it crashed the process
KILLED = ("killed", "timeout", "segfault")


def equivalent_names() -> set[str]:
    """Claims keyed by mutmut's index: none any more (equivalent.md keys them by diff)."""
    return set()


def copy_tests(files: list[str], dest: Path) -> list[str]:
    """Copy test files into the staging tree's tests/ (as tests/NAME), with the shared rigs they
    import (tests/helpers.py beside them), which may be newer than the staged copy."""
    names = []
    for f in files:
        shutil.copy(f, dest / Path(f).name)
        names.append(f"tests/{Path(f).name}")
    for rigs in {Path(f).resolve().parent / "helpers.py" for f in files}:
        if rigs.exists():
            shutil.copy(rigs, dest / "helpers.py")
    return names


def start_child(files: list[str], mutant: str) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.environ["MUTANT_UNDER_TEST"] = mutant
            import pytest

            code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *files])
        except BaseException:
            code = 99
        os._exit(int(code))
    return pid


def verdict_of(status: int) -> str:
    if os.WIFSIGNALED(status):
        return "killed"  # a crash under the mutant
    return "killed" if os.WEXITSTATUS(status) != 0 else "survived"


def run_many(work: list[tuple[str, list[str]]], timeout: float, jobs: int, report=None) -> dict[str, str]:
    """Run (mutant, test files) pairs, `jobs` at a time; a verdict per mutant."""
    verdicts: dict[str, str] = {}
    todo = list(reversed(work))
    running: dict[int, tuple[str, float]] = {}
    while todo or running:
        while todo and len(running) < jobs:
            name, files = todo.pop()
            running[start_child(files, name)] = (name, time.monotonic() + timeout)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid and pid in running:
            name, _ = running.pop(pid)
            verdicts[name] = verdict_of(status)
        else:
            now = time.monotonic()
            for pid, (name, deadline) in list(running.items()):
                if now > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    running.pop(pid)
                    verdicts[name] = "timeout"
            if not pid:
                time.sleep(0.005)
            continue
        if report:
            report(name, verdicts[name])
    return verdicts


def run_child(files: list[str], mutant: str, timeout: float) -> str:
    return run_many([(mutant, files)], timeout, 1)[mutant]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="test files written after the run")
    ap.add_argument("--write", action="store_true", help="record the new verdicts in mutmut's results")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds before a mutant counts as hung (generous: a loaded machine is slow, not hung)")
    ap.add_argument("--deselect", action="append", default=[], metavar="NODEID",
                    help="leave out a test, e.g. one that tests a fix made after the run (repeatable)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants checked at once")
    ap.add_argument("--route", action="append", default=[], metavar="PREFIX=FILE[,FILE]",
                    help="try these test files first for mutants under PREFIX; the ones they leave alive "
                         "are then run against every file (repeatable)")
    ap.add_argument("--prefix", default="", help="only re-check mutants whose name starts with this")
    ap.add_argument("--json", metavar="FILE", help="write the totals and the names still alive as JSON")
    args = ap.parse_args()

    os.environ.setdefault("EPD_RING_HYPOTHESIS", "mutmut")
    os.chdir("mutants")
    sys.path.insert(0, "src")
    os.environ["EPD_RING_EXPECT_ROOT"] = str(Path("src").resolve())
    tests = copy_tests(args.files, Path("tests"))
    for nodeid in args.deselect:
        tests += ["--deselect", nodeid]

    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_source_files

    import epd_ring.executor  # noqa: F401 - warm the children: torch and the package load once

    if run_child(tests, "", args.timeout) != "survived":
        print("the tests fail with no mutant active: not usable against this tree (see which with "
              f"`cd mutants && python -m pytest {' '.join(tests)}`; --deselect tests of later fixes)")
        return 2

    equivalent = equivalent_names()
    totals: dict[str, int] = {}
    rechecked = {"killed": 0, "timeout": 0, "survived": 0}
    alive = []
    os.chdir("..")
    datas = []
    for path in walk_source_files():
        m = SourceFileMutationData(path=path)
        m.load()
        datas.append(m)
    os.chdir("mutants")
    targets = [name for m in datas for name, code in m.exit_code_by_key.items()
               if name not in equivalent and name.startswith(args.prefix)
               and code is not None and status_by_exit_code[code] in ("survived", "no tests")]
    routes = []
    for r in args.route:
        prefix, _, names = r.partition("=")
        routes.append((prefix, [t for t in tests if Path(t).name in {Path(n).name for n in names.split(",")}]))

    def first_files(name: str) -> list[str]:
        for prefix, files in routes:
            if name.startswith(prefix) and files:
                return files + [t for i, t in enumerate(tests) if t == "--deselect" or
                                (i and tests[i - 1] == "--deselect")]
        return tests

    def report(name, verdict):
        print(f"{verdict:8} {name}", flush=True)

    verdicts = run_many([(n, first_files(n)) for n in targets], args.timeout, args.jobs)
    again = [(n, tests) for n in targets if verdicts[n] == "survived" and first_files(n) != tests]
    verdicts.update(run_many(again, args.timeout, args.jobs))
    for name in targets:
        report(name, verdicts[name])
        rechecked[verdicts[name]] += 1
    for m in datas:
        changed = False
        for name, code in sorted(m.exit_code_by_key.items()):
            status = status_by_exit_code[code] if code is not None else "not checked"
            if name in equivalent:
                continue
            verdict = verdicts.get(name, "survived")
            if verdict != "survived":
                status = "killed" if verdict == "killed" else "timeout"
                if args.write:
                    m.exit_code_by_key[name] = 1 if verdict == "killed" else -24
                    changed = True
            if status not in KILLED:
                alive.append(name)
            totals[status] = totals.get(status, 0) + 1
        if changed:
            os.chdir("..")
            m.save()
            os.chdir("mutants")
    counted = sum(totals.values())
    killed = sum(n for status, n in totals.items() if status in KILLED)
    score = killed / counted if counted else 1.0
    print(f"rechecked {sum(rechecked.values())}: {rechecked}")
    print(f"by status, equivalent ones left out: {totals}")
    print(f"mutants {counted + len(equivalent)}, equivalent {len(equivalent)}, killed {killed}, "
          f"alive {len(alive)}: score {100 * score:.1f}% of the non-equivalent mutants")
    if args.json:
        Path(args.json).write_text(json.dumps({"totals": totals, "equivalent": len(equivalent),
                                               "score": score, "alive": alive}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
