"""Runners: one row per scheduler process, with its pools, slots in use and last heartbeat;
and who holds each elected duty (scheduler/duties.py) since when, and when it was last done.
Stopped and lost runners do not pile up: the live ones and the last few stopped, with a
count."""

from __future__ import annotations

from flask import Blueprint, current_app

from pgdispatch.sql import reads

from .db import get_conn
from .views import render_view

bp = Blueprint("runners", __name__, url_prefix="/runners")

STOPPED_SHOWN = 10


@bp.get("/")
def index():
    """Live and draining runners, the last STOPPED_SHOWN stopped ones, and the duties."""
    page = reads.list_runners_page(get_conn(),
                                   live_seconds=current_app.config["RUNNER_LIVE_SECONDS"],
                                   stopped_limit=STOPPED_SHOWN)
    return render_view("runners/index.html", "runners/_table.html", **page)
