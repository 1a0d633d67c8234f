"""How the machines move each other, declared once.

A change of state in one machine obliges work elsewhere: a room that parks arms
its deadline and parks its extent; a room that concludes tells its receivers; a
peer that goes down fails its rooms. Those couplings are listed here, by name,
and nowhere else. The core (executor/core/), the spec (models/spec.py) and the
Promela generator (models/promela.py) each implement every action once and run
them through this table; a test checks that each implements exactly these.

`ON_ENTER[(machine, state)]`: actions run, in order, when the machine's object
enters `state` from another state (a self-loop enters nothing).
`ON_EVENT[(machine, event)]`: actions run after that event, whatever the states.
"""

from __future__ import annotations

ON_ENTER: dict[tuple[str, str], tuple[str, ...]] = {
    ("room", "announced"): ("arm_announce_deadline",),
    ("room", "parked"): ("park_extent", "arm_park_deadline"),
    ("room", "transferring"): ("start_writes",),
    ("room", "success"): ("conclude",),
    ("room", "failed"): ("abandon_extent", "conclude"),
    ("extent", "quarantined"): ("arm_quarantine_deadline",),
    ("peer", "up"): ("resume_rooms",),
    ("peer", "down"): ("fail_rooms",),
}

ON_EVENT: dict[tuple[str, str], tuple[str, ...]] = {
    # The last write that could land into a failed room's regions is gone with the quarantine.
    ("extent", "release"): ("release_regions",),
}

ACTION_DOCS: dict[str, str] = {
    "arm_announce_deadline": "receivers came before the sender: the room fails if no sender binds in time",
    "park_extent": "the staged chunk waits in its extent (extent: staged -> parked)",
    "arm_park_deadline": "armed once at park time; partial registrations never extend it",
    "start_writes": "check the receivers tile the rows, cancel the room's deadline, issue one write per "
                    "receiver from the extent (extent -> sending); waits while a receiver's peer is connecting",
    "conclude": "cancel the room's deadlines, tell every receiver the outcome, hand failed rooms' regions "
                "to the region book, keep a tombstone",
    "abandon_extent": "an extent holding a chunk no write was issued from goes back free (its bytes to the arena)",
    "arm_quarantine_deadline": "a write that failed or timed out may still land: the extent and its bytes are held",
    "resume_rooms": "rooms whose chunk waited for this peer's contact start their writes",
    "fail_rooms": "every live room with a receiver on this peer fails; all its receivers are told",
    "release_regions": "failed rooms' regions that waited on this extent are released",
}


# The event a deadline sends its machine's object when it passes. The core arms a timer on
# entry and cancels it when the object leaves the state (start_writes, conclude); the model
# keeps no clock: the event may happen at any time while the object stays in a state whose
# entry armed it.
DEADLINES: dict[str, str] = {
    "arm_announce_deadline": "expire",
    "arm_park_deadline": "expire",
    "arm_quarantine_deadline": "release",
}


def actions() -> frozenset[str]:
    """Every action named by the table: what each implementation must provide."""
    return frozenset(a for acts in (*ON_ENTER.values(), *ON_EVENT.values()) for a in acts)


def armed_states(machine: str, without: frozenset[str] = frozenset()) -> frozenset[str]:
    """States of `machine` whose entry arms a deadline (leaving out the actions in `without`)."""
    return frozenset(state for (m, state), acts in ON_ENTER.items()
                     if m == machine and any(a in DEADLINES and a not in without for a in acts))
