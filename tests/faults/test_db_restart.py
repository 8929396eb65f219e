"""PostgreSQL restarted under load (issue 3, scenario B).

A server of this test's own (chaos_server.OwnServer, never the shared test server), migrated,
with three real scheduler processes and the real console (``python -m pgdispatch web``). A
submitter thread posts a few hundred short jobs through the JSON API with idempotency keys,
retrying whatever fails. Mid-run the server is stopped in ``fast`` mode for a few seconds
(less than the lease: running jobs live through it and report after it), later in
``immediate`` mode (every server process killed: crash recovery on the next start) for longer
than the lease (jobs running then cannot report within their lease, which lapses: they run
again), and started again each time; submitting goes on across and after both.

Afterwards: every submitted job exists exactly once and succeeded; the invariant checker
finds nothing; no attempt ran its command to the end twice, and a job whose command ran to
the end more than once had a retry (the first run's report was lost with the server);
/healthz said 503 while the server was down and 200 after; the schedulers and the console
lived through it and the schedulers still stop cleanly (exit 0 on SIGTERM).
"""

from __future__ import annotations

import collections
import random
import threading
import time
from pathlib import Path

import pytest

from pgdispatch.sql import accounts, config, db, migrate

from .chaos_procs import FAST_ENV, Fleet, free_port, http, wait_until
from .chaos_runs import read_runs, reruns, run_command, runs_violations
from .chaos_server import OwnServer
from .invariants import check_invariants

SCHEDULERS = 3
SLOTS = 3
JOBS_PER_PHASE = (120, 120, 60)  # submitted first, as the server stops, as it stops again
MAX_ATTEMPTS = 5
# A lease longer than the outage, so most running jobs live through it and report after
# it; a few may not (their reports give up when the lease would have lapsed): retried.
ENV = dict(FAST_ENV, PGDISPATCH_LEASE_SECONDS="10", PGDISPATCH_HEARTBEAT_SECONDS="1",
           PGDISPATCH_EXPIRE_INTERVAL_SECONDS="0.5",
               PGDISPATCH_RUNNER_BEAT_SECONDS="1", PGDISPATCH_DUTY_LEASE_SECONDS="3")
# (mode, seconds down at least): the fast stop is shorter than the lease, so running jobs
# live through it and report late; the crash-like immediate stop outlasts the lease, so the
# jobs running then give up reporting (or fence themselves) and their leases lapse: retried.
RESTARTS = (("fast", 3.0), ("immediate", 12.0))
DEADLINE_S = 120.0

CONFIG = """
[[organizations]]
name = "acme"
max_running = 8

[[pools]]
name = "linux"
slots = 9

[[projects]]
name = "web"
organization = "acme"
pools = ["linux"]
max_running = 5

[[projects]]
name = "api"
organization = "acme"
pools = ["linux"]

[[users]]
username = "alice"
role = "operator"
password_env = "ALICE_PASSWORD"
"""


def query(url: str, sql: str, params: tuple = ()) -> list[dict]:
    """One query on a fresh connection (the server restarts under us)."""
    with db.connect(url, application_name="pgd-test") as conn:
        return conn.execute(sql, params).fetchall()


class Submitter(threading.Thread):
    """Submits jobs ``job-<i>`` through the API as they are released, each retried with
    jittered backoff until the API accepts it (201, or 200 for a repeated idempotency key)."""

    def __init__(self, base: str, token: str, runs: Path, rng: random.Random):
        super().__init__(name="submitter", daemon=True)
        self.base, self.token, self.runs, self.rng = base, token, runs, rng
        self.released = 0
        self.accepted: dict[str, int] = {}  # idempotency key -> job id
        self.repeats = 0                    # 200: the first try had committed
        self.failures: collections.Counter = collections.Counter()  # status -> count
        self.error: str | None = None  # an answer no outage explains: the thread stops
        self.stop = threading.Event()
        self._cv = threading.Condition()

    def release(self, n: int) -> None:
        with self._cv:
            self.released += n
            self._cv.notify_all()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            with self._cv:
                while i >= self.released and not self.stop.is_set():
                    self._cv.wait(0.2)
            if self.stop.is_set():
                return
            key = f"job-{i}"
            seconds = self.rng.choice((0.1, 0.2, 0.3, 0.4))
            body = {"project": self.rng.choice(("web", "api")), "pool": "linux",
                    "command": run_command(self.runs, seconds), "max_attempts": MAX_ATTEMPTS,
                    "timeout_seconds": 60, "idempotency_key": key}
            delay = 0.1
            while not self.stop.is_set():
                status, answer = http("POST", f"{self.base}/api/v1/jobs", body=body,
                                      token=self.token, timeout_s=20)
                if status in (200, 201):
                    self.accepted[key] = answer["id"]
                    self.repeats += status == 200
                    break
                self.failures[status] += 1
                if status not in (0, 500, 502, 503):  # refused, not unavailable
                    self.error = f"{key}: {status} {answer}"
                    return
                time.sleep(delay * self.rng.uniform(0.5, 1.0))
                delay = min(1.0, delay * 2)
            i += 1


@pytest.fixture
def own_server():
    server = OwnServer()
    yield server
    server.close()


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, env=ENV)
    yield f
    f.close()


def succeeded_count(url: str) -> int:
    return query(url, "SELECT count(*) AS n FROM jobs WHERE state = 'succeeded'")[0]["n"]


def test_database_restart_under_load(own_server, fleet, tmp_path, capsys):
    url = own_server.create_database("pgd_restart")
    migrate.upgrade(url)
    with db.connect(url) as conn:
        config.apply_config(conn, CONFIG, actor="test", env={"ALICE_PASSWORD": "correct horse 1"})
        token = accounts.create_api_token(conn, username="alice")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    scheds = [fleet.start_scheduler(f"s{i}", url, slots=SLOTS, grace_seconds=5)
              for i in range(SCHEDULERS)]
    web = fleet.start_web("web", url, port=port)
    wait_until(lambda: http("GET", f"{base}/healthz", timeout_s=5)[0] == 200,
               what="the console to answer", timeout_s=60, logs=fleet.logs)

    runs = tmp_path / "runs.txt"
    runs.touch()
    submitter = Submitter(base, token, runs, random.Random(3))
    submitter.start()
    figures: dict[str, object] = {}
    started = time.monotonic()
    try:
        submitter.release(JOBS_PER_PHASE[0])
        wait_until(lambda: succeeded_count(url) >= 30, what="30 jobs to succeed",
                   timeout_s=DEADLINE_S, logs=fleet.logs)
        for n, ((mode, down_s), jobs_next) in enumerate(zip(RESTARTS, JOBS_PER_PHASE[1:])):
            # the next batch is released as the server goes down: its submits meet the
            # outage through the API and are retried until the server is back
            submitter.release(jobs_next)
            figures[mode] = restart(own_server, fleet, url, base, mode=mode, down_s=down_s,
                                    scheds=scheds, web=web)
            if n == 0:
                target = succeeded_count(url) + 30
                wait_until(lambda: succeeded_count(url) >= target,
                           what="30 more jobs to succeed", timeout_s=DEADLINE_S, logs=fleet.logs)
        total = sum(JOBS_PER_PHASE)
        wait_until(lambda: len(submitter.accepted) == total or submitter.error,
                   what="every job to be accepted", timeout_s=DEADLINE_S, logs=fleet.logs)
        assert submitter.error is None, submitter.error
        wait_until(lambda: query(url, "SELECT count(*) AS n FROM jobs WHERE state NOT IN "
                                      "('succeeded', 'failed', 'cancelled')")[0]["n"] == 0,
                   what="every job to finish", timeout_s=DEADLINE_S, logs=fleet.logs)
    finally:
        submitter.stop.set()
        submitter.join(30)
    elapsed = time.monotonic() - started

    # Nothing lost, nothing duplicated: one job per idempotency key, all succeeded.
    jobs = query(url, "SELECT id, idempotency_key, state, attempts_made FROM jobs ORDER BY id")
    assert sorted(j["idempotency_key"] for j in jobs) == sorted(submitter.accepted)
    assert {j["idempotency_key"]: j["id"] for j in jobs} == submitter.accepted
    assert [j for j in jobs if j["state"] != "succeeded"] == []
    assert sum(submitter.failures.values()) > 0  # submits did meet the outages

    with db.connect(url, application_name="pgd-test") as conn:
        violations = check_invariants(conn)
    assert violations == []

    # No claim ran twice and every recorded success really ran; a job whose command ran to
    # the end twice did so in two attempts (its first report was lost with the server).
    runs_seen = read_runs(runs)
    attempt_rows = query(url, "SELECT job_id, attempt_no, state FROM attempts")
    assert runs_violations(runs_seen, attempt_rows) == []
    rerun_jobs = reruns(runs_seen)

    # /healthz, the schedulers and the console lived through it all; each scheduler's periodic
    # jobs failed during the outages, backed off, and said when they recovered.
    assert http("GET", f"{base}/healthz")[0] == 200
    assert all(p.is_alive for p in scheds + [web]), fleet.logs()
    recoveries = {p.name: p.log_tail(10**7).count("recovered after") for p in scheds}
    assert all(n > 0 for n in recoveries.values()), recoveries
    for p in scheds:
        assert fleet.stop(p) == 0, p.log_tail()
    assert fleet.stop(web) == 0, web.log_tail()

    attempts = query(url, "SELECT state, count(*) AS n FROM attempts GROUP BY state ORDER BY state")
    with capsys.disabled():
        print(f"\ndb restart: {len(jobs)} jobs in {elapsed:.1f} s; attempts "
              f"{ {a['state']: a['n'] for a in attempts} }; "
              f"reruns after a lost report {rerun_jobs}; "
              f"submits retried {dict(submitter.failures)}, answered as repeats "
              f"{submitter.repeats}; periodic-job recoveries logged {recoveries}; "
              + "; ".join(f"{mode}: {f}" for mode, f in figures.items()))


def restart(server: OwnServer, fleet: Fleet, url: str, base: str, *, mode: str, down_s: float,
            scheds, web) -> dict[str, float]:
    """Stop the server in ``mode`` while jobs run, check the console says 503 and everyone
    stays up, start it again after at least ``down_s`` seconds; returns the timings
    (seconds)."""
    wait_until(lambda: query(url, "SELECT count(*) AS n FROM attempts WHERE state = 'running'")
               [0]["n"] > 0, what="jobs to be running", timeout_s=DEADLINE_S, logs=fleet.logs)
    stopped_at = time.monotonic()
    server.stop(mode)
    status, answer = http("GET", f"{base}/healthz", timeout_s=30)
    assert status == 503 and answer["status"] == "unavailable", (status, answer)
    while time.monotonic() - stopped_at < down_s:
        time.sleep(0.1)
    assert all(p.is_alive for p in scheds + [web]), fleet.logs()
    down_s = time.monotonic() - stopped_at
    server.start()
    up_at = time.monotonic()
    server_now = query(url, "SELECT now() AS t")[0]["t"]
    wait_until(lambda: http("GET", f"{base}/healthz", timeout_s=10)[0] == 200,
               what="/healthz to say 200 again", timeout_s=60, logs=fleet.logs)
    healthy_s = time.monotonic() - up_at
    # the schedulers are back at work: an attempt claimed after the restart has finished
    wait_until(lambda: query(url, "SELECT count(*) AS n FROM attempts WHERE claimed_at > %s "
                                  "AND state = 'succeeded'", (server_now,))[0]["n"] > 0,
               what="a job claimed after the restart to succeed", timeout_s=60, logs=fleet.logs)
    working_s = time.monotonic() - up_at
    return {"down_s": round(down_s, 1), "healthz_200_after_s": round(healthy_s, 1),
            "first_new_success_after_s": round(working_s, 1)}
