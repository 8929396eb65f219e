"""One connection pool per process and one connection per request."""

from __future__ import annotations

import os
import threading

from flask import Flask, current_app, g

import pgdispatch.sql.db
from pgdispatch import sql
_lock = threading.Lock()
_KEY = "pgdispatch.pool"


def init_app(app: Flask) -> None:
    """Release the request's connection when the request ends."""
    app.extensions[_KEY] = None
    app.teardown_appcontext(_release)


def _pool(app: Flask):
    # Created lazily and keyed by pid: a pool made before gunicorn forks its workers would
    # hand the same sockets to several processes.
    holder = app.extensions.get(_KEY)
    if holder is not None and holder[0] == os.getpid():
        return holder[1]
    with _lock:
        holder = app.extensions.get(_KEY)
        if holder is None or holder[0] != os.getpid():
            pool = sql.db.make_pool(app.config["DATABASE_URL"],
                                    min_size=app.config["DB_POOL_MIN_SIZE"],
                                    max_size=app.config["DB_POOL_MAX_SIZE"], name="pgdispatch-web",
                                    timeout_seconds=app.config["DB_POOL_TIMEOUT_SECONDS"],
                                    statement_deadline_seconds=app.config[
                                        "DB_STATEMENT_DEADLINE_SECONDS"],
                                    prepare_threshold=app.config["PGDISPATCH_SETTINGS"].prepare_threshold)
            holder = (os.getpid(), pool)
            app.extensions[_KEY] = holder
    return holder[1]


def get_conn():
    """This request's connection (autocommit, dict rows), checked out on first use and given
    back when the request ends: ``pgdispatch.sql.db.checkout`` split in two, since a request is not a
    ``with`` block.

    Raises:
        sql.DatabaseUnavailable: no healthy connection in time.
    """
    if "db_conn" not in g:
        g.db_conn = sql.db.acquire(_pool(current_app))
    return g.db_conn


def _release(_exc: BaseException | None) -> None:
    conn = g.pop("db_conn", None)
    if conn is not None:
        sql.db.release(_pool(current_app), conn)


def close_pool(app: Flask) -> None:
    """Close this process's pool, if one was made."""
    with _lock:
        holder = app.extensions.get(_KEY)
        app.extensions[_KEY] = None
    if holder is not None and holder[0] == os.getpid():
        sql.db.close_pool(holder[1])
