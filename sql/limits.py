"""Concurrency limits from the admin area: an organization's limit, a project's running bound
and fairness weight, a pool's slots; each an audited, conditional change.

Each change is one transaction (the ``transition`` decorator: retried whole after a deadlock
or serialization failure) and one SECURITY DEFINER function (sql/functions/limits.sql): lock
the row, compare it with the value the admin saw (``expected_*``), change it, and write the
audit event, all or nothing. The login needs no table privilege: the function checks that
the actor may (pgd_authorize, 'admin'). A stale form loses
with AlreadyResolved, saying who changed the row last and what it holds now. An unchanged
save writes nothing and audits nothing.

Lowering a limit below the running count stops new claims only: an organization's or pool's
capacity stripes are re-split to the new limit (trigger ``pgd_sync_stripes``), every stripe
is left full and the excess is owed, paid back as those jobs end.
"""

from __future__ import annotations

from typing import Any

from .audit import check_actor, optional_reason
from .db import transition
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
                           expected_max_running: int, actor: str | None,
                           reason: str | None = None) -> dict[str, Any]:
    """Set an organization's concurrency limit (0–100000), if it is still
    ``expected_max_running``; audited. ``running`` in the answer is the held slots as of the
    change. ``actor``: see pgd_authorize (None: the database login).

    Raises: InvalidInput; NotFound; AlreadyResolved (someone changed it since); Forbidden.
    """
    check_text("organization", organization, max_len=63)
    max_running = check_int("max running", max_running, 0, MAX_LIMIT)
    return Q.set_organization_limit(conn, organization=organization, max_running=max_running,
                                    expected_max_running=expected_max_running,
                                    reason=optional_reason(reason), actor=check_actor(actor))


@transition("set_project_limits")
def set_project_limits(conn, *, project: str, max_running: int | None, weight: int,
                       expected_max_running: int | None, expected_weight: int,
                       actor: str | None, reason: str | None = None) -> dict[str, Any]:
    """Set a project's running bound (None: no bound of its own; else 0–100000) and fairness
    weight (1–1000), if both are still what the admin saw; audited.

    Raises: InvalidInput; NotFound; AlreadyResolved (someone changed them since); Forbidden.
    """
    check_text("project", project, max_len=63)
    if max_running is not None:
        max_running = check_int("max running", max_running, 0, MAX_LIMIT)
    weight = check_int("weight", weight, 1, 1000)
    return Q.set_project_limits(conn, project=project, max_running=max_running, weight=weight,
                                expected_max_running=expected_max_running,
                                expected_weight=expected_weight,
                                reason=optional_reason(reason), actor=check_actor(actor))


@transition("set_pool_slots")
def set_pool_slots(conn, *, pool: str, slots: int, expected_slots: int, actor: str | None,
                   reason: str | None = None) -> dict[str, Any]:
    """Set a pool's slots (0–100000), if still ``expected_slots``; audited. ``running`` in
    the answer is the held slots as of the change.

    Raises: InvalidInput; NotFound; AlreadyResolved (someone changed them since); Forbidden.
    """
    check_text("pool", pool, max_len=63)
    slots = check_int("slots", slots, 0, MAX_LIMIT)
    return Q.set_pool_slots(conn, pool=pool, slots=slots, expected_slots=expected_slots,
                            reason=optional_reason(reason), actor=check_actor(actor))
