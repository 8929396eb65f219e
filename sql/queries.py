"""The named SQL statements of ``sql/*.sql``, loaded once with aiosql (psycopg adapter)."""

from __future__ import annotations

from pathlib import Path

import aiosql

SQL_DIR = Path(__file__).parent
FILES = ("attempts.sql", "jobs.sql", "projects.sql", "targets.sql", "runners.sql",
         "summaries.sql", "audit.sql", "config.sql")

Q = aiosql.from_str("\n\n".join((SQL_DIR / f).read_text() for f in FILES), "psycopg",
                     mandatory_parameters=False)
