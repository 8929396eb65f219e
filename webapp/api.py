"""The JSON API under /api/v1/: bearer tokens, JSON in and out, errors as ``{"error": ...}``.

Authenticated by ``Authorization: Bearer <token>`` only (never the console's session cookie),
which is why it is exempt from CSRF. Viewer tokens may only read. Every action goes through
the same transition as the console and the CLI, audited with the token owner as the actor;
a new job's submission is audited too (``submit_job``).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, abort, current_app, g, jsonify, request, url_for

from pgdispatch.sql import InvalidInput, accounts, explain, reads, transitions

from .auth import ROLE_RANK
from .db import get_conn
from .openapi import SPEC
from .views import check_job_id

bp = Blueprint("api", __name__, url_prefix="/api/v1")
READ_METHODS = ("GET", "HEAD", "OPTIONS")
SUBMIT_FIELDS = {"project", "pool", "command", "target", "priority", "max_attempts",
                 "timeout_seconds", "delay_seconds", "requires_approval", "depends_on",
                 "idempotency_key"}
SUBMIT_REQUIRED = ("project", "pool", "command")
PUBLIC = {"api.openapi"}


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


def _body(allowed: set[str], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON object in the request body (empty allowed when nothing is required)."""
    if not request.get_data(cache=True) and not required:
        return {}
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object (Content-Type: application/json)")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidInput(f"unknown field {unknown[0]!r}")
    missing = [name for name in required if body.get(name) is None]
    if missing:
        raise InvalidInput(f"missing field {missing[0]!r}")
    return body


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
    body = _body(SUBMIT_FIELDS, SUBMIT_REQUIRED)
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
    """One job with its attempts."""
    return jsonify(reads.show_job(get_conn(), job_id=check_job_id(job_id)))


@bp.get("/jobs/<int:job_id>/explain")
def explain_job(job_id: int):
    """Why the job is not running, as reason codes with messages."""
    return jsonify(explain.explain_job(get_conn(), job_id=check_job_id(job_id),
                                       live_seconds=current_app.config["RUNNER_LIVE_SECONDS"]))


def _job_action(job_id: int, transition):
    body = _body({"reason"})
    return jsonify(transition(get_conn(), job_id=check_job_id(job_id), actor=_actor(),
                              reason=_optional_text(body, "reason")))


@bp.post("/jobs/<int:job_id>/cancel")
def cancel_job(job_id: int):
    """Cancel a waiting job, or ask a running job's runner to stop it."""
    return _job_action(job_id, transitions.cancel_job)


@bp.post("/jobs/<int:job_id>/approve")
def approve_job(job_id: int):
    """Approve a job that requires approval."""
    return _job_action(job_id, transitions.approve_job)


@bp.post("/jobs/<int:job_id>/retry")
def retry_job(job_id: int):
    """Queue a failed or cancelled job again."""
    return _job_action(job_id, transitions.retry_job)


@bp.post("/projects/<name>/pause")
def pause_project(name: str):
    """Pause a project (reason required)."""
    body = _body({"reason"}, ("reason",))
    return jsonify(transitions.pause_project(get_conn(), project=name, actor=_actor(),
                                             reason=_optional_text(body, "reason")))


@bp.post("/projects/<name>/resume")
def resume_project(name: str):
    """Resume a paused project."""
    body = _body({"reason"})
    return jsonify(transitions.resume_project(get_conn(), project=name, actor=_actor(),
                                              reason=_optional_text(body, "reason")))


@bp.post("/targets/<name>/resolve")
def resolve_target(name: str):
    """Resolve an uncertain target: succeeded, failed or retry, with a note."""
    body = _body({"outcome", "note"}, ("outcome", "note"))
    return jsonify(transitions.resolve_target(get_conn(), target=name,
                                              outcome=_optional_text(body, "outcome"),
                                              note=_optional_text(body, "note"), actor=_actor()))
