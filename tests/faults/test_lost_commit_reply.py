"""Connection lost right after COMMIT (issue 3, scenario 6), at the sql layer.

The proxy forwards the client's COMMIT to PostgreSQL and drops the client before the reply:
the transaction committed but the client cannot know. The claim token and the receipt key
are what let the client find out without doing the work twice.
"""

from __future__ import annotations

import pytest

from pgdispatch.sql import DatabaseUnavailable, db, transitions


def test_claim_commit_lost_is_recovered_by_token(world, proxy):
    world.setup()
    runner = world.runner()
    job = world.job()
    token = transitions.new_claim_token()
    flaky = db.connect(proxy.db_url)
    pid = flaky.info.backend_pid
    proxy.drop_after_commit.set()
    with pytest.raises(DatabaseUnavailable):
        transitions.claim(flaky, runner_id=runner, pools=world.pool_ids(("linux",)),
                          claim_token=token, lease_seconds=30)
    assert proxy.commits_dropped == 1
    flaky.close()
    # the claim did commit: once its session is settled the token finds it, and nobody else
    # can claim the job
    found = transitions.recover_claim(world.conn, claim_token=token, backend_pid=pid)
    assert found is not None
    claim, state = found
    assert claim.job_id == job["id"] and state == "running" and claim.generation == 1
    assert world.claim(runner) is None
    # a token that never reached the server finds nothing
    assert transitions.find_claim(world.conn, claim_token=transitions.new_claim_token()) is None
    # the recovered claim completes normally
    assert world.complete(claim)["job_state"] == "succeeded"


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
    assert transitions.settle_backend(world.conn, backend_pid=pid)
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
