"""Concurrency limits from the admin area: an organization's limit, a project's running bound
and fairness weight, a pool's slots; each an audited, conditional change.

Each change is one transaction (the ``transition`` decorator: retried whole after a deadlock
or serialization failure): lock the row, compare it with the value the admin saw
(``expected_*``), change it, and write the audit event, all or nothing. A stale form loses
with AlreadyResolved, saying who changed the row last and what it holds now. An unchanged
save writes nothing and audits nothing.

Lowering a limit below the running count stops new claims only: an organization's or pool's
capacity stripes are re-split to the new limit (trigger ``pgd_sync_stripes``), every stripe
is left full and the excess is owed, paid back as those jobs end.
"""

from __future__ import annotations

from typing import Any

from .audit import already_resolved, record_event
from .db import transition
from .errors import NotFound
from .queries import Q
from .validate import check_int, check_text

MAX_LIMIT = 100000


@transition("list_limits")
def list_limits(conn) -> dict[str, list[dict[str, Any]]]:
    """Organizations, projects and pools with their limits and running counts (for
    organizations and pools, their held slots)."""
    return {"organizations": list(Q.list_organizations(conn)),
            "projects": list(Q.list_projects(conn)),
            "pools": list(Q.list_pools(conn))}


@transition("set_organization_limit")
def set_organization_limit(conn, *, organization: str, max_running: int,
                           expected_max_running: int, actor: str,
                           reason: str | None = None) -> dict[str, Any]:
    """Set an organization's concurrency limit (0–100000), if it is still
    ``expected_max_running``; audited. ``running`` in the answer is the held slots as of the
    change.

    Raises: InvalidInput; NotFound; AlreadyResolved (someone changed it since).
    """
    check_text("organization", organization, max_len=63)
    max_running = check_int("max running", max_running, 0, MAX_LIMIT)
    row = Q.lock_organization(conn, name=organization)
    if row is None:
        raise NotFound(f"unknown organization {organization}")
    subject = f"organization:{organization}"
    if row["max_running"] != expected_max_running:
        raise already_resolved(
            conn, subject=subject,
            what=f"organization {organization}'s limit is now {row['max_running']}")
    changed = max_running != row["max_running"]
    if changed:
        Q.set_organization_limit(conn, organization_id=row["id"], max_running=max_running)
        record_event(conn, actor=actor, action="set_organization_limit", subject=subject,
                     reason=reason, details={"from": {"max_running": row["max_running"]},
                                             "to": {"max_running": max_running}})
    return {"organization": organization, "max_running": max_running,
            "running": row["running"], "changed": changed}


@transition("set_project_limits")
def set_project_limits(conn, *, project: str, max_running: int | None, weight: int,
                       expected_max_running: int | None, expected_weight: int, actor: str,
                       reason: str | None = None) -> dict[str, Any]:
    """Set a project's running bound (None: no bound of its own; else 0–100000) and fairness
    weight (1–1000), if both are still what the admin saw; audited.

    Raises: InvalidInput; NotFound; AlreadyResolved (someone changed them since).
    """
    check_text("project", project, max_len=63)
    if max_running is not None:
        max_running = check_int("max running", max_running, 0, MAX_LIMIT)
    weight = check_int("weight", weight, 1, 1000)
    row = Q.lock_project(conn, name=project)
    if row is None:
        raise NotFound(f"unknown project {project}")
    subject = f"project:{project}"
    if (row["max_running"], row["weight"]) != (expected_max_running, expected_weight):
        bound = "none" if row["max_running"] is None else row["max_running"]
        raise already_resolved(
            conn, subject=subject,
            what=f"project {project}'s limits are now bound {bound}, weight {row['weight']}")
    changed = (max_running, weight) != (row["max_running"], row["weight"])
    if changed:
        Q.set_project_limits(conn, project_id=row["id"], max_running=max_running, weight=weight)
        record_event(conn, actor=actor, action="set_project_limits", subject=subject,
                     reason=reason,
                     details={"from": {"max_running": row["max_running"],
                                       "weight": row["weight"]},
                              "to": {"max_running": max_running, "weight": weight}})
    return {"project": project, "max_running": max_running, "weight": weight,
            "running": row["running"], "changed": changed}


@transition("set_pool_slots")
def set_pool_slots(conn, *, pool: str, slots: int, expected_slots: int, actor: str,
                   reason: str | None = None) -> dict[str, Any]:
    """Set a pool's slots (0–100000), if still ``expected_slots``; audited. ``running`` in
    the answer is the held slots as of the change.

    Raises: InvalidInput; NotFound; AlreadyResolved (someone changed them since).
    """
    check_text("pool", pool, max_len=63)
    slots = check_int("slots", slots, 0, MAX_LIMIT)
    row = Q.lock_pool(conn, name=pool)
    if row is None:
        raise NotFound(f"unknown pool {pool}")
    subject = f"pool:{pool}"
    if row["slots"] != expected_slots:
        raise already_resolved(conn, subject=subject,
                               what=f"pool {pool} now has {row['slots']} slots")
    changed = slots != row["slots"]
    if changed:
        Q.set_pool_slots(conn, pool_id=row["id"], slots=slots)
        record_event(conn, actor=actor, action="set_pool_slots", subject=subject, reason=reason,
                     details={"from": {"slots": row["slots"]}, "to": {"slots": slots}})
    return {"pool": pool, "slots": slots, "running": row["running"], "changed": changed}
