"""A mutmut pass's verdicts, kept in the repository so a later session (on a fresh machine) resumes it.

    python tests/mutation/record.py save $MUTMUT_WORK tests/mutation/pass-record.json.gz
    python tests/mutation/record.py restore tests/mutation/pass-record.json.gz $MUTMUT_WORK [--carry]

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
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import tomllib

# mutmut's exit codes for the verdicts score.py counts killed (killed, timeout, segfault): written out, not
# read from mutmut, since CI checks this file without mutmut installed (test_mutation_config.py compares
# them with mutmut's own table where it is)
KILLED = {1, 3, 36, -24, 24, 152, 255, -11, -9}


def _selection(work: Path) -> dict:
    config = tomllib.loads((work / "pyproject.toml").read_text())["tool"]["mutmut"]
    args = config.get("pytest_add_cli_args", [])
    return {"files": sorted(config.get("pytest_add_cli_args_test_selection", [])),
            "deselected": sorted(b for a, b in zip(args, args[1:]) if a == "--deselect")}


def save(work: Path, out: Path) -> int:
    metas = {str(p.relative_to(work / "mutants")): json.loads(p.read_text())
             for p in sorted((work / "mutants").rglob("*.meta"))}
    if not metas:
        print(f"no verdicts under {work / 'mutants'}", file=sys.stderr)
        return 2
    record = {"commit": (work / "COMMIT").read_text().strip(), "selection": _selection(work), "metas": metas}
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
        then, now = record["selection"], _selection(work)
        lost = sorted(set(then["files"]) - set(now["files"])) + sorted(set(now["deselected"]) - set(then["deselected"]))
        if lost:
            print(f"not carried: tests that ran in the pass over {record['commit']} no longer run: {lost}",
                  file=sys.stderr)
            return 2
    kept = 0
    for rel, meta in record["metas"].items():
        if carry:
            codes = meta["exit_code_by_key"]
            meta["exit_code_by_key"] = {k: (v if v in KILLED else None) for k, v in codes.items()}
        kept += sum(v is not None for v in meta["exit_code_by_key"].values())
        path = work / "mutants" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta))
    print(f"restored {kept} verdicts of the pass over {record['commit']}" + (f" onto {commit}" if carry else ""))
    return 0


def main(argv: list[str]) -> int:
    carry = "--carry" in argv
    argv = [a for a in argv if a != "--carry"]
    if len(argv) != 3 or argv[0] not in ("save", "restore") or (carry and argv[0] == "save"):
        print(__doc__, file=sys.stderr)
        return 2
    a, b = Path(argv[1]), Path(argv[2])
    return save(a, b) if argv[0] == "save" else restore(a, b, carry)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
