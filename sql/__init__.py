"""pgdispatch's one package that talks to PostgreSQL.

The SQL lives in ``sql/schema.sql`` (tables, indexes, types), ``sql/functions/*.sql`` (the
PL/pgSQL transitions and triggers), ``sql/*.sql`` (the named statements the Python modules
run) and ``sql/migrations/`` (what changes a live database's tables; see ``pgdispatch.sql.migrate``).
This package loads it, owns the connection pool and the retry policy, translates errors,
and exposes thin typed functions. ``webapp`` and ``scheduler`` call these and never import
psycopg themselves.
"""

from .errors import (AlreadyResolved, Conflict, DatabaseUnavailable, FencedOut, Forbidden,
                     IncompatibleDatabase, InvalidInput, NotFound, PgDispatchError)
from .settings import Settings

__all__ = ["AlreadyResolved", "Conflict", "DatabaseUnavailable", "FencedOut", "Forbidden",
           "IncompatibleDatabase", "InvalidInput", "NotFound", "PgDispatchError", "Settings"]
