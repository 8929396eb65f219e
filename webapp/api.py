"""The JSON API under /api/v1/: bearer tokens, JSON in and out, errors as ``{"error": ...}``.

Authenticated by ``Authorization: Bearer <token>`` only (never the console's session cookie),
which is why it is exempt from CSRF. Viewer tokens may only read. Every action goes through
the same transition as the console and the CLI, audited with the token owner as the actor;
a new job's submission is audited too (``submit_job``).
"""

from __future__ import annotations

import json
import math
from typing import Any

from flask import Blueprint, abort, current_app, g, jsonify, request, url_for
from werkzeug.exceptions import BadRequest, RequestEntityTooLarge, UnsupportedMediaType

from pgdispatch.sql import (InvalidInput, NotFound, accounts, audit, bulk, explain, reads,
                            transitions)
from pgdispatch.sql.errors import UnknownFilter

from .auth import ROLE_RANK
from .db import get_conn
from .openapi import SPEC, body_error, query_values
from .views import MAX_BIGINT, check_job_id

bp = Blueprint("api", __name__, url_prefix="/api/v1")
READ_METHODS = ("GET", "HEAD", "OPTIONS")
PUBLIC = {"api.openapi"}
# No request body of this API nests more than three levels (an object of lists of strings);
# the bound leaves room and keeps the parser far from Python's recursion limit.
MAX_JSON_DEPTH = 32


@bp.before_request
def _authenticate():
    if request.endpoint in PUBLIC:
        return None
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        abort(401, description="a bearer token is required (Authorization: Bearer <token>)")
    user = accounts.find_api_token(get_conn(), token=token.strip())
    if user is None:
        abort(401, description="the bearer token is not valid")
    g.api_user = user
    if request.method not in READ_METHODS and ROLE_RANK.get(user["role"], -1) < ROLE_RANK["operator"]:
        abort(403, description=f"{user['username']} is a {user['role']}: this token may only read")
    return None


def _actor() -> str:
    return g.api_user["username"]


class _Unreadable(ValueError):
    """A JSON text that parses, but that this API refuses to read (a key twice, NaN)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # RFC 8259 leaves a repeated name's meaning to the parser: one request could then mean
    # two things to two readers (a proxy that checks the first, Python that keeps the last)
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _Unreadable(f"the field {key!r} appears twice")
        seen[key] = value
    return seen


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Unreadable(f"the number {text[:40]} is too large")
    return value


def _not_json(text: str) -> float:
    raise _Unreadable(f"{text} is not a JSON number")


def _parse_json(data: bytes) -> Any:
    """The JSON document in ``data``; BadRequest (400) when it cannot be read: not UTF-8,
    not JSON, a key twice, NaN or a number past a double, text with a lone surrogate, or
    nested deeper than MAX_JSON_DEPTH."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the request body is not valid UTF-8") from None
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_float=_finite,
                           parse_constant=_not_json)
    except RecursionError:
        raise BadRequest(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except _Unreadable as exc:
        raise BadRequest(f"the request body is refused: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, and an integer of more than 4300 digits
        raise BadRequest(f"the request body is not valid JSON: {' '.join(str(exc).split())[:200]}") from None
    # breadth first, without recursion: the depth bound is this walk's to enforce
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
        below = []
        for item in level:
            if isinstance(item, dict):
                below.extend(item.keys())
                below.extend(item.values())
            elif isinstance(item, list):
                below.extend(item)
            elif isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:  # "\ud800": valid JSON, not text
                    raise BadRequest("the request body has a string that is not valid "
                                     "Unicode (a lone surrogate escape)") from None
        level = below
    return value


def _body(operation_id: str) -> dict[str, Any]:
    """The request body of ``operation_id``, checked against what the OpenAPI document says
    of it (webapp/openapi.py): every JSON body of the API is read here.

    No body is an empty object (then a required field is missing). Raises
    RequestEntityTooLarge (413) for a chunked body that reaches MAX_CONTENT_LENGTH (one with
    a Content-Length over it is refused before), UnsupportedMediaType (415) for a body that
    is not ``application/json``, BadRequest (400)
    for one that cannot be read as JSON (``_parse_json``), and InvalidInput (422) naming the
    first field the document refuses: unknown, missing, of another type (a number in
    quotes, 0/1 for a boolean, 5.5 for an integer), out of range.
    """
    data = request.get_data(cache=True)
    limit = current_app.config.get("MAX_CONTENT_LENGTH")
    if limit and request.content_length is None and len(data) >= limit:
        # a chunked body (no Content-Length) is read only up to the limit: what reaches it is
        # cut, not whole, so it is refused as too large rather than parsed as cut JSON
        raise RequestEntityTooLarge()
    if not data:
        value: Any = {}
    elif not request.is_json:
        raise UnsupportedMediaType("the request body must be JSON (Content-Type: application/json)")
    else:
        value = _parse_json(data)
    problem = body_error(operation_id, value)
    if problem:
        raise InvalidInput(problem)
    return value


def _whole(value: Any) -> Any:
    """JSON has one number type: 7.0 is the integer 7 (as JSON Schema's "integer" says).
    Anything else is passed on as it is, for the transition's own check to refuse."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _optional_text(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidInput(f"{name} must be a string")
    return value


@bp.get("/openapi.json")
def openapi():
    """The OpenAPI 3.1 description of this API."""
    return jsonify(SPEC)


@bp.post("/jobs")
def submit_job():
    """Submit one job; 201 with the job, or 200 with the existing one when the same request
    repeats its idempotency key (409 when the key was used for a different request)."""
    body = _body("submitJob")
    for name in ("project", "pool"):
        if not isinstance(body[name], str):
            raise InvalidInput(f"{name} must be a string")
    if not isinstance(body["command"], list):
        raise InvalidInput("command must be a list of arguments")
    if "requires_approval" in body and not isinstance(body["requires_approval"], bool):
        raise InvalidInput("requires_approval must be true or false")
    depends_on = body.get("depends_on")
    if depends_on is None:
        depends_on = []
    if not isinstance(depends_on, list):
        raise InvalidInput("depends_on must be a list of job ids")
    if any(isinstance(d, bool) or not isinstance(d, (int, float)) for d in depends_on):
        raise InvalidInput("depends_on must be a list of job ids")
    depends_on = [_whole(d) for d in depends_on]
    kwargs = {name: _whole(body[name]) for name in ("priority", "max_attempts", "timeout_seconds")
              if body.get(name) is not None}
    if body.get("delay_seconds") is not None:
        kwargs["delay_seconds"] = body["delay_seconds"]
    # the submission and its audit event commit together (pgd_submit)
    job = transitions.submit(
        get_conn(), project=body["project"], pool=body["pool"], command=body["command"],
        target=_optional_text(body, "target"), requires_approval=body.get("requires_approval", False),
        depends_on=depends_on, idempotency_key=_optional_text(body, "idempotency_key"),
        submitted_by=_actor(), **kwargs)
    response = jsonify(job)
    response.status_code = 201 if job["is_new"] else 200
    response.headers["Location"] = url_for("api.get_job", job_id=job["id"])
    return response


@bp.get("/jobs/<int:job_id>")
def get_job(job_id: int):
    """One job with its attempts, its resolution (a lost deployment an operator decided) and
    its own audit trail."""
    query_values("getJob", request.args)
    return jsonify(reads.show_job(get_conn(), job_id=check_job_id(job_id)))


@bp.get("/jobs/<int:job_id>/explain")
def explain_job(job_id: int):
    """Why the job is not running, as reason codes with messages."""
    query_values("explainJob", request.args)
    return jsonify(explain.explain_job(get_conn(), job_id=check_job_id(job_id),
                                       live_seconds=current_app.config["RUNNER_LIVE_SECONDS"]))


def _job_action(job_id: int, transition, operation_id: str):
    body = _body(operation_id)
    return jsonify(transition(get_conn(), job_id=check_job_id(job_id), actor=_actor(),
                              reason=_optional_text(body, "reason")))


@bp.post("/jobs/<int:job_id>/cancel")
def cancel_job(job_id: int):
    """Cancel a waiting job, or ask a running job's runner to stop it."""
    return _job_action(job_id, transitions.cancel_job, "cancelJob")


@bp.post("/jobs/<int:job_id>/approve")
def approve_job(job_id: int):
    """Approve a job that requires approval."""
    return _job_action(job_id, transitions.approve_job, "approveJob")


@bp.post("/jobs/<int:job_id>/retry")
def retry_job(job_id: int):
    """Queue a failed or cancelled job again."""
    return _job_action(job_id, transitions.retry_job, "retryJob")


@bp.post("/jobs/<int:job_id>/priority")
def set_job_priority(job_id: int):
    """Set the priority of a waiting job."""
    body = _body("setJobPriority")
    return jsonify(transitions.set_priority(get_conn(), job_id=check_job_id(job_id),
                                            priority=_whole(body["priority"]), actor=_actor(),
                                            reason=_optional_text(body, "reason")))


# the API's filter names (listJobs' query parameters) and the bulk action's (sql/bulk.py)
_BULK_FILTER_NAMES = {"runner": "runner_id", "older_than": "older_than_seconds",
                      "younger_than": "younger_than_seconds"}


@bp.post("/jobs/bulk")
def bulk_jobs():
    """Preview (dry_run) or apply a bulk cancel / retry / approve / reprioritize: by filter
    (previewed and applied in one request), or to exactly the job_ids of an earlier preview
    (ids, or its jobs with the generation each had). A name that does not exist is 404."""
    body = _body("bulkJobs")
    filters = {_BULK_FILTER_NAMES.get(k, k): _whole(v) for k, v in body.get("filter", {}).items()}
    priority = _whole(body.get("priority"))
    reason = _optional_text(body, "reason")
    conn = get_conn()
    live = current_app.config["RUNNER_LIVE_SECONDS"]
    items = body.get("job_ids")
    try:
        if items is None:
            run = bulk.run_bulk(conn, action=body["action"], filters=filters, priority=priority,
                                reason=reason, actor=_actor(), dry_run=body["dry_run"],
                                live_seconds=live)
            preview, result = run["preview"], run["result"]
        else:
            ids = [_whole(i["id"] if isinstance(i, dict) else i) for i in items]
            generations = [_whole(i["generation"]) if isinstance(i, dict) else None for i in items]
            if body["dry_run"]:
                preview = bulk.preview_bulk(conn, action=body["action"], filters=filters,
                                            priority=priority, job_ids=ids, live_seconds=live)
                result = None
            else:
                preview = None
                result = bulk.apply_bulk(conn, action=body["action"], job_ids=ids,
                                         generations=generations, filters=filters,
                                         priority=priority, reason=reason, actor=_actor())
    except UnknownFilter as exc:
        raise NotFound(str(exc)) from None
    if preview is not None:
        preview = {k: v for k, v in preview.items() if k != "now"}
    return jsonify({"dry_run": body["dry_run"], "action": body["action"], "preview": preview,
                    "result": result})


@bp.post("/projects/<name>/pause")
def pause_project(name: str):
    """Pause a project (reason required)."""
    body = _body("pauseProject")
    return jsonify(transitions.pause_project(get_conn(), project=name, actor=_actor(),
                                             reason=_optional_text(body, "reason")))


@bp.post("/projects/<name>/resume")
def resume_project(name: str):
    """Resume a paused project."""
    body = _body("resumeProject")
    return jsonify(transitions.resume_project(get_conn(), project=name, actor=_actor(),
                                              reason=_optional_text(body, "reason")))


@bp.post("/pools/<name>/pause")
def pause_pool(name: str):
    """Pause a pool (reason required): no claim takes from it."""
    body = _body("pausePool")
    return jsonify(transitions.pause_pool(get_conn(), pool=name, actor=_actor(),
                                          reason=_optional_text(body, "reason")))


@bp.post("/pools/<name>/resume")
def resume_pool(name: str):
    """Resume a paused pool."""
    body = _body("resumePool")
    return jsonify(transitions.resume_pool(get_conn(), pool=name, actor=_actor(),
                                           reason=_optional_text(body, "reason")))


def _check_runner_id(runner_id: int) -> int:
    """404 for ids no bigint can hold (the URL converter accepts any digits)."""
    if not 1 <= runner_id <= MAX_BIGINT:
        raise NotFound(f"unknown runner {str(runner_id)[:40]}")
    return runner_id


@bp.post("/runners/<int:runner_id>/drain")
def drain_runner(runner_id: int):
    """Drain a runner (reason required, deadline_seconds optional)."""
    body = _body("drainRunner")
    return jsonify(transitions.drain_runner(get_conn(), runner_id=_check_runner_id(runner_id),
                                            actor=_actor(), reason=_optional_text(body, "reason"),
                                            deadline_seconds=_whole(body.get("deadline_seconds"))))


@bp.post("/runners/<int:runner_id>/resume")
def resume_runner(runner_id: int):
    """Resume a drained runner."""
    body = _body("resumeRunner")
    return jsonify(transitions.resume_runner(get_conn(), runner_id=_check_runner_id(runner_id),
                                             actor=_actor(), reason=_optional_text(body, "reason")))


@bp.post("/targets/<name>/resolve")
def resolve_target(name: str):
    """Resolve an uncertain target: succeeded, failed or retry, with a note."""
    body = _body("resolveTarget")
    return jsonify(transitions.resolve_target(get_conn(), target=name,
                                              outcome=_optional_text(body, "outcome"),
                                              note=_optional_text(body, "note"), actor=_actor()))


# --- looking: lists and shows (the read token's role is enough) --------------------------

def _next_url(endpoint: str, query: dict[str, Any], following: dict[str, int] | None) -> str | None:
    """The URL of the next page: the same query with the cursor ``following`` gives."""
    if not following:
        return None
    kept = {k: v for k, v in query.items() if k not in ("before_id", "after_id")}
    return url_for(endpoint, **kept, **following)


@bp.get("/jobs")
def list_jobs():
    """Jobs, filtered, keyset-paged by job id (reads.list_jobs: with older_than in creation
    order); a name or runner that does not exist is 404, as in a path."""
    query = query_values("listJobs", request.args)
    try:
        page = reads.list_jobs(
            get_conn(), state=query.get("state"), organization=query.get("organization"),
            project=query.get("project"), pool=query.get("pool"), target=query.get("target"),
            runner_id=query.get("runner"), reason=query.get("reason"),
            older_than_seconds=query.get("older_than"), younger_than_seconds=query.get("younger_than"),
            before_id=query.get("before_id"), after_id=query.get("after_id"),
            limit=query.get("limit", 50), live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])
    except UnknownFilter as exc:
        raise NotFound(str(exc)) from None
    return jsonify({"jobs": page["jobs"], "order": page["order"], "next": page["next"],
                    "next_url": _next_url("api.list_jobs", query, page["next"])})


@bp.get("/jobs/search")
def search_jobs():
    """Jobs found by command text, project, submitter, state or id (reads.search_jobs),
    newest first, keyset-paged by id; a project that does not exist is 404."""
    query = query_values("searchJobs", request.args)
    if "q" not in query:
        raise InvalidInput("query parameter q is required: 3 characters or more of a command, "
                           "or a job id (#N)")
    try:
        page = reads.search_jobs(
            get_conn(), q=query["q"], project=query.get("project"),
            submitter=query.get("submitter"), state=query.get("state"),
            before_id=query.get("before_id"), limit=query.get("limit", 50))
    except UnknownFilter as exc:
        raise NotFound(str(exc)) from None
    return jsonify({**{k: page[k] for k in ("query", "job_id", "jobs", "order", "next")},
                    "next_url": _next_url("api.search_jobs", query, page["next"])})


@bp.get("/overview")
def overview():
    """What the console's overview says (reads.overview_report): waiting jobs by every reason
    and by primary, the oldest waiting per pool and primary reason, capacity, uncertain
    targets, paused projects."""
    query_values("getOverview", request.args)
    return jsonify(reads.overview_report(get_conn(),
                                         live_seconds=current_app.config["RUNNER_LIVE_SECONDS"]))


@bp.get("/projects")
def list_projects():
    """Every project with its organization, limits, running count, pause and pools."""
    query_values("listProjects", request.args)
    return jsonify({"projects": reads.list_projects(get_conn())})


@bp.get("/projects/<name>")
def get_project(name: str):
    """One project with the jobs running for it and its last audit events."""
    query_values("getProject", request.args)
    return jsonify(reads.show_project(get_conn(), name=name))


@bp.get("/pools")
def list_pools():
    """Every pool: pool slots held, and the runner slots of its live runners."""
    query_values("listPools", request.args)
    return jsonify({"pools": reads.list_pools(get_conn(),
                                              live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])})


@bp.get("/pools/<name>")
def get_pool(name: str):
    """One pool with its live runners and the jobs running on it."""
    query_values("getPool", request.args)
    return jsonify(reads.show_pool(get_conn(), name=name,
                                   live_seconds=current_app.config["RUNNER_LIVE_SECONDS"]))


@bp.get("/targets")
def list_targets():
    """Every target, uncertain first, with its holder."""
    query_values("listTargets", request.args)
    return jsonify({"targets": reads.list_targets(get_conn())})


@bp.get("/targets/<name>")
def get_target(name: str):
    """One target with the evidence of its last attempt and its last audit events."""
    query_values("getTarget", request.args)
    return jsonify(reads.show_target(get_conn(), name=name))


@bp.get("/runners")
def list_runners():
    """Runners seen or stopped within the hour (stop_reason: stopped or lost)."""
    query_values("listRunners", request.args)
    return jsonify({"runners": reads.list_runners(
        get_conn(), live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])})


@bp.get("/runners/<int:runner_id>")
def get_runner(runner_id: int):
    """One runner of any age with the jobs it runs now."""
    query_values("getRunner", request.args)
    return jsonify(reads.show_runner(get_conn(), runner_id=runner_id,
                                     live_seconds=current_app.config["RUNNER_LIVE_SECONDS"]))


@bp.get("/audit")
def list_audit_events():
    """Audit events, newest first, filtered by actor, action, subject prefix and job (its own
    trail); a job that does not exist is 404."""
    query = query_values("listAuditEvents", request.args)
    limit = query.get("limit", 50)
    conn = get_conn()
    job_id = query.get("job")
    if job_id is not None and not audit.job_exists(conn, job_id=job_id):
        raise NotFound(f"unknown job {job_id}")
    events = audit.list_audit_events(conn, before_id=query.get("before_id", 2**63 - 1),
                                     limit=limit, actor=query.get("actor"),
                                     action=query.get("action"), subject=query.get("subject"),
                                     job_id=job_id)
    following = {"before_id": events[-1]["id"]} if len(events) == limit else None
    return jsonify({"events": events, "next": following,
                    "next_url": _next_url("api.list_audit_events", query, following)})
