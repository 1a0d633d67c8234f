"""Mutation check: put back, one at a time, a bug the seed has or had, and run the
stateful suite (`ci` profile) against it. Every mutant must be killed.

    python tests/mutants/run.py            # all mutants
    python tests/mutants/run.py NAME ...   # some of them

Mutants run side by side, one per core (`EPD_RING_MUTANT_JOBS` to change it): each is a process of
its own on a copy of its own.

Each patch is applied to a temporary copy of the tree, which is put first on
PYTHONPATH as the `epd_ring` namespace; the suite checks it really imported that copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SUITE = "tests/test_stateful.py"
PACKAGES = ("fsm", "executor", "models")


def prepare(patch: Path | None) -> tuple[Path, str]:
    tmp = Path(tempfile.mkdtemp(prefix="epd-ring-mutant-"))
    for name in (*PACKAGES, "tests"):
        shutil.copytree(ROOT / name, tmp / name, ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"))
    if patch is not None:
        r = subprocess.run(["patch", "-p1", "--no-backup-if-mismatch", "-s", "-i", str(patch)], cwd=tmp,
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{patch.name} does not apply: {r.stdout}{r.stderr}")
    site = tmp / "_site" / "epd_ring"
    site.mkdir(parents=True)
    for name in PACKAGES:
        (site / name).symlink_to(tmp / name, target_is_directory=True)
    return tmp, str(tmp / "_site")


def run_suite(tmp: Path, site: str, timeout: float) -> tuple[int, str, float]:
    # The `ci` examples without shrinking: the first failure is enough to call a mutant killed.
    profile = os.environ.get("EPD_RING_MUTANT_PROFILE", "mutants")  # mutants-random: from random seeds
    env = dict(os.environ, PYTHONPATH=site, EPD_RING_HYPOTHESIS=profile, EPD_RING_EXPECT_ROOT=str(tmp))
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", SUITE],
                           cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout + r.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as exc:
        return -1, f"timed out after {timeout} s\n{exc.stdout or ''}", time.perf_counter() - t0


INVARIANTS = ("delivered_bytes_are_the_rooms_own", "no_undeclared_transition", "parked_rooms_never_outlive",
              "receivers_of_concluded_rooms_are_told", "records_stay_bounded",
              "writes_only_for_transferring_rooms", "live_senders_find_their_room",
              "receivers_told_one_outcome", "released_regions_take_no_more_writes", "write_deadlines_are_their_value",
              "writes_only_to_peers_that_are_up", "rooms_of_down_peers_are_concluded", "teardown",
              "extent_accounting_adds_up", "unsure_writes_keep_their_bytes", "held_and_parked_bytes_add_up")


def falsifying(output: str, lines: int = 4) -> str:
    """The first rule calls of the falsifying example, or the error if there is none."""
    out = output.splitlines()
    for i, line in enumerate(out):
        if "Falsifying example" in line or "Failing test case" in line:
            steps = []
            for ln in out[i + 1:]:
                text = ln.lstrip("E").strip().lstrip("|").strip()
                if text.startswith("state.") and not text.startswith(tuple(f"state.{n}" for n in INVARIANTS)):
                    steps.append(text.removeprefix("state."))
            error = next((ln.lstrip("E").strip() for ln in out if ln.lstrip("E").strip().startswith(
                ("AssertionError", "KeyError", "StagingError", "InvalidTransition", "epd_ring"))), "")
            return " | ".join(steps[:lines]) + (f"  => {error[:100]}" if error else "")
    for line in out:
        if line.startswith("E ") and ("Error" in line or "assert" in line):
            return line[2:].strip()[:120]
    return out[-1][:120] if out else ""


def main(argv: list[str]) -> int:
    patches = sorted(HERE.glob("*.patch"))
    if argv:
        patches = [p for p in patches if p.stem in argv]
    tmp, site = prepare(None)
    rc, out, secs = run_suite(tmp, site, 600)
    shutil.rmtree(tmp, ignore_errors=True)
    if rc != 0:
        print(f"the unmutated suite fails ({secs:.1f} s); fix that first:\n{out[-3000:]}")
        return 2
    print(f"baseline: the suite passes on the unmutated tree in {secs:.1f} s\n")
    print(f"{'mutant':<40} {'result':<9} {'seconds':>8}  falsifying example (first steps)")

    def check(patch: Path) -> tuple[bool, str]:
        try:
            tmp, site = prepare(patch)
        except RuntimeError as exc:
            return False, f"{patch.stem:<40} {'no-apply':<9} {'':>8}  {exc}"
        rc, out, secs = run_suite(tmp, site, 600)
        shutil.rmtree(tmp, ignore_errors=True)
        killed = rc not in (0, 5)
        return killed, f"{patch.stem:<40} {'killed' if killed else 'SURVIVED':<9} {secs:>8.1f}  {falsifying(out)}"

    survivors = 0
    jobs = int(os.environ.get("EPD_RING_MUTANT_JOBS", os.cpu_count() or 1))
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for killed, line in pool.map(check, patches):  # printed in the patches' order
            survivors += not killed
            print(line, flush=True)
    print(f"\n{len(patches) - survivors} of {len(patches)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
