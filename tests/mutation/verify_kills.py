"""Re-run chosen survivors (and mutants no selected test reached) of a finished mutmut run against
given test files (run in $MUTMUT_WORK).

    cd /tmp/epd-ring-mutmut && python tests/mutation/verify_kills.py PREFIX TEST_FILE...
    ... verify_kills.py --record tests/mutation/pass-record.json.gz PREFIX TEST_FILE...

With --record, the survivors are the record's (tests/mutation/record.py): a pass carried onto a later
commit has not run them again yet, so mutmut's own results do not name them.

Copies the test files into mutants/tests, checks they pass with no mutant active, then runs them
once per such mutant whose name starts with PREFIX, with mutmut's MUTANT_UNDER_TEST set, and prints
killed/survived per mutant and the totals. Each run is forked from one warm process (see
rescore.py), so a mutant costs the tests' own time, not a Python start and a torch import.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rescore import copy_tests, run_child


def record_survivors(record: str, prefix: str) -> list[str]:
    import gzip
    import json

    metas = json.loads(gzip.decompress(Path(record).read_bytes()))["metas"].values()
    return sorted(k for m in metas for k, v in m["exit_code_by_key"].items() if v == 0 and k.startswith(prefix))


def main(prefix: str, files: list[str], record: str | None = None) -> int:
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_source_files

    os.environ.setdefault("EPD_RING_HYPOTHESIS", "mutmut")
    tests = copy_tests(files, Path("mutants/tests"))
    targets = record_survivors(record, prefix) if record else []
    for path in [] if record else walk_source_files():
        m = SourceFileMutationData(path=path)
        m.load()
        targets += [k for k, v in m.exit_code_by_key.items()
                    if status_by_exit_code[v] in ("survived", "no tests") and k.startswith(prefix)]
    os.chdir("mutants")
    sys.path.insert(0, "src")
    import epd_ring.executor  # noqa: F401 - loaded once, shared by every forked run

    if run_child(tests, "", 300.0) != "survived":
        print("the tests fail with no mutant active: not usable against this tree")
        return 2
    killed = 0
    for name in targets:
        verdict = run_child(tests, name, 300.0)
        killed += verdict != "survived"
        print(f"{'killed  ' if verdict != 'survived' else 'survived'} {name}", flush=True)
    print(f"{killed} of {len(targets)} survivors under {prefix!r} killed by {', '.join(tests)}")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    rec = None
    if args[:1] == ["--record"]:
        rec, args = str(Path(args[1]).resolve()), args[2:]
    sys.exit(main(args[0], args[1:], rec))
