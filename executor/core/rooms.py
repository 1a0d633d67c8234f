"""A room (one request's transfer to its N receivers) and the chunk it carries."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epd_ring.fsm import ROOM

from .reasons import Reason
from .ring import Extent  # at run time: the compiled core's `Chunk` reads its fields' types at import

if TYPE_CHECKING:
    from .frames import ReceiverFrame
    from .shares import Share
    from .transport import Buf
    from .writes import Write

# Derived from the declaration: where a chunk may be handed over, and where a room waits
# with a deadline (park or announce).
ACCEPTS_CHUNK = ROOM.sources("stage")
EXPIRABLE = ROOM.sources("expire")


class RoomConflict(ValueError):
    """A room id already in use (or concluded Success) was registered again."""


@dataclass(slots=True)
class Chunk:
    """One room's embedding, staged in a ring extent."""

    extent: Extent
    n_tokens: int
    hidden: int
    dtype: str
    row_bytes: int
    src: int
    deep_src: int = 0
    deep_row_bytes: int = 0
    # Deepstack levels per row (its width over hidden); -1 when the width is no
    # multiple of hidden, which no frame can match.
    deep_levels: int = 0
    # A spanning extent's pieces, as (address, bytes) in the item's order (`spread` maps a receiver's
    # rows onto them); empty when the half is one run from `src` (or `deep_src`).
    pieces: tuple[tuple[int, int], ...] = ()
    deep_pieces: tuple[tuple[int, int], ...] = ()

    @property
    def has_deep(self) -> bool:
        return self.deep_row_bytes > 0


def spread(pieces: tuple[tuple[int, int], ...], start: int, dst: int, nbytes: int) -> list[tuple[int, int, int]]:
    """The (src, dst, bytes) buffers that write bytes [start, start + nbytes) of an item held in
    `pieces` ((address, bytes) in the item's order) to `dst` onwards: one per piece they touch, so the
    receiver's rows stay contiguous however the item was placed."""
    bufs = []
    at = 0  # the item's byte where this piece begins
    end = start + nbytes
    for ptr, size in pieces:
        lo, hi = max(start, at), min(end, at + size)
        if lo < hi:
            bufs.append((ptr + lo - at, dst + lo - start, hi - lo))
        at += size
    return bufs


def chunk_writes(chunk: Chunk, frames: Iterable[ReceiverFrame]) -> list[tuple[ReceiverFrame, tuple[Buf, ...]]]:
    """Each receiver's write of its rows of the chunk: (frame, its buffers, main then deepstack); a
    zero-row shard, which only counts toward N, gets none."""
    writes: list[tuple[ReceiverFrame, tuple[Buf, ...]]] = []
    rb, drb = chunk.row_bytes, chunk.deep_row_bytes
    if chunk.pieces or chunk.deep_pieces:  # a spanning extent: a buffer per piece a receiver's rows touch
        main = chunk.pieces or ((chunk.src, chunk.n_tokens * rb),)
        deep = chunk.deep_pieces or ((chunk.deep_src, chunk.n_tokens * drb),)
        for f in frames:
            if f.n_tokens:
                bufs = spread(main, f.row_start * rb, f.dst_ptr, f.n_tokens * rb)
                if drb:
                    bufs += spread(deep, f.row_start * drb, f.dst_deep_ptr, f.n_tokens * drb)
                writes.append((f, tuple(bufs)))
        return writes
    for f in frames:  # the branch above on one run, written out: the per-item path (no `spread` per receiver)
        n = f.n_tokens
        if n:
            main_buf = (chunk.src + f.row_start * rb, f.dst_ptr, n * rb)
            writes.append((f, ((main_buf, (chunk.deep_src + f.row_start * drb, f.dst_deep_ptr, n * drb)) if drb
                               else (main_buf,))))
    return writes


class Room:
    __slots__ = ("id", "state", "n", "frames", "chunk", "timer", "due", "reason", "writes_left",
                 "sender", "announced", "cause", "withdrawn", "owner", "uncharged_bytes",
                 "parked_bytes", "share", "extent")

    def __init__(self, room_id: int):
        self.id = room_id
        self.state = ROOM.initial
        self.n: int | None = None
        self.frames: dict[str, ReceiverFrame] = {}
        self.chunk: Chunk | None = None
        self.timer = 0
        self.due = 0.0
        self.reason: Reason | str = ""
        self.writes_left = 0
        self.sender = False
        self.announced = False
        self.cause: Write | None = None  # the unsure write that failed it, if one did
        self.withdrawn: str | None = None  # the receiver whose withdraw failed it, if one did
        # The identity whose frames this room takes (None until the sender names one or
        # the first frame claims it); frames from any other identity never touch it.
        self.owner: str | None = None
        # Ring bytes its leased chunk holds, not yet charged to its receivers' peers (they are
        # when its writes start).
        self.uncharged_bytes = 0
        # Of those, the bytes counted against the parked chunks' bound (`EncodeManager.parked_bytes`)
        # while its receivers are not all registered.
        self.parked_bytes = 0
        # The identity share its extent (and its parked bytes) are charged to, and that extent (shares.py).
        self.share: Share | None = None
        self.extent: Extent | None = None

    # guard named in the room declaration
    def all_receivers(self) -> bool:
        return self.n is not None and len(self.frames) >= self.n

    def __repr__(self) -> str:
        return f"room {self.id}"


__all__ = ["ACCEPTS_CHUNK", "Chunk", "EXPIRABLE", "Room", "RoomConflict"]
