"""List the mutants left alive (survived, or reached by no selected test) that are not claimed
equivalent, with their one-line change, grouped by function (run in $MUTMUT_WORK).

    cd /tmp/epd-ring-mutmut && python /path/to/tests/mutation/survivors.py > survivors.txt
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_source_files


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rescore import equivalent_names

    equivalent = equivalent_names()
    counts = collections.Counter()
    groups = collections.defaultdict(list)
    for path in walk_source_files():
        m = SourceFileMutationData(path=path)
        m.load()
        for name, code in m.exit_code_by_key.items():
            status = "equivalent" if name in equivalent else status_by_exit_code[code]
            counts[status] += 1
            if status not in ("survived", "no tests"):
                continue
            diff = get_diff_for_mutant(name, path=m.path)
            minus = [l[1:].strip() for l in diff.splitlines() if l.startswith("-") and not l.startswith("---")]
            plus = [l[1:].strip() for l in diff.splitlines() if l.startswith("+") and not l.startswith("+++")]
            func = re.sub(r"__mutmut_\d+$", "", name)
            groups[func].append((name.rsplit("_", 1)[-1] + ("" if status == "survived" else " (no tests)"),
                                 " / ".join(minus)[:110], " / ".join(plus)[:110]))
    print(f"# {dict(counts)}")
    for func in sorted(groups):
        print(f"\n## {func} ({len(groups[func])})")
        for n, a, b in groups[func]:
            print(f"- {n}: `{a}` -> `{b}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
