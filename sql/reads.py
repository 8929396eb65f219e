"""Read-only queries for the console, the API and the CLI (no state changes here)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from .db import transition
from .errors import InvalidInput, NotFound
from .explain import (read_world, reasons_for, summary_any_reason_counts, summary_oldest_waiting,
                      summary_reason_counts)
from .queries import Q

# the queue's orders (list_waiting): by id, or longest waiting first
WAITING_SORTS = ("id", "oldest")


@transition("show_job")
def show_job(conn, *, job_id: int, tail_chars: int = 65536) -> dict[str, Any]:
    """One job with its attempts (oldest first; each with up to ``tail_chars`` of output and
    ``duration_seconds``), its times in seconds (``age_seconds``, ``duration_seconds`` once
    it ended, ``waiting_since`` / ``waiting_seconds`` while it waits, ``running_seconds``
    while it runs: get_job, sql/jobs.sql) and ``resolution``: how its lost deployment was
    decided — {"outcome", "actor", "at", "note", "action"} (``resolve_target`` by an
    operator, ``late_report`` by the attempt itself) — or None.

    Raises: NotFound.
    """
    job = Q.get_job(conn, job_id=job_id)
    if job is None:
        raise NotFound(f"unknown job {job_id}")
    job["attempts"] = list(Q.list_attempts(conn, job_id=job_id, tail_chars=tail_chars))
    resolution = Q.last_job_resolution(conn, job_id=job_id)
    job["resolution"] = None if resolution is None else {
        k: resolution[k] for k in ("outcome", "actor", "at", "note", "action")}
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
                 after_since: dt.datetime | None = None) -> dict[str, Any]:
    """Waiting jobs (blocked, queued, uncertain) after a cursor, each with its reasons and
    ``waiting_since`` (pgd_waiting_since, sql/functions/summaries.sql). ``sort``: "id" (by
    id, after ``after_id``) or "oldest" (longest waiting first, after (``after_since``,
    ``after_id``); ``after_since`` None: from the start).

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
    filters = {"organization": organization, "project": project, "pool": pool}
    while len(out) < limit:
        if sort == "oldest":
            batch = list(Q.list_waiting_jobs_by_age(conn, after_since=since, after_id=cursor,
                                                    limit=batch_size, **filters))
        else:
            batch = list(Q.list_waiting_jobs(conn, after_id=cursor, limit=batch_size, **filters))
        if not batch:
            cursor = None
            break
        for job in batch:
            cursor, since = job["id"], job["waiting_since"]
            reasons = [r.as_dict() for r in reasons_for(job, world)]
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


@transition("overview")
def overview(conn, *, live_seconds: float = 90.0) -> dict[str, Any]:
    """What the overview page (and the web's /metrics) shows.

    Returns a dict:
        now; organizations, projects, pools (each with running, and a pool with
        ``runner_slots``, ``free_runner_slots``, ``live_runners`` of its live runners and
        ``waiting``: its blocked and queued jobs); targets (uncertain first);
        ``paused_projects`` (with paused_by, paused_at, pause_reason);
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
        "targets": list(world.targets.values()),
        "reason_counts": every,
        "primary_counts": primary,
        "waiting": sum(primary.values()),
        "oldest_waiting": oldest,
        "summary_age_seconds": max(ages) if ages else None,
        "jobs_by_state": by_state,
        "runners": list(Q.list_runners(conn, live_seconds=live_seconds)),
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
