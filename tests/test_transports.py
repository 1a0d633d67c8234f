"""The engine is chosen by name (`make_transport`), as a deployment's configuration names it."""

from __future__ import annotations

import os

import pytest

import epd_ring.executor as ex
from epd_ring.executor.drivers.transports import TRANSPORTS, make_transport


def test_a_name_no_engine_answers_to_is_refused():
    for kind in ("rdma", "", "Mooncake"):
        with pytest.raises(ValueError):
            make_transport(kind)


def test_each_engine_is_public_and_built_by_its_name():
    assert TRANSPORTS == ("mooncake", "nixl")
    assert "NixlTransport" in ex.__all__ and "make_transport" in ex.__all__
    if not os.environ.get("EPD_RING_REQUIRE_NIXL"):
        pytest.importorskip("nixl_cu12")
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    transport = make_transport("nixl")
    try:
        assert isinstance(transport, ex.NixlTransport)
    finally:
        transport.close()
