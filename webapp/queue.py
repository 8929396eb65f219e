"""Queue: waiting jobs, each with why it waits; filterable, keyset-paginated by job id."""

from __future__ import annotations

from flask import Blueprint, current_app

from pgdispatch.sql import InvalidInput, reads
from pgdispatch.sql.explain import REASON_CODES

from .db import get_conn
from .views import arg_int, arg_text, render_view

bp = Blueprint("queue", __name__, url_prefix="/queue")
FILTERS = ("organization", "project", "pool", "reason")


@bp.get("/")
def index():
    """Waiting jobs after ``after_id``, filtered; the table fragment for htmx polls."""
    filters = {name: arg_text(name) for name in FILTERS}
    if filters["reason"] is not None and filters["reason"] not in REASON_CODES:
        raise InvalidInput(f"unknown reason {filters['reason']!r}")
    after_id = arg_int("after_id", 0)
    limit = arg_int("limit", 50, low=1, high=200)
    conn = get_conn()
    choices = reads.list_filter_choices(conn)
    for name in ("organization", "project", "pool"):
        # an unknown name is a mistyped link, said as the reason and state filters say it
        if filters[name] is not None and filters[name] not in choices[name + "s"]:
            raise InvalidInput(f"unknown {name} {filters[name]!r}")
    page = reads.list_waiting(conn, after_id=after_id, limit=limit,
                              live_seconds=current_app.config["RUNNER_LIVE_SECONDS"], **filters)
    active = {k: v for k, v in filters.items() if v is not None}
    return render_view("queue/index.html", "queue/_table.html", jobs=page["jobs"],
                       next_after_id=page["next_after_id"], after_id=after_id, limit=limit,
                       filters=active, choices=choices,
                       reason_codes=REASON_CODES)
