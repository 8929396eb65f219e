"""Connection lost right after COMMIT (issue 3, scenario 6), at the sql layer.

The proxy forwards the client's COMMIT to PostgreSQL and drops the client before the reply:
the transaction committed but the client cannot know. The claim token and the receipt key
are what let the client find out without doing the work twice.
"""

from __future__ import annotations

import time

import pytest

from pgdispatch.sql import DatabaseUnavailable, db, transitions


def test_claim_commit_lost_is_recovered_by_token(world, proxy):
    world.setup()
    runner = world.runner()
    job = world.job()
    token = transitions.new_claim_token()
    flaky = db.connect(proxy.db_url)
    proxy.drop_after_commit.set()
    with pytest.raises(DatabaseUnavailable):
        transitions.claim(flaky, runner_id=runner, pools=world.pool_ids(("linux",)),
                          claim_token=token, lease_seconds=30)
    assert proxy.commits_dropped == 1
    flaky.close()
    # the claim did commit: its recovery finds it, and nobody else can claim the job
    [(claim, state)] = transitions.recover_claims(world.conn, claim_tokens=[token], runner_id=runner)
    assert claim.job_id == job["id"] and state == "running" and claim.generation == 1
    assert world.claim(runner) is None
    # asked again, the same answer
    assert transitions.recover_claims(world.conn, claim_tokens=[token], runner_id=runner) == [
        (claim, "running")]
    # a token that never reached the server finds nothing, and is void from now on
    assert transitions.recover_claims(world.conn, claim_tokens=[transitions.new_claim_token()],
                                      runner_id=runner) == []
    # the recovered claim completes normally
    assert world.complete(claim)["job_state"] == "succeeded"


def wait_session_gone(conn, pid: int, timeout_s: float = 10.0) -> None:
    """Until server session ``pid`` has ended (a direct connection's pid is its session's)."""
    deadline = time.monotonic() + timeout_s
    while conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
        assert time.monotonic() < deadline, f"session {pid} is still there"
        time.sleep(0.02)


def test_completion_commit_lost_retry_with_same_receipt_is_a_noop(world, proxy):
    world.setup()
    runner = world.runner()
    world.job(max_attempts=3)
    c = world.claim(runner)
    flaky = db.connect(proxy.db_url)
    pid = flaky.info.backend_pid
    proxy.drop_after_commit.set()
    with pytest.raises(DatabaseUnavailable):
        transitions.complete(flaky, attempt_id=c.attempt_id, generation=c.generation, outcome="failed",
                             exit_code=2, receipt_key=c.receipt_key)
    flaky.close()
    wait_session_gone(world.conn, pid)  # its transaction has committed, not in flight
    before = world.counters()
    assert before == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    retry = db.connect(proxy.db_url)
    again = transitions.complete(retry, attempt_id=c.attempt_id, generation=c.generation,
                                 outcome="failed", exit_code=2, receipt_key=c.receipt_key)
    retry.close()
    assert again["repeated"] is True and again["job_state"] == "queued"
    # counted once: one failure, counters untouched by the repeat
    assert world.row("jobs", c.job_id)["failures"] == 1
    assert world.counters() == before
