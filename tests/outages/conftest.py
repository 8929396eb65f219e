"""PgBouncers of this test's own, each configured to misbehave, in front of the test server
or of a port where nothing listens; and a PostgreSQL server of the test's own to stop.

The launcher is tests/pooling/pgbouncer.py's (Debian's PgBouncer 1.18, transaction pooling,
trust authentication, not run as root), one PgBouncer per call instead of one per session,
with its admin console open to the server's user (PAUSE, RESUME, SHOW)."""

from __future__ import annotations

import pytest

from ..faults.chaos_server import OwnServer
from ..pooling.pgbouncer import PgBouncer


@pytest.fixture
def make_bouncer(server_url):
    """``make_bouncer(**settings)``: a PgBouncer in front of the test server (``settings``
    are [pgbouncer] lines, seconds for the timeouts; two server connections and 50 clients
    unless they say otherwise); ``make_bouncer(upstream_url=url, ...)`` in front of another
    server; ``make_bouncer(nowhere=True, ...)`` in front of a loopback port where nothing
    listens. Its URLs give up connecting after 5 s. Every one is stopped at the end of the
    test."""
    made: list[PgBouncer] = []

    def make(*, upstream_url: str | None = None, nowhere: bool = False,
             default_pool_size: int = 2, max_client_conn: int = 50, **settings) -> PgBouncer:
        made.append(PgBouncer(upstream_url or server_url, pool_size=default_pool_size,
                              nowhere=nowhere, connect_timeout=5,
                              max_client_conn=max_client_conn, **settings))
        return made[-1]

    yield make
    for b in made:
        b.stop()


@pytest.fixture
def own_server():
    """A PostgreSQL server of this test's own, to stop and start (tests/faults/chaos_server.py)."""
    server = OwnServer()
    yield server
    server.close()
