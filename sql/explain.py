"""Why is this job waiting? Reasons in DESIGN.md's order of precedence, with numbers.

Durable blockers (dependency, approval) come from the job row; everything else is derived at
read time from the small tables (organizations and pools with their held slots, projects,
runners, targets) read once into a ``World`` snapshot, so explaining a page of fifty jobs
costs a handful of queries.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from .db import transition
from .errors import NotFound
from .queries import Q

# DESIGN.md, "Why is this job waiting?" — the order is the precedence. The first reason of
# a job is its primary one; counts, filters and metrics count a job under each of its
# reasons, with the primary counts beside them (docs/design.md).
REASON_CODES = (
    "dependency_pending", "approval_required", "project_paused", "pool_paused", "retry_delayed",
    "no_authorized_runner", "capacity_organization", "capacity_project", "capacity_pool",
    "target_order", "target_held", "target_uncertain", "runners_busy", "ready",
)
WAITING_STATES = ("blocked", "queued", "uncertain")
# Reasons that hold for every waiting job of a (project, pool) alike, judged at read time
# from the small tables; the others are the job's own (its row, its target).
GROUP_REASONS = ("project_paused", "pool_paused", "no_authorized_runner", "capacity_organization",
                 "capacity_project", "capacity_pool")
# What a job with no other reason is: waiting for a runner slot, or next in line.
LAST_REASONS = ("runners_busy", "ready")


@dataclasses.dataclass(frozen=True)
class Reason:
    """One reason a job is not running: a code from REASON_CODES and a message with numbers."""

    code: str
    message: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


@dataclasses.dataclass
class World:
    """A snapshot of the small tables, taken in one read transaction."""

    now: dt.datetime
    organizations: dict[int, dict]
    projects: dict[int, dict]
    pools: dict[int, dict]
    targets: dict[int, dict]
    grants: set[tuple[int, int]]
    live_pools: set[int]
    # pool id -> (slots of its live runners, how many of them are free)
    runner_slots: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # pool id -> ids of its live runners (granted, not draining), by id
    runner_ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # pool id -> logins of live runners that ask for it without its grant
    ungranted_logins: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    # target id -> its head: the ready deployment a claim takes next (pgd_target_head); only
    # targets with one
    target_heads: dict[int, int] = dataclasses.field(default_factory=dict)


def _hhmm(ts: dt.datetime | None) -> str:
    return ts.astimezone(dt.timezone.utc).strftime("%H:%M:%S UTC") if ts else "?"


@transition("read_world")
def read_world(conn, *, live_seconds: float = 90.0) -> World:
    """Snapshot organizations, projects, pools, targets, grants and live runners.

    ``live_seconds``: a runner whose last heartbeat is older than this is not live.
    """
    now = conn.execute("SELECT now() AS now").fetchone()["now"]
    live = list(Q.live_runner_pools(conn, live_seconds=live_seconds))
    return World(
        now=now,
        organizations={r["id"]: r for r in Q.list_organizations(conn)},
        projects={r["id"]: r for r in Q.list_projects(conn)},
        pools={r["id"]: r for r in Q.list_pools(conn)},
        targets={r["id"]: r for r in Q.list_targets(conn)},
        grants={(r["project_id"], r["pool_id"]) for r in Q.list_grants(conn)},
        live_pools={r["pool_id"] for r in live if r["runner_slots"] > 0},
        runner_slots={r["pool_id"]: (r["runner_slots"], r["free_runner_slots"])
                      for r in live if r["runner_slots"] > 0},
        runner_ids={r["pool_id"]: list(r["runner_ids"]) for r in live if r["runner_slots"] > 0},
        ungranted_logins={r["pool_id"]: list(r["ungranted_logins"]) for r in live
                          if r["ungranted_logins"]},
        target_heads={r["target_id"]: r["head_job_id"] for r in Q.list_target_heads(conn)},
    )


# targets.deploy_order in words, for the target_order reason and the target page
DEPLOY_ORDER_WORDS = {"oldest_first": "oldest first", "newest_ready_first": "newest ready first"}


def reasons_for(job: dict[str, Any], world: World,
                pending: list[dict[str, Any]] | None = None) -> list[Reason]:
    """Every reason that holds for ``job`` (a jobs row with project_id, pool_id, target_id…),
    in precedence order; ``[Reason("ready")]`` when none does. Running and finished jobs
    get an empty list. ``pending``: the unfinished dependencies, for a detailed message."""
    state = job["state"]
    if state not in WAITING_STATES:
        return []
    project = world.projects[job["project_id"]]
    org = world.organizations[project["organization_id"]]
    pool = world.pools[job["pool_id"]]
    target = world.targets.get(job["target_id"]) if job.get("target_id") else None
    out: list[Reason] = []

    if state == "uncertain":
        name = target["name"] if target else "?"
        return [Reason("target_uncertain",
                       f"deployment to target {name} was lost with its runner; its outcome is "
                       f"unknown until an operator resolves the target",
                       {"target": name})]

    if job.get("pending_dependencies", 0) > 0:
        if pending:
            listed = ", ".join(f"job {d['id']} ({d['state']})" for d in pending[:5])
            more = f" and {len(pending) - 5} more" if len(pending) > 5 else ""
            msg = f"waiting for {listed}{more}"
        else:
            n = job["pending_dependencies"]
            msg = f"waiting for {n} dependenc{'y' if n == 1 else 'ies'} to succeed"
        out.append(Reason("dependency_pending", msg,
                          {"pending": job["pending_dependencies"],
                           "jobs": [d["id"] for d in (pending or [])]}))
    if job.get("requires_approval") and job.get("approved_at") is None:
        submitter = job.get("submitted_by")
        if target is not None and target.get("requires_approval"):
            role = target.get("approver_role") or "operator"
            msg = (f"target {target['name']} requires approval by {'an' if role[0] in 'aeiou' else 'a'} "
                   f"{role}; submitted by {submitter}")
            details = {"target": target["name"], "approver_role": role, "submitted_by": submitter}
        else:
            msg = f"waiting for an operator's approval (asked for at submission by {submitter})"
            details = {"target": None, "approver_role": "operator", "submitted_by": submitter}
        out.append(Reason("approval_required", msg, details))
    if project["paused_at"] is not None:
        out.append(Reason("project_paused",
                          f"project {project['name']} paused by {project['paused_by']} at "
                          f"{_hhmm(project['paused_at'])}: {project['pause_reason']}",
                          {"project": project["name"], "paused_by": project["paused_by"],
                           "paused_at": project["paused_at"].isoformat(),
                           "reason": project["pause_reason"]}))
    if pool.get("paused_at") is not None:
        out.append(Reason("pool_paused",
                          f"pool {pool['name']} paused by {pool['paused_by']} at "
                          f"{_hhmm(pool['paused_at'])}: {pool['pause_reason']}",
                          {"pool": pool["name"], "paused_by": pool["paused_by"],
                           "paused_at": pool["paused_at"].isoformat(),
                           "reason": pool["pause_reason"]}))
    if state == "queued" and job["ready_at"] > world.now:
        wait = (job["ready_at"] - world.now).total_seconds()
        failures = job.get("failures", 0)
        after = f" after {failures} failed attempt{'s' if failures != 1 else ''}" if failures else ""
        out.append(Reason("retry_delayed",
                          f"delayed until {_hhmm(job['ready_at'])} (in {wait:.0f} s){after}",
                          {"ready_at": job["ready_at"].isoformat(), "seconds": round(wait, 1),
                           "failures": failures}))
    if (job["project_id"], job["pool_id"]) not in world.grants:
        out.append(Reason("no_authorized_runner",
                          f"project {project['name']} is not granted pool {pool['name']}",
                          {"project": project["name"], "pool": pool["name"]}))
    elif job["pool_id"] not in world.live_pools:
        asking = world.ungranted_logins.get(job["pool_id"], [])
        if asking:
            # a host asks for the pool but the server does not grant it (sql/functions/claim.sql)
            out.append(Reason("no_authorized_runner",
                              f"no live runner is granted pool {pool['name']} (asked for by "
                              f"login{'s' if len(asking) > 1 else ''} {', '.join(asking)}, "
                              f"not granted it)",
                              {"pool": pool["name"], "ungranted_logins": asking}))
        else:
            out.append(Reason("no_authorized_runner", f"no live runner serves pool {pool['name']}",
                              {"pool": pool["name"], "ungranted_logins": []}))
    # capacity_* and target_held carry "holders": the Jobs page filter that lists the jobs
    # holding that capacity (GET /jobs/?state=running&organization=NAME…, webapp/jobs.py)
    if org["running"] >= org["max_running"]:
        out.append(Reason("capacity_organization",
                          f"organization {org['name']}: {org['running']} of {org['max_running']} running",
                          {"organization": org["name"], "running": org["running"],
                           "limit": org["max_running"],
                           "holders": {"organization": org["name"]}}))
    if project["max_running"] is not None and project["running"] >= project["max_running"]:
        out.append(Reason("capacity_project",
                          f"project {project['name']}: {project['running']} of {project['max_running']} running",
                          {"project": project["name"], "running": project["running"],
                           "limit": project["max_running"],
                           "holders": {"project": project["name"]}}))
    if pool["running"] >= pool["slots"]:
        out.append(Reason("capacity_pool",
                          f"pool {pool['name']}: {pool['running']} of {pool['slots']} pool slots taken",
                          {"pool": pool["name"], "running": pool["running"], "slots": pool["slots"],
                           "holders": {"pool": pool["name"]}}))
    # a ready deployment that is not its target's head (sql/functions/claim.sql, "Deployment
    # order"): ready as the claim means it, so a paused project's or a delayed one is not
    head = world.target_heads.get(job["target_id"]) if target is not None else None
    if (state == "queued" and job["ready_at"] <= world.now and project["paused_at"] is None
            and head is not None and head != job["id"]):
        order = target.get("deploy_order") or "oldest_first"
        out.append(Reason("target_order",
                          f"target {target['name']} deploys {DEPLOY_ORDER_WORDS[order]}: "
                          f"job {head} is next",
                          {"target": target["name"], "deploy_order": order, "next_job_id": head}))
    if target is not None and target["state"] == "held" and target["holder_job_id"] != job["id"]:
        out.append(Reason("target_held",
                          f"target {target['name']} held by job {target['holder_job_id']} "
                          f"(project {target['holder_project']}) since {_hhmm(target['held_since'])}",
                          {"target": target["name"], "holder_job_id": target["holder_job_id"],
                           "holder_project": target["holder_project"],
                           "since": target["held_since"].isoformat(),
                           "holders": {"target": target["name"]}}))
    if target is not None and target["state"] == "uncertain":
        out.append(Reason("target_uncertain",
                          f"target {target['name']} is uncertain: job {target['holder_job_id']} "
                          f"(project {target['holder_project']}) was lost mid-deployment; an "
                          f"operator must resolve it",
                          {"target": target["name"], "holder_job_id": target["holder_job_id"]}))
    if not out:
        # Runner slots (what the live runners serving the pool can run at once, whatever the
        # pool of each job they run) are not pool slots (pools.slots, what the pool admits):
        # a job with room under every limit still waits while every runner is busy, maybe
        # with jobs of other pools (found by a fresh-user run: "next in line" was said of
        # every queued job while 4 of 4 runner slots were busy and the pool had 0 of 2 taken).
        slots, free = world.runner_slots.get(job["pool_id"], (0, 0))
        runners = world.runner_ids.get(job["pool_id"], [])
        if slots and not free:
            n = len(runners)
            out.append(Reason("runners_busy",
                              f"every runner serving pool {pool['name']} is busy: {slots} of {slots} "
                              f"runner slots running jobs on {n} runner{'s' if n != 1 else ''} "
                              f"(pool slots: {pool['running']} of {pool['slots']} taken); claimed "
                              f"when a runner slot frees",
                              {"pool": pool["name"], "runner_slots": slots, "free_runner_slots": 0,
                               "pool_running": pool["running"], "pool_slots": pool["slots"],
                               "runner_ids": runners}))
        else:
            out.append(Reason("ready",
                              f"next in line for a runner of pool {pool['name']} "
                              f"({free} of {slots} runner slots free)",
                              {"pool": pool["name"], "runner_slots": slots,
                               "free_runner_slots": free, "runner_ids": runners}))
    return out


@transition("explain_job")
def explain_job(conn, *, job_id: int, live_seconds: float = 90.0) -> dict[str, Any]:
    """Why job ``job_id`` is not running.

    Returns:
        {"job_id", "state", "reason" (the first code, or None when running/finished),
         "message" (the first reason's, or what the job is doing),
         "reasons": [{"code", "message", "details"}...]} — codes from REASON_CODES.
    Raises:
        NotFound: no such job.
    """
    job = Q.get_job(conn, job_id=job_id)
    if job is None:
        raise NotFound(f"unknown job {job_id}")
    world = read_world(conn, live_seconds=live_seconds)
    pending = list(Q.list_pending_dependencies(conn, job_id=job_id)) if job["pending_dependencies"] else []
    reasons = reasons_for(job, world, pending)
    if reasons:
        message = reasons[0].message
    elif job["state"] == "running":
        message = f"job {job_id} is running (attempt {job['attempts_made']})"
    else:
        message = f"job {job_id} has ended: {job['state']}"
    return {"job_id": job_id, "state": job["state"],
            "reason": reasons[0].code if reasons else None, "message": message,
            "reasons": [r.as_dict() for r in reasons]}


def pair_reasons(world: World, project_id: int, pool_id: int) -> list[str] | None:
    """The reasons every waiting job of (project, pool) shares (codes of GROUP_REASONS in
    precedence order), or ``[runners_busy]`` / ``[ready]`` when none holds; None for a
    project or pool that is gone. A waiting job has one of GROUP_REASONS, or one of
    LAST_REASONS, only if its (project, pool) has it here."""
    return _group_codes({"project_id": project_id, "pool_id": pool_id}, world)


def _group_codes(s: dict[str, Any], world: World) -> list[str] | None:
    """The reasons every waiting job of summary row ``s``'s (project, pool) shares (codes of
    GROUP_REASONS in precedence order), or ``[runners_busy]`` / ``[ready]`` when none holds;
    None for a project that is gone."""
    if s["project_id"] not in world.projects or s["pool_id"] not in world.pools:
        return None
    probe = {"id": 0, "state": "queued", "project_id": s["project_id"], "pool_id": s["pool_id"],
             "target_id": None, "ready_at": world.now, "pending_dependencies": 0}
    return [r.code for r in reasons_for(probe, world) if r.code != "retry_delayed"]


def summary_reason_counts(summaries: list[dict[str, Any]], world: World) -> dict[str, int]:
    """Waiting jobs counted by their first (primary) reason, from the per-(project, pool)
    summary: ``{code: n}`` for every code of REASON_CODES; the counts sum to the waiting jobs.

    Blocked jobs split by their durable blocker; in a paused project every queued job is
    ``project_paused``, else in a paused pool ``pool_paused``; otherwise delayed jobs are ``retry_delayed``, and the ready ones of a
    (project, pool) take the first group-level reason that holds (no runner, capacity), else
    those waiting for their target's order (``target_order``: not its head) or on their target
    count as such, the rest ``runners_busy`` or ``ready``.
    """
    counts = {code: 0 for code in REASON_CODES}
    for s in summaries:
        counts["dependency_pending"] += s["blocked_dependency"]
        counts["approval_required"] += s["blocked_approval"]
        codes = _group_codes(s, world)
        if codes is None:
            continue
        if codes[0] in ("project_paused", "pool_paused"):
            counts[codes[0]] += s["queued_delayed"] + s["queued_ready"]
            continue
        counts["retry_delayed"] += s["queued_delayed"]
        if codes[0] in LAST_REASONS:
            counts["target_order"] += s["target_order"]
            counts["target_held"] += s["target_held"]
            counts["target_uncertain"] += s["target_uncertain"]
            counts[codes[0]] += (s["queued_ready"] - s["target_order"] - s["target_held"]
                                 - s["target_uncertain"])
        else:
            counts[codes[0]] += s["queued_ready"]
    return counts


def summary_any_reason_counts(summaries: list[dict[str, Any]], world: World) -> dict[str, int]:
    """Waiting jobs counted under every reason that holds for them (as ``reasons_for`` lists
    them, so the same as the queue's reason filter), from the per-(project, pool) summary:
    ``{code: n}`` for every code of REASON_CODES. A job with several reasons is counted once
    under each, so the counts may sum to more than the waiting jobs.

    A group-level reason (paused, no runner, capacity) holds for every waiting job of its
    (project, pool): blocked, delayed and ready alike. ``runners_busy`` / ``ready`` is what
    a ready job with no other reason has.
    """
    counts = {code: 0 for code in REASON_CODES}
    for s in summaries:
        counts["dependency_pending"] += s["blocked_dependency"]
        counts["approval_required"] += s["any_approval"]
        counts["target_held"] += s["any_target_held"]
        counts["target_uncertain"] += s["any_target_uncertain"]
        # only ready jobs of unpaused projects have it (pgd_summarize_queue)
        counts["target_order"] += s["target_order"]
        codes = _group_codes(s, world)
        if codes is None:
            continue
        counts["retry_delayed"] += s["queued_delayed"]
        if codes[0] in LAST_REASONS:
            counts[codes[0]] += (s["queued_ready"] - s["target_order"] - s["target_held"]
                                 - s["target_uncertain"])
        else:
            waiting = (s["blocked_dependency"] + s["blocked_approval"] + s["queued_ready"]
                       + s["queued_delayed"])
            for code in codes:
                counts[code] += waiting
    return counts


def summary_oldest_waiting(summaries: list[dict[str, Any]],
                           world: World) -> dict[tuple[str, str], dt.datetime]:
    """The oldest "waiting since" per (pool name, primary reason), from the summary rows
    (which carry the pool's name): only pairs with a waiting job. Waiting since is the
    ``created_at`` of a blocked job, the ``ready_at`` of a queued ready one; a delayed job is
    not waiting yet (``retry_delayed`` has no entry), nor is a lost deployment counted here
    (``pgdispatch_uncertain_targets`` says it)."""
    out: dict[tuple[str, str], dt.datetime] = {}

    def put(pool: str, code: str, ts: dt.datetime | None) -> None:
        if ts is not None and ((pool, code) not in out or ts < out[(pool, code)]):
            out[(pool, code)] = ts

    for s in summaries:
        put(s["pool"], "dependency_pending", s["oldest_dependency_at"])
        put(s["pool"], "approval_required", s["oldest_approval_at"])
        codes = _group_codes(s, world)
        if codes is None:
            continue
        if codes[0] in LAST_REASONS:
            put(s["pool"], "target_order", s["oldest_target_order_at"])
            put(s["pool"], "target_held", s["oldest_target_held_at"])
            put(s["pool"], "target_uncertain", s["oldest_target_uncertain_at"])
            put(s["pool"], codes[0], s["oldest_free_at"])
        else:
            put(s["pool"], codes[0], s["oldest_ready_at"])
    return out
