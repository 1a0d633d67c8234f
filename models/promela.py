"""The spec as a Promela model, checked by SPIN: an engine independent of explore.py.

`generate(config)` writes Promela for one bounded configuration. The room,
slot and region moves are emitted from the compiled `fsm/` tables (`ROOM.table`,
`SLOT.table`, `REGION.table`: every source, event, guard and destination, first
declared edge first), and the states and their order from the declarations; the
events of the environment (tower, frames, copies, writes, deadlines, aborts,
withdraws, drain, reap, release) follow the rules of `spec.Spec.successors`, one
Promela inline per rule, with the same variant switches. With
`Config(regions=True)` (the default) each room also carries its receivers'
regions and where the write into each is, and the encoder's notices (outcome,
release, withdraw ack) step them through `REGION`'s table, as in the spec. Nothing here executes Python spec code: SPIN
searches its own compiled state space, so a slip in either engine shows up as a
disagreement.

The model applies the explorer's symmetry reduction itself: after every event a
`d_step` relabels rooms and slots into the same canonical order as
`explore.canonical` (rooms sorted by everything about them, their receivers
sorted first as the spec keeps them, used slots in their rooms' order, unused
slots by state). Each event is one atomic step and SPIN
does not store states inside atomic steps, so for a configuration without a
violation SPIN stores exactly the explorer's canonical states, a second
agreement check besides the verdict.

`epd_ring.executor.tools.spin.check(config)` (a tool: it runs processes) runs `spin -a`, gcc and `pan` (exhaustive, no hash compaction or
bitstate), once per kind of violation: a run asserts every kind not yet found
and treats the found ones as dead ends (as the explorer does: a bad state is
reported, not explored), so the set of kinds found is the explorer's set.
Each SPIN trail is replayed with `spin -t`, whose printfs give the events and
canonical states, and rebuilt on the Python spec into a concrete, readable trace
(which also checks that SPIN's steps are steps of the spec).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from epd_ring.fsm import REGION, ROOM, SLOT
from epd_ring.fsm.regions import NOTICE_EVENTS

from .explore import _transition_check, canonical
from .spec import _REGION_RANK, CH_NAMES, CONCLUDED, W_FLIGHT, W_GHOST, W_IDLE, W_LANDED, Config, Spec

# Kinds of violation, in the order the spec checks them; codes are 1-based.
KINDS = ("crash", "overwrite-under-late-write", "overwrite-under-write", "overwrite-under-chunk",
         "receiver-not-told", "success-without-all-writes", "write-for-concluded-room", "deadline-extended",
         "deadlock", "failure-not-sticky", "status-not-forward", "model-cycle",
         "write-into-released-region", "success-under-write", "wrong-outcome")
CODE = {k: n + 1 for n, k in enumerate(KINDS)}

# States are numbered in sorted name order, so a numeric comparison in the
# canonical sort orders rooms exactly as explore.canonical's tuple comparison does.
ROOM_STATES = tuple(sorted(ROOM.states))
SLOT_STATES = tuple(sorted(SLOT.states))  # coded 1.. (0 sorts first: "no slot", as "" does)
# A receiver's region is coded 1.. in name order (0: no receiver registered in that place), and
# sorted with its write's place (W_*) as region * 4 + write, which is the order of spec's (name, write) pairs.
REGION_STATES = tuple(sorted(REGION.states))
# The seed's receiver has no release protocol: it frees a region on Failed (spec.Spec._notice).
SEED_NOTICE = {"success": "written", "failed": "released"}
NONE = 255
HALTS = {0: None, 1: "crash", 2: "spin"}
EVENTS = ("register", "frame", "tower", "tower_error", "stage_error", "copied", "write_done", "write_unsure",
          "late_landing", "expire", "abort", "drain", "reap", "release", "withdraw")

# Promela for each guard named in the declarations, given the stepped object.
ROOM_GUARDS = {"all_receivers": "({allr})"}
SLOT_GUARDS = {"writes_pending": "({pend})", "write_unsure": "slot[{x}].unsure"}


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
    for ev, rows in table(SLOT).items():
        def assign(d):
            return f"slot[sx].ss = {_ss(d)}" + ("; slot[sx].unsure = 0" if d == SLOT.initial else "")
        arms = "\n".join(
            f"  :: slot[sx].ss == {_ss(src)} -> "
            + _chain(opts, SLOT_GUARDS, assign, {"pend": "spend", "x": "sx"}, f"slot {src} {ev}")
            for src, opts in rows)
        out.append(f"inline slot_{ev}(sx, spend) {{\n  if\n{arms}\n"
                   f'  :: else -> printf("MODELBUG slot {ev}\\n"); assert(false)\n  fi\n}}')
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


def generate(cfg: Config, asserted: frozenset[str] | None = None,
             drop_guard: tuple[str, str, str] | None = None) -> str:
    """Promela for `cfg`. Kinds in `asserted` (default: all) fail an assertion; the others end the path.

    `drop_guard=(machine, event, guard)` removes one guard from the emitted
    table: a deliberately broken generator, for showing the engines disagree.
    """
    R, S, N, F = cfg.rooms, cfg.slots, cfg.receivers, cfg.faults
    if getattr(cfg, "peers", False):
        raise ValueError("promela: the peers are not generated; use Config(peers=False)")
    if R > 15 or S > 15 or N > 7 or F > 200:
        raise ValueError("promela: at most 15 rooms, 15 slots, 7 receivers")
    asserted = frozenset(KINDS) if asserted is None else asserted
    mask = sum(1 << CODE[k] for k in asserted)
    v = cfg.variant
    # Canonical sort key of a room, most significant field first (explore._keys): its fields, its
    # receivers (sorted (region, write) codes; rooms with equal `reg` have as many), then its slot.
    fields = [("room[KI].rs", _bits(len(ROOM_STATES) - 1)), ("room[KI].snd", 2), ("room[KI].ch", 3),
              ("room[KI].reg", _bits(N)), ("room[KI].told", _bits(N)), ("room[KI].ok", _bits(N)),
              ("room[KI].infl", _bits(N)), ("room[KI].ghost", _bits(N))]
    if cfg.regions:
        fields += [(f"(room[KI].rg[{j}] * 4 + room[KI].rw[{j}])", _bits(len(REGION_STATES) * 4 + 3))
                   for j in range(N)]
    fields += [("KSS", _bits(len(SLOT_STATES))), ("KUN", 1), ("KSAME", 1), ("KDPOS", _bits(R))]
    # The key is split into ints of at most 31 bits, compared most significant first.
    chunks = [[]]
    for f in fields:
        if sum(b for _, b in chunks[-1]) + f[1] > 31:
            chunks.append([])
        chunks[-1].append(f)
    keydefs = []
    for c, chunk in enumerate(chunks):
        key = "0"
        for expr, b in chunk:
            key = f"(({key}) << {b}) | ({expr})"
        keydefs.append(f"#define KEY{c}OF(KI, KSS, KUN, KSAME, KDPOS) ({key})")
    gt = "0"
    for c in reversed(range(len(chunks))):
        gt = f"(key{c}[A] > key{c}[B] || (key{c}[A] == key{c}[B] && {gt}))"
    keydefs.append(f"#define KEYGT(A, B) {gt}")
    keydefs.append("#define SETKEYS(KI, KSS, KUN, KSAME, KDPOS) "
                   + "; ".join(f"key{c}[KI] = KEY{c}OF(KI, KSS, KUN, KSAME, KDPOS)" for c in range(len(chunks))))

    defs = [f"#define R {R}", f"#define S {S}", f"#define N {N}", f"#define F {F}", f"#define NONE {NONE}",
            f"#define ASSERTED {mask}", f"#define REGIONS {int(cfg.regions)}",
            f"#define SEED {int(v == 'seed')}", f"#define NO_PARKED_CHECK {int(v == 'no-parked-check')}",
            f"#define BUSY_WAIT {int(v == 'busy-wait')}", f"#define REAP_CRASH {int(v == 'reaped-deferred-crash')}"]
    defs += [f"#define {_rs(s)} {n}" for n, s in enumerate(ROOM_STATES)]
    defs += [f"#define {_ss(s)} {n + 1}" for n, s in enumerate(SLOT_STATES)]
    defs += [f"#define {_gs(s)} {n + 1}" for n, s in enumerate(REGION_STATES)]
    defs += [f"#define W_IDLE {W_IDLE}", f"#define W_FLIGHT {W_FLIGHT}", f"#define W_GHOST {W_GHOST}",
             f"#define W_LANDED {W_LANDED}"]
    defs += [f"#define CH_{name.upper().replace('-', '_')} {n}" for n, name in enumerate(CH_NAMES)]
    defs += [f"#define K_{k.upper().replace('-', '_')} {CODE[k]}" for k in KINDS]
    concluded = " || ".join(f"(x) == {_rs(s)}" for s in sorted(CONCLUDED))
    defs.append(f"#define CONCLUDED(x) ({concluded})")
    defs.append("#define STAGEABLE(x) ((x) == R_registered || (x) == R_ready)")
    # spec._leasable: the seed reuses a slot whose tenant is concluded and not parked
    if v == "seed":
        defs.append("#define LEASABLE(x) (slot[x].content == NONE || (CONCLUDED(room[slot[x].content].rs)"
                    " && room[slot[x].content].ch != CH_HELD))")
    elif v == "no-parked-check":
        defs.append("#define LEASABLE(x) (slot[x].ss == S_free || slot[x].ss == S_parked)")
    else:
        defs.append("#define LEASABLE(x) (slot[x].ss == S_free)")
    defs.append("#define ANY_LEASABLE (" + " || ".join(f"LEASABLE({s})" for s in range(S)) + ")")
    # spec._writes_pending
    defs.append("#define PENDING(x) (" + " || ".join(f"(room[{i}].sl == (x) && room[{i}].infl > 0)"
                                                     for i in range(R)) + ")")
    # spec._holds_slot: with regions, while a write into one of its regions is not idle (a landed
    # late write keeps it until the quarantine ends); without, while writes are in flight or unsure.
    if cfg.regions:
        defs.append("#define HOLDS(x) (" + " || ".join(f"room[x].rw[{j}] != W_IDLE" for j in range(N)) + ")")
    else:
        defs.append("#define HOLDS(x) (room[x].infl > 0 || room[x].ghost > 0)")
    final = " && ".join([f"slot[{s}].ss == S_free" for s in range(S)]
                        + [f"CONCLUDED(room[{i}].rs) && room[{i}].told == N && room[{i}].reg == N && "
                           f"room[{i}].snd == 2 && room[{i}].infl == 0 && room[{i}].ghost == 0" for i in range(R)]
                        + ([f"(room[{i}].rg[{j}] == G_written || room[{i}].rg[{j}] == G_released) && "
                            f"room[{i}].rw[{j}] == W_IDLE" for i in range(R) for j in range(N)]
                           if cfg.regions else []))
    defs.append(f"#define FINAL (hlt == 0 && dlen == 0 && {final})")
    defs.append("#define LIVE (!stop && hlt == 0)")
    defs += keydefs
    regrank = " : ".join(f"((g) == {_gs(s)} -> {_REGION_RANK[s]}" for s in REGION_STATES) + " : 0" + ")" * len(REGION_STATES)
    defs.append(f"#define REGRANK(g) ({regrank})")

    m = 3 * N + 4
    rank = " + ".join(
        [f"{m} * (room[{i}].ch + room[{i}].snd + room[{i}].reg + room[{i}].told + CONCLUDED(room[{i}].rs))"
         f" - 3 * room[{i}].infl - room[{i}].ghost" for i in range(R)]
        + [f"REGRANK(room[{i}].rg[{j}])" for i in range(R) for j in range(N) if cfg.regions]
        + [f"(slot[{s}].ss != S_quarantined)" for s in range(S)] + ["(hlt != 0)"])
    defs.append(f"#define RANK ({rank})")

    decl = f"""
typedef Room {{ byte rs = {_rs(ROOM.initial)}; byte snd; byte ch = CH_AWAITING_TOWER; byte reg; byte told; byte ok;
               byte infl; byte ghost; byte sl = NONE; byte rg[N]; byte rw[N] }}
typedef Slot {{ byte ss = {_ss(SLOT.initial)}; byte content = NONE; bit unsure }}
Room room[R];
Slot slot[S];
byte dq[R];
byte dlen;
byte faults = F;
byte hlt;      /* 0 running, 1 the loop crashed, 2 the loop spins */
bit stop;      /* a violation already reported: a dead end, as in the explorer */

/* scratch, written and read only inside one d_step: not part of the state */
hidden byte tmp, k, n, q, best, gj, gq, gt;
{{keys}}
hidden byte ord[R], rmap[R], smap[S], sord[S];
hidden byte t_rs[R], t_snd[R], t_ch[R], t_reg[R], t_told[R], t_ok[R], t_infl[R], t_ghost[R], t_sl[R];
hidden byte t_ss[S], t_content[S], t_unsure[S], t_dq[R];
hidden byte t_rg[R * N], t_rw[R * N];
""".replace("{keys}", "".join(f"hidden int key{c}[R];\n" for c in range(len(chunks))))

    fail = _RULES.split("/* END FAIL */")[0]
    rules = (fail.replace("IS_EXPIRE", "0").replace("EV", "fail")
             + fail.replace("IS_EXPIRE", "1").replace("EV", "expire")
             + _RULES.split("/* END FAIL */")[1]).replace("CHOOSE_SLOT", _choose_slot(S))
    for notice, event in NOTICE_EVENTS.items():  # which region event each notice steps
        rules = rules.replace(f"region_NOTICE_{notice}(", f"region_{event}(")
    for notice, dest in SEED_NOTICE.items():
        rules = rules.replace(f"SEED_{notice.upper()}", _gs(dest))
    inlines = _machine_inlines(drop_guard) + "\n\n" + rules
    # One option per rule. Its first statement picks a room (or slot) the rule is enabled for; all of it runs
    # in one atomic step, so choices add no state, and the checks and relabelling (post) are emitted once.
    arms, enabled = [], []
    # A rule about one receiver's write or region also picks the receiver (y); receivers alike give the
    # same successor, so picking among them adds transitions, not states (the spec picks one of each kind).
    for n, (name, _, act, per_receiver) in enumerate(_events("x", "y", cfg.regions)):
        places = [(i, j) for i in range(R) for j in (range(N) if per_receiver and cfg.regions else [None])]
        guards = [_events(str(i), str(j), cfg.regions)[n][1] for i, j in places]
        enabled += guards
        pick = " ".join(f":: {g} -> x = {i}" + ("" if j is None else f"; y = {j}")
                        for (i, j), g in zip(places, guards))
        # a rule without a choice inside runs as one d_step (no per-statement search overhead)
        body = f"d_step {{ pre() }}; {act}" if "ev_tower(" in act else f"d_step {{ pre(); {act} }}"
        arms.append(f"    :: if {pick} fi; ev = {EVENTS.index(name)}; {body}")
    enabled.append("(LIVE && dlen > 0 && ANY_LEASABLE)")
    arms.append(f"    :: LIVE && dlen > 0 && ANY_LEASABLE -> ev = {EVENTS.index('drain')}; x = 255; d_step {{ pre() }}; drain()")
    reapable = " || ".join(f"(room[{i}].snd == 1 && CONCLUDED(room[{i}].rs) && room[{i}].ch != CH_AWAITING_TOWER)"
                           for i in range(R))
    enabled.append(f"(LIVE && ({reapable}))")
    arms.append(f"    :: LIVE && ({reapable}) -> ev = {EVENTS.index('reap')}; x = 255; d_step {{ pre(); reap() }}")
    guards = [f"LIVE && slot[{s}].ss == S_quarantined && !PENDING({s})" for s in range(S)]
    enabled += guards
    pick = " ".join(f":: {g} -> x = {s}" for s, g in enumerate(guards))
    arms.append(f"    :: if {pick} fi; ev = {EVENTS.index('release')}; d_step {{ pre(); release(x) }}")
    proc = ("active proctype model() {\n"
            "  /* per-step scratch that must survive backtracking: zero between steps */\n"
            "  byte ev, x, y, ls, h, t, kind;\n  byte ors[R];\n  int orank;\n  do\n"
            "  :: atomic {\n    if\n" + "\n".join(arms) + "\n    fi;\n    post(); ev = 0; x = 0; y = 0\n  }\n"
            # No rule enabled: a dead end is fine after a reported violation or when quiescent, else a deadlock.
            "  :: atomic { !(" + " || ".join(enabled) + ") -> d_step { if :: stop || FINAL -> skip "
            ":: (ASSERTED >> K_DEADLOCK) & 1 -> kind = K_DEADLOCK; report() :: else -> skip fi } }\n"
            "  od\n}\n")
    return "\n".join(defs) + "\n" + decl + "\n" + inlines + "\n\n" + proc


def _events(i: str, j: str, regions: bool) -> list[tuple[str, str, str, bool]]:
    """(event name, guard, action, about one receiver) for room i (receiver j), in spec.successors' order."""
    r = f"room[{i}]"
    live = "LIVE && " if i != "x" else ""
    # With regions a write, a late landing or a withdraw is about receiver j; without, about the room.
    write = f" && {r}.rw[{j}] == W_FLIGHT" if regions else ""
    ghost = f" && {r}.rw[{j}] == W_GHOST" if regions else ""
    j = j if regions else "0"
    events = [
        ("register", f"{r}.snd == 0", f"ev_register({i})", False),
        ("frame", f"{r}.reg < N", f"ev_frame({i})", False),
        ("tower", f"{r}.snd == 1 && {r}.ch == CH_AWAITING_TOWER && !STAGEABLE({r}.rs)", f"{r}.ch = CH_DROPPED", False),
        ("tower", f"{r}.snd == 1 && {r}.ch == CH_AWAITING_TOWER && STAGEABLE({r}.rs)", f"ev_tower({i})", False),
        ("tower_error", f"{r}.snd == 1 && {r}.ch == CH_AWAITING_TOWER && STAGEABLE({r}.rs) && faults > 0",
         f"ev_tower_error({i})", False),
        ("stage_error", f"{r}.snd == 1 && {r}.ch == CH_AWAITING_TOWER && STAGEABLE({r}.rs) && faults > 0",
         f"ev_tower_error({i})", False),
        ("copied", f"{r}.ch == CH_COPYING && slot[{r}.sl].ss == S_copying", f"ev_copied({i})", False),
        ("write_done", f"{r}.infl > 0{write}", f"ev_write({i}, {j}, 0)", True),
        ("write_unsure", f"{r}.infl > 0 && faults > 0{write}", f"ev_write({i}, {j}, 1)", True),
        ("late_landing", f"{r}.ghost > 0{ghost}", f"ev_late_landing({i}, {j})", True),
        ("expire", f"SEED && {r}.rs == R_failed && {r}.ch == CH_HELD", f"ev_seed_reaper({i})", False),
        ("expire", f"{r}.rs == R_parked || (!SEED && {r}.rs == R_announced)", f"ev_expire({i})", False),
    ]
    if regions:  # a receiver's request is aborted: it withdraws its region
        events.append(("withdraw", f"faults > 0 && !CONCLUDED({r}.rs) && {r}.rg[{j}] == G_offered",
                       f"ev_withdraw({i}, {j})", True))
    events.append(("abort", f"faults > 0 && {r}.snd == 1 && !CONCLUDED({r}.rs)", f"fail_fail({i}); faults--", False))
    return [(name, live + guard, act, per) for name, guard, act, per in events]


# The environment's rules, after spec.Spec (same names, same order of effects).
_RULES = r"""
inline fail_EV(fx) {
  room_EV(room[fx].rs, (room[fx].reg >= N), t); room[fx].rs = t; t = 0;
  if
  :: (room[fx].ch == CH_COPYING || room[fx].ch == CH_HELD) && !(SEED && room[fx].ch == CH_HELD && !IS_EXPIRE) ->
     if
     :: room[fx].ch == CH_HELD ->
        if :: SEED -> slot[room[fx].sl].ss = S_free :: else -> slot_abandon(room[fx].sl, 0) fi;
        room[fx].ch = CH_DROPPED; room[fx].sl = NONE
     :: else -> skip   /* a copying chunk is abandoned when its copy completes */
     fi
  :: else -> skip
  fi;
  if :: !(SEED && IS_EXPIRE) -> conclude(fx) :: else -> skip fi
}
/* END FAIL */

/* the encoder sends receiver gk of room gx a notice (spec._notice); the seed's receiver frees on Failed */
inline notice_success(gx, gk) {
  if :: SEED -> room[gx].rg[gk] = SEED_SUCCESS
     :: else -> region_NOTICE_success(room[gx].rg[gk], gt); room[gx].rg[gk] = gt; gt = 0 fi
}
inline notice_failed(gx, gk) {
  if :: SEED -> room[gx].rg[gk] = SEED_FAILED
     :: else -> region_NOTICE_failed(room[gx].rg[gk], gt); room[gx].rg[gk] = gt; gt = 0 fi
}
inline notice_released(gx, gk) { region_NOTICE_released(room[gx].rg[gk], gt); room[gx].rg[gk] = gt; gt = 0 }
inline notice_withdrawn(gx, gk) { region_NOTICE_withdrawn(room[gx].rg[gk], gt); room[gx].rg[gk] = gt; gt = 0 }

/* spec._release_settled: a Failed room's region is released (its withdraw acked) once no write can land */
inline release_settled(gx) {
  if
  :: REGIONS && !SEED ->
     gq = 0;
     do
     :: gq < room[gx].reg ->
        if
        :: room[gx].rw[gq] == W_IDLE && room[gx].rg[gq] == G_failed -> notice_released(gx, gq)
        :: room[gx].rw[gq] == W_IDLE && room[gx].rg[gq] == G_withdrawing -> notice_withdrawn(gx, gq)
        :: else -> skip
        fi;
        gq++
     :: else -> break
     od;
     gq = 0
  :: else -> skip
  fi
}

/* spec._conclude: every receiver is told; regions offered or withdrawing get the outcome */
inline conclude(cx) {
  room[cx].told = room[cx].reg;
  if
  :: REGIONS ->
     gj = 0;
     do
     :: gj < room[cx].reg ->
        if
        :: room[cx].rg[gj] == G_offered || room[cx].rg[gj] == G_withdrawing ->
           if :: room[cx].rs == R_success -> notice_success(cx, gj) :: else -> notice_failed(cx, gj) fi
        :: else -> skip
        fi;
        gj++
     :: else -> break
     od;
     gj = 0;
     if :: room[cx].rs != R_success -> release_settled(cx) :: else -> skip fi
  :: else -> skip
  fi
}


inline issue_writes(wx) {
  if :: CONCLUDED(room[wx].rs) -> kind = K_WRITE_FOR_CONCLUDED_ROOM :: else -> skip fi;
  if :: SEED -> slot[room[wx].sl].ss = S_sending :: else -> slot_send(room[wx].sl, 0) fi;
  room[wx].ch = CH_SENT; room[wx].infl = N;
  gj = 0; do :: gj < room[wx].reg -> room[wx].rw[gj] = W_FLIGHT; gj++ :: else -> break od; gj = 0
}

/* lease a slot for room gx and start its copy: any leasable slot may be taken */
inline stage(gx) {
  if
  :: !STAGEABLE(room[gx].rs) -> room[gx].ch = CH_DROPPED
  :: else ->
     if
     CHOOSE_SLOT
     fi;
     if
     :: SEED || slot[ls].ss != S_free -> slot[ls].ss = S_copying; slot[ls].unsure = 0
     :: else -> slot_lease(ls, 0)
     fi;
     slot[ls].content = gx; room[gx].ch = CH_COPYING; room[gx].sl = ls; ls = 0
  fi
}

/* serve deferred sends oldest first while a slot is leasable */
inline drain() {
  do
  :: dlen == 0 || !ANY_LEASABLE -> break
  :: else ->
     h = dq[0];
     if
     :: room[h].snd == 2 && REAP_CRASH -> hlt = 1; break
     :: else ->
        k = 0; do :: k + 1 < dlen -> dq[k] = dq[k + 1]; k++ :: else -> break od;
        dlen--; dq[dlen] = 0; k = 0;
        if
        :: room[h].snd == 2 -> room[h].ch = CH_DROPPED
        :: else -> stage(h)
        fi
     fi;
     h = 0
  od
}

inline ev_register(x) {
  if :: !CONCLUDED(room[x].rs) -> room_bind_sender(room[x].rs, (room[x].reg >= N), t); room[x].rs = t; t = 0
     :: else -> skip fi;
  room[x].snd = 1
}

inline ev_frame(x) {
  if :: REGIONS -> room[x].rg[room[x].reg] = G_offered; room[x].rw[room[x].reg] = W_IDLE :: else -> skip fi;
  room[x].reg++;
  if
  :: CONCLUDED(room[x].rs) ->
     room_add_receiver(room[x].rs, 1, t); room[x].rs = t; t = 0;
     if
     :: !SEED -> room[x].told++;
        /* told Failed at once (no write will go there), and released with it */
        if :: REGIONS -> notice_failed(x, room[x].reg - 1); release_settled(x) :: else -> skip fi
     :: SEED && room[x].rs == R_failed && room[x].ch == CH_HELD && room[x].reg >= N -> issue_writes(x)
     :: else -> skip
     fi
  :: else ->
     room_add_receiver(room[x].rs, (room[x].reg >= N), t);
     if
     :: room[x].rs == R_parked && t == R_transferring -> room[x].rs = t; issue_writes(x)
     :: room[x].rs == R_parked && t != R_transferring && SEED -> room[x].rs = t; kind = K_DEADLINE_EXTENDED
     :: else -> room[x].rs = t
     fi;
     t = 0
  fi
}

inline ev_tower(x) {
  room[x].ch = CH_DEFERRED;
  drain();
  if
  :: hlt == 1 -> skip
  :: else ->
     if
     :: dlen > 0 || !ANY_LEASABLE ->
        if :: BUSY_WAIT -> hlt = 2
           :: else -> room[x].ch = CH_DEFERRED; dq[dlen] = x; dlen++ fi
     :: else -> stage(x)
     fi
  fi
}

inline ev_tower_error(x) {
  room[x].ch = CH_DROPPED;
  if :: !CONCLUDED(room[x].rs) -> fail_fail(x) :: else -> skip fi;
  faults--
}

inline ev_copied(x) {
  if :: SEED -> slot[room[x].sl].ss = S_staged :: else -> slot_copied(room[x].sl, 0) fi;
  if
  :: !STAGEABLE(room[x].rs) ->
     if :: SEED && room[x].rs == R_failed -> slot[room[x].sl].ss = S_free
        :: else -> slot_abandon(room[x].sl, 0) fi;
     room[x].ch = CH_DROPPED; room[x].sl = NONE
  :: else ->
     room_stage(room[x].rs, (room[x].reg >= N), t); room[x].rs = t; t = 0;
     if
     :: room[x].rs == R_parked ->
        if :: SEED -> slot[room[x].sl].ss = S_parked :: else -> slot_park(room[x].sl, 0) fi;
        room[x].ch = CH_HELD
     :: else -> issue_writes(x)
     fi
  fi
}

inline ev_write(x, j, UNSURE) {
  room[x].infl--;
  if
  :: REGIONS ->
     if :: !UNSURE && room[x].rg[j] == G_released -> kind = K_WRITE_INTO_RELEASED_REGION :: else -> skip fi;
     if :: UNSURE -> room[x].rw[j] = W_GHOST :: else -> room[x].rw[j] = W_IDLE fi
  :: else -> skip
  fi;
  if :: UNSURE -> room[x].ghost++; slot[room[x].sl].unsure = 1 :: else -> skip fi;
  if
  :: SEED -> if :: UNSURE || room[x].infl == 0 -> slot[room[x].sl].ss = S_free :: else -> skip fi
  :: else -> slot_settle(room[x].sl, PENDING(room[x].sl))
  fi;
  if
  :: room[x].rs == R_transferring ->
     if
     :: !UNSURE ->
        room[x].ok++;
        if :: room[x].ok == N -> room_written(room[x].rs, 1, t); room[x].rs = t; t = 0; conclude(x)
           :: else -> skip fi
     :: else -> fail_fail(x)
     fi
  :: !UNSURE && room[x].rs == R_failed -> release_settled(x)
  :: else -> skip
  fi;
  if :: !HOLDS(x) && room[x].ch == CH_SENT -> room[x].sl = NONE :: else -> skip fi;
  if :: UNSURE -> faults-- :: else -> skip fi
}

inline ev_late_landing(x, j) {
  if
  :: slot[room[x].sl].content != x -> kind = K_OVERWRITE_UNDER_LATE_WRITE
  :: REGIONS && slot[room[x].sl].content == x && room[x].rg[j] == G_released -> kind = K_WRITE_INTO_RELEASED_REGION
  :: else -> skip
  fi;
  room[x].ghost--;
  /* the seed waits out no quarantine: a landed write is simply gone */
  if :: REGIONS -> if :: SEED -> room[x].rw[j] = W_IDLE :: else -> room[x].rw[j] = W_LANDED fi :: else -> skip fi;
  if :: !HOLDS(x) -> room[x].sl = NONE :: else -> skip fi
}

/* a receiver withdraws an offered region; the seed's receiver frees it, the encoder never hears */
inline ev_withdraw(x, j) {
  if
  :: SEED -> room[x].rg[j] = G_released
  :: else -> region_withdraw(room[x].rg[j], gt); room[x].rg[j] = gt; gt = 0; fail_fail(x)
  fi;
  faults--
}

/* the seed's reaper pops a parked chunk of a room already failed */
inline ev_seed_reaper(x) {
  slot[room[x].sl].ss = S_free; room[x].ch = CH_DROPPED; room[x].sl = NONE
}

inline ev_expire(x) {
  if
  :: room[x].rs == R_parked -> fail_expire(x); room[x].ch = CH_DROPPED; room[x].sl = NONE
  :: else -> fail_expire(x)
  fi
}

inline reap() {
  k = 0;
  do
  :: k < R -> if :: room[k].snd == 1 && CONCLUDED(room[k].rs) && room[k].ch != CH_AWAITING_TOWER -> room[k].snd = 2
                 :: else -> skip fi; k++
  :: else -> break
  od;
  k = 0
}

inline release(x) {
  slot_release(x, 0);
  k = 0;
  do
  :: k < R -> if :: room[k].sl == x && HOLDS(k) -> room[k].ghost = 0;
                    if
                    :: REGIONS ->
                       gj = 0;
                       do
                       :: gj < room[k].reg ->
                          if :: room[k].rw[gj] == W_GHOST || room[k].rw[gj] == W_LANDED -> room[k].rw[gj] = W_IDLE
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
  k = 0
}

inline pre() {
  k = 0; do :: k < R -> ors[k] = room[k].rs; k++ :: else -> break od; orank = RANK; kind = 0; k = 0
}

inline report() {
  if
  :: (ASSERTED >> kind) & 1 -> printf("VIOLATION %d\n", kind); assert(false)
  :: else -> stop = 1
  fi
}

inline post() {
  d_step {
    /* each room's receivers in order (spec.successors' emit sorts them) */
    if :: REGIONS -> sort_receivers() :: else -> skip fi;
    /* a slot no room uses forgets whose bytes it held (spec.successors' emit) */
    q = 0;
    do
    :: q < S ->
       k = 0; n = 0;
       do :: k < R -> if :: room[k].sl == q -> n = 1 :: else -> skip fi; k++ :: else -> break od;
       if :: n == 0 -> slot[q].content = NONE :: else -> skip fi; q++
    :: else -> break
    od;
    /* the checks: the step's own violation, then failure sticky / status forward / rank, then the invariant */
    if
    :: kind == 0 ->
       k = 0;
       do
       :: k < R && kind == 0 ->
          if :: CONCLUDED(ors[k]) && room[k].rs != ors[k] ->
                if :: ors[k] == R_failed -> kind = K_FAILURE_NOT_STICKY :: else -> kind = K_STATUS_NOT_FORWARD fi
             :: else -> skip fi;
          k++
       :: else -> break
       od;
       if :: kind == 0 && RANK <= orank -> kind = K_MODEL_CYCLE :: else -> skip fi
    :: else -> skip
    fi;
    if
    :: kind == 0 && hlt == 1 -> kind = K_CRASH
    :: else -> skip
    fi;
    k = 0;
    do
    :: k < R && kind == 0 ->
       if
       :: room[k].sl != NONE && slot[room[k].sl].content != k ->
          if
          :: room[k].ghost > 0 -> kind = K_OVERWRITE_UNDER_LATE_WRITE
          :: room[k].ghost == 0 && room[k].infl > 0 -> kind = K_OVERWRITE_UNDER_WRITE
          :: room[k].ghost == 0 && room[k].infl == 0 && (room[k].ch == CH_COPYING || room[k].ch == CH_HELD) ->
             kind = K_OVERWRITE_UNDER_CHUNK
          :: else -> skip
          fi
       :: else -> skip
       fi;
       if
       :: kind == 0 && CONCLUDED(room[k].rs) && room[k].told < room[k].reg -> kind = K_RECEIVER_NOT_TOLD
       :: kind == 0 && room[k].rs == R_success && room[k].ok < N -> kind = K_SUCCESS_WITHOUT_ALL_WRITES
       :: else -> skip
       fi;
       gj = 0;
       do
       :: REGIONS && kind == 0 && gj < room[k].reg ->
          if
          :: room[k].rg[gj] == G_written && (room[k].rw[gj] == W_FLIGHT || room[k].rw[gj] == W_GHOST) ->
             kind = K_SUCCESS_UNDER_WRITE
          :: (room[k].rg[gj] == G_written && room[k].rs != R_success) || (room[k].rg[gj] == G_failed && room[k].rs == R_success) ->
             kind = K_WRONG_OUTCOME
          :: else -> skip
          fi;
          gj++
       :: else -> break
       od;
       gj = 0;
       k++
    :: else -> break
    od;
    canon();
    printf("EV %d %d\n", ev, x);
    show_state();
    if :: kind != 0 -> report() :: else -> skip fi;
    kind = 0; k = 0; n = 0; q = 0; orank = 0;
    k = 0; do :: k < R -> ors[k] = 0; k++ :: else -> break od; k = 0
  }
}

inline show_state() {
  printf("ST %d %d %d", hlt, faults, dlen);
  k = 0; do :: k < dlen -> printf(" %d", dq[k]); k++ :: else -> break od;
  printf("\n");
  k = 0;
  do
  :: k < R -> printf("RM %d %d %d %d %d %d %d %d %d", room[k].rs, room[k].snd, room[k].ch, room[k].reg,
                     room[k].told, room[k].ok, room[k].infl, room[k].ghost, room[k].sl);
     gj = 0; do :: gj < N -> printf(" %d %d", room[k].rg[gj], room[k].rw[gj]); gj++ :: else -> break od; gj = 0;
     printf("\n"); k++
  :: else -> break
  od;
  k = 0;
  do :: k < S -> printf("SL %d %d %d\n", slot[k].ss, slot[k].content, slot[k].unsure); k++ :: else -> break od;
  k = 0
}

/* sort each room's registered receivers by (region, write): stable insertion sort */
inline sort_receivers() {
  k = 0;
  do
  :: k < R ->
     gj = 1;
     do
     :: gj < room[k].reg ->
        gq = gj;
        do
        :: gq > 0 && room[k].rg[gq - 1] * 4 + room[k].rw[gq - 1] > room[k].rg[gq] * 4 + room[k].rw[gq] ->
           gt = room[k].rg[gq]; room[k].rg[gq] = room[k].rg[gq - 1]; room[k].rg[gq - 1] = gt;
           gt = room[k].rw[gq]; room[k].rw[gq] = room[k].rw[gq - 1]; room[k].rw[gq - 1] = gt;
           gq--
        :: else -> break
        od;
        gj++
     :: else -> break
     od;
     k++
  :: else -> break
  od;
  k = 0; gj = 0; gq = 0; gt = 0
}

/* relabel rooms and slots into explore.canonical's order */
inline canon() {
  k = 0;
  do
  :: k < R ->
     n = NONE;
     q = 0; do :: q < dlen -> if :: dq[q] == k -> n = q :: else -> skip fi; q++ :: else -> break od;
     if
     :: room[k].sl != NONE ->
        SETKEYS(k, slot[room[k].sl].ss, slot[room[k].sl].unsure, slot[room[k].sl].content == k,
                (n == NONE -> 0 : n + 1))
     :: else -> SETKEYS(k, 0, 0, 0, (n == NONE -> 0 : n + 1))
     fi;
     ord[k] = k; k++
  :: else -> break
  od;
  /* stable insertion sort of rooms by key (ties keep their index order) */
  k = 1;
  do
  :: k < R ->
     tmp = ord[k]; q = k;
     do :: q > 0 && KEYGT(ord[q - 1], tmp) -> ord[q] = ord[q - 1]; q-- :: else -> break od;
     ord[q] = tmp; k++
  :: else -> break
  od;
  k = 0; do :: k < R -> rmap[ord[k]] = k; k++ :: else -> break od;
  /* used slots follow their rooms */
  k = 0; do :: k < S -> smap[k] = NONE; k++ :: else -> break od;
  n = 0; k = 0;
  do
  :: k < R ->
     tmp = room[ord[k]].sl;
     if :: tmp != NONE && smap[tmp] == NONE -> smap[tmp] = n; n++ :: else -> skip fi; k++
  :: else -> break
  od;
  /* unused slots next, by state then unsure (stable) */
  q = 0; k = 0;
  do :: k < S -> if :: smap[k] == NONE -> sord[q] = k; q++ :: else -> skip fi; k++ :: else -> break od;
  k = 1;
  do
  :: k < q ->
     tmp = sord[k]; best = k;
     do
     :: best > 0 && (slot[sord[best - 1]].ss * 2 + slot[sord[best - 1]].unsure > slot[tmp].ss * 2 + slot[tmp].unsure) ->
        sord[best] = sord[best - 1]; best--
     :: else -> break
     od;
     sord[best] = tmp; k++
  :: else -> break
  od;
  k = 0; do :: k < q -> smap[sord[k]] = n; n++; k++ :: else -> break od;
  /* permute */
  k = 0;
  do
  :: k < R ->
     t_rs[k] = room[k].rs; t_snd[k] = room[k].snd; t_ch[k] = room[k].ch; t_reg[k] = room[k].reg;
     t_told[k] = room[k].told; t_ok[k] = room[k].ok; t_infl[k] = room[k].infl; t_ghost[k] = room[k].ghost;
     t_sl[k] = room[k].sl;
     gj = 0; do :: gj < N -> t_rg[k * N + gj] = room[k].rg[gj]; t_rw[k * N + gj] = room[k].rw[gj]; gj++
                :: else -> break od; gj = 0;
     k++
  :: else -> break
  od;
  k = 0;
  do
  :: k < R ->
     tmp = rmap[k];
     room[tmp].rs = t_rs[k]; room[tmp].snd = t_snd[k]; room[tmp].ch = t_ch[k]; room[tmp].reg = t_reg[k];
     room[tmp].told = t_told[k]; room[tmp].ok = t_ok[k]; room[tmp].infl = t_infl[k]; room[tmp].ghost = t_ghost[k];
     if :: t_sl[k] == NONE -> room[tmp].sl = NONE :: else -> room[tmp].sl = smap[t_sl[k]] fi;
     gj = 0; do :: gj < N -> room[tmp].rg[gj] = t_rg[k * N + gj]; room[tmp].rw[gj] = t_rw[k * N + gj]; gj++
                :: else -> break od; gj = 0;
     k++
  :: else -> break
  od;
  k = 0;
  do
  :: k < S -> t_ss[k] = slot[k].ss; t_content[k] = slot[k].content; t_unsure[k] = slot[k].unsure; k++
  :: else -> break
  od;
  k = 0;
  do
  :: k < S ->
     tmp = smap[k];
     slot[tmp].ss = t_ss[k]; slot[tmp].unsure = t_unsure[k];
     if :: t_content[k] == NONE -> slot[tmp].content = NONE :: else -> slot[tmp].content = rmap[t_content[k]] fi;
     k++
  :: else -> break
  od;
  k = 0; do :: k < dlen -> dq[k] = rmap[dq[k]]; k++ :: else -> break od;
  k = 0; n = 0; q = 0; tmp = 0; best = 0
}
"""


def _choose_slot(S: int) -> str:
    return "\n".join(f"     :: LEASABLE({s}) -> ls = {s}" for s in range(S))


# -- reading SPIN's results ----------------------------------------------------------------------------------------------


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
    rooms, slots = [], []
    for line in lines[1:]:
        tag, *f = line.split()
        f = [int(v) for v in f]
        if tag == "RM":
            # receivers: (region, write) pairs after the room's fields; region 0 is no receiver (or no regions)
            rcv = tuple((REGION_STATES[g - 1], w) for g, w in zip(f[9::2], f[10::2]) if g)
            rooms.append((ROOM_STATES[f[0]], *f[1:8], rcv, -1 if f[8] == NONE else f[8]))
        else:
            slots.append((SLOT_STATES[f[0] - 1], -1 if f[1] == NONE else f[1], bool(f[2])))
    return (tuple(rooms), tuple(slots), deferred, faults, HALTS[halt], ())


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
        elif line.startswith(("ST ", "RM ", "SL ")):
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
    for n, (event, _arg, target) in enumerate(steps, 1):
        for step in spec.successors(state):
            if step.event[0] == event and canonical(step.state) == target:
                prev, state = state, step.state
                trace.append((step.event, state))
                break
        else:
            raise Disagreement(f"SPIN step {n} ({event}) reaches a state the spec cannot reach from "
                               f"{spec.describe(state)}: {spec.describe(target)}")
    if kind == "deadlock":
        got = "deadlock" if not spec.successors(state) and not spec.is_final(state) else None
    else:
        got = step.violation or (_transition_check(spec, prev, state) or spec.invariant(state) or (None,))[0]
    if got != kind:
        raise Disagreement(f"SPIN reports {kind} after {len(steps)} steps; the spec says {got or 'no violation'}")
    return trace


