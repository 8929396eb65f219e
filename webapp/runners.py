"""Runners: one row per scheduler process, with its pools, slots in use and last heartbeat;
and who holds each elected duty (scheduler/duties.py) since when, and when it was last done.
Polled. Stopped and lost runners fold away FOLD_SECONDS after they stopped (the page says how
many it folds); their rows are kept, and ``?show=stopped`` lists them, newest first, paged."""

from __future__ import annotations

from flask import Blueprint, current_app, render_template, url_for

from pgdispatch.sql import InvalidInput, NotFound, reads, transitions

from .db import get_conn
from .views import MAX_BIGINT, actor, arg_int, arg_text, form_text, perform, render_view

bp = Blueprint("runners", __name__, url_prefix="/runners")

FOLD_SECONDS = 600
STOPPED_SHOWN = 10
SHOWS = ("stopped",)


@bp.get("/")
def index():
    """Live and draining runners, those stopped in the last FOLD_SECONDS (at most
    STOPPED_SHOWN) and the duties; ``?show=stopped``: the stopped ones, ``before_id`` paged."""
    show = arg_text("show")
    if show is not None and show not in SHOWS:
        raise InvalidInput(f"show must be one of: {', '.join(SHOWS)}")
    conn = get_conn()
    if show == "stopped":
        before_id = arg_int("before_id", MAX_BIGINT, low=1)
        limit = arg_int("limit", 50, low=1, high=500)
        page = reads.list_stopped_runners(conn, before_id=before_id, limit=limit)
        return render_view("runners/index.html", "runners/_table.html", show=show, **page,
                           is_first_page=before_id == MAX_BIGINT,
                           limit=limit if limit != 50 else None, fold_seconds=FOLD_SECONDS)
    page = reads.list_runners_page(conn, live_seconds=current_app.config["RUNNER_LIVE_SECONDS"],
                                   fold_seconds=FOLD_SECONDS, stopped_limit=STOPPED_SHOWN)
    return render_view("runners/index.html", "runners/_table.html", show=None, **page,
                       is_first_page=True, fold_seconds=FOLD_SECONDS, stopped_limit=STOPPED_SHOWN)


def _row(runner_id: int) -> str:
    """The runner's row as it is now ("" when it does not exist)."""
    try:
        runner = reads.show_runner(get_conn(), runner_id=runner_id,
                                   live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])
    except NotFound:
        return ""
    return render_template("runners/_row.html", r=runner)


@bp.post("/<int:runner_id>/drain")
def drain(runner_id: int):
    """Drain a runner (reason required, deadline in seconds optional): it takes nothing new."""
    reason = form_text("reason")
    deadline = form_text("deadline_seconds")
    return perform(lambda conn: transitions.drain_runner(
                       conn, runner_id=runner_id, reason=reason or "", actor=actor(),
                       deadline_seconds=deadline),
                   success=lambda r: f"runner {r['name']} drained" + (
                       f"; its builds are handed back after {deadline} s" if deadline else ""),
                   back=url_for("runners.index"), fragment=lambda: _row(runner_id))


@bp.post("/<int:runner_id>/resume")
def resume(runner_id: int):
    """Resume a drained runner: it claims again."""
    reason = form_text("reason")
    return perform(lambda conn: transitions.resume_runner(conn, runner_id=runner_id, reason=reason,
                                                          actor=actor()),
                   success=lambda r: f"runner {r['name']} resumed",
                   back=url_for("runners.index"), fragment=lambda: _row(runner_id))
