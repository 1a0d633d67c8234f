"""A mutmut pass's verdicts, kept in the repository so a later session (on a fresh machine) resumes it.

    python tests/mutation/record.py save $MUTMUT_WORK tests/mutation/pass-record.json.gz
    python tests/mutation/record.py restore tests/mutation/pass-record.json.gz $MUTMUT_WORK

mutmut keeps each file's verdicts in `mutants/<path>.meta`, beside the function hashes it checks
them against; a verdict stands where its function's hash is unchanged. The pass's directory does
not outlive the machine, so `save` gathers every .meta (and the stats mutmut would otherwise
re-run for several minutes) with the commit the pass is over, and `restore` puts them back into an
empty pass directory of the same commit (run_mutmut.sh does it when MUTMUT_RECORD names the file).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path


def save(work: Path, out: Path) -> int:
    metas = {str(p.relative_to(work / "mutants")): json.loads(p.read_text())
             for p in sorted((work / "mutants").rglob("*.meta"))}
    if not metas:
        print(f"no verdicts under {work / 'mutants'}", file=sys.stderr)
        return 2
    record = {"commit": (work / "COMMIT").read_text().strip(), "metas": metas}
    out.write_bytes(gzip.compress(json.dumps(record, sort_keys=True).encode(), mtime=0))
    done = sum(v is not None for m in metas.values() for v in m["exit_code_by_key"].values())
    total = sum(len(m["exit_code_by_key"]) for m in metas.values())
    print(f"{out}: {done} of {total} mutants decided, pass over {record['commit']}")
    return 0


def restore(src: Path, work: Path) -> int:
    record = json.loads(gzip.decompress(src.read_bytes()))
    commit = (work / "COMMIT").read_text().strip()
    if record["commit"] != commit:
        print(f"{src} is a pass over {record['commit']}, not {commit}: not restored", file=sys.stderr)
        return 2
    if any((work / "mutants").rglob("*.meta")):
        print(f"{work / 'mutants'} already holds verdicts: not restored", file=sys.stderr)
        return 2
    for rel, meta in record["metas"].items():
        path = work / "mutants" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta))
    print(f"restored {len(record['metas'])} files' verdicts of the pass over {commit}")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("save", "restore"):
        print(__doc__, file=sys.stderr)
        return 2
    a, b = Path(argv[1]), Path(argv[2])
    return save(a, b) if argv[0] == "save" else restore(a, b)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
