"""Slot and room state machines, declared once with `transitions`."""

from .core import CompiledMachine, Edge, InvalidTransition, build_machine
from .machines import ROOM, ROOM_CONCLUDED, ROOM_DECLARATION, SLOT, SLOT_DECLARATION

__all__ = [
    "CompiledMachine",
    "Edge",
    "InvalidTransition",
    "build_machine",
    "ROOM",
    "ROOM_CONCLUDED",
    "ROOM_DECLARATION",
    "SLOT",
    "SLOT_DECLARATION",
]
