"""The overview's charts, drawn on the server as SVG with pygal (no JavaScript, no build):
waiting jobs by primary reason, running jobs by pool, the wait from ready to claimed (p50 /
p95 of the jobs claimed, per pool) and the wait of the oldest queued job per pool (since its
ready time; blocked jobs and delayed retries left out), over the last hour
(by the minute) or the last day (by 10 minutes), from the rolled-up history the summaries
duty writes (sql/history.py). Served as images (``<img>``), so that the page's strict CSP
is untouched: each SVG answer carries its own policy, styles only, no script."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from typing import Any

import pygal
from pygal.etree import etree as ET
from pygal.style import Style

from pgdispatch.sql.explain import REASON_CODES

from .formatting import seconds

# name -> (title, what the alt text says the chart shows)
CHARTS = {
    "depth": ("Waiting jobs by primary reason", "waiting jobs, stacked by their primary reason"),
    "running": ("Running jobs by pool", "running jobs, stacked by pool"),
    "wait": ("Wait from ready to claimed", "the p50 and p95 wait of the jobs claimed, per pool"),
    # queue_history.oldest_wait_seconds: the summary's oldest_ready_at (sql/functions/summaries.sql)
    "oldest": ("Oldest queued job's wait",
               "how long the oldest queued job of each pool (whatever holds it; blocked jobs "
               "and delayed retries left out) had waited since it became ready"),
}

# the console's palette (static/app.css), then distinct hues for the rest
STYLE = Style(
    background="#ffffff", plot_background="#ffffff", foreground="#1d232b",
    foreground_strong="#1d232b", foreground_subtle="#d9dee4", opacity=".55",
    opacity_hover=".8", font_family="system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif",
    colors=("#2457c5", "#b3261e", "#9a5b00", "#1f7a3f", "#6b3fa0", "#00838f", "#c2185b",
            "#5d4037", "#546e7a", "#827717", "#e65100", "#66707c"),
    title_font_size=15, label_font_size=11, major_label_font_size=11, legend_font_size=11,
)


def _labels(points: list[dt.datetime], step_seconds: int) -> list[str]:
    fmt = "%H:%M" if step_seconds < 3600 else "%d %H:%M"
    return [p.astimezone(dt.timezone.utc).strftime(fmt) for p in points]


def _chart(kind: Callable[..., Any], title: str, history: dict[str, Any], *,
           is_duration: bool = False, fill: bool = False) -> Any:
    step = history["step_seconds"]
    chart = kind(
        style=STYLE, width=640, height=300, js=[], fill=fill, show_dots=False,
        allow_interruptions=True, title=title, show_minor_x_labels=False,
        x_labels_major_every=10 if step == 60 else 18, truncate_label=-1, truncate_legend=24,
        legend_at_bottom=False, include_x_axis=True,
        no_data_text="no history yet", margin=8, stroke_style={"width": 2},
        value_formatter=seconds if is_duration else (lambda v: f"{v:.0f}"),
    )
    chart.x_labels = _labels(history["points"], step)
    return chart


# tick steps that read well: counts, then durations in seconds; past the last, 1, 2 or 5
# times a power of ten of it
_COUNT_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 50000, 100000)
_SECOND_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400,
                 21600, 43200, 86400, 172800, 604800)
# at most this many intervals between ticks, so at most MAX_TICKS + 2 labels, whatever the values
MAX_TICKS = 5


def _tick_step(top: float, steps: tuple[int, ...]) -> int:
    """The least step of ``steps`` (or past its last, its last times 1, 2 or 5 times a power
    of ten) that splits 0..``top`` into at most MAX_TICKS intervals."""
    for step in steps:
        if top / step <= MAX_TICKS:
            return step
    need = top / MAX_TICKS / steps[-1]  # > 1 here
    power = 10 ** math.floor(math.log10(need))
    return steps[-1] * next(f * power for f in (1, 2, 5, 10) if f * power >= need)


def _y_labels(chart: Any, top: float, steps: tuple[int, ...]) -> None:
    # whole ticks (no "0, 0, 1, 1" from a count axis split into fractions), a bounded number
    # of them: a huge value must not make thousands of labels
    step = _tick_step(top, steps)
    chart.y_labels = [step * k for k in range(int(top // step) + 2)]


def _finite(value: Any) -> Any:
    # pygal cannot place an infinite or NaN value (a wait since -infinity): a gap instead
    return value if value is None or math.isfinite(value) else None


def _present(values: list[Any]) -> bool:
    return any(v is not None for v in values)


def render(name: str, history: dict[str, Any]) -> bytes:
    """The SVG of chart ``name`` (a key of CHARTS) over ``history`` (sql/history.py
    read_queue_history). Series with no value in the span are left out."""
    title = f"{CHARTS[name][0]}, last {history['span']}"
    pools = history["pools"]
    if name == "depth":
        chart = _chart(pygal.StackedLine, title, history, fill=True)
        for code in REASON_CODES:
            values = history["reasons"].get(code)
            if values and any(values):
                chart.add(code, values)
    elif name == "running":
        chart = _chart(pygal.StackedLine, title, history, fill=True)
        for pool, rows in pools.items():
            values = [r["running"] if r else None for r in rows]
            if any(values):
                chart.add(pool, values)
    elif name == "wait":
        chart = _chart(pygal.Line, title, history, is_duration=True)
        for pool, rows in pools.items():
            for key, label in (("wait_p95_seconds", "p95"), ("wait_p50_seconds", "p50")):
                values = [_finite(r[key]) if r else None for r in rows]
                if _present(values):
                    chart.add(f"{pool} {label}", values)
    elif name == "oldest":
        chart = _chart(pygal.Line, title, history, is_duration=True)
        for pool, rows in pools.items():
            values = [_finite(r["oldest_wait_seconds"]) if r else None for r in rows]
            if _present(values):
                chart.add(pool, values)
    else:
        raise KeyError(name)
    values = [v for serie in chart.raw_series for v in serie[0] if v is not None]
    if values:
        _y_labels(chart, max(values) if name not in ("depth", "running")
                  else _stacked_top(chart),
                  _SECOND_STEPS if name in ("wait", "oldest") else _COUNT_STEPS)
    else:  # an empty chart says "no history yet", on no axis of pygal's own guessing
        chart.show_y_labels = False
        chart.show_y_guides = False
    return _without_scripts(chart)


def _stacked_top(chart: Any) -> float:
    series = [serie[0] for serie in chart.raw_series]
    return max((sum(v or 0 for v in point) for point in zip(*series)), default=0)


def _without_scripts(chart: Any) -> bytes:
    # pygal always embeds its config as a <script> (for its optional tooltips, off here: js=[]);
    # an image never runs it, and the SVG's own policy forbids it, so it is dropped
    tree = chart.render_tree()
    for parent in list(tree.iter()):
        for child in list(parent):
            if isinstance(child.tag, str) and child.tag.rsplit("}", 1)[-1] == "script":
                parent.remove(child)
    return ET.tostring(tree, encoding="utf-8", xml_declaration=True)


def alt_text(name: str, history: dict[str, Any]) -> str:
    """What chart ``name`` shows, and its latest values, for the image's alt text."""
    what = CHARTS[name][1]
    pools = history["pools"]
    latest: list[str] = []
    if name == "depth":
        for code in REASON_CODES:
            values = [v for v in history["reasons"].get(code, []) if v is not None]
            if values and values[-1]:
                latest.append(f"{code} {values[-1]}")
    else:
        key = {"running": "running", "wait": "wait_p95_seconds",
               "oldest": "oldest_wait_seconds"}[name]
        for pool, rows in pools.items():
            values = [r[key] for r in rows if r is not None and r[key] is not None]
            if values:
                shown = seconds(values[-1]) if name != "running" else str(values[-1])
                latest.append(f"{pool} {shown}" + (" (p95)" if name == "wait" else ""))
    span = f"over the last {history['span']}"
    return f"Chart of {what} {span}; latest: {', '.join(latest) or 'none'}."
