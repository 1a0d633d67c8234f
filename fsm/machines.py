"""The extent and room machines, declared once.

Everything else (runtime stepping, diagrams, the formal model) is derived from
these two declarations. Guards name predicate methods of the object stepped:
`Extent` and `Room` in the executor, and their abstract twins in the model.
"""

from __future__ import annotations

from .core import CompiledMachine

# Tags give each state its meaning for review: where an extent's bytes may still be
# read (in_flight), where they may be read by a write we lost track of (unsure),
# and where nothing will happen any more (terminal).
EXTENT_DECLARATION = {
    "name": "extent",
    "initial": "free",
    "states": [
        {"name": "free", "tags": ["free"]},
        {"name": "copying", "tags": ["in_flight"]},
        {"name": "staged", "tags": ["in_flight"]},
        {"name": "parked", "tags": ["in_flight"]},
        {"name": "sending", "tags": ["in_flight"]},
        {"name": "quarantined", "tags": ["unsure"]},
        {"name": "retired", "tags": ["terminal"]},
    ],
    "transitions": [
        # Leased from the arena with the item's size; the embedding is being copied in (on CUDA
        # the copy is asynchronous and must finish before any write may read the extent).
        {"trigger": "lease", "source": "free", "dest": "copying"},
        {"trigger": "copied", "source": "copying", "dest": "staged"},
        # Receivers are not all registered: the chunk waits in the extent.
        {"trigger": "park", "source": "staged", "dest": "parked"},
        {"trigger": "send", "source": ["staged", "parked"], "dest": "sending"},
        # No write was ever issued from the extent, so nothing can still read it.
        {"trigger": "abandon", "source": ["copying", "staged", "parked"], "dest": "free"},
        # One write from the extent reported an outcome (or hit its own deadline).
        {"trigger": "settle", "source": "sending", "dest": "free",
         "unless": ["writes_pending", "write_unsure"]},
        {"trigger": "settle", "source": "sending", "dest": "sending",
         "conditions": ["writes_pending"]},
        {"trigger": "settle", "source": "sending", "dest": "quarantined",
         "conditions": ["write_unsure"], "unless": ["writes_pending"]},
        # A failed or timed-out write may still land later: reuse only after the
        # quarantine deadline.
        {"trigger": "release", "source": "quarantined", "dest": "free"},
        {"trigger": "retire", "source": "free", "dest": "retired"},
    ],
    "docs": {
        "free": "its bytes are back in the arena; they may be leased and rewritten",
        "copying": "leased; the embedding is being copied in (async on CUDA)",
        "staged": "holds a complete chunk; no write issued yet",
        "parked": "holds a chunk whose room still waits for receivers",
        "sending": "writes from the extent are in flight",
        "quarantined": "a write failed or timed out and may still land; held until the quarantine deadline",
        "retired": "ring closed; never leased again",
    },
    "guard_docs": {
        "writes_pending": "some write from this extent has not reported yet",
        "write_unsure": "some write from this extent failed or timed out",
    },
}

ROOM_DECLARATION = {
    "name": "room",
    "initial": "new",
    "states": [
        {"name": "new", "tags": ["waiting"]},
        {"name": "announced", "tags": ["waiting"]},
        {"name": "registered", "tags": ["waiting"]},
        {"name": "ready", "tags": ["waiting"]},
        {"name": "parked", "tags": ["in_flight"]},
        {"name": "transferring", "tags": ["in_flight"]},
        {"name": "success", "tags": ["terminal"]},
        {"name": "failed", "tags": ["terminal"]},
    ],
    "transitions": [
        # The encode request for the room was registered (its sender).
        {"trigger": "bind_sender", "source": "new", "dest": "registered"},
        {"trigger": "bind_sender", "source": "announced", "dest": "ready",
         "conditions": ["all_receivers"]},
        {"trigger": "bind_sender", "source": "announced", "dest": "registered",
         "unless": ["all_receivers"]},
        # A receiver's registration frame (k of N).
        {"trigger": "add_receiver", "source": "new", "dest": "announced"},
        {"trigger": "add_receiver", "source": "announced", "dest": "announced"},
        {"trigger": "add_receiver", "source": "registered", "dest": "ready",
         "conditions": ["all_receivers"]},
        {"trigger": "add_receiver", "source": "registered", "dest": "registered",
         "unless": ["all_receivers"]},
        {"trigger": "add_receiver", "source": "parked", "dest": "transferring",
         "conditions": ["all_receivers"]},
        {"trigger": "add_receiver", "source": "parked", "dest": "parked",
         "unless": ["all_receivers"]},
        # Late frames after the room concluded: the receiver is told the outcome.
        {"trigger": "add_receiver", "source": "success", "dest": "success"},
        {"trigger": "add_receiver", "source": "failed", "dest": "failed"},
        # The room's chunk is staged in an extent.
        {"trigger": "stage", "source": "registered", "dest": "parked"},
        {"trigger": "stage", "source": "ready", "dest": "transferring"},
        # Every receiver's write completed.
        {"trigger": "written", "source": "transferring", "dest": "success"},
        # A deadline passed: parked too long, or receivers came but the sender never did.
        {"trigger": "expire", "source": ["announced", "parked"], "dest": "failed"},
        # Any other failure. Failure is sticky: failing again changes nothing.
        {"trigger": "fail",
         "source": ["new", "announced", "registered", "ready", "parked", "transferring", "failed"],
         "dest": "failed"},
    ],
    "docs": {
        "new": "record created, no event applied yet",
        "announced": "receivers registered before the sender; deadline armed",
        "registered": "sender registered; k of N receivers, no chunk yet",
        "ready": "sender registered and all N receivers; waiting for the chunk",
        "parked": "chunk staged, k < N receivers; deadline armed, not extended by partial registrations",
        "transferring": "writes to all N receivers in flight",
        "success": "all N receivers written and told Success",
        "failed": "every receiver, late ones included, is told Failed; no write is issued",
    },
    "guard_docs": {
        "all_receivers": "N distinct receivers have registered",
    },
}

EXTENT = CompiledMachine("extent", EXTENT_DECLARATION)
ROOM = CompiledMachine("room", ROOM_DECLARATION)

ROOM_CONCLUDED = frozenset(ROOM.states_tagged("terminal"))
