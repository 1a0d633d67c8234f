"""The Promela around the rules: what runs after every step, and how a state is printed.

`post()` checks the step (its own violation, failure sticky, status forward, the
rank, then the invariants, in `spec.Spec`'s order) and relabels rooms into
`explore.canonical`'s order (`canon()`; cells keep their places), so SPIN stores
exactly the explorer's canonical states; `show_state()` prints a state for
`promela.parse_trail`.
"""

SEARCH = r"""
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
    /* each room's receivers in order (events.Events._emit sorts them) */
    if :: REGIONS -> sort_receivers() :: else -> skip fi;
    /* a cell no room's extent covers forgets whose bytes it held, and an item's size is kept only while it
       waits or holds an extent (events.Events._emit) */
    q = 0;
    do
    :: q < C ->
       k = 0; n = 0;
       do
       :: k < R -> if :: room[k].sl != NONE && COVERS(k, q) -> n = 1
                      :: else -> skip fi; k++
       :: else -> break
       od;
       if :: n == 0 -> cell[q].content = NONE :: else -> skip fi; q++  /* one identity */
       /* with identities a busy cell stays charged to its identity (models/shares.py) */  /* shares */
       if :: n == 0 && cell[q].ss == S_free -> cell[q].content = NONE  /* shares */
          :: n == 0 && cell[q].ss != S_free && cell[q].content < R ->  /* shares */
             cell[q].content = FORGOT + OWN(cell[q].content)  /* shares */
          :: else -> skip fi; q++  /* shares */
    :: else -> break
    od;
    k = 0;
    do
    :: k < R -> if :: room[k].sl == NONE && room[k].ch != CH_DEFERRED -> room[k].sz = 0 :: else -> skip fi; k++
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
    peer_invariant();
    k = 0;
    do
    :: k < R && kind == 0 ->
       if
       :: room[k].sl != NONE && !OWNS(k) ->
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
          :: (room[k].rg[gj] == G_written && room[k].rs != R_success) ||
             (room[k].rg[gj] == G_failed && room[k].rs == R_success) ->
             kind = K_WRONG_OUTCOME
          :: else -> skip
          fi;
          /* the outcome it was told, kept after release: exactly one, the room's (spec.invariant) */
          if
          :: kind == 0 && room[k].rt[gj] == T_TWICE -> kind = K_TOLD_TWICE
          :: kind == 0 && room[k].rt[gj] != T_TWICE && room[k].rt[gj] != T_NONE &&
             room[k].rt[gj] != TOLD_OF(room[k].rs) -> kind = K_WRONG_OUTCOME
          :: kind == 0 && room[k].rt[gj] == T_NONE && CONCLUDED(room[k].rs) &&
             !OUTCOME_ON_WAY(k, gj) -> kind = K_RECEIVER_NOT_TOLD
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
    calc_servable();  /* shares */
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
  :: k < R ->
     printf("RX");  /* channels */
     printf("RM");  /* plain */
     printf(" %d %d %d %d %d %d %d %d %d %d", room[k].rs, room[k].snd, room[k].ch, room[k].reg,
                     room[k].told, room[k].ok, room[k].infl, room[k].ghost, room[k].sz, room[k].sl);
     gj = 0; do :: gj < N -> printf(" %d %d %d", room[k].rg[gj], room[k].rw[gj], room[k].rt[gj]);
                   printf(" %d %d %d", room[k].rc[gj], room[k].rd[gj], room[k].rr[gj]);  /* channels */
                   gj++
                :: else -> break od; gj = 0;
     printf("\n"); k++
  :: else -> break
  od;
  k = 0;
  do :: k < C -> printf("SL %d %d %d %d\n", cell[k].ss, cell[k].content, cell[k].unsure, cell[k].span); k++
     :: else -> break od;
  k = 0;
  show_peers()
}

/* sort each room's registered receivers by (region, write, told[, channel, withdraw, release]): insertion sort */
inline sort_receivers() {
  k = 0;
  do
  :: k < R ->
     gj = 1;
     do
     :: gj < room[k].reg ->
        gq = gj;
        do
        :: gq > 0 && RCVCODE(k, gq - 1) > RCVCODE(k, gq) ->
           gt = room[k].rg[gq]; room[k].rg[gq] = room[k].rg[gq - 1]; room[k].rg[gq - 1] = gt;
           gt = room[k].rw[gq]; room[k].rw[gq] = room[k].rw[gq - 1]; room[k].rw[gq - 1] = gt;
           gt = room[k].rt[gq]; room[k].rt[gq] = room[k].rt[gq - 1]; room[k].rt[gq - 1] = gt;
           gt = room[k].rc[gq]; room[k].rc[gq] = room[k].rc[gq - 1]; room[k].rc[gq - 1] = gt;  /* channels */
           gt = room[k].rd[gq]; room[k].rd[gq] = room[k].rd[gq - 1]; room[k].rd[gq - 1] = gt;  /* channels */
           gt = room[k].rr[gq]; room[k].rr[gq] = room[k].rr[gq - 1]; room[k].rr[gq - 1] = gt;  /* channels */
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

/* relabel rooms into explore.canonical's order; cells keep their places */
inline canon() {
  k = 0;
  do
  :: k < R ->
     n = NONE;
     q = 0; do :: q < dlen -> if :: dq[q] == k -> n = q :: else -> skip fi; q++ :: else -> break od;
     if
     :: room[k].sl != NONE -> SETKEYS(k, room[k].sl + 1, OWNS(k), (n == NONE -> 0 : n + 1))
     :: else -> SETKEYS(k, 0, 0, (n == NONE -> 0 : n + 1))
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
  /* permute */
  k = 0;
  do
  :: k < R ->
     t_rs[k] = room[k].rs; t_snd[k] = room[k].snd; t_ch[k] = room[k].ch; t_reg[k] = room[k].reg;
     t_told[k] = room[k].told; t_ok[k] = room[k].ok; t_infl[k] = room[k].infl; t_ghost[k] = room[k].ghost;
     t_sz[k] = room[k].sz; t_sl[k] = room[k].sl;
     gj = 0; do :: gj < N -> t_rg[k * N + gj] = room[k].rg[gj]; t_rw[k * N + gj] = room[k].rw[gj];
                   t_rt[k * N + gj] = room[k].rt[gj];
                   t_rc[k * N + gj] = room[k].rc[gj]; t_rd[k * N + gj] = room[k].rd[gj];  /* channels */
                   t_rr[k * N + gj] = room[k].rr[gj];  /* channels */
                   gj++
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
     room[tmp].sz = t_sz[k]; room[tmp].sl = t_sl[k];
     gj = 0; do :: gj < N -> room[tmp].rg[gj] = t_rg[k * N + gj]; room[tmp].rw[gj] = t_rw[k * N + gj];
                   room[tmp].rt[gj] = t_rt[k * N + gj];
                   room[tmp].rc[gj] = t_rc[k * N + gj]; room[tmp].rd[gj] = t_rd[k * N + gj];  /* channels */
                   room[tmp].rr[gj] = t_rr[k * N + gj];  /* channels */
                   gj++
                :: else -> break od; gj = 0;
     k++
  :: else -> break
  od;
  k = 0;
  do
  :: k < C -> if :: cell[k].content < R -> cell[k].content = rmap[cell[k].content] :: else -> skip fi; k++
  :: else -> break
  od;
  k = 0; do :: k < dlen -> dq[k] = rmap[dq[k]]; k++ :: else -> break od;
  k = 0; n = 0; q = 0; tmp = 0
}
"""
