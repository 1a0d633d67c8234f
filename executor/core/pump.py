"""The pump: runs a sans-I/O core against a `Transport`.

The core decides and returns effects (effects.py); the pump does them and
feeds back what comes of them. One tick of an encode loop is `tick()`: frames
from the sources (a control plane), write outcomes and contact answers from
the transport, then the core's own tick (deadlines, copies, deferred sends),
then every effect those decided. After any other call into the core (`execute`,
`register_receiver`, ...) a driver calls `flush()` so that what it decided goes
out at once.

A transport whose contact answers at once (`connect` returns True or False) is
answered within the same flush, so a room written to an in-process receiver
is written before `flush()` returns. The pump maps the transport's write
handles to the core's write ids; the core never sees a handle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .effects import Concluded, Contact, Notify, Release, Submit
from .transport import Outcome, Transport

if TYPE_CHECKING:
    from .drain import DrainReport
    from .executor import EncodeExecutor
    from .manager import EncodeManager

log = logging.getLogger("epd_ring.pump")

# Counted once a notice is handed to the transport (`notify_errors` when that raised).
_TOLD = {"success": "told_success", "failed": "told_failed"}


class Pump:
    def __init__(self, core: EncodeExecutor | EncodeManager, transport: Transport | None = None):
        from .executor import EncodeExecutor

        self.executor = core if isinstance(core, EncodeExecutor) else None
        self.manager = core.manager if isinstance(core, EncodeExecutor) else core
        self.transport: Transport = transport if transport is not None else self.manager.transport
        self.stats = self.manager.stats
        # Inputs read at the start of every tick (a control plane's `poll`): each returns how many.
        self.sources: list[Callable[[], int]] = []
        # Told of every `Concluded` effect (an engine's own bookkeeping, a demo's tally).
        self.on_conclude: list[Callable[[int, str], None]] = []
        self._handles: dict[int, int] = {}  # transport handle -> the core's write id
        self._refused: list[tuple[int, Outcome]] = []  # writes the transport raised on: failed next tick
        # Asked every tick only of a transport that can name overdue writes (NIXL): the others
        # inherit the seam's empty answer, and a call a tick is a call an item on a busy loop.
        own = getattr(type(self.transport), "overdue", Transport.overdue)
        self._overdue = None if own is Transport.overdue else self.transport.overdue

    def write_of(self, handle: int) -> int | None:
        """The core's write id for a transport handle still in flight (None if none)."""
        return self._handles.get(handle)

    def handles(self) -> dict[int, int]:
        """Transport handle -> the core's write id, for every write submitted and not yet reported."""
        return dict(self._handles)

    # doing the effects ---------------------------------------------------------
    def flush(self) -> int:
        """Do every effect the core has decided, and those that doing them decides; return how many."""
        n = 0
        t = self.transport
        # Emptied in place: what `take_effects` does, without its two calls per flush.
        outbox = self.manager.outbox
        while outbox:
            effects: list[Any] = outbox[:]  # narrowed by `kind` below, which mypy cannot follow
            outbox.clear()
            # Every item's room writes, tells its receivers and concludes: those three are done here
            # without a call each; the rest (contacts, the ring's release) in `_do`.
            for e in effects:
                kind = type(e)
                if kind is Submit:
                    try:
                        self._handles[t.submit_write(e.session, e.bufs)] = e.write
                    except Exception as exc:  # a transport must not raise here; if it does, fail this write only
                        log.error("transport refused a write to %s: %s", e.session, exc)
                        self._refused.append((e.write, Outcome.FAILED))
                elif kind is Notify:
                    try:
                        t.notify(e.receiver, e.room, e.status, e.reason)
                        self.stats[_TOLD.get(e.status) or "told_" + e.status] += 1
                    except Exception as exc:  # one unreachable receiver must not stop the others
                        self.stats["notify_errors"] += 1
                        log.warning("could not tell %s that room %s %s: %s", getattr(e.receiver, "session", "?"),
                                    e.room, e.status, exc)
                elif kind is Concluded:
                    for hook in self.on_conclude:
                        hook(e.room, e.state)
                else:
                    self._do(e)
            n += len(effects)
        return n

    def _do(self, e: Any) -> None:
        t = self.transport
        if type(e) is Contact:
            try:
                # An identity and the probe flag go to the edge only when there are some (transports
                # written before them take two arguments).
                if e.probe:
                    answer = t.connect(e.session, e.attempt, e.identity, probe=True)
                elif e.identity:
                    answer = t.connect(e.session, e.attempt, e.identity)
                else:
                    answer = t.connect(e.session, e.attempt)
                detail = "refused"
            except Exception as exc:  # a transport must not raise here; treat it as a refusal
                answer, detail = False, f"{type(exc).__name__}: {exc}"
            if answer is not None:
                self.manager.contacts_reported([(e.session, e.attempt, bool(answer), detail)])
        elif type(e) is Release:
            t.unregister_memory(e.owner)
            if e.close_transport:
                t.close()
        else:
            raise TypeError(f"unknown effect {e!r}")

    # the loop's tick -----------------------------------------------------------
    def tick(self) -> int:
        """One turn of the encode loop; return how many events the core handled."""
        m = self.manager
        n = 0
        for source in self.sources:
            n += source()
            self.flush()
        if self.executor is not None and self.executor.staging.copies:  # `copies_pending`, without its calls
            # Copies finished since the last tick go out first: their writes may report in this one.
            n += self.executor.finish_copies()
            self.flush()
        done = []
        handles = self._handles
        for handle, outcome in self.transport.poll():
            write = handles.pop(handle, None)
            if write is None:
                self.stats["completions_unknown"] += 1  # not a write of ours
            else:
                done.append((write, outcome))
        overdue = self._overdue() if self._overdue is not None else None
        if overdue:  # a write this poll reported has left `handles`: it is not overdue
            n += m.writes_overdue([handles[h] for h in overdue if h in handles])
        if self._refused:
            done += self._refused
            self._refused = []
        if done:  # `writes_reported`, without its loop's call
            on_outcome = m.lifecycle.on_outcome
            for write, outcome in done:
                on_outcome(write, outcome)
            n += len(done)
        reports = self.transport.peer_reports()
        if reports:  # most ticks have none: no call into the core for them
            n += m.contacts_reported(reports)
        n += self.executor.poll() if self.executor is not None else m.poll()
        self.flush()
        return n

    def close(self, timeout: float, idle: Callable[[], Any], *, close_transport: bool = True) -> DrainReport:
        """Drain and let go of the ring, ticking until done or `timeout` seconds (by the clock) pass.

        Stops intake, fails every room not yet transferring (its receivers are
        told), lets in-flight writes finish (failing their rooms at the
        deadline), waits out every quarantine, then retires the extents,
        unregisters the ring and closes the transport. `idle()` runs between
        ticks: `lambda: time.sleep(0.001)` in a worker, a fake clock's advance
        in a test (the core never sleeps). Returns a report; if it is not
        `clean`, the ring stays registered and later ticks carry on.
        """
        ex = self.executor
        if ex is None:
            raise TypeError("close() drains an executor's ring; this pump runs a manager alone")
        ex.begin_close(timeout, close_transport=close_transport)
        self.flush()
        drain = ex.drain
        assert drain is not None
        while not drain.done:
            self.tick()
            if drain.done or self.manager.clock.now() >= drain.deadline:
                break
            idle()
        return drain.report()


__all__ = ["Pump"]
