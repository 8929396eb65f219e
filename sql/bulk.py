"""Bulk actions: cancel, retry, approve or reprioritize the jobs a filter selects, after a
preview (the console's Bulk page, ``pgdispatch jobs bulk``, ``POST /api/v1/jobs/bulk``).

``preview_bulk`` reads the jobs the action would take (at most MAX_BULK_JOBS, by id) and
changes nothing; ``apply_bulk`` takes exactly the ids of a preview (with the attempt
generation it saw of each): one audit event for the bulk action, then batches of BULK_BATCH
jobs, each its own short transaction in id order, where every job still in the state the
action expects is changed (with its own audit event naming the bulk event) and every other
is skipped with why (sql/functions/bulk.sql; docs/design.md, "Bulk actions").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .audit import check_actor, job_exists, optional_reason
from .db import transition
from .errors import InvalidInput
from .explain import read_world, reasons_for
from .queries import Q
from .reads import MAX_BIGINT, _check_job_list_input, _job_filter_ids, _quoted

BULK_ACTIONS = ("cancel", "retry", "approve", "reprioritize")
# The job states each action takes; a job in another is not previewed, and one that moved
# to another since the preview is skipped (pgd_bulk_refusal). A bulk cancel takes waiting
# jobs only: a running job is stopped one by one (jobs cancel ID), so that a bulk cancel
# never races a claim into "cancelled and run".
ACTION_STATES = {"cancel": ("blocked", "queued"), "retry": ("failed", "cancelled"),
                 "approve": ("blocked",), "reprioritize": ("blocked", "queued")}
# The filters a bulk action selects by: the job list's (reads.list_jobs).
BULK_FILTERS = ("state", "organization", "project", "pool", "target", "runner_id", "reason",
                "older_than_seconds", "younger_than_seconds")
MAX_BULK_JOBS = 10_000  # the most jobs one bulk action takes (the preview's bound)
BULK_BATCH = 100        # jobs per transaction when applying
_PAGE = 1000            # rows per read of the preview


def check_action(action: Any, priority: Any) -> int | None:
    """``action`` one of BULK_ACTIONS and, for reprioritize, ``priority`` a whole number in
    -1000..1000 (returned; None for the others, which take none). Raises InvalidInput."""
    if action not in BULK_ACTIONS:
        raise InvalidInput(f"unknown bulk action {_quoted(action)} (one of {', '.join(BULK_ACTIONS)})")
    if action != "reprioritize":
        if priority is not None:
            raise InvalidInput("only reprioritize takes a priority")
        return None
    if priority is None:
        raise InvalidInput("reprioritize needs a priority (-1000..1000)")
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        raise InvalidInput("priority must be a whole number between -1000 and 1000")
    return priority


def check_filters(filters: dict[str, Any]) -> dict[str, Any]:
    """The filters given (None values dropped), checked as the job list checks them.
    Raises InvalidInput for an unknown filter name or a bad value."""
    unknown = sorted(set(filters) - set(BULK_FILTERS))
    if unknown:
        raise InvalidInput(f"unknown filter {_quoted(unknown[0])} (one of {', '.join(BULK_FILTERS)})")
    given = {k: v for k, v in filters.items() if v is not None}
    for name in ("organization", "project", "pool", "target"):
        if name in given and not isinstance(given[name], str):
            raise InvalidInput(f"{name} must be a name")
    _check_job_list_input(state=given.get("state"), reason=given.get("reason"),
                          runner_id=given.get("runner_id"),
                          older_than_seconds=given.get("older_than_seconds"),
                          younger_than_seconds=given.get("younger_than_seconds"),
                          before_id=None, after_id=None, limit=1)
    return given


def _filter_ids(conn, given: dict[str, Any]) -> dict[str, Any]:
    """The ids of the names in checked filters ``given`` (reads._job_filter_ids). Raises
    UnknownFilter (an InvalidInput) for a name or runner id that does not exist."""
    return _job_filter_ids(conn, organization=given.get("organization"), project=given.get("project"),
                           pool=given.get("pool"), target=given.get("target"),
                           runner_id=given.get("runner_id"))


def _check_ids(job_ids: Any, generations: Any) -> tuple[list[int], list[int | None]]:
    if not isinstance(job_ids, (list, tuple)) or not job_ids:
        raise InvalidInput("job_ids must be a list of 1 to 10000 job ids")
    if len(job_ids) > MAX_BULK_JOBS:
        raise InvalidInput(f"a bulk action takes at most {MAX_BULK_JOBS} jobs, got {len(job_ids)}")
    for i in job_ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= MAX_BIGINT:
            raise InvalidInput(f"job ids must be whole numbers between 1 and {MAX_BIGINT}")
    if generations is None:
        return list(job_ids), [None] * len(job_ids)
    if not isinstance(generations, (list, tuple)) or len(generations) != len(job_ids):
        raise InvalidInput("generations must be a list as long as job_ids")
    for g in generations:
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or not 0 <= g <= MAX_BIGINT):
            raise InvalidInput(f"generations must be whole numbers between 0 and {MAX_BIGINT}")
    return list(job_ids), list(generations)


def _takes(action: str, job: dict[str, Any], priority: int | None) -> bool:
    """Whether the preview lists ``job`` for ``action`` (its state is one ACTION_STATES
    names already): as pgd_bulk_refusal judges it, but the approver's rule."""
    if action == "retry":
        return job["pending_dependencies"] == 0 and not (job["requires_approval"]
                                                        and job["approved_at"] is None)
    if action == "approve":
        return job["requires_approval"] and job["approved_at"] is None
    if action == "reprioritize":
        return job["priority"] != priority
    return True


@transition("preview_bulk")
def preview_bulk(conn, *, action: str, filters: dict[str, Any], priority: int | None = None,
                 job_ids: Sequence[int] | None = None, limit: int = MAX_BULK_JOBS,
                 live_seconds: float = 90.0) -> dict[str, Any]:
    """The jobs bulk ``action`` would take now: those matching ``filters`` (BULK_FILTERS,
    as the job list takes them; ``reason`` holds among a waiting job's reasons) in the
    states the action takes (ACTION_STATES; with a ``state`` filter, only that one),
    among ``job_ids`` when given, first by id, at most ``limit`` (≤ MAX_BULK_JOBS). Reads
    only.

    Returns:
        {"action", "priority", "filter" (the filters given), "states" (those taken),
        "jobs": [{"id", "generation", "state", "priority", "project", "organization",
        "pool", "target", "command", "reason" (a waiting job's primary reason code, else
        None), "message" (that reason's message, or a finished job's last error),
        "created_at"}] by id, "count", "truncated" (more matched than ``limit``), "now"}.

    Raises:
        InvalidInput: an unknown action or filter, a bad value, a priority missing for
            reprioritize or given for another action.
        UnknownFilter (an InvalidInput): a name or runner id that does not exist.
    """
    priority = check_action(action, priority)
    given = check_filters(filters)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_BULK_JOBS:
        raise InvalidInput(f"limit must be a whole number between 1 and {MAX_BULK_JOBS}")
    if job_ids is not None:
        job_ids, _ = _check_ids(job_ids, None)
    ids = _filter_ids(conn, given)
    states = [s for s in ACTION_STATES[action] if given.get("state") in (None, s)]
    reason = given.get("reason")
    now = Q.begin_job_list(conn)["now"]
    world = read_world(conn, live_seconds=live_seconds)
    out: list[dict[str, Any]] = []
    truncated = False
    after_id = 0
    while states and not truncated:
        page = list(Q.list_bulk_candidates(
            conn, states=states, after_id=after_id, limit=_PAGE, job_ids=job_ids,
            project_ids=ids["project_ids"], pool_id=ids["pool_id"], target_id=ids["target_id"],
            runner_id=given.get("runner_id"),
            older_than_seconds=given.get("older_than_seconds"),
            younger_than_seconds=given.get("younger_than_seconds")))
        if not page:
            break
        after_id = page[-1]["id"]
        blocked = [j["id"] for j in page if j["pending_dependencies"] > 0 and j["state"] == "blocked"]
        pending: dict[int, list[dict[str, Any]]] = {}
        if blocked:
            for dep in Q.list_pending_dependencies_of_jobs(conn, job_ids=blocked):
                pending.setdefault(dep.pop("job_id"), []).append(dep)
        for job in page:
            if not _takes(action, job, priority):
                continue
            reasons = reasons_for(job, world, pending.get(job["id"]))
            if reason is not None and not any(r.code == reason for r in reasons):
                continue
            if len(out) == limit:
                truncated = True
                break
            out.append({"id": job["id"], "generation": job["generation"], "state": job["state"],
                        "priority": job["priority"], "project": job["project"],
                        "organization": job["organization"], "pool": job["pool"],
                        "target": job["target"], "command": job["command"],
                        "reason": reasons[0].code if reasons else None,
                        "message": reasons[0].message if reasons else job["last_error"],
                        "created_at": job["created_at"]})
        if len(page) < _PAGE:
            break
    return {"action": action, "priority": priority, "filter": given, "states": states,
            "jobs": out, "count": len(out), "truncated": truncated, "now": now}


@transition("bulk_begin", one_statement=True)
def _begin(conn, **params: Any) -> int:
    return Q.bulk_begin(conn, **params)


@transition("bulk_apply", one_statement=True)
def _apply_batch(conn, *, bulk_event_id: int, job_ids: list[int], generations: list[int | None],
                 actor: str | None) -> list[dict[str, Any]]:
    return list(Q.bulk_apply(conn, bulk_event_id=bulk_event_id, job_ids=job_ids,
                             generations=generations, actor=actor))


def apply_bulk(conn, *, action: str, job_ids: Sequence[int],
               generations: Sequence[int | None] | None = None,
               filters: dict[str, Any] | None = None, truncated: bool = False,
               priority: int | None = None, reason: str | None = None, actor: str | None,
               batch_size: int = BULK_BATCH) -> dict[str, Any]:
    """Apply bulk ``action`` to exactly ``job_ids`` (a preview's, at most MAX_BULK_JOBS),
    with the attempt generation the preview saw of each (``generations``, same length;
    None: only the state is checked): the bulk action's audit event (``filters`` and
    ``truncated`` as the preview had them, the number of jobs, ``reason``), then batches of
    ``batch_size`` jobs in id order, each its own transaction (retried on deadlock). Runs on
    an idle connection (it commits batch by batch).

    Returns:
        {"bulk_event_id", "action", "priority", "requested" (distinct jobs), "done": [ids],
        "skipped": [{"job_id", "state" (now; None for an unknown job), "why"}], in id
        order}; bulk_event_id None, and no event written, when not one of the ids is a job.

    Raises:
        InvalidInput: a bad action, priority, id list, filter, reason or batch size
            (before anything is written); UnknownFilter (an InvalidInput) for a filter
            naming a project, pool, target, organization or runner that does not exist. Forbidden: the actor may not act (viewer).
    """
    priority = check_action(action, priority)
    ids, gens = _check_ids(job_ids, generations)
    given = check_filters(filters or {})
    _filter_ids(conn, given)  # the event records the filter: only one that names what exists
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 500:
        raise InvalidInput("batch size must be a whole number between 1 and 500")
    first: dict[int, int | None] = {}
    for i, g in zip(ids, gens):
        first.setdefault(i, g)
    ordered = sorted(first)
    if not any(job_exists(conn, job_id=i) for i in ordered):
        # not one of them is a job: nothing to act on, and no event that changed nothing
        return _nothing_done(action, priority, requested=len(ordered), skipped=[
            {"job_id": i, "state": None, "why": "unknown job"} for i in ordered])
    bulk_event_id = _begin(conn, action=action, filter=json.dumps(given, default=str),
                           requested=len(ordered), truncated=bool(truncated), priority=priority,
                           reason=optional_reason(reason), actor=check_actor(actor))
    done: list[int] = []
    skipped: list[dict[str, Any]] = []
    for start in range(0, len(ordered), batch_size):
        chunk = ordered[start:start + batch_size]
        for row in _apply_batch(conn, bulk_event_id=bulk_event_id, job_ids=chunk,
                                generations=[first[i] for i in chunk], actor=check_actor(actor)):
            if row["done"]:
                done.append(row["job_id"])
            else:
                skipped.append({"job_id": row["job_id"], "state": row["state"], "why": row["note"]})
    return {"bulk_event_id": bulk_event_id, "action": action, "priority": priority,
            "requested": len(ordered), "done": done, "skipped": skipped}


def _nothing_done(action: str, priority: int | None, *, requested: int,
                  skipped: list[dict[str, Any]]) -> dict[str, Any]:
    """apply_bulk's answer when no job is there to act on: no audit event (bulk_event_id
    None)."""
    return {"bulk_event_id": None, "action": action, "priority": priority,
            "requested": requested, "done": [], "skipped": skipped}


def run_bulk(conn, *, action: str, filters: dict[str, Any], priority: int | None = None,
             reason: str | None = None, actor: str | None, dry_run: bool = True,
             live_seconds: float = 90.0) -> dict[str, Any]:
    """Preview bulk ``action`` over ``filters`` and, unless ``dry_run``, apply it at once to
    the previewed ids and generations (``pgdispatch jobs bulk … --yes``, the API without
    job_ids). Returns {"preview": preview_bulk's answer, "result": apply_bulk's or None
    (dry run)}; a filter that matches nothing gives a result with no bulk_event_id (no
    event is written). Raises as the two do."""
    preview = preview_bulk(conn, action=action, filters=filters, priority=priority,
                           live_seconds=live_seconds)
    result = None
    if not dry_run and not preview["jobs"]:
        result = _nothing_done(action, priority, requested=0, skipped=[])
    elif not dry_run:
        result = apply_bulk(conn, action=action, job_ids=[j["id"] for j in preview["jobs"]],
                            generations=[j["generation"] for j in preview["jobs"]],
                            filters=preview["filter"], truncated=preview["truncated"],
                            priority=priority, reason=reason, actor=actor)
    return {"preview": preview, "result": result}
