"""Schema migrations: the numbered SQL files in ``sql/migrations``, applied by yoyo-migrations."""

from __future__ import annotations

import logging
from pathlib import Path

from .db import backoff_sleep, connect

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# pg_advisory_lock key held while migrating, so that several hosts running `db upgrade` at
# once apply each migration exactly once (yoyo's own lock table is a second line of defence).
ADVISORY_LOCK_KEY = 7_261_626_001
# A migration that changes tables the transitions use takes ACCESS EXCLUSIVE locks while
# claims and completions run; one can deadlock with a transition in flight (40P01; the
# migration, waiting first, is the usual victim) or give up waiting after its lock_timeout
# (55P03, set by the migration itself so that traffic does not queue behind it for long).
# Either rolls the migration back whole; it is then tried again, up to MIGRATION_TRIES.
RETRY_SQLSTATES = {"40P01", "55P03"}
MIGRATION_TRIES = 10


def _sqlstate(exc: BaseException | None) -> str | None:
    """The SQLSTATE of ``exc`` or of the database error it wraps, if any."""
    seen = 0
    while exc is not None and seen < 5:
        state = getattr(exc, "sqlstate", None) or getattr(getattr(exc, "diag", None), "sqlstate", None)
        if state:
            return state
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _yoyo_url(url: str) -> str:
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme):]
    return url


def upgrade(url: str) -> list[str]:
    """Apply pending migrations; return the ids applied (empty when up to date).

    Safe to run from several processes or hosts at once: a session-level advisory lock
    (PostgreSQL docs 13.3.5) serialises them, and each migration runs in one transaction.
    Safe to run while schedulers and the web app run: a migration rolled back by a deadlock
    or its lock timeout (``RETRY_SQLSTATES``) is tried again after a jittered backoff (0.1 s
    doubling, at most 5 s), at most ``MIGRATION_TRIES`` times; then its error is raised.
    """
    from yoyo import get_backend, read_migrations

    with connect(url, application_name="pgdispatch-migrate") as lock_conn:
        lock_conn.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_LOCK_KEY,))
        try:
            backend = get_backend(_yoyo_url(url))
            try:
                migrations = read_migrations(str(MIGRATIONS_DIR))
                with backend.lock():
                    applied = [m.id for m in backend.to_apply(migrations)]
                for try_no in range(1, MIGRATION_TRIES + 1):
                    try:
                        with backend.lock():
                            backend.apply_migrations(backend.to_apply(migrations))
                        break
                    except Exception as exc:
                        state = _sqlstate(exc)
                        if state not in RETRY_SQLSTATES or try_no == MIGRATION_TRIES:
                            raise
                        log.warning("migration rolled back (SQLSTATE %s), try %d of %d: %s",
                                    state, try_no, MIGRATION_TRIES, str(exc).splitlines()[0])
                        backoff_sleep(try_no, base_seconds=0.1, cap_seconds=5.0)
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
