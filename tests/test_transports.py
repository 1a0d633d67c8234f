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


def test_a_closed_metadata_server_lets_its_port_go_and_serves_nobody_after():
    import socket

    from epd_ring.executor.drivers.nixl import MetadataServer

    server = MetadataServer("127.0.0.1", b"body", timeout_s=0.5)
    host, port = server.address.rsplit(":", 1)
    server.close()
    again = socket.socket()
    try:
        again.bind((host, int(port)))  # EADDRINUSE while the accept thread still held the socket
    finally:
        again.close()
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=5):
        pass


def test_a_flood_of_clients_that_never_send_gets_a_bounded_number_of_answer_threads():
    import socket
    import threading

    from epd_ring.executor.drivers.nixl import MetadataServer

    before = threading.active_count()
    server = MetadataServer("127.0.0.1", b"body", timeout_s=30, max_answers=4)
    host, port = server.address.rsplit(":", 1)
    clients = [socket.create_connection((host, int(port)), timeout=5) for _ in range(40)]
    try:
        # the accept thread has taken every connection once the last is turned away or answered
        turned_away = 0
        for c in clients[4:]:
            c.settimeout(30)
            turned_away += c.recv(1) == b""
        assert turned_away == 36
        assert threading.active_count() <= before + 1 + 4
    finally:
        for c in clients:
            c.close()
        server.close()


def test_an_agent_name_another_session_holds_or_is_adding_is_refused():
    import base64
    import json

    if not os.environ.get("EPD_RING_REQUIRE_NIXL"):
        pytest.importorskip("nixl_cu12")
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from epd_ring.executor.drivers import nixl

    body = json.dumps({"engine": nixl.ENGINE, "agent": "agent-x", "buffers": [4096],
                       "metadata": base64.b64encode(b"meta").decode()}).encode()
    transport = nixl.NixlTransport()
    try:
        transport.fetch = lambda session, timeout: body
        transport._claims["agent-x"] = "10.0.0.1:1"  # another connector thread is adding it for its session
        ok, _, _ = transport._contact("10.0.0.2:2")
        assert not ok and transport.stats["adds_failed"] == 0  # refused before any add was tried
        del transport._claims["agent-x"]
        transport._names["10.0.0.1:1"] = "agent-x"  # and once it is added
        ok, _, _ = transport._contact("10.0.0.2:2")
        assert not ok and transport.stats["adds_failed"] == 0 and "10.0.0.2:2" not in transport._names
    finally:
        transport.close()
