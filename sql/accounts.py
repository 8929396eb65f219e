"""Operator accounts and API tokens: argon2id password hashes, sha256 token digests, sign-in,
sessions, and the admin area's audited changes.

Every write and every use of a hash is a function in sql/functions/accounts.sql: this module
never reads ``users.password_hash`` or ``api_tokens.token_hash``. Signing in asks the database
for the account's argon2 parameters and salt, hashes the typed password with them here, and
lets the database compare, count the failure against the login limit and audit, in one
transaction. Each admin change is one such function: it locks the row, compares it with the
value the admin saw (``expected_*``), changes it and writes the audit event, all or nothing; a
stale form loses with AlreadyResolved, saying who changed the account last.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import secrets
from typing import Any

import argon2.low_level
from argon2 import PasswordHasher

from .audit import optional_reason
from .db import transition
from .errors import InvalidInput
from .queries import Q
from .validate import check_int, check_text

ROLES = ("viewer", "operator", "admin")
_hasher = PasswordHasher()
_TYPES = {"argon2id": argon2.low_level.Type.ID, "argon2i": argon2.low_level.Type.I,
          "argon2d": argon2.low_level.Type.D}


def hash_password(password: str) -> str:
    """An argon2id hash (argon2-cffi defaults, RFC 9106 profile), encoded.

    Raises:
        InvalidInput: shorter than 8 characters, longer than 1024, or not text.
    """
    check_text("password", password, max_len=1024)
    if len(password) < 8:
        raise InvalidInput("password must be at least 8 characters")
    return _hasher.hash(password)


def encode_with(parameters: dict[str, Any], password: str) -> str:
    """The encoded argon2 hash of ``password`` under ``parameters`` (pgd_sign_in_parameters'
    answer: type, version, memory_cost in KiB, time_cost, parallelism, salt in base64,
    hash_len in bytes): equal to the stored hash exactly when the password is the account's."""
    salt = parameters["salt"]
    return argon2.low_level.hash_secret(
        password.encode(), base64.b64decode(salt + "=" * (-len(salt) % 4)),
        time_cost=parameters["time_cost"], memory_cost=parameters["memory_cost"],
        parallelism=parameters["parallelism"], hash_len=parameters["hash_len"],
        type=_TYPES[parameters["type"]], version=parameters["version"]).decode()


def _is_current(parameters: dict[str, Any]) -> bool:
    """Whether a hash made with ``parameters`` is what hash_password makes today."""
    salt_len = len(parameters["salt"]) * 3 // 4
    return (parameters["type"], parameters["memory_cost"], parameters["time_cost"],
            parameters["parallelism"], parameters["hash_len"], salt_len) == (
        "argon2id", _hasher.memory_cost, _hasher.time_cost, _hasher.parallelism,
        _hasher.hash_len, _hasher.salt_len)


def token_digest(token: str) -> str:
    """The sha256 hex digest stored for a bearer token (tokens are 256-bit random)."""
    return hashlib.sha256(token.encode()).hexdigest()


# --- sign-in, sessions and bearer tokens -----------------------------------------------------

def sign_in(conn, *, username: str, password: str, address: str | None) -> dict[str, Any]:
    """Check a console sign-in against the database's login limit; audited whatever the
    outcome (sign_in, sign_in_failed, sign_in_refused).

    Returns:
        {"outcome": "signed_in" | "failed" | "limited"}, and when signed in also user_id,
        username, role and session_generation (to carry in the session). A hash made under
        older argon2 parameters is replaced by one under today's (pgd_rehash_password).
    Raises:
        InvalidInput: a username that is empty or longer than 63 characters.
    """
    check_text("username", username, max_len=63)
    parameters = _sign_in_parameters(conn, username=username, address=address)
    encoded = None
    if not parameters["is_limited"] and isinstance(password, str) and len(password) <= 1024:
        encoded = encode_with(parameters, password)
    result = _sign_in(conn, username=username, encoded_hash=encoded, address=address)
    if result["outcome"] == "signed_in" and not _is_current(parameters):
        _rehash_password(conn, username=username, encoded_hash=encoded,
                         new_hash=hash_password(password))
    return result


@transition("sign_in_parameters", one_statement=True)
def _sign_in_parameters(conn, *, username: str, address: str | None) -> dict[str, Any]:
    return Q.sign_in_parameters(conn, username=username, address=address)


@transition("sign_in", one_statement=True)
def _sign_in(conn, *, username: str, encoded_hash: str | None,
             address: str | None) -> dict[str, Any]:
    return Q.sign_in(conn, username=username, encoded_hash=encoded_hash, address=address)


@transition("rehash_password", one_statement=True)
def _rehash_password(conn, *, username: str, encoded_hash: str, new_hash: str) -> bool:
    return Q.rehash_password(conn, username=username, encoded_hash=encoded_hash,
                             new_hash=new_hash)


@transition("session_user", one_statement=True)
def session_user(conn, *, user_id: int, session_generation: int) -> dict[str, Any] | None:
    """The enabled account (id, username, role, session_generation) of a console session
    whose generation is still the account's, or None (signed out, new password, disabled,
    demoted since)."""
    return Q.session_user(conn, user_id=user_id, session_generation=session_generation)


@transition("sign_out", one_statement=True)
def sign_out(conn, *, user_id: int, session_generation: int, address: str | None) -> bool:
    """End every session of the user (audited as sign_out); False when this session had
    already ended."""
    return Q.sign_out(conn, user_id=user_id, session_generation=session_generation,
                      address=address)


@transition("find_api_token", one_statement=True)
def find_api_token(conn, *, token: str) -> dict[str, Any] | None:
    """The enabled account behind a live, unexpired bearer token (id, username, role), or
    None; marks the token used now."""
    if not isinstance(token, str) or not 8 <= len(token) <= 200:
        return None
    return Q.authenticate_token(conn, token_hash=token_digest(token))


# --- unaudited set-up (config apply, tests, benchmarks) --------------------------------------

def declare_user(conn, *, username: str, password: str, role: str) -> bool:
    """Create or update an account from an apply file; True when a row changed. The password
    is hashed, never stored; it is compared with the stored one by the database.

    Raises:
        InvalidInput: bad username, role or password.
    """
    if role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    check_text("username", username, max_len=63)
    check_text("password", password, max_len=1024)
    parameters = Q.sign_in_parameters(conn, username=username, address=None)
    outcome = Q.declare_user(conn, username=username, role=role,
                             candidate_hash=encode_with(parameters, password), new_hash=None)
    if outcome == "needs_hash":
        outcome = Q.declare_user(conn, username=username, role=role, candidate_hash=None,
                                 new_hash=hash_password(password))
    return outcome != "unchanged"


@transition("upsert_user")
def upsert_user(conn, *, username: str, password: str, role: str) -> None:
    """Create or update an account (declare_user in a transaction of its own).

    Raises:
        InvalidInput: bad username, role or password.
    """
    declare_user(conn, username=username, password=password, role=role)


def create_api_token(conn, *, username: str, name: str = "api",
                     expires_at: dt.datetime | None = None) -> str:
    """Create a bearer token for ``username`` as this connection's login (tests, benchmarks);
    returns the token. See issue_api_token."""
    return issue_api_token(conn, username=username, name=name, actor=None,
                           expires_at=expires_at)["token"]


# --- the admin area: audited, conditional changes --------------------------------------------
# ``actor``: the signed-in admin the console names (believed only if that account is an
# enabled admin), or None for a person's own database login, which acts as itself
# (pgd_authorize, sql/functions/audit.sql). Each raises Forbidden when the actor may not.

@transition("list_users")
def list_users(conn) -> list[dict[str, Any]]:
    """Every account: id, username, role, created_at, disabled_at, live_tokens."""
    return list(Q.list_users(conn))


@transition("list_api_tokens")
def list_api_tokens(conn) -> list[dict[str, Any]]:
    """Every API token's id, owner, label, created/last used/revoked/expiry times and
    is_live (never the hash), live ones first, newest first."""
    return list(Q.list_api_tokens(conn))


@transition("create_user", one_statement=True)
def create_user(conn, *, username: str, password: str, role: str, actor: str | None,
                reason: str | None = None) -> dict[str, Any]:
    """Create an account with a password the admin chose (stored as an argon2id hash); audited.

    Returns {"user_id", "username", "role"}.
    Raises:
        InvalidInput: bad username, role, or a password shorter than 8 characters.
        Conflict: the username is taken.
    """
    check_text("username", username, max_len=63)
    if role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}")
    return Q.create_user(conn, username=username, password_hash=hash_password(password),
                         role=role, reason=optional_reason(reason), actor=actor)


@transition("set_user_role", one_statement=True)
def set_user_role(conn, *, username: str, role: str, expected_role: str, actor: str | None,
                  reason: str | None = None) -> dict[str, Any]:
    """Change an account's role, if it still has ``expected_role``; a demotion ends its
    sessions, a promotion applies from the next request. Audited.

    Raises:
        InvalidInput: unknown role; an admin demoting themself. NotFound: unknown user.
        AlreadyResolved: the role is no longer ``expected_role``. Conflict: the last admin.
    """
    check_text("username", username, max_len=63)
    return Q.set_user_role(conn, username=username, role=role, expected_role=expected_role,
                           reason=optional_reason(reason), actor=actor)


@transition("set_user_disabled", one_statement=True)
def set_user_disabled(conn, *, username: str, is_disabled: bool, actor: str | None,
                      reason: str | None = None) -> dict[str, Any]:
    """Disable an active account (its sessions end and its live tokens are revoked, so
    enabling it again revives none) or enable a disabled one; audited.

    Returns {"username", "disabled_at", "revoked_token_ids"}.
    Raises:
        InvalidInput: an admin disabling themself. NotFound: unknown user.
        AlreadyResolved: already in that state. Conflict: the last active admin.
    """
    check_text("username", username, max_len=63)
    return Q.set_user_disabled(conn, username=username, is_disabled=bool(is_disabled),
                               reason=optional_reason(reason), actor=actor)


@transition("set_user_password", one_statement=True)
def set_user_password(conn, *, username: str, password: str, actor: str | None,
                      reason: str | None = None) -> dict[str, Any]:
    """Set an account's password (argon2id; at least 8 characters); its sessions end.
    Audited without the password. Raises InvalidInput, NotFound."""
    check_text("username", username, max_len=63)
    return Q.set_user_password(conn, username=username, password_hash=hash_password(password),
                               reason=optional_reason(reason), actor=actor)


@transition("issue_api_token", one_statement=True)
def issue_api_token(conn, *, username: str, name: str, actor: str | None,
                    reason: str | None = None,
                    expires_at: dt.datetime | None = None) -> dict[str, Any]:
    """Create a bearer token for ``username``, valid until ``expires_at`` (None: until
    revoked); audited (id, label and expiry, never the token).

    Returns:
        {"token_id", "username", "name", "expires_at", "token"}: the token itself is
        returned only here and stored only as its sha256.
    Raises:
        InvalidInput: bad label; an expiry not in the future. NotFound: unknown user.
        Conflict: the user is disabled.
    """
    check_text("username", username, max_len=63)
    check_text("token name", name, max_len=100)
    if expires_at is not None and (not isinstance(expires_at, dt.datetime)
                                   or expires_at.tzinfo is None):
        raise InvalidInput("the expiry must be a time with its time zone")
    token = "pgd_" + secrets.token_urlsafe(32)
    made = Q.create_api_token(conn, username=username, name=name, token_hash=token_digest(token),
                              expires_at=expires_at, reason=optional_reason(reason), actor=actor)
    return {**made, "token": token}


@transition("revoke_api_token", one_statement=True)
def revoke_api_token(conn, *, token_id: int, actor: str | None,
                     reason: str | None = None) -> dict[str, Any]:
    """Revoke a token (it stops authenticating at once); audited.

    Returns {"token_id", "username", "revoked_at"}.
    Raises: NotFound; AlreadyResolved when it is already revoked.
    """
    token_id = check_int("token id", token_id, 1, 2**63 - 1)
    return Q.revoke_api_token(conn, token_id=token_id, reason=optional_reason(reason), actor=actor)
