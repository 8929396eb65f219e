"""Pools: pool slots held, runner slots of the live runners, the pause (who, when, why);
pause with a mandatory reason, resume. Polled. A paused pool takes no claim; its running jobs
go on (sql/functions/operator.sql, pgd_pause_pool)."""

from __future__ import annotations

from flask import Blueprint, current_app, url_for

from pgdispatch.sql import reads, transitions

from .db import get_conn
from .views import named_row, pause_or_resume, render_view

bp = Blueprint("pools", __name__, url_prefix="/pools")


def _pools() -> list[dict]:
    return reads.list_pools(get_conn(), live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])


def _row(name: str) -> str:
    """The pool's row as it is now ("" when it no longer exists)."""
    return named_row("pools/_row.html", "q", _pools(), name)


@bp.get("/")
def index():
    """Every pool with its slots, runner slots and pause."""
    return render_view("pools/index.html", "pools/_table.html", pools=_pools())


@bp.post("/<name>/pause")
def pause(name: str):
    """Pause a pool; no claim takes from it until it is resumed."""
    return pause_or_resume(transitions.pause_pool, kind="pool", name=name, pausing=True,
                           back=url_for("pools.index"), fragment=lambda: _row(name))


@bp.post("/<name>/resume")
def resume(name: str):
    """Resume a paused pool."""
    return pause_or_resume(transitions.resume_pool, kind="pool", name=name, pausing=False,
                           back=url_for("pools.index"), fragment=lambda: _row(name))
