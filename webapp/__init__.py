"""The pgdispatch web console and JSON API: a Flask application factory.

One psycopg pool per process (created on first use, so that gunicorn workers forked after
the factory ran never share sockets), one connection per request, every state change through
``pgdispatch.sql.transitions``. Only ``sql`` talks to PostgreSQL; this package never imports psycopg.
"""

from __future__ import annotations

import datetime as dt
import decimal
import os
import time
from pathlib import Path
from typing import Any

from flask import Flask
from flask.json.provider import DefaultJSONProvider
from werkzeug.middleware.proxy_fix import ProxyFix

from pgdispatch import sql
import pgdispatch.sql.embedded
ROOT = Path(__file__).resolve().parent.parent
TRUTHY = ("1", "true", "yes", "on")


class JSONProvider(DefaultJSONProvider):
    """JSON with ISO 8601 times (Flask's default is the HTTP date format)."""

    @staticmethod
    def default(o: Any) -> Any:
        if isinstance(o, (dt.datetime, dt.date, dt.time)):
            return o.isoformat()
        if isinstance(o, dt.timedelta):
            return o.total_seconds()
        if isinstance(o, decimal.Decimal):
            return float(o)
        if isinstance(o, (set, frozenset)):
            return sorted(o)
        return DefaultJSONProvider.default(o)


def _secret_key(settings: sql.Settings) -> str:
    # Several gunicorn workers may generate the demo key at once; the loser of that race
    # sees the file appear (or half-written) and reads it again a moment later.
    for _ in range(20):
        try:
            key = settings.resolved_secret_key()
        except FileExistsError:
            key = ""
        if key:
            return key
        time.sleep(0.05)
    raise RuntimeError(f"could not read the session key in {settings.data_dir}")


def create_app(settings: sql.Settings | None = None, *, database_url: str | None = None,
               **config_overrides: Any) -> Flask:
    """Build the console and API application.

    Args:
        settings: process settings; ``Settings.from_env()`` when None.
        database_url: PostgreSQL to use; else ``settings.database_url``, else the embedded
            server under ``settings.data_dir``.
        config_overrides: Flask config keys to set last (tests: ``TRUSTED_PROXIES``…).
    """
    settings = settings or sql.Settings.from_env()
    app = Flask(__name__, template_folder=str(ROOT / "templates"),
                static_folder=str(ROOT / "static"), static_url_path="/static")
    app.json = JSONProvider(app)
    app.config.update(
        SECRET_KEY=_secret_key(settings),
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        SESSION_COOKIE_SECURE=os.environ.get("PGDISPATCH_SECURE_COOKIES", "").lower() in TRUTHY,
        SESSION_COOKIE_NAME="pgdispatch_session",
        # not used (no "remember me"), but never a weaker cookie than the session's
        REMEMBER_COOKIE_HTTPONLY=True,
        REMEMBER_COOKIE_SAMESITE="Lax",
        PERMANENT_SESSION_LIFETIME=dt.timedelta(hours=12),
        # an on-call console stays open for hours: the token lives as long as the session
        WTF_CSRF_TIME_LIMIT=None,
        MAX_CONTENT_LENGTH=1024 * 1024,
        # reverse proxies in front of the console whose X-Forwarded-For / -Proto are
        # believed (the login limit counts per client address): docs/operations.md
        TRUSTED_PROXIES=_trusted_proxies(os.environ.get("PGDISPATCH_TRUSTED_PROXIES", "0")),
        DB_POOL_MIN_SIZE=1,
        DB_POOL_MAX_SIZE=8,
        DB_POOL_TIMEOUT_SECONDS=5.0,
        DB_STATEMENT_DEADLINE_SECONDS=settings.statement_deadline_seconds,
        # a runner is live for one lease after its keep-alive (docs/design.md)
        RUNNER_LIVE_SECONDS=settings.lease_seconds,
        POLL_SECONDS=2,
        # the overview flags the queue summary as stale past this age (schedulers refresh it
        # every PGDISPATCH_SUMMARY_INTERVAL_SECONDS, 5 s by default)
        SUMMARY_STALE_SECONDS=60,
        # the overview's banner: a session or prepared transaction holding the xmin horizon
        # back longer than this (docs/operations.md, "The database's health")
        HORIZON_ALERT_SECONDS=settings.horizon_alert_seconds,
        PGDISPATCH_SETTINGS=settings,
    )
    app.config["REMEMBER_COOKIE_SECURE"] = app.config["SESSION_COOKIE_SECURE"]
    app.config.update(config_overrides)
    if database_url is None:
        database_url = sql.embedded.database_url(settings)
    app.config["DATABASE_URL"] = database_url

    from . import (admin, api, audit, auth, database, db, errors, formatting, jobs, metrics,
                   overview, pools, projects, queue, runners, security, targets)

    db.init_app(app)
    formatting.init_app(app)
    security.init_app(app)
    auth.init_app(app)
    errors.init_app(app)
    for module in (overview, queue, projects, pools, targets, jobs, runners, database, audit,
                   admin, api, metrics):
        app.register_blueprint(module.bp)
    security.csrf.exempt(api.bp)
    hops = app.config["TRUSTED_PROXIES"]
    if hops:
        # the client's address and scheme as the nearest ``hops`` proxies saw them; never
        # X-Forwarded-Host, which a proxy that does not set it would pass from the client
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops, x_host=0,
                                x_port=0, x_prefix=0)
    return app


def _trusted_proxies(raw: str) -> int:
    """PGDISPATCH_TRUSTED_PROXIES: how many reverse proxies in front of the console (0..10)."""
    value = raw.strip() or "0"
    if not (value.isascii() and value.isdigit()) or int(value) > 10:
        raise ValueError(f"PGDISPATCH_TRUSTED_PROXIES must be a whole number of proxies "
                         f"0..10, got {raw!r}")
    return int(value)


def shutdown(app: Flask) -> None:
    """Close this process's connection pool (tests, and a clean worker exit)."""
    from . import db

    db.close_pool(app)
