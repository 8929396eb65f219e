"""Sign-in for the console: accounts from the ``users`` table, roles viewer < operator < admin.

Every console page needs a signed-in user (checked before every request, so a new page
cannot forget it); the JSON API authenticates by bearer token instead (``api.py``), and
``/metrics``, ``/healthz`` and the static files are public.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any
from urllib.parse import urlsplit

from flask import (Blueprint, Flask, current_app, make_response, redirect, render_template,
                   request, session, url_for)
from flask_limiter import Limiter
from flask_limiter.util import get_remote_address
from flask_login import LoginManager, UserMixin, current_user, login_user, logout_user

from pgdispatch.sql import accounts

from .db import get_conn
from .views import is_htmx

log = logging.getLogger(__name__)
bp = Blueprint("auth", __name__)
ROLE_RANK = {"viewer": 0, "operator": 1, "admin": 2}
PUBLIC_ENDPOINTS = {"auth.login", "static", "metrics.metrics", "metrics.healthz"}


def _fingerprint(password_hash: str) -> str:
    # Part of the session's user id: setting a new password ends every other session.
    return hashlib.sha256(password_hash.encode()).hexdigest()[:16]


class Operator(UserMixin):
    """The signed-in account, re-read from the database on every request."""

    def __init__(self, row: dict[str, Any]):
        self.id = row["id"]
        self.username = row["username"]
        self.role = row["role"]
        self.fingerprint = _fingerprint(row["password_hash"])

    def get_id(self) -> str:
        return f"{self.id}:{self.fingerprint}"

    @property
    def can_act(self) -> bool:
        """Operators and admins may change state; viewers only read."""
        return ROLE_RANK.get(self.role, -1) >= ROLE_RANK["operator"]

    @property
    def is_admin(self) -> bool:
        """Admins also manage accounts, API tokens and limits."""
        return self.role == "admin"


def init_app(app: Flask) -> None:
    """Install Flask-Login, the login rate limit and the sign-in requirement."""
    manager = LoginManager()
    manager.init_app(app)
    manager.user_loader(_load_user)
    manager.unauthorized_handler(_unauthorized)
    app.register_blueprint(bp)
    # A limiter per application, memory storage: each web worker counts its own attempts.
    limiter = Limiter(get_remote_address, app=app, storage_uri="memory://", default_limits=[],
                      headers_enabled=False)
    app.extensions["pgdispatch.limiter"] = limiter
    app.view_functions["auth.login"] = limiter.limit(
        lambda: current_app.config["LOGIN_RATE_LIMIT"], methods=["POST"],
        error_message="too many sign-in attempts; wait a minute")(login)
    app.before_request(_require_login)


def _load_user(session_id: str) -> Operator | None:
    user_id, _, fingerprint = session_id.partition(":")
    if not user_id.isascii() or not user_id.isdigit() or len(user_id) > 18:
        return None
    row = accounts.get_user(get_conn(), user_id=int(user_id))
    if row is None or row["disabled_at"] is not None:
        return None
    user = Operator(row)
    if not hmac.compare_digest(user.fingerprint, fingerprint):
        return None  # the password changed since this session signed in
    return user


def _unauthorized():
    target = url_for("auth.login", next=_local_path(request.full_path))
    if is_htmx():
        # a redirect would be followed by the XHR and the login page swapped into a fragment
        response = make_response("", 401)
        response.headers["HX-Redirect"] = target
        return response
    return redirect(target)


def _require_login():
    if request.endpoint is None or request.endpoint in PUBLIC_ENDPOINTS:
        return None
    if request.blueprint == "api":
        return None
    if not current_user.is_authenticated:
        return _unauthorized()
    return None


def _local_path(path: str | None) -> str | None:
    """``path`` when it is a path on this site, else None (no open redirect).

    Browsers drop tabs and newlines inside URLs and read a backslash as a slash, so a
    slash, a tab and ``/evil.example`` would leave the site: any control character,
    whitespace or backslash refuses the value, as does anything but one leading slash.
    """
    if not path or len(path) > 2000:
        return None
    path = path.rstrip("?")
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F or c == "\\" for c in path):
        return None
    parts = urlsplit(path)
    if parts.scheme or parts.netloc or not path.startswith("/") or path.startswith("//"):
        return None
    return path


@bp.route("/login", methods=["GET", "POST"])
def login():
    """Sign in with username and password (rate-limited per client address)."""
    next_path = _local_path(request.values.get("next"))
    if request.method == "GET":
        if current_user.is_authenticated:
            return redirect(next_path or url_for("overview.index"))
        return render_template("auth/index.html", next=next_path, error=None)
    username = request.form.get("username", "")
    password = request.form.get("password", "")
    user = None
    if 0 < len(username) <= 63 and "\x00" not in username and len(password) <= 1024:
        user = accounts.authenticate(get_conn(), username=username, password=password)
    if user is None:
        # neither the password nor the username (it may be a password typed in the wrong box)
        log.warning("failed sign-in from %s", request.remote_addr)
        return render_template("auth/index.html", next=next_path, username=username[:63],
                               error="wrong username or password"), 401
    session.clear()  # no session fixation: a fresh session for the signed-in user
    login_user(Operator(user))
    accounts.record_sign_in(get_conn(), username=user["username"], address=request.remote_addr)
    return redirect(next_path or url_for("overview.index"), code=303)


@bp.route("/logout", methods=["POST"])
def logout():
    """Sign out (POST with the CSRF token, like every state change); audited."""
    if current_user.is_authenticated:
        accounts.record_sign_out(get_conn(), username=current_user.username,
                                 address=request.remote_addr)
    logout_user()
    session.clear()
    return redirect(url_for("auth.login"), code=303)
