"""pgdispatch's exceptions, and the one place where database errors become them."""

from __future__ import annotations


class PgDispatchError(Exception):
    """Base class; ``str(err)`` is a one-line message fit for an operator."""

    http_status = 400


class InvalidInput(PgDispatchError):
    """The request is malformed or out of range (SQLSTATE PD422 and kin); nothing was changed."""

    http_status = 422


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


def translate(exc: BaseException) -> BaseException:
    """Map a psycopg error to our exception; return ``exc`` unchanged when it is not ours."""
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
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return DatabaseUnavailable(message)
    return exc
