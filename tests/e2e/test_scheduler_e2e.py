"""End to end: real scheduler processes (``python -m scheduler``) against a real PostgreSQL,
killed and signalled for real. Every process started here is killed at teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pgdispatch.sql import FencedOut, transitions

ROOT = Path(__file__).resolve().parents[2]
LEASE_SECONDS = 2.0
DEADLINE_SECONDS = 30.0


def wait_until(fn: Callable[[], Any], *, what: str, timeout: float = DEADLINE_SECONDS,
               procs: "Schedulers | None" = None) -> Any:
    """Poll ``fn`` until it returns something truthy; fail after ``timeout`` seconds with
    the schedulers' logs."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            logs = procs.logs() if procs is not None else ""
            raise AssertionError(f"timed out waiting for {what}; last: {value!r}\n{logs}")
        time.sleep(0.05)


class Schedulers:
    """Starts ``python -m scheduler`` processes on one database; kills them all at the end,
    and the job process groups whose pids the job commands wrote into ``pid_dir``."""

    def __init__(self, db_url: str, tmp_path: Path):
        self.db_url = db_url
        self.tmp_path = tmp_path
        self.pid_dir = tmp_path / "pids"
        self.pid_dir.mkdir()
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, name: str, *, pools=("linux",), slots: int = 2,
              grace_seconds: float | None = None, via_cli: bool = False,
              new_session: bool = False) -> subprocess.Popen:
        """Start scheduler ``name``; with ``new_session`` it leads its own process group (as
        under a shell's job control), so that a signal can go to that whole group."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
        env.update(DATABASE_URL=self.db_url, PGDISPATCH_LEASE_SECONDS=str(LEASE_SECONDS),
                   PGDISPATCH_HEARTBEAT_SECONDS="0.5", PGDISPATCH_CLAIM_INTERVAL_SECONDS="0.2", PGDISPATCH_CLAIM_IDLE_CAP_SECONDS="1",
                   PGDISPATCH_EXPIRE_INTERVAL_SECONDS="0.3",
               PGDISPATCH_RUNNER_BEAT_SECONDS="1", PGDISPATCH_DUTY_LEASE_SECONDS="3",
                   PGDISPATCH_SUMMARY_INTERVAL_SECONDS="1",
                   PGDISPATCH_BACKOFF_BASE_SECONDS="0.1", PGDISPATCH_BACKOFF_CAP_SECONDS="0.2",
                   PGDISPATCH_DATA_DIR=str(self.tmp_path / "data"))
        entry = ["-m", "pgdispatch", "scheduler"] if via_cli else ["-m", "pgdispatch.scheduler"]
        argv = [sys.executable, *entry, "--slots", str(slots), "--name", name]
        for pool in pools:
            argv += ["--pool", pool]
        if grace_seconds is not None:
            argv += ["--grace-seconds", str(grace_seconds)]
        log_path = self.tmp_path / f"{name}.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log_file,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=new_session)
        self.procs.append((name, proc, log_path))
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {name} (exit {proc.poll()}) ---\n"
                         f"{path.read_text(errors='replace')[-4000:]}"
                         for name, proc, path in self.procs)

    def job_pid(self, job_id: int) -> int:
        """The pid (and process group) a job command wrote, once it has."""
        path = self.pid_dir / f"{job_id}.pid"
        return int(wait_until(lambda: path.exists() and path.read_text().strip(),
                              what=f"job {job_id} to start", procs=self))

    def close(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        for f in self.pid_dir.glob("*.pid"):
            try:
                os.killpg(int(f.read_text().strip()), signal.SIGKILL)
            except (ValueError, ProcessLookupError, PermissionError):
                pass


@pytest.fixture
def schedulers(db_url, tmp_path):
    s = Schedulers(db_url, tmp_path)
    yield s
    s.close()


def sleeper(schedulers: Schedulers, *, first_attempt_only: bool = False) -> list[str]:
    """A command that writes its pid (its process group) and sleeps 30 s; with
    ``first_attempt_only`` a later attempt just succeeds at once."""
    script = f'echo $$ > {schedulers.pid_dir}/$PGDISPATCH_JOB_ID.pid; exec sleep 30'
    if first_attempt_only:
        script = (f'if [ "$PGDISPATCH_ATTEMPT" = 1 ]; then {script}; fi; '
                  'echo "attempt $PGDISPATCH_ATTEMPT ok"')
    return ["sh", "-c", script]


def job_row(conn, job_id: int) -> dict:
    return conn.execute("SELECT * FROM jobs WHERE id = %s", (job_id,)).fetchone()


def attempts(conn, job_id: int) -> list[dict]:
    return conn.execute("SELECT a.*, r.name AS runner_name FROM attempts a "
                        "JOIN runners r ON r.id = a.runner_id WHERE a.job_id = %s "
                        "ORDER BY a.attempt_no", (job_id,)).fetchall()


def is_running(conn, job_id: int) -> bool:
    return job_row(conn, job_id)["state"] == "running"


def test_a_scheduler_process_runs_real_commands(world, schedulers):
    world.setup()
    ok = world.job(command=["sh", "-c", "echo out-of-process; exit 0"])
    bad = world.job(command=["sh", "-c", "echo failing >&2; exit 7"])
    schedulers.start("a")
    for job in (ok, bad):
        wait_until(lambda: job_row(world.conn, job["id"])["finished_at"] is not None,
                   what=f"job {job['id']} to finish", procs=schedulers)
    [a_ok] = attempts(world.conn, ok["id"])
    assert job_row(world.conn, ok["id"])["state"] == "succeeded"
    assert (a_ok["state"], a_ok["exit_code"], a_ok["runner_name"]) == ("succeeded", 0, "a")
    assert "out-of-process" in a_ok["output_tail"]
    [a_bad] = attempts(world.conn, bad["id"])
    assert job_row(world.conn, bad["id"])["state"] == "failed"
    assert (a_bad["state"], a_bad["exit_code"]) == ("failed", 7)
    assert "failing" in a_bad["output_tail"]


def test_a_killed_schedulers_deployment_becomes_uncertain(world, schedulers):
    world.setup(targets=("production",))
    job = world.job(command=sleeper(schedulers), target="production", max_attempts=3)
    a = schedulers.start("a")
    wait_until(lambda: is_running(world.conn, job["id"]), what="the deployment to run",
               procs=schedulers)
    schedulers.job_pid(job["id"])
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=10)
    schedulers.start("b")
    wait_until(lambda: job_row(world.conn, job["id"])["state"] == "uncertain",
               what="the deployment to become uncertain", procs=schedulers)
    [attempt] = attempts(world.conn, job["id"])
    assert attempt["state"] == "lost" and attempt["runner_name"] == "a"
    target = world.conn.execute("SELECT * FROM targets WHERE name = 'production'").fetchone()
    assert target["state"] == "uncertain" and target["holder_job_id"] == job["id"]
    with pytest.raises(FencedOut):
        transitions.heartbeat(world.conn, attempt_id=attempt["id"],
                              generation=attempt["generation"], lease_seconds=30)


def test_a_killed_schedulers_build_is_retried_by_another(world, schedulers):
    world.setup()
    job = world.job(command=sleeper(schedulers, first_attempt_only=True), max_attempts=2)
    a = schedulers.start("a")
    wait_until(lambda: is_running(world.conn, job["id"]), what="the build to run",
               procs=schedulers)
    schedulers.job_pid(job["id"])
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=10)
    schedulers.start("b")
    wait_until(lambda: job_row(world.conn, job["id"])["state"] == "succeeded",
               what="the build to succeed on the second scheduler", procs=schedulers)
    first, second = attempts(world.conn, job["id"])
    assert (first["state"], first["runner_name"]) == ("expired", "a")
    assert (second["state"], second["runner_name"], second["exit_code"]) == ("succeeded", "b", 0)
    assert "attempt 2 ok" in second["output_tail"]
    # The killed attempt's late reports carry its old generation: both are fenced out.
    with pytest.raises(FencedOut):
        transitions.heartbeat(world.conn, attempt_id=first["id"], generation=first["generation"],
                              lease_seconds=30)
    with pytest.raises(FencedOut):
        transitions.complete(world.conn, attempt_id=first["id"], generation=first["generation"],
                             outcome="succeeded", receipt_key=f"{first['claim_token']}:complete",
                             exit_code=0)
    assert job_row(world.conn, job["id"])["state"] == "succeeded"


def test_sigterm_drains_hands_back_and_exits_0(world, schedulers):
    world.setup()
    job = world.job(command=sleeper(schedulers))
    a = schedulers.start("a", grace_seconds=1)
    wait_until(lambda: is_running(world.conn, job["id"]), what="the build to run",
               procs=schedulers)
    pgid = schedulers.job_pid(job["id"])
    sent = time.monotonic()
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=15) == 0, schedulers.logs()
    assert time.monotonic() - sent < 1 + 4.0  # the grace period, then a prompt stop
    runner = world.conn.execute("SELECT * FROM runners WHERE name = 'a'").fetchone()
    assert runner["stopped_at"] is not None
    row = job_row(world.conn, job["id"])
    assert row["state"] == "queued" and row["failures"] == 0
    [attempt] = attempts(world.conn, job["id"])
    assert attempt["state"] == "cancelled"
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_an_unknown_pool_exits_2_with_one_line_and_no_runner(world, schedulers):
    world.setup()
    proc = schedulers.start("a", pools=("linux", "no-such-pool"))
    assert proc.wait(timeout=20) == 2
    name, _, log_path = schedulers.procs[-1]
    errors = [line for line in log_path.read_text().splitlines() if line.startswith("error:")]
    assert errors == ["error: unknown pool among linux, no-such-pool"]
    assert world.conn.execute("SELECT count(*) AS n FROM runners").fetchone()["n"] == 0
