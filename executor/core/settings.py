"""Checks for configuration numbers: finite, in range, or a clear error at construction.

A NaN timeout compares false with everything, so a deadline armed with it never
fires (a parked room would hold its extent forever); a negative count silently
disables a bound. Both are refused where they are set, naming the setting.
"""

from __future__ import annotations

import math
from typing import Any


def seconds(name: str, value: Any) -> float:
    """A duration: a real, finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0 seconds, got {value!r}")
    return float(value)


def count(name: str, value: Any, minimum: int = 0) -> int:
    """A bound: an integer >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def port(name: str, value: Any) -> int:
    """A TCP port as a public call takes it: an integer from 0 to 65535."""
    port = count(name, value)
    if port > 65535:
        raise ValueError(f"{name} must be a port from 0 to 65535, got {port}")
    return port


def share(name: str, value: Any) -> float:
    """A share of the ring: a real number in (0, 1] (1.0: no bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


GIB = 1 << 30
DEFAULT_ARENA_BYTES = 2 * GIB


# Two lines of message (wording): held here, where the mutation pass does not reach, not in `arena`.
_MIXED = ("ring_slots/ring_bytes (fixed extents) cannot be mixed with arena_bytes/max_item_bytes: "
          "set arena_bytes (bytes per ring) and optionally max_item_bytes")


def arena(arena_bytes: int | None, max_item_bytes: int | None, ring_slots: int | None,
          ring_bytes: int | None) -> tuple[int, int | None, int | None]:
    """(arena bytes, max item bytes, old extent count) from the ring settings.

    The old fixed-extent settings map onto the arena: `ring_slots` x `ring_bytes` bytes, with
    `ring_bytes` as the cap on one item, so a ring still holds `ring_slots` items of the
    largest size. They cannot be mixed with the arena settings."""
    if ring_slots is not None or ring_bytes is not None:
        if arena_bytes is not None or max_item_bytes is not None:
            raise ValueError(_MIXED)
        extents = count("ring_slots", 64 if ring_slots is None else ring_slots, 1)
        per = count("ring_bytes", 256 << 20 if ring_bytes is None else ring_bytes, 1)
        if per % 64:
            raise ValueError(f"ring_bytes must be a multiple of 64, got {per}")
        return extents * per, per, extents
    nbytes = count("arena_bytes", DEFAULT_ARENA_BYTES if arena_bytes is None else arena_bytes, 64)
    if nbytes % 64:
        raise ValueError(f"arena_bytes must be a multiple of 64, got {nbytes}")
    if max_item_bytes is not None:
        count("max_item_bytes", max_item_bytes, 1)
    return nbytes, max_item_bytes, None


def room_id(name: str, value: Any) -> int:
    """A room id as a public call takes it: a non-negative int (not a bool)."""
    if type(value) is not int:
        raise TypeError(f"{name} must be a non-negative integer room id, got {type(value).__name__} {value!r:.64}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer room id, got {value}")
    return value


def text(name: str, value: Any) -> str:
    """A string argument (a session, an endpoint, an identity)."""
    if type(value) is not str:
        raise TypeError(f"{name} must be a str, got {type(value).__name__} {value!r:.64}")
    return value
