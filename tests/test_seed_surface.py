"""The seed's surface: an encode loop written for the seed's executor runs on ours unchanged.

The seed's `DisaggEncodeExecutor` (the executor this project started from) is driven through seven
calls. `SeedLoop` below is such a loop: it calls those and nothing else on the executor, with the
seed's arguments. The rig plays what the seed's manager did in its own threads (receivers register,
writes complete): the pump, ticked between the loop's turns, and flushed after each call.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import make_rig, reason_kind

from epd_ring.executor import EncodeExecutor, EncodeItem, ReasonKind

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT.parent / "shared" / "seeds" / "encode_executor.py"
SEED_CALLS = ("register", "execute", "send_item", "drain_deferred", "has_deferred", "fail_rooms",
              "reap_concluded_senders")


@dataclass
class Request:
    request_id: str
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    item: EncodeItem


class SeedLoop:
    """An encode loop as written for the seed: only the seed's calls, as the seed documents them."""

    def __init__(self, executor, batch: int = 2):
        self.executor = executor
        self.batch = batch
        self.queue: list[Request] = []

    def turn(self, arrivals=(), cancelled=()) -> None:
        ex = self.executor
        for req in arrivals:
            ex.register(req.request_id, req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
            self.queue.append(req)
        if cancelled:
            ex.fail_rooms(list(cancelled), RuntimeError("client went away"))
            self.queue = [r for r in self.queue if r.request_id not in cancelled]
        ex.drain_deferred()  # once per tick: sends that waited for a free extent
        ex.reap_concluded_senders({r.request_id for r in self.queue})
        if ex.has_deferred():
            return  # backpressure: no tower run while sends wait
        batch, self.queue = self.queue[:self.batch], self.queue[self.batch:]
        for req in batch:
            if req.item.encoded is not None:  # a cache hit skips the tower
                ex.send_item(req.request_id, req.item)
        misses = [(r.request_id, r.item) for r in batch if r.item.encoded is None]
        if misses:
            try:
                ex.execute(misses)
            except Exception as exc:  # the seed's execute raised on a tower error; ours fails the rooms itself
                ex.fail_rooms([rid for rid, _ in misses], exc)


def test_the_seed_file_has_no_public_call_beyond_these():
    if not SEED.is_file():
        pytest.skip(f"no seed at {SEED}")
    tree = ast.parse(SEED.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DisaggEncodeExecutor"]
    public = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
    assert public == set(SEED_CALLS)
    assert all(callable(getattr(EncodeExecutor, name, None)) for name in SEED_CALLS)


def test_the_deferred_queues_calls_on_the_class_take_the_executor_first_as_a_method_does():
    rig = make_rig(extents=1, extent_bytes=64)
    ex = rig.executor
    rig.open_room(1)
    rig.open_room(2)
    rig.transport.inject("hold", session="p1")
    ex.execute([("r1", rig.item(2, 1)), ("r2", rig.item(2, 2))])  # the second waits for the one extent
    assert EncodeExecutor.has_deferred(ex) is True
    assert EncodeExecutor.drop_deferred(ex) == 1
    assert EncodeExecutor.has_deferred(ex) is False and ex.deferred_count == 0
    rig.open_room(3)
    ex.execute([("r3", rig.item(2, 3))])  # the emptied queue counts from zero again
    assert ex.deferred_count == 1 and ex.deferred_requests() == ["r3"]


def test_a_loop_written_for_the_seed_runs_unchanged():
    # Two extents (the seed's ring_slots / ring_bytes), so parked chunks fill the ring and later items defer.
    rig = make_rig(extents=2, extent_bytes=64, parked_ring_share=1.0)
    loop = SeedLoop(rig.executor)

    def request(room: int) -> Request:
        return Request(f"req-{room}", "prefill-host", 8998, room, rig.item(2, room))

    reqs = {room: request(room) for room in range(1, 9)}
    hit = reqs[5].item
    hit.encoded = rig.tower.expected(hit)  # a cache hit: already encoded
    loop.turn(arrivals=[reqs[1], reqs[2], reqs[3], reqs[4]])  # rooms 1 and 2 park (no receivers yet)
    loop.turn()  # rooms 3 and 4 find no free extent
    assert rig.executor.has_deferred() and rig.manager.room_status(3) == "registered"
    loop.turn(arrivals=[reqs[5], reqs[6], reqs[7]], cancelled=["req-6"])
    assert loop.queue == [reqs[5], reqs[7]]  # backpressure: no batch while sends wait
    for room in range(1, 9):
        rig.manager.register_receiver(rig.frame(room, f"p{room}", 2))
    for _ in range(3):
        rig.executor.poll()
        loop.turn()
    assert not rig.executor.has_deferred() and loop.queue == []
    rig.tower.raise_next = RuntimeError("CUDA error: out of memory")
    loop.turn(arrivals=[reqs[8]])  # its batch fails in the tower
    for _ in range(2):
        rig.executor.poll()
        loop.turn()

    status = {room: rig.manager.room_status(room) for room in reqs}
    assert status == {1: "success", 2: "success", 3: "success", 4: "success", 5: "success",
                      6: "failed", 7: "success", 8: "failed"}
    assert reason_kind(rig.manager, 6) is ReasonKind.CALLER and reason_kind(rig.manager, 8) is ReasonKind.TOWER
    assert all(rig.delivered_ok(room, f"p{room}", reqs[room].item) for room in (1, 2, 3, 4, 5, 7))
    assert rig.tower.calls == [("image", 2), ("image", 2), ("image", 1), ("image", 1)]  # not the hit, not room 6
    assert rig.executor.senders == {} and rig.executor.ring.live == 0  # every sender reaped, every extent free


def test_drain_deferred_serves_deferred_sends_as_serve_deferred_does():
    rig = make_rig(extents=1, extent_bytes=64)
    a, b = (("req-1", rig.item(2, 1)), ("req-2", rig.item(2, 2)))
    for rid, room in (("req-1", 1), ("req-2", 2)):
        rig.executor.register(rid, "prefill-host", 8998, room)
    rig.executor.execute([a, b])  # a parks in the only extent, b defers
    rig.executor.fail_rooms(["req-1"], "client went away")  # a's extent comes free (nothing was written)
    assert rig.executor.deferred_requests() == ["req-2"] and rig.executor.ring.live == 0
    rig.executor.drain_deferred()
    assert not rig.executor.has_deferred() and rig.manager.room_status(2) == "parked"


def test_a_sender_answers_to_the_seeds_bootstrap_room():
    rig = make_rig()
    rig.executor.register("req-9", "prefill-host", 8998, 9)
    assert rig.executor.senders["req-9"].bootstrap_room == 9
