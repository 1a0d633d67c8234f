"""The environment's events in Promela, one family per family of `models/events.py`, in its order.

Each room family is a function giving its arms for room `i` (receiver `j`): the
event's name, its guard, the statement that takes it, and whether it is about
one receiver; and a text holding the family's inlines. The rules follow the
spec's (same names, same order of effects); machine moves go through the
`move_room_<event>` / `move_extent_<event>` inlines, which run the couplings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import promela_peers

Arm = tuple[str, str, str, bool]  # (event, guard, statement, about one receiver)

# -- the regions and the ring: the rules the event families share -------------------------------
REGIONS = r"""
/* receiver gk of room gx takes a notice (rules._deliver); the seed's receiver frees on Failed */
inline deliver_success(gx, gk) {
  if :: SEED -> room[gx].rg[gk] = SEED_SUCCESS
     :: else -> region_NOTICE_success(room[gx].rg[gk], gt); room[gx].rg[gk] = gt; gt = 0 fi;
  room[gx].rt[gk] = (room[gx].rt[gk] == T_NONE -> T_SUCCESS : T_TWICE)  /* state.told_after */
}
inline deliver_failed(gx, gk) {
  if :: SEED -> room[gx].rg[gk] = SEED_FAILED
     :: else -> region_NOTICE_failed(room[gx].rg[gk], gt); room[gx].rg[gk] = gt; gt = 0 fi;
  room[gx].rt[gk] = (room[gx].rt[gk] == T_NONE -> T_FAILED : T_TWICE)
}
inline deliver_released(gx, gk) { region_NOTICE_released(room[gx].rg[gk], gt); room[gx].rg[gk] = gt; gt = 0 }
inline deliver_withdrawn(gx, gk) { region_NOTICE_withdrawn(room[gx].rg[gk], gt); room[gx].rg[gk] = gt; gt = 0 }

/* the encoder sends a notice (rules._notice): with channels it joins the receiver's FIFO (base-5 digits, the
   head lowest: state.chan_push), else it arrives at once */
inline chan_push(gx, gk, code) {
  if
  :: room[gx].rc[gk] == 0 -> room[gx].rc[gk] = code
  :: room[gx].rc[gk] > 0 && room[gx].rc[gk] < 5 -> room[gx].rc[gk] = room[gx].rc[gk] + code * 5
  :: room[gx].rc[gk] >= 5 && room[gx].rc[gk] < 25 -> room[gx].rc[gk] = room[gx].rc[gk] + code * 25
  :: else -> printf("MODELBUG channel full\n"); assert(false)
  fi
}
NOTICE_INLINES

/* rules._release_settled: a Failed room's region is released (its withdraw acked) once no write can land */
inline release_settled(gx) {
  if
  :: REGIONS && !SEED ->
     gq = 0;
     do
     :: gq < room[gx].reg ->
        if
SETTLE_ARMS
        :: else -> skip  /* a write may land: wait */
        fi;
        gq++
     :: else -> break
     od;
     gq = 0
  :: else -> skip
  fi
}

/* rules._offer: one more receiver registered; with regions it offers its receive region */
inline offer(ox) {
  if :: REGIONS -> room[ox].rg[room[ox].reg] = G_offered; room[ox].rw[room[ox].reg] = W_IDLE;
              room[ox].rt[room[ox].reg] = T_NONE :: else -> skip fi;
  room[ox].reg++
}
"""

RING = r"""
/* rules._spread: the extent's other cells take its first cell's state; a free extent falls apart into free cells
   (with spans, a spanning extent's other cells are those marked with its first, wherever they lie) */
inline spread(px) {
  sp = px + 1;  /* one run */
  do  /* one run */
  :: sp < px + (cell[px].span -> cell[px].span : 1) ->  /* one run */
     cell[sp].ss = cell[px].ss; cell[sp].unsure = cell[px].unsure;  /* one run */
     if :: cell[px].ss == S_free -> cell[sp].span = 1 :: else -> skip fi;  /* one run */
     sp++  /* one run */
  :: else -> break  /* one run */
  od;  /* one run */
  if :: cell[px].ss == S_free -> cell[px].span = 1 :: else -> skip fi;  /* one run */
  sp = 0  /* one run */
  sq = SPANS(px); sp = px + 1;  /* spans */
  do  /* spans */
  :: sp < C && (sq || sp < px + (cell[px].span -> cell[px].span : 1)) ->  /* spans */
     if  /* spans */
     :: !sq || cell[sp].span == MARK(px) ->  /* spans */
        cell[sp].ss = cell[px].ss; cell[sp].unsure = cell[px].unsure;  /* spans */
        if :: cell[px].ss == S_free -> cell[sp].span = 1 :: else -> skip fi  /* spans */
     :: else -> skip  /* spans */
     fi;  /* spans */
     sp++  /* spans */
  :: else -> break  /* spans */
  od;  /* spans */
  if :: cell[px].ss == S_free -> cell[px].span = 1 :: else -> skip fi;  /* spans */
  sp = 0; sq = 0  /* spans */
}

/* rules._issue_writes: one write per receiver from the room's extent */
inline issue_writes(wx) {
  if :: CONCLUDED(room[wx].rs) -> kind = K_WRITE_FOR_CONCLUDED_ROOM :: else -> skip fi;
  if
  :: PEERS && !ALL_UP -> room[wx].ch = CH_HELD  /* the chunk waits in its extent until every peer is up */
  :: else ->
     move_extent_send(room[wx].sl, 0);
     room[wx].ch = CH_SENT; room[wx].infl = N;
     gj = 0; do :: gj < room[wx].reg -> room[wx].rw[gj] = W_FLIGHT; gj++ :: else -> break od; gj = 0
  fi
}

/* rules._drop_chunk: the room's chunk will never be sent, its extent goes back free */
inline drop_chunk(dx) {
  move_extent_abandon(room[dx].sl, 0); room[dx].ch = CH_DROPPED; room[dx].sl = NONE
}

/* rules._stage: lease an extent of the room's size and start its copy: any place it fits may be taken */
inline stage(gx) {
  if
  :: !STAGEABLE(room[gx].rs) -> room[gx].ch = CH_DROPPED
  :: else ->
     if
     CHOOSE_PLACE
     fi;
     /* a busy extent is never overlapped (rules._stage) */  /* one run */
     lc = ls;  /* one run */
     do  /* one run */
     :: lc < ls + room[gx].sz ->  /* one run */
        if  /* one run */
        :: kind == 0 && TAKEN(lc) -> kind = K_OVERLAP_OF_BUSY_EXTENT  /* one run */
        :: else -> skip  /* one run */
        fi;  /* one run */
        lc++  /* one run */
     :: else -> break  /* one run */
     od;  /* one run */
     lc = ls;  /* one run */
     do :: lc < ls + room[gx].sz -> cell[lc].content = gx; cell[lc].span = 0; lc++ :: else -> break od;  /* one run */
     lc = 0;  /* one run */
     /* lm: the cells of a span (a bit each), else the run from ls */  /* spans */
     lc = ls;  /* spans */
     do  /* spans */
     :: lc < C && (lm || lc < ls + room[gx].sz) ->  /* spans */
        if  /* spans */
        :: (!lm || (lm >> lc) & 1) && kind == 0 && TAKEN(lc) -> kind = K_OVERLAP_OF_BUSY_EXTENT  /* spans */
        :: else -> skip  /* spans */
        fi;  /* spans */
        lc++  /* spans */
     :: else -> break  /* spans */
     od;  /* spans */
     lc = ls;  /* spans */
     do  /* spans */
     :: lc < C && (lm || lc < ls + room[gx].sz) ->  /* spans */
        if  /* spans */
        :: !lm || (lm >> lc) & 1 -> cell[lc].content = gx; cell[lc].span = (lm -> MARK(ls) : 0)  /* spans */
        :: else -> skip  /* spans */
        fi;  /* spans */
        lc++  /* spans */
     :: else -> break  /* spans */
     od;  /* spans */
     lc = 0; lm = 0;  /* spans */
     cell[ls].span = room[gx].sz;
     if
     :: cell[ls].ss != S_free -> cell[ls].ss = S_copying; cell[ls].unsure = 0; spread(ls)
     :: else -> move_extent_lease(ls, 0)
     fi;
     room[gx].ch = CH_COPYING; room[gx].sl = ls; ls = 0
  fi
}

/* rules._serve_deferred: oldest first; a reaped or concluded head is dropped, one that fits is staged,
   else nothing behind it overtakes it */
inline serve_deferred() {
  do
  :: dlen == 0 -> break
  :: dlen > 0 && room[dq[0]].snd != 2 && STAGEABLE(room[dq[0]].rs) && !PLACEABLE(room[dq[0]].sz) -> break
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
"""


# -- room families ---------------------------------------------------------------------------------
def register(r: str, i: str, j: str, cfg) -> list[Arm]:
    return [("register", f"{r}.snd == 0", f"ev_register({i})", False)]


REGISTER = r"""
inline ev_register(x) {
  if :: !CONCLUDED(room[x].rs) -> move_room_bind_sender(x) :: else -> skip fi;
  room[x].snd = 1
}
"""


def frame(r: str, i: str, j: str, cfg) -> list[Arm]:
    return promela_peers.frame_arms(r, i)


FRAME = r"""
inline ev_frame(x) {
  contact_peer(x);
  offer(x);
  if
  :: CONCLUDED(room[x].rs) -> move_room_add_receiver(x); late_receiver(x)
  :: else ->
     move_room_add_receiver(x);
     /* the seed re-arms the park deadline on a partial registration */
     if :: SEED && room[x].rs == R_parked -> kind = K_DEADLINE_EXTENDED :: else -> skip fi
  fi
}

/* a receiver of a concluded room is told Failed at once (no write will go there), and released with it;
   the seed tells it nothing, and the last one of a failed room flushes its parked chunk, which is sent */
inline late_receiver(x) {
  if
  :: !SEED ->
     room[x].told++;
     if :: REGIONS -> notice_failed(x, room[x].reg - 1); release_settled(x) :: else -> skip fi
  :: SEED && room[x].rs == R_failed && room[x].ch == CH_HELD && room[x].reg >= N -> issue_writes(x)
  :: else -> skip
  fi
}
"""


def tower(r: str, i: str, j: str, cfg) -> list[Arm]:
    waiting = f"{r}.snd == 1 && {r}.ch == CH_AWAITING_TOWER"
    # one arm per size the item may have; one larger than the arena fails its room at once
    sized = [("tower", f"{waiting} && STAGEABLE({r}.rs)",
              f"ev_tower({i}, {z})" if z <= cfg.cells else f"ev_too_large({i}, {z})", False) for z in cfg.sizes]
    return [("tower", f"{waiting} && !STAGEABLE({r}.rs)", f"{r}.ch = CH_DROPPED", False), *sized,
            ("tower_error", f"{waiting} && STAGEABLE({r}.rs) && faults > 0", f"ev_tower_error({i})", False),
            ("stage_error", f"{waiting} && STAGEABLE({r}.rs) && faults > 0", f"ev_tower_error({i})", False)]


TOWER = r"""
inline ev_tower(x, z) {
  room[x].sz = z; room[x].ch = CH_DEFERRED;
  serve_deferred();  /* one identity */
  serve_fair();  /* shares */
  if
  :: hlt == 1 -> skip
  :: else ->
     if
     :: dlen > 0 || !PLACEABLE(z) ->  /* one identity */
        if :: BUSY_WAIT -> hlt = 2  /* one identity */
           :: else -> room[x].ch = CH_DEFERRED; dq[dlen] = x; dlen++ fi  /* one identity */
     :: sw || HELD_BACK(x) || !PLACEABLE(z) -> room[x].ch = CH_DEFERRED; enqueue(x)  /* shares */
     :: else -> stage(x)
     fi
  fi
}

inline ev_too_large(x, z) {
  room[x].sz = z; room[x].ch = CH_DROPPED; move_room_fail(x)
}

inline ev_tower_error(x) {
  room[x].ch = CH_DROPPED; move_room_fail(x); faults--
}
"""


def copied(r: str, i: str, j: str, cfg) -> list[Arm]:
    return [("copied", f"{r}.ch == CH_COPYING && cell[{r}.sl].ss == S_copying", f"ev_copied({i})", False)]


COPIED = r"""
inline ev_copied(x) {
  move_extent_copied(room[x].sl, 0);
  if
  :: !STAGEABLE(room[x].rs) -> drop_chunk(x)
  :: else -> move_room_stage(x)
  fi
}
"""


def write_outcomes(r: str, i: str, j: str, cfg) -> list[Arm]:
    flight = f" && {r}.rw[{j}] == W_FLIGHT" if cfg.regions else ""
    return [("write_done", f"{r}.infl > 0{flight}", f"ev_write({i}, {j}, 0)", True),
            ("write_unsure", f"{r}.infl > 0 && faults > 0{flight}", f"ev_write({i}, {j}, 1)", True)]


WRITE_OUTCOMES = r"""
inline ev_write(x, j, UNSURE) {
  room[x].infl--;
  if
  :: REGIONS ->
     if :: !UNSURE && room[x].rg[j] == G_released -> kind = K_WRITE_INTO_RELEASED_REGION :: else -> skip fi;
     if :: UNSURE -> room[x].rw[j] = W_GHOST :: else -> room[x].rw[j] = W_IDLE fi
  :: else -> skip
  fi;
  if :: UNSURE -> room[x].ghost++; cell[room[x].sl].unsure = 1 :: else -> skip fi;
  if
  :: SEED -> if :: UNSURE || room[x].infl == 0 -> cell[room[x].sl].ss = S_free :: else -> skip fi; spread(room[x].sl)
  :: else -> move_extent_settle(room[x].sl, PENDING(room[x].sl))
  fi;
  if
  :: room[x].rs == R_transferring ->
     if
     :: !UNSURE -> room[x].ok++; if :: room[x].ok == N -> move_room_written(x) :: else -> skip fi
     :: else -> move_room_fail(x)
     fi
  :: !UNSURE && room[x].rs == R_failed -> release_settled(x)
  :: else -> skip
  fi;
  if :: !HOLDS(x) && room[x].ch == CH_SENT -> room[x].sl = NONE :: else -> skip fi;
  if :: UNSURE -> faults-- :: else -> skip fi
}
"""


def late_landings(r: str, i: str, j: str, cfg) -> list[Arm]:
    ghost = f" && {r}.rw[{j}] == W_GHOST" if cfg.regions else ""
    if cfg.late_landing:  # a stray (its quarantine over) may land too
        ghost = f" && ({r}.rw[{j}] == W_GHOST || {r}.rw[{j}] == W_STRAY)"
    return [("late_landing", f"{r}.ghost > 0{ghost}", f"ev_late_landing({i}, {j})", True)]


LATE_LANDINGS = r"""
inline ev_late_landing(x, j) {
  if
  :: !OWNS(x) -> kind = K_OVERWRITE_UNDER_LATE_WRITE
  :: REGIONS && OWNS(x) && room[x].rg[j] == G_released -> kind = K_WRITE_INTO_RELEASED_REGION
  :: else -> skip
  fi;
  room[x].ghost--;
  /* the seed waits out no quarantine: a landed write is simply gone */
  if :: REGIONS -> if :: SEED -> room[x].rw[j] = W_IDLE :: else -> room[x].rw[j] = W_LANDED fi  /* not late */
     :: else -> skip fi;  /* not late */
  /* a stray lands after its quarantine: nothing waits for it any more */  /* late */
  if :: room[x].rw[j] == W_STRAY -> room[x].rw[j] = W_IDLE :: else -> room[x].rw[j] = W_LANDED fi;  /* late */
  if :: !HOLDS(x) -> room[x].sl = NONE :: else -> skip fi
}
"""


def deadlines(r: str, i: str, j: str, cfg) -> list[Arm]:
    return [("expire", f"SEED && {r}.rs == R_failed && {r}.ch == CH_HELD", f"drop_chunk({i})", False),
            ("expire", f"ARMED_ROOM({r}.rs)", f"move_room_expire({i})", False)]


def withdraws(r: str, i: str, j: str, cfg) -> list[Arm]:
    if not cfg.regions:  # no receivers modelled: nothing to withdraw
        return []
    if cfg.channels:  # the receiver withdraws; the encoder hears it later (withdraws_seen)
        return [("withdraw", f"faults > 0 && {r}.rg[{j}] == G_offered && {r}.rd[{j}] == WD_NONE",
                 f"ev_withdraw_sent({i}, {j})", True)]
    return [("withdraw", f"faults > 0 && !CONCLUDED({r}.rs) && {r}.rg[{j}] == G_offered", f"ev_withdraw({i}, {j})",
             True)]


WITHDRAWS = r"""
/* a receiver withdraws an offered region; the seed's receiver frees it, the encoder never hears */
inline ev_withdraw_sent(x, j) {
  region_withdraw(room[x].rg[j], gt); room[x].rg[j] = gt; gt = 0; room[x].rd[j] = WD_SENT; faults--
}
inline ev_withdraw(x, j) {
  if
  :: SEED -> room[x].rg[j] = G_released
  :: else -> region_withdraw(room[x].rg[j], gt); room[x].rg[j] = gt; gt = 0; move_room_fail(x)
  fi;
  faults--
}
"""


def abort(r: str, i: str, j: str, cfg) -> list[Arm]:
    return [("abort", f"faults > 0 && {r}.snd == 1 && !CONCLUDED({r}.rs)", f"move_room_fail({i}); faults--", False)]


def deliveries(r: str, i: str, j: str, cfg) -> list[Arm]:
    if not cfg.channels:
        return []
    return [("deliver", f"{r}.rc[{j}] != 0", f"ev_deliver({i}, {j})", True)]


def withdraws_seen(r: str, i: str, j: str, cfg) -> list[Arm]:
    if not cfg.channels:
        return []
    return [("withdraw_seen", f"{r}.rd[{j}] == WD_SENT", f"ev_withdraw_seen({i}, {j})", True)]


CHANNELS = r"""
/* the notice at the head of a receiver's FIFO reaches it (events_withdraws.Withdraws.deliveries) */
inline ev_deliver(x, j) {
  lc = room[x].rc[j] % 5; room[x].rc[j] = room[x].rc[j] / 5;
  if
  :: lc == NC_SUCCESS -> deliver_success(x, j)
  :: lc == NC_FAILED -> deliver_failed(x, j)
  :: lc == NC_RELEASED -> deliver_released(x, j)
  :: lc == NC_WITHDRAWN -> deliver_withdrawn(x, j)
  fi;
  lc = 0
}
/* a receiver's withdraw reaches the encoder: a live room fails, the withdraw is acked once settled */
inline ev_withdraw_seen(x, j) {
  room[x].rd[j] = WD_SEEN;
  if :: !CONCLUDED(room[x].rs) -> move_room_fail(x) :: else -> skip fi;
  release_settled(x)
}
"""


def notices(cfg) -> str:
    """The notice inlines and release_settled's arms: with channels a notice joins the FIFO and the encoder
    acts on what it knows (rules._release_settled_by_encoder); without, a notice arrives at once."""
    if cfg.channels:
        inl = "\n".join(f"inline notice_{n}(gx, gk) {{ chan_push(gx, gk, NC_{n.upper()}) }}"
                         for n in ("success", "failed", "released", "withdrawn"))
        arms = """        :: SETTLED(room[gx].rw[gq]) && room[gx].rd[gq] == WD_SEEN -> room[gx].rd[gq] = WD_ACKED;
           notice_withdrawn(gx, gq)
        :: SETTLED(room[gx].rw[gq]) && room[gx].rd[gq] != WD_SEEN && room[gx].rs == R_failed &&
           !room[gx].rr[gq] && room[gx].rd[gq] != WD_ACKED -> room[gx].rr[gq] = 1; notice_released(gx, gq)"""
    else:  # the deliver_ inlines are renamed notice_ (promela._rules): an inline calling one costs d_step room
        inl = ""
        arms = """        :: SETTLED(room[gx].rw[gq]) && room[gx].rg[gq] == G_failed -> notice_released(gx, gq)
        :: SETTLED(room[gx].rw[gq]) && room[gx].rg[gq] == G_withdrawing -> notice_withdrawn(gx, gq)"""
    return inl, arms


Family = Callable[[str, str, str, Any], list[Arm]]
ROOM_FAMILIES: tuple[tuple[Family, str], ...] = (
    (register, REGISTER), (frame, FRAME), (tower, TOWER), (copied, COPIED), (write_outcomes, WRITE_OUTCOMES),
    (late_landings, LATE_LANDINGS), (deadlines, ""), (withdraws, WITHDRAWS), (abort, ""),
    (promela_peers.write_deadline, promela_peers.TEXT), (deliveries, CHANNELS), (withdraws_seen, ""))


def room_arms(i: str, j: str, cfg) -> list[Arm]:
    """Every room family's arms for room i (receiver j), in spec.successors' order."""
    r = f"room[{i}]"
    live = "LIVE && " if i != "x" else ""
    # With regions a write, a late landing or a withdraw is about receiver j; without, about the room ("0").
    j = j if cfg.regions else "0"
    return [(name, live + guard, act, per)
            for family, _ in ROOM_FAMILIES for name, guard, act, per in family(r, i, j, cfg)]


# -- the encoder's families: (guards that enable them, the proctype's arm) ---------------------------
def deferred_served(event: int) -> tuple[list[str], str]:
    guard = ("LIVE && dlen > 0 && (room[dq[0]].snd == 2 || !STAGEABLE(room[dq[0]].rs) || "
             "PLACEABLE(room[dq[0]].sz))")
    return [f"({guard})"], f"    :: {guard} -> ev = {event}; x = 255; d_step {{ pre() }}; serve_deferred()"


def deferred_served_fair(event: int) -> tuple[list[str], str]:
    """With identities: the round (promela_shares.serve_fair) when it would change something (`srv`)."""
    guard = "LIVE && srv"
    return [f"({guard})"], f"    :: {guard} -> ev = {event}; x = 255; d_step {{ pre() }}; serve_fair()"


def reap(event: int, rooms: int) -> tuple[list[str], str]:
    reapable = " || ".join(f"(room[{i}].snd == 1 && CONCLUDED(room[{i}].rs) && room[{i}].ch != CH_AWAITING_TOWER)"
                           for i in range(rooms))
    guard = f"LIVE && ({reapable})"
    return [f"({guard})"], f"    :: {guard} -> ev = {event}; x = 255; d_step {{ pre(); reap() }}"


REAP = r"""
inline reap() {
  k = 0;
  do
  :: k < R -> if :: room[k].snd == 1 && CONCLUDED(room[k].rs) && room[k].ch != CH_AWAITING_TOWER -> room[k].snd = 2
                 :: else -> skip fi; k++
  :: else -> break
  od;
  k = 0
}
"""


def quarantine_ends(event: int, cells: int) -> tuple[list[str], str]:
    # an extent's deadline: at its first cell (the others carry its state too)
    guards = [f"LIVE && FIRST({s}) && ARMED_EXTENT(cell[{s}].ss) && !PENDING({s})" for s in range(cells)]
    pick = " ".join(f":: {g} -> x = {s}" for s, g in enumerate(guards))
    return guards, f"    :: if {pick} fi; ev = {event}; d_step {{ pre(); move_extent_release(x, 0) }}"


TEXT = "".join((REGIONS, RING, *(text for _, text in ROOM_FAMILIES), REAP))
