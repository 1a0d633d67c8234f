"""Embedding epd-ring in an encode worker's loop: a runnable example with a small ring.

    python examples/embed.py

The encode side is real (a tiny torch tower, the executor, its ring); the
prefill side is played in-process by the loopback transport's receivers, so the
example needs no engine. With Mooncake, swap `LoopbackTransport` for
`MooncakeTransport` and attach a `ZmqControlPlane` to the pump, which then reads
frames on every tick (see docs/embedding.md).
"""

from __future__ import annotations

import sys
import time

import torch

from epd_ring.executor import (
    EncodeExecutor,
    EncodeItem,
    EncodeManager,
    LoopbackTransport,
    MonotonicClock,
    Pump,
    ReceiverFrame,
    RoomConflict,
    TowerModel,
)

HIDDEN = 16  # embedding width
PATCH = 4  # pixels per side of one token


class Tower:
    """What `model` must provide (the `TowerModel` protocol): two encoders and the deepstack split."""

    num_deepstack_embeddings = 0  # no deepstack levels: `separate_deepstack_embeds` is never called

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(3 * PATCH * PATCH, HIDDEN)

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = pixels.unfold(1, PATCH, PATCH).unfold(2, PATCH, PATCH)  # [3, h, w, P, P]
        return self.proj(patches.permute(1, 2, 0, 3, 4).reshape(-1, 3 * PATCH * PATCH))

    def image_encoder(self, items):  # one packed [sum of n_tokens, HIDDEN] tensor, items in order
        return torch.cat([self._encode(item.pixel_values) for item in items])

    def get_video_feature(self, items):
        return torch.cat([self._encode(frame) for item in items for frame in item.pixel_values])

    def separate_deepstack_embeds(self, emb):
        return emb[:, :HIDDEN], emb[:, HIDDEN:]


def main() -> int:
    model = Tower()
    assert isinstance(model, TowerModel)
    clock = MonotonicClock()
    transport = LoopbackTransport(clock)
    manager = EncodeManager(transport, clock, park_timeout=5.0, write_timeout=5.0, quarantine_s=1.0)
    # A small ring: an arena of 16 KiB (four items of 64 tokens x HIDDEN float32), registered once;
    # each item takes the bytes it needs.
    executor = EncodeExecutor(manager, model, "cpu", arena_bytes=4 * 64 * HIDDEN * 4)
    # The core decides and never calls out; the pump does what it decided (submits writes, tells
    # receivers, contacts peers) and feeds the transport's answers back in.
    pump = Pump(executor)

    # Ten requests (images of 8x8 to 32x32 pixels: 4 to 64 tokens), one receiver each.
    images = [torch.randn(3, 8 * (1 + k % 4), 8 * (1 + k % 4)) for k in range(10)]
    requests = [(f"req-{k}", 1000 + k, EncodeItem("image", (img.shape[1] // PATCH) * (img.shape[2] // PATCH),
                                                  pixel_values=img)) for k, img in enumerate(images)]
    requests.append(("req-dup", 1003, EncodeItem("image", 4, pixel_values=images[0])))  # reuses room 1003

    # The prefill side: each receiver registers a buffer and sends one ReceiverFrame per room.
    receiver = transport.add_receiver("prefill-0:17000")
    buffers: dict[int, torch.Tensor] = {}
    frames = []
    for _, room, item in requests[:10]:
        buffers[room] = torch.zeros(item.n_tokens, HIDDEN)
        receiver.register(buffers[room])
        frames.append(ReceiverFrame(room=room, session=receiver.session, dst_ptr=buffers[room].data_ptr(),
                                    dst_deep_ptr=0, n_tokens=item.n_tokens, row_start=0, span=item.n_tokens,
                                    hidden=HIDDEN, dtype="torch.float32", has_deepstack=False, n_receivers=1))

    # The encode loop.
    pending = list(requests)
    scheduled: list[tuple[str, EncodeItem]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for rid, room, item in pending:
            try:
                executor.register(rid, "prefill-bootstrap", 8998, room)
            except RoomConflict as exc:  # a room id in use (or already concluded success)
                print(f"refused {rid}: {exc}")
                continue
            except ValueError as exc:  # the same request id twice, or a bad room id
                print(f"refused {rid}: {exc}")
                continue
            scheduled.append((rid, item))
        pending = []
        for frame in frames:  # from your control plane (ZmqControlPlane parses and checks them)
            manager.register_receiver(frame)
        frames = []
        pump.flush()  # after any call into the core: what it decided goes out now
        pump.tick()  # completions, deadlines, deferred sends, and what they decide: once per tick
        executor.reap_concluded_senders({rid for rid, _ in scheduled})
        if scheduled and executor.can_take():  # backpressure: no tower run while the arena is full
            batch, scheduled = scheduled[:3], scheduled[3:]
            executor.execute(batch)  # never raises for a bad batch: its rooms fail, receivers are told
            pump.flush()  # the writes are submitted here
        if not scheduled and not manager.rooms:
            break
        time.sleep(0.001)

    print(executor.dump_state())  # returns a string: the ring's live extents and the live rooms
    ok = True
    for rid, room, item in requests[:10]:
        status = manager.room_status(room)
        told = receiver.statuses(room)
        same = torch.equal(buffers[room], item.encoded)
        print(f"{rid}: room {room} {status}, receiver told {told}, bytes equal the tower's: {same}")
        ok &= status == "success" and told == ["success"] and same

    # Shut down: stop intake, let writes finish, wait out quarantines, unregister the ring.
    report = pump.close(5.0, idle=lambda: time.sleep(0.001))
    print(f"drained: clean={report.clean}, rooms failed by the drain={report.rooms_failed}")
    ok &= report.clean
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
