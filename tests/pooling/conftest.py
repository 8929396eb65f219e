"""A real PgBouncer (Debian's package, 1.18) in front of the test server, started by the tests
on a loopback port from a config in a temporary folder.

* ``pgbouncer_url(db_url)``: through PgBouncer in transaction pooling with one server
  connection per database and user (``default_pool_size = 1``), so that every client's
  transactions share it: whatever one client leaves on a server session, the next one meets.
* ``pooler`` (a ``PgBouncer``): the same mode with three server connections, for what must
  also run concurrently (scheduler processes, upgrades racing); ``pooler.url(db_url)``, and
  ``pooler.session_alias(db_url)``: a second database entry for the same database with
  ``pool_mode = session``, the route a scheduler's wake-up listener takes
  (``--listen-url``), as docs/operations.md ("Deployment guide") describes it.
"""

from __future__ import annotations

import pytest

from .pgbouncer import PgBouncer


@pytest.fixture(scope="session")
def pgbouncer_url(server_url):
    """The server's URL through PgBouncer (pool_mode transaction, one server connection per
    database and user, so that every client's transactions share it); any database name."""
    bouncer = PgBouncer(server_url, pool_size=1)
    yield bouncer.url
    bouncer.stop()


@pytest.fixture(scope="session")
def pooler(server_url):
    """A PgBouncer in transaction pooling with three server connections per database and
    user, and session-mode aliases on demand (see the module docstring)."""
    bouncer = PgBouncer(server_url, pool_size=3)
    yield bouncer
    bouncer.stop()
