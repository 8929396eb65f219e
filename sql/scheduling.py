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
import psycopg.conninfo
from psycopg_pool import ConnectionPool

from .db import _reports_other_pid, connect, make_pool, transition
from .errors import DatabaseUnavailable, Forbidden, InvalidInput, NotFound
from .queries import Q

log = logging.getLogger(__name__)

__all__ = ["WAKEUP_CHANNEL", "listen_for_work", "make_scheduler_pool", "runner_channel",
           "runner_pool_ids"]

# The pools' broadcast (sql/functions/submit.sql, pgd_notify_queued); payload: the pool id.
WAKEUP_CHANNEL = "pgdispatch_queued"


def runner_channel(runner_id: int) -> str:
    """The channel one runner's listener hears the wake-ups chosen for it on
    (pgd_runner_channel, sql/functions/wakeups.sql); payload: the pool id."""
    return f"pgdispatch_runner_{int(runner_id)}"


def make_scheduler_pool(url: str, *, slots: int, timeout_seconds: float = 2.0,
                        statement_deadline_seconds: float = 30.0,
                        prepare_threshold: int | None = None) -> ConnectionPool:
    """A pool sized for one scheduler: a connection per running job (its heartbeats and its
    completion) plus a few for the periodic jobs (claim, expiry, summary, runner keep-alive).

    Connections are only borrowed for one short transaction; none is held while a job runs.
    ``timeout_seconds`` bounds how long a checkout waits: short, so that during an outage a
    periodic job fails fast and backs off instead of queueing behind the reconnection.
    ``statement_deadline_seconds`` bounds every answer a connection waits for
    (sql/db.py, Connection). ``prepare_threshold``: psycopg's (None, the default: never
    prepare on the server; Settings.prepare_threshold).
    """
    return make_pool(url, min_size=1, max_size=slots + 4, name="pgdispatch-scheduler",
                     timeout_seconds=timeout_seconds,
                     statement_deadline_seconds=statement_deadline_seconds,
                     prepare_threshold=prepare_threshold)


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
                    max_backoff_seconds: float = 30.0, is_session_route: bool = False,
                    runner_id: int | None = None) -> bool:
    """Until ``stop`` is set: LISTEN on WAKEUP_CHANNEL over a connection of its own and call
    ``on_work()`` whenever a job of one of ``pool_ids`` became claimable (NOTIFY from
    sql/functions/submit.sql), and once after every (re)connection, since notifications
    sent while not listening are lost (PostgreSQL docs, LISTEN). With ``runner_id`` it also
    listens on that runner's own channel (``runner_channel``) and then registers this
    session as the runner's listener (pgd_listen_runner, sql/functions/wakeups.sql), so that
    a claimable job wakes this one scheduler, chosen, instead of every listener; a
    registration refused (an old schema, a revoked login) is logged and the pools' broadcast
    still heard. Checks ``stop`` every
    ``poll_seconds``. A broken connection is reopened after a backoff doubling from 0.5 s to
    ``max_backoff_seconds``. ``on_work``'s exceptions are logged.

    The connection must be a session of its own on the server: behind a pooler in
    transaction mode the LISTEN is left on a server connection that other clients go on
    using, and the listener hears nothing (tests/pooling/test_listener.py). So unless the
    caller says ``url`` is a session route (``is_session_route``: direct to PostgreSQL, or
    a pooler database in session mode; the scheduler's ``--listen-url``), a connection that
    goes through a pooler is not listened on: it is recognised by the process id the server
    reports differing from the one the connection was given at start-up (a pooler hands out
    its own), one warning names the fix, and the function returns at once.

    Returns:
        False when it gave up on a pooled route without listening, True when ``stop`` was set.
        Never raises.
    """
    wanted = {str(p) for p in pool_ids}
    delay = 0.5
    while not stop.is_set():
        try:
            with connect(url, application_name="pgdispatch-listener",
                         statement_deadline_seconds=None) as conn:
                if not is_session_route and _is_pooled(conn):
                    log.warning(
                        "wake-up listener: DATABASE_URL goes through a connection pooler, where "
                        "LISTEN may hear nothing; not listening, polling (backing off to the idle cap). "
                        "Give the scheduler --listen-url (PGDISPATCH_LISTEN_URL) with a session "
                        "route (direct to PostgreSQL, or a PgBouncer database in pool_mode "
                        "session), or --no-listen")
                    return False
                conn.execute(f"LISTEN {WAKEUP_CHANNEL}")
                if runner_id is not None:
                    # LISTEN first: a wake-up chosen for us once registered is never missed
                    conn.execute(f"LISTEN {runner_channel(runner_id)}")
                    _register_listener(conn, runner_id)
                # said once per connection: a listener that never gets here (a session pool
                # too small holds it in the pooler's queue) is otherwise silent
                log.info("wake-up listener: listening on %s", WAKEUP_CHANNEL)
                delay = 0.5
                _call(on_work)
                while not stop.is_set():
                    for note in conn.notifies(timeout=poll_seconds):
                        if note.channel != WAKEUP_CHANNEL or note.payload in wanted:
                            _call(on_work)
                        if stop.is_set():
                            break
        except (psycopg.Error, DatabaseUnavailable, InvalidInput) as exc:
            log.warning("wake-up listener: %s; listening again in %.1f s",
                        str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                        delay)
            stop.wait(delay)
            delay = min(max_backoff_seconds, delay * 2)
    return True


@transition("listen_runner", one_statement=True)
def listen_runner(conn, *, runner_id: int) -> str:
    """Register ``conn``'s server session (pg_backend_pid()) as runner ``runner_id``'s wake-up
    listener; call it on the listening session, after LISTEN on ``runner_channel``. Returns
    the channel.

    Raises:
        NotFound: unknown runner. Forbidden: another login's runner.
    """
    return Q.listen_runner(conn, runner_id=runner_id)


def _register_listener(conn, runner_id: int) -> None:
    """Record ``conn``'s server session as runner ``runner_id``'s listener; a refusal is
    logged (the broadcast is still heard), a broken connection raises psycopg.Error."""
    try:
        listen_runner(conn, runner_id=runner_id)
    except (NotFound, Forbidden, InvalidInput) as exc:
        log.warning("wake-up listener: not registered for runner %d (%s); hearing the pools' "
                    "broadcast only", runner_id, exc)


def check_listen_url(url: str) -> str:
    """``url`` when libpq can parse it (a URL or a conninfo string).

    Raises:
        InvalidInput: one line naming ``--listen-url``, without the URL (it may hold a password).
    """
    try:
        psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise InvalidInput(f"--listen-url (PGDISPATCH_LISTEN_URL) is not a valid database URL: "
                           f"{str(exc).splitlines()[0]}") from None
    return url


def _is_pooled(conn) -> bool:
    """Whether ``conn`` reaches PostgreSQL through a connection pooler (PgBouncer, any mode).

    The server sends a session its process id at start-up (BackendKeyData, which a cancel
    request names); a pooler answers the start-up itself, with a number of its own, so that
    a cancel comes to it. A session whose ``pg_backend_pid()`` differs from that number is
    therefore not a direct one (``sql.db._reports_other_pid``, which the pool's checkout check
    goes by too). A plain TCP proxy passes the start-up through and counts as direct, which
    it is: the session is the client's own.

    Raises:
        psycopg.Error: the connection broke.
    """
    return _reports_other_pid(conn)


def _call(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the listener outlives a failed wake-up
        log.exception("wake-up callback failed")
