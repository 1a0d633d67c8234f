"""The front page and the docs site: README's commands and example, the pages' links and generated
tables, the diagrams shown, and a strict mkdocs build."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epd_ring.fsm import couplings, tables

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) <= 250


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    assert text.index("```bash") < text.index("## ")  # the commands come before any section
    blocks = [b.strip() for b in fenced(text, "bash")[:2]]
    assert "epd-ring demo" in blocks[0] and "pip install torch==2.13.0" in blocks[0]
    test_cmd = blocks[1].split("&&")[-1].strip()
    assert "pytest" in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_readme_example_runs_as_written():
    (block,) = fenced(README.read_text(), "python")
    assert len(block.splitlines()) <= 30  # a first example, not the whole loop
    ns: dict = {"__name__": "readme_example"}
    with torch.random.fork_rng():  # the toy tower's init draws from torch's RNG; leave other tests' draws alone
        exec(compile(block, str(README), "exec"), ns)
    # the room succeeded: the receiver holds the tower's rows and was told so; the drain was clean
    assert torch.equal(ns["dst"], ns["item"].encoded)
    assert ns["receiver"].statuses(1001) == ["success"]
    assert ns["manager"].room_status(1001) == "success"
    assert ns["executor"].closed  # the drain ran to its end: ring retired, unregistered, transport closed


def test_readme_links_into_docs_and_every_page_is_linked():
    text = README.read_text()
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", text))
    for path in linked:
        assert (ROOT / path).is_file(), path
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md")} - {"docs/index.md"}
    assert pages <= linked, pages - linked


def test_machine_tables_on_the_machines_page_match_the_declarations():
    text = (DOCS / "machines.md").read_text()
    assert tables.BEGIN in text and tables.END in text
    assert tables.refresh(text) == text, "run: python -m epd_ring.fsm.tables --write"


def test_tables_write_refreshes_the_machines_page_by_default(tmp_path):
    page = tmp_path / tables.PAGE
    page.parent.mkdir(parents=True)
    page.write_text(f"# The machines\n\n{tables.BEGIN}\nstale\n{tables.END}\n\nafter\n")
    subprocess.run([sys.executable, "-m", "epd_ring.fsm.tables", "--write"], cwd=tmp_path, check=True)
    assert page.read_text() == f"# The machines\n\n{tables.BEGIN}\n{tables.markdown()}\n{tables.END}\n\nafter\n"


def test_machines_page_lists_the_couplings_table_as_declared():
    # hand-written on the page: every entry of fsm/couplings.py (its actions in order), and nothing else
    text = (DOCS / "machines.md").read_text()
    rows = re.findall(r"^\| (\w+) \| (enters|takes) `(\w+)` \| (.+?) \|$", text, flags=re.M)
    shown = {(m, w, s): tuple(re.findall(r"`(\w+)`", acts)) for m, w, s, acts in rows}
    declared = {(m, "enters", s): acts for (m, s), acts in couplings.ON_ENTER.items()}
    declared |= {(m, "takes", e): acts for (m, e), acts in couplings.ON_EVENT.items()}
    assert len(rows) == len(shown) and shown == declared
    described = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M))
    assert couplings.actions() <= described, couplings.actions() - described


def test_embedding_page_points_at_the_example_and_the_protocol():
    text = (DOCS / "embedding.md").read_text()
    for needle in ("examples/embed.py", "TowerModel", "image_encoder", "get_video_feature",
                   "num_deepstack_embeddings", "separate_deepstack_embeds", "EncodeItem", "ReceiverFrame",
                   "RoomConflict", "print(executor.dump_state())", "pump.close(", "pump.flush()", "pump.tick()"):
        assert needle in text, needle


def test_every_generated_diagram_is_shown_on_a_page():
    shown = set()
    for page in DOCS.glob("*.md"):
        shown |= set(re.findall(r"!\[[^\]]*\]\(diagrams/([^)]+\.svg)\)", page.read_text()))
    drawn = {p.name for p in (ROOT / "diagrams").glob("*.svg")}
    assert drawn and drawn <= shown, drawn - shown
    assert shown <= drawn, shown - drawn  # no picture of a diagram that is not generated


def test_glossary_defines_the_domain_words():
    text = (DOCS / "glossary.md").read_text()
    words = set(re.findall(r"^\| ([a-z_]+) \|", text, flags=re.M))
    assert {"room", "receiver", "session", "identity", "peer", "extent", "arena", "registration", "region", "chunk",
            "lease", "park", "defer", "quarantine", "tombstone", "pin", "drain", "reason"} <= words


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (it comes with the `test` extra)")
def test_site_builds_with_warnings_as_errors(tmp_path):
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(site)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (site / "diagrams" / "extent.svg").is_file()
    assert 'src="../diagrams/extent.svg"' in (site / "machines" / "index.html").read_text()


def test_every_test_the_trust_page_names_exists():
    # docs/trust.md checks each sentence by the test named beside it: a renamed or removed test
    # must not leave a sentence unchecked.
    page = (ROOT / "docs" / "trust.md").read_text()
    named = set(re.findall(r"\b(test_\w+)\b(?!\.py)", page))
    defined = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(), re.M))
    assert len(named) > 40
    assert named - defined == set()
