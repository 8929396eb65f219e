"""What the web console needs beyond reads and transitions: the
admin area's audited changes (accounts, API tokens, limits), and audited sign-in/out.

Kept here so that ``webapp`` never touches psycopg or psycopg_pool errors itself.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from .db import transition
from .errors import AlreadyResolved, Conflict, InvalidInput, NotFound
from .queries import Q
from .transitions import submit
from .users import ROLES, hash_password, token_digest
from .validate import check_int, check_text


@transition("list_filter_choices")
def filter_choices(conn) -> dict[str, Any]:
    """Organization, project and pool names for the console's filter menus."""
    row = Q.list_filter_choices(conn)
    return {k: list(v) for k, v in row.items()}


# --- admin area: accounts, tokens, limits ---------------------------------------------------
#
# Each change below is one transaction (the ``transition`` decorator: retried whole after a
# deadlock or serialization failure): lock the row, compare it with the value the admin saw
# (``expected_*``), change it, and write the audit event — all or nothing. A stale form
# loses with AlreadyResolved, saying who changed the row last and what it holds now.

MAX_LIMIT = 100000


def _audit(conn, *, actor: str, action: str, subject: str, reason: str | None,
           details: dict[str, Any]) -> int:
    return Q.record_event(conn, actor=check_text("actor", actor, max_len=200), action=action,
                          subject=subject, reason=_optional_reason(reason),
                          details=json.dumps(details))


def _optional_reason(reason: str | None) -> str | None:
    if reason is None or reason.strip() == "":
        return None
    return check_text("reason", reason, max_len=1000)


def _stale(subject: str, what: str, conn) -> AlreadyResolved:
    return AlreadyResolved(f"{what} (last change by {Q.last_actor(conn, subject=subject)}); "
                           "reload and try again")


def _locked_user(conn, username: str) -> dict[str, Any]:
    check_text("username", username, max_len=63)
    user = Q.lock_user(conn, username=username)
    if user is None:
        raise NotFound(f"unknown user {username}")
    return user


def _lock_admins_then_user(conn, username: str) -> tuple[list[str], dict[str, Any]]:
    """Lock every active admin's row (id order), then the account's: the one order that
    changes able to remove an admin take, so two admins demoting each other at once cannot
    deadlock, and the second sees the first's result before its "last admin" check."""
    admins = [a["username"] for a in Q.lock_active_admins(conn)]
    return admins, _locked_user(conn, username)


def _keep_an_admin(admins: list[str], user: dict[str, Any]) -> None:
    """Refuse a change that would leave no active admin (before demoting or disabling)."""
    if admins == [user["username"]]:
        raise Conflict(f"{user['username']} is the last active admin; make another admin first")


@transition("list_users")
def list_users(conn) -> list[dict[str, Any]]:
    """Every account: id, username, role, created_at, disabled_at, live_tokens."""
    return list(Q.list_users(conn))


@transition("list_api_tokens")
def list_api_tokens(conn) -> list[dict[str, Any]]:
    """Every API token's id, owner, label, created/last used/revoked times (never the hash)."""
    return list(Q.list_api_tokens(conn))


@transition("list_limits")
def list_limits(conn) -> dict[str, list[dict[str, Any]]]:
    """Organizations, projects and pools with their limits and running counts (for
    organizations and pools, their held slots)."""
    return {"organizations": list(Q.list_organizations(conn)),
            "projects": list(Q.list_projects(conn)),
            "pools": list(Q.list_pools(conn))}


@transition("create_user")
def create_user(conn, *, username: str, password: str, role: str, actor: str,
                reason: str | None = None) -> dict[str, Any]:
    """Create an account with a password the admin chose (stored as an argon2id hash); audited.

    Raises:
        InvalidInput: bad username, role, or a password shorter than 8 characters.
        Conflict: the username is taken.
    """
    check_text("username", username, max_len=63)
    if role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}")
    user_id = Q.insert_user(conn, username=username, password_hash=hash_password(password),
                            role=role)
    if user_id is None:
        raise Conflict(f"user {username} already exists")
    _audit(conn, actor=actor, action="create_user", subject=f"user:{username}", reason=reason,
           details={"role": role})
    return {"user_id": user_id, "username": username, "role": role}


@transition("set_user_role")
def set_user_role(conn, *, username: str, role: str, expected_role: str, actor: str,
                  reason: str | None = None) -> dict[str, Any]:
    """Change an account's role, if it still has ``expected_role``; audited.

    Raises:
        InvalidInput: unknown role; an admin demoting themself. NotFound: unknown user.
        AlreadyResolved: the role is no longer ``expected_role``. Conflict: the last admin.
    """
    if role not in ROLES or expected_role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}")
    admins, user = _lock_admins_then_user(conn, username)
    if user["role"] != expected_role:
        raise _stale(f"user:{username}", f"{username} is already {user['role']}", conn)
    if role == user["role"]:
        raise Conflict(f"{username} is already {role}")
    if user["role"] == "admin":
        if username == actor:
            raise InvalidInput("you cannot demote yourself; ask another admin")
        if user["disabled_at"] is None:
            _keep_an_admin(admins, user)
    Q.update_user_role(conn, user_id=user["id"], role=role)
    _audit(conn, actor=actor, action="set_user_role", subject=f"user:{username}", reason=reason,
           details={"from": user["role"], "to": role})
    return {"username": username, "role": role}


@transition("set_user_disabled")
def set_user_disabled(conn, *, username: str, is_disabled: bool, actor: str,
                      reason: str | None = None) -> dict[str, Any]:
    """Disable an active account (its sessions and tokens stop working at once) or enable a
    disabled one; audited.

    Raises:
        InvalidInput: an admin disabling themself. NotFound: unknown user.
        AlreadyResolved: already in that state. Conflict: the last active admin.
    """
    admins, user = _lock_admins_then_user(conn, username)
    if (user["disabled_at"] is not None) == is_disabled:
        state = "disabled" if is_disabled else "enabled"
        raise _stale(f"user:{username}", f"{username} is already {state}", conn)
    if is_disabled:
        if username == actor:
            raise InvalidInput("you cannot disable your own account")
        if user["role"] == "admin":
            _keep_an_admin(admins, user)
    disabled_at = Q.update_user_disabled_at(conn, user_id=user["id"], is_disabled=is_disabled)
    _audit(conn, actor=actor, action="disable_user" if is_disabled else "enable_user",
           subject=f"user:{username}", reason=reason, details={})
    return {"username": username, "disabled_at": disabled_at}


@transition("set_user_password")
def set_user_password(conn, *, username: str, password: str, actor: str,
                      reason: str | None = None) -> dict[str, Any]:
    """Set an account's password (argon2id; at least 8 characters); its other sessions end.
    Audited without the password. Raises InvalidInput, NotFound."""
    user = _locked_user(conn, username)
    Q.update_user_password(conn, user_id=user["id"], password_hash=hash_password(password))
    _audit(conn, actor=actor, action="set_user_password", subject=f"user:{username}",
           reason=reason, details={})
    return {"username": username}


@transition("issue_api_token")
def issue_api_token(conn, *, username: str, name: str, actor: str,
                    reason: str | None = None) -> dict[str, Any]:
    """Create a bearer token for ``username``; audited (label and id, never the token).

    Returns:
        {"token_id", "username", "name", "token"}: the token itself is returned only here
        and stored only as its sha256.
    Raises:
        InvalidInput: bad label. NotFound: unknown user. Conflict: the user is disabled.
    """
    check_text("token name", name, max_len=100)
    user = _locked_user(conn, username)
    if user["disabled_at"] is not None:
        raise Conflict(f"{username} is disabled; enable the account first")
    token = "pgd_" + secrets.token_urlsafe(32)
    token_id = Q.create_api_token(conn, username=username, name=name,
                                  token_hash=token_digest(token))
    _audit(conn, actor=actor, action="create_api_token", subject=f"user:{username}",
           reason=reason, details={"token_id": token_id, "name": name})
    return {"token_id": token_id, "username": username, "name": name, "token": token}


@transition("revoke_api_token")
def revoke_api_token(conn, *, token_id: int, actor: str,
                     reason: str | None = None) -> dict[str, Any]:
    """Revoke a token (it stops authenticating at once); audited.

    Raises: NotFound; AlreadyResolved when it is already revoked (says when).
    """
    token_id = check_int("token id", token_id, 1, 2**63 - 1)
    row = Q.lock_api_token(conn, token_id=token_id)
    if row is None:
        raise NotFound(f"unknown token {token_id}")
    if row["revoked_at"] is not None:
        raise _stale(f"user:{row['username']}",
                     f"token {row['name']} of {row['username']} is already revoked", conn)
    revoked_at = Q.revoke_api_token(conn, token_id=token_id)
    _audit(conn, actor=actor, action="revoke_api_token", subject=f"user:{row['username']}",
           reason=reason, details={"token_id": token_id, "name": row["name"]})
    return {"token_id": token_id, "username": row["username"], "revoked_at": revoked_at}


@transition("set_organization_limit")
def set_organization_limit(conn, *, organization: str, max_running: int,
                           expected_max_running: int, actor: str,
                           reason: str | None = None) -> dict[str, Any]:
    """Set an organization's concurrency limit (0–100000), if it is still
    ``expected_max_running``; audited. Its capacity stripes are re-split to the limit
    (migration 0014): below the running count every stripe is left full and the excess is
    owed, paid back as those jobs end; so a lowering stops new claims only. ``running`` in
    the answer is the held slots as of the change.

    Raises: InvalidInput; NotFound; AlreadyResolved (someone changed it since).
    """
    check_text("organization", organization, max_len=63)
    max_running = check_int("max running", max_running, 0, MAX_LIMIT)
    row = Q.lock_organization(conn, name=organization)
    if row is None:
        raise NotFound(f"unknown organization {organization}")
    subject = f"organization:{organization}"
    if row["max_running"] != expected_max_running:
        raise _stale(subject, f"organization {organization}'s limit is now {row['max_running']}",
                     conn)
    changed = max_running != row["max_running"]
    if changed:  # an unchanged save writes nothing and audits nothing
        Q.update_organization_limit(conn, organization_id=row["id"], max_running=max_running)
        _audit(conn, actor=actor, action="set_organization_limit", subject=subject, reason=reason,
               details={"from": {"max_running": row["max_running"]},
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
        raise _stale(subject, f"project {project}'s limits are now bound {bound}, "
                              f"weight {row['weight']}", conn)
    changed = (max_running, weight) != (row["max_running"], row["weight"])
    if changed:  # an unchanged save writes nothing and audits nothing
        Q.update_project_limits(conn, project_id=row["id"], max_running=max_running, weight=weight)
        _audit(conn, actor=actor, action="set_project_limits", subject=subject, reason=reason,
               details={"from": {"max_running": row["max_running"], "weight": row["weight"]},
                        "to": {"max_running": max_running, "weight": weight}})
    return {"project": project, "max_running": max_running, "weight": weight,
            "running": row["running"], "changed": changed}


@transition("set_pool_slots")
def set_pool_slots(conn, *, pool: str, slots: int, expected_slots: int, actor: str,
                   reason: str | None = None) -> dict[str, Any]:
    """Set a pool's slots (0–100000), if still ``expected_slots``; audited. Its capacity
    stripes are re-split (migration 0014): below the running count every stripe is left full
    and the excess is owed, paid back as those jobs end; so a lowering stops new claims
    only.
    ``running`` in the answer is the held slots as of the change.

    Raises: InvalidInput; NotFound; AlreadyResolved (someone changed them since).
    """
    check_text("pool", pool, max_len=63)
    slots = check_int("slots", slots, 0, MAX_LIMIT)
    row = Q.lock_pool(conn, name=pool)
    if row is None:
        raise NotFound(f"unknown pool {pool}")
    subject = f"pool:{pool}"
    if row["slots"] != expected_slots:
        raise _stale(subject, f"pool {pool} now has {row['slots']} slots", conn)
    changed = slots != row["slots"]
    if changed:  # an unchanged save writes nothing and audits nothing
        Q.update_pool_slots(conn, pool_id=row["id"], slots=slots)
        _audit(conn, actor=actor, action="set_pool_slots", subject=subject, reason=reason,
               details={"from": {"slots": row["slots"]}, "to": {"slots": slots}})
    return {"pool": pool, "slots": slots, "running": row["running"], "changed": changed}


# --- audited console events ------------------------------------------------------------------

@transition("record_sign_in")
def record_sign_in(conn, *, username: str, address: str | None) -> int:
    """Audit a successful sign-in (never the password); returns the event id."""
    return _audit(conn, actor=username, action="sign_in", subject=f"user:{username}",
                  reason=None, details={"address": address})


@transition("record_sign_out")
def record_sign_out(conn, *, username: str, address: str | None) -> int:
    """Audit a sign-out; returns the event id."""
    return _audit(conn, actor=username, action="sign_out", subject=f"user:{username}",
                  reason=None, details={"address": address})


@transition("submit_job_audited")
def submit_job(conn, *, actor: str, **kwargs: Any) -> dict[str, Any]:
    """``transitions.submit`` plus a ``submit_job`` audit event in the same transaction when
    the job is new (a repeated idempotency key changes nothing and records nothing).
    Takes submit's keyword arguments; ``actor`` is recorded as ``submitted_by`` too."""
    job = submit(conn, submitted_by=actor, **kwargs)
    if job["is_new"]:
        _audit(conn, actor=actor, action="submit_job", subject=f"job:{job['id']}", reason=None,
               details={"project": job["project"], "pool": job["pool"],
                        "target": job.get("target")})
    return job
