"""The audit log: append an event in the caller's transaction, read events back, and name
who changed a subject last when a stale change is refused.

The table refuses UPDATE and DELETE (``pgd_audit``); every change the console, the API and
the CLI make writes its event in the transaction that makes the change.
"""

from __future__ import annotations

import json
from typing import Any

from .db import transition
from .errors import AlreadyResolved
from .queries import Q
from .validate import check_text


@transition("record_event")
def record_event(conn, *, actor: str, action: str, subject: str, reason: str | None = None,
                 details: dict[str, Any] | None = None) -> int:
    """Append one audit event (``subject`` as "kind:name", e.g. "user:alice"; a blank
    ``reason`` is stored as none); returns its id.

    Raises:
        InvalidInput: an empty or over-long actor (200) or reason (1000).
    """
    return Q.record_event(conn, actor=check_text("actor", actor, max_len=200), action=action,
                          subject=subject, reason=optional_reason(reason),
                          details=json.dumps(details or {}))


def optional_reason(reason: str | None) -> str | None:
    """A reason as the audit log keeps it: None for a blank one. Raises InvalidInput over
    1000 characters."""
    if reason is None or reason.strip() == "":
        return None
    return check_text("reason", reason, max_len=1000)


def check_actor(actor: str | None) -> str | None:
    """The actor a caller names for a transition that authorizes it (pgd_authorize,
    sql/functions/audit.sql): None lets the database name the login. Raises InvalidInput for
    an empty or over-long (200) name."""
    return None if actor is None else check_text("actor", actor, max_len=200)


def already_resolved(conn, *, subject: str, what: str) -> AlreadyResolved:
    """The refusal for a change made from a stale form: ``what`` the row holds now, who
    changed ``subject`` last and when ("alice at 2025-01-31 14:02:03 UTC")."""
    return AlreadyResolved(f"{what} (last change by {Q.last_actor(conn, subject=subject)}); "
                           "reload and try again")


@transition("list_audit_events")
def list_audit_events(conn, *, before_id: int = 2**63 - 1, limit: int = 100,
                      actor: str | None = None, action: str | None = None,
                      subject: str | None = None, job_id: int | None = None) -> list[dict[str, Any]]:
    """Audit events with ids below ``before_id``, newest first (keyset pagination), at most
    ``limit``, optionally only ``actor``'s, only ``action``, only subjects starting with
    ``subject``, or only those about job ``job_id`` (its own trail: audit_events.job_id,
    target resolutions that decided it included). Each: id, at, actor, action, subject,
    reason, details."""
    if job_id is not None:
        return list(Q.list_job_audit_events(conn, job_id=job_id, before_id=before_id, limit=limit,
                                            actor=actor, action=action, subject=subject))
    return list(Q.list_audit_events(conn, before_id=before_id, limit=limit, actor=actor,
                                    action=action, subject=subject))


@transition("list_subject_events")
def list_subject_events(conn, *, subject: str, limit: int = 10) -> list[dict[str, Any]]:
    """The audit events of exactly ``subject`` ("project:web": never "project:web-legacy"'s),
    newest first, at most ``limit``; each as list_audit_events gives it."""
    return list(Q.list_subject_audit_events(conn, subject=subject, limit=limit))


@transition("job_exists")
def job_exists(conn, *, job_id: int) -> bool:
    """Whether job ``job_id`` exists (False for an id no bigint holds)."""
    if isinstance(job_id, bool) or not isinstance(job_id, int) or not 1 <= job_id <= 2**63 - 1:
        return False
    return bool(Q.job_exists(conn, job_id=job_id))
