"""The hand-written OpenAPI 3.1 description of /api/v1 (tests check it matches the routes)."""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema_rs

from pgdispatch.sql.explain import REASON_CODES

_ERROR = {"$ref": "#/components/responses/Error"}
_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(schema: dict[str, Any], *, required: bool) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(code): _UNAVAILABLE if code == 503 else _ERROR for code in codes}


_UNAVAILABLE = {"$ref": "#/components/responses/Unavailable"}
# What any request may meet before its operation runs: a request line or headers past the
# server's bounds (webapp/limits.py, and gunicorn's own in webapp/serve.py), a database
# that cannot answer now.
_EVERY = (414, 431, 503)
# Every operation that reads: no token or a bad one; a job that does not exist.
_READ = (401, 404, *_EVERY)
# Every operation that acts, besides its own 409: a body that cannot be read (400), a
# viewer's token or a refusal by the database (403), a body past 1 MiB (413), not JSON
# (415), refused by this document's schema or the transition's checks (422).
_WRITE = (400, 401, 403, 404, 413, 415, 422, *_EVERY)


_JOB_ID = {"name": "job_id", "in": "path", "required": True,
           "schema": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}}
# The names the schema's CHECK constraints accept (organizations, projects, pools, targets).
_NAME_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"}
_NAME = {"name": "name", "in": "path", "required": True, "schema": _NAME_SCHEMA}
# Text the server accepts: no NUL byte (PostgreSQL text cannot hold one).
_NO_NUL = "^[^\\u0000]*$"
# Operator text that must say something: not blank, no NUL. "Blank" is Python's str.isspace,
# which the server applies; it differs from a pattern's \s (ECMA 262) in U+001C–U+001F, U+0085
# and U+FEFF, so the class is spelled out and both regex engines agree.
_SPACE_CLASS = "\\u0000\\t\\n\\u000b\\u000c\\r\\u001c-\\u001f \\u0085\\u00a0\\u1680\\u2000-\\u200a" \
               "\\u2028\\u2029\\u202f\\u205f\\u3000"
_SAYS_SOMETHING = f"^[^\\u0000]*[^{_SPACE_CLASS}][^\\u0000]*$"
_REASON_BODY = {"type": "object", "additionalProperties": False,
                "properties": {"reason": {"type": ["string", "null"], "maxLength": 1000,
                                          "pattern": _NO_NUL}}}


def _job_action(summary: str, conflict: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "operationId": summary.split()[0].lower() + "Job",
        "parameters": [_JOB_ID],
        "requestBody": _body(_REASON_BODY, required=False),
        "responses": {"200": _json({"$ref": "#/components/schemas/ActionResult"}, "done"),
                      **_errors(*_WRITE),
                      "409": {"description": conflict, "content": _ERROR_CONTENT}},
    }}


SPEC: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "pgdispatch API",
        "version": "1",
        "description": "Submit, inspect and steer build and deployment jobs. Every action is "
                       "audited with the token's user as the actor. Errors are "
                       "`{\"error\": \"one line\"}` with a 4xx status; nothing is changed then.",
    },
    "servers": [{"url": "/api/v1"}],
    "security": [{"bearer": []}],
    "paths": {
        "/openapi.json": {"get": {
            "summary": "This document", "operationId": "getOpenapi", "security": [],
            "responses": {"200": _json({"type": "object"}, "the OpenAPI document"),
                          **_errors(414, 431)},
        }},
        "/jobs": {"post": {
            "summary": "Submit a job", "operationId": "submitJob",
            "requestBody": _body({"$ref": "#/components/schemas/JobSubmission"}, required=True),
            "responses": {
                "201": _json({"$ref": "#/components/schemas/Job"}, "the new job"),
                "200": _json({"$ref": "#/components/schemas/Job"},
                             "the job submitted earlier by the same request with the "
                             "same idempotency key (a different request with the key: 409)"),
                **_errors(*_WRITE, 409),
            },
        }},
        "/jobs/{job_id}": {"get": {
            "summary": "Show a job with its attempts", "operationId": "getJob",
            "parameters": [_JOB_ID],
            "responses": {"200": _json({"$ref": "#/components/schemas/JobWithAttempts"}, "the job"),
                          **_errors(*_READ)},
        }},
        "/jobs/{job_id}/explain": {"get": {
            "summary": "Why the job is not running", "operationId": "explainJob",
            "parameters": [_JOB_ID],
            "responses": {"200": _json({"$ref": "#/components/schemas/Explanation"}, "the reasons"),
                          **_errors(*_READ)},
        }},
        "/jobs/{job_id}/cancel": _job_action(
            "Cancel a waiting job, or ask the runner of a running one to stop it",
            "the job has ended or a cancel was already asked"),
        "/jobs/{job_id}/approve": _job_action(
            "Approve a job that requires approval", "already approved, or no approval needed"),
        "/jobs/{job_id}/retry": _job_action(
            "Retry a failed or cancelled job", "the job is not failed or cancelled"),
        "/projects/{name}/pause": {"post": {
            "summary": "Pause a project", "operationId": "pauseProject",
            "parameters": [_NAME],
            "requestBody": _body({"type": "object", "additionalProperties": False,
                                  "required": ["reason"],
                                  "properties": {"reason": {"type": "string", "maxLength": 1000,
                                                            "pattern": _SAYS_SOMETHING}}},
                                 required=True),
            "responses": {"200": _json({"$ref": "#/components/schemas/ActionResult"}, "paused"),
                          **_errors(*_WRITE),
                          "409": {"description": "already paused (says by whom)",
                                  "content": _ERROR_CONTENT}},
        }},
        "/projects/{name}/resume": {"post": {
            "summary": "Resume a paused project", "operationId": "resumeProject",
            "parameters": [_NAME],
            "requestBody": _body(_REASON_BODY, required=False),
            "responses": {"200": _json({"$ref": "#/components/schemas/ActionResult"}, "resumed"),
                          **_errors(*_WRITE),
                          "409": {"description": "not paused", "content": _ERROR_CONTENT}},
        }},
        "/targets/{name}/resolve": {"post": {
            "summary": "Resolve an uncertain target", "operationId": "resolveTarget",
            "parameters": [_NAME],
            "requestBody": _body({"type": "object", "additionalProperties": False,
                                  "required": ["outcome", "note"],
                                  "properties": {
                                      "outcome": {"enum": ["succeeded", "failed", "retry"]},
                                      "note": {"type": "string", "maxLength": 1000,
                                               "pattern": _SAYS_SOMETHING}}},
                                 required=True),
            "responses": {"200": _json({"$ref": "#/components/schemas/ActionResult"}, "resolved"),
                          **_errors(*_WRITE),
                          "409": {"description": "already resolved (says by whom and when)",
                                  "content": _ERROR_CONTENT}},
        }},
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                       "description": "a token from `pgdispatch.sql.accounts.create_api_token`"}},
        "responses": {"Error": {"description": "refused; nothing was changed",
                                "content": _ERROR_CONTENT},
                      "Unavailable": {"description": "the database could not answer now: "
                                                     "try again later (a submission with its "
                                                     "idempotency key)",
                                      "content": _ERROR_CONTENT}},
        "schemas": {
            "Error": {"type": "object", "required": ["error"],
                      "properties": {"error": {"type": "string"}}},
            "JobSubmission": {
                "type": "object", "additionalProperties": False,
                "required": ["project", "pool", "command"],
                "properties": {
                    "project": _NAME_SCHEMA,
                    "pool": _NAME_SCHEMA,
                    "command": {"type": "array", "minItems": 1, "maxItems": 256,
                                "description": "program and arguments, 64 KiB in all",
                                "prefixItems": [{"type": "string", "maxLength": 16384,
                                                 "pattern": _SAYS_SOMETHING}],
                                "items": {"type": "string", "maxLength": 16384,
                                          "pattern": _NO_NUL}},
                    "target": {"oneOf": [_NAME_SCHEMA, {"type": "null"}]},
                    "priority": {"type": "integer", "minimum": -1000, "maximum": 1000, "default": 0},
                    "max_attempts": {"type": "integer", "minimum": 1, "maximum": 100, "default": 1},
                    "timeout_seconds": {"type": "integer", "minimum": 1, "maximum": 604800,
                                        "default": 3600},
                    "delay_seconds": {"type": "number", "minimum": 0, "maximum": 2592000,
                                      "default": 0},
                    "requires_approval": {"type": "boolean", "default": False},
                    "depends_on": {"type": "array", "maxItems": 1000,
                                   "items": {"type": "integer", "minimum": 1,
                                             "maximum": 2**63 - 1}},
                    "idempotency_key": {"type": ["string", "null"], "minLength": 1,
                                        "maxLength": 200, "pattern": _NO_NUL},
                },
            },
            "Job": {
                "type": "object",
                "required": ["id", "state", "project", "pool", "command"],
                "properties": {
                    "id": {"type": "integer"},
                    "state": {"enum": ["blocked", "queued", "running", "succeeded", "failed",
                                       "cancelled", "uncertain"]},
                    "project": {"type": "string"}, "organization": {"type": "string"},
                    "pool": {"type": "string"}, "target": {"type": ["string", "null"]},
                    "command": {"type": "array", "items": {"type": "string"}},
                    "priority": {"type": "integer"}, "max_attempts": {"type": "integer"},
                    "generation": {"type": "integer"},
                    "ready_at": {"type": "string", "format": "date-time"},
                    "created_at": {"type": "string", "format": "date-time"},
                    "finished_at": {"type": ["string", "null"], "format": "date-time"},
                    "depends_on": {"type": "array", "items": {"type": "integer"}},
                    "is_new": {"type": "boolean"},
                },
            },
            "JobWithAttempts": {"allOf": [
                {"$ref": "#/components/schemas/Job"},
                {"type": "object", "properties": {"attempts": {
                    "type": "array", "items": {"$ref": "#/components/schemas/Attempt"}}}},
            ]},
            "Attempt": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"}, "attempt_no": {"type": "integer"},
                    "generation": {"type": "integer"}, "runner_name": {"type": "string"},
                    "state": {"enum": ["running", "succeeded", "failed", "expired", "cancelled",
                                       "lost"]},
                    "claimed_at": {"type": "string", "format": "date-time"},
                    "lease_expires_at": {"type": "string", "format": "date-time"},
                    "finished_at": {"type": ["string", "null"], "format": "date-time"},
                    "exit_code": {"type": ["integer", "null"]},
                    "output_tail": {"type": ["string", "null"]},
                },
            },
            "Explanation": {
                "type": "object", "required": ["job_id", "state", "reason", "reasons"],
                "properties": {
                    "job_id": {"type": "integer"},
                    "state": {"type": "string"},
                    "reason": {"oneOf": [{"enum": list(REASON_CODES)}, {"type": "null"}]},
                    "reasons": {"type": "array", "items": {
                        "type": "object", "required": ["code", "message"],
                        "properties": {"code": {"enum": list(REASON_CODES)},
                                       "message": {"type": "string"},
                                       "details": {"type": "object"}}}},
                },
            },
            "ActionResult": {"type": "object",
                             "description": "what changed, e.g. {\"job_id\": 7, \"state\": \"cancelled\"}"},
        },
    },
}


# --- the document as the check of request bodies (webapp/api.py's _body) ------------------

_NAME_RULE = "1 to 63 of letters, digits, '_', '.', '-', starting with a letter or digit"
_KINDS = {"integer": "a whole number", "number": "a number", "string": "text",
          "boolean": "true or false", "array": "a list", "object": "an object", "null": "null"}
# The error reported when a body has several: structure first, then types, then values.
_RANK = {"AdditionalProperties": 0, "Required": 1, "Type": 2, "OneOfNotValid": 3}


def _operations() -> dict[str, dict[str, Any]]:
    return {op["operationId"]: op for ops in SPEC["paths"].values() for op in ops.values()}


@functools.cache
def _validator(operation_id: str):
    body = _operations()[operation_id].get("requestBody")
    if body is None:
        return None
    schema = body["content"]["application/json"]["schema"]
    # the components travel with the schema, for its "#/components/..." references
    root = {**schema, "components": SPEC["components"]}
    return jsonschema_rs.Draft202012Validator(root), root


def _field(path: list) -> str:
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "the request body"


def _shown(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 42 else text[:40] + "…"


def _message(error, root: dict[str, Any]) -> str:
    kind, field, value = type(error.kind).__name__, _field(list(error.instance_path)), error.instance
    limit = getattr(error.kind, "limit", None)
    if kind == "AdditionalProperties":
        return f"unknown field {sorted(error.kind.unexpected)[0]!r}"
    if kind == "Required":
        return f"missing field {error.kind.property!r}"
    if kind == "Type":
        wanted = " or ".join(_KINDS.get(t, t) for t in sorted(error.kind.types, key=lambda t: t == "null"))
        return f"{field} must be {wanted}, got {_shown(value)}"
    if kind == "OneOfNotValid":
        return f"{field} must be a name ({_NAME_RULE}) or null, got {_shown(value)}"
    if kind in ("Minimum", "Maximum"):
        rule = functools.reduce(lambda node, key: node[key], list(error.schema_path)[:-1], root)
        return f"{field} must be between {rule['minimum']} and {rule['maximum']}, got {_shown(value)}"
    if kind == "MinItems":
        return f"{field} must not be empty" if limit == 1 else f"{field} needs at least {limit} items"
    if kind == "MaxItems":
        return f"{field} has more than {limit} items"
    if kind == "MinLength":
        return f"{field} must not be empty"
    if kind == "MaxLength":
        return f"{field} is longer than {limit} characters"
    if kind == "Enum":
        return f"{field} must be one of {', '.join(map(str, error.kind.options))}, got {_shown(value)}"
    if kind == "Pattern":
        if "\x00" in value:
            return f"{field} must not contain NUL bytes"
        if error.kind.pattern == _NAME_SCHEMA["pattern"]:
            return f"{field} {_shown(value)} is not a name: {_NAME_RULE}"
        return f"{field} must not be blank"
    return f"{field}: {error.message}"


def body_error(operation_id: str, body: Any) -> str | None:
    """What the document refuses in ``body`` as the request body of ``operation_id``, as
    one line naming the field (None: it conforms). ``body`` is parsed JSON whose strings
    encode to UTF-8 (webapp/api.py checks both first)."""
    checked = _validator(operation_id)
    if checked is None:
        return None
    validator, root = checked
    errors = list(validator.iter_errors(body))
    if not errors:
        return None
    return _message(min(errors, key=lambda e: _RANK.get(type(e.kind).__name__, 9)), root)
