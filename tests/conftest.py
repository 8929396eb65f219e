"""Test fixtures: a real PostgreSQL (embedded by default, DATABASE_URL when given).

The schema is migrated once per session into a template database. Where a test's ``conn``
and ``world`` write follows one rule:

* **Rolled back** (the default): ``conn`` is one connection to a database the session shares,
  inside a transaction that is rolled back when the test ends. Nothing a test writes outlives
  it and no database is created for it. A transition runs there as inside any caller's
  transaction (``pgdispatch.sql.db.transition``): once, without a transaction of its own, so a refusal
  from the database aborts the test's transaction. A test that goes on after an expected
  refusal gives that call a savepoint: ``with pytest.raises(FencedOut), conn.transaction():``.
  A test that ends the transaction itself (a COMMIT) fails.
* **Own database**: a test that shares its database with another connection — it asks for
  ``db_url`` or for a fixture built on it (``app``, ``start_scheduler``, ``proxy``,
  ``live_server``) — or that is marked ``own_database`` gets a fresh ``CREATE DATABASE …
  TEMPLATE`` copy, and ``conn`` is an autocommit connection to it: every transition commits,
  as in production.

Mark a test ``own_database`` (a module: ``pytestmark = pytest.mark.own_database``) when it
depends on what only commits give, even on one connection: ``now()`` moving on (it is the
transaction's start time, so a backoff or ``ready_at`` never passes inside one), NOTIFY
(delivered at commit), statements refused inside a transaction block (VACUUM, CREATE INDEX
CONCURRENTLY) or needing a transaction of their own (SET TRANSACTION ISOLATION LEVEL), ids
counted from 1 (a rollback does not give sequence values back), or a plan chosen from statistics (ANALYZE writes a table's row count
in place, outside the transaction, and autovacuum of the shared database, woken by earlier
tests' rolled-back rows, may overwrite it during the test).

Tests only ever create and drop databases named ``pgd_test_*``; the database named in
DATABASE_URL itself is never written, nor its server's settings. The embedded server runs
with fsync, synchronous_commit and full_page_writes off: durability is not what any test here
checks, and no test crashes this server (the restart test, tests/faults/test_db_restart.py,
crashes a server of its own, with the default settings).
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import pytest

from pgdispatch.sql.embedded import ensure_runtime_dir  # noqa: E402

ensure_runtime_dir()

from pgdispatch.sql import db, migrate, roles  # noqa: E402

from .factories import World  # noqa: E402

TEMPLATE = "pgd_test_template"
# Every migration in sql/migrations/, in order: what `db upgrade` applies to a new database
# (tests/sql/test_migrations.py, test_schema.py, tests/cli/test_cli.py, test_packaging.py).
MIGRATIONS = ["0001_baseline", "0002_claim_tombstones", "0003_audit_login",
              "0004_sessions_and_tokens", "0005_runner_grants", "0006_complete_entry_point",
              "0007_duty_leases", "0008_claim_wakeups", "0009_reason_summaries",
              "0010_history_charts", "0011_audit_job", "0012_supersede_and_order",
              "0013_pool_pause_and_drain", "0015_job_search",
              "0016_search_statistics", "0017_project_running_stripes",
              "0018_console_at_scale", "0019_queue_by_age",
              "0020_jobs_by_pool", "0021_jobs_by_runner", "0022_jobs_by_age"]
_counter = itertools.count()

# Off for the embedded test server only (all three take effect on a reload; PostgreSQL docs
# 19.5.1): a commit may then be lost if the server or the machine crashes, which no test
# here does to this server; a committed transaction is still visible to every session at once.
NOT_DURABLE = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}

def pytest_configure(config):
    config.addinivalue_line(
        "markers", "own_database: conn and world commit into a fresh database of this test's "
                   "own instead of a rolled-back transaction (tests/conftest.py)")
    config.addinivalue_line(
        "markers", "solo: measures a share or a rate over seconds of real claiming, so it runs "
                   "with no other test beside it: `make test` runs these after the parallel "
                   "part, serially (-m solo); every test in tests/fairness is one")


# tests/fairness measures running ratios over seconds of concurrent claims: a parallel
# worker's load beside it moves a ratio out of its tolerance (a weighted run read 2.32 for
# 3.0 ± 0.5 beside the other worker), so they run alone
SOLO_DIRS = ("fairness",)


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(root).parts
        if parts and parts[0] in SOLO_DIRS:
            item.add_marker(pytest.mark.solo)


def with_database(url: str, name: str) -> str:
    """The same server URL pointing at database ``name``."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


@pytest.fixture(scope="session")
def server_url(tmp_path_factory):
    """A URL for the server's maintenance database (``postgres``)."""
    if os.environ.get("DATABASE_URL"):
        yield os.environ["DATABASE_URL"]
        return
    from pgdispatch.sql import embedded

    base = Path(tempfile.mkdtemp(prefix="pgd-test-"))
    # the server the product starts (scram-sha-256, a password file); URLs the tests build
    # for their proxies name no passfile, so libpq finds the password through PGPASSFILE
    server, url = embedded.start_server(base, cleanup_mode="delete")
    os.environ["PGPASSFILE"] = str(embedded.passfile(base))
    # PgBouncer (tests/pooling/pgbouncer.py) runs as the server's user, which must reach the
    # socket in base/pgdata: traverse, no listing (the password file stays 0600, root's)
    os.chmod(base, 0o711)
    with db.connect(url) as conn:
        for name, value in NOT_DURABLE.items():
            conn.execute(f"ALTER SYSTEM SET {name} = {value}")
        conn.execute("SELECT pg_reload_conf()")
    wait_for_settings(url, NOT_DURABLE)
    yield url
    server.cleanup()
    shutil.rmtree(base, ignore_errors=True)


def wait_for_settings(url: str, settings: dict[str, str], timeout_s: float = 10.0) -> None:
    """Wait until a new session sees ``settings`` (a reload reaches the server's processes
    asynchronously); fail after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        with db.connect(url) as conn:
            seen = {name: conn.execute("SELECT current_setting(%s) AS v", (name,)).fetchone()["v"]
                    for name in settings}
        if seen == settings:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the test server did not take {settings}: {seen}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def template_url(server_url):
    """The migrated template database (built once per session)."""
    with db.connect(server_url) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    url = with_database(server_url, TEMPLATE)
    migrate.upgrade(url)
    yield url


# The console's login in the tests: a member of pgdispatch_web only, as in production
# (sql/grants.sql), so that every console and API test also proves the web role suffices.
CONSOLE_LOGIN = "pgd_test_console"
CONSOLE_PASSWORD = secrets.token_urlsafe(16)


def as_login(url: str, user: str, password: str) -> str:
    """``url`` logging in as ``user`` with ``password`` instead."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, f"{quote(user)}:{quote(password)}@{host}", parts.path,
                       parts.query, parts.fragment))


@pytest.fixture(scope="session")
def console_login(server_url, template_url) -> str:
    """The console's own login (group pgdispatch_web), made once per session: roles are
    cluster-wide; ``db login`` is idempotent."""
    roles.set_login(server_url, name=CONSOLE_LOGIN, kind="web", password=CONSOLE_PASSWORD)
    return CONSOLE_LOGIN


@pytest.fixture
def console_url(db_url, console_login) -> str:
    """This test's database, logged in as the console's login."""
    return as_login(db_url, console_login, CONSOLE_PASSWORD)


def _copy_of_template(server_url: str, kind: str) -> str:
    name = f"pgd_test_{os.getpid()}_{kind}{next(_counter)}_{uuid.uuid4().hex[:6]}"
    with db.connect(server_url) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE} STRATEGY FILE_COPY")
    return name


def _drop(server_url: str, name: str) -> None:
    with db.connect(server_url) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def shared_url(server_url, template_url):
    """The migrated database of the rolled-back tests; nothing is ever committed in it."""
    name = _copy_of_template(server_url, "shared")
    yield with_database(server_url, name)
    _drop(server_url, name)


@pytest.fixture
def db_url(server_url, template_url):
    """A fresh migrated database for this test; dropped afterwards."""
    name = _copy_of_template(server_url, "")
    yield with_database(server_url, name)
    _drop(server_url, name)


def has_own_database(request) -> bool:
    """Whether this test's ``conn`` commits into its own database (see the module's rule)."""
    return ("db_url" in request.fixturenames
            or request.node.get_closest_marker("own_database") is not None)


@pytest.fixture
def conn(request):
    """A connection (dict rows) for this test: inside a transaction rolled back at the end,
    or autocommit to this test's own database (the rule at the top of this module)."""
    if has_own_database(request):
        with db.connect(request.getfixturevalue("db_url"), application_name="pgd-test") as c:
            yield c
        return
    with db.connect(request.getfixturevalue("shared_url"), application_name="pgd-test") as c:
        with c.transaction(force_rollback=True):
            yield c
            if c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                pytest.fail("the test ended the rolled-back transaction (a COMMIT?) and may have "
                            "written into the shared database: mark it own_database")


@pytest.fixture
def world(conn):
    """Factories for organizations, pools, projects, targets, runners and jobs."""
    return World(conn)


@pytest.fixture
def new_database(server_url):
    """A factory of new, empty databases (from template1), dropped after the test."""
    names: list[str] = []

    def make() -> str:
        name = f"pgd_test_new_{uuid.uuid4().hex[:8]}"
        with db.connect(server_url) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        names.append(name)
        return with_database(server_url, name)

    yield make
    with db.connect(server_url) as conn:
        for name in names:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
