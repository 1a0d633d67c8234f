"""The mutation pass's configuration (tests/mutation/run_mutmut.sh) says what it means: the tests it
selects and deselects exist, and the lines it leaves alone are wording (help and exception messages),
not behaviour. The pass itself takes hours and is not run here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "mutation" / "run_mutmut.sh"
MUTATED = ("fsm", "executor/core", "models")


@pytest.fixture(scope="module")
def config() -> dict:
    text = SCRIPT.read_text()
    body = text.split("<<'TOML'\n", 1)[1].split("\nTOML\n", 1)[0]
    return tomllib.loads(body)["tool"]["mutmut"]


def mutated_lines():
    for folder in MUTATED:
        for path in sorted((ROOT / folder).glob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                yield f"{path.relative_to(ROOT)}:{n}", line


def test_the_selection_has_the_command_line_spin_and_hostile_edge_suites(config):
    selected = config["pytest_add_cli_args_test_selection"]
    assert {"tests/test_cli.py", "tests/test_spin.py", "tests/test_hostile_edges.py"} <= set(selected)
    assert [f for f in selected if not (ROOT / f).is_file()] == []


def test_every_deselected_test_is_selected_and_exists(config):
    args = config["pytest_add_cli_args"]
    nodes = [args[i + 1] for i, a in enumerate(args) if a == "--deselect"]
    assert nodes
    selected = set(config["pytest_add_cli_args_test_selection"])
    for node in nodes:
        path, name = node.split("::")[:2]
        assert path in selected, node
        name = name.split("[")[0]
        assert re.search(rf"^(def {name}\(|{name} = |class {name}\b)", (ROOT / path).read_text(), re.M), node


def test_help_and_exception_messages_are_left_alone_and_nothing_else(config):
    patterns = [re.compile(p) for p in config["do_not_mutate_patterns"]]

    def skipped(line: str) -> bool:
        return any(p.search(line) for p in patterns)

    helps = [(where, line) for where, line in mutated_lines() if "help=" in line.split("#")[0]]
    assert len(helps) > 20 and [where for where, line in helps if not skipped(line)] == []
    # an exception whose arguments are its message only: the first is a string, or starts the next line
    messages = [(where, line) for where, line in mutated_lines()
                if re.match(r"\s*raise \w+\((f?[\"']|$)", line)]
    assert len(messages) > 50 and [where for where, line in messages if not skipped(line)] == []
    # no other line: an exception that carries data, a call with help= later on, a plain statement
    for line in ['        raise InvalidTransition(self.name, state, event, obj)',
                 '    p.add_argument("--cells", type=count_at_least(1), default=None,',
                 '            self._close(key)', '        log = logging.getLogger("epd_ring")']:
        assert not skipped(line), line
