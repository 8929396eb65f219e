"""The scheduler's life: run() until stopped, graceful drain, hand-back and lost deployments."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from pgdispatch.scheduler.main import run
from pgdispatch.sql import NotFound

from .conftest import FAST, group_is_alive, wait_until


def runner_rows(conn) -> list[dict]:
    return conn.execute("SELECT * FROM runners ORDER BY id").fetchall()


def test_run_registers_the_runner_until_stopped_and_returns_0(world, db_url):
    world.setup()
    job = world.job(command=["sh", "-c", "echo via-run"])
    stop = threading.Event()
    exit_codes = []
    thread = threading.Thread(target=lambda: exit_codes.append(
        run(FAST, database_url=db_url, pools=["linux"], slots=1, stop_event=stop)))
    thread.start()
    try:
        wait_until(lambda: world.row("jobs", job["id"])["state"] == "succeeded",
                   what="the job to succeed")
        [runner] = runner_rows(world.conn)
        assert runner["name"] == f"{socket.gethostname()}:{os.getpid()}"
        assert runner["slots"] == 1 and runner["stopped_at"] is None
        assert runner["pool_ids"] == world.pool_ids(("linux",))
    finally:
        stop.set()
        thread.join(timeout=20)
    assert not thread.is_alive() and exit_codes == [0]
    [runner] = runner_rows(world.conn)
    assert runner["stopped_at"] is not None and runner["draining"] is True


def test_run_with_an_unknown_pool_raises_and_writes_nothing(world, db_url):
    world.setup()
    with pytest.raises(NotFound, match="unknown pool"):
        run(FAST, database_url=db_url, pools=["linux", "no-such-pool"], slots=1,
            stop_event=threading.Event())
    assert runner_rows(world.conn) == []


def test_stop_hands_a_running_build_back(world, start_scheduler):
    world.setup()
    job = world.job(command=["sleep", "30"], max_attempts=1)
    s, signals = start_scheduler()
    claim, pid = signals.next_started()
    started = time.monotonic()
    s.stop(grace_seconds=0.5)
    assert time.monotonic() - started < 4.0
    result = signals.next_completed(timeout=1)
    assert result.stop_reason == "shutdown" and result.outcome == "handed_back"
    assert not group_is_alive(pid)
    row = world.row("jobs", job["id"])
    assert row["state"] == "queued" and row["failures"] == 0  # not counted as a failure
    assert world.row("attempts", claim.attempt_id)["state"] == "cancelled"
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert runner_rows(world.conn)[0]["stopped_at"] is not None


def test_stop_reports_a_running_deployment_lost(world, start_scheduler):
    world.setup(targets=("production",))
    job = world.job(command=["sleep", "30"], target="production")
    s, signals = start_scheduler()
    claim, pid = signals.next_started()
    s.stop(grace_seconds=0.2)
    result = signals.next_completed(timeout=1)
    assert result.outcome == "lost" and not group_is_alive(pid)
    assert world.row("jobs", job["id"])["state"] == "uncertain"
    assert world.row("attempts", claim.attempt_id)["state"] == "lost"
    target = world.conn.execute("SELECT * FROM targets WHERE name = 'production'").fetchone()
    assert target["state"] == "uncertain" and target["holder_job_id"] == job["id"]


def test_stop_lets_a_job_finish_within_the_grace_period(world, start_scheduler):
    world.setup()
    job = world.job(command=["sh", "-c", "sleep 1; echo finished"])
    s, signals = start_scheduler()
    signals.next_started()
    s.stop(grace_seconds=10)
    result = signals.next_completed(timeout=1)
    assert result.outcome == "succeeded" and result.stop_reason is None
    assert world.row("jobs", job["id"])["state"] == "succeeded"


def test_a_second_stop_request_skips_the_grace_period(world, start_scheduler):
    world.setup()
    job = world.job(command=["sh", "-c", "trap '' TERM; sleep 30"])  # ignores SIGTERM
    s, signals = start_scheduler(kill_grace_seconds=30)
    signals.next_started()
    hurry = threading.Event()
    stopper = threading.Thread(target=s.stop, kwargs=dict(grace_seconds=30, hurry=hurry))
    started = time.monotonic()
    stopper.start()
    time.sleep(0.3)  # the first request is draining, waiting on the grace period
    assert stopper.is_alive()
    hurry.set()  # the second SIGINT
    stopper.join(timeout=10)
    assert not stopper.is_alive() and time.monotonic() - started < 5.0
    result = signals.next_completed(timeout=1)
    assert result.outcome == "handed_back" and result.exit_code == -9
    assert world.row("jobs", job["id"])["state"] == "queued"


def test_stop_never_waits_for_a_beat_that_reschedules_itself_during_the_shutdown(world,
                                                                                start_scheduler):
    # A beat job moves its own next run (scheduler/duties.py). APScheduler's shutdown holds
    # its job-store lock while it waits for running jobs: a beat that asks to move itself
    # after the shutdown began must give up, not wait for that lock (and shutdown for it).
    world.setup()
    s, _ = start_scheduler()
    in_beat = threading.Event()

    def late_beat():
        in_beat.set()
        time.sleep(1.0)  # stop() starts its shutdown meanwhile
        s._reschedule_beat(1.0)

    s._aps.add_job(late_beat, id="late-beat")
    assert in_beat.wait(10)
    stopper = threading.Thread(target=s.stop, kwargs={"grace_seconds": 0}, daemon=True)
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive(), "stop() is still waiting for the beat job"
