"""Operator accounts and API tokens: argon2 password hashes, sha256 token digests."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from .db import transition
from .errors import InvalidInput, NotFound
from .queries import Q
from .validate import check_text

ROLES = ("viewer", "operator", "admin")
_hasher = PasswordHasher()
# verify() against this when the user is unknown, so both paths cost one argon2 hash
_DUMMY_HASH = _hasher.hash("pgdispatch-no-such-user")


def hash_password(password: str) -> str:
    """An argon2id hash (argon2-cffi defaults, RFC 9106 profile)."""
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


@transition("get_user")
def get_user(conn, *, username: str | None = None, user_id: int | None = None) -> dict[str, Any] | None:
    """One account by username or id, or None."""
    if user_id is not None:
        return Q.get_user_by_id(conn, user_id=user_id)
    return Q.get_user(conn, username=username)


def authenticate(conn, *, username: str, password: str) -> dict[str, Any] | None:
    """The active account for this username and password, or None."""
    user = get_user(conn, username=username) if isinstance(username, str) and len(username) <= 63 else None
    if not verify_password(user["password_hash"] if user else None, password or ""):
        return None
    if user["disabled_at"] is not None:
        return None
    return user


@transition("upsert_user")
def upsert_user(conn, *, username: str, password: str, role: str) -> None:
    """Create or update an account; the password is hashed, never stored."""
    if role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    check_text("username", username, max_len=63)
    existing = Q.get_user(conn, username=username)
    if existing and verify_password(existing["password_hash"], password) and existing["role"] == role:
        return
    Q.upsert_user(conn, username=username, password_hash=hash_password(password), role=role)


@transition("create_api_token")
def create_api_token(conn, *, username: str, name: str = "api") -> str:
    """Create a bearer token for ``username``; returns the token (shown once, stored hashed)."""
    check_text("username", username, max_len=63)
    check_text("token name", name, max_len=200)
    token = "pgd_" + secrets.token_urlsafe(32)
    if Q.create_api_token(conn, username=username, name=name, token_hash=token_digest(token)) is None:
        raise NotFound(f"unknown user {username}")
    return token


@transition("find_api_token")
def find_api_token(conn, *, token: str) -> dict[str, Any] | None:
    """The active account behind a bearer token, or None."""
    if not isinstance(token, str) or not 8 <= len(token) <= 200:
        return None
    return Q.find_api_token(conn, token_hash=token_digest(token))
