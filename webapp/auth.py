"""Sign-in for the console: accounts from the ``users`` table, roles viewer < operator < admin.

Every console page needs a signed-in user (checked before every request, so a new page
cannot forget it); the JSON API authenticates by bearer token instead (``api.py``), and
``/metrics``, ``/healthz`` and the static files are public.

The database decides a sign-in (``pgdispatch.sql.accounts.sign_in``: the login limit, the
comparison of hashes and the audit are there, shared by every worker and host), and the
signed session carries the account's id and session generation, checked on every request:
signing out, a new password, disabling or a demotion moves the generation on and so ends
every session of the account, copies of the cookie included.

A request whose session has ended (signed out elsewhere, a new password, disabled, demoted,
or the cookie gone while a console page was open) is never answered with a page swapped into
a fragment: an htmx request gets 401 with ``HX-Redirect`` to the sign-in page, which then says
that the session ended and returns to the page the operator was on; a plain request is
redirected there the same way. The sign-in check runs before the CSRF check, so an action
sent from a page whose session is gone reads "session ended", not "the form expired".
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from flask import (Blueprint, Flask, make_response, redirect, render_template, request, session,
                   url_for)
from flask_login import LoginManager, UserMixin, current_user, login_user, logout_user

from pgdispatch.sql import accounts

from .db import get_conn
from .views import is_htmx

log = logging.getLogger(__name__)
bp = Blueprint("auth", __name__)
ROLE_RANK = {"viewer": 0, "operator": 1, "admin": 2}
PUBLIC_ENDPOINTS = {"auth.login", "static", "metrics.metrics", "metrics.healthz"}


class Operator(UserMixin):
    """The signed-in account, re-read from the database on every request."""

    def __init__(self, row: dict[str, Any]):
        self.id = row.get("user_id", row.get("id"))
        self.username = row["username"]
        self.role = row["role"]
        self.session_generation = row["session_generation"]

    def get_id(self) -> str:
        return f"{self.id}:{self.session_generation}"

    @property
    def can_act(self) -> bool:
        """Operators and admins may change state; viewers only read."""
        return ROLE_RANK.get(self.role, -1) >= ROLE_RANK["operator"]

    @property
    def is_admin(self) -> bool:
        """Admins also manage accounts, API tokens and limits."""
        return self.role == "admin"


def init_app(app: Flask) -> None:
    """Install Flask-Login and the sign-in requirement."""
    manager = LoginManager()
    manager.init_app(app)
    manager.user_loader(_load_user)
    manager.unauthorized_handler(_unauthorized)
    app.register_blueprint(bp)
    # first of the before-request hooks: before CSRFProtect's (security.py), so that a page
    # whose session ended gets "sign in again", not "the form expired"
    app.before_request_funcs.setdefault(None, []).insert(0, _require_login)


def _is_small_number(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 18


def _load_user(session_id: str) -> Operator | None:
    user_id, _, generation = session_id.partition(":")
    if not _is_small_number(user_id) or not _is_small_number(generation):
        return None  # a session of an older version (or a forged one): sign in again
    row = accounts.session_user(get_conn(), user_id=int(user_id),
                                session_generation=int(generation))
    return None if row is None else Operator(row)


def _unauthorized():
    ended = is_htmx() or "_user_id" in session
    target = url_for("auth.login", next=_return_path(), ended=1 if ended else None)
    if is_htmx():
        # a redirect would be followed by the XHR and the sign-in page swapped into the
        # fragment: htmx leaves the page for the sign-in page instead (static/app.js shows
        # the same message and goes there should a proxy drop the header)
        response = make_response(render_template("auth/_ended.html", target=target), 401)
        response.headers["HX-Redirect"] = target
        response.headers["HX-Reswap"] = "none"
        response.vary.add("HX-Request")
        return response
    return redirect(target)


def _return_path() -> str | None:
    """Where to return after signing in again: the page the operator was on.

    A GET is that page; an htmx request is sent from the page its ``HX-Current-URL`` names
    (a fragment or an action's URL is no page to return to); a plain form POST has none.
    """
    if is_htmx():
        current = urlsplit(request.headers.get("HX-Current-URL", ""))
        if current.netloc and current.netloc != request.host:
            return None
        return _local_path(urlunsplit(("", "", current.path, current.query, "")))
    if request.method == "GET":
        return _local_path(request.full_path)
    return None


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
    """Sign in with username and password (the login limit is the database's: per username
    and per client address)."""
    next_path = _local_path(request.values.get("next"))
    if request.method == "GET":
        if current_user.is_authenticated:
            return redirect(next_path or url_for("overview.index"))
        return render_template("auth/index.html", next=next_path, error=None,
                               ended=request.args.get("ended") == "1",
                               signed_out=request.args.get("signed_out") == "1")
    username = request.form.get("username", "")
    password = request.form.get("password", "")
    result = {"outcome": "failed"}
    if 0 < len(username) <= 63 and "\x00" not in username and len(password) <= 1024:
        result = accounts.sign_in(get_conn(), username=username, password=password,
                                  address=request.remote_addr)
    if result["outcome"] != "signed_in":
        # neither the password nor the username (it may be a password typed in the wrong box)
        log.warning("%s sign-in from %s", result["outcome"], request.remote_addr)
        limited = result["outcome"] == "limited"
        error = ("too many failed sign-ins; wait a minute" if limited
                 else "wrong username or password")
        return render_template("auth/index.html", next=next_path, username=username[:63],
                               error=error), 429 if limited else 401
    session.clear()  # no session fixation: a fresh session for the signed-in user
    login_user(Operator(result))
    return redirect(next_path or url_for("overview.index"), code=303)


@bp.route("/logout", methods=["POST"])
def logout():
    """Sign out (POST with the CSRF token, like every state change): every session of the
    account ends, here and elsewhere; audited. The sign-in page it lands on says so."""
    if current_user.is_authenticated:
        accounts.sign_out(get_conn(), user_id=current_user.id,
                          session_generation=current_user.session_generation,
                          address=request.remote_addr)
    logout_user()
    session.clear()
    return redirect(url_for("auth.login", signed_out=1), code=303)
