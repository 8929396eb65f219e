"""Overview: capacity per organization and pool, waiting jobs by reason, uncertain targets,
a banner when a session holds the database's xmin horizon back too long, and the charts of
the last hour or day (webapp/charts.py)."""

from __future__ import annotations

import time

from flask import Blueprint, abort, current_app, make_response, redirect, url_for

from pgdispatch.sql import health, history, reads
from pgdispatch.sql.explain import REASON_CODES

from . import charts
from .db import get_conn
from .views import arg_text, is_htmx, render_view

bp = Blueprint("overview", __name__)

# an SVG image may style itself (pygal's <style>) and nothing else: no script, no fetch
SVG_POLICY = "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'self'"


def _span() -> str:
    span = arg_text("span") or "hour"
    history.check_span(span)  # InvalidInput: a 400 page
    return span


def _charts_context(span: str) -> dict:
    """What templates/overview/_charts.html needs: the span, the charts' names, titles and
    alt texts (with their latest values), and a version that changes every minute (the
    history's grain), so that each poll's images are fetched anew."""
    data = history.read_queue_history(get_conn(), span=span)
    return {"span": span, "spans": list(history.SPANS), "chart_names": list(charts.CHARTS),
            "chart_titles": {n: t for n, (t, _) in charts.CHARTS.items()},
            "chart_alts": {n: charts.alt_text(n, data) for n in charts.CHARTS},
            "chart_version": int(time.time() // 60)}


def _pinned_horizon() -> dict | None:
    """The session or prepared transaction that has held the xmin horizon back longer than
    HORIZON_ALERT_SECONDS (the longest such), or None."""
    oldest = health.read_horizon(get_conn())["oldest"]
    limit = current_app.config["HORIZON_ALERT_SECONDS"]
    if oldest is not None and oldest["xact_age_seconds"] > limit:
        return {**oldest, "alert_seconds": limit}
    return None


@bp.get("/")
def index():
    """The overview page, or its live fragment (polled every few seconds)."""
    span = _span()
    data = reads.overview(get_conn(), live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])
    uncertain = [t for t in data["targets"] if t["state"] == "uncertain"]
    pinned = _pinned_horizon()
    # the summary's 2-second poll gets no charts: they have their own, every minute
    extra = {} if is_htmx() else _charts_context(span)
    return render_view("overview/index.html", "overview/_summary.html", data=data,
                       uncertain=uncertain, pinned=pinned, reason_codes=REASON_CODES,
                       waiting=data["waiting"], **extra)


@bp.get("/charts/")
def chart_panel():
    """The charts fragment (polled every minute); without htmx, the overview page."""
    span = _span()
    if not is_htmx():
        return redirect(url_for("overview.index", span=span))
    return render_view("overview/index.html", "overview/_charts.html", **_charts_context(span))


@bp.get("/charts/<name>.svg")
def chart(name: str):
    """One chart as an SVG image (``span``: hour or day)."""
    if name not in charts.CHARTS:
        abort(404)
    data = history.read_queue_history(get_conn(), span=_span())
    response = make_response(charts.render(name, data))
    response.headers["Content-Type"] = "image/svg+xml; charset=utf-8"
    response.headers["Content-Security-Policy"] = SVG_POLICY
    return response
