"""Audit log: every operator action (who, when, what, why), newest first, filterable; the
newest page is polled. ``?job=N``: job N's own trail (target resolutions that decided it
included)."""

from __future__ import annotations

from flask import Blueprint

from pgdispatch.sql import audit

from .db import get_conn
from .views import MAX_BIGINT, arg_int, arg_text, render_view

bp = Blueprint("audit", __name__, url_prefix="/audit")
FILTERS = ("actor", "action", "subject")


@bp.get("/")
def index():
    """Audit events before ``before_id``, filtered by actor, action, subject prefix and job."""
    filters = {name: arg_text(name) for name in FILTERS}
    job_id = arg_int("job", 0, low=1) or None
    before_id = arg_int("before_id", MAX_BIGINT, low=1)
    limit = arg_int("limit", 100, low=1, high=500)
    events = audit.list_audit_events(get_conn(), before_id=before_id, limit=limit, job_id=job_id,
                                     **filters)
    older = events[-1]["id"] if len(events) == limit else None
    active = {k: v for k, v in filters.items() if v is not None}
    if job_id is not None:
        active["job"] = job_id
    return render_view("audit/index.html", "audit/_table.html", events=events, filters=active,
                       older=older, is_first_page=before_id == MAX_BIGINT,
                       limit=limit if limit != 100 else None)
