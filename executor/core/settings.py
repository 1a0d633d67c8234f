"""Checks for configuration numbers: finite, in range, or a clear error at construction.

A NaN timeout compares false with everything, so a deadline armed with it never
fires (a parked room would hold its slot forever); a negative count silently
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
