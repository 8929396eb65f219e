"""Database: what degrades a PostgreSQL queue, before it hurts (docs/operations.md, "The
database's health"): who holds the xmin horizon back, the hot tables' dead tuples, last
vacuum and sizes, and the claim's time inside the database. Polled; read-only."""

from __future__ import annotations

from flask import Blueprint, current_app

from pgdispatch.sql import health

from .db import get_conn
from .views import render_view

bp = Blueprint("database", __name__, url_prefix="/database")


@bp.get("/")
def index():
    """The holders of the horizon first, then the tables and the claim's latency."""
    data = health.read_database_health(get_conn())
    return render_view("database/index.html", "database/_health.html", data=data,
                       alert_seconds=current_app.config["HORIZON_ALERT_SECONDS"])
