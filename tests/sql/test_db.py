"""The one pool checkout (sql.db.checkout, and acquire/release under it): whatever goes wrong
getting or using a pooled connection arrives as our exception, and the connection goes back."""

from __future__ import annotations

import psycopg
import pytest

from pgdispatch.sql import DatabaseUnavailable, InvalidInput, db


@pytest.fixture
def pool(db_url):
    pool = db.make_pool(db_url, min_size=1, max_size=1, name="pgd-test-pool", timeout_seconds=5)
    yield pool
    db.close_pool(pool)


def test_a_checkout_hands_out_a_live_connection_and_takes_it_back(pool):
    with db.checkout(pool) as conn:
        assert db.ping_database(conn) is True
    # max_size is 1: a second checkout gets it only if the first gave it back
    with db.checkout(pool, timeout_seconds=1) as again:
        assert again is conn


def test_no_connection_in_time_is_database_unavailable(pool):
    held = db.acquire(pool)
    try:
        with pytest.raises(DatabaseUnavailable, match="did not answer in time"):
            with db.checkout(pool, timeout_seconds=0.2):
                pass
        with pytest.raises(DatabaseUnavailable, match="did not answer in time"):
            db.acquire(pool, timeout_seconds=0.2)
    finally:
        db.release(pool, held)


def test_a_closed_pool_is_database_unavailable(db_url):
    pool = db.make_pool(db_url, min_size=1, max_size=1, name="pgd-test-pool")
    db.close_pool(pool)
    with pytest.raises(DatabaseUnavailable, match="pool is closed"):
        with db.checkout(pool):
            pass


def test_a_connection_the_server_ended_is_database_unavailable(pool, conn):
    with pytest.raises(DatabaseUnavailable):
        with db.checkout(pool) as pooled:
            conn.execute("SELECT pg_terminate_backend(%s)", (pooled.info.backend_pid,))
            pooled.execute("SELECT 1")
    # the broken connection was discarded: the next checkout is a working one
    with db.checkout(pool) as fresh:
        assert db.ping_database(fresh) is True


def test_errors_in_use_are_translated_and_others_pass_unchanged(pool):
    with pytest.raises(InvalidInput):
        with db.checkout(pool) as conn:
            conn.execute("SELECT CAST('x' AS integer)")  # 22P02, bad input
    with pytest.raises(psycopg.errors.UndefinedFunction):
        with db.checkout(pool) as conn:
            conn.execute("SELECT no_such_function()")
    with pytest.raises(ZeroDivisionError):
        with db.checkout(pool):
            raise ZeroDivisionError
    with db.checkout(pool, timeout_seconds=1) as conn:
        assert db.ping_database(conn) is True
