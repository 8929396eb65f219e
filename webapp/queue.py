"""Queue: waiting jobs, each with why it waits and since when; filterable, sorted by id or
longest waiting first, keyset-paginated in either order."""

from __future__ import annotations

import datetime as dt

from flask import Blueprint, current_app

from pgdispatch.sql import InvalidInput, reads
from pgdispatch.sql.explain import REASON_CODES

from .db import get_conn
from .views import arg_int, arg_text, render_view

bp = Blueprint("queue", __name__, url_prefix="/queue")
FILTERS = ("organization", "project", "pool", "target", "reason")


@bp.get("/")
def index():
    """Waiting jobs after ``after_id``, filtered; the table fragment for htmx polls."""
    filters = {name: arg_text(name) for name in FILTERS}
    if filters["reason"] is not None and filters["reason"] not in REASON_CODES:
        raise InvalidInput(f"unknown reason {filters['reason']!r}")
    after_id = arg_int("after_id", 0)
    limit = arg_int("limit", 50, low=1, high=200)
    sort = arg_text("sort") or "id"
    if sort not in reads.WAITING_SORTS:
        raise InvalidInput(f"unknown sort {sort!r} (one of: {', '.join(reads.WAITING_SORTS)})")
    after_since = _arg_time("after_since") if sort == "oldest" else None
    conn = get_conn()
    choices = reads.list_filter_choices(conn)
    choices["targets"] = sorted(t["name"] for t in reads.list_targets(conn))
    for name in ("organization", "project", "pool", "target"):
        # an unknown name is a mistyped link, said as the reason and state filters say it
        if filters[name] is not None and filters[name] not in choices[name + "s"]:
            raise InvalidInput(f"unknown {name} {filters[name]!r}")
    page = reads.list_waiting(conn, after_id=after_id, limit=limit,
                              live_seconds=current_app.config["RUNNER_LIVE_SECONDS"],
                              sort=sort, after_since=after_since, **filters)
    active = {k: v for k, v in filters.items() if v is not None}
    unsorted_filters = dict(active)  # the column headers' links set the sort themselves
    if sort != "id":
        active["sort"] = sort  # kept by the filters form, the pager and the poll
    return render_view("queue/index.html", "queue/_table.html", jobs=page["jobs"],
                       next_after_id=page["next_after_id"],
                       next_after_since=page["next_after_since"], after_id=after_id,
                       after_since=after_since, limit=limit, filters=active, choices=choices,
                       reason_codes=REASON_CODES, sort=sort, now=page["now"],
                       unsorted_filters=unsorted_filters)


def _arg_time(name: str) -> dt.datetime | None:
    """An ISO 8601 time with its offset (a cursor the pager wrote); None when absent."""
    value = arg_text(name)
    if value is None:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise InvalidInput(f"{name} must be an ISO 8601 time, got {value!r}") from None
    if parsed.tzinfo is None:
        raise InvalidInput(f"{name} must carry its UTC offset, got {value!r}")
    return parsed
