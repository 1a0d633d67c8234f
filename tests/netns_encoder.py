"""The encode worker of the multi-host suite, as a process on its own host (network namespace).

`python tests/netns_encoder.py HOST CONFIG_JSON`, keys from EPD_RING_SECRET_KEY and
EPD_RING_ALLOWED_KEYS. It runs the encode loop (MooncakeTransport, or NixlTransport with
`"transport": "nixl"` in CONFIG_JSON; the CURVE control plane, the
tiny tower, a `Pump`) without pause, and takes JSON commands on stdin between ticks, so the
test can cut links while rooms are in flight. It prints one JSON line at start
({"endpoint", "session"}) and one answer per command:

  {"cmd": "submit", "rooms": [[ROOM, H, W], ...]}  queue rooms; each goes through `execute` in
                                                   batches, while the arena can take them
  {"cmd": "wait", "rooms": [...], "timeout": T}    answered once they all concluded (or at T):
                                                   per room its state, reason kind, times, sha256;
                                                   the times: "arrived" (its submit command was
                                                   read, before the loop's gate on deferred sends),
                                                   "submitted" (it went through `execute`, after
                                                   the gate), "concluded"
  {"cmd": "state"}                                 ring, peers, transport and control counters, and
                                                   each peer's state changes as the loop saw them
                                                   ("peer_log": [[SESSION, STATE, TIME, REASON], ...]),
                                                   the peer table's counters ("peer_stats"),
                                                   its incarnation, its live control connections
  {"cmd": "exit"}

Times are `time.monotonic()`, which every namespace shares with the test.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import selectors
import signal
import sys
import time
from collections import deque
from typing import Any

# Read when the engine starts. The suite's own deadlines (settings below) must carry it, never
# these (Mooncake's TCP transport reports a cut write 14-78 s late whatever they say).
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", "5")
os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", "5")

import torch

from epd_ring.executor import EncodeExecutor, EncodeItem, EncodeManager, MonotonicClock, Pump
from epd_ring.executor.drivers.control import ZmqControlPlane, keys_from_env
from epd_ring.executor.drivers.mooncake import MooncakeTransport
from epd_ring.executor.tools.tower import TinyVisionModel, TinyVisionTower


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # where the loop is, when a test wonders why it waits
    host, cfg = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    keypair, allowed = keys_from_env()
    control = ZmqControlPlane(bind=f"tcp://{host}:{cfg.get('control_port', 0)}", keypair=keypair, allowed_keys=allowed,
                              heartbeat_s=cfg.get("heartbeat_s", 10.0))
    if cfg.get("transport") == "nixl":
        from epd_ring.executor.drivers.nixl import NixlTransport

        # NIXL has no write timeout of its own: ours frees a cut peer's extent (the encoder's own write
        # deadline, in its settings, fails the room well before).
        transport: Any = NixlTransport(hostname=host, notifier=control.push_status, write_timeout_s=10.0)
    else:
        transport = MooncakeTransport(hostname=host, notifier=control.push_status)
    manager = EncodeManager(transport, MonotonicClock(), **cfg.get("settings", {}))
    model = TinyVisionModel(TinyVisionTower(seed=7))
    # An arena of `items` of the largest size (64 x 64 rows): smaller items share it.
    executor = EncodeExecutor(manager, model, "cpu", arena_bytes=cfg.get("items", 16) * 64 * 64 * model.hidden * 4)
    pump = Pump(executor)
    control.attach(pump)
    owner = cfg["owner"]  # the prefill instance's key: every room is its
    batch = cfg.get("batch", 4)
    queued: deque = deque()
    arrived: dict[int, float] = {}  # a latency counts from here: the gate's wait is the room's too
    submitted: dict[int, float] = {}
    concluded: dict[int, tuple[str, float]] = {}
    expected: dict[int, str] = {}
    pump.on_conclude.append(lambda room, state: concluded.setdefault(room, (state, time.monotonic())))
    # Each peer's state after every tick, and when it changed (how long a wedged peer took to go down).
    peer_state: dict[str, str] = {}
    peer_log: deque = deque(maxlen=512)

    def watch_peers() -> None:
        for session, peer in manager.peers.by_session.items():
            if peer_state.get(session) != peer.state:
                peer_state[session] = peer.state
                peer_log.append([session, peer.state, time.monotonic(), peer.reason])
    print(json.dumps({"endpoint": control.endpoint, "session": transport.session}), flush=True)

    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    buf = b""
    waiting: tuple[list[int], float] | None = None

    def answer(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    def outcome(rooms: list[int]) -> dict:
        out = {}
        for r in rooms:
            state, at = concluded.get(r, (manager.room_status(r), None))
            reason = manager.failure_reason(r)
            out[str(r)] = {"state": state, "kind": reason.kind.value if reason else None,
                           "detail": reason.detail if reason else None, "arrived": arrived.get(r),
                           "submitted": submitted.get(r),
                           "concluded": at, "sha256": expected.get(r)}
        return out

    def feed() -> None:
        if not queued or not executor.can_take():
            return  # backpressure, as an encode loop does: no tower run while the arena is full
        chunk = [queued.popleft() for _ in range(min(batch, len(queued)))]
        items = []
        for room, h, w in chunk:
            pixels = torch.randn(3, h, w, generator=torch.Generator().manual_seed(room))
            items.append((room, EncodeItem("image", model.tower.tokens_for(h, w), pixel_values=pixels)))
            executor.register(f"r{room}", host, 0, room, receiver=owner)
        pump.flush()
        now = time.monotonic()
        submitted.update((room, now) for room, _ in items)  # through the gate: not where latency counts
        executor.execute([(f"r{room}", item) for room, item in items])
        pump.flush()
        for room, item in items:
            if item.encoded is not None:
                expected[room] = hashlib.sha256(item.encoded.contiguous().numpy().tobytes()).hexdigest()

    running = True
    while running:
        busy = bool(queued) or transport.in_flight or waiting is not None
        for _key, _ev in sel.select(0.001 if busy else 0.005):
            data = os.read(sys.stdin.fileno(), 1 << 16)
            if not data:
                running = False
                break
            buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd = json.loads(line)
            kind = cmd["cmd"]
            if kind == "submit":
                now = time.monotonic()
                for r in cmd["rooms"]:
                    arrived.setdefault(r[0], now)
                queued.extend(tuple(r) for r in cmd["rooms"])
                answer({"ok": True})
            elif kind == "wait":
                waiting = (cmd["rooms"], time.monotonic() + cmd.get("timeout", 0))
            elif kind == "state":
                answer({"live_extents": len(executor.ring.extents), "arena": executor.ring.gauges(),
                        "peers": manager.peers.snapshot(), "peer_stats": dict(manager.peers.stats),
                        "transport": dict(transport.stats),
                        "control": dict(control.stats), "in_flight": transport.in_flight, "queued": len(queued),
                        "peer_log": list(peer_log), "incarnation": control.incarnation.decode(),
                        "connections": len(control.guard.live) if control.guard else 0})
            elif kind == "exit":
                running = False
            else:
                answer({"ok": False, "error": f"unknown command {kind!r}"})
        feed()
        pump.tick()
        watch_peers()
        executor.reap_concluded_senders(set())
        if waiting is not None:
            rooms, deadline = waiting
            if all(r in concluded for r in rooms) or time.monotonic() > deadline:
                waiting = None
                answer(outcome(rooms))
    control.close()
    transport.close()


if __name__ == "__main__":
    main()
