"""A mutmut pass's verdicts, kept in the repository so a later session (on a fresh machine) resumes it.

    python tests/mutation/record.py save $MUTMUT_WORK tests/mutation/pass-record.json.gz
    python tests/mutation/record.py restore tests/mutation/pass-record.json.gz $MUTMUT_WORK [--carry]
    python tests/mutation/record.py carry $MUTMUT_WORK NEXT_PYPROJECT   # (run_mutmut.sh calls it)

mutmut keeps each file's verdicts in `mutants/<path>.meta`, beside the hash of each function they
were decided on; when it mutates a file again, a verdict stands only where its function's hash is
unchanged. The pass's directory does not outlive the machine, so `save` gathers every .meta with
the commit the pass is over and the selection it ran (the staged pyproject.toml's test files and
deselected tests), and `restore` puts them back into an empty pass directory of the same commit.
mutmut's stats (which tests reach which function) are not kept: a megabyte compressed, against the
few minutes mutmut takes to gather them again.

`--carry` restores onto a pass over a later commit: only kills are kept (a mutant killed then is
killed now if its function is unchanged, which mutmut checks, and no test it ran was taken away,
which this checks: every test file selected then is selected now, and nothing is deselected now
that was not then); every other verdict is set to undecided, so survivors meet today's tests.

`carry` does the same in a pass directory that is still there, before it is staged from a later
commit: mutmut then keeps its stats (only new tests are timed) and the pass goes on where it
was, with every kill of an unchanged function kept. Both keep a survivor whose diff is claimed
equivalent (tests/mutation/equivalent.md) or is a log line (claims.py): no test can kill it, and
running it again costs every test that reaches it. `save` writes each survivor's diff into the
record for that, where mutmut is installed.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
import claims  # the script beside this one (no mutmut needed)

# mutmut's exit codes for the verdicts score.py counts killed (killed, timeout, segfault, and an abort): written
# out, not read from mutmut, since CI checks this file without mutmut installed (test_mutation_config.py
# compares them with mutmut's own table where it is)
KILLED = {1, 3, 36, -24, 24, 152, 255, -11, -9, -6}


def _selection(work: Path) -> dict:
    return _selection_of(work / "pyproject.toml")


def _selection_of(pyproject: Path) -> dict:
    config = tomllib.loads(pyproject.read_text())["tool"]["mutmut"]
    args = config.get("pytest_add_cli_args", [])
    return {"files": sorted(config.get("pytest_add_cli_args_test_selection", [])),
            "deselected": sorted(b for a, b in zip(args, args[1:]) if a == "--deselect")}


def _survivor_diffs(work: Path, metas: dict) -> dict[str, list[str]] | None:
    """Each survivor's diff (lines before, after), read through mutmut where it is installed: what a carry
    needs to keep a survivor no test can kill (`claims.set_aside`). None without mutmut."""
    try:
        from mutmut.mutation.diff_apply import get_diff_for_mutant
    except ImportError:
        return None
    here, out = os.getcwd(), {}
    os.chdir(work)  # mutmut reads the mutants from mutants/<path>
    try:
        for rel, meta in metas.items():
            for name, code in meta["exit_code_by_key"].items():
                if code is not None and code not in KILLED:
                    try:
                        out[name] = list(claims.changed(get_diff_for_mutant(name, path=Path(rel).with_suffix(""))))
                    except Exception:  # no diff read (its file gone): run again when carried
                        continue
    finally:
        os.chdir(here)
    return out


def save(work: Path, out: Path) -> int:
    metas = {str(p.relative_to(work / "mutants")): json.loads(p.read_text())
             for p in sorted((work / "mutants").rglob("*.meta"))}
    if not metas:
        print(f"no verdicts under {work / 'mutants'}", file=sys.stderr)
        return 2
    record = {"commit": (work / "COMMIT").read_text().strip(), "selection": _selection(work), "metas": metas}
    diffs = _survivor_diffs(work, metas)
    if diffs is not None:
        record["survivor_diffs"] = diffs
    out.write_bytes(gzip.compress(json.dumps(record, sort_keys=True).encode(), mtime=0))
    done = sum(v is not None for m in metas.values() for v in m["exit_code_by_key"].values())
    total = sum(len(m["exit_code_by_key"]) for m in metas.values())
    print(f"{out}: {done} of {total} mutants decided, pass over {record['commit']}")
    return 0


def restore(src: Path, work: Path, carry: bool = False) -> int:
    record = json.loads(gzip.decompress(src.read_bytes()))
    commit = (work / "COMMIT").read_text().strip()
    if record["commit"] != commit and not carry:
        print(f"{src} is a pass over {record['commit']}, not {commit}: not restored (--carry keeps its kills)",
              file=sys.stderr)
        return 2
    if any((work / "mutants").rglob("*.meta")):
        print(f"{work / 'mutants'} already holds verdicts: not restored", file=sys.stderr)
        return 2
    if carry:
        lost = _lost(record["selection"], _selection(work))
        if lost:
            print(f"not carried: tests that ran in the pass over {record['commit']} no longer run: {lost}",
                  file=sys.stderr)
            return 2
    kept = 0
    keep = _carried(record.get("survivor_diffs", {}))
    for rel, meta in record["metas"].items():
        if carry:
            meta["exit_code_by_key"] = {k: (v if keep(k, v) else None) for k, v in meta["exit_code_by_key"].items()}
        kept += sum(v is not None for v in meta["exit_code_by_key"].values())
        path = work / "mutants" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta))
    print(f"restored {kept} verdicts of the pass over {record['commit']}" + (f" onto {commit}" if carry else ""))
    return 0


def _lost(then: dict, now: dict) -> list[str]:
    """Tests that ran then and would not now: a file no longer selected, or a test deselected since."""
    return sorted(set(then["files"]) - set(now["files"])) + sorted(set(now["deselected"]) - set(then["deselected"]))


def _carried(diffs: dict[str, list[str]]):
    """Whether a verdict stands when its pass is carried: a kill, or a survivor whose diff (`diffs`)
    no test can kill (claimed equivalent, or a log line)."""
    equivalent = claims.equivalents()

    def keep(name: str, code: int | None) -> bool:
        if code is None or code in KILLED:
            return code is not None
        diff = diffs.get(name)
        return diff is not None and claims.set_aside(name, diff[0], diff[1], equivalent) is not None

    return keep


def carry_here(work: Path, next_pyproject: Path) -> int:
    """Carry the pass in `work` onto the selection in `next_pyproject` (the commit it will be staged
    from next): kills and survivors that no test can kill stay, every other verdict is undecided."""
    lost = _lost(_selection(work), _selection_of(next_pyproject))
    if lost:
        print(f"not carried: tests that ran in the pass in {work} would no longer run: {lost}", file=sys.stderr)
        return 2
    paths = sorted((work / "mutants").rglob("*.meta"))
    metas = {str(p.relative_to(work / "mutants")): json.loads(p.read_text()) for p in paths}
    keep = _carried(_survivor_diffs(work, metas) or {})
    kept = reset = 0
    for path, meta in zip(paths, metas.values()):
        codes = meta["exit_code_by_key"]
        for name, code in codes.items():
            if code is not None and code not in KILLED:
                if keep(name, code):
                    kept += 1
                else:
                    codes[name] = None
                    reset += 1
        path.write_text(json.dumps(meta))
    print(f"carried the pass in {work}: {reset} verdicts to run again, {kept} survivors no test can kill kept")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["carry"] and len(argv) == 3:
        return carry_here(Path(argv[1]), Path(argv[2]))
    carry = "--carry" in argv
    argv = [a for a in argv if a != "--carry"]
    if len(argv) != 3 or argv[0] not in ("save", "restore") or (carry and argv[0] == "save"):
        print(__doc__, file=sys.stderr)
        return 2
    a, b = Path(argv[1]), Path(argv[2])
    return save(a, b) if argv[0] == "save" else restore(a, b, carry)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
