"""pgdispatch's one package that talks to PostgreSQL.

The SQL lives in ``sql/*.sql`` (named statements) and ``sql/migrations/*.sql`` (the schema
and the PL/pgSQL transitions); this package loads it, owns the connection pool and the retry
policy, translates errors, and exposes thin typed functions. ``webapp`` and ``scheduler``
call these and never import psycopg themselves.
"""

from .errors import (AlreadyResolved, Conflict, DatabaseUnavailable, FencedOut, InvalidInput,
                     NotFound, PgDispatchError)
from .settings import Settings

__all__ = ["AlreadyResolved", "Conflict", "DatabaseUnavailable", "FencedOut", "InvalidInput",
           "NotFound", "PgDispatchError", "Settings"]
