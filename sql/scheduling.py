"""What the scheduler process needs from ``sql`` beyond the transitions: a pooled connection
whose failures arrive as our exceptions, and the pools a runner serves.

``scheduler`` never imports psycopg, so a dropped connection, a pool that cannot hand out a
connection in time, or a server that refuses connections must all surface here as
``DatabaseUnavailable``: the one exception a scheduler catches to log, back off and carry on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from .db import make_pool, transition
from .errors import DatabaseUnavailable, NotFound, translate
from .queries import Q

__all__ = ["backend_pid", "connection", "make_scheduler_pool", "runner_pool_ids"]


def make_scheduler_pool(url: str, *, slots: int, timeout_seconds: float = 2.0) -> ConnectionPool:
    """A pool sized for one scheduler: a connection per running job (its heartbeats and its
    completion) plus a few for the periodic jobs (claim, expiry, summary, runner keep-alive).

    Connections are only borrowed for one short transaction; none is held while a job runs.
    ``timeout_seconds`` bounds how long a checkout waits: short, so that during an outage a
    periodic job fails fast and backs off instead of queueing behind the reconnection.
    """
    return make_pool(url, min_size=1, max_size=slots + 4, name="pgdispatch-scheduler",
                     timeout_seconds=timeout_seconds)


@contextlib.contextmanager
def connection(pool: ConnectionPool, *, timeout_seconds: float | None = None) -> Iterator[Any]:
    """Borrow a connection from ``pool`` for one short piece of work, waiting at most
    ``timeout_seconds`` (the pool's default when None) to get one.

    Raises:
        DatabaseUnavailable: no connection could be had in time, or the connection broke while
        in use (the server went away, was restarted, or refused us).
        Our other exceptions (sql.errors) pass through unchanged.
    """
    try:
        with pool.connection(timeout=timeout_seconds) as conn:
            yield conn
    except psycopg.Error as exc:
        # PoolTimeout is an OperationalError; InterfaceError is "the connection is closed",
        # which a transition can hit when the server dropped the connection between statements.
        if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
            raise DatabaseUnavailable(str(exc).strip().splitlines()[0] if str(exc).strip()
                                      else type(exc).__name__) from None
        raised = translate(exc)
        if raised is exc:
            raise
        raise raised from None


def backend_pid(conn) -> int | None:
    """The server process id of ``conn``'s session, None when it is not connected; after the
    connection is lost, ``transitions.recover_claim`` uses it to settle that session."""
    try:
        return conn.info.backend_pid or None
    except psycopg.Error:
        return None


@transition("runner_pool_ids")
def runner_pool_ids(conn, *, runner_id: int) -> list[int]:
    """The pool ids a runner serves, as registered.

    Raises:
        NotFound: unknown runner.
    """
    pool_ids = Q.get_runner_pool_ids(conn, runner_id=runner_id)
    if pool_ids is None:
        raise NotFound(f"unknown runner {runner_id}")
    return list(pool_ids)
