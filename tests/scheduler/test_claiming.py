"""The claim job: slots, wake-up on a freed slot, draining, and claims whose answer was lost."""

from __future__ import annotations

import dataclasses
import time

from pgdispatch.scheduler.claiming import Claimer
from pgdispatch.sql import db, transitions
from pgdispatch.sql.scheduling import make_scheduler_pool

from .conftest import FAST


def test_a_finished_job_frees_its_slot_at_once(world, start_scheduler):
    world.setup()
    jobs = [world.job(command=["true"]) for _ in range(4)]
    # One slot and a claim interval far longer than the test: only the wake-up on a freed
    # slot can run the jobs one after another this fast.
    slow = dataclasses.replace(FAST, claim_interval_seconds=60.0)
    started = time.monotonic()
    _, signals = start_scheduler(slots=1, settings=slow)
    done = [signals.next_completed(timeout=10) for _ in jobs]
    assert time.monotonic() - started < 8.0
    assert sorted(r.claim.job_id for r in done) == sorted(j["id"] for j in jobs)
    assert all(r.outcome == "succeeded" for r in done)


def test_slots_bound_the_jobs_running_at_once(world, start_scheduler):
    world.setup()
    for _ in range(5):
        world.job(command=["sleep", "0.5"])
    _, signals = start_scheduler(slots=2)
    results = [signals.next_completed(timeout=15) for _ in range(5)]
    assert all(r.outcome == "succeeded" for r in results)
    # By the database's clock, at no moment were more than two attempts running.
    rows = world.conn.execute("SELECT claimed_at, finished_at FROM attempts").fetchall()
    assert len(rows) == 5
    events = sorted([(r["claimed_at"], 1) for r in rows] + [(r["finished_at"], -1) for r in rows])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak == 2


def test_a_claim_whose_answer_was_lost_is_recovered(world, db_url):
    world.setup()
    world.job(command=["true"])
    runner = world.runner()
    pool_ids = world.pool_ids(("linux",))
    committed = transitions.new_claim_token()
    # The claim commits on a connection whose answer (as after a dropped connection) never
    # arrived.
    lost = db.connect(db_url)
    claim = transitions.claim(lost, runner_id=runner, pools=pool_ids, claim_token=committed,
                              lease_seconds=1)
    lost.close()
    never_committed = transitions.new_claim_token()
    pool = make_scheduler_pool(db_url, slots=1)
    launched = []
    try:
        claimer = Claimer(pool, FAST, runner_id=runner, pool_ids=pool_ids,
                          free_slots=lambda: 2 - len(launched),
                          launch=lambda c, sent_at: launched.append((c, sent_at)),
                          is_draining=lambda: False)
        # What a claim that raised DatabaseUnavailable leaves behind: its tokens, unanswered,
        # one group per claim.
        claimer._pending.extend([[committed], [never_committed]])
        before = time.monotonic()
        assert claimer.fill() == 1
    finally:
        pool.close()
    [(recovered, sent_at)] = launched
    assert recovered.attempt_id == claim.attempt_id and recovered.generation == claim.generation
    assert sent_at >= before  # the self-fencing clock restarts from the renewing heartbeat
    attempt = world.row("attempts", claim.attempt_id)
    assert attempt["lease_expires_at"] > claim.lease_expires_at
    assert claimer._pending == []
    # both tokens are settled for good: the one that never committed is void
    tombstones = {r["claim_token"] for r in world.conn.execute(
        "SELECT claim_token::text FROM claim_tombstones WHERE runner_id = %s", (runner,))}
    assert tombstones == {committed, never_committed}


def test_a_draining_scheduler_claims_nothing(world, start_scheduler):
    world.setup()
    s, signals = start_scheduler()
    s.drain(grace_seconds=0)
    job = world.job(command=["true"])
    s.wake_claimer()
    time.sleep(3 * FAST.claim_interval_seconds)  # proving an absence: nothing to wait on
    assert signals.claimed.empty()
    assert world.row("jobs", job["id"])["state"] == "queued"
    runner = world.conn.execute("SELECT draining FROM runners WHERE id = %s",
                                (s.runner_id,)).fetchone()
    assert runner["draining"] is True


def test_a_claim_answered_late_is_renewed_before_it_runs(world, start_scheduler, db_url):
    """A claim that waited most of a lease for its answer (here: behind another session
    holding its project's claim lock) is renewed before its command starts; run from the
    claim's send time it would be self-fenced moments after starting — a deployment then
    left uncertain although nothing failed (found by an adversarial run)."""
    world.setup(pools=("linux", "deploy"), targets=("production",))
    project = world.conn.execute("SELECT id FROM projects WHERE name = 'web'").fetchone()["id"]
    holder = db.connect(db_url, application_name="pgd-test-holder")
    try:
        holder.execute("BEGIN")
        holder.execute("SELECT pg_advisory_xact_lock(pgd_claim_lock_class(), pgd_claim_lock_key(%s))",
                       (project,))
        job = world.job(pool="deploy", target="production", command=["sleep", "1.5"],
                        max_attempts=1)
        _, signals = start_scheduler(pools=("deploy",), slots=1)
        time.sleep(0.85 * FAST.lease_seconds)  # the claim waits on the lock meanwhile
        holder.execute("ROLLBACK")
    finally:
        holder.close()
    result = signals.next_completed(timeout=15)
    assert result.claim.job_id == job["id"]
    assert (result.stop_reason, result.outcome, result.is_reported) == (None, "succeeded", True)
    assert world.conn.execute("SELECT state FROM targets WHERE name = 'production'"
                              ).fetchone()["state"] == "free"
