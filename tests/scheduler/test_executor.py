"""The executor, through a real in-process scheduler: real commands in real subprocesses,
real heartbeats and completions against PostgreSQL."""

from __future__ import annotations

import dataclasses
import time

from pgdispatch.sql import transitions

from .conftest import FAST, group_is_alive, is_alive, wait_for_file, wait_until


def attempts_of(conn, job_id: int) -> list[dict]:
    return conn.execute("SELECT * FROM attempts WHERE job_id = %s ORDER BY attempt_no",
                        (job_id,)).fetchall()


def receipts_of(conn, attempt_id: int) -> list[dict]:
    return conn.execute("SELECT * FROM delivery_receipts WHERE attempt_id = %s",
                        (attempt_id,)).fetchall()


def test_success_records_exit_code_and_output_tail(world, start_scheduler):
    world.setup()
    job = world.job(command=["sh", "-c", "echo hi; echo to-stderr >&2; exit 0"])
    _, signals = start_scheduler()
    result = signals.next_completed()
    assert result.claim.job_id == job["id"]
    assert (result.outcome, result.is_reported, result.exit_code) == ("succeeded", True, 0)
    assert world.row("jobs", job["id"])["state"] == "succeeded"
    [attempt] = attempts_of(world.conn, job["id"])
    assert attempt["state"] == "succeeded" and attempt["exit_code"] == 0
    assert "hi\n" in attempt["output_tail"] and "to-stderr" in attempt["output_tail"]
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}


def test_failing_command_is_retried_then_fails(world, start_scheduler):
    world.setup()
    job = world.job(command=["sh", "-c", "echo boom; exit 3"], max_attempts=2)
    _, signals = start_scheduler()
    first = signals.next_completed()
    second = signals.next_completed()
    assert [first.outcome, second.outcome] == ["failed", "failed"]
    assert [first.job_state, second.job_state] == ["queued", "failed"]
    row = world.row("jobs", job["id"])
    assert row["state"] == "failed" and row["failures"] == 2
    attempts = attempts_of(world.conn, job["id"])
    assert [(a["attempt_no"], a["state"], a["exit_code"]) for a in attempts] == [
        (1, "failed", 3), (2, "failed", 3)]
    assert "boom" in attempts[1]["output_tail"]


def test_timeout_kills_the_process_group(world, start_scheduler, pid_files):
    world.setup()
    pidfile = pid_files / "child.pid"
    # The shell starts a grandchild, so the whole group must go, not just the leader.
    job = world.job(command=["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"],
                    timeout_seconds=1)
    _, signals = start_scheduler()
    _, pid = signals.next_started()
    grandchild = int(wait_for_file(pidfile))
    result = signals.next_completed(timeout=10)
    assert result.stop_reason == "timeout" and result.outcome == "failed"
    assert 1.0 <= result.run_seconds < 4.0
    assert not group_is_alive(pid) and not is_alive(grandchild)
    [attempt] = attempts_of(world.conn, job["id"])
    assert attempt["state"] == "failed" and attempt["error"] == "timed out after 1 s"
    assert world.row("jobs", job["id"])["state"] == "failed"


def test_cancel_stops_the_running_job_within_a_heartbeat(world, start_scheduler):
    world.setup()
    job = world.job(command=["sleep", "60"])
    _, signals = start_scheduler()
    _, pid = signals.next_started()
    asked = time.monotonic()
    transitions.cancel_job(world.conn, job_id=job["id"], actor="alice", reason="wrong branch")
    result = signals.next_completed(timeout=10)
    assert time.monotonic() - asked < FAST.heartbeat_seconds + 1.5
    assert result.stop_reason == "cancel" and result.outcome == "cancelled"
    assert not group_is_alive(pid)
    assert world.row("jobs", job["id"])["state"] == "cancelled"
    assert attempts_of(world.conn, job["id"])[0]["state"] == "cancelled"
    assert world.counters()["pool"] == 0


def test_fenced_out_kills_the_group_and_reports_nothing(world, start_scheduler, pid_files):
    world.setup()
    pidfile = pid_files / "child.pid"
    job = world.job(command=["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"])
    _, signals = start_scheduler()
    claim, pid = signals.next_started()
    grandchild = int(wait_for_file(pidfile))
    # Test-only: lapse the lease and expire it in one transaction, so no heartbeat can slip
    # in between; the attempt is then no longer running and the next heartbeat is fenced.
    with world.conn.transaction():
        world.expire_now(claim.attempt_id)
        expired = transitions.expire_one(world.conn, backoff_base_seconds=0.05,
                                         backoff_cap_seconds=0.1)
    assert expired["attempt_id"] == claim.attempt_id
    result = signals.next_completed(timeout=FAST.heartbeat_seconds + 5)
    assert result.stop_reason == "fenced"
    assert result.outcome is None and not result.is_reported
    # SIGKILLed before the pipe closed; a killed member closes its files before it is a
    # zombie, so with nothing to report the result can come a moment before the last one is
    # gone (a loaded CI run saw it): the whole group is gone within a second, not 60 s
    wait_until(lambda: not group_is_alive(pid) and not is_alive(grandchild), timeout=1.0,
               what="the fenced group gone")
    [attempt] = attempts_of(world.conn, job["id"])
    assert attempt["state"] == "expired" and attempt["exit_code"] is None
    assert receipts_of(world.conn, claim.attempt_id) == []
    assert world.row("jobs", job["id"])["state"] == "failed"  # max_attempts=1, lease expired


def test_heartbeats_keep_a_job_longer_than_its_lease(world, start_scheduler):
    world.setup()
    job = world.job(command=["sh", "-c", "sleep 4; echo done"])
    settings = dataclasses.replace(FAST, lease_seconds=2.0, heartbeat_seconds=0.5)
    _, signals = start_scheduler(settings=settings)
    claim = signals.claimed.get(timeout=10)
    result = signals.next_completed(timeout=15)
    assert result.outcome == "succeeded" and result.run_seconds >= 4.0
    [attempt] = attempts_of(world.conn, job["id"])  # never expired, never re-claimed
    assert attempt["state"] == "succeeded" and "done" in attempt["output_tail"]
    assert (attempt["last_heartbeat_at"] - attempt["claimed_at"]).total_seconds() >= 3.0
    assert len(receipts_of(world.conn, claim.attempt_id)) == 1
    assert world.row("jobs", job["id"])["state"] == "succeeded"


def test_command_that_cannot_start_fails_with_127_or_126(world, start_scheduler, tmp_path):
    world.setup()
    not_executable = tmp_path / "script.sh"
    not_executable.write_text("#!/bin/sh\necho never\n")
    missing = world.job(command=["/nonexistent/pgdispatch-command", "x"])
    denied = world.job(command=[str(not_executable)])
    _, signals = start_scheduler()
    results = {r.claim.job_id: r for r in (signals.next_completed(), signals.next_completed())}
    assert results[missing["id"]].exit_code == 127
    assert results[denied["id"]].exit_code == 126
    for job, text in ((missing, "No such file"), (denied, "Permission denied")):
        [attempt] = attempts_of(world.conn, job["id"])
        assert attempt["state"] == "failed" and text in attempt["error"]
        assert world.row("jobs", job["id"])["state"] == "failed"


def test_output_tail_keeps_the_last_64_kib(world, start_scheduler):
    world.setup()
    script = ("import sys; sys.stdout.write('FIRST' + 'x' * 200000 + 'LAST\\n'); "
              "sys.stdout.flush()")
    job = world.job(command=["python3", "-c", script])
    _, signals = start_scheduler()
    assert signals.next_completed().outcome == "succeeded"
    tail = attempts_of(world.conn, job["id"])[0]["output_tail"]
    assert len(tail.encode()) == 64 * 1024
    assert tail.endswith("LAST\n") and "FIRST" not in tail


def test_job_environment_names_the_attempt_and_hides_the_database(world, start_scheduler,
                                                                  monkeypatch):
    world.setup()
    monkeypatch.setenv("DATABASE_URL", "postgresql://secret@nowhere/db")
    monkeypatch.setenv("PGDISPATCH_SECRET_KEY", "hush")
    job = world.job(command=["sh", "-c", 'echo "job=$PGDISPATCH_JOB_ID attempt=$PGDISPATCH_ATTEMPT '
                             'gen=$PGDISPATCH_GENERATION db=${DATABASE_URL:-unset} '
                             'key=${PGDISPATCH_SECRET_KEY:-unset} path=${PATH:+set}"'])
    _, signals = start_scheduler()
    assert signals.next_completed().outcome == "succeeded"
    tail = attempts_of(world.conn, job["id"])[0]["output_tail"]
    assert tail.strip() == f"job={job['id']} attempt=1 gen=1 db=unset key=unset path=set"


def test_process_group_leftovers_are_killed_when_the_command_exits(world, start_scheduler,
                                                                   pid_files):
    world.setup()
    pidfile = pid_files / "daemon.pid"
    # A background process that outlives its shell, holding the output pipe open.
    world.job(command=["sh", "-c", f"sleep 60 & echo $! > {pidfile}; echo started"])
    _, signals = start_scheduler()
    result = signals.next_completed()
    assert result.outcome == "succeeded" and result.run_seconds < 3.0
    assert "started" in result.output_tail
    assert not is_alive(int(wait_for_file(pidfile)))


def test_heartbeats_carry_the_output_so_far(world, start_scheduler, pid_files):
    """A running job's output reaches the database before it ends, so a deployment lost with
    its runner leaves evidence for the operator resolving its target."""
    world.setup()
    job = world.job(command=["sh", "-c", f"echo deploying step 1; echo $$ > {pid_files}/$PGDISPATCH_JOB_ID.pid; "
                             "exec sleep 30"])
    start_scheduler()
    wait_for_file(pid_files / f"{job['id']}.pid")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        [attempt] = attempts_of(world.conn, job["id"])
        if attempt["output_tail"] and "deploying step 1" in attempt["output_tail"]:
            break
        time.sleep(0.05)
    assert attempt["state"] == "running"
    assert "deploying step 1" in (attempt["output_tail"] or "")
