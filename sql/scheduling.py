"""What the scheduler process needs from ``sql`` beyond the transitions: a pool sized for
it, the pools a runner serves, and the wake-up listener.

Connections are borrowed with ``pgdispatch.sql.db.checkout``: ``scheduler`` never imports psycopg, so a
dropped connection, a pool that cannot hand out a connection in time, or a server that
refuses connections all surface there as ``DatabaseUnavailable``, the one exception a
scheduler catches to log, back off and carry on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg
from psycopg_pool import ConnectionPool

from .db import connect, make_pool, transition
from .errors import DatabaseUnavailable, NotFound
from .queries import Q

log = logging.getLogger(__name__)

__all__ = ["WAKEUP_CHANNEL", "listen_for_work", "make_scheduler_pool", "runner_pool_ids"]

WAKEUP_CHANNEL = "pgdispatch_queued"  # migrations/0006_wakeups.sql; payload: the pool id


def make_scheduler_pool(url: str, *, slots: int, timeout_seconds: float = 2.0,
                        statement_deadline_seconds: float = 30.0) -> ConnectionPool:
    """A pool sized for one scheduler: a connection per running job (its heartbeats and its
    completion) plus a few for the periodic jobs (claim, expiry, summary, runner keep-alive).

    Connections are only borrowed for one short transaction; none is held while a job runs.
    ``timeout_seconds`` bounds how long a checkout waits: short, so that during an outage a
    periodic job fails fast and backs off instead of queueing behind the reconnection.
    ``statement_deadline_seconds`` bounds every answer a connection waits for
    (sql/db.py, Connection).
    """
    return make_pool(url, min_size=1, max_size=slots + 4, name="pgdispatch-scheduler",
                     timeout_seconds=timeout_seconds,
                     statement_deadline_seconds=statement_deadline_seconds)


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


def listen_for_work(url: str, pool_ids: list[int], on_work: Callable[[], None],
                    stop: threading.Event, *, poll_seconds: float = 1.0,
                    max_backoff_seconds: float = 30.0) -> None:
    """Until ``stop`` is set: LISTEN on WAKEUP_CHANNEL over a connection of its own and call
    ``on_work()`` whenever a job of one of ``pool_ids`` became claimable (NOTIFY from
    migrations/0006_wakeups.sql), and once after every (re)connection, since notifications
    sent while not listening are lost (PostgreSQL docs, LISTEN). Checks ``stop`` every
    ``poll_seconds``. A broken connection is reopened after a backoff doubling from 0.5 s to
    ``max_backoff_seconds``. Never raises; ``on_work``'s exceptions are logged.

    The connection must be a real session: behind PgBouncer in transaction pooling LISTEN
    silently hears nothing (route it to session pooling, or run the scheduler with
    ``--no-listen`` and rely on polling; docs/operations.md).
    """
    wanted = {str(p) for p in pool_ids}
    delay = 0.5
    while not stop.is_set():
        try:
            with connect(url, application_name="pgdispatch-listener",
                         statement_deadline_seconds=None) as conn:
                conn.execute(f"LISTEN {WAKEUP_CHANNEL}")
                delay = 0.5
                _call(on_work)
                while not stop.is_set():
                    for note in conn.notifies(timeout=poll_seconds):
                        if note.payload in wanted:
                            _call(on_work)
                        if stop.is_set():
                            break
        except (psycopg.Error, DatabaseUnavailable) as exc:
            log.warning("wake-up listener: %s; listening again in %.1f s",
                        str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                        delay)
            stop.wait(delay)
            delay = min(max_backoff_seconds, delay * 2)


def _call(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the listener outlives a failed wake-up
        log.exception("wake-up callback failed")
