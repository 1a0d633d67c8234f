"""Re-run chosen survivors (and mutants no selected test reached) of a finished mutmut run against given test files (run in $MUTMUT_WORK).

    cd /tmp/epd-ring-mutmut && python tests/mutation/verify_kills.py PREFIX TEST_FILE...

Copies the test files into mutants/tests, checks they pass with no mutant active, then runs
them once per survivor whose name starts with PREFIX, with mutmut's MUTANT_UNDER_TEST set, and
prints killed/survived per mutant and the totals.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from mutmut.mutation.data import SourceFileMutationData
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_source_files

RUN = ("import sys; sys.path.insert(0, 'src'); import pytest; "
       "sys.exit(pytest.main(['-x', '-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))")


def run(tests: list[str], mutant: str) -> int:
    env = dict(os.environ, MUTANT_UNDER_TEST=mutant)
    return subprocess.run([sys.executable, "-c", RUN, *tests], cwd="mutants", env=env,
                          capture_output=True, text=True).returncode


def main(prefix: str, files: list[str]) -> int:
    tests = []
    for f in files:
        shutil.copy(f, Path("mutants/tests") / Path(f).name)
        tests.append(f"tests/{Path(f).name}")
    if run(tests, "") != 0:
        print("the tests fail with no mutant active: not usable against this tree")
        return 2
    survivors = []
    for path in walk_source_files():
        m = SourceFileMutationData(path=path)
        m.load()
        survivors += [k for k, v in m.exit_code_by_key.items()
                      if status_by_exit_code[v] in ("survived", "no tests") and k.startswith(prefix)]
    killed = 0
    for name in survivors:
        rc = run(tests, name)
        killed += rc != 0
        print(f"{'killed  ' if rc else 'survived'} {name}", flush=True)
    print(f"{killed} of {len(survivors)} survivors under {prefix!r} killed by {', '.join(tests)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
