"""Every declared transition of both machines, refusal of undeclared ones, and
agreement of the compiled table with the `transitions` Machine it came from."""

from __future__ import annotations

import itertools

import pytest
from transitions import MachineError

from epd_ring.fsm import PEER, REGION, ROOM, SLOT, InvalidTransition, build_machine
from epd_ring.fsm.core import CompiledMachine

MACHINES = [SLOT, ROOM, REGION, PEER]


class Subject:
    """A stepped object whose guards return fixed values."""

    def __init__(self, state, truth):
        self.state = state
        for name, value in truth.items():
            setattr(self, name, (lambda v: (lambda: v))(value))


def valuations(machine: CompiledMachine):
    for values in itertools.product([False, True], repeat=len(machine.guards)):
        yield dict(zip(machine.guards, values))


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_every_declared_edge_is_taken_when_its_guards_hold(machine):
    for edge in machine.edges:
        taken = False
        for truth in valuations(machine):
            if not all(truth[g] is want for g, want in edge.guards):
                continue
            subject = Subject(edge.source, truth)
            # Earlier edges for the same (source, event) win, as in transitions.
            expected = machine.destinations(edge.source, edge.event, truth)
            assert machine.step(subject, edge.event) == expected == subject.state
            taken = taken or expected == edge.dest
        assert taken, f"{machine.name}: edge {edge} is shadowed by an earlier one"


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_undeclared_transitions_raise_naming_machine_state_and_event(machine):
    refused = 0
    for state, event in itertools.product(machine.states, machine.events):
        if machine.allowed(state, event):
            continue
        subject = Subject(state, {g: True for g in machine.guards})
        with pytest.raises(InvalidTransition) as info:
            machine.step(subject, event)
        msg = str(info.value)
        assert machine.name in msg and repr(state) in msg and repr(event) in msg
        assert subject.state == state  # nothing moved
        refused += 1
    assert refused > 0


def test_guard_that_holds_nowhere_is_refused_not_ignored():
    subject = Subject("sending", {"writes_pending": False, "write_unsure": False})
    assert SLOT.step(subject, "settle") == "free"
    # No valuation leaves `settle` without a match, so check refusal on a room guard.
    room = Subject("registered", {"all_receivers": False})
    assert ROOM.step(room, "add_receiver") == "registered"
    with pytest.raises(InvalidTransition, match="'bind_sender' is not allowed in state 'registered'"):
        ROOM.step(room, "bind_sender")


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_compiled_table_agrees_with_the_transitions_machine(machine):
    """For every state, event and guard valuation, both give the same answer."""

    class Model:
        pass

    checked = 0
    for truth in valuations(machine):
        model = Model()
        for name, value in truth.items():
            setattr(model, name, (lambda v: (lambda: v))(value))
        real = build_machine(machine.declaration, model=model)
        for state, event in itertools.product(machine.states, machine.events):
            real.set_state(state, model=model)
            try:
                moved = getattr(model, event)()
                real_dest = model.state if moved else None
            except MachineError:
                real_dest = None
            assert machine.destinations(state, event, truth) == real_dest, (state, event, truth)
            checked += 1
    assert checked == len(machine.states) * len(machine.events) * 2 ** len(machine.guards)


def test_slot_machine_has_the_states_safety_needs():
    assert {"free", "staged", "sending", "parked", "quarantined", "retired"} <= set(SLOT.states)
    assert SLOT.tags["quarantined"] == ("unsure",)
    assert SLOT.tags["retired"] == ("terminal",)
    # Only quarantine expiry, an abandon (no write issued) or a clean settle free a slot.
    into_free = {(e.source, e.event) for e in SLOT.edges if e.dest == "free"}
    assert into_free == {("copying", "abandon"), ("staged", "abandon"), ("parked", "abandon"),
                         ("sending", "settle"), ("quarantined", "release")}
    # A sending slot never goes straight to free when a write was unsure.
    assert SLOT.destinations("sending", "settle", {"writes_pending": False, "write_unsure": True}) == "quarantined"


def test_room_failure_is_sticky_and_status_only_moves_forward():
    concluded = {"success", "failed"}
    for edge in ROOM.edges:
        if edge.source in concluded:
            assert edge.dest == edge.source, edge
    assert ROOM.destinations("failed", "fail", {"all_receivers": True}) == "failed"
    assert ROOM.destinations("success", "fail", {"all_receivers": True}) is None


def test_every_state_has_a_doc_and_a_tag():
    for machine in MACHINES:
        for state in machine.states:
            assert machine.docs.get(state), (machine.name, state)
            assert machine.tags[state], (machine.name, state)


def test_peer_takes_writes_only_when_up_and_comes_back_only_through_contact():
    # Only a successful contact (first contact, or the re-check of a suspect peer) leads to `up`.
    into_up = {(e.source, e.event) for e in PEER.edges if e.dest == "up" and e.source != "up"}
    assert into_up == {("connecting", "connected"), ("suspect", "connected")}
    # A down peer leaves `down` only for `connecting`, and only once its backoff passed.
    out_of_down = {(e.event, e.dest, e.guards) for e in PEER.edges if e.source == "down" and e.dest != "down"}
    assert out_of_down == {("contact", "connecting", (("backing_off", False),))}
    # A missed connect deadline takes the peer down from wherever contact was running.
    assert {e.source for e in PEER.edges if e.event == "connect_expired"} == {"connecting", "suspect"}
    assert PEER.destinations("up", "write_failed", {"at_threshold": True, "backing_off": False}) == "suspect"
    assert PEER.destinations("up", "write_failed", {"at_threshold": False, "backing_off": False}) == "up"
    with pytest.raises(InvalidTransition, match="peer machine.*'connected' is not allowed in state 'up'"):
        PEER.step(Subject("up", {}), "connected")
