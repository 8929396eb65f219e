"""Jinja filters for times: UTC everywhere, ISO 8601 in attributes, "12 s ago" for ages."""

from __future__ import annotations

import datetime as dt

from flask import Flask


def utc(ts: dt.datetime | None) -> str:
    """``2025-01-31 14:02:03 UTC``."""
    if ts is None:
        return ""
    return ts.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def isotime(ts: dt.datetime | None) -> str:
    """ISO 8601 in UTC, for ``<time datetime>``."""
    if ts is None:
        return ""
    return ts.astimezone(dt.timezone.utc).isoformat(timespec="seconds")


def seconds(value: float | None) -> str:
    """A duration in seconds as ``45 s``, ``12 min``, ``3 h``, ``2 d``."""
    if value is None:
        return "—"
    value = float(value)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 120:
        return f"{sign}{value:.0f} s"
    if value < 7200:
        return f"{sign}{value / 60:.0f} min"
    if value < 172800:
        return f"{sign}{value / 3600:.0f} h"
    return f"{sign}{value / 86400:.0f} d"


def ago(ts: dt.datetime | None, now: dt.datetime | None = None) -> str:
    """How long ago ``ts`` was, measured from ``now`` (the database's, when the page has it)."""
    if ts is None:
        return "never"
    now = now or dt.datetime.now(dt.timezone.utc)
    delta = (now - ts).total_seconds()
    if delta < 0:
        return "in " + seconds(-delta)
    return seconds(delta) + " ago"


def size(value: int | None) -> str:
    """A size in bytes as ``512 B``, ``16 kB``, ``1.5 MB``, ``2.0 GB`` (powers of 1024, as
    PostgreSQL's pg_size_pretty)."""
    if value is None:
        return "—"
    amount = float(value)
    for unit in ("B", "kB", "MB", "GB"):
        if amount < 1024 or unit == "GB":
            break
        amount /= 1024
    if unit == "B":
        return f"{int(amount)} B"
    return f"{amount:.0f} {unit}" if amount >= 10 else f"{amount:.1f} {unit}"


def init_app(app: Flask) -> None:
    """Register the filters."""
    app.add_template_filter(utc)
    app.add_template_filter(isotime)
    app.add_template_filter(seconds)
    app.add_template_filter(ago)
    app.add_template_filter(size)
