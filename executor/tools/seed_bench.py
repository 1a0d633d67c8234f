"""The seed's executor on the bench's cycle, loaded from its own file.

`epd-ring bench --seed PATH` measures the executor this project started from
beside ours, in the same process and run, so the ratio does not depend on
figures taken on another day. The seed imports engine modules (tokenspeed's
multimodal inputs, transfer status, Mooncake sender, env settings) that are not
installed here; this module writes minimal stand-ins for them, as cheap as we
can make them so that the seed is charged only for its own work:

- the manager keeps each room's status in a dict and its receivers' buffers;
- the sender's `send` copies the bytes to the registered receiver with one
  memmove and marks the room Success at once (the loopback transport's job on
  our side), or leaves the room Transferring for the rooms the bench holds;
- `envs` returns the constructor's arguments.

Nothing of the seed is copied here: its file is executed as it is.
"""

from __future__ import annotations

import ctypes
import enum
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

_MODULES = (
    "tokenspeed", "tokenspeed.runtime", "tokenspeed.runtime.multimodal",
    "tokenspeed.runtime.multimodal.embedder", "tokenspeed.runtime.multimodal.inputs",
    "tokenspeed.runtime.pd", "tokenspeed.runtime.pd.base", "tokenspeed.runtime.pd.base.status",
    "tokenspeed.runtime.pd.epd", "tokenspeed.runtime.pd.epd.embedding_transfer",
    "tokenspeed.runtime.utils", "tokenspeed.runtime.utils.env",
)


class Modality(enum.Enum):
    IMAGE = "image"
    VIDEO = "video"


class MultimodalDataItem:
    __slots__ = ("modality", "n_tokens", "encoded", "encoded_deepstack")

    def __init__(self, modality: Modality, n_tokens: int):
        self.modality = modality
        self.n_tokens = n_tokens
        self.encoded = None
        self.encoded_deepstack = None


class TransferPoll(enum.Enum):
    Bootstrapping = 0
    WaitingForInput = 1
    Transferring = 2
    Success = 3
    Failed = 4


def _item_token_count(item: MultimodalDataItem) -> int:
    return item.n_tokens


class _Setting:
    __slots__ = ()

    def get_set_value_or(self, default: Any) -> Any:
        return default

    def get(self) -> Any:
        return None


class _Envs:
    TOKENSPEED_EPD_ENCODE_RING_SLOTS = _Setting()
    TOKENSPEED_EPD_ENCODE_RING_SLOT_MB = _Setting()


class _Engine:
    def __init__(self) -> None:
        self.registered = 0

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered += 1


class SeedManager:
    """The least a manager must do for the seed's executor on the bench's cycle."""

    def __init__(self) -> None:
        self.engine = _Engine()
        self.status: dict[int, TransferPoll] = {}
        self.receivers: dict[int, int] = {}  # room -> destination pointer
        self.held: set[int] = set()  # rooms whose writes never complete
        self.success = 0

    def register_receiver(self, room: int, dst_ptr: int, held: bool = False) -> None:
        self.receivers[room] = dst_ptr
        if held:
            self.held.add(room)

    def room_status(self, room: int) -> TransferPoll | None:
        return self.status.get(room)

    def is_parked(self, room: int) -> bool:
        return False  # every room's receiver registers before its chunk on this cycle

    def fail_room(self, room: int, reason: str) -> None:
        self.status[room] = TransferPoll.Failed


class MooncakeEmbeddingSender:
    __slots__ = ("manager", "peer", "bootstrap_room")

    def __init__(self, manager: SeedManager, peer: str, bootstrap_room: int):
        self.manager = manager
        self.peer = peer
        self.bootstrap_room = bootstrap_room

    def send(self, copy_event: Any = None, *, src_embedding_ptr: int, nbytes: int, **_: Any) -> None:
        m = self.manager
        room = self.bootstrap_room
        if room in m.held:
            m.status[room] = TransferPoll.Transferring
            return
        ctypes.memmove(m.receivers[room], src_embedding_ptr, nbytes)
        m.status[room] = TransferPoll.Success
        m.success += 1


def _standins() -> dict[str, types.ModuleType]:
    mods = {name: types.ModuleType(name) for name in _MODULES}
    mods["tokenspeed.runtime.multimodal.embedder"]._item_token_count = _item_token_count
    inputs = mods["tokenspeed.runtime.multimodal.inputs"]
    inputs.Modality, inputs.MultimodalDataItem = Modality, MultimodalDataItem
    mods["tokenspeed.runtime.pd.base.status"].TransferPoll = TransferPoll
    mods["tokenspeed.runtime.pd.epd.embedding_transfer"].MooncakeEmbeddingSender = MooncakeEmbeddingSender
    mods["tokenspeed.runtime.utils.env"].envs = _Envs()
    return mods


def load_seed(path: str | Path) -> types.ModuleType:
    """Execute the seed's file with the stand-ins in place; return its module."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no seed executor at {path}")
    standins = _standins()
    saved = {name: sys.modules.get(name) for name in standins}
    sys.modules.update(standins)
    try:
        spec = importlib.util.spec_from_file_location("epd_ring_seed_executor", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:  # the seed's globals are bound now; leave sys.modules as we found it
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    if not hasattr(module, "DisaggEncodeExecutor"):
        raise ValueError(f"{path} defines no DisaggEncodeExecutor")
    return module
