"""The sans-I/O core: the controller's state and every rule that changes it.

Code here is deterministic and single-threaded: it changes only through explicit
calls (tower output, a receiver frame, a transfer report, a clock reading) and
never opens a socket, starts a thread or process, or sleeps. Time comes from an
injected clock. `executor` owns items and senders (tower, scatter, reap) and
`staging` gets items into extents (lease, copy, defer); `manager` owns rooms
(its public calls, the tick), `lifecycle` how rooms, extents and peers move each
other (through fsm/couplings.py), `admission` the frames and withdraws,
`writes` the writes in flight, `tombstones` what is kept of concluded rooms;
`reasons` why a room failed; `ring` the extents; `transport` the seam every
transport implements; `loopback` the in-process transport with fault injection. It may import only
`epd_ring.fsm`, torch, `mypy_extensions` (marks for the compiled core, setup.py) and the standard library.
"""

from .clock import FakeClock, MonotonicClock
from .drain import DrainReport
from .effects import Concluded, Contact, Notify, Release, Submit
from .executor import EncodeExecutor, EncodeItem, Modality, assign_encoded_embeddings, item_token_count
from .frames import FrameError, ReceiverFrame, shard_rows
from .loopback import Fault, LoopbackReceiver, LoopbackTransport
from .manager import Chunk, EncodeManager, RoomConflict
from .observe import Observer
from .pump import Pump
from .reasons import Reason, ReasonKind
from .ring import Extent, Ring
from .staging import StagingError
from .tower import TowerModel
from .transport import Outcome, Transport, TransportError

__all__ = [
    "Chunk", "EncodeExecutor", "EncodeItem", "EncodeManager", "FakeClock", "Fault", "FrameError",
    "LoopbackReceiver", "LoopbackTransport", "Modality", "MonotonicClock", "Outcome", "ReceiverFrame",
    "Ring", "RoomConflict", "Extent", "StagingError", "Transport", "TransportError", "TowerModel", "DrainReport",
    "Observer", "Reason", "ReasonKind", "Pump", "Concluded", "Contact", "Notify", "Release", "Submit",
    "assign_encoded_embeddings", "item_token_count", "shard_rows",
]
