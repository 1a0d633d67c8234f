"""`epd-ring demo --timeline FILE`: slot occupancy over time, as an SVG a reviewer can open.

One row per slot, time to the right. Each stretch of a slot in one state (and
for one room) is a bar coloured by the state. Rooms that failed are marked with
a red cross where they concluded, on the slot that last held them (or on a
lane of their own when they never reached a slot); each quarantine starts with
a purple tick. The SVG is written by hand: no plotting library needed.
"""

from __future__ import annotations

from html import escape
from typing import Any

from epd_ring.fsm import EXTENT

COLOURS = {
    "free": "#f2f2f2", "copying": "#9ecae1", "staged": "#6baed6", "parked": "#fdae6b",
    "sending": "#31a354", "quarantined": "#9e67c9", "retired": "#bdbdbd",
}


class TimelineRecorder:
    """Samples every slot's state at the loop's chosen moments; records failures as they conclude.

    `pump` is the `Pump` that drives the executor: concluded rooms are learnt from its
    `on_conclude` hooks, as any driver learns them."""

    def __init__(self, pump: Any, clock: Any):
        self.executor = executor = pump.executor
        self.clock = clock
        n = executor.ring.n_slots
        # per slot: list of [start, end, state, room]
        self.bars: list[list[list]] = [[] for _ in range(n)]
        self.failures: list[tuple[float, int | None, int]] = []  # (time, slot or None, room)
        self.quarantines: list[tuple[float, int]] = []
        self._last_slot_of: dict[int, int] = {}
        self.t0 = clock.now()
        pump.on_conclude.append(self._concluded)

    def _concluded(self, room: int, state: str) -> None:
        if state == "failed":
            slot = self._last_slot_of.get(room)
            for s in self.executor.ring.slots:  # the slot that holds it right now, if any
                if s.room == room:
                    slot = s.index
            self.failures.append((self.clock.now(), slot, room))
        self._last_slot_of.pop(room, None)

    def sample(self) -> None:
        now = self.clock.now()
        for s in self.executor.ring.slots:
            bars = self.bars[s.index]
            if s.room is not None:
                self._last_slot_of[s.room] = s.index
            if bars and bars[-1][2] == s.state and bars[-1][3] == s.room:
                bars[-1][1] = now
                continue
            if bars:
                bars[-1][1] = now
            if s.state == "quarantined":
                self.quarantines.append((now, s.index))
            bars.append([now, now, s.state, s.room])

    def svg(self, title: str = "") -> str:
        t_end = max([b[-1][1] for b in self.bars if b] + [self.t0 + 1e-9])
        span = max(t_end - self.t0, 1e-9)
        n = len(self.bars)
        left, top, row, width = 70, 40, 22, 1100
        lost_lane = any(slot is None for _, slot, _ in self.failures)
        height = top + row * (n + (1 if lost_lane else 0)) + 70

        def x(t: float) -> float:
            return left + (t - self.t0) / span * width

        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
               f'font-family="sans-serif" font-size="11">',
               f'<text x="{left}" y="18" font-size="13">{escape(title)}</text>']
        for i, bars in enumerate(self.bars):
            y = top + i * row
            out.append(f'<text x="{left - 8}" y="{y + row * 0.65:.1f}" text-anchor="end">slot {i}</text>')
            for start, end, state, room in bars:
                w = max(x(end) - x(start), 0.6)
                tip = f"slot {i}: {state}" + (f", room {room}" if room is not None else "") + \
                      f", {start - self.t0:.3f}-{end - self.t0:.3f} s"
                out.append(f'<rect x="{x(start):.2f}" y="{y + 2}" width="{w:.2f}" height="{row - 4}" '
                           f'fill="{COLOURS.get(state, "#000")}"><title>{escape(tip)}</title></rect>')
        if lost_lane:
            out.append(f'<text x="{left - 8}" y="{top + n * row + row * 0.65:.1f}" text-anchor="end">no slot</text>')
        for t, slot in self.quarantines:
            y = top + slot * row
            out.append(f'<line x1="{x(t):.2f}" y1="{y}" x2="{x(t):.2f}" y2="{y + row}" stroke="#5b2a86" '
                       f'stroke-width="1.5"/>')
        for t, slot, room in self.failures:
            cy = top + (n if slot is None else slot) * row + row / 2
            cx = x(t)
            out.append(f'<path d="M{cx - 3:.2f},{cy - 3:.2f} L{cx + 3:.2f},{cy + 3:.2f} M{cx - 3:.2f},{cy + 3:.2f} '
                       f'L{cx + 3:.2f},{cy - 3:.2f}" stroke="#d62728" stroke-width="1.5" class="failure">'
                       f'<title>room {room} failed at {t - self.t0:.3f} s</title></path>')
        axis_y = top + row * (n + (1 if lost_lane else 0)) + 14
        for k in range(11):
            t = self.t0 + span * k / 10
            out.append(f'<text x="{x(t):.1f}" y="{axis_y}" text-anchor="middle">{t - self.t0:.2f} s</text>')
        lx = left
        legend_y = axis_y + 22
        for state in EXTENT.states:
            out.append(f'<rect x="{lx}" y="{legend_y - 10}" width="12" height="12" fill="{COLOURS[state]}" '
                       f'stroke="#999"/><text x="{lx + 16}" y="{legend_y}">{state}</text>')
            lx += 100
        out.append(f'<path d="M{lx},{legend_y - 9} l8,8 M{lx},{legend_y - 1} l8,-8" stroke="#d62728" '
                   f'stroke-width="1.5"/><text x="{lx + 14}" y="{legend_y}">room failed '
                   f'({len(self.failures)})</text>')
        lx += 130
        out.append(f'<line x1="{lx + 4}" y1="{legend_y - 10}" x2="{lx + 4}" y2="{legend_y + 2}" stroke="#5b2a86" '
                   f'stroke-width="1.5"/><text x="{lx + 12}" y="{legend_y}">quarantine starts '
                   f'({len(self.quarantines)})</text>')
        out.append("</svg>")
        return "\n".join(out) + "\n"

    def write(self, path: str, title: str = "") -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.svg(title))
