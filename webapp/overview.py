"""Overview: capacity per organization and pool, waiting jobs by reason, uncertain targets."""

from __future__ import annotations

from flask import Blueprint, current_app

from pgdispatch.sql import reads
from pgdispatch.sql.explain import REASON_CODES

from .db import get_conn
from .views import render_view

bp = Blueprint("overview", __name__)


@bp.get("/")
def index():
    """The overview page, or its live fragment (polled every few seconds)."""
    data = reads.overview(get_conn(), live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])
    uncertain = [t for t in data["targets"] if t["state"] == "uncertain"]
    return render_view("overview/index.html", "overview/_summary.html", data=data,
                       uncertain=uncertain, reason_codes=REASON_CODES,
                       waiting=data["waiting"])
