"""Stateful property suite: the real executor, manager, loopback transport and torch tensors,
driven through every interleaving hypothesis can find.

Every write is held until a rule completes it (done, failed, timed out, or timed out and
landing later), and time moves only when a rule advances the fake clock, so deferred sends,
late and partial registrations, reaping, failures and deadlines interleave freely.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

sys.path.insert(0, str(Path(__file__).parent))
from helpers import TableTower, drive

from epd_ring.executor import (
    EncodeExecutor,
    EncodeItem,
    EncodeManager,
    FakeClock,
    LoopbackTransport,
    Outcome,
    ReceiverFrame,
    shard_rows,
)
from epd_ring.executor.core.loopback import Notice
from epd_ring.fsm import InvalidTransition
from epd_ring.fsm.core import CompiledMachine

PARK, ANNOUNCE, WRITE_T, QUARANTINE, CONNECT_T, BACKOFF = 10.0, 12.0, 20.0, 5.0, 6.0, 2.0
PEERS = ("peer0", "peer1", "peer2")  # receiver k of a room is on peer (room + k) % 3: peers are shared
MAX_ROOMS, MAX_TOMBSTONES, HIDDEN = 12, 6, 8
SENTINEL = -7.0


class RecordingTransport(LoopbackTransport):
    """Holds every write for the test to complete, and records what each write targeted."""

    def __init__(self, clock, owner):
        super().__init__(clock)
        self.owner = owner
        self.submits: list[tuple[int, int, str]] = []  # (handle, room, room status at submit)
        self.region_of: dict[int, tuple[int, str]] = {}  # handle -> (room, session) it writes into
        self.submitted_at: dict[int, float] = {}  # handle -> when it was submitted
        self.peer_at_submit: list[tuple[str, str]] = []  # (session, its peer's state at submit)

    def submit_write(self, session, bufs):
        peer = self.owner.manager.peers.get(session)
        self.peer_at_submit.append((session, peer.state if peer is not None else "none"))
        handle = super().submit_write(session, bufs)
        room = self.owner.room_of_dst.get(bufs[0][1])
        self.submits.append((handle, room, self.owner.manager.room_status(room)))
        self.region_of[handle] = (room, session)
        self.submitted_at[handle] = self.clock.now()
        return handle

    def notify(self, frame, room, status, reason=""):
        # Status goes over the control plane, which here outlives a peer whose data path died:
        # the receiver keeps every notice, so the checks on what it was told apply to it too.
        r = self.receivers.get(frame.session)
        if r is not None:
            r.notices.append(Notice(room, status, reason, self.clock.now()))


class Room:
    def __init__(self, room_id, rid, item, n, shard, deep):
        self.id, self.rid, self.item, self.n, self.shard = room_id, rid, item, n, shard
        self.frames: list[ReceiverFrame] = []
        self.sent = 0  # well-formed frames registered
        self.told_sessions: list[str] = []  # sessions that registered (and so must be told)
        self.asked: Counter = Counter()  # session -> frames it sent (each may be answered once)
        self.malformed: set[str] = set()
        self.withdrawn: Counter = Counter()  # session -> withdraws it sent (each acked once)
        self.tower_ran = False
        self.expected: torch.Tensor | None = None
        self.deep = deep
        self.park_start: float | None = None


class EncodeWorker(RuleBasedStateMachine):
    @initialize(cells=st.integers(1, 4), capped=st.booleans(), deep=st.booleans())
    def start(self, cells, capped, deep):
        self.invalid: list[InvalidTransition] = []
        original = CompiledMachine.step

        def recording_step(machine, obj, event, _orig=original, _log=self.invalid):
            try:
                return _orig(machine, obj, event)
            except InvalidTransition as exc:
                _log.append(exc)
                raise

        CompiledMachine.step = recording_step
        self._restore = lambda: setattr(CompiledMachine, "step", original)
        self.clock = FakeClock()
        self.room_of_dst: dict[int, int] = {}
        self.transport = RecordingTransport(self.clock, self)
        self.transport.inject("hold", count=1 << 30)
        self.manager = EncodeManager(self.transport, self.clock, park_timeout=PARK, announce_timeout=ANNOUNCE,
                                     write_timeout=WRITE_T, quarantine_s=QUARANTINE,
                                     max_tombstones=MAX_TOMBSTONES, tombstone_ttl=1e6, connect_timeout=CONNECT_T,
                                     peer_backoff=BACKOFF, peer_fail_threshold=2)
        self.tower = TableTower(hidden=HIDDEN, n_deep=1 if deep else 0)
        self.extent_tokens = 6
        # Mixed sizes: items of 1-8 rows share an arena of `cells` x 4 rows, so they pack, wait for
        # bytes, or (over the arena, or over a cap of 6 rows) can never fit.
        cap = self.extent_tokens * HIDDEN * 4 if capped else None
        # Driven as a worker drives it: every call flushes its effects, poll() is the pump's tick.
        self.executor = drive(EncodeExecutor(self.manager, self.tower, "cpu", arena_bytes=cells * 4 * HIDDEN * 4,
                                             max_item_bytes=cap, max_deferred=8 * cells))
        self.manager = self.executor.manager
        self.pump = self.executor.pump
        self.rooms: dict[int, Room] = {}
        self.pending: list[Room] = []  # registered, tower not yet run
        self.buffers: dict[tuple[int, str], tuple] = {}
        self.ghosts: dict[int, float] = {}  # handle -> when it reported failure
        self.unsure: list[tuple[Any, int, float]] = []  # (extent, room, report time)
        self.next_room = 0

    def teardown(self):
        try:
            if hasattr(self, "executor"):
                self.quiesce_and_check()
        finally:
            if hasattr(self, "_restore"):
                self._restore()

    # -- helpers ----------------------------------------------------------------------
    def _frame(self, room: Room, k: int) -> ReceiverFrame:
        session = self._session(room, k)
        rcv = self.transport.receivers.get(session) or self.transport.add_receiver(session)
        span = room.item.n_tokens
        start, rows = shard_rows(span, k, room.n) if room.shard else (0, span)
        main = torch.full((max(rows, 1), HIDDEN), SENTINEL)
        rcv.register(main)
        deep = None
        if room.deep:
            deep = torch.full((max(rows, 1), HIDDEN), SENTINEL)
            rcv.register(deep)
        self.buffers[(room.id, session)] = (main, deep, start, rows)
        self.room_of_dst[main.data_ptr()] = room.id
        return ReceiverFrame(room.id, session, main.data_ptr(), deep.data_ptr() if deep is not None else 0, rows,
                             start, span, HIDDEN, str(self.tower.dtype), room.deep, room.n,
                             deep_levels=1 if room.deep else 0)

    def _session(self, room: Room, k: int) -> str:
        return f"p{room.id}.{k}"  # every receiver its own peer, always reachable (EncodeWorkerWithPeers shares them)

    def _register_next(self, room: Room) -> None:
        k = len(room.frames)
        f = self._frame(room, k)
        room.frames.append(f)
        room.sent += 1
        room.told_sessions.append(f.session)
        room.asked[f.session] += 1
        self.manager.register_receiver(f)

    def _run(self, rooms: list[Room]) -> None:
        for r in rooms:
            r.tower_ran = True
            r.expected = self.tower.expected(r.item)
        self.executor.execute([(r.rid, r.item) for r in rooms])

    # -- rules ------------------------------------------------------------------------
    @precondition(lambda self: hasattr(self, "rooms") and self.next_room < MAX_ROOMS)
    @rule(tokens=st.integers(1, 8), n=st.integers(1, 3), shard=st.booleans(), early=st.sampled_from([0, 0, 1, 3]))
    def submit(self, tokens, n, shard, early):
        room_id = 1000 + self.next_room
        self.next_room += 1
        item = EncodeItem("image", tokens, meta={"seed": room_id})
        room = Room(room_id, f"req-{room_id}", item, n, shard, bool(self.tower.num_deepstack_embeddings))
        self.rooms[room_id] = room
        for _ in range(min(early, n)):
            self._register_next(room)  # receivers before the sender: announced
        self.executor.register(room.rid, "prefill", 8998, room_id)
        self.pending.append(room)

    @precondition(lambda self: hasattr(self, "pending") and self.pending)
    @rule(size=st.integers(1, 3), fail=st.booleans())
    def run_tower(self, size, fail):
        batch, self.pending = self.pending[:size], self.pending[size:]
        if fail:
            self.tower.raise_next = RuntimeError("injected tower failure")
            for r in batch:
                r.tower_ran = True
            self.executor.execute([(r.rid, r.item) for r in batch])
            for r in batch:
                assert self.manager.room_status(r.id) == "failed"  # a live sender keeps its record
        else:
            self._run(batch)

    @precondition(lambda self: hasattr(self, "pending") and self.pending)
    @rule(oversized=st.booleans())
    def cache_hit(self, oversized):
        room = self.pending.pop(0)
        room.tower_ran = True
        if oversized:
            room.item.encoded = torch.zeros(self.extent_tokens * 4, HIDDEN)
            room.item.encoded_deepstack = torch.zeros(self.extent_tokens * 4, HIDDEN) if room.deep else None
            self.executor.send_item(room.rid, room.item)
            assert self.manager.room_status(room.id) == "failed"
            return
        exp = self.tower.expected(room.item)
        room.expected = exp
        room.item.encoded = exp[:, :HIDDEN].contiguous()
        room.item.encoded_deepstack = exp[:, HIDDEN:].contiguous() if room.deep else None
        self.executor.send_item(room.rid, room.item)

    @precondition(lambda self: hasattr(self, "rooms") and any(len(r.frames) < r.n for r in self.rooms.values()))
    @rule(data=st.data())
    def receiver_registers(self, data):
        room = data.draw(st.sampled_from([r for r in self.rooms.values() if len(r.frames) < r.n]))
        self._register_next(room)

    @precondition(lambda self: hasattr(self, "rooms") and any(
        len(r.frames) < r.n and self.manager.is_parked(r.id) for r in self.rooms.values()))
    @rule(data=st.data(), wait=st.sampled_from([0.0, 3.0, 4.0]))
    def late_receiver_for_parked_chunk(self, data, wait):
        """Some time after its chunk parked, one more receiver of the room registers."""
        room = data.draw(st.sampled_from([r for r in self.rooms.values()
                                          if len(r.frames) < r.n and self.manager.is_parked(r.id)]))
        if wait:
            self._advance(wait)
            self.parked_rooms_never_outlive_their_deadline()
        if self.manager.is_parked(room.id):
            self._register_next(room)

    @precondition(lambda self: hasattr(self, "rooms") and any(r.frames for r in self.rooms.values()))
    @rule(data=st.data())
    def receiver_registers_twice(self, data):
        room = data.draw(st.sampled_from([r for r in self.rooms.values() if r.frames]))
        if self.manager.room_status(room.id) is None:
            # Its record aged out (no sender, no region a write may land in): the id is free
            # again, and a frame re-sent now would open a new room. A receiver retries only
            # while it waits, so it sends nothing here.
            return
        room.asked[room.frames[-1].session] += 1
        assert self.manager.register_receiver(room.frames[-1]) in (True, False)

    @precondition(lambda self: hasattr(self, "rooms") and any(len(r.frames) < r.n for r in self.rooms.values()))
    @rule(data=st.data(), kind=st.sampled_from(["negative_rows", "bad_dtype", "wrong_hidden"]))
    def malformed_frame(self, data, kind):
        room = data.draw(st.sampled_from([r for r in self.rooms.values() if len(r.frames) < r.n]))
        f = self._frame(room, len(room.frames))
        bad = {"negative_rows": dict(n_tokens=-1), "bad_dtype": dict(dtype="float32"),
               "wrong_hidden": dict(hidden=HIDDEN * 2)}[kind]
        room.frames.append(f)
        room.told_sessions.append(f.session)
        room.asked[f.session] += 1
        room.malformed.add(f.session)
        accepted = self.manager.register_receiver(f._replace(**bad))
        if kind != "wrong_hidden":  # well-formed on its own: it fails the room against the chunk
            assert not accepted and self.manager.room_status(room.id) in ("failed", None)

    @precondition(lambda self: hasattr(self, "transport") and self.transport.held)
    @rule(data=st.data(), outcome=st.sampled_from(["done", "failed", "timed_out", "timed_out_lands_later"]))
    def transfer_completes(self, data, outcome):
        handle = data.draw(st.sampled_from(self.transport.held))
        write = self.manager.writes.by_handle.get(self.pump.write_of(handle))
        if outcome != "done" and write is not None:
            # From this report on, the write may still land: its extent's bytes must not be
            # reused for a full quarantine.
            self.unsure.append((write.extent, write.room, self.clock.now()))
        if outcome == "done":
            self.transport.complete(handle, Outcome.DONE)
        elif outcome == "failed":
            self.transport.complete(handle, Outcome.FAILED, land=False)
        elif outcome == "timed_out":
            self.transport.complete(handle, Outcome.TIMED_OUT, land=False)
        else:
            self.transport.complete(handle, Outcome.TIMED_OUT, land=False, land_later=True)
            self.ghosts[handle] = self.clock.now()

    @precondition(lambda self: hasattr(self, "ghosts") and self.ghosts)
    @rule(data=st.data())
    def late_write_lands(self, data):
        handle = data.draw(st.sampled_from(sorted(self.ghosts)))
        del self.ghosts[handle]
        self.transport.land_ghost(handle)

    def _advance(self, dt: float) -> None:
        self.clock.advance(dt)
        self.executor.poll()
        # The design's timing assumption: a write that reported failure lands, if at
        # all, within the quarantine. Past it, the test no longer lands it.
        now = self.clock.now()
        self.ghosts = {h: t for h, t in self.ghosts.items() if now < t + QUARANTINE}

    @precondition(lambda self: hasattr(self, "clock"))
    @rule(dt=st.sampled_from([0.5, 3.0, 4.0, QUARANTINE + 0.1, CONNECT_T + 0.1, PARK + 0.1, WRITE_T + 0.1,
                              3 * WRITE_T]))
    def clock_advances(self, dt):
        self._advance(dt)

    @precondition(lambda self: hasattr(self, "rooms") and self.rooms)
    @rule(data=st.data())
    def client_aborts(self, data):
        """The encode loop fails a request's room (fail_rooms), whatever state it is in."""
        room = data.draw(st.sampled_from(sorted(self.rooms.values(), key=lambda r: r.id)))
        before = self.manager.room_status(room.id)
        self.executor.fail_rooms([room.rid], RuntimeError("client abort"))
        if before not in ("success", "failed", None) and room.rid in self.executor.senders:
            assert self.manager.room_status(room.id) == "failed"

    @precondition(lambda self: hasattr(self, "rooms") and any(r.frames for r in self.rooms.values()))
    @rule(data=st.data())
    def receiver_withdraws(self, data):
        """A receiver's request was aborted: it withdraws its region, whatever the room's state."""
        room = data.draw(st.sampled_from([r for r in self.rooms.values() if r.frames]))
        session = data.draw(st.sampled_from(sorted({f.session for f in room.frames} - set(room.withdrawn))
                                            or [room.frames[0].session]))
        before = self.manager.room_status(room.id)
        room.withdrawn[session] += 1
        self.manager.withdraw(room.id, session)
        if before not in ("success", "failed", None) and session in self.manager_sessions(room):
            assert self.manager.room_status(room.id) == "failed"

    def manager_sessions(self, room: Room) -> set:
        tomb = self.manager.tombstone(room.id)
        return set(tomb.sessions) if tomb is not None else set()

    @precondition(lambda self: hasattr(self, "executor") and self.executor.has_deferred())
    @rule(data=st.data())
    def client_aborts_deferred(self, data):
        """A request whose send waits for an extent is aborted (its item stays queued)."""
        rid = data.draw(st.sampled_from(self.executor.deferred_requests()))
        self.executor.fail_rooms([rid], RuntimeError("client abort while deferred"))

    @precondition(lambda self: hasattr(self, "executor"))
    @rule()
    def poll(self):
        self.executor.poll()

    @precondition(lambda self: hasattr(self, "executor"))
    @rule()
    def serve_deferred(self):
        self.executor.serve_deferred()

    @precondition(lambda self: hasattr(self, "executor"))
    @rule()
    def reap(self):
        pending = {r.rid for r in self.pending}
        self.executor.reap_concluded_senders(pending)
        for rid, sender in self.executor.senders.items():
            status = self.manager.room_status(sender.room)
            assert rid in pending or status not in ("success", "failed"), f"{rid} ({status}) was not reaped"

    # -- invariants -------------------------------------------------------------------
    @invariant()
    def no_undeclared_transition(self):
        if hasattr(self, "invalid"):
            assert not self.invalid, self.invalid

    @invariant()
    def delivered_bytes_are_the_rooms_own(self):
        if not hasattr(self, "rooms"):
            return
        h = HIDDEN
        for room in self.rooms.values():
            status = self.manager.room_status(room.id)
            for f in room.frames:
                main, deep, start, rows = self.buffers[(room.id, f.session)]
                if not rows:
                    continue
                got = main[:rows] if deep is None else torch.cat([main[:rows], deep[:rows]], dim=1)
                untouched = bool((got == SENTINEL).all())
                if status == "success" and f.session in [x.session for x in room.frames[:room.n]]:
                    assert room.expected is not None and torch.equal(got, room.expected[start:start + rows]), \
                        f"room {room.id}: {f.session} got bytes that are not its tower output"
                elif not untouched:
                    assert room.expected is not None and torch.equal(got, room.expected[start:start + rows]), \
                        f"room {room.id} ({status}): {f.session} got another room's bytes"
        _ = h

    @invariant()
    def unsure_writes_keep_their_bytes(self):
        if not hasattr(self, "unsure"):
            return
        now = self.clock.now()
        self.unsure = [u for u in self.unsure if now < u[2] + QUARANTINE]
        ring = self.executor.ring
        for ext, room, _ in self.unsure:
            assert ext.state != "free" and ext.room == room and ring.extents.get(ext.index) is ext, (
                f"{ext} is {ext.state} (room {ext.room}) within the quarantine of an unsure write of room {room}")
            # its bytes are the arena's live extent still: no other extent was handed any of them
            assert (ext.offset, ring.main_arena.extent_bytes(ext.offset)) in ring.main_arena.live_extents()

    @invariant()
    def writes_only_for_transferring_rooms(self):
        if hasattr(self, "transport"):
            for handle, room, status in self.transport.submits:
                assert status == "transferring", f"write {handle} for room {room} issued while {status}"

    @invariant()
    def writes_only_to_peers_that_are_up(self):
        if hasattr(self, "transport"):
            for session, state in self.transport.peer_at_submit:
                assert state == "up", f"a write went to {session} while its peer was {state}"
            # A write to a session never reached is first contact inside the submit call: on
            # Mooncake, a handshake that holds the loop up to a minute.
            assert self.transport.unreached_writes == 0, "a write went to a peer that was never contacted"

    @invariant()
    def held_and_parked_bytes_add_up(self):
        # The peer share and the parked bound decide from running totals: a total that drifts from
        # what is held (a byte given back twice, or never) would bound the ring wrongly for good.
        if not hasattr(self, "manager"):
            return
        m, peers = self.manager, self.manager.peers
        for peer in peers.by_session.values():
            assert peer.held == sum(peer.holds.values()) and all(n > 0 for n in peer.holds.values()), peer
        assert peers.held_total == sum(p.held for p in peers.by_session.values())
        assert peers.per_identity == Counter(p.identity for p in peers.by_session.values())
        assert m.parked_bytes == sum(r.parked_bytes for r in m.rooms.values())

    @invariant()
    def rooms_of_down_peers_are_concluded(self):
        if not hasattr(self, "manager"):
            return
        down = {s for s, p in self.manager.peers.by_session.items() if p.state == "down"}
        if down:
            for room in self.manager.rooms.values():
                assert not down & set(room.frames), f"room {room.id} is {room.state} with a down peer"

    @invariant()
    def extent_accounting_adds_up(self):
        """The ring's live extents are exactly the arenas' live extents: none free, none overlapping."""
        if not hasattr(self, "executor"):
            return
        ring = self.executor.ring
        live = list(ring.extents.values())
        assert all(e.state != "free" and ring.extents[e.index] is e for e in live)
        for arena, at in ((ring.main_arena, lambda e: e.offset), (ring.deep_arena, lambda e: e.deep_offset)):
            if arena is None:
                continue
            held = sorted((at(e), arena.extent_bytes(at(e))) for e in live if at(e) >= 0)
            assert held == arena.live_extents(), (held, arena.live_extents())
            assert all(a + n <= b for (a, n), (b, _) in zip(held, held[1:]))
            assert not held or sum(held[-1]) <= arena.capacity
            assert arena.in_use + arena.free_bytes == arena.capacity

    @invariant()
    def records_stay_bounded(self):
        if hasattr(self, "manager"):
            assert len(self.manager.tombstones) <= MAX_TOMBSTONES
            # Records pinned past the cap are held by live senders, which reaping bounds, or by
            # regions a write may still land in, which writes in flight and quarantines bound.
            assert len(self.manager.pinned) <= len(self.executor.senders) + len(self.manager.regions._per_room)
            assert len(self.executor.senders) <= MAX_ROOMS
            assert self.manager.deadlines.heap_size <= 8 * (MAX_ROOMS * 4 + 8)

    @invariant()
    def live_senders_find_their_room(self):
        """A record is never evicted while its sender is registered (the tombstone cap skips it)."""
        if hasattr(self, "executor"):
            for rid, sender in self.executor.senders.items():
                assert self.manager.room_status(sender.room) is not None, f"{rid}: room {sender.room} forgotten"

    @invariant()
    def receivers_of_concluded_rooms_are_told(self):
        if not hasattr(self, "rooms"):
            return
        for room in self.rooms.values():
            status = self.manager.room_status(room.id)
            if status not in ("success", "failed"):
                continue
            for session in room.told_sessions:
                told = self.transport.receivers[session].statuses(room.id)
                assert told, f"room {room.id} is {status} but {session} was never told"

    @invariant()
    def receivers_told_one_outcome_and_the_right_one(self):
        """Each frame gets at most one answer, all answers agree, and they match the room."""
        if not hasattr(self, "rooms"):
            return
        for room in self.rooms.values():
            status = self.manager.room_status(room.id)
            accepted = [f.session for f in room.frames[:room.n] if f.session not in room.malformed]
            for session, asked in room.asked.items():
                told = self.transport.receivers[session].statuses(room.id)
                assert len(told) <= asked, f"room {room.id}: {session} told {told} for {asked} frame(s)"
                assert len(set(told)) <= 1, f"room {room.id}: {session} told different outcomes {told}"
                if told and told[0] == "success":
                    assert status in ("success", None) and session in accepted, (
                        f"room {room.id} ({status}): {session} told success")
                if told and status == "failed":
                    assert told[0] == "failed", f"room {room.id} failed but {session} was told {told}"

    @invariant()
    def released_regions_take_no_more_writes(self):
        """After `released` or a withdraw ack, no write into that region is in flight or may land."""
        if not hasattr(self, "transport"):
            return
        t = self.transport
        live = [t.region_of[h] for h in t.held] + [t.region_of[h] for h in self.ghosts]
        for room, session in live:
            done = t.receivers[session].releases(room)
            assert not done, f"room {room}: {session} was told {done} while a write into its region may land"

    @invariant()
    def write_deadlines_are_their_value(self):
        """Each write in flight is due exactly `write_timeout` after it was submitted, not before."""
        if hasattr(self, "manager"):
            for h, write in self.pump.handles().items():
                w = self.manager.writes.by_handle[write]
                at = self.transport.submitted_at.get(h)
                if w.timer and at is not None:
                    assert w.due == at + WRITE_T, f"write {h} due at {w.due}, submitted at {at}"

    @invariant()
    def parked_rooms_never_outlive_their_deadline(self):
        if not hasattr(self, "rooms"):
            return
        now = self.clock.now()
        for room in self.rooms.values():
            if self.manager.is_parked(room.id):
                if room.park_start is None:
                    room.park_start = now
                assert now - room.park_start < PARK, f"room {room.id} parked for {now - room.park_start} s"
                due = self.manager.deadline_of(room.id)
                assert due == room.park_start + PARK, (
                    f"room {room.id} parked at {room.park_start} must fail at {room.park_start + PARK}, not {due}")
            else:
                room.park_start = None

    # -- teardown ---------------------------------------------------------------------
    def quiesce_and_check(self):
        ex, m, t = self.executor, self.manager, self.transport
        if self.pending:
            self._run(self.pending)
            self.pending = []
        for _ in range(50):
            for handle in t.held:
                t.complete(handle, Outcome.DONE)
            self.ghosts.clear()
            self.clock.advance(WRITE_T + PARK + QUARANTINE)
            ex.poll()
            if not t.held and not m.rooms and not ex.has_deferred() and ex.ring.live == 0:
                break
        assert not m.rooms, f"rooms never concluded: {m.snapshot()}"
        assert ex.ring.live == 0 and ex.ring.counts() == Counter(), ex.dump_state()
        assert ex.ring.main_arena.free_extents() == [(0, ex.ring.main_arena.capacity)]  # coalesced whole again
        assert not ex.has_deferred() and not any(m.is_parked(r) for r in self.rooms)
        for room in self.rooms.values():
            for session in room.told_sessions:
                told = t.receivers[session].statuses(room.id)
                assert told, f"{session} of room {room.id} never told"
                releases = t.receivers[session].releases(room.id)
                if session in room.withdrawn:
                    assert "withdrawn" in releases, f"room {room.id}: withdraw of {session} never acknowledged"
                elif "failed" in told:
                    assert "released" in releases, f"room {room.id}: {session} told failed, never released"
                assert len(releases) <= room.asked[session] + room.withdrawn[session], (
                    f"room {room.id}: {session} got {releases}")
        self.delivered_bytes_are_the_rooms_own()


TestEncodeWorker = EncodeWorker.TestCase


class EncodeWorkerWithPeers(EncodeWorker):
    """The same suite on receivers that share three peers, with peer faults: first contact hangs,
    is refused or answers late, a hung contact answers (maybe after its deadline), a peer dies and
    recovers. A separate machine, so the base suite's sequences (and its mutant kills) stay as they are."""

    def _session(self, room: Room, k: int) -> str:
        return PEERS[(room.id + k) % len(PEERS)]

    # -- peers: first contact hangs, is refused or answers late; a peer dies and recovers --
    @precondition(lambda self: hasattr(self, "transport"))
    @rule(session=st.sampled_from(PEERS),
          kind=st.sampled_from(["hang", "refuse", "slow", "answer", "dies", "recovers"]),
          delay=st.sampled_from([0.0, 1.0, CONNECT_T + 1]), ok=st.booleans())
    def peer_misbehaves(self, session, kind, delay, ok):
        t = self.transport
        rcv = t.receivers.get(session) or t.add_receiver(session)
        if kind in ("hang", "refuse", "slow"):  # the next contact with the peer
            t.inject_contact(kind, session=session, delay=delay)
        elif kind == "answer":  # a hung contact answers after all, maybe after its deadline
            t.answer(session, ok=ok)
        elif kind == "dies":
            rcv.kill()
        else:
            rcv.revive()


TestEncodeWorkerWithPeers = EncodeWorkerWithPeers.TestCase
