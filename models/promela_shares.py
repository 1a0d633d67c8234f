"""Shares by identity in Promela (`Config.identities` > 1; models/shares.py is the spec's).

A room's owner is not stored: `Spec.owners` gives identity blocks of room indices, and the canonical
order sorts rooms by owner first (the key's most significant field here), so after every step room x
is still identity `OWN(x)`'s. A busy cell no room covers keeps its identity as `FORGOT + owner` in its
content (the spec's `-2 - owner`). `srv` is a state bit `post()` computes after each step (whether
serving the deferred queues would change anything: `Shares.servable`); it is a function of the
rest of the state, so it adds no state. The round's own bookkeeping lives in the proctype's locals,
since a placement chosen while staging is backtracked over, and zeroed at the end of each step.

Lines tagged `/* shares */` are emitted only with identities, `/* one identity */` only without.
"""

from __future__ import annotations

from .shares import Shares
from .spec import Spec

FORGOT = 200  # content codes FORGOT + v: a busy cell charged to identity v that no room covers


def constants(cfg) -> list[str]:
    if cfg.identities < 2:
        return []
    if Shares.one_fifo:
        raise ValueError("promela: the one-FIFO mutant is the explorer's only")
    owners = Spec(cfg).owners()
    # OWN(x): the block room x is in
    own = "0"
    for v in range(1, cfg.identities):  # the highest block outermost
        own = f"((x) >= {owners.index(v)} -> {v} : {own})"
    cap = Shares(cfg).cap
    uncharged = "".join(f" && cell[s].ss != S_{st}" for st in Shares.uncharged)
    held = " + ".join(f"(cell[{s}].ss != S_free && cell[{s}].content != NONE{uncharged.replace('[s]', f'[{s}]')} "
                      f"&& CELLOWN(cell[{s}].content) == (v))" for s in range(cfg.cells))
    left = " || ".join(f"(OWN({i}) == (v) && (room[{i}].snd != 0 || room[{i}].reg != 0) && !CONCLUDED(room[{i}].rs))"
                       for i in range(cfg.rooms))
    return [f"#define K {cfg.identities}", f"#define CAP {cap}", f"#define FORGOT {FORGOT}",
            f"#define OWN(x) ({own})", "#define CELLOWN(c) ((c) >= FORGOT -> (c) - FORGOT : OWN(c))",
            f"#define HELD(v) ({held})",
            "#define HELD_BACK(x) (HELD(OWN(x)) > 0 && HELD(OWN(x)) + room[x].sz > CAP)",
            # an identity with a room that began and has not concluded (liveness.starved)
            f"#define LEFT(v) ({left})"]


DECLARATIONS = "bit srv;  /* shares */\nhidden byte ra, rb; hidden byte rq[R];  /* shares */\n"

# the proctype's locals for the round (zeroed after each step)
LOCALS = "  byte sw, sfp, sfn, sfi, sfv, sfc, sfq, sfh; byte sford[K], sfst[K];  /* shares */\n"
RESET = ("sw = 0; sfp = 0; sfn = 0; sfi = 0; sfv = 0; sfc = 0; sfq = 0; sfh = 0; "
         "ra = 0; do :: ra < K -> sford[ra] = 0; sfst[ra] = 0; ra++ :: else -> break od; ra = 0")

TEXT = r"""
/* models/shares.py `order`: the identities with deferred sends, in the order they first appear */
inline fair_order() {
  sfn = 0; ra = 0;
  do
  :: ra < dlen ->
     rb = 0; do :: rb < sfn && sford[rb] != OWN(dq[ra]) -> rb++ :: else -> break od;
     if :: rb == sfn -> sford[sfn] = OWN(dq[ra]); sfn++ :: else -> skip fi;
     ra++
  :: else -> break
  od;
  ra = 0; rb = 0
}

inline dq_remove(p) {
  ra = p; do :: ra + 1 < dlen -> dq[ra] = dq[ra + 1]; ra++ :: else -> break od;
  dlen--; dq[dlen] = 0; ra = 0
}

/* models/shares.py `enqueue`: at the back of its identity's queue, or of the round */
inline enqueue(ex) {
  ra = 0; rb = NONE;
  do :: ra < dlen -> if :: OWN(dq[ra]) == OWN(ex) -> rb = ra :: else -> skip fi; ra++ :: else -> break od;
  if
  :: rb == NONE -> dq[dlen] = ex
  :: else -> ra = dlen; do :: ra > rb + 1 -> dq[ra] = dq[ra - 1]; ra-- :: else -> break od; dq[rb + 1] = ex
  fi;
  dlen++; ra = 0; rb = 0
}

/* models/shares.py `rotate`: identity v's sends go to the back of the round, in their order */
inline rotate(v) {
  ra = 0; rb = 0;
  do :: ra < dlen -> if :: OWN(dq[ra]) != v -> rq[rb] = dq[ra]; rb++ :: else -> skip fi; ra++ :: else -> break od;
  ra = 0;
  do :: ra < dlen -> if :: OWN(dq[ra]) == v -> rq[rb] = dq[ra]; rb++ :: else -> skip fi; ra++ :: else -> break od;
  ra = 0; do :: ra < dlen -> dq[ra] = rq[ra]; rq[ra] = 0; ra++ :: else -> break od;
  ra = 0; rb = 0
}

/* the position in dq of identity sfv's sfc-th send (NONE: it has no more) */
inline nth_of(pos) {
  pos = NONE; ra = 0; rb = 0;
  do
  :: ra < dlen ->
     if :: OWN(dq[ra]) == sfv -> if :: rb == sfc -> pos = ra; break :: else -> rb++ fi :: else -> skip fi;
     ra++
  :: else -> break
  od;
  ra = 0; rb = 0
}

/* shares.Shares.serve: one send per identity per turn, in the round's order, each identity's oldest not passed
   over; one held back by its identity's share is passed over, one that waits for bytes stops the round (sw) */
inline serve_fair() {
  sw = 0;
  if
  :: dlen > 0 ->
     sfp = 1;
     do
     :: sfp && dlen > 0 && !sw ->
        sfp = 0; fair_order(); sfi = 0;
        do
        :: sfi < sfn && !sw ->
           sfv = sford[sfi]; sfi++; sfc = sfst[sfv];
           do
           :: true ->
              nth_of(sfq);
              if
              :: sfq == NONE -> sfst[sfv] = sfc; break
              :: else ->
                 sfh = dq[sfq];
                 if
                 :: room[sfh].snd == 2 || !STAGEABLE(room[sfh].rs) -> room[sfh].ch = CH_DROPPED; dq_remove(sfq)
                 :: else ->
                    if
                    :: HELD_BACK(sfh) -> sfc++
                    :: else ->
                       sfst[sfv] = sfc;
                       if
                       :: !PLACEABLE(room[sfh].sz) -> sw = 1
                       :: else -> dq_remove(sfq); stage(sfh); rotate(sfv); sfp = 1
                       fi;
                       break
                    fi
                 fi
              fi
           od
        :: else -> break
        od
     :: else -> break
     od
  :: else -> skip
  fi;
  sfp = 0; sfn = 0; sfi = 0; sfv = 0; sfc = 0; sfq = 0; sfh = 0;
  ra = 0; do :: ra < K -> sford[ra] = 0; sfst[ra] = 0; ra++ :: else -> break od; ra = 0
}

/* shares.Shares.servable, into srv: the round's first move changes something (a send dropped or staged) */
inline calc_servable() {
  srv = 0; fair_order(); sfi = 0; sfc = 0;
  do
  :: sfi < sfn && !sfc ->
     sfv = sford[sfi]; sfi++; sfq = 0;
     do
     :: sfq < dlen ->
        if
        :: OWN(dq[sfq]) == sfv ->
           sfh = dq[sfq];
           if
           :: room[sfh].snd == 2 || !STAGEABLE(room[sfh].rs) -> srv = 1; sfc = 1; break
           :: else ->
              if :: HELD_BACK(sfh) -> skip
                 :: else -> srv = PLACEABLE(room[sfh].sz); sfc = 1; break
              fi
           fi
        :: else -> skip
        fi;
        sfq++
     :: else -> break
     od
  :: else -> break
  od;
  sfn = 0; sfi = 0; sfv = 0; sfc = 0; sfq = 0; sfh = 0;
  ra = 0; do :: ra < K -> sford[ra] = 0; ra++ :: else -> break od; ra = 0
}
"""


def text(cfg) -> str:
    return TEXT if cfg.identities > 1 else ""


def starved_arms(cfg, enabled: list[str], fair_by: dict, fair_all: list[str]) -> str:
    """liveness.starved, one arm per identity: a room of v left, events enabled, but none assumed fair that is
    v's own or the encode loop's. Reports without changing the state (as the liveness arm)."""
    out = []
    for v in range(cfg.identities):
        fair = fair_all + fair_by[v]  # every identity has a room (Config), and every room has fair guards
        out.append(f"  :: atomic {{ LIVE && LEFT({v}) && !(" + " || ".join(fair) + ") && ("
                   + " || ".join(enabled) + ") -> d_step { kind = K_IDENTITY_STARVED;\n"
                   "       if :: (ASSERTED >> kind) & 1 -> report() :: else -> skip fi; kind = 0 } }\n")
    return "".join(out)
