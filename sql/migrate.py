"""Schema upgrades: the migrations in ``sql/migrations`` (applied by yoyo-migrations), then the
function files in ``sql/functions``, in one transaction.

Where the current definitions are:

* tables, columns, constraints, indexes, types: ``sql/schema.sql`` (read this one; a table
  change is a new migration plus the same change there, and tests/sql/test_schema.py fails
  when the two disagree);
* functions and triggers: ``sql/functions/*.sql``, one ``CREATE OR REPLACE`` each. They are
  not copied into migrations: every ``db upgrade`` whose function files differ from what the
  database last loaded runs all of them again (``FUNCTION_FILES``), so that editing a body
  and running ``pgdispatch db upgrade`` changes a live database.

* who owns it all and who may do what: ``sql/roles.sql``, ``sql/owner.sql``,
  ``sql/grants.sql`` (``pgdispatch.sql.roles``). Every upgrade runs as pgdispatch_owner
  when the login may (``SET LOCAL ROLE``), so that what it creates the owner owns, and
  applies the grants again after the function files load. The first upgrade of a server
  creates the group roles when its login may (CREATEROLE or superuser) and hands every
  object the login owns to pgdispatch_owner; a login that may not create them is told to
  run ``pgdispatch db roles`` (as one that may) first.

docs/contributing.md says how to change either.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from psycopg.rows import dict_row

from . import roles
from .db import PREPARE_THRESHOLD, backoff_sleep, connect
from .errors import Forbidden, IncompatibleDatabase, PgDispatchError

log = logging.getLogger(__name__)

SQL_DIR = Path(__file__).parent
MIGRATIONS_DIR = SQL_DIR / "migrations"
FUNCTIONS_DIR = SQL_DIR / "functions"
SCHEMA_FILE = SQL_DIR / "schema.sql"
# Load order: a LANGUAGE sql function is checked against what exists when it is created, so
# a file comes after every file whose functions its SQL functions call (plpgsql bodies are
# resolved when they run, and triggers follow their functions within each file).
FUNCTION_FILES = ("audit.sql", "capacity.sql", "claim.sql", "wakeups.sql", "complete.sql", "expire.sql",
                  "submit.sql", "operator.sql", "limits.sql", "runners.sql", "summaries.sql",
                  "accounts.sql", "lists.sql", "bulk.sql", "health.sql")
# The migration ids of development versions before 0.1.0, squashed into 0001_baseline: a
# database that has any of them cannot be upgraded (its tables are not the baseline's).
PRE_RELEASE_IDS = frozenset({"0001_initial", "0014_capacity_stripes"})

# Advisory lock key taken by every try of an upgrade, first in its transaction and released
# with it, so that several hosts running `db upgrade` at once apply each migration exactly
# once. Transaction-level, not session-level: through a pooler in transaction mode a session
# lock stays on whichever server connection ran the statement, which then serves other
# clients, and the unlock may run on another one (tests/pooling/test_upgrade.py).
ADVISORY_LOCK_KEY = 7_261_626_001
UPGRADE_LOCK_SQL = "SELECT pg_advisory_xact_lock(%s)"
# The tables the transitions lock, in the order a claim or a completion first locks them
# (docs/design.md, "Lock order"). An upgrade takes them all before it changes anything, in
# EXCLUSIVE mode when only function files changed, in ACCESS EXCLUSIVE mode when a migration
# is pending (its DDL needs that). That waits for every transition in flight and holds new
# ones off until it commits, so no transaction runs an old function body beside a new one;
# plain reads (the console) go on while only functions change. A transition already holding a later table can still deadlock
# with it (40P01; the upgrade, waiting first, is the usual victim), and a long transaction
# holding one of them would queue every transition behind the upgrade: LOCK_TIMEOUT gives
# up instead. Either rolls the whole upgrade back, and it is tried again, up to
# UPGRADE_TRIES times. While a try waits, the tables it already holds hold transitions off,
# up to LOCK_TIMEOUT each try: behind a transaction that never ends, claims stall for about
# a minute in all before the upgrade gives up (run it again when that transaction is gone).
# runners comes first: a claim reads its runner row (its drain) before it locks any job.
UPGRADE_LOCKS = ("runners", "jobs", "targets", "attempts", "projects", "organizations", "pools",
                 "capacity_stripes", "capacity_debts", "delivery_receipts", "audit_events")
LOCK_TIMEOUT = "5s"
RETRY_SQLSTATES = {"40P01", "55P03"}
UPGRADE_TRIES = 10


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


def function_sources(functions_dir: Path = FUNCTIONS_DIR) -> list[tuple[str, str]]:
    """``(file name, text)`` of every function file, in load order.

    Raises:
        FileNotFoundError: a file of FUNCTION_FILES is missing.
        ValueError: ``functions_dir`` holds a .sql file that FUNCTION_FILES does not list
            (it would never be loaded).
    """
    unlisted = sorted({p.name for p in functions_dir.glob("*.sql") if not p.name.startswith(".")}
                      - set(FUNCTION_FILES))  # an editor's lock or backup file is not ours
    if unlisted:
        raise ValueError(f"{functions_dir} has files not in FUNCTION_FILES: {', '.join(unlisted)}")
    return [(name, (functions_dir / name).read_text()) for name in FUNCTION_FILES]


def definitions_digest(sources: list[tuple[str, str]]) -> str:
    """sha256 (hex) of the function files, names and texts in load order, and of the
    grants (sql/grants.sql: a changed grant is applied by the next upgrade)."""
    h = hashlib.sha256()
    for name, text in [*sources, ("grants.sql", roles.GRANTS_FILE.read_text())]:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def _check_compatible(conn, known: set[str]) -> None:
    """Refuse, before anything is changed, a database this version cannot upgrade."""
    row = conn.execute("SELECT to_regclass('_yoyo_migration') IS NOT NULL AS has_record, "
                       "       to_regclass('jobs') IS NOT NULL AS has_jobs").fetchone()
    if not row["has_record"]:
        if row["has_jobs"]:
            raise IncompatibleDatabase(
                "this database has a jobs table but no record of pgdispatch migrations: "
                "point DATABASE_URL at an empty database or one made by pgdispatch")
        return
    applied = [r["migration_id"] for r in conn.execute(
        "SELECT migration_id FROM _yoyo_migration ORDER BY applied_at_utc, migration_id")]
    unknown = [m for m in applied if m not in known]
    if not unknown:
        return
    if PRE_RELEASE_IDS & set(applied):
        raise IncompatibleDatabase(
            f"this database was made by a development version of pgdispatch before 0.1.0 "
            f"(last migration {applied[-1]}), which 0.1.0 cannot upgrade: start from a new "
            f"database (for the demo's embedded server: stop it, then remove .pgdispatch/)")
    raise IncompatibleDatabase(
        f"this database has migrations this pgdispatch does not know ({', '.join(unknown[:3])}"
        f"{' …' if len(unknown) > 3 else ''}): it was upgraded by a newer version; run that one")


class Applied(list):
    """The migration ids an upgrade applied, in order (a list), and whether it reloaded the
    function files (``functions_reloaded``)."""

    functions_reloaded: bool = False


def upgrade(url: str, *, migrations_dir: Path = MIGRATIONS_DIR,
            functions_dir: Path = FUNCTIONS_DIR) -> Applied:
    """Apply pending migrations and reload changed function files; return the migration ids
    applied (empty when none was pending), with ``functions_reloaded`` saying whether the
    function files were loaded.

    After a check of the database (read only), one transaction does all of it: the advisory
    lock ``ADVISORY_LOCK_KEY``, yoyo's own tables when new, the UPGRADE_LOCKS (see there;
    LOCK_TIMEOUT), every pending migration, then every function file when their digest
    differs from the one the database last loaded (kept in ``_pgdispatch_definitions``), then
    yoyo's record. Safe to run from several processes or hosts at once: the advisory lock
    (PostgreSQL docs 13.3.5), held until that transaction ends, serialises them, and the
    second finds nothing pending. Safe under live claims and completions: an upgrade rolled
    back by a deadlock or its lock timeout (``RETRY_SQLSTATES``) is tried again after a
    jittered backoff (0.1 s doubling, at most 5 s), at most ``UPGRADE_TRIES`` times; then
    its error is raised. Safe through a pooler in transaction mode (PgBouncer): nothing
    outlives the transaction on the server connection, and no statement is prepared on it
    (tests/pooling/test_upgrade.py). ``migrations_dir`` and ``functions_dir`` are for tests.

    Raises:
        IncompatibleDatabase: the database was made by a pre-0.1.0 development version, or
            by a newer one, or is not pgdispatch's; nothing is changed.
        Forbidden: the login may not create the missing group roles, or may not become
            pgdispatch_owner (_become_owner); nothing is changed.
        DatabaseUnavailable: the server cannot be reached.
    """
    from yoyo import read_migrations

    sources = function_sources(functions_dir)
    digest = definitions_digest(sources)
    migrations = read_migrations(str(migrations_dir))
    with connect(url, application_name="pgdispatch-migrate") as conn:
        # Read-only, so outside the lock: yoyo's tables and the baseline's are created in one
        # transaction, so a concurrent upgrade's work is seen whole or not at all.
        _check_compatible(conn, {m.id for m in migrations})
    backend = _yoyo_backend(url)
    try:
        for try_no in range(1, UPGRADE_TRIES + 1):
            try:
                applied = _upgrade_once(backend, migrations, sources, digest)
                break
            except Exception as exc:
                state = _sqlstate(exc)
                if state not in RETRY_SQLSTATES or try_no == UPGRADE_TRIES:
                    raise
                log.warning("upgrade rolled back (SQLSTATE %s), try %d of %d: %s",
                            state, try_no, UPGRADE_TRIES, " ".join(str(exc).split()))
                backoff_sleep(try_no, base_seconds=0.1, cap_seconds=5.0)
    finally:
        backend.connection.close()
    for mid in applied:
        log.info("applied migration %s", mid)
    if applied.functions_reloaded:
        log.info("loaded the function files (%s)", digest[:12])
    return applied


def _yoyo_backend(url: str):
    """yoyo's backend for ``url``, its connection set never to prepare a statement on the
    server (``PREPARE_THRESHOLD``): it runs some statements more than five times, and a
    prepared one would stay on a pooler's shared server connection."""
    from yoyo import get_backend

    backend = get_backend(_yoyo_url(url))
    backend.connection.prepare_threshold = PREPARE_THRESHOLD
    return backend


def _clear_yoyo_lock(conn) -> None:
    """Delete a lock row yoyo left behind. pgdispatch serialises upgrades with its advisory
    lock, which PostgreSQL releases with the transaction however the process ends, and never
    takes yoyo's own lock row; one left by a killed older upgrade (or a yoyo command) would
    make yoyo's commands wait and fail ("Process N has locked this database")."""
    if conn.execute("SELECT to_regclass('yoyo_lock') IS NOT NULL AS e").fetchone()["e"]:
        conn.execute("DELETE FROM yoyo_lock")


_OURS = """
    SELECT p.oid::regprocedure::text AS what, p.xmin::text AS version FROM pg_proc p
     WHERE p.pronamespace = 'public'::regnamespace AND p.proname LIKE 'pgd%'
       -- not an index expression's function (pgd_command_text): sql/schema.sql defines it
       AND NOT EXISTS (SELECT 1 FROM pg_depend d
                        WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_proc'::regclass
                          AND d.refobjid = p.oid)
    UNION ALL
    SELECT format('trigger %s on %s', t.tgname, t.tgrelid::regclass), t.xmin::text
      FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
     WHERE NOT t.tgisinternal AND c.relnamespace = 'public'::regnamespace"""


def _catalog_versions(conn) -> dict[str, str]:
    """Our functions and triggers, each with the version (xmin) of its catalog row."""
    return {what: version for what, version in conn.execute(_OURS).fetchall()}


def _refuse_leftovers(before: dict[str, str], after: dict[str, str]) -> None:
    """Refuse a database that keeps a pgd* function, or a trigger on its tables, that no
    function file defines (removed from a file, or a signature changed, without a migration
    that drops the old one): loading every file rewrites the catalog row of everything they
    define, so such an object is the one whose row kept its version.

    Raises:
        PgDispatchError: naming the objects (the upgrade is rolled back).
    """
    left = sorted(what for what, version in after.items() if before.get(what) == version)
    if left:
        raise PgDispatchError(
            "the database has what no file in sql/functions/ defines: " + ", ".join(left)
            + "; drop it in a migration (docs/contributing.md); nothing was changed")


_FOREIGN_OBJECTS = """
    SELECT EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace
                      AND c.relowner <> 'pgdispatch_owner'::regrole)
        OR EXISTS (SELECT 1 FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace
                      AND p.proowner <> 'pgdispatch_owner'::regrole) AS is_foreign"""


def _become_owner(conn) -> bool:
    """In the upgrade's transaction, before it changes anything: create the group roles when
    they are missing and the login may, hand the schema's objects to pgdispatch_owner when
    another role owns some, then ``SET LOCAL ROLE pgdispatch_owner`` when the login may.
    Returns whether objects were handed over (the grants must then be applied again).

    Raises:
        Forbidden: the roles are missing and this login may not create them, or this login
            may not become pgdispatch_owner; nothing is changed.
    """
    with conn.cursor(row_factory=dict_row) as cur:
        status = roles.role_status(cur)
        if status["missing"]:
            if not (status["is_superuser"] or status["can_create_roles"]):
                raise Forbidden(
                    "the database roles (sql/roles.sql) do not exist and this login may not "
                    "create them: run `pgdispatch db roles` as a login with CREATEROLE first "
                    "(docs/operations.md, \"Database roles\"); nothing was changed")
            roles.create_roles(cur)
            status = roles.role_status(cur)
        if not status["may_become_owner"]:
            # upgrading as itself would leave objects the owner does not own, which no
            # migrator could upgrade or grant afterwards
            raise Forbidden(
                "this login may not become pgdispatch_owner (SET ROLE): run `db upgrade` as a "
                "migrator login (`pgdispatch db login NAME --role migrator`) or a superuser "
                "(docs/operations.md, \"Database roles\"); nothing was changed")
        is_adopted = cur.execute(_FOREIGN_OBJECTS).fetchone()["is_foreign"]
        roles.adopt_schema(cur)  # also lets the owner create in the schema
        roles.restrict_advisory_locks(cur)  # a superuser's upgrade: sql/advisory.sql
        cur.execute(f"SET LOCAL ROLE {roles.OWNER}")
    return bool(is_adopted)


def _upgrade_once(backend, migrations, sources: list[tuple[str, str]], digest: str) -> Applied:
    """One try of ``upgrade`` on yoyo's connection, in one transaction; the ids applied."""
    from yoyo import internalmigrations

    conn = backend.connection  # psycopg: no placeholder parsing without parameters
    with backend.transaction():
        conn.execute(UPGRADE_LOCK_SQL, (ADVISORY_LOCK_KEY,))
        is_adopted = _become_owner(conn)
        with conn.cursor(row_factory=dict_row) as cur:
            _clear_yoyo_lock(cur)
        # yoyo's own tables, in this transaction (a savepoint), under the advisory lock:
        # backend.ensure_internal_schema_updated would take yoyo's lock row in transactions
        # of its own instead
        if internalmigrations.needs_upgrading(backend):
            internalmigrations.upgrade(backend)
        pending = backend.to_apply(migrations)
        conn.execute("CREATE TABLE IF NOT EXISTS _pgdispatch_definitions ("
                     " digest text NOT NULL, loaded_at timestamptz NOT NULL DEFAULT now())")
        loaded = conn.execute("SELECT digest FROM _pgdispatch_definitions").fetchone()
        if not pending and loaded is not None and loaded[0] == digest and not is_adopted:
            return Applied()
        conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        existing = [t for t in UPGRADE_LOCKS
                    if conn.execute("SELECT to_regclass(%s)", (t,)).fetchone()[0] is not None]
        if existing:
            # a migration's DDL needs ACCESS EXCLUSIVE: taken up front, in order, since a
            # lock raised later waits for readers that may be queued behind it (a deadlock)
            mode = "ACCESS EXCLUSIVE" if pending else "EXCLUSIVE"
            conn.execute(f"LOCK TABLE {', '.join(existing)} IN {mode} MODE")
        for migration in pending:
            log.info("applying migration %s", migration.id)
            try:
                migration.process_steps(backend, "apply")  # nested: a savepoint in this transaction
            except Exception as exc:
                if _sqlstate(exc) in RETRY_SQLSTATES:
                    raise
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise PgDispatchError(
                    f"sql/migrations/{migration.id}: {first} (nothing was changed)") from exc
            backend.log_migration(migration, "apply")
            backend.mark_one(migration, log=False)
        before = _catalog_versions(conn)
        for name, text in sources:
            log.debug("loading sql/functions/%s", name)
            try:
                conn.execute(text)
            except Exception as exc:
                if _sqlstate(exc) in RETRY_SQLSTATES:
                    raise
                # the whole upgrade is rolled back; say which file, in one line
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise PgDispatchError(f"sql/functions/{name}: {first} (nothing was changed)") from exc
        _refuse_leftovers(before, _catalog_versions(conn))
        roles.apply_grants(conn)
        conn.execute("DELETE FROM _pgdispatch_definitions")
        conn.execute("INSERT INTO _pgdispatch_definitions (digest) VALUES (%s)", (digest,))
    applied = Applied(m.id for m in pending)
    applied.functions_reloaded = True
    return applied


def applied_migrations(url: str) -> list[str]:
    """Ids of the migrations recorded as applied, in order."""
    with connect(url) as conn:
        exists = conn.execute("SELECT to_regclass('_yoyo_migration') IS NOT NULL AS e").fetchone()["e"]
        if not exists:
            return []
        rows = conn.execute("SELECT migration_id FROM _yoyo_migration ORDER BY applied_at_utc, migration_id")
        return [r["migration_id"] for r in rows]
