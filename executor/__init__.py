"""The encode-side controller and its transports.

Three folders, one rule each (a test checks the imports run one way,
tools -> drivers -> core -> fsm):

- `core/`: the sans-I/O controller. Deterministic state changed only by explicit
  calls; no sockets, threads, processes or sleeps. The embedded loopback
  transport lives here because it moves bytes in-process under an injected clock.
- `drivers/`: code at the edge that does I/O: the Mooncake transport, the ZMQ
  control plane, the reference receiver (which may run as a process).
- `tools/`: the command line, demos, benchmarks and the toy tower they drive.

The names below are the public surface; embedding code imports them from
`epd_ring.executor`, not from the folders, so files can move without breaking it.
Driver names load lazily: their extras (pyzmq, Mooncake) are optional.
"""

from .core import (Chunk, EncodeExecutor, EncodeItem, EncodeManager, FakeClock, Fault, FrameError,
                   LoopbackReceiver, LoopbackTransport, Modality, MonotonicClock, Outcome, ReceiverFrame, Ring,
                   RoomConflict, Slot, StagingError, Transport, TransportError, assign_encoded_embeddings,
                   item_token_count, shard_rows, TowerModel, DrainReport, Observer, Reason, ReasonKind,
                   Pump, Concluded, Contact, Notify, Release, Submit)

_DRIVERS = {
    "MooncakeTransport": "mooncake",
    "load_engine": "mooncake",
    "ZmqControlPlane": "control",
    "ReferenceReceiver": "receiver",
    "ReceiverProcess": "receiver",
    "instrument": "metrics",
}


def __getattr__(name: str):
    module = _DRIVERS.get(name)
    if module is None:
        raise AttributeError(f"module 'epd_ring.executor' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f".drivers.{module}", __name__), name)


__all__ = [
    "Chunk", "EncodeExecutor", "EncodeItem", "EncodeManager", "FakeClock", "Fault", "FrameError",
    "LoopbackReceiver", "LoopbackTransport", "Modality", "MonotonicClock", "MooncakeTransport", "Outcome",
    "ReceiverFrame", "ReceiverProcess", "ReferenceReceiver", "Ring", "RoomConflict", "Slot", "StagingError",
    "Transport", "TransportError", "TowerModel", "DrainReport", "Observer", "Reason", "ReasonKind", "Pump", "Concluded", "Contact", "Notify", "Release", "Submit",
    "ZmqControlPlane",
    "assign_encoded_embeddings", "instrument", "item_token_count",
    "load_engine", "shard_rows",
]
