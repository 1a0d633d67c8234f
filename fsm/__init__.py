"""Extent, room, receive region and peer state machines, declared once with `transitions`."""

from .core import CompiledMachine, Edge, InvalidTransition, build_machine
from .machines import EXTENT, EXTENT_DECLARATION, ROOM, ROOM_CONCLUDED, ROOM_DECLARATION
from .peer import PEER, PEER_DECLARATION
from .regions import REGION, REGION_DECLARATION

__all__ = [
    "CompiledMachine",
    "Edge",
    "InvalidTransition",
    "PEER",
    "PEER_DECLARATION",
    "build_machine",
    "REGION",
    "REGION_DECLARATION",
    "ROOM",
    "ROOM_CONCLUDED",
    "ROOM_DECLARATION",
    "EXTENT",
    "EXTENT_DECLARATION",
]
