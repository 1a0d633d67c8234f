"""The peer machine, declared once: one per receiver session the encode worker writes to.

First contact with a peer (segment open, handshake, probe) can take a minute
against a host that accepts TCP and never answers, so it never runs on the
encode loop: the transport does it at the edge, under a connect deadline, and
reports back through `poll()`. Writes go to a peer only while it is `up`.
While an `up` peer has work pending (live rooms, or ring bytes held for it) it
is probed every probe interval (the connect deadline unless set) the same way,
off the loop and under the connect deadline, so a wedged peer whose writes
simply never report goes `down` within the interval plus the connect deadline
(2x the connect deadline by default). Its first overdue write makes it
`suspect` at once.
Guards name predicate methods of the stepped object (`Peer` in
executor/core/peers.py, and its twin in the model).
"""

from __future__ import annotations

from .core import CompiledMachine

PEER_DECLARATION = {
    "name": "peer",
    "initial": "unknown",
    "states": [
        {"name": "unknown", "tags": ["waiting"]},
        {"name": "connecting", "tags": ["in_flight"]},
        {"name": "up", "tags": ["free"]},
        {"name": "suspect", "tags": ["unsure"]},
        {"name": "down", "tags": ["down"]},
    ],
    "transitions": [
        # A receiver frame names the peer: first contact starts at the edge.
        {"trigger": "contact", "source": "unknown", "dest": "connecting"},
        {"trigger": "contact", "source": "down", "dest": "down", "conditions": ["backing_off"]},
        {"trigger": "contact", "source": "down", "dest": "connecting", "unless": ["backing_off"]},
        {"trigger": "contact", "source": ["connecting", "up", "suspect"], "dest": "="},
        # The heartbeat: an up peer with work pending is probed at the edge, as first contact is;
        # writes go on meanwhile.
        {"trigger": "probe", "source": "up", "dest": "="},
        # The edge reports first contact (or the re-check of a suspect peer, or a probe).
        {"trigger": "connected", "source": ["connecting", "suspect", "up"], "dest": "up"},
        {"trigger": "refused", "source": ["connecting", "suspect", "up"], "dest": "down"},
        # No report within the connect deadline: the edge may still be waiting; we are not.
        {"trigger": "connect_expired", "source": ["connecting", "suspect", "up"], "dest": "down"},
        # Our own write deadline passed: the first overdue write makes the peer suspect (a
        # partitioned receiver's writes do not report for a minute; no more go to it meanwhile).
        {"trigger": "write_overdue", "source": "up", "dest": "suspect"},
        {"trigger": "write_overdue", "source": ["suspect", "down", "connecting"], "dest": "="},
        # Write reports. Consecutive failures past the threshold make the peer suspect:
        # no new writes until a fresh contact says it answers.
        # A write issued before the peer went down may report while a later contact runs:
        # it changes nothing there (that contact decides), and must not stop the loop.
        {"trigger": "write_ok", "source": ["up", "suspect", "down", "connecting"], "dest": "="},
        {"trigger": "write_failed", "source": "up", "dest": "suspect", "conditions": ["at_threshold"]},
        {"trigger": "write_failed", "source": "up", "dest": "up", "unless": ["at_threshold"]},
        {"trigger": "write_failed", "source": ["suspect", "down", "connecting"], "dest": "="},
    ],
    "docs": {
        "unknown": "record created for a session no frame has named before",
        "connecting": "first contact runs at the edge under the connect deadline; its rooms wait",
        "up": "contact succeeded; writes may be submitted; probed every interval while it has work pending",
        "suspect": "a write was overdue, or consecutive writes failed; re-checked at the edge, no new writes meanwhile",
        "down": "contact failed or timed out; its rooms fail at once, a later frame retries after the backoff",
    },
    "guard_docs": {
        "backing_off": "the backoff since the peer went down has not passed",
        "at_threshold": "consecutive failed writes reached the configured threshold",
    },
}

PEER = CompiledMachine("peer", PEER_DECLARATION)
