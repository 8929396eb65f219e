"""Connections, the pool and its checkout, and the transaction retry policy. Only ``sql``
imports psycopg (and psycopg_pool): a caller meets our exceptions, never theirs."""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import select
import time
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

import psycopg
import psycopg.conninfo
from psycopg import errors as pg_errors
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from . import metrics, timestamps
from .errors import (Conflict, DatabaseUnavailable, FencedOut, InvalidInput, NotFound,
                     translate)
from .queries import Q

log = logging.getLogger(__name__)
T = TypeVar("T")

# Deadlock and serialization failure (PostgreSQL docs 13.4); and what a call that started
# its function before an upgrade committed meets when it goes on after it, with the old
# body's plans cached: 42P10 when the unique index its INSERT ... ON CONFLICT names was
# replaced, 42703 when a column it reads was dropped, 42P01 when a table it reads was
# dropped (each seen under live traffic when such a change committed). The retry runs the
# new body. A migration that can fail an old body in another way extends this set
# (docs/contributing.md).
RETRYABLE = (pg_errors.DeadlockDetected, pg_errors.SerializationFailure,
             pg_errors.InvalidColumnReference, pg_errors.UndefinedColumn, pg_errors.UndefinedTable)
MAX_TRIES = 6


# psycopg prepares a statement on the server after it ran 5 times on a connection. Behind a
# pooler in transaction mode (PgBouncer before 1.21, or with max_prepared_statements 0) the
# next transaction may run on another server connection, where the statement does not exist
# or another client's does: "prepared statement "_pg3_0" already exists", "... does not
# exist", or a bind to the wrong statement (tests/pooling/test_pgbouncer.py). Every statement
# of ours is a short call of a PL/pgSQL function, whose plans the server caches itself, so
# never preparing costs little and is safe on every route (psycopg docs, "Prepared
# statements"; PgBouncer docs, "max_prepared_statements"). The default of connect and
# make_pool; PGDISPATCH_PREPARE_THRESHOLD (sql/settings.py) passes another for a route that
# keeps prepared statements per client.
PREPARE_THRESHOLD = None


# How long the client waits for any answer from the server — a statement's result, a COMMIT's,
# the pool's liveness check — before it gives up on the connection (seconds; the setting
# PGDISPATCH_STATEMENT_DEADLINE_SECONDS, sql/settings.py). TCP keepalives cannot see a peer
# that answers them but never the query: a pooler or a middlebox that stalled, a server
# process stuck behind a lock nobody releases. Without a deadline one such answer holds its
# thread for good (issue 16: every later report of a scheduler queued behind one). Every
# statement of ours is a short function call; no healthy one comes near this.
STATEMENT_DEADLINE_SECONDS = 30.0
# After the deadline, how long the cancel request (sent on its own connection) has to take
# effect before the connection is closed anyway (seconds; at most a quarter of the deadline).
CANCEL_GRACE_SECONDS = 2.0
# The least the pool's check on checkout, and /healthz's ping, wait for their answer (seconds).
CHECK_DEADLINE_SECONDS = 5.0
_WAIT_INTERVAL = 0.1  # how often psycopg's wait loop looks up from the socket (its default)


class NoAnswer(psycopg.OperationalError):
    """No answer came within the connection's statement deadline; the statement was cancelled
    and the connection closed. Whether it committed is unknown (like any lost connection)."""


class Connection(psycopg.Connection):
    """psycopg's connection with a client-side deadline on every answer it waits for.

    psycopg runs each network exchange (a statement and its results, BEGIN, COMMIT, the
    pool's check) through ``wait``; this one bounds it by ``statement_deadline_seconds``.
    When no answer came in time it does what psycopg itself does on Ctrl-C (psycopg docs,
    "Interrupting a query"): asks the server to cancel, gives the cancel
    CANCEL_GRACE_SECONDS (at most a quarter of the deadline), then closes the connection whatever happened — a late answer is
    not trusted, and a cancel still on its way must not hit the connection's next statement
    — and raises NoAnswer, which callers meet as DatabaseUnavailable (a pool discards the
    closed connection; the retry runs on a fresh one). Waits that carry their own timeout
    (``notifies(timeout=...)``) are left alone. ``None``: no deadline (db upgrade, whose lock
    waits are bounded by lock_timeout, and the wake-up listener).
    """

    statement_deadline_seconds: float | None = STATEMENT_DEADLINE_SECONDS

    def wait(self, gen, interval: float = _WAIT_INTERVAL, timeout: float | None = None):
        deadline = self.statement_deadline_seconds
        if timeout is not None or deadline is None:
            return super().wait(gen, interval=interval, timeout=timeout)
        try:
            return super().wait(gen, interval=interval, timeout=deadline)
        except pg_errors._WaitTimeout:  # psycopg's own signal for a wait that timed out
            pass
        log.warning("no answer from the database in %g s; cancelling and closing the "
                    "connection", deadline)
        metrics.STATEMENT_DEADLINES.inc()
        grace = min(CANCEL_GRACE_SECONDS, deadline / 4)
        try:
            self.cancel_safe(timeout=grace)
            super().wait(gen, interval=interval, timeout=grace)
        except Exception:  # noqa: BLE001 - whatever the cancel led to, the connection goes
            pass
        self.pgconn.finish()
        raise NoAnswer(f"no answer from the database within {deadline:g} s "
                       "(the connection was closed; it may have committed)")


@contextlib.contextmanager
def statement_deadline(conn: psycopg.Connection, seconds: float) -> Iterator[None]:
    """Within the block, bound every answer ``conn`` waits for by at most ``seconds`` (a
    tighter bound than the connection's own, never a looser one); restored after it. A
    heartbeat uses it so that one stalled beat gives up before the lease it renews could
    lapse, and the next beat runs on a fresh connection."""
    before = getattr(conn, "statement_deadline_seconds", None)
    if not isinstance(conn, Connection):
        yield
        return
    conn.statement_deadline_seconds = seconds if before is None else min(before, seconds)
    try:
        yield
    finally:
        conn.statement_deadline_seconds = before


def connect(url: str, *, application_name: str = "pgdispatch",
            statement_deadline_seconds: float | None = STATEMENT_DEADLINE_SECONDS,
            **kwargs: Any) -> Connection:
    """Open an autocommit connection returning dict rows; open transactions with
    ``with conn.transaction():``. Every answer it waits for is bounded by
    ``statement_deadline_seconds`` (``Connection``; None: unbounded).

    Raises:
        DatabaseUnavailable: the server cannot be reached (or did not answer within
            CONNECT_TIMEOUT_SECONDS).
    """
    try:
        conn = Connection.connect(url, autocommit=True, row_factory=dict_row,
                                  application_name=application_name,
                                  **{"prepare_threshold": PREPARE_THRESHOLD, **tcp_liveness(url),
                                     **kwargs})
        conn.statement_deadline_seconds = statement_deadline_seconds
        timestamps.register(conn.adapters)
    except psycopg.ProgrammingError as exc:
        # libpq could not parse the URL / conninfo
        raise InvalidInput(f"not a valid database URL: {str(exc).splitlines()[0]}") from None
    except psycopg.Error as exc:
        raise translate(exc) from None
    try:
        bound_idle_transactions(conn)
    except psycopg.Error as exc:
        conn.close()
        raise translate(exc) from None
    return conn


# A session idle inside a transaction for this long has lost its client: the process died
# behind a proxy or NAT that kept its socket open, or the network is partitioned. The server
# then ends the session and its row locks go with it. pgdispatch's transactions are short and
# never wait on anything outside the database, so no live one is ever idle this long; without
# the bound, one vanished claimer holding an organization row stalls every claim, completion
# and expiry of that organization (and every scheduler's claim loop behind it) until TCP
# keepalive notices, hours later. A value set for the server, database or role, or in
# PGOPTIONS, is left alone (PostgreSQL docs 19.11.1, idle_in_transaction_session_timeout).
IDLE_IN_TRANSACTION_TIMEOUT_S = 60


def bound_idle_transactions(conn: psycopg.Connection) -> None:
    """Set this session's ``idle_in_transaction_session_timeout`` to
    IDLE_IN_TRANSACTION_TIMEOUT_S seconds unless the configuration already sets one.
    ``conn`` must be in autocommit mode (the setting then lasts for the session)."""
    conn.execute("SELECT set_config('idle_in_transaction_session_timeout', %s, false) "
                 "WHERE current_setting('idle_in_transaction_session_timeout') = '0'",
                 (f"{int(IDLE_IN_TRANSACTION_TIMEOUT_S * 1000)}ms",))


# TCP settings (libpq parameters; ignored on Unix sockets) so that a connection whose peer
# vanished — a partition, a dead middlebox — fails within about half a minute instead of
# blocking a thread until the kernel gives up, hours later: keepalive probes while waiting
# for an answer, and a bound on unacknowledged writes (PostgreSQL docs 32.1.2).
# connect_timeout bounds the connection set-up, which the statement deadline does not cover.
CONNECT_TIMEOUT_SECONDS = 10
TCP_LIVENESS = {"keepalives": "1", "keepalives_idle": "15", "keepalives_interval": "5",
                "keepalives_count": "3", "tcp_user_timeout": "30000",
                "connect_timeout": str(CONNECT_TIMEOUT_SECONDS)}


def has_password(url: str) -> bool:
    """Whether the libpq URL or conninfo ``url`` holds a password itself (a ``passfile`` is
    not one); False when it does not parse."""
    try:
        return bool(psycopg.conninfo.conninfo_to_dict(url).get("password"))
    except psycopg.ProgrammingError:
        return False


def tcp_liveness(url: str) -> dict[str, str]:
    """TCP_LIVENESS without the parameters ``url`` sets itself (the URL wins)."""
    try:
        given = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return {}
    return {k: v for k, v in TCP_LIVENESS.items() if k not in given}


# A pooled connection that has been idle this long is checked with a round trip on checkout
# (seconds, direct routes only). One used more recently is handed out after the free check
# alone (``_has_pending_input``): a server that restarted or ended the session has sent its
# termination notice and closed the socket by then, which the free check sees. Longer than an
# idle scheduler's claim poll and keep-alive (at most 15 s each by default), so that an idle
# scheduler's checkouts cost no round trip of their own: measured, a 10 s bound sent one
# before nearly every idle poll and doubled an idle scheduler's transactions.
CHECK_IDLE_SECONDS = 60.0


def make_pool(url: str, *, min_size: int = 1, max_size: int = 8, name: str = "pgdispatch",
              timeout_seconds: float = 10.0,
              statement_deadline_seconds: float | None = STATEMENT_DEADLINE_SECONDS,
              prepare_threshold: int | None = PREPARE_THRESHOLD) -> ConnectionPool:
    """A connection pool whose connections are checked on checkout, so that after a
    database restart a broken connection is replaced instead of handed out. Every answer a
    connection waits for, the check's included, is bounded by ``statement_deadline_seconds``
    (``Connection``); the check's by the checkout timeout too (at least
    CHECK_DEADLINE_SECONDS). ``prepare_threshold``: psycopg's (None: never prepare on the
    server; Settings).

    The check (``_check_on_checkout``): free for every connection, a look at its socket
    (input waiting on an idle connection is the peer's goodbye, or end of file); then, on a
    direct route only, an empty query for a connection idle more than CHECK_IDLE_SECONDS.
    Behind a pooler (recognised at connect, ``_reports_other_pid``) the empty query is never
    sent: it would test only the link to the pooler and cost the server a transaction each
    time; a connection that breaks there meets its
    caller as DatabaseUnavailable, which every caller retries."""

    def configure(conn: Connection) -> None:
        conn.statement_deadline_seconds = statement_deadline_seconds
        timestamps.register(conn.adapters)
        bound_idle_transactions(conn)
        conn.is_pooled_route = _reports_other_pid(conn)
        conn.released_at = time.monotonic()

    # The check on checkout is an empty query: a healthy server answers it at once, so it
    # waits no longer than the checkout itself may (at least CHECK_DEADLINE_SECONDS); a
    # stalled pooler then costs a checkout seconds, not a whole statement deadline.
    check_within = max(timeout_seconds, CHECK_DEADLINE_SECONDS)

    def check(conn: Connection) -> None:
        if not _needs_round_trip(conn):
            return
        with statement_deadline(conn, check_within):
            ConnectionPool.check_connection(conn)

    def reset(conn: Connection) -> None:
        conn.released_at = time.monotonic()

    return ConnectionPool(
        url, min_size=min_size, max_size=max_size, name=name, open=True,
        connection_class=Connection, timeout=timeout_seconds, check=check, reset=reset,
        kwargs=dict(autocommit=True, row_factory=dict_row, application_name=name,
                    prepare_threshold=prepare_threshold, **tcp_liveness(url)),
        configure=configure, reconnect_timeout=300)


def _reports_other_pid(conn: psycopg.Connection) -> bool:
    """Whether the server session's pg_backend_pid() differs from the process id the
    connection was given at start-up (BackendKeyData, which a cancel request names): a
    pooler answers the start-up itself, with a number of its own, so that a cancel comes to
    it; a plain TCP proxy passes the start-up through, and its session is the client's own.

    Raises:
        psycopg.Error: the connection broke.
    """
    row = conn.execute("SELECT pg_backend_pid() AS pid").fetchone()
    pid = row["pid"] if isinstance(row, dict) else row[0]
    return pid != conn.info.backend_pid


def _has_pending_input(conn: psycopg.Connection) -> bool:
    """Whether an idle connection's socket has input waiting (a termination notice, end of
    file, an error), without reading it: a zero-timeout select, no round trip."""
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return True  # no usable socket: let the round trip fail and the pool replace it
    return bool(readable)


def _needs_round_trip(conn: psycopg.Connection) -> bool:
    """Whether the checkout check sends its empty query (``make_pool``)."""
    if _has_pending_input(conn):
        return True
    if getattr(conn, "is_pooled_route", False):
        return False
    return time.monotonic() - getattr(conn, "released_at", 0.0) > CHECK_IDLE_SECONDS


def acquire(pool: ConnectionPool, *, timeout_seconds: float | None = None) -> psycopg.Connection:
    """Check a connection out of ``pool`` (checked alive on checkout, see make_pool), waiting
    at most ``timeout_seconds`` (the pool's own timeout when None). Give it back with
    ``release``; where a ``with`` block fits, use ``checkout``.

    Raises:
        DatabaseUnavailable: no healthy connection within the timeout, or the pool is closed.
    """
    try:
        return pool.getconn(timeout=timeout_seconds)
    except psycopg.Error as exc:
        raise _unavailable(exc, is_checkout=True) from None


def release(pool: ConnectionPool, conn: psycopg.Connection) -> None:
    """Give ``conn`` back to ``pool``; a connection left inside a transaction is rolled back
    by the pool, a broken one is discarded."""
    pool.putconn(conn)


@contextlib.contextmanager
def checkout(pool: ConnectionPool, *, timeout_seconds: float | None = None
             ) -> Iterator[psycopg.Connection]:
    """Borrow a connection from ``pool`` for one short piece of work (``acquire``, then
    ``release`` when the block ends, however it ends).

    A connection that met anything but one of the database's refusals (``REFUSALS``) is
    closed, not reused.

    Raises:
        DatabaseUnavailable: no connection within ``timeout_seconds`` (the pool's default when
        None), or the connection broke while in use (the server went away, was restarted,
        refused us, or gave no answer within the statement deadline).
        Our other exceptions (sql.errors) pass through; a psycopg error raised in the block is
        translated (sql.errors.translate), and one that is not ours is re-raised unchanged.
    """
    conn = acquire(pool, timeout_seconds=timeout_seconds)
    try:
        yield conn
    except psycopg.Error as exc:
        raised = _unavailable(exc, is_checkout=False)
        if not isinstance(raised, REFUSALS):
            _discard(conn)
        if raised is exc:
            raise
        raise raised from None
    except DatabaseUnavailable:
        _discard(conn)
        raise
    finally:
        release(pool, conn)


# The database's own answers to a request (SQLSTATE PD*, a constraint or a bad value): the
# connection that carried them is healthy. After any other error — a pooler's, a broken or
# stalled link, one we do not expect — the connection is closed rather than reused, so that
# what the caller retries runs on a fresh one.
REFUSALS = (NotFound, InvalidInput, Conflict, FencedOut)


def _discard(conn: psycopg.Connection) -> None:
    """Close ``conn`` so that its pool replaces it instead of handing it out again."""
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - it is being thrown away
        pass


def _unavailable(exc: psycopg.Error, *, is_checkout: bool) -> BaseException:
    """Our exception for a psycopg error met checking out or using a pooled connection;
    ``exc`` itself when it is not ours and was met in use."""
    message = str(exc).strip()
    message = message.splitlines()[0] if message else type(exc).__name__
    # Both pool errors are OperationalErrors, so they are tested first.
    if isinstance(exc, PoolTimeout):
        return DatabaseUnavailable(f"the database did not answer in time ({message})")
    if isinstance(exc, PoolClosed):
        return DatabaseUnavailable("the connection pool is closed")
    # InterfaceError is "the connection is closed", which a transition can hit when the
    # server dropped the connection between statements.
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return DatabaseUnavailable(message)
    raised = translate(exc)
    if raised is exc and is_checkout:
        # a checkout that fails is the database being unavailable, whatever the reason
        return DatabaseUnavailable(message)
    return raised


def close_pool(pool: ConnectionPool, *, timeout_seconds: float = 5.0) -> None:
    """Close ``pool`` and its connections, waiting at most ``timeout_seconds`` for workers."""
    pool.close(timeout=timeout_seconds)


def backoff_sleep(try_no: int, *, base_seconds: float = 0.01, cap_seconds: float = 1.0) -> None:
    """Sleep a full-jitter exponential delay: uniform(0, min(cap, base * 2**try_no)) seconds."""
    time.sleep(random.uniform(0, min(cap_seconds, base_seconds * (2 ** try_no))))


def in_transaction(conn: psycopg.Connection, fn: Callable[..., T], *args: Any,
                   tx_name: str = "transaction", max_tries: int = MAX_TRIES,
                   one_statement: bool = False, **kwargs: Any) -> T:
    """Run ``fn(conn, *args, **kwargs)`` in one transaction, retrying the whole of it after
    a deadlock (SQLSTATE 40P01) or serialization failure (40001), with jittered backoff,
    at most ``max_tries`` times (PostgreSQL docs 13.4, "Serialization Failure Handling");
    also after 42P10 or 42703, an ON CONFLICT arbiter or a column a migration replaced or
    dropped while the call ran (``RETRYABLE``).

    With ``one_statement`` (``fn`` sends exactly one statement on an autocommit connection)
    no BEGIN/COMMIT is sent: the statement is its own implicit transaction, committed by the
    server before it answers (PostgreSQL docs 55.2.2, "an implicit transaction block ... is
    committed at the Sync"; psycopg returns only after ReadyForQuery, so a returned result
    is a committed one). The row locks it takes are then held only while the server runs it,
    never across a round trip to a client that may be waiting for a CPU: on a busy
    organization that is what bounds how many claims per second its row admits
    (docs/design.md, "Design decisions, as measured": its first row).

    Raises:
        our exceptions (sql.errors) translated from database errors.
    """
    for try_no in range(1, max_tries + 1):
        try:
            if one_statement and conn.autocommit:
                return fn(conn, *args, **kwargs)
            with conn.transaction():
                return fn(conn, *args, **kwargs)
        except RETRYABLE as exc:
            metrics.TRANSACTION_RETRIES.labels(name=tx_name, sqlstate=exc.sqlstate or "").inc()
            log.warning("%s: %s (SQLSTATE %s), retry %d of %d", tx_name, type(exc).__name__,
                        exc.sqlstate, try_no, max_tries - 1)
            if try_no == max_tries:
                raise translate(exc) from None
            backoff_sleep(try_no)
        except psycopg.Error as exc:
            raised = translate(exc)
            if raised is exc:
                raise
            raise raised from None
    raise AssertionError("unreachable")


def transition(name: str, *, one_statement: bool = False
               ) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator for a transition ``fn(conn, ...)``: when the connection is idle it runs in
    its own retried transaction (``in_transaction``; ``one_statement``: ``fn`` sends exactly
    one statement, run as an implicit transaction); inside the caller's transaction it runs
    once, errors translated, and the caller owns the retry."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def run(conn: psycopg.Connection, *args: Any, **kwargs: Any) -> T:
            if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                return in_transaction(conn, fn, *args, tx_name=name, one_statement=one_statement,
                                      **kwargs)
            try:
                return fn(conn, *args, **kwargs)
            except psycopg.Error as exc:
                raised = translate(exc)
                if raised is exc:
                    raise
                raise raised from None
        return run
    return wrap


# one statement, no BEGIN: a BEGIN would wait under the connection's whole statement
# deadline, outside the check's shorter one (a pooler that holds every query)
@transition("ping_database", one_statement=True)
def ping_database(conn: psycopg.Connection) -> bool:
    """True when the server answers a trivial query within CHECK_DEADLINE_SECONDS (the
    console's /healthz: a load balancer's probe must get its answer in seconds).

    Raises:
        DatabaseUnavailable: the connection is broken, the server went away, or no answer
            came in time.
    """
    with statement_deadline(conn, CHECK_DEADLINE_SECONDS):
        return Q.ping_database(conn) == 1
