"""The database's health read (sql/health.py, sql/functions/health.sql): a foreign snapshot
is found as the oldest holder of the xmin horizon, through the console's own non-superuser
login, without any session's query text; dead tuples of the hot tables; the claim's time from
the function statistics; and a page that says what is missing when the owner lacks
pg_read_all_stats."""

from __future__ import annotations

import time

import pytest

from pgdispatch.sql import db, health

from ..conftest import CONSOLE_LOGIN
from ..factories import World, snapshot_holder

MARKER = "horizon-secret-marker-7f3a"


@pytest.fixture
def foreign(db_url):
    """A foreign session of this database holding a snapshot, its last query MARKER."""
    with snapshot_holder(db_url, application_name="foreign-holder", marker=MARKER) as c:
        yield c


def _flush(conn) -> None:
    """Make this session's statistics visible to others now (PostgreSQL 15 and later flush
    them at most once a second otherwise)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT 1")


def test_a_foreign_snapshot_is_the_oldest_holder_seen_by_the_console_login(foreign, console_url):
    time.sleep(0.05)  # a measurable age
    with db.connect(console_url, application_name="health-reader") as web:
        me = web.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"]
        data = health.read_database_health(web)
    assert data["reads_all_stats"] is True
    assert me not in [h["pid"] for h in data["holders"]]
    holder = next(h for h in data["holders"] if h["pid"] == foreign.pid)
    assert holder["kind"] == "session"
    assert holder["application_name"] == "foreign-holder"
    assert holder["state"] == "idle in transaction"
    assert holder["usename"] and holder["xmin_age"] is not None
    assert holder["xact_age_seconds"] >= 0.05
    assert data["oldest"]["pid"] == foreign.pid


def test_the_console_login_never_sees_a_query_text(foreign, console_url):
    with db.connect(console_url) as web:
        data = health.read_database_health(web)
        assert foreign.pid in [h["pid"] for h in data["holders"]]
        assert MARKER not in repr(data)
        # the login itself has no pg_read_all_stats: only the definer function sees another
        # role's transaction start and state
        row = web.execute("SELECT query, state, xact_start FROM pg_stat_activity WHERE pid = %s",
                          (foreign.pid,)).fetchone()
        assert row["query"] == "<insufficient privilege>"
        assert row["state"] is None and row["xact_start"] is None


def test_without_pg_read_all_stats_the_read_says_so_and_does_not_fail(foreign, db_url):
    """Roles are cluster-wide: the owner's grant is revoked in a transaction rolled back at
    the end, read as the console's login inside it."""
    with db.connect(db_url) as su, su.transaction(force_rollback=True):
        su.execute("REVOKE pg_read_all_stats FROM pgdispatch_owner")
        su.execute(f"SET LOCAL ROLE {CONSOLE_LOGIN}")
        data = health.read_database_health(su)
        assert data["reads_all_stats"] is False
        # PostgreSQL 18 shows every session's backend_xmin, not its transaction's start
        seen = [h for h in data["holders"] if h["pid"] == foreign.pid]
        assert all(h["xact_age_seconds"] is None and h["state"] is None for h in seen)
        assert data["oldest"] is None


def test_dead_tuples_appear_after_deleting_rows(db_url, console_url):
    with db.connect(db_url) as c:
        world = World(c)
        world.setup()
        for _ in range(5):
            world.job()
        c.execute("DELETE FROM job_dependencies")
        deleted = c.execute("UPDATE jobs SET priority = priority + 1").rowcount
        c.execute("ANALYZE jobs")  # the sizes are the catalog's, as of the last ANALYZE
        _flush(c)
    with db.connect(console_url) as web:
        tables = {t["table_name"]: t for t in health.read_database_health(web)["tables"]}
    assert {"jobs", "attempts", "delivery_receipts", "capacity_stripes", "job_dependencies",
            "audit_events"} <= tables.keys()
    assert tables["jobs"]["dead_tuples"] >= deleted == 5
    assert tables["jobs"]["total_bytes"] >= tables["jobs"]["table_bytes"] > 0
    assert tables["jobs"]["index_bytes"] > 0


def test_the_health_read_waits_for_no_table_lock(db_url, console_url):
    """A VACUUM FULL or an ALTER TABLE of a hot table (ACCESS EXCLUSIVE) must not hold the
    Database page or a scrape: the read takes no lock on the tables (their sizes are the
    catalog's page counts). pg_total_relation_size would wait for the lock here."""
    with db.connect(db_url) as locker, locker.transaction():
        locker.execute("LOCK TABLE duty_leases, audit_events IN ACCESS EXCLUSIVE MODE")
        with db.connect(console_url) as web:
            web.execute("SET lock_timeout = '2s'")
            tables = {t["table_name"] for t in health.read_database_health(web)["tables"]}
    assert {"duty_leases", "audit_events", "jobs"} <= tables


def test_the_claims_time_comes_from_the_function_statistics(db_url, console_url):
    with db.connect(console_url) as web:
        claim = health.read_database_health(web)["claim"]
    assert claim["is_available"] is False and "track_functions" in claim["why_not"]
    with db.connect(db_url) as c:
        c.execute("SET track_functions = 'pl'")
        world = World(c)
        world.setup()
        runner = world.runner()
        world.job()
        assert world.claim(runner) is not None
        assert world.claim(runner) is None
        _flush(c)
    with db.connect(console_url) as web:
        claim = health.read_database_health(web)["claim"]
    # the console's own sessions run with the default ('none'): the server's counts are read
    assert claim["calls"] == 2
    assert claim["mean_ms"] > 0


def test_keeping_the_claim_statistics_turns_them_on_for_new_sessions(db_url):
    """What `pgdispatch demo` does to its database, so that its Database page has the claim's
    time: new sessions count the claim functions (track_functions 'pl')."""
    with db.connect(db_url) as c:
        assert c.execute("SHOW track_functions").fetchone()["track_functions"] == "none"
        health.keep_claim_statistics(c)
    with db.connect(db_url) as c:
        assert c.execute("SHOW track_functions").fetchone()["track_functions"] == "pl"
