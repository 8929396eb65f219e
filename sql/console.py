"""What the web console needs beyond reads and transitions: pool checkout and liveness.

Kept here so that ``webapp`` never touches psycopg or psycopg_pool errors itself.
"""

from __future__ import annotations

from typing import Any

import psycopg
import psycopg_pool

from .db import transition
from .errors import DatabaseUnavailable, translate
from .queries import Q


def acquire(pool: psycopg_pool.ConnectionPool, *, timeout_seconds: float | None = None):
    """Check a connection out of ``pool`` (checked alive on checkout, see make_pool).

    Raises:
        DatabaseUnavailable: no healthy connection within ``timeout_seconds`` (the pool's
        own timeout when None).
    """
    try:
        return pool.getconn(timeout=timeout_seconds)
    except psycopg_pool.PoolTimeout:
        raise DatabaseUnavailable("the database did not answer in time") from None
    except psycopg_pool.PoolClosed:
        raise DatabaseUnavailable("the connection pool is closed") from None
    except psycopg.Error as exc:
        raised = translate(exc)
        raise (raised if raised is not exc else DatabaseUnavailable(str(exc))) from None


def release(pool: psycopg_pool.ConnectionPool, conn) -> None:
    """Give ``conn`` back to ``pool``; a connection left inside a transaction is rolled back
    by the pool, a broken one is discarded."""
    pool.putconn(conn)


def close_pool(pool: psycopg_pool.ConnectionPool, *, timeout_seconds: float = 5.0) -> None:
    """Close ``pool`` and its connections, waiting at most ``timeout_seconds`` for workers."""
    pool.close(timeout=timeout_seconds)


@transition("ping_database")
def ping(conn) -> bool:
    """True when the server answers a trivial query.

    Raises:
        DatabaseUnavailable: the connection is broken or the server went away.
    """
    return Q.ping_database(conn) == 1


@transition("list_filter_choices")
def filter_choices(conn) -> dict[str, Any]:
    """Organization, project and pool names for the console's filter menus."""
    row = Q.list_filter_choices(conn)
    return {k: list(v) for k, v in row.items()}
