"""The vLLM connector's worker loops at their edges, without vLLM: a bad side-channel message, a
dead rank, a loop whose thread has ended. Each fails only what it touched, and nothing waits unbounded."""

from __future__ import annotations

import json
import time

import pytest
import torch

zmq = pytest.importorskip("zmq")

from epd_ring.executor.connectors.vllm_worker import ConsumerWorker, LoadChannel, Loop, Settings  # noqa: E402

WAIT = 60  # a bound for conditions that hold at once on an idle machine


def until(cond, bound: float = WAIT) -> bool:
    end = time.monotonic() + bound
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_a_bad_side_channel_message_fails_its_own_load_and_the_loop_goes_on(tmp_path):
    settings = Settings(hidden=4, deepstack=0, dtype=torch.float32, insecure=True)
    loads, reports = f"ipc://{tmp_path}/w0", f"ipc://{tmp_path}/s"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(reports)
    worker = ConsumerWorker(settings, "cpu", (loads, reports))
    push = ctx.socket(zmq.PUSH)
    push.connect(loads)
    try:
        push.send(b"not json")
        push.send(json.dumps({"op": "load", "mm_hash": "bad-room", "room": {"nonsense": 1}, "index": 0,
                              "num_embeds": 3}).encode())
        push.send(json.dumps({"op": "load", "mm_hash": "no-index",
                              "room": {"host": "127.0.0.1", "port": 7000, "room": 1, "ranks": 1}}).encode())
        assert pull.poll(WAIT * 1000)
        failed = {}
        while len(failed) < 2 and pull.poll(WAIT * 1000):
            report = json.loads(pull.recv())
            failed[report["mm_hash"]] = report["outcome"]
        assert set(failed) == {"bad-room", "no-index"} and "ready" not in failed.values()
        assert worker.loop.error is None and worker.loop.thread.is_alive()
        _, out = worker.take_reports()
        assert set(out) == {"bad-room", "no-index"}
    finally:
        worker.shutdown()
        push.close(0)
        pull.close(0)
        ctx.term()
    assert not worker.loop.thread.is_alive()


def test_a_dead_rank_never_blocks_the_schedulers_sends(tmp_path):
    # nobody binds the rank's endpoint: its queue fills, and a send says so instead of waiting
    channel = LoadChannel(f"ipc://{tmp_path}/s", [f"ipc://{tmp_path}/w0"])
    try:
        results = [channel.send({"op": "cancel", "mm_hash": f"h{i}"}) for i in range(5000)]
    finally:
        channel.close()
    assert results[0] is True and results[-1] is False


def test_a_command_run_on_an_ended_loop_runs_on_the_callers_thread():
    def boom() -> int:
        raise RuntimeError("the drivers' tick failed")

    loop = Loop("ended", boom)
    assert until(lambda: not loop.thread.is_alive())
    assert isinstance(loop.error, RuntimeError)
    ran = []
    loop.run(lambda: ran.append(True), timeout=WAIT)  # a shutdown still closes the stack
    assert ran == [True]
    assert loop.stop(1)


def test_insecure_must_be_a_bool_not_a_string_that_reads_true():
    with pytest.raises(ValueError):
        Settings.of(_Config(), {"insecure": "false"}, {})


class _Config:  # the two fields Settings.of reads from vLLM's config
    class model_config:
        dtype = torch.float32

        @staticmethod
        def get_inputs_embeds_size() -> int:
            return 4

        hf_config = None


def test_a_receiver_keeps_only_its_live_rooms_and_a_reused_room_starts_untold():
    import os

    if not os.environ.get("EPD_RING_REQUIRE_MOONCAKE"):
        pytest.importorskip("mooncake.engine")
    from epd_ring.executor.drivers.receiver import ReferenceReceiver

    rcv = ReferenceReceiver("tcp://127.0.0.1:9", capacity=1 << 16, insecure=True)
    try:
        frame = rcv.expect(5, span=2, hidden=4)
        rcv.on_notice(5, "success", frame.dst_ptr)
        assert not rcv.forget(5)  # its region is held: nothing is dropped
        rcv.consume(5)
        # the room's id comes again before anyone forgot it: the old outcome is not the new region's
        frame = rcv.expect(5, span=2, hidden=4)
        assert rcv.status.get(5) is None and rcv.notices.get(5) is None
        rcv.on_notice(5, "success", frame.dst_ptr)
        rcv.consume(5)
        assert rcv.forget(5)
        assert all(5 not in kept for kept in (rcv.frames, rcv.views, rcv.status, rcv.notices))
    finally:
        rcv.close()
