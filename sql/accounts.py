"""Operator accounts and API tokens: argon2id password hashes, sha256 token digests, sign-in,
the admin area's audited changes, and the audited sign-in and sign-out records.

Each admin change is one transaction (the ``transition`` decorator: retried whole after a
deadlock or serialization failure): lock the row, compare it with the value the admin saw
(``expected_*``), change it, and write the audit event, all or nothing. A stale form loses
with AlreadyResolved, saying who changed the account last and what it holds now.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from .audit import already_resolved, record_event
from .db import transition
from .errors import Conflict, InvalidInput, NotFound
from .queries import Q
from .validate import check_int, check_text

ROLES = ("viewer", "operator", "admin")
_hasher = PasswordHasher()
# verify() against this when the user is unknown, so both paths cost one argon2 hash
_DUMMY_HASH = _hasher.hash("pgdispatch-no-such-user")


def hash_password(password: str) -> str:
    """An argon2id hash (argon2-cffi defaults, RFC 9106 profile).

    Raises:
        InvalidInput: shorter than 8 characters, longer than 1024, or not text.
    """
    check_text("password", password, max_len=1024)
    if len(password) < 8:
        raise InvalidInput("password must be at least 8 characters")
    return _hasher.hash(password)


def verify_password(password_hash: str | None, password: str) -> bool:
    """True when ``password`` matches; constant work whether or not the user exists."""
    try:
        return _hasher.verify(password_hash or _DUMMY_HASH, password) and password_hash is not None
    except (VerificationError, InvalidHashError):
        return False


def token_digest(token: str) -> str:
    """The sha256 hex digest stored for a bearer token (tokens are 256-bit random)."""
    return hashlib.sha256(token.encode()).hexdigest()


# --- sign-in and bearer tokens ---------------------------------------------------------------

@transition("get_user")
def get_user(conn, *, username: str | None = None,
             user_id: int | None = None) -> dict[str, Any] | None:
    """One account by username or id (id, username, password_hash, role, disabled_at), or
    None."""
    if user_id is not None:
        return Q.get_user_by_id(conn, user_id=user_id)
    return Q.get_user(conn, username=username)


def authenticate(conn, *, username: str, password: str) -> dict[str, Any] | None:
    """The active account for this username and password, or None."""
    is_plausible = isinstance(username, str) and len(username) <= 63
    user = get_user(conn, username=username) if is_plausible else None
    if not verify_password(user["password_hash"] if user else None, password or ""):
        return None
    if user["disabled_at"] is not None:
        return None
    return user


@transition("find_api_token")
def find_api_token(conn, *, token: str) -> dict[str, Any] | None:
    """The active account behind a bearer token (id, username, role), or None; marks the
    token used now."""
    if not isinstance(token, str) or not 8 <= len(token) <= 200:
        return None
    return Q.find_api_token(conn, token_hash=token_digest(token))


@transition("record_sign_in")
def record_sign_in(conn, *, username: str, address: str | None) -> int:
    """Audit a successful sign-in (never the password); returns the event id."""
    return record_event(conn, actor=username, action="sign_in", subject=f"user:{username}",
                        details={"address": address})


@transition("record_sign_out")
def record_sign_out(conn, *, username: str, address: str | None) -> int:
    """Audit a sign-out; returns the event id."""
    return record_event(conn, actor=username, action="sign_out", subject=f"user:{username}",
                        details={"address": address})


# --- unaudited set-up (config apply, tests, benchmarks) --------------------------------------

@transition("upsert_user")
def upsert_user(conn, *, username: str, password: str, role: str) -> None:
    """Create or update an account; the password is hashed, never stored.

    Raises:
        InvalidInput: bad username, role or password.
    """
    if role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    check_text("username", username, max_len=63)
    existing = Q.get_user(conn, username=username)
    if (existing and verify_password(existing["password_hash"], password)
            and existing["role"] == role):
        return
    Q.upsert_user(conn, username=username, password_hash=hash_password(password), role=role)


@transition("create_api_token")
def create_api_token(conn, *, username: str, name: str = "api") -> str:
    """Create a bearer token for ``username``; returns the token (shown once, stored hashed).

    Raises:
        InvalidInput: bad username or label. NotFound: unknown user.
    """
    check_text("username", username, max_len=63)
    check_text("token name", name, max_len=200)
    token = "pgd_" + secrets.token_urlsafe(32)
    if Q.create_api_token(conn, username=username, name=name,
                          token_hash=token_digest(token)) is None:
        raise NotFound(f"unknown user {username}")
    return token


# --- the admin area: audited, conditional changes --------------------------------------------

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
    user_id = Q.create_user(conn, username=username, password_hash=hash_password(password),
                            role=role)
    if user_id is None:
        raise Conflict(f"user {username} already exists")
    record_event(conn, actor=actor, action="create_user", subject=f"user:{username}",
                 reason=reason, details={"role": role})
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
        raise already_resolved(conn, subject=f"user:{username}",
                               what=f"{username} is already {user['role']}")
    if role == user["role"]:
        raise Conflict(f"{username} is already {role}")
    if user["role"] == "admin":
        if username == actor:
            raise InvalidInput("you cannot demote yourself; ask another admin")
        if user["disabled_at"] is None:
            _keep_an_admin(admins, user)
    Q.set_user_role(conn, user_id=user["id"], role=role)
    record_event(conn, actor=actor, action="set_user_role", subject=f"user:{username}",
                 reason=reason, details={"from": user["role"], "to": role})
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
        raise already_resolved(conn, subject=f"user:{username}",
                               what=f"{username} is already {state}")
    if is_disabled:
        if username == actor:
            raise InvalidInput("you cannot disable your own account")
        if user["role"] == "admin":
            _keep_an_admin(admins, user)
    disabled_at = Q.set_user_disabled(conn, user_id=user["id"], is_disabled=is_disabled)
    record_event(conn, actor=actor, action="disable_user" if is_disabled else "enable_user",
                 subject=f"user:{username}", reason=reason)
    return {"username": username, "disabled_at": disabled_at}


@transition("set_user_password")
def set_user_password(conn, *, username: str, password: str, actor: str,
                      reason: str | None = None) -> dict[str, Any]:
    """Set an account's password (argon2id; at least 8 characters); its other sessions end.
    Audited without the password. Raises InvalidInput, NotFound."""
    user = _locked_user(conn, username)
    Q.set_user_password(conn, user_id=user["id"], password_hash=hash_password(password))
    record_event(conn, actor=actor, action="set_user_password", subject=f"user:{username}",
                 reason=reason)
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
    record_event(conn, actor=actor, action="create_api_token", subject=f"user:{username}",
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
        raise already_resolved(
            conn, subject=f"user:{row['username']}",
            what=f"token {row['name']} of {row['username']} is already revoked")
    revoked_at = Q.revoke_api_token(conn, token_id=token_id)
    record_event(conn, actor=actor, action="revoke_api_token", subject=f"user:{row['username']}",
                 reason=reason, details={"token_id": token_id, "name": row["name"]})
    return {"token_id": token_id, "username": row["username"], "revoked_at": revoked_at}
