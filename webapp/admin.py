"""Admin area: accounts (create, role, disable, password), API tokens, and limits.

Admins only: every route, pages included, answers 403 to operators and viewers. Each action
is a conditional transition in ``pgdispatch.sql.accounts`` or ``pgdispatch.sql.limits`` that writes its audit event
in the same transaction; forms carry the value the admin saw (``expected_*``), so a stale form
loses with "already … (last change by bob at …)" instead of overwriting someone else's change.
"""

from __future__ import annotations

import datetime as dt

from flask import Blueprint, flash, render_template, request, url_for

from pgdispatch.sql import InvalidInput, PgDispatchError, accounts, limits
from pgdispatch.sql.accounts import ROLES
from pgdispatch.sql.validate import check_int

from .db import get_conn
from .views import actor, form_text, is_htmx, perform, render_view, require_admin, respond

bp = Blueprint("admin", __name__, url_prefix="/admin")


@bp.before_request
def _admins_only():
    require_admin()


def _form_int(name: str, *, low: int, high: int) -> int:
    raw = form_text(name)
    if raw is None:
        raise InvalidInput(f"{name.replace('_', ' ')} is required")
    return check_int(name.replace("_", " "), raw, low, high)


def _form_optional_int(name: str, *, low: int, high: int) -> int | None:
    """A whole number, or None for a blank field ("no limit")."""
    raw = form_text(name)
    return None if raw is None else check_int(name.replace("_", " "), raw, low, high)


def _form_password() -> str:
    # never stripped: spaces are part of a password
    password = request.form.get("password", "")
    if not isinstance(password, str) or password == "":
        raise InvalidInput("a password is required")
    return password


def _users_context(new_token: dict | None = None) -> dict:
    conn = get_conn()
    return {"users": accounts.list_users(conn), "tokens": accounts.list_api_tokens(conn),
            "roles": ROLES, "new_token": new_token}


def _users_fragment() -> str:
    return render_template("admin/_users.html", **_users_context())


def _limits_fragment() -> str:
    return render_template("admin/_limits.html", limits=limits.list_limits(get_conn()))


def _users_action(action, success):
    # ``action`` parses the form inside the transition call, so bad input is a 422 refusal
    return perform(action, success=success, back=url_for("admin.index"),
                   fragment=_users_fragment, role="admin")


def _limits_action(action, success):
    return perform(action, success=success, back=url_for("admin.limits"),
                   fragment=_limits_fragment, role="admin")


@bp.get("/")
def index():
    """Accounts and API tokens."""
    return render_view("admin/index.html", "admin/_users.html", **_users_context())


@bp.get("/limits", endpoint="limits")
def limits_page():
    """Organization limits, project bounds and weights, pool slots."""
    return render_view("admin/limits.html", "admin/_limits.html",
                       limits=limits.list_limits(get_conn()))


@bp.post("/users")
def create_user():
    """Create an account with a password the admin sets."""
    return _users_action(
        lambda conn: accounts.create_user(conn, username=form_text("username", required=True),
                                          password=_form_password(),
                                          role=form_text("role", required=True),
                                          actor=actor(), reason=form_text("reason")),
        lambda r: f"user {r['username']} created as {r['role']}")


@bp.post("/users/<username>/role")
def set_role(username: str):
    """Change an account's role (conditional on the role the admin saw)."""
    return _users_action(
        lambda conn: accounts.set_user_role(conn, username=username,
                                            role=form_text("role", required=True),
                                            expected_role=form_text("expected_role", required=True),
                                            actor=actor(), reason=form_text("reason")),
        lambda r: f"{r['username']} is now {r['role']}")


@bp.post("/users/<username>/disable")
def disable(username: str):
    """Disable an account: its sessions and API tokens stop working at once."""
    return _users_action(
        lambda conn: accounts.set_user_disabled(conn, username=username, is_disabled=True,
                                                actor=actor(), reason=form_text("reason")),
        lambda r: f"{r['username']} disabled")


@bp.post("/users/<username>/enable")
def enable(username: str):
    """Enable a disabled account."""
    return _users_action(
        lambda conn: accounts.set_user_disabled(conn, username=username, is_disabled=False,
                                                actor=actor(), reason=form_text("reason")),
        lambda r: f"{r['username']} enabled")


@bp.post("/users/<username>/password")
def set_password(username: str):
    """Set an account's password (its other sessions end)."""
    return _users_action(
        lambda conn: accounts.set_user_password(conn, username=username, password=_form_password(),
                                                actor=actor(), reason=form_text("reason")),
        lambda r: f"password of {r['username']} set; their other sessions are signed out")


@bp.post("/tokens")
def create_token():
    """Create an API token; the answer shows it once (it is stored only as a hash), so it is
    rendered here, never redirected through a flashed message in the session cookie."""
    back = url_for("admin.index")
    try:
        days = _form_optional_int("expires_in_days", low=1, high=3650)
        made = accounts.issue_api_token(
            get_conn(), username=form_text("username", required=True),
            name=form_text("name") or "api", actor=actor(), reason=form_text("reason"),
            expires_at=None if days is None else dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=days))
    except PgDispatchError as exc:
        return respond(message=str(exc), category="error", status=exc.http_status, back=back)
    message = f"token {made['name']} created for {made['username']}: copy it now, it is not shown again"
    if is_htmx():
        return respond(message=message, category="success", status=200, back=back,
                       fragment=lambda: render_template("admin/_users.html",
                                                        **_users_context(new_token=made)))
    flash(message, "success")
    return render_view("admin/index.html", "admin/_users.html", **_users_context(new_token=made))


@bp.post("/tokens/<int:token_id>/revoke")
def revoke_token(token_id: int):
    """Revoke an API token at once."""
    return _users_action(
        lambda conn: accounts.revoke_api_token(conn, token_id=token_id, actor=actor(),
                                               reason=form_text("reason")),
        lambda r: f"token {r['token_id']} of {r['username']} revoked")


def _unchanged(result: dict) -> str:
    """What a limits message adds when the save changed nothing (and audited nothing)."""
    return "" if result["changed"] else " (unchanged)"


@bp.post("/organizations/<name>/limit")
def set_organization_limit(name: str):
    """Set an organization's concurrency limit (conditional on the value the admin saw)."""
    return _limits_action(
        lambda conn: limits.set_organization_limit(
            conn, organization=name,
            max_running=_form_int("max_running", low=0, high=limits.MAX_LIMIT),
            expected_max_running=_form_int("expected_max_running", low=0, high=limits.MAX_LIMIT),
            actor=actor(), reason=form_text("reason")),
        lambda r: f"organization {r['organization']}: limit {r['max_running']} "
                  f"({r['running']} running){_unchanged(r)}")


@bp.post("/projects/<name>/limits")
def set_project_limits(name: str):
    """Set a project's running bound (blank: none) and weight (conditional)."""
    return _limits_action(
        lambda conn: limits.set_project_limits(
            conn, project=name,
            max_running=_form_optional_int("max_running", low=0, high=limits.MAX_LIMIT),
            weight=_form_int("weight", low=1, high=1000),
            expected_max_running=_form_optional_int("expected_max_running", low=0,
                                                    high=limits.MAX_LIMIT),
            expected_weight=_form_int("expected_weight", low=1, high=1000),
            actor=actor(), reason=form_text("reason")),
        lambda r: f"project {r['project']}: bound "
                  f"{'none' if r['max_running'] is None else r['max_running']}, "
                  f"weight {r['weight']}{_unchanged(r)}")


@bp.post("/pools/<name>/slots")
def set_pool_slots(name: str):
    """Set a pool's slots (conditional on the value the admin saw)."""
    return _limits_action(
        lambda conn: limits.set_pool_slots(
            conn, pool=name, slots=_form_int("slots", low=0, high=limits.MAX_LIMIT),
            expected_slots=_form_int("expected_slots", low=0, high=limits.MAX_LIMIT),
            actor=actor(), reason=form_text("reason")),
        lambda r: f"pool {r['pool']}: {r['slots']} slots ({r['running']} running){_unchanged(r)}")
