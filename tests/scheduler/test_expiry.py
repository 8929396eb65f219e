"""The expiry job: lapsed leases of a dead runner are ended by a live scheduler."""

from __future__ import annotations

from pgdispatch.scheduler.expiry import expire_lapsed_leases
from pgdispatch.sql.scheduling import make_scheduler_pool

from .conftest import FAST, wait_until


def test_a_dead_runners_build_is_expired_and_run_again(world, start_scheduler):
    world.setup()
    job = world.job(command=["sh", "-c", "echo second try"], max_attempts=2)
    dead = world.runner()
    lost = world.claim(dead, lease_seconds=0.5)  # its scheduler "dies": no heartbeat ever
    s, signals = start_scheduler()
    result = signals.next_completed(timeout=10)
    assert result.claim.job_id == job["id"] and result.claim.attempt_no == 2
    assert result.outcome == "succeeded"
    assert world.row("attempts", lost.attempt_id)["state"] == "expired"
    assert world.row("attempts", result.claim.attempt_id)["runner_id"] == s.runner_id
    assert world.row("jobs", job["id"])["state"] == "succeeded"


def test_a_dead_runners_deployment_becomes_uncertain(world, start_scheduler):
    world.setup(targets=("production",))
    job = world.job(command=["true"], target="production", max_attempts=3)
    dead = world.runner()
    lost = world.claim(dead, lease_seconds=0.5)
    start_scheduler()
    wait_until(lambda: world.row("jobs", job["id"])["state"] == "uncertain", timeout=10,
               what="the deployment to become uncertain")
    assert world.row("attempts", lost.attempt_id)["state"] == "lost"
    target = world.conn.execute("SELECT state FROM targets WHERE name = 'production'").fetchone()
    assert target["state"] == "uncertain"


def test_one_expiry_pass(world, db_url):
    world.setup()
    world.job()
    runner = world.runner()
    c = world.claim(runner)
    pool = make_scheduler_pool(db_url, slots=1)
    try:
        assert expire_lapsed_leases(pool, FAST) == []
        world.expire_now(c.attempt_id)
        [done] = expire_lapsed_leases(pool, FAST)
    finally:
        pool.close()
    assert done["attempt_id"] == c.attempt_id and done["job_state"] == "failed"
