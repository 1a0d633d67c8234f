"""The encode-side controller and its transports.

Three folders, one rule each (a test checks the imports run one way,
tools -> drivers -> core -> fsm):

- `core/`: the sans-I/O controller. Deterministic state changed only by explicit
  calls; no sockets, threads, processes or sleeps. The embedded loopback
  transport lives here because it moves bytes in-process under an injected clock.
- `drivers/`: code at the edge that does I/O: the Mooncake and NIXL transports, the ZMQ
  control plane, the reference receiver (which may run as a process).
- `tools/`: the command line, demos, benchmarks and the toy tower they drive.

The names below are the public surface; embedding code imports them from
`epd_ring.executor`, not from the folders, so files can move without breaking it.
Every name loads on first use, so importing this package (as the command line does) costs
nothing until a name is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and readers; at run time the names load on first use
    from .core import (Chunk, DrainReport, EncodeExecutor, EncodeItem, EncodeManager, FakeClock, Fault, FrameError,
                       LoopbackReceiver, LoopbackTransport, Modality, MonotonicClock, Observer, Outcome,
                       Reason, ReasonKind, ReceiverFrame, Ring, RoomConflict, Extent, StagingError, TowerModel,
                       Transport, TransportError, assign_encoded_embeddings, item_token_count, shard_rows)
    from .core import Concluded, Contact, Notify, Pump, Release, Submit

__all__ = [
    "Chunk", "DrainReport", "EncodeExecutor", "EncodeItem", "EncodeManager", "FakeClock", "Fault", "FrameError",
    "LoopbackReceiver", "LoopbackTransport", "Modality", "MonotonicClock", "MooncakeTransport", "NixlTransport",
    "Observer",
    "Outcome", "Reason", "ReasonKind", "ReceiverFrame", "ReceiverProcess", "ReferenceReceiver", "Ring",
    "RoomConflict", "Extent", "Pump", "Concluded", "Contact", "Notify", "Release", "Submit",
    "StagingError", "TowerModel", "Transport", "TransportError", "ZmqControlPlane", "assign_encoded_embeddings",
    "instrument", "item_token_count", "load_engine", "make_transport", "shard_rows",
]

# Nothing is imported until a name is asked for: the core pulls in torch (seconds), and
# `epd-ring --version`, `--help` and usage errors must answer without it. The drivers' names
# come from their modules (their extras, pyzmq, Mooncake and prometheus_client, are optional);
# every other name from the core.
_DRIVERS = {
    "MooncakeTransport": ".drivers.mooncake",
    "load_engine": ".drivers.mooncake",
    "NixlTransport": ".drivers.nixl",
    "make_transport": ".drivers.transports",
    "ZmqControlPlane": ".drivers.control",
    "ReferenceReceiver": ".drivers.receiver",
    "ReceiverProcess": ".drivers.receiver",
    "instrument": ".drivers.metrics",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_DRIVERS.get(name, ".core"), __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
