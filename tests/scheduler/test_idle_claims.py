"""What an idle scheduler costs, and what a wake-up costs (issue 18, scheduler/claiming.py,
sql/functions/wakeups.sql): the idle poll backs off, a wake-up brings it back at once, a lone
job costs one claim transaction, and a submit wakes one chosen listener, not every one.

Counted, never timed: pgd_claim / pgd_claim_batch calls from pg_stat_user_functions
(track_functions = 'all' for the test's database, read after the schedulers stopped: a
session flushes its counts when it ends), and the claimer's own counters of what it sent,
which must agree with the database's.
"""

from __future__ import annotations

import dataclasses
import time
from urllib.parse import urlsplit

import pytest

from pgdispatch.scheduler.main import Scheduler
from pgdispatch.sql import transitions

from .conftest import FAST, wait_until


def track_functions(conn, db_url: str) -> None:
    """Count function calls in every new session of the test's database."""
    name = urlsplit(db_url).path.lstrip("/")
    conn.execute(f"ALTER DATABASE {name} SET track_functions = 'all'")


def stop_and_count(conn, schedulers: list[Scheduler]) -> dict[str, int]:
    """Stop ``schedulers``, wait for their sessions to end (which flushes their counts), and
    return the calls of pgd_claim and pgd_claim_batch in this database."""
    for s in schedulers:
        s.stop(grace_seconds=0)
    wait_until(lambda: not conn.execute(
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name IN ('pgdispatch-scheduler', 'pgdispatch-listener')").fetchone(),
        timeout=10, what="the schedulers' sessions to end")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = conn.execute("SELECT funcname, calls FROM pg_stat_user_functions "
                        "WHERE funcname IN ('pgd_claim', 'pgd_claim_batch')").fetchall()
    counts = {"pgd_claim": 0, "pgd_claim_batch": 0}
    counts.update({r["funcname"]: r["calls"] for r in rows})
    return counts


def sent(schedulers: list[Scheduler]) -> dict[str, int]:
    """What the claimers say they sent."""
    return {"pgd_claim": sum(s._claimer.claims_sent for s in schedulers),
            "pgd_claim_batch": sum(s._claimer.batches_sent for s in schedulers)}


def listeners_registered(conn, n: int) -> bool:
    return conn.execute("SELECT count(*) AS n FROM runners WHERE listen_pid IS NOT NULL "
                        "AND stopped_at IS NULL").fetchone()["n"] >= n


def test_an_idle_scheduler_polls_less_and_less(world, db_url, start_scheduler):
    world.setup()
    track_functions(world.conn, db_url)
    # without the backoff: a claim every 0.1 s, about 40 in the window
    settings = dataclasses.replace(FAST, claim_interval_seconds=0.1, claim_idle_cap_seconds=1.6)
    s, _ = start_scheduler(settings=settings, listen=False)
    time.sleep(4.0)  # the window counted, not a speed
    counts = stop_and_count(world.conn, [s])
    # 0.1-0.2, 0.2-0.4, 0.4-0.8, 0.8-1.6 s, then at most every 1.6 s: at most 9 in 4 s
    assert 2 <= counts["pgd_claim"] <= 12, counts
    assert counts["pgd_claim_batch"] == 0
    assert counts == sent([s])
    assert s._claimer.polls_skipped > 0  # the ticks skipped made no transaction


def test_a_wakeup_returns_a_backed_off_scheduler_to_claiming_at_once(world, start_scheduler):
    world.setup()
    settings = dataclasses.replace(FAST, claim_interval_seconds=0.1, claim_idle_cap_seconds=60.0)
    s, signals = start_scheduler(settings=settings, listen=True)
    wait_until(lambda: listeners_registered(world.conn, 1), what="the listener's registration")
    # backed off to the point where the next poll is at least 1.6 s away (half of 3.2 s)
    wait_until(lambda: s._claimer.idle_seconds() >= 3.2, timeout=15, what="the idle backoff")
    with s._claimer._state:
        skip = s._claimer._ticks_to_skip
    job = world.job()
    # claimed before the poll that the backoff had scheduled (skip ticks of 0.1 s) came
    claim = signals.claimed.get(timeout=skip * 0.1)
    assert claim.job_id == job["id"]
    # its answer said nothing more waits: back to the backoff it had, not a ramp from 0.1 s
    wait_until(lambda: s._claimer.polls_skipped > 0, what="the next tick skipped")
    assert s._claimer.idle_seconds() >= 3.2


def test_a_lone_job_costs_one_claim_and_no_empty_claim_after_it(world, db_url, start_scheduler):
    world.setup()
    track_functions(world.conn, db_url)
    # the poll is 30 s away: every claim here comes from the wake-up and the completion
    slow = dataclasses.replace(FAST, claim_interval_seconds=30.0, claim_idle_cap_seconds=30.0)
    s, signals = start_scheduler(settings=slow, slots=4, listen=True)
    wait_until(lambda: listeners_registered(world.conn, 1), what="the listener's registration")
    wait_until(lambda: s._claimer.claims_sent >= 1, what="the first poll")
    time.sleep(0.3)  # the listener's first wake-up (after it connected) settles
    before = sent([s])
    job = world.job()
    assert signals.claimed.get(timeout=10).job_id == job["id"]
    assert signals.next_completed().claim.job_id == job["id"]
    time.sleep(0.5)  # proving an absence: a claim after the completion would come now
    after = sent([s])
    assert after["pgd_claim"] - before["pgd_claim"] == 1
    assert after["pgd_claim_batch"] == before["pgd_claim_batch"] == 0
    assert stop_and_count(world.conn, [s]) == after


def test_spaced_submits_to_many_listeners_wake_about_one_claim_each(world, db_url,
                                                                    start_scheduler):
    world.setup()
    track_functions(world.conn, db_url)
    slow = dataclasses.replace(FAST, claim_interval_seconds=30.0, claim_idle_cap_seconds=30.0)
    schedulers = [start_scheduler(settings=slow, slots=2, listen=True)[0] for _ in range(8)]
    wait_until(lambda: listeners_registered(world.conn, 8), what="eight listeners")
    time.sleep(0.5)  # each listener's first wake-up settles
    before = sent(schedulers)
    jobs = 10
    for _ in range(jobs):
        job = world.job()
        wait_until(lambda: world.conn.execute(
            "SELECT state FROM jobs WHERE id = %s", (job["id"],)).fetchone()["state"] == "succeeded",
            what="the job to run")
    time.sleep(0.5)
    after = sent(schedulers)
    extra = (after["pgd_claim"] + after["pgd_claim_batch"]
             - before["pgd_claim"] - before["pgd_claim_batch"] - jobs)
    assert extra <= 1.5 * jobs, (before, after)
    assert stop_and_count(world.conn, schedulers) == after


@pytest.mark.parametrize("limit", ["project bound", "pool slots"])
def test_a_completion_that_frees_the_limit_a_job_waits_for_claims_it_at_once(
        world, db_url, start_scheduler, limit):
    """A job held back by a limit that this scheduler's running job fills (its project's
    bound of 1, or a pool of 1 slot) is claimed when that job completes, not at the next poll
    (30 s away): the claim that found nothing asked pgd_capacity_waiting, so the completion
    claims at once. Without the ask it waited for the poll (bench/e2e.py, "project bound
    freed": 9.9 s median at the 15 s idle cap)."""
    world.setup(**({"project_limit": 1} if limit == "project bound" else {"pool_slots": 1}))
    slow = dataclasses.replace(FAST, claim_interval_seconds=30.0, claim_idle_cap_seconds=30.0)
    s, signals = start_scheduler(settings=slow, slots=2, listen=True)
    wait_until(lambda: listeners_registered(world.conn, 1), what="the listener's registration")
    wait_until(lambda: s._claimer.claims_sent >= 1, what="the first poll")
    time.sleep(0.3)  # the listener's first wake-up settles
    first = world.job(command=["sleep", "0.5"])
    second = world.job()
    assert signals.claimed.get(timeout=10).job_id == first["id"]
    assert signals.next_completed().claim.job_id == first["id"]
    # claimed by the completion, well before the poll
    assert signals.claimed.get(timeout=10).job_id == second["id"]
    assert s._claimer.capacity_asks >= 1


def test_a_round_that_ends_on_a_lone_job_still_learns_of_a_job_held_back(
        world, start_scheduler):
    """A job held back by its project's bound, which this scheduler's running job fills,
    arrives together with a job of another project: the wake-up's round claims that one
    alone (more_waiting false, since the held-back job is no candidate) and, as jobs ran
    before it, asks pgd_capacity_waiting; so the completion that frees the bound claims the
    held-back job at once, not at the next poll (30 s away). Without the ask it waited for
    the next wake-up (bench/e2e.py, "project bound freed" under load: p95 383 ms)."""
    world.setup(project_limit=1)
    world.project("other", org="acme", pools=("linux",))
    slow = dataclasses.replace(FAST, claim_interval_seconds=30.0, claim_idle_cap_seconds=30.0)
    s, signals = start_scheduler(settings=slow, slots=3, listen=True)
    wait_until(lambda: listeners_registered(world.conn, 1), what="the listener's registration")
    wait_until(lambda: s._claimer.claims_sent >= 1, what="the first poll")
    time.sleep(0.3)  # the listener's first wake-up settles
    first = world.job(command=["sleep", "0.8"])
    assert signals.claimed.get(timeout=10).job_id == first["id"]
    with world.conn.transaction():  # one commit: one NOTIFY, one round
        held = world.job()
        lone = world.job(project="other", command=["sleep", "5"])
    assert signals.claimed.get(timeout=10).job_id == lone["id"]
    assert signals.next_completed().claim.job_id == first["id"]
    # claimed by the completion, well before the poll or the lone job's end
    assert signals.claimed.get(timeout=3).job_id == held["id"]
    assert s._claimer.capacity_asks >= 1


def test_capacity_waiting_says_whether_a_queued_job_waits_for_a_held_limit(world):
    """pgd_capacity_waiting: false with nothing queued or with room; true while a queued job's
    project is at its bound; false again when that project is paused (a pause, not capacity,
    holds it then) or the bound is freed."""
    world.setup(project_limit=1)
    runner = world.runner(slots=4)
    pools = world.pool_ids(("linux",))

    def ask() -> bool:
        return transitions.capacity_waiting(world.conn, runner_id=runner, pools=pools)

    assert ask() is False
    world.job()
    world.job()
    assert ask() is False  # room: the claim takes it
    c = world.claim(runner)
    assert ask() is True   # the second waits for the bound the first holds
    transitions.pause_project(world.conn, project="web", reason="check", actor="alice")
    assert ask() is False
    transitions.resume_project(world.conn, project="web", actor="alice")
    assert ask() is True
    world.complete(c)
    assert ask() is False
