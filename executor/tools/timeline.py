"""`epd-ring demo --timeline FILE`: arena occupancy over time, as an SVG a reviewer can open.

Time runs to the right, the main arena's bytes run down (offset 0 at the top).
Each extent is drawn where it lies in the arena, for as long as it is live, in
stretches coloured by its state; free bytes are the pale background. Rooms that
failed are marked with a red cross where they concluded, on the extent that
last held them (or on a lane of their own below the arena when they never
reached one); each quarantine starts with a purple tick across its extent.
The SVG is written by hand: no plotting library needed.
"""

from __future__ import annotations

from html import escape
from typing import Any

from epd_ring.fsm import EXTENT

COLOURS = {
    "free": "#f2f2f2", "copying": "#9ecae1", "staged": "#6baed6", "parked": "#fdae6b",
    "sending": "#31a354", "quarantined": "#9e67c9", "retired": "#bdbdbd",
}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class TimelineRecorder:
    """Samples every live extent's state at the loop's chosen moments; records failures as they conclude.

    `pump` is the `Pump` that drives the executor: concluded rooms are learnt from its
    `on_conclude` hooks, as any driver learns them."""

    def __init__(self, pump: Any, clock: Any):
        self.executor = pump.executor
        self.clock = clock
        self.capacity = self.executor.ring.main_arena.capacity
        # per extent index: ((offset, bytes) of each piece, [[start, end, state, room], ...])
        self.extents: dict[int, tuple[tuple[tuple[int, int], ...], list[list]]] = {}
        self._open: set[int] = set()  # extents live at the last sample
        self.failures: list[tuple[float, int | None, int]] = []  # (time, extent or None, room)
        self.quarantines: list[tuple[float, int]] = []
        self.retired_at: float | None = None
        self._last_extent_of: dict[int, int] = {}
        self.t0 = clock.now()
        self.t_last = self.t0
        pump.on_conclude.append(self._concluded)

    def _concluded(self, room: int, state: str) -> None:
        if state == "failed":
            ext = self._last_extent_of.get(room)
            for e in self.executor.ring.extents.values():  # the extent that holds it right now, if any
                if e.room == room:
                    ext = e.index
            self.failures.append((self.clock.now(), ext, room))
        self._last_extent_of.pop(room, None)

    def sample(self) -> None:
        now = self.t_last = self.clock.now()
        ring = self.executor.ring
        live = set()
        for e in list(ring.extents.values()):
            live.add(e.index)
            rec = self.extents.get(e.index)
            if rec is None:
                rec = self.extents[e.index] = (e.pieces or ((e.offset, e.nbytes),), [])
            bars = rec[1]
            if e.room is not None:
                self._last_extent_of[e.room] = e.index
            if bars and bars[-1][2] == e.state and bars[-1][3] == e.room:
                bars[-1][1] = now
                continue
            if bars:
                bars[-1][1] = now
            if e.state == "quarantined":
                self.quarantines.append((now, e.index))
            bars.append([now, now, e.state, e.room])
        for gone in self._open - live:  # freed since the last sample: its bytes went back at about now
            self.extents[gone][1][-1][1] = now
        self._open = live
        if ring.retired and self.retired_at is None:
            self.retired_at = now

    def svg(self, title: str = "") -> str:
        t_end = max(self.t_last, self.t0 + 1e-9)
        span = max(t_end - self.t0, 1e-9)
        left, top, height_px, width = 90, 40, 320, 1100
        row = 22
        lost_lane = any(ext is None for _, ext, _ in self.failures)
        cap = max(self.capacity, 1)

        def x(t: float) -> float:
            return left + (t - self.t0) / span * width

        def y(offset: float) -> float:
            return top + offset / cap * height_px

        def ext_y(index: int | None) -> tuple[float, float]:
            if index is None or index not in self.extents:
                return top + height_px + 4, row - 4
            off, n = self.extents[index][0][0]  # a spanning extent's marks go on its first piece
            return y(off), max(y(off + n) - y(off), 1.5)

        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" '
               f'height="{top + height_px + row + 90}" font-family="sans-serif" font-size="11">',
               f'<text x="{left}" y="18" font-size="13">{escape(title)}</text>',
               f'<rect x="{left}" y="{top}" width="{width}" height="{height_px}" fill="{COLOURS["free"]}">'
               f'<title>arena: {self.capacity} B, free where no extent is drawn</title></rect>']
        for k in range(5):
            off = self.capacity * k / 4
            out.append(f'<text x="{left - 8}" y="{y(off) + 4:.1f}" text-anchor="end">{_size(off)}</text>')
        out.append(f'<text x="{left - 8}" y="{top - 8}" text-anchor="end">arena offset</text>')
        for index, (pieces, bars) in self.extents.items():
            at = ",".join(f"@{off}+{n}" for off, n in pieces)
            for start, end, state, room in bars:
                w = max(x(end) - x(start), 0.6)
                tip = f"extent {index} {at}: {state}" + (f", room {room}" if room is not None else "") + \
                      f", {start - self.t0:.3f}-{end - self.t0:.3f} s"
                for off, n in pieces:  # a band per piece of a spanning extent
                    out.append(f'<rect x="{x(start):.2f}" y="{y(off):.2f}" width="{w:.2f}" '
                               f'height="{max(y(off + n) - y(off), 1.5):.2f}" fill="{COLOURS.get(state, "#000")}">'
                               f'<title>{escape(tip)}</title></rect>')
        if self.retired_at is not None:
            w = max(x(t_end) - x(self.retired_at), 0.6)
            out.append(f'<rect x="{x(self.retired_at):.2f}" y="{top}" width="{w:.2f}" '
                       f'height="{height_px}" fill="{COLOURS["retired"]}"><title>arena: retired at '
                       f'{self.retired_at - self.t0:.3f} s</title></rect>')
        if lost_lane:
            out.append(f'<text x="{left - 8}" y="{top + height_px + row * 0.65:.1f}" text-anchor="end">'
                       f'no extent</text>')
        for t, index in self.quarantines:
            y0, h = ext_y(index)
            out.append(f'<line x1="{x(t):.2f}" y1="{y0:.2f}" x2="{x(t):.2f}" y2="{y0 + max(h, 6):.2f}" '
                       f'stroke="#5b2a86" stroke-width="1.5"/>')
        for t, index, room in self.failures:
            y0, h = ext_y(index)
            cy = y0 + h / 2
            cx = x(t)
            out.append(f'<path d="M{cx - 3:.2f},{cy - 3:.2f} L{cx + 3:.2f},{cy + 3:.2f} M{cx - 3:.2f},{cy + 3:.2f} '
                       f'L{cx + 3:.2f},{cy - 3:.2f}" stroke="#d62728" stroke-width="1.5" class="failure">'
                       f'<title>room {room} failed at {t - self.t0:.3f} s</title></path>')
        axis_y = top + height_px + (row if lost_lane else 0) + 14
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
