"""Drive the implementation and the spec with the same events, and compare.

`Harness` owns a real executor, manager and loopback transport (fake clock,
every write held until the harness completes it, copies gated by fences the
harness completes, and with `Config.peers` every first contact held until the
harness answers it or fires its deadline) and maps each spec event onto them. `abstract()` reads the
implementation's state back as a spec state (through its `Readback` part, models/conformance_reads.py;
its `Timing` part, models/conformance_clock.py, fires deadlines through the clock): rooms, cells, the deferred queue,
writes in flight and each receiver's region (stepped through the region
machine on every notice that receiver got, so a second outcome fails at once);
after every event it must equal, up to relabelling rooms, one of the
spec's successors for that event. Beyond the spec, `check_full_state()`
compares what the spec has no words for: each live room's frames, every
deadline against the time its event happened (each timeout a distinct value,
so a deadline armed with the wrong one, or re-armed, shows), and the bytes in
every receive buffer as room labels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epd_ring.executor.core import (
    EncodeExecutor,
    EncodeItem,
    EncodeManager,
    FakeClock,
    LoopbackTransport,
    Outcome,
    Pump,
    ReasonKind,
    ReceiverFrame,
)

from .conformance_clock import FAR, OFFSET, Timing, fires
from .conformance_reads import Readback
from .explore import canonical, event_name
from .spec import (
    RCV,
    W_FLIGHT,
    W_GHOST,
    W_LANDED,
    Config,
    Spec,
)

HIDDEN = 4
TIMEOUTS = dict(park_timeout=FAR + OFFSET["park"], announce_timeout=FAR + OFFSET["announce"],
                write_timeout=FAR + OFFSET["write"], quarantine_s=FAR + OFFSET["quarantine"],
                tombstone_ttl=1e9, connect_timeout=FAR + OFFSET["connect"],
                peer_probe_interval=FAR + OFFSET["probe"], peer_backoff=127.0,
                # The model does not move peers on write failures: neither may the implementation here.
                peer_fail_threshold=1 << 30)


# The reason kind a room fails with, by the spec event that fails it (an expiry by the state it expired
# in). The spec keeps no history: a room failed by its park deadline and one failed by an abort may be one
# spec state. The core keeps the kind in its tombstone and may branch on it later (a late frame, a late
# sender), so the harness owns it: it compares the kind after every event, and the walk keys its states by
# it (`Harness.history`), so every spec edge is walked from each history the core can tell apart.
FAILED_BY = {"abort": ReasonKind.CALLER, "tower_error": ReasonKind.TOWER, "write_unsure": ReasonKind.WRITE_TIMED_OUT,
             # the harness stages an item larger than the whole arena for a staging error
             "stage_error": ReasonKind.TOO_LARGE, "tower": ReasonKind.TOO_LARGE,
             "write_deadline": ReasonKind.WRITE_DEADLINE, "withdraw": ReasonKind.WITHDRAWN,
             **dict.fromkeys(("frame", "frame_after_backoff", "refused", "connect_expired", "probe_refused",
                              "probe_expired"), ReasonKind.PEER_DOWN),
             ("expire", "parked"): ReasonKind.PARK_TIMEOUT, ("expire", "announced"): ReasonKind.ANNOUNCE_TIMEOUT}

# Events the harness maps onto the implementation through the spec state it is in (which receiver is meant).
NEEDS_STATE = frozenset(("write_done", "write_unsure", "late_landing", "withdraw"))
_NOT_PRESENT = "checked on the implementation: not present"  # a refused trace's verdict (wording)



class Fence:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class RoomTower:
    """Every room's embedding is distinct (rows filled with the room number)."""

    num_deepstack_embeddings = 0

    def __init__(self) -> None:
        self.fail_next = False

    def image_encoder(self, items):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected tower error")
        return torch.cat([torch.full((i.n_tokens, HIDDEN), float(i.meta["room"])) for i in items])

    get_video_feature = image_encoder


class Harness:
    ROOM_BASE = 500

    def __init__(self, config: Config, tokens: int = 4, room_sizes: tuple[int, ...] | None = None,
                 plan: Sequence[tuple] = (), arms: Sequence[frozenset] = ()):
        """`tokens` rows make one cell (64 B: the arena's alignment, so an item of z cells takes exactly
        z cells); room i's item has `room_sizes[i]` cells (default: the configuration's sizes in turn).
        The spec lets the tower pick any size; receivers size their regions from the request, so here
        each room's size is fixed up front and the harness takes only that room's tower event.

        `plan`: the events this harness will take, and `arms`: the (kind, `deadline_key`) of the deadlines
        each of the first of them arms (what `arms_made` recorded on an earlier run of those events). With
        them each deadline the plan fires is the clock's next when it fires; without, `step` rebuilds the
        harness along its own events with the one to take foreseen, when that one fires a deadline that
        is not the clock's next (`_replan`)."""
        if config.variant != "project":
            raise ValueError("the implementation is the project variant")
        if (tokens * HIDDEN * 4) % 64:
            raise ValueError("a cell must be a whole number of 64-byte units")
        self.cfg = config
        self.size = tuple(room_sizes) if room_sizes is not None else self.room_sizes(config)
        if len(self.size) != config.rooms or not set(self.size) <= set(config.sizes):
            raise ValueError(f"room sizes {self.size} must give each of {config.rooms} rooms one of {config.sizes}")
        self.spec = Spec(config)
        self.state = self.spec.initial()
        self.tokens = tokens
        self.clock = FakeClock()
        self.transport = LoopbackTransport(self.clock, record=True)
        self.transport.inject("hold", count=1 << 30)  # the harness decides every write's outcome
        self.manager = EncodeManager(self.transport, self.clock, **TIMEOUTS)
        if config.peers:
            self.transport.inject_contact("hang", count=1 << 30)  # the harness answers every contact
        self.tower = RoomTower()
        # The arena is the model's cells: an extent of z cells is z * cell_bytes at a multiple of them.
        self.cell_bytes = tokens * HIDDEN * 4
        # With identities the spec's fixed share, 1/K of the arena (models/shares.py); with one, the default.
        share = {"identity_ring_share": 1.0 / config.identities} if config.identities > 1 else {}
        self.executor = EncodeExecutor(self.manager, self.tower, "cpu", arena_bytes=config.cells * self.cell_bytes,
                                       copy_fence=Fence,
                                       # the model keeps no per-peer bound of ring bytes, nor one on parked chunks
                                       peer_ring_share=1.0, parked_ring_share=1.0, max_pieces=config.pieces, **share)
        # Room i's identity: the spec's owner, named by the engine at register and by its receivers' frames.
        self.owner = self.spec.owners() if config.identities > 1 else (None,) * config.rooms
        # On the manager alone: a tick takes outcomes and deadlines; serving deferred sends and
        # finishing copies are events of their own in the spec.
        self.pump = Pump(self.manager, self.transport)
        R, N = config.rooms, config.receivers
        self.frames = []
        self.buffers = {}
        for i in range(R):
            row = []
            for k in range(N):
                session = self.session(i, k)
                rcv = self.transport.receivers.get(session) or self.transport.add_receiver(session)
                rows = tokens * self.size[i]
                buf = torch.full((rows, HIDDEN), -1.0)
                rcv.register(buf)
                self.buffers[(i, k)] = buf
                row.append(ReceiverFrame(self.room(i), session, buf.data_ptr(), 0, rows, 0, rows, HIDDEN,
                                         "torch.float32", False, N, identity=self.key(i)))
            self.frames.append(row)
        self.frames_sent = [0] * R  # the receivers' own moves: how many of each room's frames went
        self.faults = config.faults
        self.handle_room: dict[int, int] = {}
        self.handle_extent: dict[int, int] = {}
        self.ghosts: dict[int, int] = {}  # handle -> room
        self.replans = 0  # times it rebuilt itself to fire a deadline it had not foreseen (`_replan`)
        # The parts: reading the implementation back, and time (the plan, the timeouts, the clock).
        self.reads = Readback(config, self.executor, self.manager, self.transport, self.buffers, self.size,
                              self.owner, self.cell_bytes, self.ROOM_BASE, self.room, self.rid, self.session)
        self.timing = Timing(config.peers, self.manager, self.clock, self.pump, self.reads.cell, self.ROOM_BASE,
                             list(plan), list(arms))
        self.foreseen = len(plan)  # the plan's first events, known before any was taken
        self.arms_made: list[frozenset] = []  # the deadlines each event taken armed
        self.why = [""] * R  # the reason kind each room failed with, by the event that failed it (FAILED_BY)

    def room(self, i: int) -> int:
        return self.ROOM_BASE + i

    def rid(self, i: int) -> str:
        return f"r{i}"

    def key(self, i: int) -> str:
        """Room i's identity key ("" without identities: one trust domain, as without authentication)."""
        v = self.owner[i]
        return "" if v is None else f"id{v}"

    def session(self, i: int, k: int) -> str:
        # With peers, the rank-k receiver of every room is on one peer, as in the model.
        return f"p.{k}" if self.cfg.peers else f"p{i}.{k}"

    @staticmethod
    def room_sizes(config: Config) -> tuple[int, ...]:
        """Each room's item size by default: the configuration's sizes in turn."""
        return tuple(config.sizes[i % len(config.sizes)] for i in range(config.rooms))

    def _observe(self) -> None:
        """After an event: the deadlines it armed, when each is due (`Timing.record`), and its writes' handles."""
        m = self.manager
        self.timing.record(self.executor.ring.extents.values(), self.cfg.receivers)
        for h, write in self.pump.handles().items():  # transport handle -> the core's write
            w = m.writes.by_handle[write]
            if h not in self.handle_room:
                i = w.room - self.ROOM_BASE
                self.handle_room[h] = i
                self.handle_extent[h] = self.reads.cell(w.extent)

    def history(self) -> tuple[str, ...]:
        """What the core keeps of each room's past that the spec does not: the reason kind it failed with."""
        return tuple(self.why)

    def abstract(self) -> tuple:
        """The implementation as a spec state (the fault budget is the harness's count: the core has none)."""
        return self.reads.abstract(self.faults)

    @property
    def fired(self) -> dict[str, int]:
        """Deadline events fired, all through the clock and `poll()`."""
        return self.timing.fired

    def follow(self, events: Sequence[tuple]) -> None:
        """Take `events` on the implementation without checking them (they were checked when first walked)."""
        for n, ev in enumerate(events):
            self.timing.pass_time()
            self.apply(ev)
            if n + 1 == len(events) or events[n + 1][0] in NEEDS_STATE:
                self.state = self.abstract()

    def _replan(self, event: tuple) -> None:
        """Become a harness that took the same events with `event` foreseen next: the deadlines it fires are
        then the clock's next (the spec fires deadlines in any order; the clock fires the earliest)."""
        j = len(self.arms_made)
        plan = self.timing.plan
        new = Harness(self.cfg, self.tokens, self.size, plan=[*plan[:j], event], arms=self.arms_made)
        new.follow(plan[:j])
        new.timing.fired, new.replans = self.timing.fired, self.replans + 1
        self.__dict__.update(new.__dict__)

    # -- events ----------------------------------------------------------------------
    def enabled(self) -> list[tuple]:
        seen = []
        for step in self.spec.successors(self.state):
            ev = step.event
            if ev not in seen and not (ev[0] == "tower" and len(ev) > 2 and ev[2] != self.size[ev[1]]):
                seen.append(ev)
        return seen

    def apply(self, event: tuple) -> None:
        """Apply `event` to the implementation only."""
        name, *args = event
        i = args[0] if args else None
        ex, m, t, fire = self.executor, self.manager, self.transport, self.timing.fire
        j = len(self.arms_made)
        plan = self.timing.plan
        if plan[j:j + 1] != [event]:  # not the event planned (or none was): the plan is this from here on
            plan[j:] = [event]
            del self.timing.arms[j:]  # what the planned events armed says nothing of this one
            self.foreseen = min(self.foreseen, j)
        self.timing.set_timeouts(j)
        before = self.timing.armed_now()
        was = [m.room_status(self.room(k)) or "new" for k in range(self.cfg.rooms)]
        if name == "register":
            ex.register(self.rid(i), "prefill-bootstrap", 8998, self.room(i),
                        receiver=self.key(i) if self.owner[i] is not None else None)
        elif name in ("frame", "frame_after_backoff"):
            if name == "frame_after_backoff":
                # the backoff passed: set, not waited out on the clock, which would pass deadlines planned later
                m.peers.get(f"p.{self.frames_sent[i]}").retry_at = self.clock.now()
            room = m.rooms.get(self.room(i))
            parked_timer = room.timer if room is not None and room.state == "parked" else None
            m.register_receiver(self.frames[i][self.frames_sent[i]])
            self.frames_sent[i] += 1
            if parked_timer is not None and room.state == "parked" and room.timer != parked_timer:
                raise AssertionError(f"deadline-extended: a partial registration re-armed room {i}'s park deadline")
        elif name in ("tower", "tower_error", "stage_error"):
            # an item of its room's size; a staging error: one larger than the whole arena
            n = self.tokens * (self.size[i] if name != "stage_error" else self.cfg.cells + 1)
            item = EncodeItem("image", n, meta={"room": self.room(i)})
            if name == "tower_error":
                self.tower.fail_next = True
            if name != "tower":
                self.faults -= 1
            ex.execute([(self.rid(i), item)])
        elif name == "copied":
            for fence, room in ex.copy_fences():
                if room == self.room(i):
                    fence.done = True
            ex.finish_copies()
        elif name in ("write_done", "write_unsure"):
            session = self._session_for(i, args[1])
            h = min(h for h in t.held if self.handle_room.get(h) == i and t.session_of(h) == session)
            if name == "write_done":
                t.complete(h, Outcome.DONE)
            else:
                t.complete(h, Outcome.TIMED_OUT, land=False, land_later=True)
                self.ghosts[h] = i
                self.faults -= 1
            self.pump.tick()
        elif name == "late_landing":
            session = self._session_for(i, args[1])
            h = min(h for h, r in self.ghosts.items() if r == i and t.session_of(h) == session)
            del self.ghosts[h]
            t.land_ghost(h)
        elif name == "expire":
            fire([m.rooms[self.room(i)]])
        elif name == "withdraw":
            session = self._session_for(i, args[1])
            self.reads.withdrew(i, session)
            m.withdraw(self.room(i), session, **({"identity": self.key(i)} if self.owner[i] is not None else {}))
            self.faults -= 1
        elif name == "abort":
            ex.fail_rooms([self.rid(i)], RuntimeError("client abort"))
            self.faults -= 1
        elif name in ("connected", "refused"):
            assert t.answer(f"p.{i}", ok=name == "connected")
            if name == "refused":
                self.faults -= 1
            self.pump.tick()
        elif name == "connect_expired":
            peer = m.peers.get(f"p.{i}")
            fire([peer])
            self.faults -= 1
        elif name in ("probe_refused", "probe_expired"):
            peer = m.peers.get(f"p.{i}")
            fire([peer.beat])
            self.pump.flush()  # the probe's contact goes to the edge, where the harness answers it
            if name == "probe_refused":
                assert t.answer(f"p.{i}", ok=False)
                self.pump.tick()
            else:
                self.timing.pass_time()
                fire([peer])
            self.faults -= 1
        elif name == "write_deadline":
            rid = self.room(i)
            due = [w for w in m.writes.values() if w.room == rid and w.timer and not w.overdue]
            fire(due)
            self.faults -= 1
        elif name == "serve":
            ex.serve_deferred()
        elif name == "reap":
            # as the engine does: requests whose item has not gone to the tower are still pending
            ex.reap_concluded_senders({rid for rid, s in ex.senders.items() if not s.offered})
        elif name == "release":
            extent = next(e for e in ex.ring.extents.values() if self.reads.cell(e) == i)
            fire([extent])
            for h in [h for h, r in self.ghosts.items() if self.handle_extent[h] == i]:
                del self.ghosts[h]  # past the quarantine a stale write is assumed gone
                t.forget_ghost(h)
        else:
            raise ValueError(f"unknown event {event}")
        self.pump.flush()
        self._observe()
        for k, rs in enumerate(was):
            if rs not in ("success", "failed") and m.room_status(self.room(k)) == "failed":
                kind = FAILED_BY.get((name, rs)) or FAILED_BY.get(name)
                self.why[k] = kind.value if kind is not None else f"failed by {name} from {rs}"
        self.arms_made.append(frozenset((kind, key) for kind, key, _ in self.timing.armed_now() - before))

    def _session_for(self, i: int, k: int) -> str:
        """A session of room i whose (region, write) is the spec's k-th receiver (alike ones are one choice)."""
        want = self.state[0][i][RCV][k]
        for n in range(self.frames_sent[i]):
            s = self.session(i, n)
            if (self.reads.region(i, s), self.reads.write_state(i, s), self.reads.told(i, s)) == want:
                return s
        raise AssertionError(f"no receiver of room {i} is {want}")

    def step(self, event: tuple) -> tuple:
        """Apply `event` to both; raise AssertionError if the implementation leaves the spec."""
        options = [s for s in self.spec.successors(self.state) if s.event == event]
        if not options:
            raise ValueError(f"{event_name(event)} is not enabled in the spec")
        self.timing.pass_time()  # every event at its own time, before every pending deadline
        j = len(self.arms_made)
        foreseen = j < self.foreseen and self.timing.plan[j] == event
        # A probe left unanswered arms a contact and fires its deadline within the event: only a foreseen
        # one is sure to be the clock's next.
        if fires(event) and not foreseen and (event[0] == "probe_expired" or self.timing.fire_time(event) is None):
            self._replan(event)
            self.timing.pass_time()
        self.apply(event)
        check_full_state(self)
        got = self.abstract()
        # exactly one of the spec's successors: the harness keeps the spec's labelling of rooms and cells
        if got not in {s.state for s in options}:
            raise AssertionError(
                f"after {event_name(event)} the implementation is in\n  {self.spec.describe(got)}\n"
                "but the spec allows only\n" + "\n".join(f"  {self.spec.describe(s.state)}" for s in options))
        problem = self.spec.invariant(got)
        if problem:
            raise AssertionError(f"invariant {problem[0]} broken on the implementation: {problem[1]}")
        self.state = got  # one of the spec's successors, exactly
        return got


def check_full_state(h: Harness) -> None:
    """What the spec abstracts, on harness `h`'s implementation: frames, deadline values, bytes at
    receivers. Raise AssertionError."""
    m, N = h.manager, h.cfg.receivers
    assert h.reads.reasons() == h.history(), f"failed rooms' reason kinds {h.reads.reasons()}, not {h.history()}"
    for i in range(h.cfg.rooms):
        rid = h.room(i)
        room = m.rooms.get(rid)
        if room is not None:
            sent = {f.session: f for f in h.frames[i][:h.frames_sent[i]]}
            assert room.frames == sent, f"room {i}: frames {sorted(room.frames)} but {sorted(sent)} were sent"
            if room.timer:
                assert room.state in ("announced", "parked"), f"room {i} has a deadline in state {room.state}"
                want = h.timing.armed[("room", rid, room.state)]
                assert room.due == want, f"room {i} ({room.state}) due at {room.due}, not {want}"
            elif room.state in ("announced", "parked"):
                raise AssertionError(f"room {i} is {room.state} without a deadline")
        for k in range(N):
            vals = set(h.buffers[(i, k)].unique().tolist())
            assert vals <= {-1.0, float(rid)}, (
                f"receiver p{i}.{k} holds bytes of rooms {vals - {-1.0, float(rid)}}"  # pragma: no mutate (wording)
            )
            if k < h.frames_sent[i] and h.reads.region(i, h.session(i, k)) == "written":
                assert vals == {float(rid)}, f"receiver p{i}.{k} was told success but holds {vals}"
    for write, w in m.writes.by_handle.items():
        want = h.timing.armed[("write", write, "")]
        # an overdue write (its deadline fired: `write_deadline`) is still in flight, its timer spent
        assert (w.timer or w.overdue) and w.due == want, f"write {write} due at {w.due}, not {want}"
    for s in h.executor.ring.extents.values():
        if s.state == "quarantined":
            want = h.timing.armed[("extent", h.reads.cell(s), "quarantine")]
            assert s.timer and s.due == want, f"{s} released at {s.due}, not {want}"
    for _, kind, obj in h.timing.pending():
        if kind in ("connect", "probe"):
            k = h.timing.deadline_key(kind, obj)[1]
            want = h.timing.armed[(kind, k, obj.timer)]
            assert obj.due == want, f"peer p.{k}'s {kind} deadline due at {obj.due}, not {want}"
        else:  # every other kind is compared above, from the object that holds it
            assert kind in ("announce", "park", "write", "quarantine"), f"a deadline of kind {kind} is not compared"


def replay_on_implementation(trace: dict, config: Config | None = None) -> dict:
    """Replay a hazard trace (found on another variant) on our design.

    Events our design does not allow at that point are refused and skipped.
    Returns where the implementation first left the hazard's path, and what it refused.
    """
    cfg = config or Config(**{**trace["config"], "variant": "project"})
    h = Harness(cfg)
    from .explore import replay

    hazard_steps, _ = replay(trace)
    diverged_at = None
    refused = []
    for n, raw in enumerate(trace["events"], start=1):
        event = tuple(raw)
        if event not in h.enabled():
            refused.append((n, event_name(event), h.spec.describe(h.state)))
            if diverged_at is None:
                diverged_at = n
            continue
        got = h.step(event)
        if diverged_at is None and canonical(got) != canonical(hazard_steps[n][1]):
            diverged_at = n
    if diverged_at is None:
        # Same states all the way: the hazard lies in the last transition itself (e.g. a
        # re-armed deadline), which `Harness.apply` checks on the implementation and found absent.
        diverged_at = len(trace["events"])
        refused.append((diverged_at, trace["violation"], _NOT_PRESENT))
    return {"diverged_at": diverged_at, "refused": refused, "final": h.spec.describe(h.state),
            "hazard_len": len(trace["events"])}


# -- coverage: drive the implementation into every place the spec can be -----------------------
def coverage_targets(cfg: Config) -> dict:
    """Name -> predicate on spec states: every chunk location, two deferred sends, every region and
    write state, and (with items of two cells) a two-cell extent and a deferred item with a cell free.

    Predicates on states only: that each kind of deadline fires on the implementation (through the clock
    and `poll()`) is an edge, and `models.walk` walks every edge of the spec at a bound."""
    from .spec import CH, CH_NAMES, LEN, RCV as _RCV, SS

    t = {f"chunk {name}": (lambda st, c=c: any(r[CH] == c for r in st[0])) for c, name in enumerate(CH_NAMES)}
    t["two deferred sends"] = lambda st: len(st[2]) >= 2
    for g in ("offered", "written", "failed", "withdrawing", "released"):
        t[f"region {g}"] = lambda st, g=g: any(x[0] == g for r in st[0] for x in r[_RCV])
    for w, name in ((W_FLIGHT, "in flight"), (W_GHOST, "may land"), (W_LANDED, "landed late")):
        t[f"write {name}"] = lambda st, w=w: any(x[1] == w for r in st[0] for x in r[_RCV])
    if max(cfg.sizes) > 1:
        t["extent of two cells"] = lambda st: any(c[LEN] == 2 for c in st[1])
        t["deferred with a cell free"] = lambda st: bool(st[2]) and any(c[SS] == "free" for c in st[1])
    return t


def reach(cfg: Config, targets: dict, max_states: int = 200_000) -> dict[str, list[tuple]]:
    """Shortest event list reaching each target (breadth-first over the spec, no symmetry), each room's
    item of the size `Harness(cfg)` gives it."""
    sizes = Harness.room_sizes(cfg)
    spec = Spec(cfg)
    init = spec.initial()
    parent: dict[tuple, tuple] = {init: (None, None)}
    frontier = [init]
    found: dict[str, list[tuple]] = {}

    def path(st):
        out = []
        while parent[st][0] is not None:
            prev, ev = parent[st]
            out.append(ev)
            st = prev
        return out[::-1]

    while frontier and len(found) < len(targets) and len(parent) < max_states:
        nxt = []
        for st in frontier:
            for name, pred in targets.items():
                if name not in found and pred(st):
                    found[name] = path(st)
            for step in spec.successors(st):
                ev = step.event
                if ev[0] == "tower" and len(ev) > 2 and ev[2] != sizes[ev[1]]:
                    continue
                if step.state not in parent and not step.violation:
                    parent[step.state] = (st, step.event)
                    nxt.append(step.state)
        frontier = nxt
    return found
