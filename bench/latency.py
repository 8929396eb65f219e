"""Latency at size: claim p50/p95/p99, console pages and ``jobs explain`` with many jobs.

Run it from the repository root (``python -m bench all`` runs it after the throughput
series; this runs it alone)::

    python -m bench latency [--queued-sizes 10000,100000,1000000] [--history 1000000]
                            [--latency-claims 1000] [--quick]

Two databases are built, one after the other, on the invocation's server: one without
history and one with ``--history`` finished jobs (each a succeeded no-op job with its one
succeeded attempt, created over the last 30 days, inserted with ``INSERT ... SELECT
generate_series`` in chunks of 1,000,000, before any queued job). In each, queued no-op jobs
are added up to each of ``--queued-sizes`` in turn (one organization, one pool, four projects;
limits free), then ``VACUUM ANALYZE``, and at that size:

* claim latency — one connection claims ``--latency-claims`` times through
  ``sql.transitions.claim`` (each claim completed through ``sql.transitions.complete``
  before the next, untimed); p50/p95/p99 and mean of the claim calls, milliseconds;
* ``summarize_queue`` — the scheduler's queue-summary refresh the overview reads (ms);
* console overview (``GET /``) and queue page (``GET /queue/``, first page of 50) — server
  time of the real Flask app (``webapp.create_app``) through its test client, signed in as a
  viewer: the request handled in-process, rendering included, no network; median of 5 after
  one warm-up, milliseconds;
* ``jobs explain`` — ``sql.explain.explain_job`` (what the CLI command calls) on the newest
  queued job, median of 5, milliseconds.

Build times are recorded (seconds) so that the cost of a larger history can be planned:
``make bench`` uses 1,000,000 history rows; 10,000,000 is ``--history 10000000``.
"""

from __future__ import annotations

import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sql import Settings, config, db, explain, transitions, users

from .claim import POOL, Bench, config_text, limits, scratch_database

HISTORY_CHUNK = 1_000_000
CONSOLE_USER = "bench-viewer"
CONSOLE_PASSWORD = "bench-viewer-password"

# Finished history: succeeded no-op jobs with their one succeeded attempt, oldest first,
# created evenly over the last 30 days (%(first)s..%(last)s of %(total)s rows in all).
INSERT_HISTORY = """
WITH j AS (
    INSERT INTO jobs (project_id, pool_id, state, command, submitted_by, attempts_made,
                      generation, created_at, ready_at, started_at, finished_at)
    SELECT (%(project_ids)s::bigint[])[1 + g %% cardinality(%(project_ids)s::bigint[])],
           %(pool_id)s, 'succeeded', ARRAY['true'], 'bench', 1, 1, t, t, t, t + interval '1 second'
      FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g,
           LATERAL (SELECT now() - interval '30 days' * (1 - g::float8 / %(total)s::bigint)) AS c(t)
    RETURNING id, started_at, finished_at
)
INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                      claimed_at, lease_expires_at, finished_at, exit_code)
SELECT id, 1, 1, %(runner_id)s, gen_random_uuid(), 'succeeded', started_at,
       started_at + interval '1 hour', finished_at, 0
  FROM j
"""

INSERT_QUEUED = """
INSERT INTO jobs (project_id, pool_id, state, command, submitted_by)
SELECT (%(project_ids)s::bigint[])[1 + g %% cardinality(%(project_ids)s::bigint[])],
       %(pool_id)s, 'queued', ARRAY['true'], 'bench'
  FROM generate_series(1, %(jobs)s::bigint) AS g
"""

COUNT_QUEUED = "SELECT count(*) AS n FROM jobs WHERE state = 'queued'"
NEWEST_QUEUED = "SELECT max(id) AS id FROM jobs WHERE state = 'queued'"


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99 and mean of durations given in seconds, in milliseconds."""
    ms = sorted(s * 1000.0 for s in seconds)
    if len(ms) < 2:
        value = ms[0] if ms else float("nan")
        return {"p50": value, "p95": value, "p99": value, "mean": value, "n": len(ms)}
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50": q[49], "p95": q[94], "p99": q[98], "mean": statistics.fmean(ms), "n": len(ms)}


def median_ms(fn: Callable[[], Any], *, times: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``times`` calls after ``warmup`` calls, milliseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000.0


def add_history(conn, *, rows: int, project_ids: list[int], pool_id: int, runner_id: int,
                progress: Callable[[str], None]) -> None:
    """Insert ``rows`` finished jobs (with attempts) in chunks of HISTORY_CHUNK."""
    for first in range(0, rows, HISTORY_CHUNK):
        last = min(rows, first + HISTORY_CHUNK) - 1
        started = time.monotonic()
        conn.execute(INSERT_HISTORY, {"project_ids": project_ids, "pool_id": pool_id,
                                      "runner_id": runner_id, "first": first, "last": last,
                                      "total": rows})
        progress(f"history rows {last + 1:,} of {rows:,} ({time.monotonic() - started:.0f} s)")


class Console:
    """The real console app on a database, signed in as a viewer through the login form."""

    def __init__(self, url: str):
        from webapp import create_app

        self._tmp = tempfile.TemporaryDirectory(prefix="pgd-bench-console-")
        settings = Settings(secret_key="bench-only-secret-key-0123456789abcdef",
                            data_dir=Path(self._tmp.name))
        self.app = create_app(settings, database_url=url, TESTING=True)
        self.client = self.app.test_client()
        page = self.client.get("/login").get_data(as_text=True)
        token = re.search(r'<meta name="csrf-token" content="([^"]+)"', page)
        response = self.client.post("/login", data={"username": CONSOLE_USER,
                                                    "password": CONSOLE_PASSWORD,
                                                    "csrf_token": token.group(1) if token else ""})
        if response.status_code != 303:
            raise RuntimeError(f"console sign-in failed: {response.status_code}")

    def get(self, path: str) -> None:
        """GET ``path``; raises unless it answers 200."""
        response = self.client.get(path)
        if response.status_code != 200:
            raise RuntimeError(f"GET {path}: {response.status_code}")

    def close(self) -> None:
        from webapp import shutdown

        shutdown(self.app)
        self._tmp.cleanup()


def measure_size(conn, console: Console, *, runner_id: int, pool_ids: list[int], claims: int,
                 lease_seconds: float) -> dict[str, Any]:
    """Everything measured at the database's current size (see module doc)."""
    out: dict[str, Any] = {}
    started = time.perf_counter()
    transitions.summarize_queue(conn)
    out["summarize_ms"] = (time.perf_counter() - started) * 1000.0
    out["overview_ms"] = median_ms(lambda: console.get("/"))
    out["queue_page_ms"] = median_ms(lambda: console.get("/queue/"))
    newest = conn.execute(NEWEST_QUEUED).fetchone()["id"]
    out["explain_ms"] = median_ms(lambda: explain.explain_job(conn, job_id=newest))
    samples = []
    for _ in range(claims):
        started = time.perf_counter()
        c = transitions.claim(conn, runner_id=runner_id, pools=pool_ids,
                              claim_token=transitions.new_claim_token(), lease_seconds=lease_seconds)
        samples.append(time.perf_counter() - started)
        if c is None:
            raise RuntimeError("latency: the claim found nothing with jobs queued")
        transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                             outcome="succeeded", exit_code=0, receipt_key=c.receipt_key)
    out["claim_ms"] = percentiles_ms(samples)
    return out


def run_history(bench: Bench, *, history: int, queued_sizes: Sequence[int], claims: int,
                progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Build one database with ``history`` finished jobs and measure at each queued size."""
    results = []
    with scratch_database(bench.server_url, "pgd_bench_latency", template=bench.template) as url:
        with db.connect(url, application_name="bench-latency") as conn:
            config.apply_config(conn, config_text(limits(1, binding=False), bench.projects),
                                actor="bench", env={})
            users.upsert_user(conn, username=CONSOLE_USER, password=CONSOLE_PASSWORD, role="viewer")
            project_ids = [r["id"] for r in conn.execute("SELECT id FROM projects ORDER BY id")]
            pool_id = conn.execute("SELECT id FROM pools WHERE name = %s", (POOL,)).fetchone()["id"]
            runner_id = transitions.register_runner(conn, name="bench-latency", pools=[POOL], slots=1)
            started = time.monotonic()
            add_history(conn, rows=history, project_ids=project_ids, pool_id=pool_id,
                        runner_id=runner_id, progress=progress)
            history_seconds = time.monotonic() - started
            console = Console(url)
            try:
                for size in sorted(queued_sizes):
                    started = time.monotonic()
                    have = conn.execute(COUNT_QUEUED).fetchone()["n"]
                    if size > have:
                        conn.execute(INSERT_QUEUED, {"project_ids": project_ids, "pool_id": pool_id,
                                                     "jobs": size - have})
                    conn.execute("VACUUM ANALYZE jobs")
                    conn.execute("VACUUM ANALYZE attempts")
                    build = time.monotonic() - started
                    figures = measure_size(conn, console, runner_id=runner_id, pool_ids=[pool_id],
                                           claims=claims, lease_seconds=bench.lease_seconds)
                    results.append({"history": history, "queued": size,
                                    "history_build_seconds": history_seconds,
                                    "queued_build_seconds": build, **figures})
                    c = figures["claim_ms"]
                    progress(f"history {history:,}, queued {size:,}: claim p50 {c['p50']:.2f} ms, "
                             f"p99 {c['p99']:.2f} ms; overview {figures['overview_ms']:.1f} ms, "
                             f"queue page {figures['queue_page_ms']:.1f} ms, "
                             f"explain {figures['explain_ms']:.1f} ms")
            finally:
                console.close()
    return results


def run(bench: Bench, *, history: int, queued_sizes: Sequence[int], claims: int,
        progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The latency figures without history and with ``history`` finished jobs."""
    results = []
    for h in dict.fromkeys((0, history)):
        results += run_history(bench, history=h, queued_sizes=queued_sizes, claims=claims,
                               progress=progress)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench latency``: the latency figures alone (see ``bench.report``)."""
    from bench import report

    return report.run_cli(list(argv or []), prog="python -m bench latency", only=[], latency=True)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
