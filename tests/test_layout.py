"""The layout is the architecture: imports run one way, tools -> drivers -> core -> fsm.

An engine's adapter (executor/connectors/, vLLM's EC connector) sits beside the tools, over the
drivers, and nothing of ours imports it: the engine stays an optional extra.

Read from the source's own import statements (ast), so a new file in the wrong
folder, or a socket opened from the core, fails here before review.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Folder (relative to the repo) -> the package it installs as.
PACKAGES = {"fsm": "epd_ring.fsm", "executor": "epd_ring.executor", "models": "epd_ring.models"}

# Layer of a module, by its dotted name; the facade `epd_ring.executor` itself re-exports the core.
LAYERS = [
    ("epd_ring.executor.connectors", "connectors"),
    ("epd_ring.executor.tools", "tools"),
    ("epd_ring.executor.drivers", "drivers"),
    ("epd_ring.executor.core", "core"),
    ("epd_ring.executor", "core"),
    ("epd_ring.models", "models"),
    ("epd_ring.fsm", "fsm"),
]

ALLOWED = {
    "fsm": {"fsm"},
    "core": {"fsm", "core"},
    "models": {"fsm", "core", "models"},
    "drivers": {"fsm", "core", "drivers"},
    "tools": {"fsm", "core", "drivers", "tools", "models"},
    "connectors": {"fsm", "core", "drivers", "connectors"},
}

# What only the edge may touch: I/O libraries and blocking.
CORE_FORBIDDEN_MODULES = {"zmq", "mooncake", "subprocess", "socket", "threading", "multiprocessing",
                          "asyncio", "selectors", "signal"}
SANS_IO_LAYERS = {"fsm", "core", "models"}


def layer_of(module: str) -> str | None:
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            # `from . import x` names submodules too
            out.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names
                       if layer_of(f"{target}.{alias.name}") and not node.module)
    return out


def sleeps(path: Path) -> list[int]:
    """Lines that call time.sleep (or import sleep from time)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "sleep" and isinstance(node.value, ast.Name)
                and node.value.id == "time"):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "time" and any(a.name == "sleep" for a in node.names):
            lines.append(node.lineno)
    return lines


def violations(root: Path) -> list[str]:
    found = []
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            module = module_name(path, root)
            layer = layer_of(module)
            where = path.relative_to(root)
            for line, target in imports_of(path, module):
                top = target.split(".")[0]
                if layer in SANS_IO_LAYERS and top in CORE_FORBIDDEN_MODULES:
                    found.append(f"{where}:{line}: {layer} code imports {target} (I/O belongs in executor/drivers)")
                target_layer = layer_of(target)
                if target_layer and target_layer not in ALLOWED[layer]:
                    found.append(f"{where}:{line}: {layer} imports {target} ({target_layer}): "
                                 f"imports run tools -> drivers -> core -> fsm")
            if layer in SANS_IO_LAYERS:
                found.extend(f"{where}:{line}: {layer} code calls time.sleep" for line in sleeps(path))
    return found


def test_imports_run_one_way():
    assert violations(ROOT) == []


# Import cycles. Every import statement counts, wherever it stands: at module level, under
# `if TYPE_CHECKING:`, or inside a function. Moving an import into a function or under
# TYPE_CHECKING still leaves the two modules depending on each other; it only hides the cycle
# from the interpreter. Importing `a.b.c` first runs `a/b/__init__.py`; that implicit step is no
# edge (else every package would be in a cycle with its own modules), but an `__init__.py`'s own
# imports are edges like any other.
def project_modules(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for folder in PACKAGES for path in sorted((root / folder).rglob("*.py"))}


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project's modules its import statements name (`from x import y` names `x.y` if a module)."""
    modules = project_modules(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules:
                        edges.add(f"{target}.{alias.name}")
                    elif target in modules:
                        edges.add(target)
        graph[module] = edges - {module}
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """Each set of modules that import one another in a ring (a strongly connected component), sorted."""
    graph = import_graph(root)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return sorted(cycles)


def test_no_module_imports_itself_back():
    assert import_cycles(ROOT) == []
    assert sum(map(len, import_graph(ROOT).values())) > 100  # and the graph is read: the modules import a lot


@pytest.mark.parametrize("a,b", [
    ("from . import b\n", "from .a import X\n"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import Y\n", "from . import a\n"),
    ("import epd_ring.fsm.b\n", "def f():\n    from .a import X\n    return X\n"),
])
def test_a_cycle_is_caught_however_its_imports_are_hidden(tmp_path, a, b):
    root = _tree(tmp_path, {"fsm/__init__.py": "", "fsm/a.py": a, "fsm/b.py": b, "fsm/c.py": "from .a import X\n"})
    assert import_cycles(root) == [["epd_ring.fsm.a", "epd_ring.fsm.b"]]


def test_imports_one_way_and_a_package_importing_its_modules_are_no_cycle(tmp_path):
    root = _tree(tmp_path, {"fsm/__init__.py": "from .a import X\nfrom .b import Y\n", "fsm/a.py": "from .b import Y\n",
                            "fsm/b.py": "from epd_ring.fsm.c import Z\n", "fsm/c.py": "import os\n"})
    assert import_graph(root)["epd_ring.fsm.a"] == {"epd_ring.fsm.b"}
    assert import_cycles(root) == []


# Small parts: no class in fsm/, executor/ or models/ is over this many lines (the class statement to
# its last line, as ast counts them). A class that grows past it is split into parts that own their
# state (see docs/architecture.md), not into mixins.
MAX_CLASS_LINES = 300

# Classes being split right now, each by the change named beside it, which removes its line here.
# Nothing else may be listed: a new or grown class over the limit fails.
OVER_LIMIT_WHILE_SPLIT: dict[str, str] = {}


def class_sizes(root: Path) -> dict[str, int]:
    """Dotted name (nested classes too) -> lines, for every class in the packages."""
    sizes = {}
    for module, path in project_modules(root).items():
        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    name = f"{prefix}.{child.name}"
                    sizes[name] = (child.end_lineno or child.lineno) - child.lineno + 1
                    visit(child, name)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, f"{prefix}.{child.name}")
                else:
                    visit(child, prefix)
        visit(ast.parse(path.read_text(), filename=str(path)), module)
    return sizes


def oversized(root: Path, allowed: dict[str, str]) -> list[str]:
    return sorted(f"{name}: {n} lines (at most {MAX_CLASS_LINES})" for name, n in class_sizes(root).items()
                  if n > MAX_CLASS_LINES and name not in allowed)


def test_no_class_is_over_the_limit():
    assert oversized(ROOT, OVER_LIMIT_WHILE_SPLIT) == []
    sizes = class_sizes(ROOT)
    assert "epd_ring.executor.core.manager.EncodeManager" in sizes and len(sizes) > 50  # and the classes are read


def test_the_allow_list_names_only_classes_still_over_the_limit():
    """Once a listed class is split (or gone), its line goes too: the list never covers a class that grows again."""
    sizes = class_sizes(ROOT)
    stale = [name for name in OVER_LIMIT_WHILE_SPLIT if sizes.get(name, 0) <= MAX_CLASS_LINES]
    assert stale == [], f"{stale} are at most {MAX_CLASS_LINES} lines now (or gone): remove them from the list"


def _class_of(name: str, lines: int, indent: str = "") -> str:
    """A class statement and body of `lines` lines in all."""
    return f"{indent}class {name}:\n" + "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))


def test_a_class_over_the_limit_is_caught_wherever_it_stands(tmp_path):
    root = _tree(tmp_path, {"executor/core/big.py": _class_of("Big", MAX_CLASS_LINES + 1),
                            "models/nested.py": "def f():\n" + _class_of("Inner", MAX_CLASS_LINES + 1, "    "),
                            "fsm/ok.py": _class_of("AtTheLimit", MAX_CLASS_LINES)})
    found = oversized(root, {})
    assert [f.split(":")[0] for f in found] == ["epd_ring.executor.core.big.Big", "epd_ring.models.nested.f.Inner"]
    assert oversized(root, {"epd_ring.executor.core.big.Big": "being split"}) == [found[1]]


# The top level, as the design card this project was built from names it, and what stands beside it:
# the docs site, the examples, the `epd_ring` namespace's `__main__`, CI's scripts, front page, licence,
# and setup.py (the compiled core's build: setuptools takes extensions made at build time only from it).
CARD_TOP = {"fsm/", "executor/", "models/", "tests/", "diagrams/", "pyproject.toml"}
BESIDE_TOP = {"docs/", "examples/", "epd_ring/", ".ci/", "mkdocs.yml", "README.md", "LICENSE", ".gitignore",
              "setup.py"}


def top_level(root: Path) -> set[str] | None:
    """The tracked entries at the top of the checkout, folders with a trailing slash (None outside git)."""
    p = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True)
    if p.returncode != 0:
        return None
    return {name.split("/")[0] + ("/" if "/" in name else "") for name in p.stdout.decode().split("\0") if name}


def test_the_top_level_is_the_cards():
    found = top_level(ROOT)
    if found is None:
        pytest.skip("not a git checkout: what is tracked is unknown")
    assert found == CARD_TOP | BESIDE_TOP
    assert (ROOT / "diagrams" / "room.svg").is_file() and not (ROOT / "docs" / "diagrams").exists()


def test_every_folder_says_what_lives_there():
    for init in [ROOT / "executor/__init__.py", *sorted((ROOT / "executor").glob("*/__init__.py"))]:
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 20, f"{init.relative_to(ROOT)} needs a docstring saying what lives there"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for folder in PACKAGES:
        (tmp_path / folder).mkdir(exist_ok=True)
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


@pytest.mark.parametrize("rel,text,needle", [
    ("executor/core/bad.py", "import zmq\n", "imports zmq"),
    ("executor/core/bad.py", "import socket\n", "imports socket"),
    ("executor/core/bad.py", "import time\ntime.sleep(1)\n", "time.sleep"),
    ("executor/core/bad.py", "from ..drivers.mooncake import load_engine\n", "core imports epd_ring.executor.drivers"),
    ("executor/core/bad.py", "from epd_ring.executor.tools import cli\n", "core imports epd_ring.executor.tools"),
    ("executor/drivers/bad.py", "from ..tools.demo import run\n", "drivers imports epd_ring.executor.tools"),
    ("fsm/bad.py", "from epd_ring.models.spec import Spec\n", "fsm imports epd_ring.models"),
    ("models/bad.py", "import threading\n", "imports threading"),
    ("models/bad.py", "from epd_ring.executor.drivers import control\n", "models imports epd_ring.executor.drivers"),
    ("executor/core/bad.py", "from epd_ring.executor.connectors.vllm import EpdRingConnector\n",
     "core imports epd_ring.executor.connectors"),
    ("executor/drivers/bad.py", "from ..connectors import vllm\n", "drivers imports epd_ring.executor.connectors"),
    ("executor/tools/bad.py", "from ..connectors.vllm import Room\n", "tools imports epd_ring.executor.connectors"),
    ("executor/connectors/bad.py", "from ..tools.demo import run\n", "connectors imports epd_ring.executor.tools"),
])
def test_a_file_in_the_wrong_place_is_caught(tmp_path, rel, text, needle):
    found = violations(_tree(tmp_path, {rel: text}))
    assert any(needle in v for v in found), found


def test_allowed_directions_pass(tmp_path):
    root = _tree(tmp_path, {
        "executor/tools/ok.py": "from ..drivers.control import X\nfrom epd_ring.models.spec import Spec\n",
        "executor/drivers/ok.py": "import zmq\nimport threading\nfrom ..core.frames import F\n",
        "executor/core/ok.py": "from epd_ring.fsm import ROOM\nfrom .ring import Ring\nimport time\ntime.monotonic()\n",
        "models/ok.py": "from epd_ring.executor.core import EncodeExecutor\n",
        "executor/connectors/ok.py": "import zmq\nfrom ..drivers.mooncake import load_engine\n"
                                     "from ..core import Pump\n",
    })
    assert violations(root) == []


# Old words on purpose below, to the end marker (issue 32's rename script leaves these lines alone).
# One word per concept (docs/glossary.md, issue 32): the ring's pieces are extents, never slots. What
# may still say "slot" in the packages, and why; anything else fails, wherever it stands (identifier,
# docstring, comment, help text, generated Promela).
OLD_WORD = re.compile(r"(?i)slot")
OLD_WORD_ALLOWED = {
    r"__slots__": "Python's own",
    r"\bslots=True\b": "dataclass(slots=True), Python's own",
    r"(?i)ring_slots": "the seed's EncodeExecutor argument (and setting), kept so seed code runs unchanged",
    r"TOKENSPEED_EPD_[A-Z_]*SLOT[A-Z_]*": "the seed's environment variables (seed_bench stands in for them)",
}
OLD_WORD_LINES_ALLOWED = {
    r"(?i)deprecated": "an old name kept one release as a deprecated alias (demo --slots, demo.run(slots=))",
}
# `epd-ring check --slots` was removed at issue 20; its refusal names the flag the user typed.
OLD_WORD_LINES_ALLOWED_IN = {"models/check.py": (r'"--slots"', r'"slots"', r"--slots is gone",
                                                 r"a slot per item is --sizes 1", r"ring was slots once")}


def old_words(root: Path) -> list[str]:
    found = []
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(root).as_posix()
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if any(re.search(p, line) for p in (*OLD_WORD_LINES_ALLOWED, *OLD_WORD_LINES_ALLOWED_IN.get(rel, ()))):
                    continue
                for p in OLD_WORD_ALLOWED:
                    line = re.sub(p, "", line)
                if OLD_WORD.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    return found


def test_the_packages_say_extent_not_slot():
    assert old_words(ROOT) == []


def test_an_old_word_is_caught_and_the_allowed_ones_pass(tmp_path):
    root = _tree(tmp_path, {
        "executor/core/bad.py": "def lease_slot(n):\n    '''A free Slot.'''\nFREE_SLOTS = 1\nx.by_slot = 2\n",
        "models/ok.py": "class A:\n    __slots__ = ()\ndef f(ring_slots=1):  # the seed's\n    pass\n",
        "executor/tools/ok.py": "p.add_argument('--slots', dest='extents')  # deprecated alias\n",
        "models/check.py": 'p.add_argument("--slots", type=int)\n',
        "fsm/bad.py": 'p.add_argument("--slots", type=int)\n',  # allowed in models/check.py only
    })
    assert sorted(f.split(":")[0:2] for f in old_words(root)) == [
        ["executor/core/bad.py", "1"], ["executor/core/bad.py", "2"], ["executor/core/bad.py", "3"],
        ["executor/core/bad.py", "4"], ["fsm/bad.py", "1"]]


def test_the_models_event_for_serving_deferred_sends_is_not_the_shutdowns_word():
    from epd_ring.models import liveness, promela

    assert "serve" in promela.EVENTS and "drain" not in promela.EVENTS
    fair = {name for _, events in liveness.FAIRNESS.values() for name in events}
    assert "serve" in fair and "drain" not in fair
# old words end
