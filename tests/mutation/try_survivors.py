"""Put survivors listed in tests/mutation/survivors.md back into today's source, one at a time, and run
chosen tests against each (no mutmut run needed).

    python tests/mutation/try_survivors.py MODULE_PREFIX [--only FUNC] [--skip REGEX] [--limit S] -- PYTEST_ARGS...
    python tests/mutation/try_survivors.py MODULE_PREFIX --dry --show -- x   # where each lands today

`--only`: functions whose name holds FUNC; `--skip`: survivors whose line matches REGEX (e.g. the pass's
`do_not_mutate_patterns`); `--limit`: seconds a run may take (a hang counts as a kill, as in mutmut).
`--dry --show` writes nothing: it prints each survivor's line and its mutant as they read today, whole,
the key an equivalent claim takes (tests/mutation/equivalent.md). `MOVED` names lines reworded since the
pass; the same change is made on today's form. One run at a time per tree (a lock).

For each survivor whose function starts with MODULE_PREFIX (e.g. `epd_ring.models.explore`), the
function is found in today's file (by its name, a method by its class too) and the survivor's line
(`before`, cut at 100 characters in survivors.md, so matched as a prefix, the cut tail rebuilt from the
source) is replaced inside it by `after`. The file is written, the tests are run in a child forked from
one warm process (torch and pytest loaded once; no stale bytecode is read: `sys.pycache_prefix` points
to an empty folder), and the file is restored. Prints one line per mutant: killed, survived, no line
(the line is gone from that function today) or timeout; restores the source in every case.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
FOLDERS = {"epd_ring.models": "models", "epd_ring.fsm": "fsm", "epd_ring.executor": "executor"}


# survivors whose line has changed since the pass: the line as it reads today (the same change is made there)
MOVED = {
    "keys.append((r[:EXTENTI], s + 1, own, dpos.get(i, -1), i))":
        "keys.append((r[EXTENTI + 1:], r[:EXTENTI], s + 1, own, dpos.get(i, -1), i))",
    "keys.append((r[:EXTENTI], 0, False, dpos.get(i, -1), i))":
        "keys.append((r[EXTENTI + 1:], r[:EXTENTI], 0, False, dpos.get(i, -1), i))",
    "return state if deferred.__class__ is tuple else (rooms, cells, tuple(deferred), faults, halt, peers":
        "return state if deferred.__class__ is tuple else (rooms, cells, tuple(deferred), *state[3:])",
    "return _FACT[len(state[0])] // stab": "return _FACT[len(rooms)] // stab",
    'if k < h.frames_sent[i] and h.region(i, h.session(i, k)) == "written":':
        'if k < h.frames_sent[i] and h.reads.region(i, h.session(i, k)) == "written":',
    "peer_ring_share=1.0, parked_ring_share=1.0)": "peer_ring_share=1.0, parked_ring_share=1.0, **share)",
    "new = Harness(self.cfg, self.tokens, self.size, plan=[*self.plan[:j], event], arms=self.arms_made)":
        "new = Harness(self.cfg, self.tokens, self.size, plan=[*plan[:j], event], arms=self.arms_made)",
    "now = (self._fire_time(ev) if ev is not None else None) or self.clock.now()":
        "now = (self.fire_time(ev) if ev is not None else None) or self.clock.now()",
    'm.peers.get(f"p.{self.frames_sent[i]}").retry_at = self.clock.now()  # the backoff passed':
        'm.peers.get(f"p.{self.frames_sent[i]}").retry_at = self.clock.now()',
    'ex.register(self.rid(i), "prefill-bootstrap", 8998, self.room(i))':
        'ex.register(self.rid(i), "prefill-bootstrap", 8998, self.room(i),',
    'return ("write", obj.room - self.ROOM_BASE)': 'return ("write", obj.room - self.room_base)',
    "foreseen = j < self.foreseen and self.plan[j] == event":
        "foreseen = j < self.foreseen and self.timing.plan[j] == event",
    'if fires(event) and not foreseen and (event[0] == "probe_expired" or self._fire_time(event) is None)':
        'if fires(event) and not foreseen and (event[0] == "probe_expired" or self.timing.fire_time(event) is None):',
}


# a change the text alone cannot carry over: (before, after) -> today's line after the change
MANUAL = {("peer_ring_share=1.0, parked_ring_share=1.0)", "peer_ring_share=1.0, )"): "peer_ring_share=1.0, **share)"}


def survivors(prefix: str):
    func = None
    for line in (ROOT / "tests/mutation/survivors.md").read_text().splitlines():
        if line.startswith("## "):
            func = line[3:].rsplit(" (", 1)[0]
            continue
        m = re.match(r"- (\w[\w ]*): `(.*)` -> `(.*)`$", line)
        if m and func and func.startswith(prefix):
            yield func, m.group(2), m.group(3)


def locate(func: str) -> tuple[Path, str | None, str]:
    module, _, name = func.rpartition(".")
    for pkg, folder in FOLDERS.items():
        if module.startswith(pkg):
            path = ROOT / folder / (module[len(pkg) + 1:].replace(".", "/") + ".py")
            break
    if "ǁ" in name:
        _, cls, meth = name.split("ǁ")[:3]
        return path, cls, meth
    return path, None, name[2:]  # x_name


def func_lines(source: str, cls: str | None, name: str) -> tuple[int, int] | None:
    tree = ast.parse(source)
    body = tree.body
    if cls is not None:
        c = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if c is None:
            return None
        body = c.body
    f = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None)
    if f is None:
        return None
    first = min([f.lineno] + [d.lineno for d in f.decorator_list])
    return first - 1, f.end_lineno


def mutate_line(full: str, before: str, after: str) -> str | None:
    """`full` is today's line (stripped); `before`/`after` the survivor's, each maybe cut at 100 characters."""
    if len(before) < 100:
        return after if full == before else None
    if not full.startswith(before):
        return None
    if len(after) < 100:
        return after  # the mutant's line is whole (it shortened the line below the cut)
    p = 0
    while p < min(len(before), len(after)) and before[p] == after[p]:
        p += 1
    best = None
    for old in range(0, 60):
        for new in range(0, 60):
            cand = after[:p + new] + full[p + old:]
            if cand.startswith(after) and cand != full and (best is None or old + new < best[0]):
                best = (old + new, cand)
    return best[1] if best else None


def segment(before: str, after: str) -> tuple[int, int, str]:
    """The change as (where, how many characters of `before` it replaces, with what): the smallest
    edit that explains `after` (both may be cut at 100 characters)."""
    p = 0
    while p < min(len(before), len(after)) and before[p] == after[p]:
        p += 1
    best = None
    for old in range(0, len(before) - p + 1):
        for new in range(0, len(after) - p + 1):
            a, b = before[p + old:], after[p + new:]
            n = min(len(a), len(b))
            whole = len(before) < 100 and len(after) < 100
            if ((a == b) if whole else (a[:n] == b[:n])) and (best is None or old + new < best[0]):
                best = (old + new, old, after[p:p + new])
    assert best is not None
    return p, best[1], best[2]


def transplant(line: str, before: str, after: str) -> str | None:
    """The survivor's change made on `line`, today's form of its line: the changed text found there with
    as much of its context either side as today's line still has."""
    p, old, new = segment(before, after)
    core = before[p:p + old]
    if p + old == len(before) and line.startswith(before[:p]):  # the rest of the line replaced
        return line[:p] + new
    for left in range(min(p, 40), -1, -1):
        for right in range(min(len(before) - p - old, 40), -1, -1):
            pat = before[p - left:p] + core + before[p + old:p + old + right]
            if (left or right or core) and line.count(pat) == 1:
                return line.replace(pat, before[p - left:p] + new + before[p + old:p + old + right])
    return None


def apply(path: Path, cls, name, before, after, nth: int = 0) -> str | None:
    src = path.read_text()
    span = func_lines(src, cls, name)
    if span is None:
        return None
    lines = src.split("\n")
    hits = []
    today = MOVED.get(before)
    for n in range(span[0], span[1]):
        full = lines[n]
        indent = full[:len(full) - len(full.lstrip())]
        if today is not None:
            new = transplant(full.strip(), before, after) if full.strip() == today else None
            new = MANUAL.get((before, after), new) if new is not None else None
        else:
            new = mutate_line(full.strip(), before, after)
        if new is not None:
            hits.append((n, indent + new))
    if not hits:
        return None
    if nth >= len(hits):
        return None
    n, new = hits[nth]  # a survivor listed twice: the same change on the line's second occurrence
    lines[n] = new
    return "\n".join(lines)


def run_child(args: list[str], limit: float) -> str:
    pid = os.fork()
    if pid == 0:
        try:
            import pytest

            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            rc = pytest.main(["-p", "no:cacheprovider", "-q", "-x", *args])
        except BaseException:
            rc = 3
        os._exit(int(rc))
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            return "survived" if rc == 0 else "killed" if rc == 1 else f"error({rc})"
        if time.monotonic() - t0 > limit:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.02)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    opts, tests = argv[:split], argv[split + 1:]
    prefix = opts[0]
    only = opts[opts.index("--only") + 1] if "--only" in opts else ""
    dry = "--dry" in opts
    skip = opts[opts.index("--skip") + 1] if "--skip" in opts else ""  # e.g. lines the pass leaves alone
    limit = float(opts[opts.index("--limit") + 1]) if "--limit" in opts else 120.0
    os.chdir(ROOT)
    import fcntl

    # one lock per tree (a worktree's .git is a file): two runs at once would each restore the other's mutant
    lock = open(Path(tempfile.gettempdir()) / ("try_survivors" + str(ROOT).replace("/", "_")), "w")  # noqa: SIM115
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("another run is mutating this tree")
        return 2
    os.environ.setdefault("EPD_RING_HYPOTHESIS", "mutants")
    import pytest  # noqa: F401 - loaded once for every child
    import torch  # noqa: F401
    import transitions  # noqa: F401

    sys.dont_write_bytecode = True
    sys.pycache_prefix = tempfile.mkdtemp(prefix="try-survivors-")  # never read a stale .pyc
    if not dry and run_child(tests, limit) != "survived":
        print("the tests fail with no mutant active")
        return 2
    counts: dict[str, int] = {}
    seen: dict[tuple, int] = {}
    for func, before, after in survivors(prefix):
        nth = seen.get((func, before, after), 0)
        seen[(func, before, after)] = nth + 1
        if (only and only not in func) or (skip and re.search(skip, before)):
            continue
        path, cls, name = locate(func)
        original = path.read_text()
        mutated = apply(path, cls, name, before, after, nth)
        if mutated is None:
            verdict = "no line"
        elif dry:
            verdict = "found"
            if "--show" in opts:  # today's whole line, before and after: the key of an equivalent claim
                a, b = next((a, b) for a, b in zip(original.split("\n"), mutated.split("\n")) if a != b)
                print(f"    `{func}` | `{a.strip()}` | `{b.strip()}`")
        else:
            try:
                path.write_text(mutated)
                verdict = run_child(tests, limit)
            finally:
                path.write_text(original)
        counts[verdict] = counts.get(verdict, 0) + 1
        print(f"{verdict:8} {func} | {before} | {after}", flush=True)
    print(counts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
