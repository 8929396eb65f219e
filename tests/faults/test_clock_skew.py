"""Clocks (issue 3): a scheduler whose clock is minutes off changes nothing, because every
time that matters is the database's.

The scheduler is a real process started as ``faketime -f '+10m' python -m pgdispatch
scheduler …`` (libfaketime, Debian package ``faketime``): its wall clock — ``time.time``,
``datetime.now``, its log timestamps, and the clock of every job command it starts — is ten
minutes ahead of (or behind) the database's. The monotonic clock is left alone
(FAKETIME_DONT_FAKE_MONOTONIC=1): a skewed machine has a wrong wall clock, not a shifted
monotonic one, and the scheduler measures its own intervals on the monotonic clock. (With
libfaketime 0.9.10 faking the monotonic clock too, Python's timed waits — Event.wait,
Condition.wait — never return, so no Python program can run under it; and even with it left
alone, ``time.sleep`` fails with EINVAL under libfaketime. The scheduler's normal path does not
sleep, only its retry paths do; its log is checked for any traceback.) The delayed job is
submitted through the CLI under the same skew.

Each run checks, on the database's clock: jobs run; every lease sampled while running ends
within ``lease_seconds`` after the database's now (never in its past, never minutes ahead);
no attempt of the healthy scheduler is expired; a ``--delay 5`` job does not start before
its ready time; a retry waits its backoff after the failure. The same checks are shown
catching a process that used its own skewed clock for a lease, a delay and a backoff.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import glob
import json
import os
import re
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pgdispatch.sql import transitions

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 2.0
BACKOFF_BASE_S = 2.0  # first retry waits uniform(0.5, 1) * 2 s = 1..2 s (pgd_backoff_seconds)
DELAY_S = 5.0
SKEW_S = 600.0
DEADLINE_S = 60.0
SKEWS = {"ahead": ("+10m", SKEW_S), "behind": ("-10m", -SKEW_S)}


def faketime(offset: str) -> list[str]:
    """The command prefix that runs a program with its wall clock moved by ``offset``.

    Clears first what earlier runs left in /dev/shm: libfaketime names a semaphore and a
    shared-memory segment after the pid of the process that starts the skew, and unlinks them
    only when that process exits normally. A SIGKILLed run leaves them behind, and a later
    run given the same pid then failed with "sem_open: File exists" (seen in a CI run)."""
    exe = shutil.which("faketime")
    assert exe, ("the clock tests need libfaketime: apt-get install -y faketime "
                 "(.ci/run installs it)")
    for path in glob.glob("/dev/shm/faketime_shm_*") + glob.glob("/dev/shm/sem.faketime_sem_*"):
        pid = path.rsplit("_", 1)[1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):  # its process is gone
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return [exe, "-f", offset]


def skewed_env(db_url: str, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=db_url, TZ="UTC", FAKETIME_DONT_FAKE_MONOTONIC="1",
               PGDISPATCH_LEASE_SECONDS=str(LEASE_S), PGDISPATCH_HEARTBEAT_SECONDS="0.5",
               PGDISPATCH_CLAIM_INTERVAL_SECONDS="0.2", PGDISPATCH_CLAIM_IDLE_CAP_SECONDS="1", PGDISPATCH_EXPIRE_INTERVAL_SECONDS="0.3",
               PGDISPATCH_RUNNER_BEAT_SECONDS="1", PGDISPATCH_DUTY_LEASE_SECONDS="3",
               PGDISPATCH_SUMMARY_INTERVAL_SECONDS="1",
               PGDISPATCH_BACKOFF_BASE_SECONDS=str(BACKOFF_BASE_S),
               PGDISPATCH_BACKOFF_CAP_SECONDS="300",
               PGDISPATCH_DATA_DIR=str(tmp_path / "data"),
               # a skewed machine's jobs see its clock too: libfaketime's variables are not on
               # the job environment's allow-list by default (scheduler/sandbox.py)
               PGDISPATCH_JOB_ENV_ALLOW="LD_PRELOAD,FAKETIME,FAKETIME_DONT_FAKE_MONOTONIC")
    return env


def db_now(conn) -> dt.datetime:
    return conn.execute("SELECT clock_timestamp() AS t").fetchone()["t"]


# --- the checks (each shown catching a skewed-clock variant below) ---------------------

LEASE_SAMPLE_SQL = """
SELECT a.id, extract(epoch FROM a.lease_expires_at - clock_timestamp())::float8 AS left_s
  FROM attempts a WHERE a.state = 'running'"""


def lease_violations(samples: list[dict[str, Any]], lease_s: float) -> list[str]:
    """Leases sampled while running that were not within (0, lease_s] of the database's now."""
    return [f"attempt {s['id']}: lease ends {s['left_s']:+.1f} s from the database's now"
            for s in samples if not 0 < s["left_s"] <= lease_s]


def expired_attempts(conn) -> list[str]:
    """Attempts ended by the expiry pass (a healthy scheduler should have none)."""
    return [f"attempt {r['id']} of job {r['job_id']} was {r['state']}" for r in conn.execute(
        "SELECT id, job_id, state FROM attempts WHERE state IN ('expired', 'lost') ORDER BY id")]


def early_starts(conn, job_id: int, delay_s: float) -> list[str]:
    """The job's first attempt began less than ``delay_s`` after the job was created."""
    return [f"job {job_id} started {r['waited_s']:.2f} s after submission, delay {delay_s:g} s"
            for r in conn.execute("""
        SELECT extract(epoch FROM a.claimed_at - j.created_at)::float8 AS waited_s
          FROM attempts a JOIN jobs j ON j.id = a.job_id
         WHERE a.job_id = %s AND a.attempt_no = 1""", (job_id,))
            if r["waited_s"] < delay_s]


def backoff_violations(conn, base_s: float) -> list[str]:
    """Retries claimed sooner after the failure before them than the least backoff allows:
    uniform(0.5, 1) * base * 2**(n-1) after the n-th failure (cap not reached here)."""
    rows = conn.execute("""
        SELECT a.job_id, a.attempt_no,
               extract(epoch FROM a.claimed_at - prev.finished_at)::float8 AS waited_s
          FROM attempts a
          JOIN attempts prev ON prev.job_id = a.job_id AND prev.attempt_no = a.attempt_no - 1
         WHERE prev.state IN ('failed', 'expired')""").fetchall()
    out = []
    for r in rows:
        least = 0.5 * base_s * 2 ** (r["attempt_no"] - 2)
        if r["waited_s"] < least:
            out.append(f"job {r['job_id']} attempt {r['attempt_no']} began {r['waited_s']:.2f} s "
                       f"after the failure, backoff at least {least:g} s")
    return out


# --- a skewed scheduler, for real -------------------------------------------------------

class SkewedScheduler:
    """``faketime -f OFFSET python -m pgdispatch scheduler`` on the test's database."""

    def __init__(self, db_url: str, tmp_path: Path, offset: str):
        self.env = skewed_env(db_url, tmp_path)
        self.offset = offset
        self.log_path = tmp_path / "scheduler.log"
        self.proc: subprocess.Popen | None = None

    def submit(self, *args: str) -> dict[str, Any]:
        """``pgdispatch submit`` under the same skew; returns the job it printed."""
        out = subprocess.run([*faketime(self.offset), sys.executable, "-m", "pgdispatch", "submit",
                              *args], env=self.env, cwd=ROOT, capture_output=True, text=True,
                             timeout=DEADLINE_S, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, f"skewed submit exited {out.returncode}: {out.stderr[-2000:]}"
        return json.loads(out.stdout)

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*faketime(self.offset), sys.executable, "-m", "pgdispatch", "scheduler",
                 "--pool", "linux", "--slots", "4", "--name", f"skewed{self.offset}"],
                env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def first_log_time(self) -> dt.datetime:
        """The timestamp of its first log line (its own, skewed, clock)."""
        m = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", self.log(), re.M)
        assert m, f"no log line yet:\n{self.log()}"
        return dt.datetime.strptime(f"{m[1]}.{m[2]}", "%Y-%m-%d %H:%M:%S.%f").replace(
            tzinfo=dt.timezone.utc)

    def close(self) -> None:
        # faketime runs the scheduler as its child: end the whole session's process group,
        # or the scheduler (and its watchdog) would outlive the test
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


@pytest.fixture
def make_skewed(db_url, tmp_path):
    made: list[SkewedScheduler] = []

    def make(offset: str) -> SkewedScheduler:
        s = SkewedScheduler(db_url, tmp_path, offset)
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("skew", sorted(SKEWS))
def test_a_skewed_scheduler_keeps_time_by_the_database(world, make_skewed, skew):
    offset, skew_s = SKEWS[skew]
    world.setup()
    sched = make_skewed(offset)
    clock = world.job(command=["sh", "-c", "date +%s"])
    long = world.job(command=["sleep", str(2.5 * LEASE_S)])
    retried = world.job(command=["sh", "-c", '[ "$PGDISPATCH_ATTEMPT" -gt 1 ]'], max_attempts=2)
    delayed = sched.submit("--project", "web", "--pool", "linux", "--delay", str(DELAY_S),
                           "--", "true")
    jobs = [clock["id"], long["id"], retried["id"], delayed["id"]]
    started_at = db_now(world.conn)
    sched.start()

    samples: list[dict[str, Any]] = []
    long_leases: set[dt.datetime] = set()
    deadline = time.monotonic() + DEADLINE_S
    while True:
        samples += world.conn.execute(LEASE_SAMPLE_SQL).fetchall()
        row = world.conn.execute("SELECT lease_expires_at FROM attempts WHERE job_id = %s",
                                 (long["id"],)).fetchone()
        if row:
            long_leases.add(row["lease_expires_at"])
        unfinished = world.conn.execute("SELECT count(*) AS n FROM jobs WHERE id = ANY(%s) "
                                        "AND finished_at IS NULL", (jobs,)).fetchone()["n"]
        if unfinished == 0:
            break
        assert sched.proc.poll() is None, f"the scheduler exited:\n{sched.log()}"
        assert time.monotonic() < deadline, f"jobs still unfinished:\n{sched.log()[-4000:]}"
        time.sleep(0.05)

    # the clocks really were skewed: the scheduler's log and its job's `date`
    logged = (sched.first_log_time() - started_at).total_seconds()
    assert abs(logged - skew_s) < 30, f"scheduler clock off by {logged:.0f} s, wanted {skew_s:+g}"
    [a_clock] = world.conn.execute(
        "SELECT output_tail, extract(epoch FROM finished_at)::float8 AS t FROM attempts "
        "WHERE job_id = %s", (clock["id"],)).fetchall()
    job_skew = int(a_clock["output_tail"].split()[0]) - a_clock["t"]
    assert abs(job_skew - skew_s) < 30, f"job clock off by {job_skew:.0f} s"

    assert "Traceback" not in sched.log(), sched.log()[-4000:]
    states = {r["id"]: r["state"] for r in world.conn.execute(
        "SELECT id, state FROM jobs WHERE id = ANY(%s)", (jobs,))}
    assert set(states.values()) == {"succeeded"}, states
    # leases ran on the database's clock and were extended while the long job ran
    assert len(samples) > 20
    assert lease_violations(samples, LEASE_S) == []
    assert len(long_leases) >= 3, "the long job's lease was never extended"
    [a_long] = world.conn.execute("SELECT * FROM attempts WHERE job_id = %s",
                                  (long["id"],)).fetchall()
    assert (a_long["lease_expires_at"] - a_long["claimed_at"]).total_seconds() > 2 * LEASE_S
    assert expired_attempts(world.conn) == []
    # the delay and the backoff waited by the database's clock, and not much longer
    assert early_starts(world.conn, delayed["id"], DELAY_S) == []
    waited = world.conn.execute(
        "SELECT extract(epoch FROM a.claimed_at - j.created_at)::float8 AS s FROM attempts a "
        "JOIN jobs j ON j.id = a.job_id WHERE j.id = %s", (delayed["id"],)).fetchone()["s"]
    assert waited < DELAY_S + 15, f"the delayed job waited {waited:.1f} s"
    assert world.conn.execute("SELECT count(*) AS n FROM attempts WHERE job_id = %s",
                              (retried["id"],)).fetchone()["n"] == 2
    assert backoff_violations(world.conn, BACKOFF_BASE_S) == []
    print(f"\nskew {offset}: scheduler log clock {logged:+.0f} s, job clock {job_skew:+.0f} s "
          f"from the database; {len(samples)} lease samples in "
          f"[{min(s['left_s'] for s in samples):.2f}, {max(s['left_s'] for s in samples):.2f}] s; "
          f"delayed job started after {waited:.2f} s")


# --- the checks catch a process that trusts its own skewed clock ------------------------

CLIENT_CLOCK_SCRIPT = r"""
import datetime as dt, sys
import psycopg
url, what, row_id, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds)  # the skewed clock
with psycopg.connect(url, autocommit=True) as conn:
    if what == "lease":
        conn.execute("UPDATE attempts SET lease_expires_at = %s WHERE id = %s", (at, row_id))
    else:
        conn.execute("UPDATE jobs SET ready_at = %s WHERE id = %s", (at, row_id))
print(at.isoformat())
"""


def client_clock(db_url: str, offset: str, what: str, row_id: int, seconds: float) -> dt.datetime:
    """In a process skewed by ``offset``: set a lease (``what="lease"``) or a ready time to
    its own clock + ``seconds`` — the deliberately broken way."""
    out = subprocess.run([*faketime(offset), sys.executable, "-c", CLIENT_CLOCK_SCRIPT, db_url,
                          what, str(row_id), str(seconds)],
                         env={**os.environ, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}, cwd=ROOT,
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 0, f"skewed client exited {out.returncode}: {out.stderr[-2000:]}"
    return dt.datetime.fromisoformat(out.stdout.strip())


def seconds_in(line: str) -> float:
    """The first signed number of seconds in a check's line."""
    return float(re.search(r"([-+]?\d+\.\d+) s", line)[1])


def test_the_checks_catch_times_taken_from_a_skewed_process_clock(world, db_url):
    """The same checks, against a process that takes times from its own clock (skewed with
    faketime, like the scheduler above) instead of the database's."""
    world.setup()
    runner = world.runner()
    delay_s, base_s = 30.0, 20.0  # long, so that the broken variants are early beyond doubt

    # a heartbeat computing the lease on a clock 10 min behind: the lease is already over
    # when it is written, and the healthy runner's attempt is expired by the next pass
    world.job(command=["sleep", "60"])
    c = world.claim(runner, lease_seconds=LEASE_S)
    assert lease_violations(world.conn.execute(LEASE_SAMPLE_SQL).fetchall(), LEASE_S) == []
    at = client_clock(db_url, "-10m", "lease", c.attempt_id, LEASE_S)
    assert abs((at - db_now(world.conn)).total_seconds() + SKEW_S) < 30  # really skewed
    [found] = lease_violations(world.conn.execute(LEASE_SAMPLE_SQL).fetchall(), LEASE_S)
    assert found.startswith(f"attempt {c.attempt_id}: ")
    assert -SKEW_S < seconds_in(found) < -SKEW_S + 30
    # ... and 10 min ahead: the lease would outlive a dead runner by ten minutes
    client_clock(db_url, "+10m", "lease", c.attempt_id, LEASE_S)
    [found] = lease_violations(world.conn.execute(LEASE_SAMPLE_SQL).fetchall(), LEASE_S)
    assert SKEW_S - 30 < seconds_in(found) < SKEW_S + LEASE_S + 1
    client_clock(db_url, "-10m", "lease", c.attempt_id, LEASE_S)
    assert expired_attempts(world.conn) == []
    transitions.expire_leases(world.conn)
    assert expired_attempts(world.conn) == [f"attempt {c.attempt_id} of job {c.job_id} was expired"]

    # a delay computed on the clock 10 min behind: the job is ready at once and starts early
    delayed = world.job(delay_seconds=delay_s)
    assert world.claim(runner) is None  # the real delay holds it back
    client_clock(db_url, "-10m", "ready_at", delayed["id"], delay_s)
    assert world.claim(runner).job_id == delayed["id"]
    [found] = early_starts(world.conn, delayed["id"], delay_s)
    assert found.startswith(f"job {delayed['id']} started ") and seconds_in(found) < delay_s

    # a retry backoff computed on the clock 10 min behind: the retry starts at once
    retried = world.job(max_attempts=2)
    first = world.claim(runner)
    assert first.job_id == retried["id"]
    result = world.complete(first, outcome="failed", exit_code=1, backoff_base_seconds=base_s)
    assert result["job_state"] == "queued"
    assert backoff_violations(world.conn, base_s) == []
    assert world.claim(runner) is None  # the real backoff holds it back
    client_clock(db_url, "-10m", "ready_at", retried["id"], base_s)
    assert world.claim(runner).job_id == retried["id"]
    [found] = backoff_violations(world.conn, base_s)
    assert found.startswith(f"job {retried['id']} attempt 2 began ")
    assert seconds_in(found) < base_s / 2
