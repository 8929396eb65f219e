"""Schema migrations: the numbered SQL files in ``sql/migrations``, applied by yoyo-migrations."""

from __future__ import annotations

import logging
from pathlib import Path

from .db import connect

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# pg_advisory_lock key held while migrating, so that several hosts running `db upgrade` at
# once apply each migration exactly once (yoyo's own lock table is a second line of defence).
ADVISORY_LOCK_KEY = 7_261_626_001


def _yoyo_url(url: str) -> str:
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme):]
    return url


def upgrade(url: str) -> list[str]:
    """Apply pending migrations; return the ids applied (empty when up to date).

    Safe to run from several processes or hosts at once: a session-level advisory lock
    (PostgreSQL docs 13.3.5) serialises them, and each migration runs in one transaction.
    """
    from yoyo import get_backend, read_migrations

    with connect(url, application_name="pgdispatch-migrate") as lock_conn:
        lock_conn.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_LOCK_KEY,))
        try:
            backend = get_backend(_yoyo_url(url))
            try:
                migrations = read_migrations(str(MIGRATIONS_DIR))
                with backend.lock():
                    pending = backend.to_apply(migrations)
                    backend.apply_migrations(pending)
                applied = [m.id for m in pending]
            finally:
                backend.connection.close()
        finally:
            lock_conn.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_LOCK_KEY,))
    for mid in applied:
        log.info("applied migration %s", mid)
    return applied


def applied_migrations(url: str) -> list[str]:
    """Ids of the migrations recorded as applied, in order."""
    with connect(url) as conn:
        exists = conn.execute("SELECT to_regclass('_yoyo_migration') IS NOT NULL AS e").fetchone()["e"]
        if not exists:
            return []
        rows = conn.execute("SELECT migration_id FROM _yoyo_migration ORDER BY applied_at_utc, migration_id")
        return [r["migration_id"] for r in rows]
