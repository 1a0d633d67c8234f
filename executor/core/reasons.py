"""Why a room failed: a closed set of kinds, each with free detail text.

Metrics, tests and logs branch on the kind; the detail is for people and may
change wording at any time. A `Reason` is its detail text (a `str`, so it goes
on the wire and into logs unchanged) with its kind attached.
"""

from __future__ import annotations

import enum


class ReasonKind(str, enum.Enum):
    TOWER = "tower"  # the tower (or the split of its output) raised for the batch
    ITEM = "item"  # the item could not be staged: shape, size, modality, copy
    PROTOCOL = "protocol"  # the caller broke the contract: a second item or chunk for one room
    TOO_LARGE = "too_large"  # the item is larger than the whole arena or than max_item_bytes: it never fits
    DEFERRED_FULL = "deferred_full"  # the item does not fit now and the deferred queue is full
    PARK_TIMEOUT = "park_timeout"  # staged, but not every receiver registered in time
    ANNOUNCE_TIMEOUT = "announce_timeout"  # receivers registered, but the sender never did
    WRITE_FAILED = "write_failed"  # the transport reported the write failed
    WRITE_TIMED_OUT = "write_timed_out"  # the transport gave up on the write (it may still land)
    WRITE_DEADLINE = "write_deadline"  # our own write deadline passed with no report
    FRAME = "frame"  # a malformed frame, or frames of one room that disagree
    FOREIGN = "foreign"  # the room or session belongs to another identity
    CAPACITY = "capacity"  # a bound was reached: rooms waiting for a sender, peers, sessions
    PEER_DOWN = "peer_down"  # the receiver's peer refused or missed its contact deadline
    WITHDRAWN = "withdrawn"  # a receiver withdrew its region
    LATE = "late"  # a frame for a room that concluded without its receiver
    DRAINING = "draining"  # the worker is shutting down and takes no new transfers
    DRAIN_DEADLINE = "drain_deadline"  # the drain deadline passed with the room's writes in flight
    CALLER = "caller"  # failed by the engine through `fail_room` with its own text


class Reason(str):
    """Detail text with a `kind`; compares and prints as its text."""

    __slots__ = ("kind",)
    kind: ReasonKind

    def __new__(cls, kind: ReasonKind, detail: str) -> Reason:
        if not isinstance(detail, str):  # str() of anything would pass for an explanation ("None")
            raise TypeError(f"a reason's detail is text, not {type(detail).__name__}")
        self = super().__new__(cls, detail)
        self.kind = ReasonKind(kind)
        return self

    @property
    def detail(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"Reason({self.kind.value}, {self.detail!r})"

    def __reduce__(self) -> tuple[type[Reason], tuple[ReasonKind, str]]:  # pickles (process drivers) keep the kind
        return (Reason, (self.kind, self.detail))


def as_reason(reason: str, default: ReasonKind = ReasonKind.CALLER) -> Reason:
    """`reason` itself if it has a kind, else its text under `default`."""
    return reason if isinstance(reason, Reason) else Reason(default, str(reason))


__all__ = ["Reason", "ReasonKind", "as_reason"]
