"""epd-ring's EC connector, worker side, between two vLLM engines in two processes over Mooncake
(TCP, 127.0.0.1) with CURVE.

Each engine is vLLM's real v1 Scheduler with the worker connector that vLLM's own
`ensure_ec_transfer_initialized` builds, stepped through vLLM's model-runner mixin (tests/vllm_peer.py):
the producer here, the consumer in a child process. Every item that reaches the consumer's encoder
cache is checked against the producer's by sha256. Receivers that misbehave (killed, stopped, not
allow-listed) are reference receiver processes: each fails only its own request, and every wait is
bounded by a condition's deadline, never by a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["MC_TRANSFER_TIMEOUT"] = "5"  # read when an engine starts: the minimum
os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = "5"
os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = "5"
os.environ.setdefault("UCX_TLS", "tcp")  # the NIXL run: UCX's TCP transport on loopback
os.environ.setdefault("UCX_NET_DEVICES", "lo")

if not os.environ.get("EPD_RING_REQUIRE_VLLM"):
    pytest.importorskip("vllm")
if not os.environ.get("EPD_RING_REQUIRE_MOONCAKE"):
    pytest.importorskip("mooncake.engine")

sys.path.insert(0, str(Path(__file__).parent))
from helpers import wait_stopped
from vllm_peer import HIDDEN, hear

from epd_ring.executor import ReasonKind
from epd_ring.executor.connectors.vllm_worker import item_room
from epd_ring.executor.drivers.control import generate_keypair
from epd_ring.executor.drivers.receiver import ReceiverProcess
from epd_ring.executor.tools.vllm_rig import Engine, digest, encoder_output, make_tiny_blip2, request

# A mixed batch: one or two images a request, 1 to 64 rows each.
BATCH = {"c0": [("i0", 3)], "c1": [("i1", 17), ("i2", 5)], "c2": [("i3", 40)], "c3": [("i4", 1), ("i5", 2)],
         "c4": [("i6", 29)], "c5": [("i7", 8), ("i8", 64)]}
WAIT = 90  # seconds: a bound for conditions that hold in a few on an idle machine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_blip2(tmp_path_factory.mktemp("tiny-blip2"))


@pytest.fixture(scope="module")
def keys():
    return {name: generate_keypair() for name in ("encoder", "consumer", "killed", "silent", "refused")}


@pytest.fixture(scope="module")
def consumer(model):
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "vllm_peer.py"), str(model)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert hear(proc.stdout)["ready"]
    yield proc
    if proc.poll() is None:
        proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
        proc.stdin.flush()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def producer_extra(keys, deepstack: int, allowed: list[str], transport: str = "mooncake") -> dict:
    return {"transport": transport, "secret_key": keys["encoder"][1].decode(),
            "allowed_keys": [keys[n][0].decode() for n in allowed],
            "park_timeout": 3, "write_timeout": 5, "quarantine_s": 1, "drain_timeout": 5,
            "arena_bytes": 4 << 20, "deepstack_levels": deepstack}


def params(endpoint: str, room: int, receiver: bytes | None = None) -> dict:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    out = {"bootstrap_host": host, "bootstrap_port": int(port), "bootstrap_room": room}
    if receiver is not None:
        out["receiver"] = receiver.decode()
    return out


def room_of(rid: str) -> int:
    return 1000 + int(rid.rsplit("c", 1)[1]) if rid.startswith("c") else 5000 + hash(rid) % 1000


def start(consumer, keys, endpoint: str, deepstack: int, requests: list, abort: tuple = (),
          transport: str = "mooncake") -> None:
    extra = {"transport": transport, "secret_key": keys["consumer"][1].decode(),
             "encoder_key": keys["encoder"][0].decode(),
             "load_timeout": 30, "deepstack_levels": deepstack}
    consumer.stdin.write(json.dumps({"cmd": "run", "extra": extra, "requests": requests, "deadline": WAIT,
                                     "abort": list(abort)}) + "\n")
    consumer.stdin.flush()


def answer(consumer) -> dict:
    return hear(consumer.stdout)


def announced(engine: Engine, rooms: list[int]) -> bool:
    manager = engine.connector._producer.manager
    return all(manager.room_status(r) is not None for r in rooms)


@pytest.mark.parametrize(("deepstack", "transport"), [(0, "mooncake"), (2, "mooncake"), (2, "nixl")],
                         ids=["plain", "deepstack", "deepstack-nixl"])
def test_bytes_arrive_equal_in_the_consumers_encoder_cache(model, keys, consumer, deepstack, transport):
    if transport == "nixl" and not os.environ.get("EPD_RING_REQUIRE_NIXL"):
        pytest.importorskip("nixl_cu12")
    producer = Engine(model, "ec_producer", producer_extra(keys, deepstack, ["consumer"], transport))
    engine = type(producer.connector._producer.manager.transport).__name__
    assert engine == {"mooncake": "MooncakeTransport", "nixl": "NixlTransport"}[transport]
    try:
        endpoint = producer.connector.endpoint
        wanted = [(rid, images, params(endpoint, room_of(rid))) for rid, images in BATCH.items()]
        # the consumer's frames first: the producer's items then find their receivers registered
        start(consumer, keys, endpoint, deepstack, wanted, transport=transport)
        rooms = [item_room(room_of(rid), i) for rid, images in BATCH.items() for i in range(len(images))]
        assert producer.run(lambda: announced(producer, rooms), WAIT)
        for rid, images, p in wanted:
            producer.add(request(rid, images, {**p, "receiver": keys["consumer"][0].decode()}))
        assert producer.run(lambda: producer.concluded == set(BATCH) and not producer.connector_busy(), WAIT), (
            producer.concluded, producer.room_failed)
        got = answer(consumer)
    finally:
        producer.close()
    assert got["unfinished"] == [] and got["failed"] == [] and got["regions_left"] == []
    width = HIDDEN * (1 + deepstack)
    expected = {h: digest(encoder_output(h, rows, width)) for images in BATCH.values() for h, rows in images}
    assert got["loaded"] == expected
    assert producer.room_failed == {}


def test_misbehaving_receivers_fail_only_their_requests(model, keys, consumer):
    producer = Engine(model, "ec_producer", producer_extra(keys, 0, ["consumer", "killed", "silent"]))
    encoder_key = keys["encoder"][0]
    procs = {name: ReceiverProcess(producer.connector.endpoint, encoder_key=encoder_key, keypair=keys[name])
             for name in ("killed", "silent", "refused")}
    try:
        endpoint = producer.connector.endpoint
        healthy = {rid: BATCH[rid] for rid in ("c0", "c1", "c2")}
        # the consumer engine also waits on a room nobody encodes: its request alone fails
        wanted = [(rid, images, params(endpoint, room_of(rid))) for rid, images in healthy.items()]
        wanted.append(("c9", [("orphan", 4)], params(endpoint, 1009)))
        # and one it aborts while its load is out: the region is withdrawn, and comes back
        wanted.append(("c8", [("aborted", 4)], params(endpoint, 1008)))
        start(consumer, keys, endpoint, 0, wanted, abort=("c8",))
        faulty = {"f-killed": ("killed", 7001), "f-silent0": ("silent", 7002), "f-silent": ("silent", 7003),
                  "f-refused": ("refused", 7004)}
        for name, room in faulty.values():
            procs[name].ask(cmd="expect", room=room, span=6, hidden=HIDDEN, deep=0, n=1, rank=0)
            procs[name].ask(cmd="register", rooms=[room])
        rooms = [item_room(room_of(rid), i) for rid, images in healthy.items() for i in range(len(images))]
        assert producer.run(lambda: announced(producer, rooms + [7001, 7002, 7003]), WAIT)
        procs["killed"].proc.kill()
        procs["killed"].proc.wait()
        for rid, images, p in wanted:
            if rid not in healthy:
                continue
            producer.add(request(rid, images, {**p, "receiver": keys["consumer"][0].decode()}))
        for rid, (name, room) in faulty.items():
            if rid != "f-silent":
                producer.add(request(rid, [(rid, 6)], params(endpoint, room, procs[name].public_key)))
        # the silent receiver answers its first room (Mooncake opens a peer inside its first write), then stops
        assert producer.run(lambda: "f-silent0" in producer.concluded | set(producer.room_failed), WAIT)
        procs["silent"].proc.send_signal(signal.SIGSTOP)
        wait_stopped(procs["silent"].proc.pid)
        producer.add(request("f-silent", [("f-silent", 6)], params(endpoint, 7003, procs["silent"].public_key)))
        done = set(healthy) | set(faulty)
        assert producer.run(lambda: producer.concluded | set(producer.room_failed) >= done
                            and not producer.connector_busy(), WAIT), (producer.concluded, producer.room_failed)
        got = answer(consumer)
        # the aborted request's region was withdrawn at the producer (not left to its announce deadline)
        withdrawn = producer.connector._producer.manager.failure_reason(1008)
    finally:
        producer.close()
        for proc in procs.values():
            proc.close()
    assert producer.concluded == set(healthy) | {"f-silent0"}
    assert set(producer.room_failed) == {"f-killed", "f-silent", "f-refused"}
    assert producer.room_failed["f-refused"] == ReasonKind.PARK_TIMEOUT.value  # its frames never got in
    assert producer.room_failed["f-killed"] in {ReasonKind.PEER_DOWN.value, ReasonKind.WRITE_FAILED.value}
    assert producer.room_failed["f-silent"] in {ReasonKind.WRITE_FAILED.value, ReasonKind.WRITE_TIMED_OUT.value,
                                                ReasonKind.WRITE_DEADLINE.value, ReasonKind.PEER_DOWN.value}
    # the consumer engine: its healthy requests ran on the bytes sent, the orphan alone failed
    assert got["unfinished"] == [] and got["failed"] == ["c9"] and "c8" not in got["finished"]
    assert got["regions_left"] == []  # consumed, released after the failure, acknowledged after the withdraw
    assert withdrawn is not None and withdrawn.kind == ReasonKind.WITHDRAWN
    expected = {h: digest(encoder_output(h, rows, HIDDEN)) for images in healthy.values() for h, rows in images}
    assert got["loaded"] == expected
