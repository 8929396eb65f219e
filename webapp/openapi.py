"""The hand-written OpenAPI 3.1 description of /api/v1 (tests check it matches the routes)."""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

import jsonschema_rs

from pgdispatch.sql import InvalidInput

from pgdispatch.sql.explain import REASON_CODES
from pgdispatch.sql.reads import MAX_AGE_SECONDS
from pgdispatch.sql.validate import JOB_STATES

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
# Every operation that reads: no token or a bad one; a job that does not exist; a query
# parameter it does not take (422: a misspelt filter is refused, never ignored).
_READ = (401, 404, 422, *_EVERY)
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


_BIGINT = {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}
_SECONDS = {"type": "number", "minimum": 0, "maximum": MAX_AGE_SECONDS}
_PRIORITY = {"type": "integer", "minimum": -1000, "maximum": 1000}


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema,
            "description": description}


_LIMIT = _query("limit", {"type": "integer", "minimum": 1, "maximum": 500, "default": 50},
                "at most this many (1 to 500)")
_BEFORE = _query("before_id", _BIGINT, "only ids below this, newest first (the `next` of the "
                                       "previous page)")
_JOB_FILTERS = [
    _query("state", {"enum": list(JOB_STATES)}, "only jobs in this state"),
    _query("organization", _NAME_SCHEMA, "only this organization's jobs (404: no such organization)"),
    _query("project", _NAME_SCHEMA, "only this project's jobs (404: no such project)"),
    _query("pool", _NAME_SCHEMA, "only jobs for this pool (404: no such pool)"),
    _query("target", _NAME_SCHEMA, "only deployments to this target (404: no such target)"),
    _query("runner", _BIGINT, "only jobs whose latest attempt ran on this runner id (with "
                              "state=running: the jobs it runs now; 404: no such runner)"),
    _query("reason", {"enum": list(REASON_CODES)},
           "only waiting jobs with this reason (any of their reasons); the list is then the "
           "queue's, oldest first, paged with after_id"),
    _query("older_than", _SECONDS, "only jobs created at least this many seconds ago; the "
                                   "list is then in creation order (newest created first, "
                                   "oldest first with after_id), before_id and after_id at "
                                   "their jobs' places in it"),
    _query("younger_than", _SECONDS, "only jobs created less than this many seconds ago"),
    _LIMIT, _BEFORE,
    _query("after_id", {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
           "only ids above this, oldest first (0: from the first job)"),
]
_AUDIT_FILTERS = [
    _query("actor", {"type": "string", "minLength": 1, "maxLength": 200, "pattern": _NO_NUL},
           "only this actor's events"),
    _query("action", {"type": "string", "minLength": 1, "maxLength": 200, "pattern": _NO_NUL},
           "only this action (pause_project, resolve_target…)"),
    _query("subject", {"type": "string", "minLength": 1, "maxLength": 200, "pattern": _NO_NUL},
           "only subjects starting with this (project:web, job:42, target:…)"),
    _query("job", _BIGINT, "only this job's own trail: every action on it and the target "
                           "resolutions that decided it (404: no such job)"),
    _LIMIT, _BEFORE,
]
# The job search (reads.search_jobs). The document accepts a part of what the server would:
# a job id as #N (N of at most 18 digits), digits (the job with that id, then the commands
# that contain them), or 3 to 200 characters of a command, no control character, not
# starting with "#" and neither starting nor ending with a blank (the server strips blanks;
# text shorter than 3 characters, which trigrams cannot serve, is refused with 422).
_CONTROL = "\\u0000-\\u001f\\u007f"
_SEARCH_TEXT = {"type": "string", "maxLength": 200, "anyOf": [
    {"pattern": "^#[1-9][0-9]{0,17}$"},
    {"pattern": "^[0-9]{1,200}$"},
    {"pattern": f"^[^#{_CONTROL}{_SPACE_CLASS}][^{_CONTROL}]+[^{_CONTROL}{_SPACE_CLASS}]$"}]}
_SEARCH_PARAMETERS = [
    {"name": "q", "in": "query", "required": True, "schema": _SEARCH_TEXT,
     "description": "#N: job N only; digits: job N first, then the jobs whose command contains "
                    "them; other text: the jobs whose command (its words joined by spaces) "
                    "contains it, any case (% and _ are literal); 422 when shorter than 3 "
                    "characters"},
    _query("project", _NAME_SCHEMA, "only this project's jobs (404: no such project)"),
    _query("submitter", {"type": "string", "minLength": 1, "maxLength": 200,
                         "pattern": f"^[^{_CONTROL}]*$"},
           "only jobs submitted by this user or login (exactly)"),
    _query("state", {"enum": list(JOB_STATES)}, "only jobs in this state"),
    _LIMIT, _BEFORE,
]
# A list refuses what its document refuses (422), and a name that does not exist (404).
_LIST = (401, 404, 422, *_EVERY)


def _get(summary: str, operation_id: str, schema: str, *, parameters: list | None = None,
         errors: tuple[int, ...] = _READ) -> dict[str, Any]:
    return {"get": {"summary": summary, "operationId": operation_id,
                    "parameters": parameters or [],
                    "responses": {"200": _json({"$ref": f"#/components/schemas/{schema}"}, summary.lower()),
                                  **_errors(*errors)}}}


_RUNNER_ID = {"name": "runner_id", "in": "path", "required": True, "schema": _BIGINT}
_NULLABLE_TIME = {"type": ["string", "null"], "format": "date-time"}
_LIST_PATHS: dict[str, Any] = {
    "/projects": _get("Every project", "listProjects", "ProjectList", errors=(401, 422, *_EVERY)),
    "/projects/{name}": _get("One project, with the jobs running for it and its last audit "
                             "events", "getProject", "ProjectDetail", parameters=[_NAME]),
    "/pools": _get("Every pool, with pool slots and runner slots", "listPools", "PoolList",
                   errors=(401, 422, *_EVERY)),
    "/pools/{name}": _get("One pool, with its live runners and the jobs running on it",
                          "getPool", "PoolDetail", parameters=[_NAME]),
    "/targets": _get("Every target, uncertain first", "listTargets", "TargetList",
                     errors=(401, 422, *_EVERY)),
    "/targets/{name}": _get("One target: what runs next in its deployment order (each with "
                            "its reason), what was superseded on it and by what, its last "
                            "audit events", "getTarget",
                            "TargetDetail", parameters=[_NAME]),
    "/runners": _get("Runners seen or stopped within the hour", "listRunners", "RunnerList",
                     errors=(401, 422, *_EVERY)),
    "/runners/{runner_id}": _get("One runner of any age, with the jobs it runs now",
                                 "getRunner", "RunnerDetail", parameters=[_RUNNER_ID]),
    "/audit": _get("Audit events, newest first", "listAuditEvents", "AuditList",
                   parameters=_AUDIT_FILTERS, errors=_LIST),
    "/jobs/search": _get("Find jobs by command text, project, submitter, state or id, newest "
                         "first, keyset-paged by id", "searchJobs", "JobSearch",
                         parameters=_SEARCH_PARAMETERS, errors=_LIST),
    "/overview": _get("What the overview says: waiting jobs by every reason and by primary, "
                      "the oldest waiting per pool and primary reason, capacity, uncertain "
                      "targets, paused projects and pools", "getOverview", "Overview",
                      errors=(401, 422, *_EVERY)),
}
_LIST_SCHEMAS: dict[str, Any] = {
    "JobListItem": {
        "type": "object",
        "required": ["id", "state", "project", "organization", "pool", "command", "created_at",
                     "age_seconds"],
        "properties": {
            "id": {"type": "integer"}, "state": {"enum": list(JOB_STATES)},
            "project": {"type": "string"}, "organization": {"type": "string"},
            "pool": {"type": "string"}, "target": {"type": ["string", "null"]},
            "command": {"type": "array", "items": {"type": "string"}},
            "priority": {"type": "integer"},
            "created_at": {"type": "string", "format": "date-time"},
            "ready_at": {"type": "string", "format": "date-time"},
            "started_at": _NULLABLE_TIME, "finished_at": _NULLABLE_TIME, "claimed_at": _NULLABLE_TIME,
            "last_error": {"type": ["string", "null"]},
            "runner": {"type": ["string", "null"], "description": "the latest attempt's runner"},
            "runner_id": {"type": ["integer", "null"]}, "attempt_no": {"type": ["integer", "null"]},
            "age_seconds": {"type": "number", "description": "now minus created_at"},
            "running_seconds": {"type": ["number", "null"],
                                "description": "a running job: since its running attempt's claim"},
            "duration_seconds": {"type": ["number", "null"],
                                 "description": "a finished job: from its first claim to its end"},
            "reasons": {"type": "array", "description": "with reason=: why it waits",
                        "items": {"$ref": "#/components/schemas/Reason"}},
        },
    },
    "Reason": {"type": "object", "required": ["code", "message"],
               "properties": {"code": {"enum": list(REASON_CODES)}, "message": {"type": "string"},
                              "details": {"type": "object"}}},
    "Next": {"type": ["object", "null"],
             "description": "the query parameters of the next page (null: no more), e.g. "
                            "{\"before_id\": 812}; a window (after_id and before_id) keeps "
                            "its before_id",
             "properties": {"before_id": {"type": "integer"}, "after_id": {"type": "integer"}}},
    "JobList": {"type": "object", "required": ["jobs", "order", "next"],
                "properties": {
                    "jobs": {"type": "array", "items": {"$ref": "#/components/schemas/JobListItem"}},
                    "order": {"enum": ["newest_first", "oldest_first"]},
                    "next": {"$ref": "#/components/schemas/Next"},
                    "next_url": {"type": ["string", "null"]}}},
    "JobSearch": {"type": "object", "required": ["query", "job_id", "jobs", "order", "next"],
                  "properties": {
                      "query": {"type": "string", "description": "the text searched, stripped"},
                      "job_id": {"type": ["integer", "null"], "description": "the id asked for"},
                      "jobs": {"type": "array", "items": {"allOf": [
                          {"$ref": "#/components/schemas/JobListItem"},
                          {"type": "object", "required": ["match", "submitted_by"], "properties": {
                              "match": {"enum": ["id", "command"],
                                        "description": "the job asked for by id (first), or a "
                                                       "command that contains the text"},
                              "submitted_by": {"type": "string"}}}]}},
                      "order": {"enum": ["newest_first"]},
                      "next": {"$ref": "#/components/schemas/Next"},
                      "next_url": {"type": ["string", "null"]}}},
    "Project": {"type": "object", "required": ["name", "organization", "running", "pools"],
                "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                               "organization": {"type": "string"}, "running": {"type": "integer"},
                               "max_running": {"type": ["integer", "null"]},
                               "weight": {"type": "integer"}, "paused_at": _NULLABLE_TIME,
                               "pause_reason": {"type": ["string", "null"]},
                               "paused_by": {"type": ["string", "null"]},
                               "pools": {"type": "array", "items": {"type": "string"}}}},
    "ProjectList": {"type": "object", "required": ["projects"], "properties": {
        "projects": {"type": "array", "items": {"$ref": "#/components/schemas/Project"}}}},
    "ProjectDetail": {"allOf": [{"$ref": "#/components/schemas/Project"}, {
        "type": "object", "required": ["running_jobs", "audit"], "properties": {
            "running_jobs": {"type": "array", "items": {"$ref": "#/components/schemas/JobListItem"}},
            "audit": {"type": "array", "items": {"$ref": "#/components/schemas/AuditEvent"}}}}]},
    "Pool": {"type": "object",
             "required": ["name", "slots", "running", "runner_slots", "free_runner_slots"],
             "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                            "slots": {"type": "integer", "description": "pool slots: the pool's limit"},
                            "running": {"type": "integer", "description": "pool slots held"},
                            "runner_slots": {"type": "integer",
                                             "description": "slots of the live runners serving it"},
                            "free_runner_slots": {"type": "integer"},
                            "paused_at": _NULLABLE_TIME,
                            "paused_by": {"type": ["string", "null"]},
                            "pause_reason": {"type": ["string", "null"]}}},
    "PoolPause": {"type": "object", "required": ["pool", "paused_at"],
                  "properties": {"pool": {"type": "string"}, "paused_at": _NULLABLE_TIME,
                                 "paused_by": {"type": "string"},
                                 "pause_reason": {"type": "string"}}},
    "RunnerDrain": {"type": "object", "required": ["runner_id", "name", "drain_requested_at"],
                    "properties": {"runner_id": {"type": "integer"}, "name": {"type": "string"},
                                   "drain_requested_at": _NULLABLE_TIME,
                                   "drain_requested_by": {"type": "string"},
                                   "drain_reason": {"type": "string"},
                                   "drain_deadline": _NULLABLE_TIME}},
    "PoolList": {"type": "object", "required": ["pools"], "properties": {
        "pools": {"type": "array", "items": {"$ref": "#/components/schemas/Pool"}}}},
    "PoolDetail": {"allOf": [{"$ref": "#/components/schemas/Pool"}, {
        "type": "object", "required": ["runners", "running_jobs"], "properties": {
            "runners": {"type": "array", "items": {"$ref": "#/components/schemas/Runner"}},
            "running_jobs": {"type": "array", "items": {"$ref": "#/components/schemas/JobListItem"}}}}]},
    "Target": {"type": "object", "required": ["name", "state"],
               "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                              "state": {"enum": ["free", "held", "uncertain"]},
                              "holder_job_id": {"type": ["integer", "null"]},
                              "holder_project": {"type": ["string", "null"]},
                              "held_since": _NULLABLE_TIME,
                              "requires_approval": {"type": "boolean"},
                              "supersede": {"type": "boolean",
                                            "description": "a newer deployment supersedes every "
                                                           "older one still waiting, of any project"},
                              "supersede_projects": {
                                  "type": "array", "items": {"type": "string"},
                                  "description": "projects whose newer deployment supersedes their "
                                                 "own older ones still waiting"},
                              "deploy_order": {"enum": ["oldest_first", "newest_ready_first"]}}},
    "TargetList": {"type": "object", "required": ["targets"], "properties": {
        "targets": {"type": "array", "items": {"$ref": "#/components/schemas/Target"}}}},
    "TargetDetail": {"allOf": [{"$ref": "#/components/schemas/Target"}, {
        "type": "object", "required": ["audit", "next", "superseded"], "properties": {
            "next": {"$ref": "#/components/schemas/TargetNext"},
            "superseded": {"$ref": "#/components/schemas/TargetSuperseded"},
            "audit": {"type": "array", "items": {"$ref": "#/components/schemas/AuditEvent"}}}}]},
    "TargetNext": {
        "type": "object", "required": ["deploy_order", "head_job_id", "waiting", "jobs"],
        "description": "the deployments waiting for the target, what runs next first: the ready "
                       "ones in the target's order (the first is the head, claimed next), then "
                       "the others in the same order; at most 20",
        "properties": {
            "deploy_order": {"enum": ["oldest_first", "newest_ready_first"]},
            "head_job_id": {"type": ["integer", "null"],
                            "description": "the ready deployment a claim takes next; null: none ready"},
            "waiting": {"type": "integer", "description": "deployments waiting in all"},
            "jobs": {"type": "array", "items": {
                "type": "object",
                "required": ["job_id", "project", "pool", "state", "priority", "is_head", "is_ready",
                             "reason", "message", "reasons"],
                "properties": {
                    "job_id": {"type": "integer"}, "project": {"type": "string"},
                    "pool": {"type": "string"}, "state": {"enum": ["queued", "blocked"]},
                    "priority": {"type": "integer"},
                    "created_at": {"type": "string", "format": "date-time"},
                    "ready_at": {"type": "string", "format": "date-time"},
                    "is_head": {"type": "boolean"}, "is_ready": {"type": "boolean"},
                    "reason": {"enum": list(REASON_CODES)}, "message": {"type": "string"},
                    "reasons": {"type": "array", "items": {"$ref": "#/components/schemas/Reason"}}}}}}},
    "TargetSuperseded": {
        "type": "object", "required": ["total", "last_hour", "latest"],
        "properties": {
            "total": {"type": "integer"}, "last_hour": {"type": "integer"},
            "latest": {"type": "array", "description": "newest first, at most 10", "items": {
                "type": "object", "required": ["job_id", "project", "superseded_by", "at"],
                "properties": {"job_id": {"type": "integer"}, "project": {"type": "string"},
                               "superseded_by": {"type": ["integer", "null"]},
                               "at": {"type": "string", "format": "date-time"}}}}}},
    "Runner": {"type": "object", "required": ["id", "name", "slots", "slots_used", "pools", "is_live"],
               "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                              "hostname": {"type": "string"}, "slots": {"type": "integer"},
                              "slots_used": {"type": "integer"},
                              "pools": {"type": "array", "items": {"type": "string"}},
                              "is_live": {"type": "boolean"}, "draining": {"type": "boolean"},
                              "last_heartbeat_at": {"type": "string", "format": "date-time"},
                              "stopped_at": _NULLABLE_TIME,
                              "stop_reason": {"enum": ["stopped", "lost", None],
                                              "description": "how a stopped runner ended: "
                                                             "stopped cleanly, or lost (it "
                                                             "stopped beating)"},
                              "drain_requested_at": _NULLABLE_TIME,
                              "drain_requested_by": {"type": ["string", "null"]},
                              "drain_reason": {"type": ["string", "null"]},
                              "drain_deadline": _NULLABLE_TIME,
                              "drain_state": {"enum": ["draining", "drained", None],
                                              "description": "an operator's drain: draining "
                                                             "while it still runs a job, "
                                                             "drained once it runs none"}}},
    "RunnerList": {"type": "object", "required": ["runners"], "properties": {
        "runners": {"type": "array", "items": {"$ref": "#/components/schemas/Runner"}}}},
    "RunnerDetail": {"allOf": [{"$ref": "#/components/schemas/Runner"}, {
        "type": "object", "required": ["running_jobs"], "properties": {
            "running_jobs": {"type": "array", "items": {"$ref": "#/components/schemas/JobListItem"}}}}]},
    "AuditEvent": {"type": "object", "required": ["id", "at", "actor", "action", "subject"],
                   "properties": {"id": {"type": "integer"},
                                  "at": {"type": "string", "format": "date-time"},
                                  "actor": {"type": "string"}, "action": {"type": "string"},
                                  "subject": {"type": "string"},
                                  "reason": {"type": ["string", "null"]},
                                  "details": {"type": "object"}}},
    "AuditList": {"type": "object", "required": ["events", "next"], "properties": {
        "events": {"type": "array", "items": {"$ref": "#/components/schemas/AuditEvent"}},
        "next": {"$ref": "#/components/schemas/Next"},
        "next_url": {"type": ["string", "null"]}}},
    "Resolution": {"type": ["object", "null"],
                   "description": "how a lost deployment was decided (null: it was not)",
                   "properties": {"outcome": {"enum": ["succeeded", "failed", "retry"]},
                                  "actor": {"type": "string"},
                                  "at": {"type": "string", "format": "date-time"},
                                  "note": {"type": ["string", "null"]},
                                  "action": {"enum": ["resolve_target", "late_report"]}}},
    "Overview": {
        "type": "object",
        "required": ["now", "waiting", "reason_counts", "primary_counts", "oldest_waiting",
                     "organizations", "projects", "pools", "uncertain_targets", "paused_projects"],
        "properties": {
            "now": {"type": "string", "format": "date-time"},
            "waiting": {"type": "integer", "description": "waiting jobs (blocked, queued, uncertain)"},
            "reason_counts": {"type": "object", "description": "reason code -> waiting jobs with "
                                                                "that reason among theirs",
                              "additionalProperties": {"type": "integer"}},
            "primary_counts": {"type": "object", "description": "reason code -> waiting jobs whose "
                                                                 "first reason it is (they sum to waiting)",
                               "additionalProperties": {"type": "integer"}},
            "oldest_waiting": {"type": "array", "description": "oldest first", "items": {
                "type": "object", "required": ["pool", "reason", "since", "seconds"],
                "properties": {"pool": {"type": "string"}, "reason": {"enum": list(REASON_CODES)},
                               "since": {"type": "string", "format": "date-time"},
                               "seconds": {"type": "number"}}}},
            "organizations": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "running": {"type": "integer"},
                "max_running": {"type": ["integer", "null"]}}}},
            "projects": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "organization": {"type": "string"},
                "running": {"type": "integer"}, "max_running": {"type": ["integer", "null"]},
                "weight": {"type": "integer"}, "paused": {"type": "boolean"}}}},
            "pools": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"},
                "slots": {"type": "integer", "description": "pool slots: the pool's limit"},
                "running": {"type": "integer", "description": "pool slots held"},
                "runner_slots": {"type": "integer", "description": "slots of its live runners"},
                "free_runner_slots": {"type": "integer"}, "live_runners": {"type": "integer"},
                "waiting": {"type": "integer"}}}},
            "uncertain_targets": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "holder_job_id": {"type": ["integer", "null"]},
                "holder_project": {"type": ["string", "null"]}, "held_since": _NULLABLE_TIME}}},
            "paused_projects": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "organization": {"type": "string"},
                "paused_by": {"type": ["string", "null"]}, "paused_at": _NULLABLE_TIME,
                "pause_reason": {"type": ["string", "null"]}}}},
            "paused_pools": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "paused_by": {"type": ["string", "null"]},
                "paused_at": _NULLABLE_TIME, "pause_reason": {"type": ["string", "null"]}}}},
            "jobs_by_state": {"type": "object", "additionalProperties": {"type": "integer"}},
            "summary_age_seconds": {"type": ["number", "null"],
                                    "description": "age of the queue summary (null: none yet)"},
        }},
}


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
        "/jobs": {"get": {
            "summary": "List jobs, filtered, keyset-paged by id", "operationId": "listJobs",
            "parameters": _JOB_FILTERS,
            "responses": {"200": _json({"$ref": "#/components/schemas/JobList"}, "one page"),
                          **_errors(*_LIST)},
        }, "post": {
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
            "summary": "Show a job with its attempts, its resolution and its audit trail",
            "operationId": "getJob",
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
        "/jobs/{job_id}/priority": {"post": {
            "summary": "Set the priority of a waiting job (blocked or queued)",
            "operationId": "setJobPriority",
            "parameters": [_JOB_ID],
            "requestBody": _body({"type": "object", "additionalProperties": False,
                                  "required": ["priority"],
                                  "properties": {"priority": _PRIORITY,
                                                 "reason": {"type": ["string", "null"],
                                                            "maxLength": 1000, "pattern": _NO_NUL}}},
                                 required=True),
            "responses": {"200": _json({"$ref": "#/components/schemas/ActionResult"},
                                       "{job_id, state, priority, previous_priority}"),
                          **_errors(*_WRITE),
                          "409": {"description": "the job is no longer waiting, or already has "
                                                 "that priority", "content": _ERROR_CONTENT}},
        }},
        "/jobs/bulk": {"post": {
            "summary": "Preview or apply a bulk cancel, retry, approve or reprioritize",
            "description": "With `dry_run` true, the jobs the action would take now (at most "
                           "10,000, first by id; `truncated` when the filter matched more), "
                           "and nothing changes. With `dry_run` false and no `job_ids`, the "
                           "same preview is applied at once; with `job_ids` (an earlier "
                           "preview's, and its `generations` when sent), exactly those jobs. "
                           "One audit event for the bulk action, then batches of 100 jobs in "
                           "id order, each its own transaction; a job no longer in the state "
                           "the action expects (or claimed since its generation) is skipped "
                           "with why, never an error. A name in `filter` that does not exist "
                           "is 404, as in listJobs.",
            "operationId": "bulkJobs",
            "requestBody": _body({"$ref": "#/components/schemas/BulkRequest"}, required=True),
            "responses": {"200": _json({"$ref": "#/components/schemas/BulkAnswer"},
                                       "the preview, the result, or both"),
                          **_errors(*_WRITE)},
        }},
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
        "/pools/{name}/pause": {"post": {
            "summary": "Pause a pool: no claim takes from it until it is resumed (running "
                       "jobs go on; its waiting jobs explain pool_paused with who, when, why)",
            "operationId": "pausePool",
            "parameters": [_NAME],
            "requestBody": _body({"type": "object", "additionalProperties": False,
                                  "required": ["reason"],
                                  "properties": {"reason": {"type": "string", "maxLength": 1000,
                                                            "pattern": _SAYS_SOMETHING}}},
                                 required=True),
            "responses": {"200": _json({"$ref": "#/components/schemas/PoolPause"}, "paused"),
                          **_errors(*_WRITE),
                          "409": {"description": "already paused (says by whom, when and why)",
                                  "content": _ERROR_CONTENT}},
        }},
        "/pools/{name}/resume": {"post": {
            "summary": "Resume a paused pool (its schedulers are woken)",
            "operationId": "resumePool",
            "parameters": [_NAME],
            "requestBody": _body(_REASON_BODY, required=False),
            "responses": {"200": _json({"$ref": "#/components/schemas/PoolPause"}, "resumed"),
                          **_errors(*_WRITE),
                          "409": {"description": "not paused (says who resumed it and when)",
                                  "content": _ERROR_CONTENT}},
        }},
        "/runners/{runner_id}/drain": {"post": {
            "summary": "Drain a runner: it takes nothing new and finishes what it runs (its "
                       "scheduler learns it on its next beat); after deadline_seconds its "
                       "running builds are handed back (re-queued, no failure counted); "
                       "deployments are never cut",
            "operationId": "drainRunner",
            "parameters": [_RUNNER_ID],
            "requestBody": _body({"type": "object", "additionalProperties": False,
                                  "required": ["reason"],
                                  "properties": {
                                      "reason": {"type": "string", "maxLength": 1000,
                                                 "pattern": _SAYS_SOMETHING},
                                      "deadline_seconds": {
                                          "type": ["integer", "null"], "minimum": 0,
                                          "maximum": 604800,
                                          "description": "seconds until its builds are handed "
                                                         "back; null or absent: no deadline"}}},
                                 required=True),
            "responses": {"200": _json({"$ref": "#/components/schemas/RunnerDrain"}, "drained"),
                          **_errors(*_WRITE),
                          "409": {"description": "already draining (says by whom and when), or "
                                                 "the runner is stopped",
                                  "content": _ERROR_CONTENT}},
        }},
        "/runners/{runner_id}/resume": {"post": {
            "summary": "Resume a drained runner: it claims again",
            "operationId": "resumeRunner",
            "parameters": [_RUNNER_ID],
            "requestBody": _body(_REASON_BODY, required=False),
            "responses": {"200": _json({"$ref": "#/components/schemas/RunnerDrain"}, "resumed"),
                          **_errors(*_WRITE),
                          "409": {"description": "not drained (says who resumed it and when)",
                                  "content": _ERROR_CONTENT}},
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
        **_LIST_PATHS,
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
                    "state": {"enum": list(JOB_STATES)},
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
                {"type": "object", "properties": {
                    "attempts": {"type": "array", "items": {"$ref": "#/components/schemas/Attempt"}},
                    "resolution": {"$ref": "#/components/schemas/Resolution"},
                    "audit": {"type": "array", "description": "the job's own audit trail, "
                                                              "oldest first (at most 200)",
                              "items": {"$ref": "#/components/schemas/AuditEvent"}}}},
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
            **_LIST_SCHEMAS,
            "BulkRequest": {
                "type": "object", "additionalProperties": False, "required": ["action", "dry_run"],
                "if": {"properties": {"action": {"const": "reprioritize"}}},
                "then": {"required": ["priority"]},
                "else": {"not": {"required": ["priority"]}},
                "properties": {
                    "action": {"enum": ["cancel", "retry", "approve", "reprioritize"]},
                    "filter": {"type": "object", "additionalProperties": False,
                               "description": "the job list's filters (listJobs' query "
                                              "parameters), all optional, combined with AND",
                               "properties": {f["name"]: f["schema"] for f in _JOB_FILTERS
                                              if f["name"] not in ("limit", "before_id", "after_id")}},
                    "job_ids": {"type": "array", "minItems": 1, "maxItems": 10000,
                                "description": "exactly these jobs: ids, or an earlier preview's "
                                               "jobs ({id, generation}: one claimed since is "
                                               "skipped too)",
                                "items": {"oneOf": [_BIGINT, {
                                    "type": "object", "required": ["id", "generation"],
                                    "properties": {"id": _BIGINT,
                                                   "generation": {"type": "integer", "minimum": 0,
                                                                  "maximum": 2**63 - 1}}}]}},
                    "priority": {**_PRIORITY, "description": "the new priority: required by "
                                                             "reprioritize, refused by the others"},
                    "reason": {"type": ["string", "null"], "maxLength": 1000, "pattern": _NO_NUL},
                    "dry_run": {"type": "boolean"},
                },
            },
            "BulkAnswer": {
                "type": "object", "required": ["dry_run", "action", "preview", "result"],
                "properties": {
                    "dry_run": {"type": "boolean"}, "action": {"type": "string"},
                    "preview": {"oneOf": [{"type": "null"}, {
                        "type": "object",
                        "properties": {
                            "count": {"type": "integer"}, "truncated": {"type": "boolean"},
                            "priority": {"type": ["integer", "null"]},
                            "filter": {"type": "object"},
                            "states": {"type": "array", "items": {"enum": list(JOB_STATES)}},
                            "jobs": {"type": "array", "items": {"type": "object", "properties": {
                                "id": {"type": "integer"}, "generation": {"type": "integer"},
                                "state": {"enum": list(JOB_STATES)}, "priority": {"type": "integer"},
                                "project": {"type": "string"}, "organization": {"type": "string"},
                                "pool": {"type": "string"}, "target": {"type": ["string", "null"]},
                                "command": {"type": "array", "items": {"type": "string"}},
                                "reason": {"oneOf": [{"enum": list(REASON_CODES)}, {"type": "null"}]},
                                "message": {"type": ["string", "null"]},
                                "created_at": {"type": "string", "format": "date-time"}}}}}}]},
                    "result": {"oneOf": [{"type": "null"}, {
                        "type": "object",
                        "properties": {
                            "bulk_event_id": {"type": ["integer", "null"],
                                              "description": "the bulk action's audit event "
                                                             "(null: no job to act on, none "
                                                             "written)"},
                            "requested": {"type": "integer"},
                            "priority": {"type": ["integer", "null"]},
                            "done": {"type": "array", "items": {"type": "integer"}},
                            "skipped": {"type": "array", "items": {"type": "object", "properties": {
                                "job_id": {"type": "integer"},
                                "state": {"type": ["string", "null"]},
                                "why": {"type": "string"}}}}}}]},
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
# a bad value of a field given (an unknown action, say) is named before a field missing
_RANK = {"AdditionalProperties": 0, "Enum": 1, "Required": 2, "Type": 3, "OneOfNotValid": 4}


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


def _cut(value: str, width: int = 60) -> str:
    """``value`` quoted for an error message, cut to ``width`` characters with …."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 1] + "…"


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
    if kind == "OneOfNotValid" and "job_ids" in list(error.instance_path):
        return (f"{field} must be a job id (1 to {2**63 - 1}) or an object with its id and "
                f"generation (a preview's job), got {_shown(value)}")
    if kind == "OneOfNotValid":
        return f"{field} must be a name ({_NAME_RULE}) or null, got {_shown(value)}"
    if kind == "AnyOf":  # the one anyOf of the document: the search text (_SEARCH_TEXT)
        return (f"{field} must be a job id (#N), digits, or 3 to 200 characters of a command "
                f"(not starting with # or a blank), got {_shown(value)}")
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


# --- the document as the check of query parameters (the list operations) ----------------

# a whole number of more digits than any bigint is refused before int() reads it
_MAX_DIGITS = 25


# numbers in ASCII digits only: float() and int() also read "1_000", " 5" and other
# scripts' digits ("١٢")
_WHOLE = re.compile(r"-?[0-9]+")
_NUMBER = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


def _query_value(raw: str, schema: dict[str, Any]) -> Any:
    """``raw`` as the type its schema says, where it reads as one (ASCII digits); else
    ``raw`` itself, for the schema's check to refuse."""
    kind = schema.get("type")
    if kind == "integer" and len(raw) <= _MAX_DIGITS and _WHOLE.fullmatch(raw):
        return int(raw)
    if kind == "number" and len(raw) <= 40 and _NUMBER.fullmatch(raw):
        value = float(raw)
        return value if math.isfinite(value) else raw
    return raw


@functools.cache
def _parameter_validator(operation_id: str, name: str):
    schema = next(p["schema"] for p in _operations()[operation_id]["parameters"] if p["name"] == name)
    return jsonschema_rs.Draft202012Validator(schema), schema


def query_values(operation_id: str, args) -> dict[str, Any]:
    """The query parameters of ``operation_id`` in ``args`` (a werkzeug MultiDict), each as
    its schema's type, checked against the document: only those given.

    Raises InvalidInput (422) naming the first parameter refused: unknown, given twice, of
    another type, out of range, not a name."""
    declared = [p["name"] for p in _operations()[operation_id].get("parameters", []) if p["in"] == "query"]
    unknown = sorted(set(args) - set(declared))
    if unknown:
        known = f"one of {', '.join(declared)}" if declared else "it takes none"
        raise InvalidInput(f"unknown query parameter {_cut(unknown[0])} ({known})")
    values: dict[str, Any] = {}
    for name in declared:
        given = args.getlist(name)
        if not given:
            continue
        if len(given) > 1:
            raise InvalidInput(f"query parameter {name} is given more than once")
        validator, schema = _parameter_validator(operation_id, name)
        value = _query_value(given[0], schema)
        errors = list(validator.iter_errors(value))
        if errors:
            error = min(errors, key=lambda e: _RANK.get(type(e.kind).__name__, 9))
            raise InvalidInput(_message(error, schema).replace("the request body", name, 1))
        values[name] = value
    return values
