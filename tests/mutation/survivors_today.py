"""Put the recorded survivors (tests/mutation/survivors.md) back into today's source, one at a time,
and run chosen tests against each: triage without a new mutmut pass.

    # 1. with mutmut 3 installed (any venv): find each survivor among today's mutants of its function
    python tests/mutation/survivors_today.py match epd_ring.models.check > /tmp/check.json
    # 2. with the project's venv: write each mutant into the source, run the tests, restore the source
    .venv/bin/python tests/mutation/survivors_today.py run /tmp/check.json -- tests/test_cli.py ...
    # options of run, in this order: --timeout S, --tree DIR (a copy laid out as DIR/{fsm,executor,models},
    # on PYTHONPATH as DIR/..), --warm torch,hypothesis (imported once before forking), --only REGEX (functions)

`match` generates today's mutants of each function named in survivors.md with mutmut's own operators
and keys each by its diff as score.py does (the changed lines, stripped, joined by " / ", cut at 100
characters), so a survivor whose line has moved is still found. Each survivor comes out as one of:
`lost` (no mutant of today's function has that diff: the line changed or went), `unmutated` (today's
`do_not_mutate_patterns` or a `# pragma: no mutate` leaves that line alone) or `mutant` (with the
whole mutated file). `run` writes each `mutant` into its file (or, with --tree DIR, into a copy of the tree laid out as
DIR/{fsm,executor,models}, so that the working tree stays usable meanwhile), runs pytest -x on the given tests in a
child forked from a warm process (no bytecode written, so nothing stale is read back), records
killed / survived / timeout and puts the file back; it prints one line per survivor.
"""

from __future__ import annotations

import json
import os
import re
import sys
from difflib import unified_diff
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from claims import changed  # the script beside this one

ROOT = Path(__file__).resolve().parent.parent.parent
SURVIVORS = ROOT / "tests" / "mutation" / "survivors.md"
ITEM = re.compile(r"^- ([a-z ]+): `(.*)` -> `(.*)`$")


def survivors(prefix: str) -> dict[str, list[tuple[str, str, str]]]:
    out: dict[str, list[tuple[str, str, str]]] = {}
    func = None
    for line in SURVIVORS.read_text().splitlines():
        if line.startswith("## "):
            func = line[3:].rsplit(" (", 1)[0]
            if not func.startswith(prefix + "."):
                func = None
        elif func and (m := ITEM.match(line)):
            out.setdefault(func, []).append((m.group(1), m.group(2), m.group(3)))
    return out


def patterns() -> list[str]:
    import tomllib

    text = (ROOT / "tests" / "mutation" / "run_mutmut.sh").read_text()
    body = text.split("<<'TOML'\n", 1)[1].split("\nTOML\n", 1)[0]
    return tomllib.loads(body)["tool"]["mutmut"]["do_not_mutate_patterns"]


def mutants(path: Path, module: str, pats: list[str]):
    """(key, before, after, mutated file text) of every mutant mutmut makes of `path` today."""
    import libcst as cst
    from mutmut.mutation import pragma_handling
    from mutmut.mutation.file_mutation import create_mutations, deep_replace

    def by_pattern(source: str) -> set[int]:
        return {n for n, line in enumerate(source.splitlines(), 1) if any(re.search(p, line) for p in pats)}

    pragma_handling.get_lines_ignored_by_pattern = by_pattern
    code = path.read_text()
    module_node, mutations, _, _ = create_mutations(str(path), code)
    owner: dict[int, str] = {}
    for child in module_node.body:
        if isinstance(child, cst.FunctionDef):
            owner[id(child)] = f"{module}.x_{child.name.value}"
        elif isinstance(child, cst.ClassDef) and isinstance(child.body, cst.IndentedBlock):
            for m in child.body.body:
                if isinstance(m, cst.FunctionDef):
                    owner[id(m)] = f"{module}.xǁ{child.name.value}ǁ{m.name.value}"
    for mu in mutations:
        func = mu.contained_by_top_level_function
        if func is None or id(func) not in owner:
            continue
        new_func = deep_replace(func, mu.original_node, mu.mutated_node)
        a, b = (cst.Module([f]).code.strip() for f in (func, new_func))
        before, after = changed("\n".join(unified_diff(a.split("\n"), b.split("\n"), lineterm="")))
        yield owner[id(func)], before, after, lambda f=func, n=new_func: module_node.deep_replace(f, n).code


def _norm(text: str) -> str:
    return re.sub(r"\s+", "", text.replace(" / ", ""))


def same_change(old: tuple[str, str], new: tuple[str, str], window: int = 25) -> bool:
    """Is `new` (today's full diff) the mutation `old` (a recorded, maybe cut, diff) on a line that has
    since been rewrapped or extended? The same text up to the change and the same change after it."""
    ob, oa = map(_norm, old)
    nb, na = map(_norm, new)
    p = next((i for i, (x, y) in enumerate(zip(ob, oa)) if x != y), min(len(ob), len(oa)))
    q = next((i for i, (x, y) in enumerate(zip(nb, na)) if x != y), min(len(nb), len(na)))

    def agree(x: str, y: str) -> bool:  # one line may now end sooner (its tail moved to the next line)
        k = min(window, len(x), len(y))
        return x[:k] == y[:k] and (k > 0 or x == y)

    return p == q and ob[:p] == nb[:q] and agree(ob[p:], nb[q:]) and agree(oa[p:], na[q:])


def _edit(before: str, after: str) -> tuple[str, str]:
    b, a = _norm(before), _norm(after)
    p = next((i for i, (x, y) in enumerate(zip(b, a)) if x != y), min(len(b), len(a)))
    s = next((i for i, (x, y) in enumerate(zip(b[::-1], a[::-1])) if x != y or i >= min(len(b), len(a)) - p),
             min(len(b), len(a)) - p)
    return b[max(p - 30, 0):len(b) - s], a[max(p - 30, 0):len(a) - s]


def same_edit(old: tuple[str, str], new: tuple[str, str]) -> bool:
    """The same text removed and put in, with the same 30 characters before it (for a line whose
    tail has changed since); only for a recorded diff that was not cut."""
    return max(map(len, old)) < 100 and _edit(*old) == _edit(*new)


def match(prefix: str) -> list[dict]:
    path = ROOT / (prefix.removeprefix("epd_ring.").replace(".", "/") + ".py")
    today: dict = {}
    full: dict = {}
    for key, before, after, text in mutants(path, prefix, []):
        today.setdefault((key, before[:100], after[:100]), text)
        full.setdefault(key, []).append((before, after))
    selected = {(k, b[:100], a[:100]) for k, b, a, _ in mutants(path, prefix, patterns())}
    rows = []
    for func, items in survivors(prefix).items():
        for status, before, after in items:
            row = {"func": func, "status": status, "before": before, "after": after, "path": str(path)}
            key = (func, before, after)
            if key not in today:  # the line was rewrapped or extended since: the same change on it
                moved = [(b, a) for b, a in full.get(func, []) if same_change((before, after), (b, a))] or [
                    (b, a) for b, a in full.get(func, []) if same_edit((before, after), (b, a))]
                if moved:
                    key = (func, moved[0][0][:100], moved[0][1][:100])
                    row["today"] = [moved[0][0][:100], moved[0][1][:100]]
            text = today.get(key)
            if text is None:
                row["kind"] = "lost"
            elif key not in selected:
                row["kind"] = "unmutated"
            else:
                row["kind"], row["text"] = "mutant", text()
            rows.append(row)
    return rows


def run(rows: list[dict], tests: list[str], timeout: float) -> int:
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ.setdefault("EPD_RING_HYPOTHESIS", "mutmut")
    import pytest  # noqa: F401 - loaded once, before the forks

    originals = {r["path"]: Path(r["path"]).read_text() for r in rows}

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rescore import run_child  # the same forked run verify_kills uses (no mutant switched on here)

    def child() -> str:
        return run_child(tests, "", timeout)

    try:
        if child() != "survived":
            print("the tests fail with no mutant written in: not usable")
            return 2
        counts: dict[str, int] = {}
        for r in rows:
            verdict = r["kind"]
            if verdict == "mutant":
                Path(r["path"]).write_text(r["text"])
                try:
                    verdict = child()
                finally:
                    Path(r["path"]).write_text(originals[r["path"]])
            counts[verdict] = counts.get(verdict, 0) + 1
            print(f"{verdict:9} {r['func']} | `{r['before']}` -> `{r['after']}`", flush=True)
        print(counts)
    finally:
        for p, text in originals.items():
            Path(p).write_text(text)
    return 0


def main(argv: list[str]) -> int:
    if argv[0] == "match":
        json.dump(match(argv[1]), sys.stdout)
        return 0
    if argv[0] == "run":
        rows = json.loads(Path(argv[1]).read_text())
        rest = argv[2:]
        timeout = 120.0
        if rest[:1] == ["--timeout"]:
            timeout, rest = float(rest[1]), rest[2:]
        if rest[:1] == ["--tree"]:  # write the mutants into a copy laid out as DIR/{fsm,executor,models}
            for r in rows:
                r["path"] = str(Path(rest[1]) / Path(r["path"]).relative_to(ROOT))
            rest = rest[2:]
        if rest[:1] == ["--warm"]:  # third-party modules to import once, before forking (never ours)
            for name in rest[1].split(","):
                __import__(name)
            rest = rest[2:]
        only = None
        if rest[:1] == ["--only"]:
            only, rest = rest[1], rest[2:]
        if only:
            rows = [r for r in rows if re.search(only, r["func"])]
        tests = rest[1:] if rest[:1] == ["--"] else rest
        return run(rows, tests, timeout)
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
