"""Jobs: every job, filtered and paged; one job's attempts, output and explanation; approve,
cancel, retry, set its priority; bulk actions over a filter, previewed first."""

from __future__ import annotations

import re

from flask import Blueprint, current_app, redirect, render_template, request, url_for

from pgdispatch.sql import InvalidInput, PgDispatchError, bulk, explain, reads, transitions
from pgdispatch.sql.explain import REASON_CODES
from pgdispatch.sql.validate import JOB_STATES

from .db import get_conn
from .views import (actor, arg_int, arg_text, check_job_id, form_text, perform, render_view,
                    require_operator, respond)

bp = Blueprint("jobs", __name__, url_prefix="/jobs")
STATES = JOB_STATES
TAIL_CHARS = 16384
# the first events of a job's audit trail shown on its page (the audit log has them all)
AUDIT_SHOWN = 200
# the rows of one page of search results
SEARCH_LIMIT = 50


def _explain(job_id: int) -> dict:
    return explain.explain_job(get_conn(), job_id=job_id,
                               live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])


def _context(job_id: int) -> dict:
    conn = get_conn()
    job = reads.show_job(conn, job_id=job_id, tail_chars=TAIL_CHARS)
    return {"job": job, "explain": _explain(job_id),
            "audit": reads.list_job_audit(conn, job_id=job_id, limit=AUDIT_SHOWN),
            "audit_shown": AUDIT_SHOWN}


def _fragment(job_id: int) -> str:
    return render_template("jobs/_job.html", **_context(job_id))


def _waits(job_id: int) -> str:
    """What job ``job_id`` waits for now, in a few words with its reason code ("waiting for
    job 29 (dependency_pending)"); "" when it does not wait."""
    why = _explain(job_id)
    if not why["reasons"]:
        return ""
    first = why["reasons"][0]
    jobs = first["details"].get("jobs") if first["code"] == "dependency_pending" else None
    text = ("waiting for " + ", ".join(f"job {j}" for j in jobs)) if jobs else first["message"]
    return text if text.startswith(first["code"]) else f"{text} ({first['code']})"


def _approved(job_id: int, result: dict) -> str:
    if result["state"] == "blocked":
        return f"job {job_id} approved; still {_waits(job_id)}"
    return f"job {job_id} approved and queued; {_waits(job_id)}"


def _cancelled(job_id: int, result: dict) -> str:
    if result.get("cancel_requested"):
        return f"job {job_id} is running: its runner has been asked to stop it"
    return f"job {job_id} cancelled"


def _retried(job_id: int, result: dict) -> str:
    if result["state"] == "queued":
        return f"job {job_id} queued again; {_waits(job_id)}"
    return f"job {job_id} queued again, but {_waits(job_id)}"


# The Jobs page's filters, as the query string names them (contract: the holder links of the
# overview and the queue, e.g. /jobs/?state=running&organization=globex, docs/console.md).
TEXT_FILTERS = ("state", "organization", "project", "pool", "target", "reason")
AGE_FILTERS = {"older_than": "older_than_seconds", "younger_than": "younger_than_seconds"}
# the age menus' choices (seconds); any other number of seconds works in the URL
AGE_CHOICES = (60, 300, 900, 3600, 6 * 3600, 86400, 7 * 86400)
AGE_PATTERN = re.compile(r"[0-9]+(\.[0-9]+)?")


def _age_arg(name: str) -> float | None:
    raw = request.args.get(name, "").strip()
    if raw == "":
        return None
    # ASCII digits only: float() also reads "1_000", "١٢" and "1e3"
    if len(raw) > 40 or not AGE_PATTERN.fullmatch(raw):
        raise InvalidInput(f"{name} must be a number of seconds between 0 and "
                           f"{reads.MAX_AGE_SECONDS} in ASCII digits, got "
                           f"{raw[:40]!r}{'…' if len(raw) > 40 else ''}")
    value = float(raw)
    if not 0 <= value <= reads.MAX_AGE_SECONDS:  # NaN included
        raise InvalidInput(f"{name} must be a number of seconds between 0 and {reads.MAX_AGE_SECONDS}")
    return value


@bp.get("/")
def index():
    """Jobs, filtered (state, organization, project, pool, target, runner, reason, age in
    seconds), keyset-paged by job id (``before_id``: older, newest first; ``after_id``: newer,
    oldest first; with ``older_than`` in creation order, reads.list_jobs); the table fragment
    for htmx polls. ``?id=N`` jumps to job N."""
    if request.args.get("id", "").strip():
        return redirect(url_for("jobs.detail", job_id=arg_int("id", 0, low=1)))
    filters: dict = {name: arg_text(name) for name in TEXT_FILTERS}
    runner = arg_int("runner", 0, low=1)
    ages = {name: _age_arg(name) for name in AGE_FILTERS}
    limit = arg_int("limit", 50, low=1, high=500)
    before_id = arg_int("before_id", 0, low=1) or None
    # after_id=0: from the first job on, oldest first
    after_id = arg_int("after_id", 0) if request.args.get("after_id", "").strip() else None
    conn = get_conn()
    page = reads.list_jobs(conn, runner_id=runner or None, limit=limit, before_id=before_id,
                           after_id=after_id,
                           live_seconds=current_app.config["RUNNER_LIVE_SECONDS"],
                           **filters, **{AGE_FILTERS[k]: v for k, v in ages.items()})
    active = {k: v for k, v in {**filters, "runner": runner or None, **ages}.items()
              if v is not None}
    # whole seconds in links: ?older_than=3600, not 3600.0
    active = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in active.items()}
    choices = reads.list_filter_choices(conn)
    choices["targets"] = [t["name"] for t in reads.list_targets(conn)]
    return render_view("jobs/index.html", "jobs/_table.html", jobs=page["jobs"], listing=page,
                       now=page["now"], filters=active, before_id=before_id, after_id=after_id,
                       limit=limit if limit != 50 else None, states=STATES, choices=choices,
                       reason_codes=REASON_CODES, age_choices=AGE_CHOICES)


@bp.get("/search")
def search():
    """Find jobs (reads.search_jobs): ``q`` (#N, digits or 3 characters or more of a
    command), ``project``, ``submitter``, ``state``, ``before_id`` (the next page). ``#N``,
    or digits that only job N matches, open job N; without ``q``, the empty form."""
    q = request.args.get("q", "")
    filters = {name: arg_text(name) for name in ("project", "submitter", "state")}
    before_id = arg_int("before_id", 0, low=1) or None
    page = None
    if q.strip():
        page = reads.search_jobs(get_conn(), q=q, before_id=before_id, limit=SEARCH_LIMIT,
                                 **filters)
        only = page["jobs"][0] if len(page["jobs"]) == 1 else None
        if only is not None and only["match"] == "id" and before_id is None:
            return redirect(url_for("jobs.detail", job_id=only["id"]))
    active = {k: v for k, v in filters.items() if v is not None}
    choices = reads.list_filter_choices(get_conn())
    return render_view("jobs/search.html", "jobs/_search.html", q=q.strip(), found=page,
                       jobs=page["jobs"] if page else [], filters=active, before_id=before_id,
                       states=STATES, projects=choices["projects"])


@bp.get("/<int:job_id>")
def detail(job_id: int):
    """One job: attempts timeline, output tail, why it waits."""
    check_job_id(job_id)
    return render_view("jobs/detail.html", "jobs/_job.html", **_context(job_id))


def _act(job_id: int, transition, said):
    """Run an operator transition on the job; ``said(job_id, result)`` is the flash message."""
    check_job_id(job_id)
    reason = form_text("reason")
    return perform(lambda conn: transition(conn, job_id=job_id, actor=actor(), reason=reason),
                   success=lambda r: said(job_id, r),
                   back=url_for("jobs.detail", job_id=job_id), fragment=lambda: _fragment(job_id))


@bp.post("/<int:job_id>/approve")
def approve(job_id: int):
    """Approve a job that waits for an operator's approval."""
    return _act(job_id, transitions.approve_job, _approved)


@bp.post("/<int:job_id>/cancel")
def cancel(job_id: int):
    """Cancel a waiting job, or ask the runner of a running one to stop it."""
    return _act(job_id, transitions.cancel_job, _cancelled)


@bp.post("/<int:job_id>/retry")
def retry(job_id: int):
    """Queue a failed or cancelled job again."""
    return _act(job_id, transitions.retry_job, _retried)


def _prioritized(job_id: int, result: dict) -> str:
    return f"job {job_id}: priority {result['previous_priority']} -> {result['priority']}"


@bp.post("/<int:job_id>/priority")
def set_priority(job_id: int):
    """Set the priority of a waiting job (-1000..1000)."""
    check_job_id(job_id)
    reason = form_text("reason")
    raw = form_text("priority", required=True)
    return perform(lambda conn: transitions.set_priority(conn, job_id=job_id, priority=_priority(raw),
                                                         actor=actor(), reason=reason),
                   success=lambda r: _prioritized(job_id, r),
                   back=url_for("jobs.detail", job_id=job_id), fragment=lambda: _fragment(job_id))


def _priority(raw: str | None) -> int | None:
    """A priority typed in a form: ASCII digits with an optional minus, -1000..1000."""
    if raw is None:
        return None
    digits = raw[1:] if raw[:1] in "+-" else raw
    if len(raw) > 6 or not (digits.isascii() and digits.isdigit()) or not -1000 <= int(raw) <= 1000:
        raise InvalidInput("priority must be a whole number between -1000 and 1000")
    return int(raw)


# --- bulk actions: preview (GET) and confirm (POST) --------------------------------------

BULK_ROWS_SHOWN = 200  # rows of a preview and of a report on the page (every id is in the form)
_TOKEN = re.compile(r"([0-9]{1,19}):([0-9]{1,19})")


def _bulk_filters(source) -> dict:
    """The Jobs page's filters from ``source`` (request.args or request.form), in the bulk
    action's names (sql/bulk.py, BULK_FILTERS); None for each one not given."""
    def text(name):
        value = (source.get(name) or "").strip()
        if "\x00" in value or len(value) > 200:
            raise InvalidInput(f"{name} filter is not valid")
        return value or None

    def number(name, *, whole=False):
        raw = (source.get(name) or "").strip()
        if raw == "":
            return None
        if len(raw) > 40 or not AGE_PATTERN.fullmatch(raw) or (whole and "." in raw):
            raise InvalidInput(f"{name} must be a {'whole number' if whole else 'number of seconds'}"
                               f" in ASCII digits")
        return int(raw) if whole else float(raw)

    filters = {name: text(name) for name in TEXT_FILTERS}
    filters["runner_id"] = number("runner", whole=True)
    for name, key in AGE_FILTERS.items():
        filters[key] = number(name)
    return filters


def _link_filters(filters: dict) -> dict:
    """``filters`` as the Jobs page's query string names them (for links and hidden fields)."""
    names = {"runner_id": "runner", **{v: k for k, v in AGE_FILTERS.items()}}
    return {names.get(k, k): (int(v) if isinstance(v, float) and v.is_integer() else v)
            for k, v in filters.items() if v is not None}


def _bulk_action(source) -> tuple[str, int | None]:
    action = (source.get("action") or "").strip()
    if action not in bulk.BULK_ACTIONS:
        raise InvalidInput(f"choose a bulk action: {', '.join(bulk.BULK_ACTIONS)}")
    raw = (source.get("priority") or "").strip() or None
    return action, _priority(raw) if action == "reprioritize" else None


@bp.get("/bulk")
def bulk_preview():
    """What a bulk action would take: the jobs the Jobs page's filters select that are in a
    state the action takes, first by id (at most 10,000), and the form that confirms exactly
    those. Operators only; nothing changes."""
    require_operator()
    action, priority = _bulk_action(request.args)
    filters = _bulk_filters(request.args)
    preview = bulk.preview_bulk(get_conn(), action=action, filters=filters, priority=priority,
                                live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])
    tokens = " ".join(f"{j['id']}:{j['generation']}" for j in preview["jobs"])
    return render_view("jobs/bulk.html", "jobs/_bulk.html", preview=preview, result=None,
                       action=action, priority=priority, filters=_link_filters(preview["filter"]),
                       tokens=tokens, shown=BULK_ROWS_SHOWN, now=preview["now"])


@bp.post("/bulk")
def bulk_apply():
    """Apply a previewed bulk action to exactly the ids (and generations) the preview's form
    carries; the report lists what was done and what was skipped, with why."""
    require_operator()
    back = url_for("jobs.index")
    try:
        action, priority = _bulk_action(request.form)
        filters = _bulk_filters(request.form)
        raw = (request.form.get("jobs") or "").split()
        if not raw or len(raw) > bulk.MAX_BULK_JOBS:
            raise InvalidInput(f"the form carries no jobs, or more than {bulk.MAX_BULK_JOBS}: preview again")
        pairs = [_TOKEN.fullmatch(t) for t in raw]
        if not all(pairs):
            raise InvalidInput("the form's job list is not valid: preview again")
        result = bulk.apply_bulk(get_conn(), action=action,
                                 job_ids=[int(m.group(1)) for m in pairs],
                                 generations=[int(m.group(2)) for m in pairs],
                                 filters=filters, truncated=request.form.get("truncated") == "1",
                                 priority=priority, reason=form_text("bulk_reason"), actor=actor())
    except PgDispatchError as exc:
        return respond(message=str(exc), category="error", status=exc.http_status, back=back)
    return render_view("jobs/bulk.html", "jobs/_bulk.html", preview=None, result=result,
                       action=action, priority=priority, filters=_link_filters(filters),
                       tokens="", shown=BULK_ROWS_SHOWN, now=None)
