"""pgdispatch's exceptions, and the one place where database errors become them."""

from __future__ import annotations


class PgDispatchError(Exception):
    """Base class; ``str(err)`` is a one-line message fit for an operator."""

    http_status = 400


class InvalidInput(PgDispatchError):
    """The request is malformed or out of range (SQLSTATE PD422 and kin); nothing was changed."""

    http_status = 422


class UnknownFilter(InvalidInput):
    """A list was asked to filter by a name (or runner id) that does not exist: a mistyped
    link or option. Invalid input to the console and the CLI (422, exit 2); the API answers
    404, as for an unknown name in its path (webapp/api.py)."""


class Forbidden(PgDispatchError):
    """The database refused the action to this identity; nothing was changed. SQLSTATE PD403:
    pgd_authorize (sql/functions/audit.sql: the login, or the user it names, may not act so),
    a runner host's login not granted the pool or acting for another login's runner
    (sql/functions/claim.sql), an approver the target's rule does not allow
    (sql/functions/operator.sql); the message names the identity and the rule. Or
    PostgreSQL's own 42501 (insufficient privilege), when a role tries what its grants do not
    allow (sql/grants.sql)."""

    http_status = 403


class NotFound(PgDispatchError):
    """An entity named in the request does not exist (SQLSTATE PD404)."""

    http_status = 404


class Conflict(PgDispatchError):
    """The entity is not in the state the action expects (SQLSTATE PD409)."""

    http_status = 409


class AlreadyResolved(Conflict):
    """The entity is already past the action (SQLSTATE PDALR): another actor or the system moved it
    first, or it never was in the state the action undoes; the message says why, and when."""


class FencedOut(PgDispatchError):
    """The attempt is no longer the job's current running attempt (SQLSTATE PDF01): stop now."""

    http_status = 409


class IncompatibleDatabase(PgDispatchError):
    """The database was made by a version of pgdispatch this one cannot upgrade (or is not
    pgdispatch's); nothing was changed. The message says what to do."""

    http_status = 503


class DatabaseUnavailable(PgDispatchError):
    """PostgreSQL could not be reached or went away mid-transaction."""

    http_status = 503


# SQLSTATEs (and classes: two characters) that say the database, or the pooler in front of
# it, cannot serve this request now: nothing about the request is wrong, and the same request
# on a fresh connection, later, may well succeed. They become DatabaseUnavailable: 503 in the
# console and the API, exit code 5 in the CLI, a retry on a fresh connection in the scheduler.
# Each with what it means, for the message ("" where the server's own words say it).
UNAVAILABLE_STATES = {
    # connection exceptions; PgBouncer sends 08P01 for every error of its own
    # ("query_wait_timeout", "no more connections allowed (max_client_conn)", "server login
    # retry", "pgbouncer cannot connect to server"), and the server sends it for a bind
    # that does not fit the prepared statement a pooled connection holds
    "08": "",
    "08P01": "the connection pooler or the server refused the request",
    # the server is shutting down, crashed, is starting, dropped the database, or ended a
    # session idle too long
    "57P01": "", "57P02": "", "57P03": "", "57P04": "", "57P05": "",
    # a statement cancelled: statement_timeout, a client deadline, or an operator's
    # pg_cancel_backend; nothing it did was committed, and the server may answer in time later
    "57014": "a statement took too long and was cancelled",
    # out of connections, memory or disk; lock_timeout
    "53": "the server is out of resources", "55P03": "the database is busy",
    # a prepared statement missing or doubled: pgdispatch never prepares one (sql/db.py,
    # PREPARE_THRESHOLD), so only a connection shared through a pooler can meet another's
    "26000": "a pooled connection lost or mixed up a prepared statement",
    "42P05": "a pooled connection lost or mixed up a prepared statement",
    # the session was ended idle inside a transaction; a standby or a failover refuses writes
    "25P03": "",
    "25006": "the database is read-only now (a standby, or a failover in progress)",
    # the server's own I/O or system errors
    "58": "the server had a system error",
}


def _unavailable_why(state: str | None) -> str | None:
    """What an unavailable SQLSTATE means (UNAVAILABLE_STATES: by code, else by class), or
    None when ``state`` does not mean unavailable."""
    for key in (state, (state or "")[:2]):
        if key and key in UNAVAILABLE_STATES:
            return UNAVAILABLE_STATES[key]
    return None


def translate(exc: BaseException) -> BaseException:
    """Map a psycopg error to our exception; return ``exc`` unchanged when it is not ours
    (a genuine bug: a syntax error, an undefined function, an internal error stays a 500).

    The database or its pooler unable to serve us (UNAVAILABLE_STATES; libpq's errors, which
    have no SQLSTATE: refused, reset, closed; any other psycopg OperationalError) is
    DatabaseUnavailable, with a one-line message that starts "database unavailable:" and
    names the SQLSTATE when there is one."""
    import psycopg

    if isinstance(exc, UnicodeEncodeError):
        return InvalidInput("text must be valid UTF-8")
    if not isinstance(exc, psycopg.Error):
        return exc
    state = getattr(exc, "sqlstate", None)
    diag = getattr(exc, "diag", None)
    message = (diag.message_primary if diag is not None and diag.message_primary else str(exc)).strip()
    message = message.splitlines()[0] if message else "database error"
    if state is None and isinstance(exc, psycopg.DataError) and "NUL" in message:
        # raised by psycopg itself while adapting a parameter: text cannot hold NUL bytes
        return InvalidInput("text must not contain NUL bytes")
    if state == "PD404":
        return NotFound(message)
    if state == "PD403":
        return Forbidden(message)
    if state == "42501":
        # PostgreSQL's own refusal names the object, not why: say where the rule is
        return Forbidden(f"{message}: this login's group role does not allow it "
                         "(sql/grants.sql; docs/operations.md, \"Database roles\")")
    if state == "PDALR":
        return AlreadyResolved(message)
    if state == "PD409":
        return Conflict(message)
    if state == "PD422":
        return InvalidInput(message)
    if state == "PDF01":
        return FencedOut(message)
    if state in ("23514", "22001", "22003", "22P02", "22023", "22007", "22008", "23502", "54000"):
        # check violation, string too long, numeric out of range, bad text representation...
        return InvalidInput(message)
    if state == "23505":
        return Conflict(message)
    if state in ("40P01", "40001"):
        # still failing after in_transaction's retries: the database is too contended now
        return DatabaseUnavailable(f"database busy ({message}); try again")
    why = _unavailable_why(state)
    if why is not None:
        return DatabaseUnavailable(f"database unavailable: {why + ': ' if why else ''}{message} "
                                   f"(SQLSTATE {state})")
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        # libpq's own (no SQLSTATE: refused, reset, closed), and the rest of the classes
        # psycopg calls operational (55, 54001...): not the request's fault either
        return DatabaseUnavailable(f"database unavailable: {message}"
                                   + (f" (SQLSTATE {state})" if state else ""))
    return exc
