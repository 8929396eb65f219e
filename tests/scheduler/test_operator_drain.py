"""An operator drains a scheduler under load, with real schedulers running real commands:
the scheduler learns the drain from its next beat (no signal), claims nothing new, lets
its jobs finish and then shows drained; past the drain's deadline its builds are handed back
(re-queued, no failure counted) and run elsewhere while a deployment goes on; a resume makes
it claim again at once. A pool paused under load takes no claim until resumed."""

from __future__ import annotations

import time

from pgdispatch.sql import reads, transitions
from tests.faults.consistency import steering_violations, violations

from .conftest import wait_until


def _claimed_by(conn, runner_id: int) -> int:
    return conn.execute("SELECT count(*) AS n FROM attempts WHERE runner_id = %s",
                        (runner_id,)).fetchone()["n"]


def _state(world, job_id: int) -> str:
    return world.row("jobs", job_id)["state"]


def test_a_drained_scheduler_claims_nothing_new_finishes_its_jobs_and_shows_drained(
        world, start_scheduler):
    world.setup()
    jobs = [world.job(command=["sleep", "1"]) for _ in range(12)]
    a, a_signals = start_scheduler(slots=2, name="a")
    a_signals.next_started()
    a_signals.next_started()
    transitions.drain_runner(world.conn, runner_id=a.runner_id, reason="host maintenance",
                             actor="alice")
    at_drain = _claimed_by(world.conn, a.runner_id)
    b, _ = start_scheduler(slots=2, name="b")
    wait_until(lambda: all(_state(world, j["id"]) == "succeeded" for j in jobs), timeout=40,
               what="every job to succeed")
    # what it ran when drained finished; it took nothing after: b ran the rest
    assert _claimed_by(world.conn, a.runner_id) == at_drain
    assert _claimed_by(world.conn, b.runner_id) == len(jobs) - at_drain
    assert world.conn.execute("SELECT count(*) AS n FROM attempts WHERE state <> 'succeeded'"
                              ).fetchone()["n"] == 0
    wait_until(lambda: a.operator_drain is not None, what="the scheduler to learn the drain")
    assert a.is_claiming_stopped()
    assert reads.show_runner(world.conn, runner_id=a.runner_id)["drain_state"] == "drained"
    assert steering_violations(world.conn) == [] and violations(world.conn) == []

    # resume: it claims again at once (the resume's NOTIFY makes it beat now)
    transitions.resume_runner(world.conn, runner_id=a.runner_id, actor="bob")
    b.stop(grace_seconds=5)
    resumed_at = time.monotonic()
    late = world.job(command=["true"])
    wait_until(lambda: _state(world, late["id"]) == "succeeded", timeout=10,
               what="the resumed runner to run a new job")
    assert time.monotonic() - resumed_at < 5
    assert world.conn.execute("SELECT runner_id FROM attempts WHERE job_id = %s",
                              (late["id"],)).fetchone()["runner_id"] == a.runner_id


def test_past_the_deadline_builds_are_handed_back_and_run_elsewhere_deployments_go_on(
        world, start_scheduler, pid_files):
    world.setup(pools=("linux",), targets=("production",))
    builds = [world.job(command=["sleep", "30"], max_attempts=1) for _ in range(2)]
    a, a_signals = start_scheduler(slots=3, name="a")
    for _ in range(2):
        a_signals.next_started()
    deploy = world.job(command=["sleep", "4"], target="production", max_attempts=1)
    wait_until(lambda: _state(world, deploy["id"]) == "running", what="the deployment to start")
    transitions.drain_runner(world.conn, runner_id=a.runner_id, reason="reboot",
                             deadline_seconds=1, actor="alice")
    # each build ends handed back (no failure counted), queued again; b runs it to the end
    wait_until(lambda: all(world.row("jobs", j["id"])["attempts_made"] == 1
                           and _state(world, j["id"]) == "queued" for j in builds),
               timeout=15, what="both builds handed back")
    for j in builds:
        row = world.row("jobs", j["id"])
        assert row["failures"] == 0 and "handed back at its deadline" in row["last_error"]
        assert "drained by alice (reboot)" in row["last_error"]
    assert _state(world, deploy["id"]) == "running"  # a drain never cuts a deployment
    world.conn.execute("UPDATE jobs SET command = ARRAY['true'] WHERE id = ANY (%s)",
                       ([j["id"] for j in builds],))
    b, _ = start_scheduler(slots=2, name="b")
    wait_until(lambda: all(_state(world, j["id"]) == "succeeded" for j in builds), timeout=15,
               what="the builds to run on the other runner")
    wait_until(lambda: _state(world, deploy["id"]) == "succeeded", timeout=15,
               what="the deployment to finish on the drained runner")
    assert world.conn.execute("SELECT runner_id FROM attempts WHERE job_id = %s",
                              (deploy["id"],)).fetchone()["runner_id"] == a.runner_id
    assert {world.conn.execute("SELECT runner_id FROM attempts WHERE job_id = %s AND state = 'succeeded'",
                               (j["id"],)).fetchone()["runner_id"] for j in builds} == {b.runner_id}
    wait_until(lambda: reads.show_runner(world.conn, runner_id=a.runner_id)["drain_state"] == "drained",
               what="the drained runner to show drained")
    assert steering_violations(world.conn) == [] and violations(world.conn) == []


def test_a_pool_paused_under_load_takes_no_claim_until_resumed(world, start_scheduler):
    world.setup()
    s, signals = start_scheduler(slots=2)
    first = [world.job(command=["sleep", "0.5"]) for _ in range(2)]
    signals.next_started()
    signals.next_started()
    transitions.pause_pool(world.conn, pool="linux", reason="incident", actor="alice")
    waiting = [world.job(command=["true"]) for _ in range(4)]
    wait_until(lambda: all(_state(world, j["id"]) == "succeeded" for j in first), timeout=10,
               what="the running jobs to finish")
    time.sleep(1.5)  # several claim rounds and wake-ups
    assert all(_state(world, j["id"]) == "queued" for j in waiting)
    transitions.resume_pool(world.conn, pool="linux", actor="bob")
    wait_until(lambda: all(_state(world, j["id"]) == "succeeded" for j in waiting), timeout=10,
               what="the waiting jobs to run after the resume")
    assert steering_violations(world.conn) == [] and violations(world.conn) == []
