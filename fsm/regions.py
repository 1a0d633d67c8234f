"""The receive region machine: the prefill side of one room, at one receiver.

A receiver offers a region of its registered buffer for a room (its frame) and
must not read it before it is told Success, nor reuse it while a write into it
may still land. A Failed room's write may land late (a timed-out one-sided
write), so Failed is not the end: the encoder sends a release notice once no
write into the region can land (its write reported, or its extent's quarantine
ended). A receiver whose request was aborted withdraws the region; the encoder
fails the room and acknowledges the withdraw, again only once nothing can land.
"""

from __future__ import annotations

from .core import CompiledMachine

REGION_DECLARATION = {
    "name": "region",
    "initial": "offered",
    "states": [
        {"name": "offered", "tags": ["in_flight"]},
        {"name": "written", "tags": ["waiting"]},
        {"name": "failed", "tags": ["unsure"]},
        {"name": "withdrawing", "tags": ["unsure"]},
        {"name": "released", "tags": ["free"]},
    ],
    "transitions": [
        # Outcome notices: exactly one per region.
        {"trigger": "success", "source": "offered", "dest": "written"},
        {"trigger": "failure", "source": "offered", "dest": "failed"},
        # The receiver's request was aborted: it asks the encoder to stop.
        {"trigger": "withdraw", "source": "offered", "dest": "withdrawing"},
        # An outcome sent before the encoder saw the withdraw: its bytes are not used.
        {"trigger": "success", "source": "withdrawing", "dest": "withdrawing"},
        {"trigger": "failure", "source": "withdrawing", "dest": "withdrawing"},
        # Success means every write into the region reported done: read it, then reuse it.
        {"trigger": "consume", "source": "written", "dest": "released"},
        # No write into the region can land any more.
        {"trigger": "release", "source": ["failed", "withdrawing"], "dest": "released"},
        {"trigger": "ack", "source": "withdrawing", "dest": "released"},
        # An ack that crossed a release notice on the wire.
        {"trigger": "ack", "source": "released", "dest": "released"},
    ],
    "docs": {
        "offered": "frame sent; the encoder may write into the region; nothing told yet",
        "written": "told Success: every write into it reported done; the bytes are the room's",
        "failed": "told Failed: a write may still land; neither read nor reused",
        "withdrawing": "the receiver withdrew; a write may still land until the encoder acknowledges",
        "released": "no write into it can land: the memory may be reused",
    },
}

REGION = CompiledMachine("region", REGION_DECLARATION)

# What each notice from the encoder steps (statuses on the control plane).
NOTICE_EVENTS = {"success": "success", "failed": "failure", "released": "release", "withdrawn": "ack"}
OUTCOMES = frozenset(("success", "failed"))
