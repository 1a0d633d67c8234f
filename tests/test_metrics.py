"""Prometheus metrics: scraped from the endpoint during a demo run, checked against the run's own counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families  # the test extra has it: never skipped

from epd_ring.executor import ReasonKind
from epd_ring.executor.drivers.metrics import REASON_KINDS


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(figures: dict, name: str, **labels) -> float:
    return figures[(name, tuple(sorted(labels.items())))]


def test_metrics_scraped_during_a_run_match_its_outcomes(capsys):
    from epd_ring.executor.tools import demo

    rooms, extents = 1500, 4
    handle: list = []
    done = threading.Event()
    result: list = []

    def run():
        try:
            result.append(demo.run(rooms=rooms, extents=extents, seed=5, json_out=True, metrics_port=0,
                                   metrics_hook=handle.append))
        finally:
            done.set()

    thread = threading.Thread(target=run)
    thread.start()
    mid = []
    try:
        while not done.is_set():
            if handle:
                figures = scrape(handle[0].port)
                concluded = sum(value(figures, "epd_ring_rooms_concluded_total", outcome=o)
                                for o in ("success", "failed"))
                mid.append((concluded, figures))
            time.sleep(0.05)
        thread.join()
        final = scrape(handle[0].port)
    finally:
        thread.join()
        if handle:
            handle[0].close()
    assert result == [0]
    report = json.loads(capsys.readouterr().out)
    # Scraped while the run went on: some rooms concluded, not all; and the gauges said something.
    assert any(0 < c < rooms for c, _ in mid), [c for c, _ in mid]
    assert any(sum(v for (n, _), v in f.items() if n == "epd_ring_extents") > 0 for _, f in mid)
    assert any(value(f, "epd_ring_arena_bytes_in_use", arena="main") > 0 for _, f in mid)
    # At the end the figures are the run's own counts.
    outcomes = report["outcomes"]
    for outcome in ("success", "failed"):
        assert value(final, "epd_ring_rooms_concluded_total", outcome=outcome) == outcomes.get(outcome, 0)
    by_reason = {k: value(final, "epd_ring_room_failures_total", reason=k) for k in REASON_KINDS}
    assert sum(by_reason.values()) == outcomes["failed"]
    assert by_reason["caller"] == 0, by_reason  # every failure the demo provokes is one of ours, with its kind
    assert by_reason["tower"] == report["by_injection"].get("tower_error", {}).get("failed", 0) + \
        report["by_injection"].get("batch_mate", {}).get("failed", 0)
    assert by_reason["park_timeout"] > 0 and by_reason["write_failed"] > 0
    assert value(final, "epd_ring_room_lifetime_seconds_count") == rooms
    assert sum(v for (n, _), v in final.items() if n == "epd_ring_extents") == 0  # every extent came back
    for arena in ("main", "deep"):
        assert value(final, "epd_ring_arena_bytes_in_use", arena=arena) == 0
        assert value(final, "epd_ring_arena_fragmentation", arena=arena) == 0
        assert value(final, "epd_ring_arena_largest_free_bytes", arena=arena) > 0
    assert value(final, "epd_ring_deferred") == 0 and value(final, "epd_ring_parked") == 0
    assert value(final, "epd_ring_writes_in_flight") == 0
    writes = sum(value(final, "epd_ring_writes_reported_total", outcome=o) for o in ("done", "failed", "timed_out"))
    assert value(final, "epd_ring_write_latency_seconds_count") == writes > 0
    assert 0 < value(final, "epd_ring_defer_wait_seconds_count") <= report["deferred_sends"]
    assert value(final, "epd_ring_copy_seconds_count") > 0 and value(final, "epd_ring_park_wait_seconds_count") > 0


def test_failed_rooms_are_counted_by_the_kind_of_their_reason_whatever_its_text():
    from helpers import make_rig

    from epd_ring.executor.drivers.metrics import RingMetrics

    rig = make_rig()
    metrics = RingMetrics(rig.executor).attach()
    rig.open_room(1)
    rig.executor.send_item("r1", object())  # not an item: its room fails, kind `item`
    rig.open_room(2)
    rig.executor.fail_rooms(["r2"], "the engine's own words")  # kind `caller`
    rig.open_room(3, rid="r3")
    rig.executor.execute([("r3", rig.item(2, 3))])
    rig.executor.execute([("r3", rig.item(2, 3))])  # a second item for one room: kind `protocol`
    assert dict(metrics.reasons) == {"item": 1, "caller": 1, "protocol": 1}
    assert set(metrics.reasons) <= set(REASON_KINDS) == {k.value for k in ReasonKind}


def test_demo_metrics_port_flag_serves():
    p = subprocess.run([sys.executable, "-m", "epd_ring", "demo", "--rooms", "40", "--metrics-port", "0", "-q"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith("metrics: http://127.0.0.1:") and p.stderr.strip().endswith("/metrics")


def test_core_does_not_import_prometheus():
    code = ("import sys, epd_ring.executor, epd_ring.executor.core; "
            "assert 'prometheus_client' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
