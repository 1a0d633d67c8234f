"""One mutmut pass, scored as it ran: every mutant counted once, equivalents keyed by their diff.

    cd $MUTMUT_WORK && python /path/to/tests/mutation/score.py [--list]

A mutant is *killed* (a selected test failed, crashed or hung on it), *alive* (survived, or reached
by no selected test), or set aside because its diff says it changes nothing the project promises:
- a log line (the run's own policy, `do_not_mutate_patterns`; lines logging through a rate-limited
  log, `m.log.warning(`, escaped that pattern in this pass and are set aside by the same rule);
- an entry of tests/mutation/equivalent.md, keyed by the function and the exact line before and
  after (never by mutmut's index, which changes whenever the code above it does).
The score is killed / (killed + alive); the raw score is killed / every mutant decided, nothing set
aside. `--list` prints what is alive, grouped by function;
`--by-package` the same counts for fsm/, executor/core/ and models/ apart (parts of the one pass,
not passes of their own).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_source_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
from claims import changed, equivalents, function_of, set_aside  # the script beside this one

# A crash or a hang is a failed test; "suspicious" (an exit code mutmut does not know) counts alive, but for
# an abort (SIGABRT: the C library stopping a process whose heap the mutant corrupted, as a deepstack
# half memmoved to offset -1 does), a crash that mutmut's table leaves out beside its segfaults.
KILLED = {"killed", "segfault", "timeout"}
ABORT = -6


def main(argv: list[str]) -> int:
    claims = equivalents()
    counts: collections.Counter[str] = collections.Counter()
    by_package: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    alive: dict[str, list[str]] = collections.defaultdict(list)
    for path in walk_source_files():
        data = SourceFileMutationData(path=path)
        data.load()
        package = ".".join(str(data.path).split("/")[2:4]).removesuffix(".py")
        package = package if package.startswith("executor") else package.split(".")[0]
        for name, code in data.exit_code_by_key.items():
            status = "segfault" if code == ABORT else status_by_exit_code[code]
            if status in KILLED:
                verdict = "killed"
            elif status == "not checked":
                verdict = status  # an unfinished run: reported, not scored
            else:
                before, after = changed(get_diff_for_mutant(name, path=data.path))
                verdict = set_aside(name, before, after, claims) or "alive"
                if verdict == "alive":
                    alive[function_of(name)].append(f"{status}: `{before[:100]}` -> `{after[:100]}`")
            counts[verdict] += 1
            by_package[package][verdict] += 1
    scored = counts["killed"] + counts["alive"]
    print(f"mutants: {sum(counts.values())}; " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"score: {counts['killed']} killed of {scored} = {100 * counts['killed'] / max(scored, 1):.1f}%")
    decided = sum(counts.values()) - counts["not checked"]
    print(f"raw: {counts['killed']} killed of {decided} = {100 * counts['killed'] / max(decided, 1):.1f}% "
          f"(nothing set aside)")
    if "--by-package" in argv:
        for package, c in sorted(by_package.items()):
            n, d = c["killed"] + c["alive"], sum(c.values()) - c["not checked"]
            print(f"{package}: {sum(c.values())} mutants, {c['killed']} killed of {n} = "
                  f"{100 * c['killed'] / max(n, 1):.1f}%, raw {100 * c['killed'] / max(d, 1):.1f}% "
                  f"({', '.join(f'{k} {v}' for k, v in sorted(c.items()))})")
    if "--list" in argv:
        for func in sorted(alive):
            print(f"\n## {func} ({len(alive[func])})")
            print("\n".join(f"- {x}" for x in alive[func]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
