"""An answer that never comes on an open connection (issue 16): the client gives up on it at
the statement deadline (sql/db.py, Connection), instead of waiting for good.

The proxy (tests/faults/proxy.py, ``stall``) forwards the request and swallows everything the
server answers while keeping the client's socket open, as a stalled pooler or middlebox does;
TCP keepalives cannot see it. The client cancels, closes the connection and raises
DatabaseUnavailable; a pool replaces the connection, and the next transition works.
"""

from __future__ import annotations

import threading
import time

import pytest

from pgdispatch.sql import DatabaseUnavailable, db, transitions

DEADLINE = 1.0


def claim_through(conn, world, runner):
    return transitions.claim(conn, runner_id=runner, pools=world.pool_ids(("linux",)),
                             claim_token=transitions.new_claim_token(), lease_seconds=30)


def test_a_claim_whose_answer_never_comes_fails_at_the_deadline(world, proxy):
    world.setup()
    runner = world.runner()
    job = world.job()
    conn = db.connect(proxy.db_url, statement_deadline_seconds=DEADLINE)
    proxy.arm("pgd_claim", stall=True)
    began = time.monotonic()
    with pytest.raises(DatabaseUnavailable, match="no answer from the database within 1 s"):
        claim_through(conn, world, runner)
    waited = time.monotonic() - began
    assert proxy.commits_dropped == 1
    # given up at the deadline, plus at most the cancel's grace (not a speed claim: the bound
    # only tells "gave up" from "still waiting")
    assert DEADLINE <= waited < DEADLINE + db.CANCEL_GRACE_SECONDS + 5
    assert conn.closed
    # the claim committed (its answer was only swallowed): what the claim token is for
    attempts = world.conn.execute("SELECT count(*) AS n FROM attempts WHERE job_id = %s",
                                  (job["id"],)).fetchone()["n"]
    assert attempts == 1


def test_the_check_fails_without_a_deadline(world, proxy):
    """Without the deadline the same claim is still waiting long after it (the issue's stalled
    scheduler); the test closes the proxy to let it go."""
    world.setup()
    runner = world.runner()
    world.job()
    conn = db.connect(proxy.db_url, statement_deadline_seconds=None)
    proxy.arm("pgd_claim", stall=True)
    outcome: list[BaseException | object] = []

    def call():
        try:
            outcome.append(claim_through(conn, world, runner))
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(DEADLINE + db.CANCEL_GRACE_SECONDS + 3)
    assert t.is_alive() and outcome == []
    proxy.close_clients()
    t.join(10)
    assert not t.is_alive()


def test_a_pooled_connection_that_stalls_is_replaced(world, proxy):
    world.setup()
    runner = world.runner()
    world.job()
    second = world.job()
    pool = db.make_pool(proxy.db_url, min_size=1, max_size=2, timeout_seconds=5,
                        statement_deadline_seconds=DEADLINE)
    try:
        proxy.arm("pgd_claim", stall=True)
        with pytest.raises(DatabaseUnavailable, match="no answer"):
            with db.checkout(pool) as conn:
                claim_through(conn, world, runner)
        # the stalled connection was closed and is not handed out again: the retry runs on a
        # fresh one, through the same proxy, and gets its answer
        with db.checkout(pool) as conn:
            claim = claim_through(conn, world, runner)
        assert claim is not None and claim.job_id == second["id"]
    finally:
        db.close_pool(pool)


def test_the_pool_check_on_checkout_has_the_deadline_too(world, proxy, monkeypatch):
    """A link that stalls while the connection sits in the pool is found by the checkout's
    check, within the deadline, and replaced: the checkout hands out a working connection."""
    # as for a connection idle long enough to be checked (sql/db.py, CHECK_IDLE_SECONDS)
    monkeypatch.setattr(db, "CHECK_IDLE_SECONDS", -1.0)
    world.setup()
    pool = db.make_pool(proxy.db_url, min_size=1, max_size=1, timeout_seconds=10,
                        statement_deadline_seconds=DEADLINE)
    try:
        with db.checkout(pool) as conn:
            assert db.ping_database(conn)
        # the pool's check is an empty query; arm for the next request of any text
        proxy.arm(None, stall=True)
        began = time.monotonic()
        with db.checkout(pool) as conn:
            assert db.ping_database(conn)
        assert proxy.commits_dropped == 1
        assert time.monotonic() - began < 10  # the pool's own timeout did not run out
    finally:
        db.close_pool(pool)
