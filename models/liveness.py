"""Liveness under named fairness: every room that began concludes, every region is released, and every
sender whose room concluded is reaped.

The spec's graph is acyclic (the rank grows on every step), so a behaviour that never
ends is a finite path that then stays in one state forever. Such a behaviour is *fair*
when no event the environment is assumed to deliver eventually is enabled in that
state: a fairness assumption says an event that stays enabled is taken. So the
property "eventually done" holds under the assumptions exactly when every reachable
state in which no fair event is enabled is done (done is stable: concluded rooms stay
concluded, released and written regions stay so). And a fair path from every state to
such a state exists by acyclicity: take fair events until none is enabled.

The events left out of every assumption are the ones the environment may withhold
forever: a client that never sends its request, a receiver that never registers, a
withdraw or abort, a write that lands after it was reported unsure, a probe. Terminal
states (nothing at all enabled) are the deadlock check's.
"""

from __future__ import annotations

from .state import CONCLUDED, CONTENT, OWNER, RCV, REG, RS, SND

# Each assumption: a short name, what it says, and the events (the spec's event names) it makes fair.
FAIRNESS = {
    "F1": ("the transport eventually reports each write, or its write deadline fires (a timeout reports the write "
           "unsure; with peers the room's write deadline fires)",
           ("write_done", "write_unsure", "write_deadline")),
    "F2": ("the tower eventually runs or fails each item, and its copy into the ring completes",
           ("tower", "tower_error", "stage_error", "copied")),
    "F3": ("every armed deadline eventually fires (announce, park, quarantine)", ("expire", "release")),
    "F4": ("the encode loop keeps running: it serves deferred sends and reaps concluded senders",
           ("serve", "reap")),
    "F5": ("with peers: a first contact or a suspect's re-check is eventually answered or its connect deadline fires",
           ("connected", "refused", "connect_expired")),
    "F6": ("with channels: each notice on its way to a receiver is eventually delivered, and each withdraw a "
           "receiver sent eventually reaches the encoder", ("deliver", "withdraw_seen")),
    "F7": ("with restarts: after an encoder restart each receiver's reclaim delay passes and the new incarnation "
           "answers its withdraws", ("reclaim", "reclaim_after_repeat")),
}

# The kinds of liveness violation, in the order a state is judged.
KINDS = ("room-never-concludes", "region-never-released", "sender-never-reaped")

# With identities (Config.identities > 1): an identity within its share is served whatever another does.
SHARE_KINDS = ("identity-starved",)

# What a variant drops: without a write deadline a write the transport never reports stays in flight.
DROPPED = {"no-write-deadline": ("F1",)}


def assumptions(variant: str) -> tuple[str, ...]:
    """The names of the fairness assumptions a variant's check makes."""
    return tuple(f for f in FAIRNESS if f not in DROPPED.get(variant, ()))


def fair_events(variant: str) -> frozenset[str]:
    return frozenset(ev for f in assumptions(variant) for ev in FAIRNESS[f][1])


def began(room: tuple) -> bool:
    """A room exists from its request or its first receiver on; one where neither came is no room."""
    return bool(room[SND] or room[REG])


def judge(state: tuple) -> tuple[str, str] | None:
    """(kind, detail) when `state`, kept forever, leaves a room unconcluded, a region unreleased or a
    concluded room's sender unreaped; else None.

    A region is settled when released, or written (a success hands the region to its receiver). A sender
    kept after its room concluded holds its request in the executor forever (F4's `reap` ends it)."""
    rooms = state[0]
    for i, r in enumerate(rooms):
        if began(r) and r[RS] not in CONCLUDED:
            return "room-never-concludes", f"room {i} stays {r[RS]}"
    for i, r in enumerate(rooms):
        for rcv in r[RCV]:  # (region, write, told), and with channels what is on the way to it
            g = rcv[0]
            if g not in ("written", "released"):
                return "region-never-released", f"room {i} is {r[RS]} but a receiver's region stays {g}"
    for i, r in enumerate(rooms):
        if r[SND] == 1 and r[RS] in CONCLUDED:
            return "sender-never-reaped", f"room {i} is {r[RS]} but its sender stays registered"
    return None


def stuck(state: tuple, steps: list, fair: frozenset[str]) -> tuple[str, str] | None:
    """The liveness verdict on a state that has successors: None when a fair event is enabled or it is done."""
    if any(st.event[0] in fair for st in steps):
        return None
    problem = judge(state)
    if problem is None:
        return None
    enabled = sorted({st.event[0] for st in steps})
    listed = ", ".join(enabled)  # pragma: no mutate (wording)
    return problem[0], f"{problem[1]} forever: only {listed} (none assumed fair) can happen"


# -- fair shares: an identity within its share is served whatever another identity does ---------------

def checks_shares(cfg) -> bool:
    """Where `starved` is a property of the design: several identities, items of one cell (with larger ones
    the free bytes can be scattered, which shares do not address: an identity may wait for another's
    extent to free merely to find a run long enough) and a cell for each identity's share."""
    return cfg.identities > 1 and cfg.sizes == (1,) and cfg.cells >= cfg.identities


def subject(state: tuple, event: tuple) -> int | None:
    """The identity an event belongs to: its room's owner, for a quarantine's end the identity its extent is
    charged to; None for the encode loop's own steps (serving deferred sends, reaping), which are everyone's."""
    if len(event) < 2:
        return None
    rooms = state[0]
    if event[0] == "release":
        c = state[1][event[1]][CONTENT]
        return rooms[c][OWNER] if c >= 0 else -2 - c
    return rooms[event[1]][OWNER]


def starved(state: tuple, steps: list, fair: frozenset[str], identities: int) -> tuple[str, str] | None:
    """The fair-share property, judged in one state: (kind, detail) when some identity v has a room that began
    and has not concluded, yet no event assumed fair is enabled that is v's own or the encode loop's.

    The fairness assumed for v is F1-F7 (above) restricted to v's rooms and extents, plus F4 (the encode loop
    runs); nothing is assumed of any other identity: its receivers, its transport and its clients may do
    anything or nothing, and its deadlines (park, announce, quarantine of its extents) may take as long as they
    like. A behaviour that stays in this state forever is then fair to v, so v's room would never conclude:
    it waits on another identity (for bytes that identity holds past its share, or behind its sends in the
    queue). "Within its share" needs no test of its own: a send past its identity's share waits only for that
    identity's own extents to free, events fair for it. `checks_shares` says where this is a property."""
    rooms = state[0]
    for v in range(identities):
        left = [i for i, r in enumerate(rooms) if r[OWNER] == v and began(r) and r[RS] not in CONCLUDED]
        if not left:
            continue
        if any(st.event[0] in fair and subject(state, st.event) in (None, v) for st in steps):
            continue
        # the other identities' events, which only the detail lists: wording, not mutated (the pragmas)
        others = sorted({st.event[0] for st in steps if subject(state, st.event) not in (None, v)})  # pragma: no mutate
        listed = ", ".join(others) or "nothing"  # pragma: no mutate (wording)
        return ("identity-starved", f"identity {v}'s room {left[0]} stays {rooms[left[0]][RS]} unless another "
                                    f"identity moves: only {listed} of theirs can happen")
    return None
