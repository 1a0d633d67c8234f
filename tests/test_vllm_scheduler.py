"""epd-ring's EC connector driven by vLLM's real v1 Scheduler (not a mock of it), both roles.

The model is a tiny LLaVA made in a temporary folder (tests/vllm_tiny.py); the workers' part is
played by the connector's own worker metadata, fed back through vLLM's `update_from_output`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

if not os.environ.get("EPD_RING_REQUIRE_VLLM"):
    pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).parent))
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.v1.request import RequestStatus
from vllm_tiny import TOKENS_PER_IMAGE, image_request, make_tiny_blip2, runner_output, scheduler, vllm_config

from epd_ring.executor.connectors.vllm import EpdRingConnector, EpdRingWorkerMetadata, Room

ROOM = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 7000, "bootstrap_room": 42}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_blip2(tmp_path_factory.mktemp("tiny-blip2"))


@pytest.fixture(scope="module")
def producer_config(model):
    return vllm_config(model, "ec_producer")


@pytest.fixture(scope="module")
def consumer_config(model):
    return vllm_config(model, "ec_consumer")


def test_vllm_loads_the_connector_by_module_path(producer_config):
    s = scheduler(producer_config)
    assert isinstance(s.ec_connector, EpdRingConnector) and s.ec_connector.is_producer


def test_a_worker_without_its_keys_refuses_to_start(producer_config, consumer_config):
    # CURVE is on unless switched off: a worker with no keys says which it lacks, before it binds anything
    for config in (producer_config, consumer_config):
        with pytest.raises(ValueError, match="secret key"):
            EpdRingConnector(config, ECConnectorRole.WORKER)


def test_the_transport_is_chosen_by_configuration_and_an_unknown_one_refused(producer_config):
    from epd_ring.executor.connectors.vllm_worker import Settings

    assert Settings.of(producer_config, {"insecure": True}, {}).transport == "mooncake"
    assert Settings.of(producer_config, {"insecure": True, "transport": "nixl"}, {}).transport == "nixl"
    with pytest.raises(ValueError, match="transport"):
        Settings.of(producer_config, {"insecure": True, "transport": "rdma"}, {})


def test_a_producer_request_yields_its_registration_and_items_and_keeps_the_engine_stepping(producer_config):
    s = scheduler(producer_config)
    s.add_request(image_request("p1", ["img-a", "img-b"], {**ROOM, "receiver": "consumer-0"}))
    s.add_request(image_request("local", ["img-c"], None))  # names no room: nothing to send
    out = s.schedule()
    assert set(out.scheduled_encoder_inputs) == {"p1", "local"}  # the encoder runs here
    meta = out.ec_connector_metadata
    assert [(r.request_id, r.room) for r in meta.registrations] == [
        ("p1", Room("127.0.0.1", 7000, 42, "consumer-0"))]
    assert [(i.request_id, i.index, i.mm_hash, i.num_embeds) for i in meta.items] == [
        ("p1", 0, "img-a", TOKENS_PER_IMAGE), ("p1", 1, "img-b", TOKENS_PER_IMAGE)]
    assert s.ec_connector.has_pending_push_work()
    # the request finishes (max_tokens) while its room is live: the room outlives it
    s.update_from_output(out, runner_output(out))
    out = s.schedule()
    assert out.ec_connector_metadata.registrations == []  # registered once
    s.update_from_output(out, runner_output(out))
    assert "p1" not in s.requests and s.ec_connector.has_pending_push_work() and s.has_requests()
    out = s.schedule()
    assert out.ec_connector_metadata.finished == ["p1"]
    s.update_from_output(out, runner_output(out, EpdRingWorkerMetadata(concluded={"p1"})))
    assert not s.ec_connector.has_pending_push_work() and not s.has_requests()


def test_a_consumer_request_waits_for_its_load_then_runs_without_the_encoder(consumer_config):
    s = scheduler(consumer_config)
    s.add_request(image_request("c1", ["img-a"], {**ROOM, "ranks": 2}))
    out = s.schedule()
    assert out.num_scheduled_tokens == {}  # deferred: the load has not reported
    [load] = out.ec_connector_metadata.loads
    assert (load.request_id, load.mm_hash, load.num_embeds, load.room.room, load.room.ranks) == (
        "c1", "img-a", TOKENS_PER_IMAGE, 42, 2)
    s.update_from_output(out, runner_output(out))
    out = s.schedule()
    assert out.num_scheduled_tokens == {} and out.ec_connector_metadata.loads == []  # asked once
    # one rank alone is not enough: every rank gathers from its own cache
    partial = EpdRingWorkerMetadata(loaded={"img-a"}).aggregate(EpdRingWorkerMetadata())
    s.update_from_output(out, runner_output(out, partial))
    assert s.schedule().num_scheduled_tokens == {}
    both = EpdRingWorkerMetadata(loaded={"img-a"}).aggregate(EpdRingWorkerMetadata(loaded={"img-a"}))
    s.update_from_output(out, runner_output(out, both))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"c1": 1 + TOKENS_PER_IMAGE + 1}
    assert out.scheduled_encoder_inputs == {}  # no local encoder run


def test_a_failed_room_fails_only_its_requests(consumer_config):
    s = scheduler(consumer_config)
    s.add_request(image_request("c1", ["img-a"], ROOM))
    s.add_request(image_request("c2", ["img-a"], ROOM))  # shares the item, so shares its fate
    s.add_request(image_request("c3", ["img-b"], ROOM))
    out = s.schedule()
    assert sorted(load.mm_hash for load in out.ec_connector_metadata.loads) == ["img-a", "img-b"]
    s.update_from_output(out, runner_output(out, EpdRingWorkerMetadata(
        failed_loads={"img-a": "peer_lost"}, loaded={"img-b"})))
    # vLLM takes the unavailable requests before it reads the step's connector output: they fail
    # on the next step, and meanwhile the failed item keeps them deferred, never encoded here
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"c3"} and out.scheduled_encoder_inputs == {}
    assert out.ec_connector_metadata.loads == []  # the failed item is not asked for again
    outputs = s.update_from_output(out, runner_output(out))
    failed = {o.request_id for eco in outputs.values() for o in eco.outputs if o.finish_reason is not None}
    assert failed == {"c1", "c2"}
    assert "c1" not in s.requests and "c2" not in s.requests and "c3" in s.requests
    # a later request for the failed item loads it afresh
    s.add_request(image_request("c4", ["img-a"], ROOM))
    assert [load.request_id for load in s.schedule().ec_connector_metadata.loads] == ["c4"]


def test_in_both_roles_a_request_naming_its_receiver_is_sent_and_one_naming_none_is_loaded(model):
    s = scheduler(vllm_config(model, "ec_both"))
    assert s.ec_connector.is_producer and s.ec_connector.is_consumer
    s.add_request(image_request("send", ["img-a"], {**ROOM, "receiver": "consumer-0"}))
    s.add_request(image_request("load", ["img-b"], ROOM))
    out = s.schedule()
    meta = out.ec_connector_metadata
    assert set(out.num_scheduled_tokens) == {"send"} and set(out.scheduled_encoder_inputs) == {"send"}
    assert [r.request_id for r in meta.registrations] == ["send"] and [i.mm_hash for i in meta.items] == ["img-a"]
    assert [(load.request_id, load.mm_hash) for load in meta.loads] == [("load", "img-b")]
    s.update_from_output(out, runner_output(out, EpdRingWorkerMetadata(loaded={"img-b"})))
    out = s.schedule()
    assert "load" in out.num_scheduled_tokens and "load" not in out.scheduled_encoder_inputs  # loaded, not encoded
    assert out.ec_connector_metadata.items == [] and out.ec_connector_metadata.registrations == []  # nor sent on


def test_an_aborted_consumer_request_cancels_the_load_nobody_else_waits_for(consumer_config):
    s = scheduler(consumer_config)
    s.add_request(image_request("c1", ["img-a"], ROOM))
    out = s.schedule()
    s.update_from_output(out, runner_output(out))
    s.finish_requests({"c1"}, RequestStatus.FINISHED_ABORTED)
    assert s.schedule().ec_connector_metadata.cancelled_loads == ["img-a"]
    # a load reported after the cancel is no item of anyone's
    assert not s.ec_connector.has_cache_item("img-a")


def test_a_failed_producer_room_fails_its_request_and_stops_holding_the_engine(producer_config):
    s = scheduler(producer_config)
    s.add_request(image_request("p1", ["img-a"], ROOM, max_tokens=8))
    s.add_request(image_request("p2", ["img-b"], {**ROOM, "bootstrap_room": 43}, max_tokens=8))
    out = s.schedule()
    s.update_from_output(out, runner_output(out, EpdRingWorkerMetadata(failed={"p1": "receiver_refused"})))
    out = s.schedule()
    outputs = s.update_from_output(out, runner_output(out))
    failed = {o.request_id for eco in outputs.values() for o in eco.outputs if o.finish_reason is not None}
    assert failed == {"p1"} and "p2" in s.requests
    s.finish_requests({"p2"}, RequestStatus.FINISHED_ABORTED)
    assert s.ec_connector.has_pending_push_work()  # p2's room is live still
    out = s.schedule()
    # the workers are told both are over, the failed one too: else they would keep its records for good
    assert sorted(out.ec_connector_metadata.finished) == ["p1", "p2"]
    s.update_from_output(out, runner_output(out, EpdRingWorkerMetadata(concluded={"p2"})))
    assert not s.ec_connector.has_pending_push_work() and not s.ec_connector._registered
