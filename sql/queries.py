"""The named SQL statements of ``sql/*.sql``, loaded once with aiosql (psycopg adapter)."""

from __future__ import annotations

from pathlib import Path

import aiosql

SQL_DIR = Path(__file__).parent

# Every top-level .sql file but the scripts: the tables (schema.sql), the functions
# (functions/) and the migrations are the database's own, applied by sql.migrate, as are
# the roles, their grants, the schema's owner and the advisory locks (sql/roles.py).
SCRIPTS = {"schema.sql", "roles.sql", "grants.sql", "owner.sql", "advisory.sql"}
Q = aiosql.from_str("\n\n".join(p.read_text() for p in sorted(SQL_DIR.glob("*.sql"))
                                 if p.name not in SCRIPTS),
                    "psycopg", mandatory_parameters=False)
