"""Replay recorded survivors (tests/mutation/survivors.md lines) against today's source and tests.

    python tests/mutation/replay.py ENTRIES_FILE TEST_FILE... [--deselect NODE ...]

ENTRIES_FILE holds lines `module.function - status: `before` -> `after`` (survivors.md's, with the
heading's function put in front). Each mutant's line is found inside its function in today's source,
the function is rebuilt from the mutated module text and its code swapped into the module already
imported, and the tests run in a child forked from this one warm process (no Python start, no torch
import per mutant; the source files are never written). A line that matches the run's
`do_not_mutate_patterns` is reported `policy` (mutmut no longer makes it); one that is gone, `moved`.
Prints `killed`, `survived`, `policy` or `moved` per entry and the totals.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import sys
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[2]
_ENTRY = re.compile(r"^(?P<func>\S+) - (?P<status>[\w ]+): `(?P<before>.*)` -> `(?P<after>.*)`$")


def _patterns() -> list[re.Pattern[str]]:
    text = (ROOT / "tests" / "mutation" / "run_mutmut.sh").read_text()
    toml = text.split("<<'TOML'\n", 1)[1].split("\nTOML\n", 1)[0]
    return [re.compile(p) for p in tomllib.loads(toml)["tool"]["mutmut"]["do_not_mutate_patterns"]]


def _locate(func: str) -> tuple[str, Path, list[str]]:
    """(module name, its file, the qualified name's parts) of mutmut's `pkg.mod.xǁClassǁmethod` or `x_func`."""
    module, _, name = func.rpartition(".")
    # mutmut names a method `xǁClassǁname` and a function `x_` + its name
    parts = name[2:].split("ǁ") if name.startswith("xǁ") else [name[2:]]
    rel = module.removeprefix("epd_ring.").replace(".", "/") + ".py"
    return module, ROOT / rel, parts


def _span(tree: ast.Module, parts: list[str]) -> tuple[int, int] | None:
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in parts:
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = node.body  # type: ignore[attr-defined]
    assert node is not None
    return node.lineno, node.end_lineno  # type: ignore[attr-defined]


def mutate(func: str, before: str, after: str) -> tuple[str, Any] | tuple[str, None]:
    module, path, parts = _locate(func)
    src = path.read_text()
    lines = src.splitlines(keepends=True)
    tree = ast.parse(src)
    span = _span(tree, parts)
    if span is None:
        return "moved", None
    first = before.split(" / ")[0].strip()
    for i in range(span[0] - 1, span[1]):
        if lines[i].strip() == first:
            break
    else:
        return "moved", None
    if any(p.search(lines[i]) for p in PATTERNS):
        return "policy", None
    if " / " in before:
        return "multi-line", None
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = indent + after.strip() + "\n"
    return "ok", (module, parts, "".join(lines), path)


def apply(module: str, parts: list[str], text: str, path: Path) -> None:
    mod = importlib.import_module(module)
    ns: dict[str, Any] = {"__name__": module, "__file__": str(path), "__package__": mod.__package__}
    exec(compile(text, str(path), "exec"), ns)
    new: Any = ns
    old: Any = mod
    for part in parts:
        new = new[part] if isinstance(new, dict) else getattr(new, part)
        old = getattr(old, part)
    old = getattr(old, "__func__", old)
    new = getattr(new, "__func__", new)
    if isinstance(old, property):
        old, new = old.fget, new.fget
    old.__code__ = new.__code__
    old.__defaults__ = new.__defaults__
    old.__kwdefaults__ = new.__kwdefaults__


def run(entry: tuple[str, list[str], str, Path], pytest_args: list[str]) -> str:
    pid = os.fork()
    if pid == 0:
        try:
            apply(*entry)
            import pytest
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            code = pytest.main(pytest_args)
        except BaseException:
            code = 99
        os._exit(int(code))
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return "survived" if code == 0 else "killed"


PATTERNS = _patterns()


def main(argv: list[str]) -> int:
    entries_file, rest = argv[0], argv[1:]
    os.environ.setdefault("EPD_RING_HYPOTHESIS", "mutmut")
    pytest_args = ["-p", "no:cacheprovider", "-q", "-x", "--no-header", *rest]
    import pytest  # noqa: F401
    import torch  # noqa: F401

    import epd_ring.executor  # noqa: F401 - loaded once, shared by every forked run
    totals: dict[str, int] = {}
    for line in Path(entries_file).read_text().splitlines():
        m = _ENTRY.match(line.strip())
        if m is None:
            continue
        verdict, entry = mutate(m["func"], m["before"], m["after"])
        if verdict == "ok":
            try:
                verdict = run(entry, pytest_args)  # type: ignore[arg-type]
            except SyntaxError:
                verdict = "syntax"
        totals[verdict] = totals.get(verdict, 0) + 1
        print(f"{verdict:9s} {line.strip()[:220]}", flush=True)
    print(totals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
