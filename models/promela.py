"""The spec as a Promela model, checked by SPIN: an engine independent of explore.py.

`generate(config)` writes Promela for one bounded configuration. The room,
extent and region moves are emitted from the compiled `fsm/` tables (`ROOM.table`,
`EXTENT.table`, `REGION.table`: every source, event, guard and destination, first
declared edge first), and the states and their order from the declarations.
What a move obliges elsewhere comes from fsm/couplings.py: each action is one
inline (`ACTIONS`), and every move (`move_room_<event>`, `move_extent_<event>`)
runs the actions the table lists for the state it enters and the event it takes.
The events of the environment (tower, frames, copies, writes, deadlines, aborts,
withdraws, serving deferred sends, reap, release) follow the families of
`models/events.py`, one function and one Promela text each in
models/promela_events.py, with the same variant switches. With
`Config(regions=True)` (the default) each room also carries its receivers'
regions and where the write into each is, and the encoder's notices (outcome,
release, withdraw ack) step them through `REGION`'s table, as in the spec. Nothing here executes Python spec code: SPIN
searches its own compiled state space, so a slip in either engine shows up as a
disagreement.

The model applies the explorer's symmetry reduction itself: after every event a
`d_step` (models/promela_search.py) relabels rooms and extents into the same canonical order as
`explore.canonical` (rooms sorted by everything about them, their receivers
sorted first as the spec keeps them, used extents in their rooms' order, unused
extents by state). Each event is one atomic step and SPIN
does not store states inside atomic steps, so for a configuration without a
violation SPIN stores exactly the explorer's canonical states, a second
agreement check besides the verdict.

`epd_ring.executor.tools.spin.check(config)` (a tool: it runs processes) runs `spin -a`, gcc and
`pan` (exhaustive, no hash compaction or bitstate), once per kind of violation: a run asserts every kind not yet found
and treats the found ones as dead ends (as the explorer does: a bad state is
reported, not explored), so the set of kinds found is the explorer's set.
Each SPIN trail is replayed with `spin -t`, whose printfs give the events and
canonical states, and rebuilt on the Python spec into a concrete, readable trace
(which also checks that SPIN's steps are steps of the spec).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from epd_ring.fsm import EXTENT, PEER, REGION, ROOM, couplings
from epd_ring.fsm.regions import NOTICE_EVENTS

from . import liveness, promela_events as events, promela_peers as peers, promela_shares as shares
from .explore import _transition_check, canonical
from .promela_search import SEARCH
from .seed import SeedSpec
from .spec import _REGION_RANK, CH_NAMES, CONCLUDED, PEER_VARIANTS, W_FLIGHT, W_GHOST, W_IDLE, W_LANDED, Config, Spec
from .state import CHAN_CAP, NOTICE_CODE, STAGEABLE, TOLD_NONE, TOLD_TWICE, W_STRAY, runs

# Kinds of violation, in the order the spec checks them; codes are 1-based.
KINDS = ("crash", "overwrite-under-late-write", "overwrite-under-write", "overwrite-under-chunk",
         "receiver-not-told", "success-without-all-writes", "write-for-concluded-room", "deadline-extended",
         "deadlock", "failure-not-sticky", "status-not-forward", "model-cycle",
         "write-into-released-region", "success-under-write", "wrong-outcome", "overlap-of-busy-extent",
         "room-of-down-peer-live", "told-twice", *liveness.KINDS, *liveness.SHARE_KINDS)
CODE = {k: n + 1 for n, k in enumerate(KINDS)}

# States are numbered in sorted name order, so a numeric comparison in the
# canonical sort orders rooms exactly as explore.canonical's tuple comparison does.
ROOM_STATES = tuple(sorted(ROOM.states))
EXTENT_STATES = tuple(sorted(EXTENT.states))  # coded 1.. (0 sorts first: "no extent", as "" does)
# A receiver's region is coded 1.. in name order (0: no receiver registered in that place), and
# sorted with its write's place (W_*) as region * 4 + write, which is the order of spec's (name, write) pairs.
REGION_STATES = tuple(sorted(REGION.states))
# The outcome a receiver was told (state.TOLD_*), coded 0.. in the order the spec's values sort.
TOLD_VALUES = (TOLD_NONE, "failed", "success", TOLD_TWICE)
assert list(TOLD_VALUES) == sorted(TOLD_VALUES)
NONE = 255
HALTS = {0: None, 1: "crash", 2: "spin"}
EVENTS = ("register", "frame", "tower", "tower_error", "stage_error", "copied", "write_done", "write_unsure",
          "late_landing", "expire", "abort", "serve", "reap", "release", "withdraw", *peers.EVENTS,
          "deliver", "withdraw_seen")

# Promela for each guard named in the declarations, given the stepped object.
ROOM_GUARDS = {"all_receivers": "({allr})"}
EXTENT_GUARDS = {"writes_pending": "({pend})", "write_unsure": "cell[{x}].unsure"}


def _rs(name: str) -> str:
    return f"R_{name}"


def _ss(name: str) -> str:
    return f"S_{name}"


def _gs(name: str) -> str:
    return f"G_{name}"


def _chain(options, guards: dict, assign, fmt: dict, bug: str) -> str:
    """Nested if/else over one (state, event)'s edges: the first whose guards hold wins."""
    if not options:
        return f'printf("MODELBUG {bug}\\n"); assert(false)'
    (dest, conds), rest = options[0], options[1:]
    if not conds:
        return assign(dest)
    expr = " && ".join(guards[g].format(**fmt) if want else f"!{guards[g].format(**fmt)}" for g, want in conds)
    return f"if :: {expr} -> {assign(dest)} :: else -> {_chain(rest, guards, assign, fmt, bug)} fi"


def _machine_inlines(drop_guard: tuple[str, str, str] | None) -> str:
    """One inline per (machine, event), emitted from the compiled declaration tables."""
    out = []

    def table(machine):
        t = {}
        for (src, ev), options in machine.table.items():
            if drop_guard and drop_guard[0] == machine.name and drop_guard[1] == ev:
                options = tuple((d, tuple(g for g in gs if g[0] != drop_guard[2])) for d, gs in options)
            t.setdefault(ev, []).append((src, options))
        return t

    for ev, rows in table(ROOM).items():
        arms = "\n".join(
            f"  :: rcur == {_rs(src)} -> "
            + _chain(opts, ROOM_GUARDS, lambda d: f"rout = {_rs(d)}", {"allr": "rallr"}, f"room {src} {ev}")
            for src, opts in rows)
        out.append(f"inline room_{ev}(rcur, rallr, rout) {{\n  if\n{arms}\n"
                   f'  :: else -> printf("MODELBUG room {ev}\\n"); assert(false)\n  fi\n}}')
    for ev, rows in table(EXTENT).items():
        def assign(d):
            return f"cell[sx].ss = {_ss(d)}" + ("; cell[sx].unsure = 0" if d == EXTENT.initial else "")
        arms = "\n".join(
            f"  :: cell[sx].ss == {_ss(src)} -> "
            + _chain(opts, EXTENT_GUARDS, assign, {"pend": "spend", "x": "sx"}, f"extent {src} {ev}")
            for src, opts in rows)
        out.append(f"inline extent_{ev}(sx, spend) {{\n  if\n{arms}\n"
                   f'  :: else -> printf("MODELBUG extent {ev}\\n"); assert(false)\n  fi\n}}')
    for ev, rows in table(REGION).items():
        arms = "\n".join(
            f"  :: gcur == {_gs(src)} -> "
            + _chain(opts, {}, lambda d: f"gout = {_gs(d)}", {}, f"region {src} {ev}")
            for src, opts in rows)
        out.append(f"inline region_{ev}(gcur, gout) {{\n  if\n{arms}\n"
                   f'  :: else -> printf("MODELBUG region {ev}\\n"); assert(false)\n  fi\n}}')
    return "\n\n".join(out)


def _bits(n: int) -> int:
    return max(1, int(n).bit_length())


# -- the couplings -----------------------------------------------------------------------------------
# The machines whose moves run fsm/couplings.py's table here (peers: models/promela_peers.py).
COUPLED = ("room", "extent", "peer")

# With channels the encoder cannot see a region: it tells every receiver (none was told yet).
_CONCLUDE = """if
  :: SEED && cause == C_expire -> skip  /* the seed tells nobody on expiry */
  :: else ->
     room[ax].told = room[ax].reg;
     if
     :: REGIONS ->
        gj = 0;
        do
        :: gj < room[ax].reg ->
           if
           :: room[ax].rg[gj] == G_offered || room[ax].rg[gj] == G_withdrawing ->  /* plain */
           :: true ->  /* channels */
              if :: room[ax].rs == R_success -> notice_success(ax, gj) :: else -> notice_failed(ax, gj) fi
           :: else -> skip
           fi;
           gj++
        :: else -> break
        od;
        gj = 0;
        if :: room[ax].rs != R_success -> release_settled(ax) :: else -> skip fi
     :: else -> skip
     fi
  fi"""

_RELEASE_REGIONS = """k = 0;
  do
  :: k < R -> if :: room[k].sl == ax && HOLDS(k) ->
                    room[k].ghost = 0;  /* not late */
                    if
                    :: REGIONS ->
                       gj = 0;
                       do
                       :: gj < room[k].reg ->
                          if :: room[k].rw[gj] == W_GHOST || room[k].rw[gj] == W_LANDED ->  /* not late */
                                room[k].rw[gj] = W_IDLE  /* not late */
                          /* with late landings a ghost outlives the quarantine as a stray */  /* late */
                          if :: room[k].rw[gj] == W_GHOST -> room[k].rw[gj] = W_STRAY  /* late */
                             :: room[k].rw[gj] == W_LANDED -> room[k].rw[gj] = W_IDLE  /* late */
                             :: else -> skip fi;
                          gj++
                       :: else -> break
                       od;
                       gj = 0;
                       release_settled(k)
                    :: else -> skip
                    fi;
                    if :: !HOLDS(k) -> room[k].sl = NONE :: else -> skip fi
                 :: else -> skip fi; k++
  :: else -> break
  od;
  k = 0"""

# Each action of the table on the coupled machines, as the body of `inline <action>(ax, cause)`: ax is the
# room or extent that moved, cause the event that moved it (C_<event>). The model keeps no clock: a deadline
# is armed by the state itself (ARMED_ROOM, ARMED_EXTENT enable the event it sends when it passes).
ACTIONS = {
    "arm_announce_deadline": "skip",
    "arm_park_deadline": "skip",
    "arm_quarantine_deadline": "skip",
    "park_extent": "move_extent_park(room[ax].sl, 0); room[ax].ch = CH_HELD",
    "start_writes": "issue_writes(ax)",
    # a room failed by the loop keeps the seed's parked chunk: its reaper pops it later
    "abandon_extent": "if :: room[ax].ch == CH_HELD && !(SEED && cause == C_fail) -> drop_chunk(ax) :: else -> skip fi",
    "conclude": _CONCLUDE,
    "release_regions": _RELEASE_REGIONS,
    **peers.ACTIONS,
}


def coupled_actions() -> frozenset[str]:
    """The table's actions on the machines this generator moves: what ACTIONS implements."""
    table = (*couplings.ON_ENTER.items(), *couplings.ON_EVENT.items())
    return frozenset(a for (m, _), acts in table if m in COUPLED for a in acts)


def _table_events(machine) -> list[str]:
    return sorted({ev for _, ev in machine.table})


def _on_event(machine: str, event: str, index: str) -> str:
    return "".join(f"; {a}({index}, C_{event})" for a in couplings.ON_EVENT.get((machine, event), ()))


def _enter_inline(machine: str) -> str:
    """What entering each state runs, from ON_ENTER (a self-loop enters nothing: the moves check)."""
    field, code = {"room": ("room[ex].rs", _rs), "extent": ("cell[ex].ss", _ss),
                   "peer": ("peer[ex]", peers.ps)}[machine]
    arms = "".join(f"  :: {field} == {code(st)} -> " + "; ".join(f"{a}(ex, cause)" for a in acts) + "\n"
                   for (m, st), acts in couplings.ON_ENTER.items() if m == machine and acts)
    return f"inline enter_{machine}(ex, cause) {{\n  if\n{arms}  :: else -> skip\n  fi\n}}"


def _room_move(event: str) -> str:
    return (f"inline move_room_{event}(mx) {{\n"
            f"  room_{event}(room[mx].rs, (room[mx].reg >= N), t);\n"
            f"  if :: t == room[mx].rs -> t = 0 :: else -> room[mx].rs = t; t = 0; enter_room(mx, C_{event}) fi"
            f"{_on_event('room', event, 'mx')}\n}}")


def _extent_move(event: str) -> str:
    # The seed's extents have no machine: a move sets the state it names (spec: SeedSpec.EXTENT_MOVES).
    dest = SeedSpec.EXTENT_MOVES.get(event)
    seed = (f"cell[sx].ss = {_ss(dest)}" + ("; cell[sx].unsure = 0" if event == "lease" else "") if dest
            else f'printf("MODELBUG seed extent {event}\\n"); assert(false)')
    # The move steps the extent's first cell; its other cells follow (spread).
    return (f"inline move_extent_{event}(sx, spend) {{\n  so = cell[sx].ss;\n"
            f"  if :: SEED -> {seed} :: else -> extent_{event}(sx, spend) fi;\n  spread(sx);\n"
            f"  if :: cell[sx].ss == so -> so = 0 :: else -> so = 0; enter_extent(sx, C_{event}) fi"
            f"{_on_event('extent', event, 'sx')}\n}}")


def _coupling_inlines() -> str:
    """Each action once, what entering a state runs, and every move with the couplings that follow it."""
    out = [f"inline {a}(ax, cause) {{\n  {ACTIONS[a]}\n}}" for a in sorted(coupled_actions())]
    out += [_enter_inline(m) for m in COUPLED]
    out += [_room_move(ev) for ev in _table_events(ROOM)]
    out += [_extent_move(ev) for ev in _table_events(EXTENT)]
    out += [peers.move(ev, _on_event("peer", ev, "px")) for ev in peers.events()]
    return "\n\n".join(out)


# -- the generated model -----------------------------------------------------------------------------
def generate(cfg: Config, asserted: frozenset[str] | None = None,
             drop_guard: tuple[str, str, str] | None = None) -> str:
    """Promela for `cfg`. Kinds in `asserted` (default: all) fail an assertion; the others end the path.

    `drop_guard=(machine, event, guard)` removes one guard from the emitted
    table: a deliberately broken generator, for showing the engines disagree.
    """
    if cfg.peers and cfg.variant in PEER_VARIANTS:
        raise ValueError(f"promela: the peer variant {cfg.variant!r} is not generated; check it with the explorer")
    if cfg.rooms > 15 or cfg.cells > 15 or cfg.receivers > 7 or cfg.faults > 200:
        raise ValueError("promela: at most 15 rooms, 15 cells, 7 receivers")
    if cfg.identities > 1 and not liveness.checks_shares(cfg):
        raise ValueError("promela: identities are generated for items of one cell and a cell per identity")
    keys, nkeys = _key_defines(cfg)
    defs = _constants(cfg, frozenset(KINDS) if asserted is None else asserted) + _macros(cfg) + keys
    inlines = (_machine_inlines(drop_guard), peers.machine_inlines(_chain), _coupling_inlines(), _rules(cfg),
               shares.text(cfg), SEARCH)
    text = "\n".join(defs) + "\n" + _declarations(nkeys) + "\n" + "\n\n".join(inlines) + "\n\n" + _proctype(cfg)
    return _select_lines(text, cfg)


# Lines that only one setting of a switch needs end in a tag; the others are left out, so a switch that
# is off adds nothing to the generated model (SPIN caps how many jumps one d_step may hold).
LINE_TAGS = {"/* channels */": lambda c: c.channels, "/* plain */": lambda c: not c.channels,
             "/* late */": lambda c: c.late_landing, "/* not late */": lambda c: not c.late_landing,
             "/* shares */": lambda c: c.identities > 1, "/* one identity */": lambda c: c.identities == 1,
             "/* spans */": lambda c: c.pieces > 1, "/* one run */": lambda c: c.pieces == 1}


def _select_lines(text: str, cfg: Config) -> str:
    out = []
    for line in text.split("\n"):
        tag = next((t for t in LINE_TAGS if line.endswith(t)), None)
        if tag is None or LINE_TAGS[tag](cfg):
            out.append(line)
    return "\n".join(out)


def _constants(cfg: Config, asserted: frozenset[str]) -> list[str]:
    v = cfg.variant
    defs = [f"#define R {cfg.rooms}", f"#define C {cfg.cells}", f"#define N {cfg.receivers}",
            f"#define F {cfg.faults}", f"#define NONE {NONE}",
            f"#define ASSERTED {sum(1 << CODE[k] for k in asserted)}", f"#define REGIONS {int(cfg.regions)}",
            f"#define SEED {int(v == 'seed')}", f"#define NO_PARKED_CHECK {int(v == 'no-parked-check')}",
            f"#define BUSY_WAIT {int(v == 'busy-wait')}", f"#define REAP_CRASH {int(v == 'reaped-deferred-crash')}",
            f"#define NO_WRITE_DEADLINE {int(v == 'no-write-deadline')}"]
    defs += [f"#define {_rs(s)} {n}" for n, s in enumerate(ROOM_STATES)]
    defs += [f"#define {_ss(s)} {n + 1}" for n, s in enumerate(EXTENT_STATES)]
    defs += [f"#define {_gs(s)} {n + 1}" for n, s in enumerate(REGION_STATES)]
    defs += [f"#define W_IDLE {W_IDLE}", f"#define W_FLIGHT {W_FLIGHT}", f"#define W_GHOST {W_GHOST}",
             f"#define W_LANDED {W_LANDED}", f"#define W_STRAY {W_STRAY}",
             f"#define CHANNELS {int(cfg.channels)}", f"#define LATE_LANDING {int(cfg.late_landing)}",
             "#define WD_NONE 0", "#define WD_SENT 1", "#define WD_SEEN 2", "#define WD_ACKED 3",
             "#define SETTLED(w) ((w) == W_IDLE" + (" || (w) == W_STRAY)" if cfg.late_landing else ")"),
             "#define CLEN(c) (((c) > 0) + ((c) >= 5) + ((c) >= 25))",
             "#define ISOUT(d) ((d) == NC_SUCCESS || (d) == NC_FAILED)",
             # an outcome is on its way to receiver j of room x (never, without channels)
             "#define OUTCOME_ON_WAY(x, j) (" + ("ISOUT(room[x].rc[j] % 5) || ISOUT((room[x].rc[j] / 5) % 5) || "
                                                "ISOUT(room[x].rc[j] / 25))" if cfg.channels else "0)")]
    defs += [f"#define NC_{n.upper()} {c}" for n, c in NOTICE_CODE.items()]
    assert CHAN_CAP == 3  # CLEN and the channel's pushes know three digits
    defs += [f"#define T_{(t or 'none').upper()} {n}" for n, t in enumerate(TOLD_VALUES)]
    # a receiver's sort code: region, write, then the outcome it was told (the spec's tuple order)
    # (with channels then its FIFO, its withdraw's place and whether a release was sent: state.CHAN, WD, REL)
    code = "(room[x].rg[j] * 5 + room[x].rw[j]) * 4 + room[x].rt[j]"
    if cfg.channels:
        code = f"(((({code}) * 125 + room[x].rc[j]) * 4 + room[x].rd[j]) * 2 + room[x].rr[j])"
    defs.append(f"#define RCVCODE(x, j) ({code})")
    defs += [f"#define CH_{name.upper().replace('-', '_')} {n}" for n, name in enumerate(CH_NAMES)]
    defs += [f"#define K_{k.upper().replace('-', '_')} {CODE[k]}" for k in KINDS]
    # what moved a room or extent, for the actions that depend on it
    causes = sorted({*_table_events(ROOM), *_table_events(EXTENT), *_table_events(PEER)})
    defs += [f"#define C_{ev} {n + 1}" for n, ev in enumerate(causes)]
    return defs + peers.constants(cfg) + shares.constants(cfg)


def _macros(cfg: Config) -> list[str]:
    """The spec's predicates over a state, as macros."""
    R, C, N = cfg.rooms, cfg.cells, cfg.receivers
    concluded = " || ".join(f"(x) == {_rs(s)}" for s in sorted(CONCLUDED))
    defs = [f"#define CONCLUDED(x) ({concluded})",
            "#define STAGEABLE(x) (" + " || ".join(f"(x) == {_rs(s)}" for s in STAGEABLE) + ")"]
    # the states whose entry arms a deadline: its event may happen while the room or extent stays there
    unarmed = SeedSpec.UNARMED if cfg.variant == "seed" else frozenset()
    for machine, code in (("room", _rs), ("extent", _ss)):
        armed = " || ".join(f"(x) == {code(s)}" for s in sorted(couplings.armed_states(machine, unarmed)))
        defs.append(f"#define ARMED_{machine.upper()}(x) ({armed or 0})")
    # Ring.leasable, per cell; the seed (SeedRing.leasable) reuses a cell whose tenant is concluded and not parked
    if cfg.variant == "seed":
        defs.append("#define LEASABLE(x) (cell[x].content == NONE || (CONCLUDED(room[cell[x].content].rs)"
                    " && room[cell[x].content].ch != CH_HELD))")
    elif cfg.variant == "no-parked-check":
        defs.append("#define LEASABLE(x) (cell[x].ss == S_free || cell[x].ss == S_parked)")
    elif cfg.variant == "reuse-when-terminal":
        defs.append("#define LEASABLE(x) (cell[x].ss == S_free || (cell[x].content != NONE"
                    " && CONCLUDED(room[cell[x].content].rs)))")
    else:
        defs.append("#define LEASABLE(x) (cell[x].ss == S_free)")
    # ring.Ring.placements: an extent of z cells may start at cell o (FITS_o); FITS(z): somewhere
    for o in range(C):
        arms = [f"((z) == {z} && " + " && ".join(f"LEASABLE({o + c})" for c in range(z)) + ")"
                for z in cfg.sizes if o + z <= C]
        defs.append(f"#define FITS_{o}(z) ({' || '.join(arms) or 0})")
    defs.append("#define FITS(z) (" + " || ".join(f"FITS_{o}(z)" for o in range(C)) + ")")
    defs += _span_macros(cfg)
    # ring.Ring.reads: room x still needs its extent's bytes
    defs.append("#define READS(x) (room[x].ghost > 0 || room[x].infl > 0 || room[x].ch == CH_COPYING"
                " || room[x].ch == CH_HELD)")
    # a cell a new extent must not take: busy, and not known to be read by the room whose bytes it holds (the
    # invariants name that overwrite)
    defs.append("#define TAKEN(c) (cell[c].ss != S_free && !(cell[c].content != NONE && READS(cell[c].content)))")
    # every cell of room x's extent holds its bytes (nothing overlapped it)
    defs.append("#define OWNS_RUN(x) (" + " && ".join(f"(room[x].sz <= {m} || cell[room[x].sl + {m}].content == x)"
                                                      for m in range(max(cfg.sizes))) + ")")
    if cfg.pieces > 1:  # a spanning extent's cells: its first, and every cell naming it
        defs.append("#define OWNS(x) (SPANS(room[x].sl) -> (cell[room[x].sl].content == x && "
                    + " && ".join(f"(cell[{c}].span != MARK(room[x].sl) || cell[{c}].content == x)" for c in range(C))
                    + ") : OWNS_RUN(x))")
    else:
        defs.append("#define OWNS(x) OWNS_RUN(x)")
    # rules._writes_pending
    defs.append("#define PENDING(x) (" + " || ".join(f"(room[{i}].sl == (x) && room[{i}].infl > 0)"
                                                     for i in range(R)) + ")")
    # rules._holds_extent: with regions, while a write into one of its regions is not idle (a landed
    # late write keeps it until the quarantine ends); without, while writes are in flight or unsure.
    if cfg.regions:
        defs.append("#define HOLDS(x) (" + " || ".join(f"room[x].rw[{j}] != W_IDLE" for j in range(N)) + ")")
    else:
        defs.append("#define HOLDS(x) (room[x].infl > 0 || room[x].ghost > 0)")
    return defs + peers.macros(cfg) + _final_and_rank(cfg) + _done(cfg)


def _span_macros(cfg: Config) -> list[str]:
    """Spans (`Config.pieces` > 1; models/ring.py): a spanning extent's other cells hold MARK(first) in `span`
    (the spec's -1 - first); PLACEABLE(z): a run holds an item of z cells, or (`span_places`) a span does."""
    C = cfg.cells
    defs = ["#define MARK(f) (128 + (f))"]
    if cfg.pieces == 1:
        return defs + ["#define SPANS(f) 0", "#define FIRST(s) (cell[s].span > 0)", "#define PLACEABLE(z) FITS(z)",
                       "#define COVERS(k, q) (room[k].sl <= (q) && (q) < room[k].sl + room[k].sz)"]
    places = span_places(cfg)
    defs.append("#define SPANS(f) (" + " || ".join(f"cell[{c}].span == MARK(f)" for c in range(C)) + ")")
    defs.append("#define FIRST(s) (cell[s].span > 0 && cell[s].span < 128)")
    fits = [f"((z) == {len(p)} && " + " && ".join(f"LEASABLE({c})" for c in p) + ")" for p in places]
    defs.append(f"#define PLACEABLE(z) (FITS(z) || {' || '.join(fits) or 0})")
    defs.append("#define COVERS(k, q) (SPANS(room[k].sl) -> ((q) == room[k].sl || cell[q].span == MARK(room[k].sl))"
                " : (room[k].sl <= (q) && (q) < room[k].sl + room[k].sz))")
    return defs


def span_places(cfg: Config) -> list[tuple[int, ...]]:
    """Every set of cells an item may span (models/ring.py: its size's worth, not one run, in at most
    `pieces` runs), for each size it may have."""
    from itertools import combinations

    return [p for z in cfg.sizes if z <= cfg.cells for p in combinations(range(cfg.cells), z)
            if 1 < runs(p) <= cfg.pieces]


def _done(cfg: Config) -> list[str]:
    """liveness.judge: every room that began concluded (ROOMS_DONE), every region released or written, every
    concluded room's sender reaped (SENDERS_DONE)."""
    R, N = cfg.rooms, cfg.receivers
    rooms = " && ".join(f"((room[{i}].snd == 0 && room[{i}].reg == 0) || CONCLUDED(room[{i}].rs))" for i in range(R))
    regions = " && ".join(f"(room[{i}].reg <= {j} || room[{i}].rg[{j}] == G_written || room[{i}].rg[{j}] == G_released)"
                          for i in range(R) for j in range(N)) if cfg.regions else "1"
    senders = " && ".join(f"(room[{i}].snd != 1 || !CONCLUDED(room[{i}].rs))" for i in range(R))
    return [f"#define ROOMS_DONE ({rooms})", f"#define REGIONS_DONE ({regions})", f"#define SENDERS_DONE ({senders})"]


def _final_and_rank(cfg: Config) -> list[str]:
    """spec.is_final and spec.rank."""
    R, C, N = cfg.rooms, cfg.cells, cfg.receivers
    final = " && ".join([f"cell[{s}].ss == S_free" for s in range(C)]
                        + [f"CONCLUDED(room[{i}].rs) && room[{i}].told == N && room[{i}].reg == N && "
                           f"room[{i}].snd == 2 && room[{i}].infl == 0 && room[{i}].ghost == 0" for i in range(R)]
                        + ([f"(room[{i}].rg[{j}] == G_written || room[{i}].rg[{j}] == G_released) && "
                            f"room[{i}].rw[{j}] == W_IDLE && room[{i}].rt[{j}] == TOLD_OF(room[{i}].rs)"
                            + (f" && room[{i}].rc[{j}] == 0 && (room[{i}].rd[{j}] == WD_NONE || "
                               f"room[{i}].rd[{j}] == WD_ACKED)" if cfg.channels else "")
                            for i in range(R) for j in range(N)]
                           if cfg.regions else []))
    defs = ["#define TOLD_OF(rs) ((rs) == R_success -> T_SUCCESS : ((rs) == R_failed -> T_FAILED : T_NONE))",
            f"#define FINAL (hlt == 0 && dlen == 0 && {final})", "#define LIVE (!stop && hlt == 0)"]
    regrank = (" : ".join(f"((g) == {_gs(s)} -> {_REGION_RANK[s]}" for s in REGION_STATES) + " : 0"
               + ")" * len(REGION_STATES))
    defs.append(f"#define REGRANK(g) ({regrank})")
    m = 3 * N + 4
    rank = " + ".join(
        [f"{m} * (room[{i}].ch + room[{i}].snd + room[{i}].reg + room[{i}].told + CONCLUDED(room[{i}].rs))"
         f" - 3 * room[{i}].infl - room[{i}].ghost" for i in range(R)]
        + [f"REGRANK(room[{i}].rg[{j}])" for i in range(R) for j in range(N) if cfg.regions]
        + [f"(room[{i}].reg > {j}) * (2 * (CONCLUDED(room[{i}].rs) + room[{i}].rr[{j}] + "
           f"(room[{i}].rd[{j}] == WD_ACKED)) - CLEN(room[{i}].rc[{j}]) + room[{i}].rd[{j}])"
           for i in range(R) for j in range(N) if cfg.channels]
        + [f"(cell[{s}].ss != S_quarantined || cell[{s}].span == 0" + (f" || cell[{s}].span >= 128)" if cfg.pieces > 1
                                                                        else ")") for s in range(C)]
        + peers.rank_terms(cfg)
        + ["(hlt != 0)"])
    defs.append(f"#define RANK ({rank})")
    return defs


def _key_defines(cfg: Config) -> tuple[list[str], int]:
    """The canonical sort key of a room (explore._keys), most significant field first, split into ints."""
    R, N = cfg.rooms, cfg.receivers
    # its fields, its receivers (sorted (region, write, told) codes; rooms with equal `reg` have as many),
    # then its extent with identities the owner first (explore._keys): each identity's rooms keep their block of indices
    fields = [("OWN(KI)", _bits(cfg.identities - 1))] if cfg.identities > 1 else []
    fields += [("room[KI].rs", _bits(len(ROOM_STATES) - 1)), ("room[KI].snd", 2), ("room[KI].ch", 3),
              ("room[KI].reg", _bits(N)), ("room[KI].told", _bits(N)), ("room[KI].ok", _bits(N)),
              ("room[KI].infl", _bits(N)), ("room[KI].ghost", _bits(N))]
    if cfg.regions:
        top = (len(REGION_STATES) * 5 + 4) * 4 + 3
        if cfg.channels:
            top = ((top * 125 + 124) * 4 + 3) * 2 + 1
        fields += [(f"(RCVCODE(KI, {j}))", _bits(top)) for j in range(N)]
    # then the item's size, and where its extent starts (0 none, else its first cell + 1)
    fields += [("room[KI].sz", _bits(max(cfg.sizes))), ("KPOS", _bits(cfg.cells)), ("KSAME", 1),
               ("KDPOS", _bits(R))]
    # The key is split into ints of at most 31 bits, compared most significant first.
    chunks: list[list] = [[]]
    for f in fields:
        if sum(b for _, b in chunks[-1]) + f[1] > 31:
            chunks.append([])
        chunks[-1].append(f)
    keydefs = []
    for c, chunk in enumerate(chunks):
        key = "0"
        for expr, b in chunk:
            key = f"(({key}) << {b}) | ({expr})"
        keydefs.append(f"#define KEY{c}OF(KI, KPOS, KSAME, KDPOS) ({key})")
    gt = "0"
    for c in reversed(range(len(chunks))):
        gt = f"(key{c}[A] > key{c}[B] || (key{c}[A] == key{c}[B] && {gt}))"
    keydefs.append(f"#define KEYGT(A, B) {gt}")
    keydefs.append("#define SETKEYS(KI, KPOS, KSAME, KDPOS) "
                   + "; ".join(f"key{c}[KI] = KEY{c}OF(KI, KPOS, KSAME, KDPOS)" for c in range(len(chunks))))
    return keydefs, len(chunks)


def _declarations(nkeys: int) -> str:
    return f"""
typedef Room {{ byte rs = {_rs(ROOM.initial)}; byte snd; byte ch = CH_AWAITING_TOWER; byte reg; byte told; byte ok;
               byte infl; byte ghost; byte sz; byte sl = NONE; byte rg[N]; byte rw[N]; byte rt[N];
               byte rc[N]; byte rd[N]; bit rr[N];  /* channels */
}}
typedef Cell {{ byte ss = {_ss(EXTENT.initial)}; byte content = NONE; bit unsure; byte span = 1 }}
Room room[R];
Cell cell[C];
""" + peers.DECLARATIONS + """
byte dq[R];
byte dlen;
""" + shares.DECLARATIONS + """
byte faults = F;
byte hlt;      /* 0 running, 1 the loop crashed, 2 the loop spins */
bit stop;      /* a violation already reported: a dead end, as in the explorer */

/* scratch, zero between statements that may branch: not part of the state */
hidden byte tmp, k, n, q, gj, gq, gt, so, sp, lc, sq;
""" + "".join(f"hidden int key{c}[R];\n" for c in range(nkeys)) + """hidden byte ord[R], rmap[R];
hidden byte t_rs[R], t_snd[R], t_ch[R], t_reg[R], t_told[R], t_ok[R], t_infl[R], t_ghost[R], t_sz[R], t_sl[R];
hidden byte t_rg[R * N], t_rw[R * N], t_rt[R * N];
hidden byte t_rc[R * N], t_rd[R * N], t_rr[R * N];  /* channels */
"""


def _rules(cfg: Config) -> str:
    """The event families' inlines, with the variant's and the region machine's names filled in."""
    choose = "\n".join([f"     :: FITS_{s}(room[gx].sz) -> ls = {s}" for s in range(cfg.cells)]
                       + [f"     :: !FITS(room[gx].sz) && room[gx].sz == {len(p)} && "
                          + " && ".join(f"LEASABLE({c})" for c in p) + f" -> ls = {p[0]}; lm = {sum(1 << c for c in p)}"
                          for p in (span_places(cfg) if cfg.pieces > 1 else [])])
    inl, arms = events.notices(cfg)
    rules = events.TEXT.replace("CHOOSE_PLACE", choose).replace("NOTICE_INLINES", inl).replace("SETTLE_ARMS", arms)
    if not cfg.channels:  # a notice arrives as it is sent: delivering it is sending it
        rules = rules.replace("inline deliver_", "inline notice_")
    for notice, event in NOTICE_EVENTS.items():  # which region event each notice steps
        rules = rules.replace(f"region_NOTICE_{notice}(", f"region_{event}(")
    for notice, dest in SeedSpec.NOTICES.items():
        rules = rules.replace(f"SEED_{notice.upper()}", _gs(dest))
    return rules


def _proctype(cfg: Config) -> str:
    """One option per event; none enabled is a dead end: fine after a violation or when quiescent."""
    arms, enabled, fair, fair_by = _room_event_arms(cfg)
    # the global families' events, in the order of their arms (peers.global_arms: one family per event)
    names = ["serve", "reap", "release",
             *(("connected", "refused", "connect_expired", "probe_refused", "probe_expired") if cfg.peers else ())]
    fair_names = liveness.fair_events(cfg.variant)
    serve = (events.deferred_served_fair if cfg.identities > 1 else events.deferred_served)(EVENTS.index("serve"))
    fair_all: list[str] = []  # the encode loop's own fair events: everyone's (liveness.subject)
    for name, (guards, arm) in zip(names, (serve,
                                           events.reap(EVENTS.index("reap"), cfg.rooms),
                                           events.quarantine_ends(EVENTS.index("release"), cfg.cells),
                                           *peers.global_arms(cfg, EVENTS.index)), strict=True):
        enabled += guards
        fair += guards if name in fair_names else []
        if name in fair_names:
            if name == "release":  # a quarantine's end is the identity's its extent is charged to
                for s, g in enumerate(guards):
                    for v in range(cfg.identities):
                        fair_by.setdefault(v, []).append(f"({g} && CELLOWN(cell[{s}].content) == {v})")
            else:
                fair_all += guards
        arms.append(arm)
    starved = shares.starved_arms(cfg, enabled, fair_by, fair_all) if liveness.checks_shares(cfg) else ""
    reset = "; " + shares.RESET if cfg.identities > 1 else ""
    return ("active proctype model() {\n"
            # a comment in the generated model: not mutated (the pragma below)
            "  /* per-step scratch that must survive backtracking: zero between steps */\n"  # pragma: no mutate
            "  byte ev, x, y, ls, h, t, kind;\n  byte ors[R];\n  int orank, lm;\n"
            + (shares.LOCALS if cfg.identities > 1 else "") + "  do\n"
            "  :: atomic {\n    if\n" + "\n".join(arms) + f"\n    fi;\n    post(); ev = 0; x = 0; y = 0{reset}\n  }}\n"
            "  :: atomic { !(" + " || ".join(enabled) + ") -> d_step { if :: stop || FINAL -> skip "
            ":: (ASSERTED >> K_DEADLOCK) & 1 -> kind = K_DEADLOCK; report() :: else -> skip fi } }\n"
            + _liveness_arm(enabled, fair) + starved + "  od\n}\n")


def _liveness_arm(enabled: list[str], fair: list[str]) -> str:
    """models/liveness.py: staying forever where events are enabled but none assumed fair is a fair behaviour, so
    such a state must be done. The arm changes nothing unless it reports (a self-loop SPIN does not store twice)."""
    return ("  :: atomic { LIVE && !(" + (" || ".join(fair) or "0") + ") && (" + " || ".join(enabled)
            + ") -> d_step {\n       if :: ROOMS_DONE && REGIONS_DONE && SENDERS_DONE -> skip\n"
            "          :: else -> kind = (!ROOMS_DONE -> K_ROOM_NEVER_CONCLUDES : "
            "(!REGIONS_DONE -> K_REGION_NEVER_RELEASED : K_SENDER_NEVER_REAPED));\n"
            "             if :: (ASSERTED >> kind) & 1 -> report() :: else -> skip fi; kind = 0\n       fi } }\n")


def _room_event_arms(cfg: Config) -> tuple[list[str], list[str], list[str]]:
    """One option per room event. Its first statement picks a room the event is enabled for; all of it runs in
    one atomic step, so choices add no state, and the checks and relabelling (post) are emitted once. Also the
    guards that enable it (all of them, and those of the events liveness.py assumes fair)."""
    arms, enabled, fair = [], [], []
    fair_by: dict[int, list[str]] = {}  # with identities: the fair guards of each identity's rooms
    owners = Spec(cfg).owners() if cfg.identities > 1 else (0,) * cfg.rooms
    fair_names = liveness.fair_events(cfg.variant)
    # An event about one receiver's write or region also picks the receiver (y); receivers alike give the
    # same successor, so picking among them adds transitions, not states (the spec picks one of each kind).
    for n, (name, _, act, per_receiver) in enumerate(events.room_arms("x", "y", cfg)):
        places = [(i, j) for i in range(cfg.rooms)
                  for j in (range(cfg.receivers) if per_receiver and cfg.regions else [None])]
        guards = [events.room_arms(str(i), str(j), cfg)[n][1] for i, j in places]
        enabled += guards
        fair += guards if name in fair_names else []
        if name in fair_names:
            for (i, _), g in zip(places, guards):
                fair_by.setdefault(owners[i], []).append(g)
        pick = " ".join(f":: {g} -> x = {i}" + ("" if j is None else f"; y = {j}")
                        for (i, j), g in zip(places, guards))
        # an event without a choice inside runs as one d_step (no per-statement search overhead)
        body = f"d_step {{ pre() }}; {act}" if "ev_tower(" in act else f"d_step {{ pre(); {act} }}"
        arms.append(f"    :: if {pick} fi; ev = {EVENTS.index(name)}; {body}")
    return arms, enabled, fair, fair_by

# -- reading SPIN's results -------------------------------------------------------------------------


class Disagreement(AssertionError):
    """SPIN took a step, or reported a violation, that the Python spec does not have."""


@dataclass
class SpinResult:
    config: Config
    states: int = 0            # states stored by the run that searched the whole space
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0       # pan's search time, all runs
    cpu: float = 0.0           # CPU seconds of spin, gcc and pan, all runs
    search_cpu: float = 0.0    # CPU seconds of pan alone
    wall: float = 0.0          # generate + spin -a + gcc + pan, all runs
    memory_mb: float = 0.0
    runs: int = 0
    violations: dict = field(default_factory=dict)  # kind -> explore.Violation (trace rebuilt on the spec)
    raw: dict = field(default_factory=dict)         # kind -> SPIN's own steps [(event, arg, canonical state)]
    options: str = ""

    @property
    def states_per_s(self) -> float:
        return self.states / self.seconds if self.seconds else 0.0


def pan_figure(pattern: str, text: str, cast=int, default=0):
    """A number from pan's report; pan prints large counts as 1.7411507e+08."""
    m = re.search(pattern, text)
    return cast(float(m.group(1))) if m else default


def _parse_state(lines: list[str]) -> tuple:
    st = lines[0].split()[1:]
    halt, faults, dlen = int(st[0]), int(st[1]), int(st[2])
    deferred = tuple(int(d) for d in st[3:3 + dlen])
    rooms, extents, peer = [], [], ()
    for line in lines[1:]:
        tag, *f = line.split()
        f = [int(v) for v in f]
        if tag == "PE":
            peer = peers.parse(f)
        elif tag == "RM":
            # receivers: (region, write, told) after the room's fields; region 0 is no receiver (or no regions)
            rcv = tuple((REGION_STATES[g - 1], w, TOLD_VALUES[t]) for g, w, t in zip(f[10::3], f[11::3], f[12::3])
                        if g)
            rooms.append((ROOM_STATES[f[0]], *f[1:8], rcv, f[8], -1 if f[9] == NONE else f[9]))
        elif tag == "RX":  # with channels: each receiver also has its FIFO, its withdraw and its release
            rcv = tuple((REGION_STATES[x[0] - 1], x[1], TOLD_VALUES[x[2]], *x[3:]) for x in zip(*(f[10 + n::6]
                        for n in range(6))) if x[0])
            rooms.append((ROOM_STATES[f[0]], *f[1:8], rcv, f[8], -1 if f[9] == NONE else f[9]))
        else:
            content = -1 if f[1] == NONE else -2 - (f[1] - shares.FORGOT) if f[1] >= shares.FORGOT else f[1]
            # a spanning extent's other cells: MARK(first) in Promela, -1 - first in the spec
            extents.append((EXTENT_STATES[f[0] - 1], content, bool(f[2]), f[3] if f[3] < 128 else 127 - f[3]))
    return (tuple(rooms), tuple(extents), deferred, faults, HALTS[halt], peer)


def parse_trail(output: str) -> tuple[list[tuple[str, int, tuple]], str | None]:
    """SPIN's replay printfs -> [(event, arg, canonical state after)], and the kind it reported."""
    steps, kind, block, head = [], None, [], None

    def flush():
        if head is not None:
            steps.append((head[0], head[1], _parse_state(block)))

    for raw in output.splitlines():
        line = raw.strip()
        if line.startswith("EV "):
            flush()
            _, ev, arg = line.split()[:3]
            head, block = (EVENTS[int(ev)], int(arg)), []
        elif line.startswith(("ST ", "RM ", "RX ", "SL ", "PE")):
            block.append(line)
        elif line.startswith("VIOLATION "):
            kind = KINDS[int(line.split()[1]) - 1]
        elif line.startswith("MODELBUG"):
            raise Disagreement(f"SPIN: the declared machines refuse a move: {line}")
    flush()
    return steps, kind


def rebuild(spec: Spec, steps: list[tuple[str, int, tuple]], kind: str) -> list[tuple[tuple, tuple]]:
    """Follow SPIN's steps on the Python spec: a concrete trace, and proof SPIN's path is the spec's."""
    state = spec.initial()
    trace = [(("init",), state)]
    for n, (event, _arg, target) in enumerate(steps, 1):  # pragma: no mutate (n numbers the message)
        if spec.cfg.identities > 1:  # SPIN reads a room's owner from its index (promela_shares.py)
            target = (tuple((*r, v) for r, v in zip(target[0], spec.owners())), *target[1:])
        for step in spec.successors(state):
            if step.event[0] == event and canonical(step.state) == target:
                prev, state = state, step.state
                trace.append((step.event, state))
                break
        else:
            raise Disagreement(f"SPIN step {n} ({event}) reaches a state the spec cannot reach from "
                               f"{spec.describe(state)}: {spec.describe(target)}"  # pragma: no mutate (message text)
                               )
    if kind == "deadlock":
        got = "deadlock" if not spec.successors(state) and not spec.is_final(state) else None
    elif kind in liveness.SHARE_KINDS:
        fair = liveness.fair_events(spec.cfg.variant)
        got = (liveness.starved(state, spec.successors(state), fair, spec.cfg.identities) or (None,))[0]
    elif kind in liveness.KINDS:
        got = (liveness.stuck(state, spec.successors(state), liveness.fair_events(spec.cfg.variant)) or (None,))[0]
    else:
        got = step.violation or (_transition_check(spec, prev, state) or spec.invariant(state) or (None,))[0]
    if got != kind:
        raise Disagreement(f"SPIN reports {kind} after {len(steps)} steps; the spec says {got or 'no violation'}")
    return trace


