"""`epd-ring demo --timeline FILE`: an SVG of arena occupancy, coloured by state, failures and quarantines marked."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

from epd_ring.executor.tools.timeline import COLOURS

NS = "{http://www.w3.org/2000/svg}"


def test_timeline_draws_extents_where_they_lie_with_states_failures_and_quarantines(tmp_path):
    out = tmp_path / "run.svg"
    p = subprocess.run([sys.executable, "-m", "epd_ring", "demo", "--rooms", "200", "--extents", "3", "--seed", "2",
                        "--timeline", str(out), "-q"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    root = ET.parse(out).getroot()  # well-formed SVG
    labels = [t.text for t in root.iter(f"{NS}text")]
    assert "arena offset" in labels and "0 B" in labels  # the arena's bytes run down the picture
    fills = {r.get("fill") for r in root.iter(f"{NS}rect")}
    for state in ("free", "sending", "parked", "quarantined"):
        assert COLOURS[state] in fills, state
    tips = [t.text for t in root.iter(f"{NS}title")]
    assert any("room" in t and "sending" in t for t in tips)
    # extents of different sizes: the demo's images are of mixed sizes
    sizes = {t.split("@")[1].split(":")[0].split("+")[1] for t in tips if t.startswith("extent ")}
    assert len(sizes) > 1, sizes
    failures = [e for e in root.iter(f"{NS}path") if e.get("class") == "failure"]
    assert failures and all("failed at" in e.find(f"{NS}title").text for e in failures)
    assert any("quarantine starts" in (lbl or "") for lbl in labels)


def test_timeline_refuses_a_path_it_cannot_write(tmp_path):
    p = subprocess.run([sys.executable, "-m", "epd_ring", "demo", "--timeline", str(tmp_path / "no" / "x.svg")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no such folder" in p.stderr and "Traceback" not in p.stderr
