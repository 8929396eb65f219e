"""Latency at size: claim p50/p95/p99, console pages and ``jobs explain`` with many jobs.

Run it from the repository root (``python -m bench all`` runs it after the throughput
series; this runs it alone)::

    python -m bench latency [--queued-sizes 10000,100000,1000000] [--history 1000000]
                            [--latency-claims 1000] [--quick]

Two databases are built on the invocation's server and kept side by side for the whole run:
one without history and one with ``--history`` finished jobs. The history is written once,
before any queued job, as the transitions would have left it (see INSERT_HISTORY): created
evenly over the last 30 days; 92 % succeeded at the first attempt, 5 % succeeded at the
second after a failed one, 2 % failed twice, 1 % cancelled before they ran; every attempt
with its delivery receipt (about 1.06 attempts and receipts per job). It is inserted with
``INSERT ... SELECT generate_series`` in chunks of HISTORY_CHUNK jobs (one transaction
each), then ``VACUUM ANALYZE``d, as autovacuum would have done long before. Then, for each of
``--queued-sizes`` in increasing order, both databases are topped up to that many queued
no-op jobs (one organization, one pool, four projects; limits free), ``VACUUM ANALYZE``d
and checkpointed (``CHECKPOINT``, when the role is allowed to: a million-row load leaves a
checkpoint running that would otherwise fall on the first measurements), and measured
*alternately* — the same measurement on one database, then the other, the first one
rotating — so that the machine's drift falls on both alike and the ratio "with history /
without" compares figures taken seconds apart:

* claim latency — one connection per database claims ``--latency-claims`` times through
  ``pgdispatch.sql.transitions.claim``, after CLAIM_WARMUP untimed ones, in CLAIM_ROUNDS rounds
  alternating the databases (each claim completed through ``pgdispatch.sql.transitions.complete``
  before the next, untimed); p50/p95/p99 and mean of the claim calls, milliseconds;
* ``summarize_queue`` — the scheduler's queue-summary refresh the overview reads (ms);
* console overview (``GET /``) and queue page (``GET /queue/``, first page of 50) — server
  time of the real Flask app (``pgdispatch.webapp.create_app``) through its test client, signed in as a
  viewer: the request handled in-process, rendering included, no network;
* ``jobs explain`` — ``pgdispatch.sql.explain.explain_job`` (what the CLI command calls) on the newest
  queued job;
* jobs page by state (``GET /jobs/?state=failed``, the overview's link to recent failures:
  the newest 50 failed jobs, every queued job newer than they are), server time as for the
  other pages (``jobs_page_ms``; in the JSON and the progress lines, not the report's table).

Each of the last five: one warm-up call per database, then the median of 5 calls,
milliseconds. Build times are recorded (seconds; history insert and vacuum apart) with the
row counts and the database size, so that a larger history can be planned: on a 2-core
machine about 50 s per 1,000,000 history jobs when idle (100 s when busy) and 0.95 GiB of
disk per 1,000,000 (10,000,000: 9.4 GiB, about 18 minutes on a busy machine).
"""

from __future__ import annotations

import contextlib
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pgdispatch.sql import Settings, accounts, config, db, explain, transitions

from .common import POOL, Bench, config_text, limits, scratch_database

HISTORY_CHUNK = 500_000
HISTORY_DAYS = 30
CLAIM_ROUNDS = 10
CLAIM_WARMUP = 5
PAGE_TIMES = 5
CONSOLE_USER = "bench-viewer"
CONSOLE_PASSWORD = "bench-viewer-password"

# Finished history: jobs %(first)s..%(last)s of %(total)s, oldest first, created evenly over
# the last HISTORY_DAYS days, with what pgd_claim / pgd_complete write for them: per job g,
# k = g % 100 picks the outcome (k = 0: cancelled while queued, no attempt; k = 1..2: failed
# twice, max_attempts 2; k = 3..7: failed once then succeeded; else succeeded at once).
# Attempt n is claimed 1 s + 3 s * (n - 1) after the job's creation and runs 1 s; its receipt
# (key "<claim token>:complete", response as pgd_complete builds it) is written when it ends.
# Job g's id is %(first_id)s + g (given, not drawn from the identity: chunks loaded on several
# connections at once keep ids in creation order); the caller moves the identity past them
# afterwards (ADVANCE_JOB_IDS).
INSERT_HISTORY = """
WITH src AS (
    SELECT g, c.t, o.final, o.tries
      FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g,
           LATERAL (SELECT now() - make_interval(days => %(days)s)
                                   * (1 - g::float8 / %(total)s::bigint)) AS c(t),
           LATERAL (SELECT CASE WHEN g %% 100 = 0 THEN 'cancelled'
                                WHEN g %% 100 < 3 THEN 'failed' ELSE 'succeeded' END,
                           CASE WHEN g %% 100 = 0 THEN 0 WHEN g %% 100 < 8 THEN 2 ELSE 1 END
                   ) AS o(final, tries)
), j AS (
    INSERT INTO jobs (id, project_id, pool_id, state, command, submitted_by, max_attempts,
                      attempts_made, failures, generation, created_at, ready_at, started_at,
                      finished_at, last_error, cancel_requested_at, cancel_requested_by)
    OVERRIDING SYSTEM VALUE
    SELECT %(first_id)s::bigint + g, (%(project_ids)s::bigint[])[1 + g %% cardinality(%(project_ids)s::bigint[])],
           %(pool_id)s, final, ARRAY['true'], 'bench', greatest(tries, 1), tries,
           CASE WHEN final = 'failed' THEN 2 WHEN tries = 2 THEN 1 ELSE 0 END, tries,
           t, t + interval '3 seconds' * greatest(tries - 1, 0),
           CASE WHEN tries > 0 THEN t + interval '1 second' END,
           t + interval '2 seconds' + interval '3 seconds' * greatest(tries - 1, 0),
           CASE final WHEN 'failed' THEN 'exit code 1' WHEN 'cancelled' THEN 'cancelled by bench' END,
           CASE WHEN final = 'cancelled' THEN t + interval '2 seconds' END,
           CASE WHEN final = 'cancelled' THEN 'bench' END
      FROM src
    RETURNING id, state, attempts_made, created_at
), a AS (
    INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                          claimed_at, lease_expires_at, last_heartbeat_at, finished_at, exit_code)
    SELECT j.id, n, n, %(runner_id)s, gen_random_uuid(),
           CASE WHEN n < j.attempts_made OR j.state = 'failed' THEN 'failed' ELSE 'succeeded' END,
           s.claimed, s.claimed + interval '30 seconds', s.claimed, s.claimed + interval '1 second',
           CASE WHEN n < j.attempts_made OR j.state = 'failed' THEN 1 ELSE 0 END
      FROM j, generate_series(1, j.attempts_made) AS n,
           LATERAL (SELECT j.created_at + interval '1 second' + interval '3 seconds' * (n - 1)) AS s(claimed)
    RETURNING id, job_id, attempt_no, claim_token, state, finished_at
)
INSERT INTO delivery_receipts (key, attempt_id, outcome, response, created_at)
SELECT a.claim_token::text || ':complete', a.id, a.state,
       jsonb_build_object('status', 'recorded', 'job_id', a.job_id, 'attempt_id', a.id,
                          'job_state', r.job_state, 'attempt_state', a.state,
                          'is_late_report', false, 'ready_at', r.ready_at, 'repeated', false),
       a.finished_at
  FROM a JOIN j ON j.id = a.job_id,
       LATERAL (SELECT CASE WHEN a.attempt_no < j.attempts_made THEN 'queued' ELSE j.state END,
                       CASE WHEN a.attempt_no < j.attempts_made THEN a.finished_at + interval '1 second'
                            ELSE j.created_at + interval '3 seconds' * (j.attempts_made - 1) END
               ) AS r(job_state, ready_at)
"""

# Queued no-op jobs as pgd_submit writes them: every other column takes its default.
INSERT_QUEUED = """
INSERT INTO jobs (project_id, pool_id, state, command, submitted_by)
SELECT (%(project_ids)s::bigint[])[1 + g %% cardinality(%(project_ids)s::bigint[])],
       %(pool_id)s, 'queued', ARRAY['true'], 'bench'
  FROM generate_series(1, %(jobs)s::bigint) AS g
"""

# The first id a bulk load may give (ids above every job's and the identity's last value),
# and the identity moved past the ids a load gave.
NEXT_JOB_ID = """
SELECT greatest((SELECT max(id) FROM jobs),
                (SELECT last_value FROM pg_sequences
                  WHERE schemaname = current_schema() AND sequencename = 'jobs_id_seq'), 0) + 1 AS id
"""
ADVANCE_JOB_IDS = "SELECT setval(pg_get_serial_sequence('jobs', 'id'), max(id)) FROM jobs"
COUNT_QUEUED = "SELECT count(*) AS n FROM jobs WHERE state = 'queued'"
NEWEST_QUEUED = "SELECT max(id) AS id FROM jobs WHERE state = 'queued'"
ROW_COUNTS = """
SELECT (SELECT count(*) FROM jobs) AS jobs, (SELECT count(*) FROM attempts) AS attempts,
       (SELECT count(*) FROM delivery_receipts) AS delivery_receipts,
       pg_database_size(current_database()) AS database_bytes
"""
DATABASE_BYTES = "SELECT pg_database_size(current_database()) AS database_bytes"
MAY_CHECKPOINT = """
SELECT rolsuper OR pg_has_role(current_user, 'pg_checkpoint', 'MEMBER') AS ok
  FROM pg_roles WHERE rolname = current_user
"""
VACUUMED = ("jobs", "attempts", "delivery_receipts")


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99 and mean of durations given in seconds, in milliseconds."""
    ms = sorted(s * 1000.0 for s in seconds)
    if len(ms) < 2:
        value = ms[0] if ms else float("nan")
        return {"p50": value, "p95": value, "p99": value, "mean": value, "n": len(ms)}
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50": q[49], "p95": q[94], "p99": q[98], "mean": statistics.fmean(ms), "n": len(ms)}


def add_history(conn, *, rows: int, project_ids: list[int], pool_id: int, runner_id: int,
                progress: Callable[[str], None], chunk: int = HISTORY_CHUNK) -> None:
    """Insert ``rows`` finished jobs with their attempts and delivery receipts (see
    INSERT_HISTORY), ``chunk`` jobs per statement, each statement its own transaction."""
    started = time.monotonic()
    first_id = conn.execute(NEXT_JOB_ID).fetchone()["id"]
    for first in range(0, rows, chunk):
        last = min(rows, first + chunk) - 1
        conn.execute(INSERT_HISTORY, {"project_ids": project_ids, "pool_id": pool_id,
                                      "runner_id": runner_id, "first": first, "last": last,
                                      "total": rows, "days": HISTORY_DAYS, "first_id": first_id})
        progress(f"history jobs {last + 1:,} of {rows:,} ({time.monotonic() - started:.0f} s)")
    conn.execute(ADVANCE_JOB_IDS)


def vacuum(conn, tables: Sequence[str] = VACUUMED) -> float:
    """``VACUUM ANALYZE`` each of ``tables``, then ``CHECKPOINT`` when the role may (so that
    the measurements after a bulk load do not share the disk with the checkpoint its WAL
    triggers); returns the seconds it took."""
    started = time.monotonic()
    for table in tables:
        conn.execute(f"VACUUM ANALYZE {table}")
    if conn.execute(MAY_CHECKPOINT).fetchone()["ok"]:
        conn.execute("CHECKPOINT")
    return time.monotonic() - started


class Console:
    """The real console app on a database, signed in as a viewer through the login form."""

    def __init__(self, url: str):
        from pgdispatch.webapp import create_app

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
        from pgdispatch.webapp import shutdown

        shutdown(self.app)
        self._tmp.cleanup()


@dataclass
class Database:
    """One measured database: its history size, connection, console and bench rows."""

    history: int
    url: str
    conn: Any
    console: Console | None
    project_ids: list[int]
    pool_id: int
    runner_id: int
    build: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def history_database(bench: Bench, *, history: int,
                     progress: Callable[[str], None]) -> Iterator[Database]:
    """A scratch database with the bench configuration, a viewer account, a live runner and
    ``history`` finished jobs (vacuumed); dropped on exit. Build times in ``.build``."""
    with scratch_database(bench.server_url, "pgd_bench_latency", template=bench.template) as url, \
            db.connect(url, application_name="bench-latency") as conn:
        config.apply_config(conn, config_text(limits(1, binding=False), bench.projects),
                            actor="bench", env={})
        accounts.upsert_user(conn, username=CONSOLE_USER, password=CONSOLE_PASSWORD, role="viewer")
        project_ids = [r["id"] for r in conn.execute("SELECT id FROM projects ORDER BY id")]
        pool_id = conn.execute("SELECT id FROM pools WHERE name = %s", (POOL,)).fetchone()["id"]
        # the history's attempts ran on a scheduler long gone; the bench claims as a live one
        old_runner = transitions.register_runner(conn, name="bench-history", pools=[POOL], slots=1)
        transitions.stop_runner(conn, runner_id=old_runner)
        runner_id = transitions.register_runner(conn, name="bench-latency", pools=[POOL], slots=1)
        started = time.monotonic()
        add_history(conn, rows=history, project_ids=project_ids, pool_id=pool_id,
                    runner_id=old_runner, progress=progress)
        inserted = time.monotonic() - started
        vacuumed = vacuum(conn) if history else 0.0
        counts = conn.execute(ROW_COUNTS).fetchone()
        build = {"history_build_seconds": inserted + vacuumed, "history_insert_seconds": inserted,
                 "history_vacuum_seconds": vacuumed,
                 "history_rows": {k: counts[k] for k in ("jobs", "attempts", "delivery_receipts")},
                 "history_database_bytes": counts["database_bytes"]}
        if history:
            progress(f"history {history:,}: {counts['jobs']:,} jobs, {counts['attempts']:,} attempts, "
                     f"{counts['delivery_receipts']:,} receipts in {inserted:.0f} s + vacuum "
                     f"{vacuumed:.0f} s; database {counts['database_bytes'] / 2**30:.2f} GiB")
        target = Database(history=history, url=url, conn=conn, console=None,
                          project_ids=project_ids, pool_id=pool_id, runner_id=runner_id,
                          build=build)
        target.console = Console(url)
        try:
            yield target
        finally:
            target.console.close()


def fill_queue(d: Database, size: int) -> dict[str, Any]:
    """Top ``d`` up to ``size`` queued jobs and vacuum it; the seconds each step took."""
    started = time.monotonic()
    have = d.conn.execute(COUNT_QUEUED).fetchone()["n"]
    if size > have:
        d.conn.execute(INSERT_QUEUED, {"project_ids": d.project_ids, "pool_id": d.pool_id,
                                       "jobs": size - have})
    inserted = time.monotonic() - started
    vacuumed = vacuum(d.conn)
    transitions.beat_runner(d.conn, runner_id=d.runner_id)
    return {"queued_build_seconds": inserted + vacuumed, "queued_insert_seconds": inserted,
            "queued_vacuum_seconds": vacuumed,
            "database_bytes": d.conn.execute(DATABASE_BYTES).fetchone()["database_bytes"]}


def _rotated(items: Sequence[Any], k: int) -> list[Any]:
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def alternated_ms(dbs: Sequence[Database], fn: Callable[[Database], Any], *,
                  times: int = PAGE_TIMES) -> list[float]:
    """Median wall time of ``fn(d)`` for each of ``dbs`` (milliseconds), the calls
    interleaved across the databases: one warm-up each, then ``times`` rounds, each calling
    every database once, the first one rotating."""
    samples: list[list[float]] = [[] for _ in dbs]
    for d in dbs:
        fn(d)
    for r in range(times):
        for i in _rotated(range(len(dbs)), r):
            started = time.perf_counter()
            fn(dbs[i])
            samples[i].append(time.perf_counter() - started)
    return [statistics.median(s) * 1000.0 for s in samples]


def claim_once(d: Database, lease_seconds: float) -> float:
    """Time one claim on ``d`` (seconds), then complete it (untimed)."""
    started = time.perf_counter()
    c = transitions.claim(d.conn, runner_id=d.runner_id, pools=[d.pool_id],
                          claim_token=transitions.new_claim_token(), lease_seconds=lease_seconds)
    elapsed = time.perf_counter() - started
    if c is None:
        raise RuntimeError("latency: the claim found nothing with jobs queued")
    transitions.complete(d.conn, attempt_id=c.attempt_id, generation=c.generation,
                         outcome="succeeded", exit_code=0, receipt_key=c.receipt_key)
    return elapsed


def alternated_claims(dbs: Sequence[Database], *, claims: int, lease_seconds: float,
                      rounds: int = CLAIM_ROUNDS) -> list[list[float]]:
    """``claims`` timed claims per database (seconds each), after CLAIM_WARMUP untimed ones,
    in ``rounds`` rounds that take turns between the databases (the first one rotating)."""
    samples: list[list[float]] = [[] for _ in dbs]
    for d in dbs:  # the session's first calls plan the claim functions: not what is measured
        for _ in range(CLAIM_WARMUP):
            claim_once(d, lease_seconds)
    rounds = max(1, min(rounds, claims))
    for r in range(rounds):
        n = claims // rounds + (1 if r < claims % rounds else 0)
        for i in _rotated(range(len(dbs)), r):
            samples[i] += [claim_once(dbs[i], lease_seconds) for _ in range(n)]
    return samples


def measure_size(dbs: Sequence[Database], *, claims: int,
                 lease_seconds: float) -> list[dict[str, Any]]:
    """Everything measured at the databases' current size (see module doc), one dict per
    database, in the order of ``dbs``."""
    newest = {id(d): d.conn.execute(NEWEST_QUEUED).fetchone()["id"] for d in dbs}
    figures: list[dict[str, Any]] = [{} for _ in dbs]
    measured = {
        "summarize_ms": lambda d: transitions.summarize_queue(d.conn),
        "overview_ms": lambda d: d.console.get("/"),
        "queue_page_ms": lambda d: d.console.get("/queue/"),
        "explain_ms": lambda d: explain.explain_job(d.conn, job_id=newest[id(d)]),
        "jobs_page_ms": lambda d: d.console.get("/jobs/?state=failed"),
    }
    for key, fn in measured.items():
        for out, ms in zip(figures, alternated_ms(dbs, fn)):
            out[key] = ms
    for out, samples in zip(figures, alternated_claims(dbs, claims=claims,
                                                       lease_seconds=lease_seconds)):
        out["claim_ms"] = percentiles_ms(samples)
    return figures


def run(bench: Bench, *, history: int, queued_sizes: Sequence[int], claims: int,
        progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The latency figures without history and with ``history`` finished jobs, measured
    alternately on the two databases at each queued size (see module doc). One row per
    (history, queued size); rows with history also carry ``claim_vs_no_history``, their
    claim p50/p95/p99 divided by the database without history's at the same size."""
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        dbs = [stack.enter_context(history_database(bench, history=h, progress=progress))
               for h in dict.fromkeys((0, history))]
        for size in sorted(queued_sizes):
            builds = [fill_queue(d, size) for d in dbs]
            for d, build in zip(dbs, builds):
                progress(f"history {d.history:,}, queued {size:,}: built in "
                         f"{build['queued_build_seconds']:.0f} s")
            rows = measure_size(dbs, claims=claims, lease_seconds=bench.lease_seconds)
            base = rows[0]["claim_ms"]
            for d, build, figures in zip(dbs, builds, rows):
                row = {"history": d.history, "queued": size, **d.build, **build, **figures}
                if d.history:
                    row["claim_vs_no_history"] = {q: figures["claim_ms"][q] / base[q]
                                                  for q in ("p50", "p95", "p99")}
                results.append(row)
                c = figures["claim_ms"]
                ratio = (f" ({row['claim_vs_no_history']['p50']:.2f}x / "
                         f"{row['claim_vs_no_history']['p99']:.2f}x without history)"
                         if d.history else "")
                progress(f"history {d.history:,}, queued {size:,}: claim p50 {c['p50']:.2f} ms, "
                         f"p99 {c['p99']:.2f} ms{ratio}; summarize {figures['summarize_ms']:.1f} ms, "
                         f"overview {figures['overview_ms']:.1f} ms, "
                         f"queue page {figures['queue_page_ms']:.1f} ms, "
                         f"explain {figures['explain_ms']:.1f} ms, "
                         f"jobs page (failed) {figures['jobs_page_ms']:.1f} ms")
    return results
