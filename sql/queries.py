"""The named SQL statements of ``sql/*.sql``, loaded once with aiosql (psycopg adapter)."""

from __future__ import annotations

from pathlib import Path

import aiosql

SQL_DIR = Path(__file__).parent

# Every top-level .sql file; migrations/ holds the schema and is applied by sql.migrate.
Q = aiosql.from_str("\n\n".join(p.read_text() for p in sorted(SQL_DIR.glob("*.sql"))), "psycopg",
                    mandatory_parameters=False)
