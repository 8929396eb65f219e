"""Runners: one row per scheduler process, with its pools, slots in use and last heartbeat."""

from __future__ import annotations

from flask import Blueprint, current_app

from pgdispatch.sql import reads

from .db import get_conn
from .views import render_view

bp = Blueprint("runners", __name__, url_prefix="/runners")


@bp.get("/")
def index():
    """Live, draining and recently stopped runners."""
    return render_view("runners/index.html", "runners/_table.html",
                       runners=reads.list_runners(get_conn(),
                                                  live_seconds=current_app.config["RUNNER_LIVE_SECONDS"]))
