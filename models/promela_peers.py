"""The peers in Promela: the peer machine, its couplings and its events, as models/events.py has them.

With `Config(peers=True)` each receiver rank k has one peer (`peer[k]`), as in the
spec: first contact starts when a frame names it (a frame to a `down` peer fails its
room during the backoff, or contacts it again after), its outcome is an event of
its own (connected, refused, or the connect deadline), a room's write deadline
before any of its writes reported makes every peer `suspect` (re-checked as first
contact is), and an `up` peer with a live room may have its heartbeat probe
refused or unanswered (`down`). Writes go out only while every peer is `up`
(`ALL_UP`), and entering `up` or `down` runs fsm/couplings.py's actions
(`resume_rooms`, `fail_rooms`). The peer moves are emitted from `PEER.table`.
Without peers every guard here is false (`PEERS` is 0) and the array keeps its
initial value, so the encode side's state space is unchanged.
"""

from __future__ import annotations

from epd_ring.fsm import PEER

from .state import _PEER_RANK

PEER_STATES = tuple(sorted(PEER.states))  # coded 0.. in name order
# Promela for the peer's guards; the spec never moves a peer that is backing off nor counts failed writes.
PEER_GUARDS = {"backing_off": "(pboff)", "at_threshold": "0"}
EVENTS = ("frame_after_backoff", "connected", "refused", "connect_expired", "write_deadline", "probe_refused",
          "probe_expired")


def ps(name: str) -> str:
    return f"P_{name}"


def constants(cfg) -> list[str]:
    return ([f"#define PEERS {int(cfg.peers)}"] + [f"#define {ps(s)} {n}" for n, s in enumerate(PEER_STATES)])


def macros(cfg) -> list[str]:
    N, R = cfg.receivers, cfg.rooms
    rank = (" : ".join(f"((p) == {ps(s)} -> {_PEER_RANK[s]}" for s in PEER_STATES) + " : 0"
            + ")" * len(PEER_STATES))
    return [
        "#define ALL_UP (" + " && ".join(f"peer[{k}] == P_up" for k in range(N)) + ")",
        # a live room has a receiver on peer k (its rank-k receiver): the peer is probed
        "#define BUSY(k) (" + " || ".join(f"(room[{i}].reg > (k) && !CONCLUDED(room[{i}].rs))" for i in range(R)) + ")",
        f"#define PEERRANK(p) ({rank})",
    ]


def rank_terms(cfg) -> list[str]:
    return [f"PEERRANK(peer[{k}])" for k in range(cfg.receivers)] if cfg.peers else []


DECLARATIONS = "byte peer[N] = P_unknown;\nhidden byte pt, pk, pq;\n"


def machine_inlines(chain) -> str:
    """One inline per peer event from the compiled table (`chain` is promela._chain)."""
    t: dict[str, list] = {}
    for (src, ev), options in PEER.table.items():
        t.setdefault(ev, []).append((src, options))
    out = []
    for ev, rows in t.items():
        arms = "\n".join(f"  :: pcur == {ps(src)} -> "
                         + chain(opts, PEER_GUARDS, lambda d: f"pout = {ps(d)}", {}, f"peer {src} {ev}")
                         for src, opts in rows)
        out.append(f"inline peer_{ev}(pcur, pboff, pout) {{\n  if\n{arms}\n"
                   f'  :: else -> printf("MODELBUG peer {ev}\\n"); assert(false)\n  fi\n}}')
    return "\n\n".join(out)


def events() -> list[str]:
    return sorted({ev for _, ev in PEER.table})


def move(event: str, on_event: str) -> str:
    return (f"inline move_peer_{event}(px, pboff) {{\n"
            f"  peer_{event}(peer[px], pboff, pt);\n"
            f"  if :: pt == peer[px] -> pt = 0 :: else -> peer[px] = pt; pt = 0; enter_peer(px, C_{event}) fi"
            f"{on_event}\n}}")


# rules._resume_rooms and rules._fail_rooms, as the bodies of `inline <action>(ax, cause)` (ax: the peer)
ACTIONS = {
    "resume_rooms": """pq = 0;
  do
  :: pq < R -> if :: room[pq].rs == R_transferring && room[pq].ch == CH_HELD -> issue_writes(pq) :: else -> skip fi;
               pq++
  :: else -> break
  od;
  pq = 0""",
    "fail_rooms": """pk = 0;
  do
  :: pk < R -> if :: room[pk].reg > ax && !CONCLUDED(room[pk].rs) -> move_room_fail(pk) :: else -> skip fi; pk++
  :: else -> break
  od;
  pk = 0""",
}


# -- room families (models/events_peers.py: frame, write_deadlines) ------------------------------------
def frame_arms(r: str, i: str) -> list[tuple[str, str, str, bool]]:
    """A frame to a down peer fails its room (during the backoff) or contacts it again (after)."""
    down = f"PEERS && {r}.reg < N && !CONCLUDED({r}.rs) && peer[{r}.reg] == P_down"
    return [("frame", f"{r}.reg < N && !({down})", f"ev_frame({i})", False),
            ("frame", down, f"offer({i}); move_room_fail({i})", False),
            ("frame_after_backoff", down, f"ev_frame({i})", False)]


def write_deadline(r: str, i: str, j: str, cfg) -> list[tuple[str, str, str, bool]]:
    return [("write_deadline",
             f"PEERS && !NO_WRITE_DEADLINE && faults > 0 && {r}.rs == R_transferring && {r}.infl == N",
             f"ev_write_deadline({i})", False)]


TEXT = r"""
/* a live room's frame first contacts its receiver's peer (a down one's backoff has passed) */
inline contact_peer(x) {
  if :: PEERS && !CONCLUDED(room[x].rs) -> move_peer_contact(room[x].reg, 0) :: else -> skip fi
}

/* the room's writes are due together: each one's peer turns suspect, the room fails, the writes fly on */
inline ev_write_deadline(x) {
  faults--;
  cell[room[x].sl].unsure = 1; spread(room[x].sl);
  pq = 0; do :: pq < N -> move_peer_write_overdue(pq, 0); pq++ :: else -> break od; pq = 0;
  move_room_fail(x)
}

/* spec.invariant: a down peer's rooms are all concluded */
inline peer_invariant() {
  if
  :: PEERS && kind == 0 ->
     pk = 0;
     do
     :: pk < N && kind == 0 ->
        if
        :: peer[pk] == P_down ->
           pq = 0;
           do
           :: pq < R -> if :: room[pq].reg > pk && !CONCLUDED(room[pq].rs) -> kind = K_ROOM_OF_DOWN_PEER_LIVE
                           :: else -> skip fi; pq++
           :: else -> break
           od;
           pq = 0
        :: else -> skip
        fi;
        pk++
     :: else -> break
     od;
     pk = 0
  :: else -> skip
  fi
}

inline show_peers() {
  if
  :: PEERS -> printf("PE"); pk = 0; do :: pk < N -> printf(" %d", peer[pk]); pk++ :: else -> break od; pk = 0;
     printf("\n")
  :: else -> skip
  fi
}
"""


# -- the encoder's families (models/events_peers.py: connect_outcomes, probe_outcomes) --------------------
def global_arms(cfg, code) -> list[tuple[list[str], str]]:
    """(guards, the proctype's arm) of the peers' events; `code(name)` is the event's number."""
    if not cfg.peers:
        return []
    out = []
    ks = range(cfg.receivers)

    def family(name: str, cond: str, act: str) -> None:
        guards = [f"LIVE && {cond.format(k=k)}" for k in ks]
        pick = " ".join(f":: {g} -> x = {k}" for k, g in zip(ks, guards))
        out.append((guards, f"    :: if {pick} fi; ev = {code(name)}; d_step {{ pre(); {act} }}"))

    contacting = "(peer[{k}] == P_connecting || peer[{k}] == P_suspect)"
    family("connected", contacting, "move_peer_connected(x, 0)")
    family("refused", "faults > 0 && " + contacting, "faults--; move_peer_refused(x, 0)")
    family("connect_expired", "faults > 0 && " + contacting, "faults--; move_peer_connect_expired(x, 0)")
    probed = "faults > 0 && peer[{k}] == P_up && BUSY({k})"
    family("probe_refused", probed, "faults--; move_peer_probe(x, 0); move_peer_refused(x, 0)")
    family("probe_expired", probed, "faults--; move_peer_probe(x, 0); move_peer_connect_expired(x, 0)")
    return out


def parse(fields: list[int]) -> tuple:
    return tuple(PEER_STATES[v] for v in fields)
