"""Conformance driven from the spec's graph: the implementation walks every edge of the spec at a small
bound, and a core that leaves the spec is caught by the walk."""

from __future__ import annotations

import logging

import pytest

from epd_ring.executor.core import EncodeManager
from epd_ring.models.spec import Config
from epd_ring.models.walk import walk


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.CRITICAL, logger="epd_ring")  # injected tower errors are events here


@pytest.mark.parametrize("cfg", [Config(2, 2, 2, 1, sizes=(1,)), Config(1, 2, 1, 1, peers=True, sizes=(1,))], ids=str)
def test_the_implementation_walks_every_spec_edge(cfg):
    w = walk(cfg)
    print(w.summary())
    assert w.failures == []
    assert w.spec_edges > 1000 and w.edge_coverage >= 0.95 and w.state_coverage >= 0.95


def test_a_core_that_ignores_withdraws_is_caught_by_the_walk(monkeypatch):
    monkeypatch.setattr(EncodeManager, "withdraw", lambda self, room, session: None)
    w = walk(Config(1, 2, 1, 1, sizes=(1,)))
    assert w.failures and all(any(ev[0] == "withdraw" for ev in path) for path, _ in w.failures)
