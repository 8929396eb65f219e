"""Read-only queries for the console, the API and the CLI (no state changes here)."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

# list_subject_events: the shows' audit trails
from .audit import list_subject_events
from .db import transition
from .errors import InvalidInput, NotFound, UnknownFilter
from .explain import (REASON_CODES, WAITING_STATES, pair_reasons, read_world, reasons_for,
                      summary_any_reason_counts, summary_oldest_waiting, summary_reason_counts)
from .queries import Q
from .validate import JOB_STATES, _check_encodable, check_text

# the queue's orders (list_waiting): by id, or longest waiting first
WAITING_SORTS = ("id", "oldest")


def _quoted(value: object, width: int = 60) -> str:
    """``value`` quoted for an error message, cut to ``width`` characters with …: a
    5,000-character name is not echoed back whole."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 1] + "…"


@transition("show_job")
def show_job(conn, *, job_id: int, tail_chars: int = 65536, audit_limit: int = 200) -> dict[str, Any]:
    """One job with its attempts (oldest first; each with up to ``tail_chars`` of output and
    ``duration_seconds``), its times in seconds (``age_seconds``, ``duration_seconds`` once
    it ended, ``waiting_since`` / ``waiting_seconds`` while it waits, ``running_seconds``
    while it runs: get_job, sql/jobs.sql) and ``resolution``: how its lost deployment was
    decided — {"outcome", "actor", "at", "note", "action"} (``resolve_target`` by an
    operator, ``late_report`` by the attempt itself) — or None; and ``audit``: the job's own
    audit trail, oldest first, at most ``audit_limit`` events (list_job_audit).

    Raises: NotFound.
    """
    job = Q.get_job(conn, job_id=job_id)
    if job is None:
        raise NotFound(f"unknown job {job_id}")
    job["attempts"] = list(Q.list_attempts(conn, job_id=job_id, tail_chars=tail_chars))
    resolution = Q.last_job_resolution(conn, job_id=job_id)
    job["resolution"] = None if resolution is None else {
        k: resolution[k] for k in ("outcome", "actor", "at", "note", "action")}
    job["audit"] = list(Q.list_job_audit(conn, job_id=job_id, limit=audit_limit))
    return job


@transition("list_job_audit")
def list_job_audit(conn, *, job_id: int, limit: int = 200) -> list[dict[str, Any]]:
    """Job ``job_id``'s own audit trail, oldest first, at most ``limit`` events: every action
    on it (submit, approve, cancel, retry) and every target resolution that decided it
    (audit_events.job_id). Each: id, at, actor, action, subject, reason, details."""
    return list(Q.list_job_audit(conn, job_id=job_id, limit=limit))


@transition("list_waiting")
def list_waiting(conn, *, after_id: int = 0, limit: int = 50, organization: str | None = None,
                 project: str | None = None, pool: str | None = None, reason: str | None = None,
                 live_seconds: float = 90.0, sort: str = "id",
                 after_since: dt.datetime | None = None,
                 target: str | None = None) -> dict[str, Any]:
    """Waiting jobs (blocked, queued, uncertain) after a cursor, each with its reasons and
    ``waiting_since`` (pgd_waiting_since, sql/functions/summaries.sql). ``sort``: "id" (by
    id, after ``after_id``) or "oldest" (longest waiting first, after (``after_since``,
    ``after_id``); ``after_since`` None: from the start).

    ``organization``, ``project``, ``pool``, ``target``: names (None: any). A job waiting for
    dependencies names them ("waiting for job 191 (queued)"), read in one query per batch of
    rows (list_pending_dependencies_of_jobs), never one per row.

    With ``reason``, only jobs that have that reason among theirs are returned, whether it is
    their first (primary) one or not: an approval behind a dependency is listed under
    ``approval_required`` too (the scan goes on page by page until ``limit`` match or the
    queue ends).

    Returns:
        {"jobs": [job + "reasons" (each {"code", "message", "details", "is_primary",
        "is_match"}) + "reason" (the primary code) + "matched_reason" (``reason``, or None)],
        "next_after_id": id or None, "next_after_since": the next page's waiting since (sort
        "oldest") or None, "now": the database's time}.

    Raises: InvalidInput for another sort.
    """
    if sort not in WAITING_SORTS:
        raise InvalidInput(f"unknown sort {sort!r} (one of: {', '.join(WAITING_SORTS)})")
    world = read_world(conn, live_seconds=live_seconds)
    out: list[dict[str, Any]] = []
    cursor = after_id
    since = after_since
    batch_size = max(limit, 200) if reason else limit
    filters = {"organization": organization, "project": project, "pool": pool, "target": target}
    source, ids = _waiting_source(world, reason=reason, **filters)
    while len(out) < limit and source is not None:
        if sort == "oldest" and source == "special":
            batch = list(Q.list_waiting_special_jobs_by_age(conn, after_since=since, after_id=cursor,
                                                            limit=batch_size, **ids))
        elif sort == "oldest":
            batch = list(Q.list_waiting_jobs_of_pairs_by_age(
                conn, after_since=since, after_id=cursor, limit=batch_size,
                **(ids if source == "pairs" else _every_pair(world))))
        elif source == "special":
            batch = list(Q.list_waiting_special_jobs(conn, after_id=cursor, limit=batch_size, **ids))
        elif source == "pairs":
            batch = list(Q.list_waiting_jobs_of_pairs(conn, after_id=cursor, limit=batch_size, **ids))
        else:
            batch = list(Q.list_waiting_jobs(conn, after_id=cursor, limit=batch_size, **filters))
        if not batch:
            cursor = None
            break
        blocked = [job["id"] for job in batch if job["pending_dependencies"] > 0]
        pending: dict[int, list[dict[str, Any]]] = {}
        if blocked:
            for dep in Q.list_pending_dependencies_of_jobs(conn, job_ids=blocked):
                pending.setdefault(dep.pop("job_id"), []).append(dep)
        for job in batch:
            cursor, since = job["id"], job["waiting_since"]
            reasons = [r.as_dict() for r in reasons_for(job, world, pending.get(job["id"]))]
            if reason is not None and not any(r["code"] == reason for r in reasons):
                continue
            for i, r in enumerate(reasons):
                r["is_primary"] = i == 0
                r["is_match"] = r["code"] == reason
            job["reasons"] = reasons
            job["reason"] = reasons[0]["code"]
            job["matched_reason"] = reason
            out.append(job)
            if len(out) == limit:
                break
        if len(batch) < batch_size and len(out) < limit:
            cursor = None
            break
    more = bool(out and cursor)
    return {"jobs": out, "next_after_id": cursor if more else None,
            "next_after_since": since if more and sort == "oldest" else None, "now": world.now}


# The reasons a waiting job can have of its own (its row, its target), which only jobs of
# jobs_waiting_special_idx have; every other reason holds for a whole (project, pool).
OWN_REASONS = ("dependency_pending", "approval_required", "retry_delayed", "target_order",
               "target_held", "target_uncertain")


def _waiting_source(world, *, reason: str | None, organization: str | None, project: str | None,
                    pool: str | None, target: str | None) -> tuple[str | None, dict[str, Any]]:
    """Where list_waiting (sort "id") reads its candidates, each a superset of the jobs
    the filters and ``reason`` match (reasons_for decides on each row): ("all", {}) every
    waiting job (nothing to narrow by); ("special", ids for list_waiting_special_jobs) the
    jobs that can have a reason of their own, for such a reason or a target filter;
    ("pairs", ids for list_waiting_jobs_of_pairs) the (project, pool) pairs the organization,
    project and pool filters leave, of those only the pairs ``reason`` holds for; or (None,
    {}) when nothing can match (a name that does not exist, no pair)."""
    projects = [p for p in world.projects.values()
                if (project is None or p["name"] == project)
                and (organization is None
                     or world.organizations[p["organization_id"]]["name"] == organization)]
    pools = [q for q in world.pools.values() if pool is None or q["name"] == pool]
    targets = [t["id"] for t in world.targets.values() if t["name"] == target]
    if not projects or not pools or (target is not None and not targets):
        return None, {}
    by_project = project is not None or organization is not None
    if reason in OWN_REASONS or target is not None:
        return "special", {"project_ids": [p["id"] for p in projects] if by_project else None,
                           "pool_id": pools[0]["id"] if pool is not None else None,
                           "target_id": targets[0] if targets else None}
    if reason is None and not by_project and pool is None:
        return "all", {}
    pairs = [(p["id"], q["id"]) for p in projects for q in pools
             if reason is None or reason in (pair_reasons(world, p["id"], q["id"]) or ())]
    if not pairs:
        return None, {}
    return "pairs", {"project_ids": [p for p, _ in pairs], "pool_ids": [q for _, q in pairs]}


def _every_pair(world) -> dict[str, list[int]]:
    """Every (project, pool) pair of ``world``, as list_waiting_jobs_of_pairs takes them: the
    candidates of the whole queue longest waiting first (jobs_waiting_age_idx is by pair)."""
    pairs = [(p, q) for p in world.projects for q in world.pools]
    return {"project_ids": [p for p, _ in pairs], "pool_ids": [q for _, q in pairs]}


@transition("overview")
def overview(conn, *, live_seconds: float = 90.0) -> dict[str, Any]:
    """What the overview page (and the web's /metrics) shows.

    Returns a dict:
        now; organizations, projects, pools (each with running, and a pool with
        ``runner_slots``, ``free_runner_slots``, ``live_runners`` of its live runners and
        ``waiting``: its blocked and queued jobs); targets (uncertain first);
        ``paused_projects`` and ``paused_pools`` (with paused_by, paused_at, pause_reason);
        ``reason_counts`` (waiting jobs under every reason that holds for them),
        ``primary_counts`` (under their first reason only: these sum to ``waiting``),
        ``waiting``; ``oldest_waiting``: [{"pool", "reason" (primary), "since",
        "seconds"}] for every pair with a waiting job, oldest first; ``summary_age_seconds``
        (of the oldest summary row, None before the first refresh); ``jobs_by_state``:
        blocked and queued from the summary, running and uncertain exact, succeeded / failed
        / cancelled finished in the last hour; runners.

    Its cost does not grow with the queue or the history: every query reads the small tables,
    the summary, or an index range bounded by capacity or by one hour of completions
    (docs/benchmarks.md, "Latency at size")."""
    world = read_world(conn, live_seconds=live_seconds)
    summaries = list(Q.read_queue_summaries(conn))
    primary = summary_reason_counts(summaries, world)
    every = summary_any_reason_counts(summaries, world)
    # a lost deployment waits for its target's resolution only (explain.reasons_for)
    uncertain_jobs = sum(1 for t in world.targets.values() if t["state"] == "uncertain")
    primary["target_uncertain"] += uncertain_jobs
    every["target_uncertain"] += uncertain_jobs
    oldest = [{"pool": pool, "reason": code, "since": since,
               "seconds": max((world.now - since).total_seconds(), 0.0)}
              for (pool, code), since in summary_oldest_waiting(summaries, world).items()]
    oldest.sort(key=lambda o: (o["since"], o["pool"], o["reason"]))
    ages = [s["age_seconds"] for s in summaries]
    waiting_by_pool: dict[int, int] = {}
    for s in summaries:
        waiting_by_pool[s["pool_id"]] = waiting_by_pool.get(s["pool_id"], 0) + (
            s["blocked_dependency"] + s["blocked_approval"] + s["queued_ready"] + s["queued_delayed"])
    pools = []
    for p in world.pools.values():
        slots, free = world.runner_slots.get(p["id"], (0, 0))
        pools.append({**p, "runner_slots": slots, "free_runner_slots": free,
                      "live_runners": len(world.runner_ids.get(p["id"], [])),
                      "waiting": waiting_by_pool.get(p["id"], 0)})
    projects = list(world.projects.values())
    by_state = {
        "blocked": sum(s["blocked_dependency"] + s["blocked_approval"] for s in summaries),
        "queued": sum(s["queued_ready"] + s["queued_delayed"] for s in summaries),
        **{r["state"]: r["n"] for r in Q.count_recent_jobs_by_state(conn)},
    }
    return {
        "now": world.now,
        "organizations": list(world.organizations.values()),
        "projects": projects,
        "paused_projects": sorted((p for p in projects if p["paused_at"] is not None),
                                  key=lambda p: p["paused_at"]),
        "pools": pools,
        "paused_pools": sorted((q for q in pools if q.get("paused_at") is not None),
                               key=lambda q: q["paused_at"]),
        "targets": list(world.targets.values()),
        "reason_counts": every,
        "primary_counts": primary,
        "waiting": sum(primary.values()),
        "oldest_waiting": oldest,
        "summary_age_seconds": max(ages) if ages else None,
        "jobs_by_state": by_state,
        "runners": list(Q.list_runners(conn, live_seconds=live_seconds)),
    }


@transition("overview_report")
def overview_report(conn, *, live_seconds: float = 90.0) -> dict[str, Any]:
    """What the console's overview says, as data for ``pgdispatch overview`` and
    ``GET /api/v1/overview`` (from ``overview``: the summary, no job rows read).

    Returns:
        {"now", "waiting" (waiting jobs), "reason_counts" (code -> jobs under every reason
        that holds for them), "primary_counts" (code -> jobs under their first reason: these
        sum to "waiting"), "oldest_waiting": [{"pool", "reason" (primary), "since",
        "seconds"}] oldest first, "organizations": [{"name", "running", "max_running"}],
        "projects": [{"name", "organization", "running", "max_running", "weight",
        "paused"}], "pools": [{"name", "slots" (pool slots), "running" (pool slots held),
        "runner_slots", "free_runner_slots" (of its live runners), "live_runners",
        "waiting"}], "uncertain_targets": [{"name", "holder_job_id", "holder_project",
        "held_since"}], "paused_projects": [{"name", "organization", "paused_by",
        "paused_at", "pause_reason"}], "paused_pools": [{"name", "paused_by", "paused_at",
        "pause_reason"}], "jobs_by_state", "summary_age_seconds" (None before
        the summaries duty first ran)}. Every duration in seconds.
    """
    o = overview(conn, live_seconds=live_seconds)
    return {
        "now": o["now"], "waiting": o["waiting"], "reason_counts": o["reason_counts"],
        "primary_counts": o["primary_counts"], "oldest_waiting": o["oldest_waiting"],
        "organizations": [{k: r[k] for k in ("name", "running", "max_running")}
                          for r in o["organizations"]],
        "projects": [{**{k: p[k] for k in ("name", "organization", "running", "max_running",
                                           "weight")}, "paused": p["paused_at"] is not None}
                     for p in o["projects"]],
        "pools": [{k: q[k] for k in ("name", "slots", "running", "runner_slots",
                                     "free_runner_slots", "live_runners", "waiting")}
                  for q in sorted(o["pools"], key=lambda q: q["name"])],
        "uncertain_targets": [{k: t[k] for k in ("name", "holder_job_id", "holder_project",
                                                 "held_since")}
                              for t in o["targets"] if t["state"] == "uncertain"],
        "paused_projects": [{k: p[k] for k in ("name", "organization", "paused_by", "paused_at",
                                               "pause_reason")} for p in o["paused_projects"]],
        "paused_pools": [{k: q[k] for k in ("name", "paused_by", "paused_at", "pause_reason")}
                         for q in o["paused_pools"]],
        "jobs_by_state": o["jobs_by_state"],
        "summary_age_seconds": o["summary_age_seconds"],
    }


@transition("list_projects")
def list_projects(conn) -> list[dict[str, Any]]:
    """Projects with organization, limits, running count, pause state and pools."""
    return list(Q.list_projects(conn))


@transition("list_targets")
def list_targets(conn) -> list[dict[str, Any]]:
    """Targets, uncertain first, with holder and last-attempt evidence."""
    return list(Q.list_targets(conn))


@transition("list_runners")
def list_runners(conn, *, live_seconds: float = 90.0) -> list[dict[str, Any]]:
    """Runners (live, draining, recently stopped) with slots used."""
    return list(Q.list_runners(conn, live_seconds=live_seconds))


@transition("list_runners_page")
def list_runners_page(conn, *, live_seconds: float = 90.0, fold_seconds: float = 600.0,
                      stopped_limit: int = 10) -> dict[str, Any]:
    """The runners page: {"runners": runners not stopped (seen within the hour), then those
    stopped or lost in the last ``fold_seconds`` (at most ``stopped_limit``, newest first);
    "stopped_total": every stopped or lost runner on record; "folded": how many of them are
    not shown; "duties": every elected duty with its holder (list_duties, sql/runners.sql)}."""
    runners = list(Q.list_runners_page(conn, live_seconds=live_seconds, fold_seconds=fold_seconds,
                                       stopped_limit=stopped_limit))
    total = Q.count_stopped_runners(conn)
    shown = sum(1 for r in runners if r["stopped_at"] is not None)
    return {"runners": runners, "stopped_total": total, "folded": total - shown,
            "duties": list(Q.list_duties(conn))}


@transition("list_stopped_runners")
def list_stopped_runners(conn, *, before_id: int = 2**63 - 1, limit: int = 50) -> dict[str, Any]:
    """Stopped and lost runners with ids below ``before_id``, newest first, at most ``limit``:
    {"runners": [...], "older": the ``before_id`` of the next page, or None;
    "stopped_total": every stopped or lost runner on record}."""
    runners = list(Q.list_stopped_runners(conn, before_id=before_id, limit=limit))
    return {"runners": runners, "older": runners[-1]["id"] if len(runners) == limit else None,
            "stopped_total": Q.count_stopped_runners(conn)}


@transition("list_filter_choices")
def list_filter_choices(conn) -> dict[str, list[str]]:
    """Organization, project and pool names for the console's filter menus, sorted:
    {"organizations": [...], "projects": [...], "pools": [...]}."""
    row = Q.list_filter_choices(conn)
    return {k: list(v) for k, v in row.items()}


@transition("list_recent_jobs")
def list_recent_jobs(conn, *, limit: int = 50, state: str | None = None,
                     before_id: int = 2**63 - 1) -> list[dict[str, Any]]:
    """The newest jobs of any state (or of ``state``) with ids below ``before_id``."""
    if state is None:
        return list(Q.list_recent_jobs(conn, limit=limit, before_id=before_id))
    return list(Q.list_recent_jobs_in_state(conn, limit=limit, state=state, before_id=before_id))


# --- job lists (the Jobs page, `pgdispatch jobs list`, GET /api/v1/jobs) -----------------


MAX_BIGINT = 2**63 - 1
# An age filter beyond this says nothing more (and keeps make_interval far from overflow).
MAX_AGE_SECONDS = 10 * 366 * 86400
JOB_FILTERS = ("state", "organization", "project", "pool", "target", "runner_id", "reason",
               "older_than_seconds", "younger_than_seconds")


def _check_job_list_input(*, state, reason, runner_id, older_than_seconds,
                          younger_than_seconds, before_id, after_id, limit) -> None:
    if state is not None and state not in JOB_STATES:
        raise InvalidInput(f"unknown state {_quoted(state)} (one of {', '.join(JOB_STATES)})")
    if reason is not None and reason not in REASON_CODES:
        raise InvalidInput(f"unknown reason {_quoted(reason)} (one of {', '.join(REASON_CODES)})")
    for name, value in (("runner", runner_id), ("before_id", before_id), ("after_id", after_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value <= MAX_BIGINT or (name == "runner" and value == 0)):
            raise InvalidInput(f"{name} must be a whole number between 1 and {MAX_BIGINT}")
    for name, value in (("older_than", older_than_seconds), ("younger_than", younger_than_seconds)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value <= MAX_AGE_SECONDS):
            raise InvalidInput(f"{name} must be a number of seconds between 0 and {MAX_AGE_SECONDS}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 500:
        raise InvalidInput("limit must be a whole number between 1 and 500")


def _job_filter_ids(conn, *, organization, project, pool, target, runner_id) -> dict[str, Any]:
    """The ids of the filter names; UnknownFilter naming the first that does not exist,
    InvalidInput for a name that is not text UTF-8 can hold (a command line's stray byte)."""
    for name, given in (("organization", organization), ("project", project), ("pool", pool),
                        ("target", target)):
        if isinstance(given, str):
            _check_encodable(name, given)
    ids = Q.find_job_filters(conn, organization=organization, project=project, pool=pool,
                             target=target, runner_id=runner_id)
    for name, given in (("organization", organization), ("project", project), ("pool", pool),
                        ("target", target)):
        if given is not None and ids[f"{name}_id"] is None:
            raise UnknownFilter(f"unknown {name} {_quoted(given)}")
    if runner_id is not None and ids["runner_id"] is None:
        raise UnknownFilter(f"unknown runner {runner_id}")
    return ids


@transition("list_jobs")
def list_jobs(conn, *, state: str | None = None, organization: str | None = None,
              project: str | None = None, pool: str | None = None, target: str | None = None,
              runner_id: int | None = None, reason: str | None = None,
              older_than_seconds: float | None = None, younger_than_seconds: float | None = None,
              before_id: int | None = None, after_id: int | None = None, limit: int = 50,
              live_seconds: float = 90.0) -> dict[str, Any]:
    """One page of jobs, filtered: the read behind the Jobs page, ``jobs list`` and
    ``GET /api/v1/jobs``.

    Filters (all optional, combined with AND): ``state`` (a job state), ``organization``,
    ``project``, ``pool``, ``target`` (names), ``runner_id`` (the runner of the job's latest
    attempt: the one running it, for a running job), ``older_than_seconds`` /
    ``younger_than_seconds`` (the job's age, now minus created_at, in seconds). With
    ``reason`` (a code of explain.REASON_CODES) the list is the queue's: waiting jobs with
    that reason (``list_waiting``), oldest first, paged with ``after_id``.

    Paging by keyset, the cursors job ids: without ``after_id`` the newest jobs below
    ``before_id``, newest first; with it the oldest jobs above ``after_id`` (and below
    ``before_id``), oldest first. Both together are a window: its every page keeps
    ``before_id`` in ``next``. Newest and oldest by id, except with ``older_than_seconds``
    (and no ``runner_id``): then by creation, (created_at, id), which the id order follows
    only nearly (created_at is the submitting transaction's start), and a cursor stands at
    its job's place in that order; an id that is no job's (deleted, or never given) stands
    at the created_at of the next job above it by id (``before_id``) or below it
    (``after_id``), and bounds nothing when there is none (find_job_list_bounds,
    sql/jobs.sql). ``younger_than_seconds`` alone keeps the id order.

    Returns:
        {"jobs": [row], "order": "newest_first" | "oldest_first" (by id, or by creation with
        ``older_than_seconds``), "next": {"before_id": id} or {"after_id": id} (with
        "before_id" too in a window) (the same call with it gives the following page) or
        None (no more), "now": the database's time}. Each row: id, state, priority,
        command, project, organization, pool, target, created_at, ready_at, started_at (first claim),
        finished_at, last_error, attempt_no, runner_id, runner (name) and claimed_at of the
        latest attempt, age_seconds, running_seconds (running jobs: since the running
        attempt's claim), duration_seconds (finished jobs: first claim to finish); rows of
        a reason list also carry "reasons".

    Raises:
        InvalidInput: a state, reason, id, age or limit out of range.
        UnknownFilter (an InvalidInput): a name or runner id that does not exist.
    """
    _check_job_list_input(state=state, reason=reason, runner_id=runner_id,
                          older_than_seconds=older_than_seconds,
                          younger_than_seconds=younger_than_seconds, before_id=before_id,
                          after_id=after_id, limit=limit)
    ids = _job_filter_ids(conn, organization=organization, project=project, pool=pool,
                          target=target, runner_id=runner_id)
    if reason is not None:
        return _list_waiting_with_reason(
            conn, reason=reason, state=state, organization=organization, project=project,
            pool=pool, target_id=ids["target_id"], runner_id=runner_id,
            older_than_seconds=older_than_seconds, younger_than_seconds=younger_than_seconds,
            before_id=before_id, after_id=after_id or 0, limit=limit, live_seconds=live_seconds)
    params = dict(project_ids=ids["project_ids"], pool_id=ids["pool_id"],
                  target_id=ids["target_id"], runner_id=runner_id,
                  older_than_seconds=older_than_seconds, younger_than_seconds=younger_than_seconds,
                  before_id=before_id or MAX_BIGINT, after_id=after_id, upper_at=None,
                  upper_id=None, lower_at=None, lower_id=None, limit=limit)
    now = Q.begin_job_list(conn)["now"]
    if older_than_seconds is not None and runner_id is None:
        # creation order: the range's two ends as values, so that the plan sees how much of
        # jobs_created_idx lies between them
        params.update(Q.find_job_list_bounds(conn, before_id=params["before_id"], after_id=after_id,
                                             older_than_seconds=older_than_seconds,
                                             younger_than_seconds=younger_than_seconds))
    rows = list(Q.list_jobs(conn, state=state, **params))
    forward = after_id is not None
    more = len(rows) == limit
    return {"jobs": rows, "order": "oldest_first" if forward else "newest_first",
            "next": _following(rows[-1]["id"], forward=forward, before_id=before_id) if more else None,
            "now": now}


def _following(last_id: int, *, forward: bool, before_id: int | None) -> dict[str, int]:
    """The cursor of the page after the one that ended at ``last_id``: newest first, the ids
    below it; oldest first, the ids above it, still below ``before_id`` when one was given
    (a window between two ids keeps its upper bound on every page)."""
    if not forward:
        return {"before_id": last_id}
    return {"after_id": last_id} if before_id is None else {"after_id": last_id, "before_id": before_id}


def _list_waiting_with_reason(conn, *, reason, state, organization, project, pool, target_id,
                              runner_id, older_than_seconds, younger_than_seconds, before_id,
                              after_id, limit, live_seconds) -> dict[str, Any]:
    """list_jobs with a reason: pages of list_waiting (which filters by reason, organization,
    project and pool), the other filters applied to its rows, until ``limit`` match."""
    now = Q.begin_job_list(conn)["now"]
    out: list[dict[str, Any]] = []
    cursor: int | None = after_id
    if runner_id is not None or state not in (None, *WAITING_STATES):
        cursor = None  # a waiting job has no runner, and is in a waiting state
    while cursor is not None and len(out) < limit:
        page = list_waiting(conn, after_id=cursor, limit=max(limit, 200), organization=organization,
                            project=project, pool=pool, reason=reason, live_seconds=live_seconds)
        cursor = page["next_after_id"]
        for job in page["jobs"]:
            if before_id is not None and job["id"] >= before_id:
                cursor = None
                break
            age = (now - job["created_at"]).total_seconds()
            if ((state is None or job["state"] == state)
                    and (target_id is None or job.get("target_id") == target_id)
                    and (older_than_seconds is None or age >= older_than_seconds)
                    and (younger_than_seconds is None or age < younger_than_seconds)):
                out.append({**job, "runner_id": None, "runner": None, "attempt_no": None,
                            "claimed_at": None, "age_seconds": age, "running_seconds": None,
                            "duration_seconds": None, "started_at": job.get("started_at"),
                            "finished_at": None, "last_error": job.get("last_error")})
                if len(out) == limit:
                    # more may follow: the next page starts after the last one listed
                    cursor = job["id"]
                    break
    return {"jobs": out, "order": "oldest_first",
            "next": _following(cursor, forward=True, before_id=before_id)
                    if cursor is not None and out else None, "now": now}


# --- the job search (`pgdispatch jobs search`, GET /api/v1/jobs/search, the console's box) -----

# Trigrams (pg_trgm) need three characters: a shorter text matches through no index entry.
SEARCH_MIN_CHARS = 3
SEARCH_MAX_CHARS = 200
# The newest jobs (that pass the filters) the search reads first, by id, before it asks the
# trigram index: enough to answer a word most commands contain, few enough to cost a few ms.
SEARCH_PROBE_ROWS = 1000
# ... and, when that held matches too sparse for a page, as many more of the newest as a
# page takes at that density (and a half), when that is at most this many: cheaper than the
# trigram index for a word whose trigrams most commands share ("step7").
SEARCH_PROBE_ROWS_MAX = 10_000
# Otherwise the trigram step reads the matches of a window of the newest ids first, sized
# from the probe's density so that it holds this many pages of matches on average (as if it
# had found one when it found none), then below the window only when that fell short of a
# page (docs/benchmarks.md, "Finding a job").
SEARCH_WINDOW_PAGES = 2
_SEARCH_ID = re.compile(r"#?([0-9]+)")


def parse_search(q: object) -> tuple[int | None, str | None]:
    """What a search text asks for: (job id, ILIKE pattern of the command text), either None.
    ``#N`` is job N only; ``N`` (digits) is job N and the commands containing N (three
    digits or more); any other text the commands containing it, case-insensitively, with
    ``%``, ``_`` and backslash taken literally. Leading and trailing blanks are dropped.

    Raises:
        InvalidInput: not a string, not UTF-8, blank, longer than SEARCH_MAX_CHARS, a
            control character, ``#N`` with N out of 1…2**63-1, or text (not an id) shorter
            than SEARCH_MIN_CHARS.
    """
    if not isinstance(q, str):
        raise InvalidInput("search text must be text")
    _check_encodable("search text", q)
    text = q.strip()
    if not text:
        raise InvalidInput("search text is empty: give 3 characters or more of a command, or a job id (#N)")
    if len(text) > SEARCH_MAX_CHARS:
        raise InvalidInput(f"search text is longer than {SEARCH_MAX_CHARS} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise InvalidInput("search text must not contain control characters")
    found = _SEARCH_ID.fullmatch(text)
    if found and text.startswith("#") and not 1 <= int(found.group(1)) <= MAX_BIGINT:
        raise InvalidInput(f"job id must be between 1 and {MAX_BIGINT}")
    if found and int(found.group(1)) <= MAX_BIGINT:
        job_id = int(found.group(1))
        if text.startswith("#") or len(text) < SEARCH_MIN_CHARS:
            return job_id, None
        return job_id, _contains(text)
    if len(text) < SEARCH_MIN_CHARS:
        raise InvalidInput(f"search text {_quoted(text)} is too short: give {SEARCH_MIN_CHARS} "
                           "characters or more of a command (trigram search), or a job id (#N)")
    return None, _contains(text)


# The parts of a search text the trigram index may be asked for alone: each run of letters
# and digits (a word, what pg_trgm makes trigrams of; PostgreSQL docs F.35, "pg_trgm"), with
# the character before it when there is one — a word's start is then part of the pattern
# and its trigrams padded (" 23" of "-237": words that start so, far fewer than those that
# hold "237") — SEARCH_MIN_CHARS characters or more; at most this many, first ones first.
SEARCH_WORDS_MAX = 8
_SEARCH_WORD = re.compile(r"[^\W_]+")


def _search_words(q: str) -> list[str]:
    """The parts of search text ``q`` (``_SEARCH_WORD``) as ILIKE-escaped substrings,
    distinct, in order; at most SEARCH_WORDS_MAX."""
    text = q.strip()
    parts = [_contains(text[max(m.start() - 1, 0):m.end()])[1:-1]
             for m in _SEARCH_WORD.finditer(text)]
    return list(dict.fromkeys(p for p in parts if len(p.replace("\\", "")) >= SEARCH_MIN_CHARS)
                )[:SEARCH_WORDS_MAX]


def _narrow_pattern(pattern: str, words: list[str], hits: list[int]) -> str:
    """The ILIKE pattern the trigram index is asked for: the word of ``words`` found in the
    fewest of the probe's newest commands (``hits``, one count per word; the longer word on a
    tie), when another word is found in more of them; otherwise ``pattern`` itself. Any of
    them is matched by every command ``pattern`` matches, so the answer is the same; only
    the posting lists GIN reads differ (docs/benchmarks.md, "Finding a job")."""
    if len(words) < 2 or len(set(hits)) < 2:
        return pattern
    rarest = min(range(len(words)), key=lambda i: (hits[i], -len(words[i])))
    return f"%{words[rarest]}%"


def _contains(text: str) -> str:
    """The ILIKE pattern of commands containing ``text`` literally (backslash, the default
    escape, before % and _)."""
    return "%" + re.sub(r"([\\%_])", r"\\\1", text) + "%"


@transition("search_jobs")
def search_jobs(conn, *, q: str, project: str | None = None, submitter: str | None = None,
                state: str | None = None, before_id: int | None = None,
                limit: int = 50) -> dict[str, Any]:
    """Find jobs: the read behind ``jobs search``, ``GET /api/v1/jobs/search`` and the
    console's search box. ``q`` as parse_search reads it: ``#N`` is job N, digits are job N
    and the commands containing them, other text (3 characters or more) the jobs whose command
    (its words joined by spaces) contains it, case-insensitively (the trigram index
    jobs_command_trgm_idx). Filters: ``project`` (name), ``submitter`` (submitted_by, exact),
    ``state``. Newest first, keyset-paged by id: ``before_id`` from the previous page's
    ``next``; the id match comes first, on the first page only. Two steps: the newest
    SEARCH_PROBE_ROWS jobs that pass the filters, read by id (a common word is found there),
    then, if they held less than a page, the trigram index with bitmap scans only, in a
    window of the newest ids first (_search_commands).

    Returns:
        {"query": q stripped, "job_id": the id asked for or None, "jobs": [list_jobs row +
        "match": "id" | "command"], "order": "newest_first", "next": {"before_id": id} or
        None, "now": the database's time}.

    Raises:
        InvalidInput: the text (parse_search), a state, before_id or limit out of range,
            a submitter or project name empty, longer than 200 characters, not UTF-8 or with
            control characters.
        UnknownFilter (an InvalidInput): a project that does not exist.
    """
    job_id, pattern = parse_search(q)
    _check_job_list_input(state=state, reason=None, runner_id=None, older_than_seconds=None,
                          younger_than_seconds=None, before_id=before_id, after_id=None,
                          limit=limit)
    for kind, name in (("submitter", submitter), ("project", project)):
        if name is not None:
            check_text(kind, name, max_len=200)
            if any(ord(c) < 32 or ord(c) == 127 for c in name):
                raise InvalidInput(f"{kind} must not contain control characters")
    ids = _job_filter_ids(conn, organization=None, project=project, pool=None, target=None,
                          runner_id=None)
    now = Q.begin_job_list(conn)["now"]
    filters = dict(job_id=job_id, project_id=ids["project_id"], submitter=submitter, state=state,
                   before_id=before_id)
    if pattern is None:
        rows = list(Q.search_jobs(conn, pattern=None, narrow=None, ids=None, floor_id=None,
                                  limit=limit, **filters))
    else:
        rows = _search_commands(conn, q=q, pattern=pattern, limit=limit, filters=filters)
    commands = [r for r in rows if r["match"] == "command"]
    return {"query": q.strip(), "job_id": job_id, "jobs": rows, "order": "newest_first",
            "next": {"before_id": commands[-1]["id"]} if len(commands) == limit else None,
            "now": now}


def _search_commands(conn, *, q: str, pattern: str, limit: int,
                     filters: dict[str, Any]) -> list[dict[str, Any]]:
    """search_jobs' rows for a command text: the id match (if any) and at most ``limit``
    commands matching ``pattern``, newest first. Each step is bounded by what it finds:

    1. The probe (probe_recent_jobs): the newest SEARCH_PROBE_ROWS jobs that pass the
       filters. A page of matches among them, or fewer jobs than that, is the answer; when
       it found some, but too few for a page, and a page at that density takes at most
       SEARCH_PROBE_ROWS_MAX jobs, a wider probe of that many answers.
    2. Otherwise the trigram index (search_jobs with :pattern), from a floor id up: a window
       of the newest ids that holds SEARCH_WINDOW_PAGES pages of matches at the density the
       probe found (at least one match assumed), so that the heap is read for the matches of
       the window only — the GIN bitmap ANDed with a jobs_pkey range.
    3. Only when the window held less than a page: the rest of the page below it.
    """
    words = _search_words(q)
    probe = Q.probe_recent_jobs(conn, pattern=pattern, probe=SEARCH_PROBE_ROWS,
                                words=[f"%{w}%" for w in words], **filters)
    found, sample = None, probe
    if len(probe["ids"]) >= limit or probe["examined"] < SEARCH_PROBE_ROWS:
        found = probe["ids"][:limit]
    elif probe["ids"]:
        wider = -(-SEARCH_PROBE_ROWS * limit * 3 // (2 * len(probe["ids"])))
        if wider <= SEARCH_PROBE_ROWS_MAX:
            sample = Q.probe_recent_jobs(conn, pattern=pattern, probe=wider, words=[], **filters)
            if len(sample["ids"]) >= limit or sample["examined"] < wider:
                found = sample["ids"][:limit]
    if found is not None:
        return list(Q.search_jobs(conn, pattern=None, narrow=None, ids=found, floor_id=None,
                                  limit=limit, **filters))
    narrow = _narrow_pattern(pattern, words, probe["word_hits"])
    # the window from the widest probe's density: its matches per id; no window when the
    # probe examined nothing (SEARCH_PROBE_ROWS 0: no density to size it by)
    floor_id = None
    if sample["highest_id"] is not None:
        span = sample["highest_id"] - sample["lowest_id"] + 1
        window = -(-span * limit * SEARCH_WINDOW_PAGES // max(len(sample["ids"]), 1))
        floor_id = sample["highest_id"] - window + 1
    # set back on success; an error aborts the transaction, which undoes SET LOCAL itself
    saved = Q.begin_job_search(conn)
    rows = list(Q.search_jobs(conn, pattern=pattern, narrow=narrow, ids=None,
                              floor_id=floor_id, limit=limit, **filters))
    got = sum(r["match"] == "command" for r in rows)
    if got < limit and floor_id is not None and floor_id > 1:
        below = {**filters, "before_id": floor_id}
        rows += Q.search_jobs(conn, pattern=pattern, narrow=narrow, ids=None, floor_id=None,
                              limit=limit - got, **below)
    Q.end_job_search(conn, indexscan=saved["indexscan"], seqscan=saved["seqscan"])
    return rows


# --- show one project, pool, target, runner (`pgdispatch … show`, /api/v1/…/{name}) --------

HOLDERS_SHOWN = 50


def _running_jobs(conn, **filters: Any) -> list[dict[str, Any]]:
    return list_jobs(conn, state="running", limit=HOLDERS_SHOWN, **filters)["jobs"]


@transition("show_project")
def show_project(conn, *, name: str) -> dict[str, Any]:
    """One project as list_projects gives it, with "running_jobs" (the jobs holding its
    capacity, newest first, at most HOLDERS_SHOWN; list_jobs rows) and "audit" (its last 10
    audit events, newest first: subject "project:NAME" exactly, no other project's).

    Raises: NotFound.
    """
    project = next((p for p in Q.list_projects(conn) if p["name"] == name), None)
    if project is None:
        raise NotFound(f"unknown project {_quoted(name)}")
    return {**project, "running_jobs": _running_jobs(conn, project=name),
            "audit": list_subject_events(conn, subject=f"project:{name}", limit=10)}


@transition("list_pools")
def list_pools(conn, *, live_seconds: float = 90.0) -> list[dict[str, Any]]:
    """Every pool: id, name, slots (the pool's own limit) and running (slots held), and what
    its live runners give it: runner_slots (their slots) and free_runner_slots (those not
    running a job), both 0 when no live runner serves it."""
    world = read_world(conn, live_seconds=live_seconds)
    return [{**pool, "runner_slots": world.runner_slots.get(pool["id"], (0, 0))[0],
             "free_runner_slots": world.runner_slots.get(pool["id"], (0, 0))[1]}
            for pool in world.pools.values()]


@transition("show_pool")
def show_pool(conn, *, name: str, live_seconds: float = 90.0) -> dict[str, Any]:
    """One pool as list_pools gives it, with "runners" (the live runners that serve it:
    list_runners rows) and "running_jobs" (at most HOLDERS_SHOWN, newest first).

    Raises: NotFound.
    """
    pool = next((p for p in list_pools(conn, live_seconds=live_seconds) if p["name"] == name), None)
    if pool is None:
        raise NotFound(f"unknown pool {_quoted(name)}")
    runners = [r for r in Q.list_runners(conn, live_seconds=live_seconds)
               if r["is_live"] and name in r["pools"]]
    return {**pool, "runners": runners, "running_jobs": _running_jobs(conn, pool=name)}


@transition("show_target")
def show_target(conn, *, name: str) -> dict[str, Any]:
    """One target as list_targets gives it (state, holder, evidence of its last attempt),
    with "audit" (its last 10 audit events, newest first: resolutions; subject "target:NAME"
    exactly, no other target's).

    Raises: NotFound.
    """
    target = next((t for t in Q.list_targets(conn) if t["name"] == name), None)
    if target is None:
        raise NotFound(f"unknown target {_quoted(name)}")
    return {**target, "next": _target_next(conn, target), "superseded": _target_superseded(conn, target),
            "audit": list_subject_events(conn, subject=f"target:{name}", limit=10)}


# how many waiting deployments and superseded ones a target's page lists
TARGET_NEXT_SHOWN = 20
TARGET_SUPERSEDED_SHOWN = 10


def _target_next(conn, target: dict[str, Any]) -> dict[str, Any]:
    """What runs next on ``target``: {"deploy_order", "head_job_id" (the deployment a claim
    takes next, pgd_target_head; None when none is ready), "waiting" (deployments waiting in
    all), "jobs": at most TARGET_NEXT_SHOWN of them, the ready ones first in the target's
    order, then the others: [{"job_id", "project", "pool", "state", "priority",
    "created_at", "ready_at", "is_head", "is_ready", "reason", "message",
    "reasons": [{"code", "message", "details"}]}]}."""
    world = read_world(conn)
    rows = list(Q.list_target_waiting(conn, target_id=target["id"], limit=TARGET_NEXT_SHOWN,
                                      newest_first=target["deploy_order"] == "newest_ready_first"))
    head = world.target_heads.get(target["id"])
    jobs = []
    for j in rows:
        reasons = reasons_for(j, world)
        jobs.append({"job_id": j["id"], "project": j["project"], "pool": j["pool"], "state": j["state"],
                     "priority": j["priority"], "created_at": j["created_at"], "ready_at": j["ready_at"],
                     "is_head": j["id"] == head, "is_ready": j["is_ready"],
                     "reason": reasons[0].code, "message": reasons[0].message,
                     "reasons": [r.as_dict() for r in reasons]})
    return {"deploy_order": target["deploy_order"], "head_job_id": head,
            "waiting": Q.count_target_waiting(conn, target_id=target["id"]), "jobs": jobs}


def _target_superseded(conn, target: dict[str, Any]) -> dict[str, Any]:
    """How many deployments to ``target`` ended superseded and by what: {"total",
    "last_hour", "latest": at most TARGET_SUPERSEDED_SHOWN, newest first: [{"job_id",
    "project", "superseded_by", "at"}]}."""
    counts = Q.count_target_superseded(conn, target_id=target["id"])
    latest = [{"job_id": r["id"], "project": r["project"], "superseded_by": r["superseded_by"],
               "at": r["finished_at"]}
              for r in Q.list_target_superseded(conn, target_id=target["id"], limit=TARGET_SUPERSEDED_SHOWN)]
    return {"total": counts["total"], "last_hour": counts["last_hour"], "latest": latest}


@transition("show_runner")
def show_runner(conn, *, runner_id: int, live_seconds: float = 90.0) -> dict[str, Any]:
    """One runner of any age (get_runner, sql/runners.sql) with "running_jobs" (the jobs it
    runs now, newest first, at most HOLDERS_SHOWN).

    Raises: NotFound (also for an id no bigint holds).
    """
    if isinstance(runner_id, bool) or not isinstance(runner_id, int) or not 1 <= runner_id <= MAX_BIGINT:
        raise NotFound(f"unknown runner {runner_id}")
    runner = Q.get_runner(conn, runner_id=runner_id, live_seconds=live_seconds)
    if runner is None:
        raise NotFound(f"unknown runner {runner_id}")
    return {**runner, "running_jobs": _running_jobs(conn, runner_id=runner_id)}
