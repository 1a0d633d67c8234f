"""The encode-side controller and its transports."""

from .clock import FakeClock, MonotonicClock
from .executor import (EncodeExecutor, EncodeItem, Modality, StagingError, assign_encoded_embeddings,
                       item_token_count)
from .frames import FrameError, ReceiverFrame, shard_rows
from .loopback import Fault, LoopbackReceiver, LoopbackTransport
from .manager import Chunk, EncodeManager, RoomConflict
from .ring import Ring, Slot
from .transport import Outcome, Transport, TransportError

__all__ = [
    "Chunk", "EncodeExecutor", "EncodeItem", "EncodeManager", "FakeClock", "Fault", "FrameError",
    "LoopbackReceiver", "LoopbackTransport", "Modality", "MonotonicClock", "Outcome", "ReceiverFrame",
    "Ring", "RoomConflict", "Slot", "StagingError", "Transport", "TransportError",
    "assign_encoded_embeddings", "item_token_count", "shard_rows",
]
