"""Through PgBouncer in transaction pooling the connection pool makes no checkout check
transactions (sql/db.py make_pool): the empty query psycopg_pool sends before each checkout
would test only the link to PgBouncer, and cost the server a transaction each time.
Counted in pg_stat_database (xact_commit + xact_rollback of the test's database), after the
server sessions that ran anything ended (a session flushes its counts when it ends)."""

from __future__ import annotations

import time

from pgdispatch.sql import db

CHECKOUTS = 30


def server_transactions(db_url: str) -> int:
    """End every other session of the database (PgBouncer's server connections), wait until
    they are gone, and return the database's committed + rolled back transactions."""
    with db.connect(db_url, application_name="pgd-test-counter") as c:
        c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                  "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        deadline = time.monotonic() + 10
        while c.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = "
                        "current_database() AND pid <> pg_backend_pid()").fetchone()["n"]:
            assert time.monotonic() < deadline, "the server sessions did not end"
            time.sleep(0.05)
        c.execute("SELECT pg_stat_clear_snapshot()")
        return c.execute("SELECT xact_commit + xact_rollback AS n FROM pg_stat_database "
                         "WHERE datname = current_database()").fetchone()["n"]


def test_checkouts_through_pgbouncer_cost_the_server_no_transaction(db_url, pgbouncer_url,
                                                                   monkeypatch):
    # every connection counts as idle long enough: only the pooler rule spares the check
    monkeypatch.setattr(db, "CHECK_IDLE_SECONDS", -1.0)
    pool = db.make_pool(pgbouncer_url(db_url), min_size=1, max_size=2)
    try:
        with db.checkout(pool) as conn:  # connected and configured (those statements count)
            conn.execute("SELECT 1")
        counting = -server_transactions(db_url)
        before = server_transactions(db_url)
        counting += before  # what one count costs itself
        for _ in range(CHECKOUTS):
            with db.checkout(pool):
                pass
        after = server_transactions(db_url)
        # only the count's own transactions (give or take a few of the server's own, such as
        # an autovacuum worker's); a check per checkout would be CHECKOUTS more
        assert after - before - counting < CHECKOUTS // 3, (counting, before, after)
        with db.checkout(pool) as conn:  # and a connection checked out still works
            assert conn.execute("SELECT 1 AS one").fetchone()["one"] == 1
    finally:
        db.close_pool(pool)
