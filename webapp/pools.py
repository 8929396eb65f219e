"""Pools: pool slots held, runner slots of the live runners, the pause (who, when, why);
pause with a mandatory reason, resume. Polled. A paused pool takes no claim; its running jobs
go on (sql/functions/operator.sql, pgd_pause_pool)."""

from __future__ import annotations

from flask import Blueprint, current_app, render_template, url_for

from pgdispatch.sql import reads, transitions

from .db import get_conn
from .views import actor, form_text, perform, render_view

bp = Blueprint("pools", __name__, url_prefix="/pools")


def _pools() -> list[dict]:
    return reads.list_pools(get_conn(), live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])


def _row(name: str) -> str:
    """The pool's row as it is now ("" when it no longer exists)."""
    for pool in _pools():
        if pool["name"] == name:
            return render_template("pools/_row.html", q=pool)
    return ""


@bp.get("/")
def index():
    """Every pool with its slots, runner slots and pause."""
    return render_view("pools/index.html", "pools/_table.html", pools=_pools())


@bp.post("/<name>/pause")
def pause(name: str):
    """Pause a pool; no claim takes from it until it is resumed."""
    reason = form_text("reason")
    return perform(lambda conn: transitions.pause_pool(conn, pool=name, reason=reason or "",
                                                       actor=actor()),
                   success=lambda r: f"pool {name} paused",
                   back=url_for("pools.index"), fragment=lambda: _row(name))


@bp.post("/<name>/resume")
def resume(name: str):
    """Resume a paused pool."""
    reason = form_text("reason")
    return perform(lambda conn: transitions.resume_pool(conn, pool=name, reason=reason,
                                                        actor=actor()),
                   success=lambda r: f"pool {name} resumed",
                   back=url_for("pools.index"), fragment=lambda: _row(name))
