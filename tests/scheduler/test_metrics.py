"""Each scheduler's own metrics endpoint, scraped from a real ``pgdispatch scheduler`` process."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_SECONDS = 30.0


def _env(db_url: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=db_url, PGDISPATCH_LEASE_SECONDS="3", PGDISPATCH_HEARTBEAT_SECONDS="0.5",
               PGDISPATCH_CLAIM_INTERVAL_SECONDS="0.2", PGDISPATCH_CLAIM_IDLE_CAP_SECONDS="1", PGDISPATCH_EXPIRE_INTERVAL_SECONDS="0.3",
               PGDISPATCH_RUNNER_BEAT_SECONDS="1", PGDISPATCH_DUTY_LEASE_SECONDS="3",
               PGDISPATCH_SUMMARY_INTERVAL_SECONDS="1", PGDISPATCH_BACKOFF_BASE_SECONDS="30",
               PGDISPATCH_DATA_DIR=str(tmp_path / "data"), **extra)
    return env


def _until(fn, what: str, log: Path | None = None, timeout: float = DEADLINE_SECONDS):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.1)


def _sample(text: str, name: str, labels: str = "") -> float | None:
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else None


@pytest.fixture
def scheduler_process(db_url, tmp_path):
    """Start ``python -m pgdispatch scheduler …``; killed at teardown if still running."""
    procs: list[subprocess.Popen] = []

    def start(*args: str, **env: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"scheduler-{len(procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "pgdispatch", "scheduler", *args],
                                    env=_env(db_url, tmp_path, **env), cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(proc)
        return proc, log

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_a_scheduler_serves_its_own_process_metrics(world, scheduler_process):
    world.setup()
    # a lease that lapsed on a runner that is gone: this scheduler's expiry pass ends it
    gone = world.runner(name="gone")
    world.job(command=["sh", "-c", "exit 0"], max_attempts=2)
    lapsed = world.claim(gone)
    world.expire_now(lapsed.attempt_id)
    proc, log = scheduler_process("--pool", "linux", "--slots", "2", "--name", "metered",
                                  PGDISPATCH_METRICS_PORT="0")  # the variable, no flag
    port = int(_until(lambda: re.search(r"serving metrics on http://127\.0\.0\.1:(\d+)/metrics",
                                        log.read_text(errors="replace")), "the metrics line",
                      log).group(1))

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            return r.read().decode()

    text = _until(lambda: (t := scrape()) and _sample(
        t, "pgdispatch_lease_expirations_total", '{kind="build"}') == 1.0 and t,
        "the expiry pass to show", log)
    assert _sample(text, "pgdispatch_scheduler_slots") == 2.0
    assert _sample(text, "pgdispatch_scheduler_info", '{pools="linux",runner="metered"}') == 1.0
    # a job that runs for a while: claimed, counted, seen running, then completed
    running = world.job(command=["sh", "-c", "sleep 2"])
    text = _until(lambda: (t := scrape()) and _sample(
        t, "pgdispatch_scheduler_running_jobs") == 1.0 and t, "the job to run", log)
    assert _sample(text, "pgdispatch_claims_total", '{kind="build"}') >= 1.0
    assert _sample(text, "pgdispatch_claims_total", '{kind="deployment"}') == 0.0
    assert _sample(text, "pgdispatch_claim_seconds_count") >= 1.0
    assert _sample(text, "pgdispatch_claim_seconds_bucket", '{le="+Inf"}') >= 1.0
    assert "# TYPE pgdispatch_transaction_retries_total counter" in text
    assert "# TYPE pgdispatch_statement_deadlines_total counter" in text
    assert _sample(text, "pgdispatch_wait_seconds_count", '{pool="linux"}') >= 1.0
    assert _sample(text, "process_cpu_seconds_total") is not None
    text = _until(lambda: (t := scrape()) and _sample(
        t, "pgdispatch_scheduler_completions_total", '{outcome="succeeded"}') >= 1.0 and t,
        "the job to complete", log)
    assert _sample(text, "pgdispatch_scheduler_running_jobs") == 0.0
    assert world.row("jobs", running["id"])["state"] == "succeeded"
    # what the web /metrics shows from the database is not duplicated here
    assert "pgdispatch_queue_depth" not in text
    # no undocumented *_created series beside the counters and histograms (sql/metrics.py)
    assert not re.search(r"^\w+_created[ {]", text, re.M), "a *_created series"
    assert proc.poll() is None


def test_metrics_port_in_use_or_invalid_fails_cleanly_and_registers_nothing(world,
                                                                           scheduler_process):
    world.setup()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, log = scheduler_process("--pool", "linux", "--slots", "1", "--metrics-port", str(port))
        assert proc.wait(timeout=60) == 2
    lines = log.read_text().strip().splitlines()
    assert lines[-1].startswith(f"error: cannot serve metrics on 127.0.0.1:{port}: ")
    bad, log = scheduler_process("--pool", "linux", "--slots", "1", "--metrics-port", "70000")
    assert bad.wait(timeout=60) == 2 and "70000" in log.read_text()
    assert world.conn.execute("SELECT count(*) AS n FROM runners").fetchone()["n"] == 0


def test_the_exporter_counts_what_its_scheduler_reports(db_url, world):
    """In process: the hooks chain before the scheduler's own callbacks, the claimed job's
    wait (ready_at to claimed_at) is observed for its pool, and close() frees the port."""
    from pgdispatch.scheduler.main import Scheduler
    from pgdispatch.scheduler.metrics import Exporter

    from .conftest import FAST

    world.setup()
    seen = []
    exporter = Exporter(port=0)
    try:
        s = Scheduler(FAST, database_url=db_url, pools=["linux"], slots=1, name="inproc",
                      on_claimed=seen.append)
        exporter.watch(s)
        job = world.job(command=["sh", "-c", "exit 3"])
        # ready 100 s ago (a test-only UPDATE), claimed once the scheduler starts
        world.conn.execute("UPDATE jobs SET ready_at = now() - interval '100 seconds' WHERE id = %s",
                           (job["id"],))
        assert exporter.registry.get_sample_value("pgdispatch_wait_seconds_count",
                                                  {"pool": "linux"}) == 0.0
        assert s.start()
        try:
            _until(lambda: world.row("jobs", job["id"])["state"] == "failed", "the job to fail")
            _until(lambda: exporter.registry.get_sample_value(
                "pgdispatch_scheduler_completions_total", {"outcome": "failed"}) == 1.0,
                "the completion to be counted")
        finally:
            s.stop(grace_seconds=0)
        assert [c.job_id for c in seen] == [job["id"]]  # the original callback still runs
        assert exporter.registry.get_sample_value("pgdispatch_claims_total",
                                                  {"kind": "build"}) == 1.0
        wait = {le: exporter.registry.get_sample_value("pgdispatch_wait_seconds_bucket",
                                                       {"pool": "linux", "le": le})
                for le in ("60.0", "120.0")}
        assert wait == {"60.0": 0.0, "120.0": 1.0}
        assert 100 <= exporter.registry.get_sample_value("pgdispatch_wait_seconds_sum",
                                                         {"pool": "linux"}) < 120
        port = exporter.port
    finally:
        exporter.close()
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # free again
