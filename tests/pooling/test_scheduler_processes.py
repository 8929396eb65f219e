"""Real scheduler processes behind PgBouncer in transaction pooling (issue 16: 4 schedulers
behind the pooler recorded 116 and 174 of 1,000 succeeded jobs as failed).

Four ``python -m pgdispatch scheduler --pool linux --pool deploy --slots 4 --no-listen``
processes, DATABASE_URL through a PgBouncer with three server connections that all their
pools share, run builds and deployments with ``max_attempts = 1`` through limits that bind
(organizations of 5 and 4, a project bound of 3, a pool of 8 slots, four targets): one build
and deployment in ten exits 1, a few sleep past several heartbeats. Four slots each, so that
claim rounds take batches (claim_batch) and reports meet in complete_batch. Afterwards, from
the database alone, with the checkers tests/concurrency uses over the whole history:

* every job ended with its true outcome: ``true`` and ``sleep`` succeeded, ``false``
  failed, each in exactly one attempt whose exit code says so, and the sleepers heartbeated;
* tests/faults/consistency (history and cross-table facts) and tests/faults/invariants
  (every invariant) find nothing; the most attempts holding each organization, project,
  pool and target at once (tests/concurrency/harness.max_overlaps) reach no more than its
  limit, and a watcher sampling while they ran saw none over it.

That the checkers can fail is shown where they live (tests/faults/test_invariants.py,
tests/concurrency). The same run with ``PGDISPATCH_PREPARE_THRESHOLD=0`` used to fail here
(commands that exited 0 recorded failed, deployments left uncertain); since a report is sent
again after any error that is not the database's answer (scheduler/reporting.py), the
schedulers mostly recover from the statements the pooler mixes up, so that run no longer
fails reliably: the mix-ups themselves are shown deterministically in test_pgbouncer.py,
test_console.py and test_cli.py.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from pgdispatch.sql import transitions

from ..concurrency import processes
from ..concurrency.harness import Watcher, limits, max_overlaps
from ..faults import consistency
from ..faults.invariants import check_invariants

SCHEDULERS = 4
SLOTS = 4
BUILDS = 240
DEPLOYMENTS = 40
SLEEPERS = 6
FAIL_EVERY = 10
TARGETS = ("production", "staging", "eu", "us")
DEADLINE_S = 120.0


def build_world(world) -> None:
    """acme (5: web bounded at 3, api) and globex (4: ops) on pools linux (8) and deploy (4)."""
    world.apply({
        "organizations": [{"name": "acme", "max_running": 5},
                          {"name": "globex", "max_running": 4}],
        "pools": [{"name": "linux", "slots": 8}, {"name": "deploy", "slots": 4}],
        "projects": [
            {"name": "web", "organization": "acme", "pools": ["linux", "deploy"], "max_running": 3},
            {"name": "api", "organization": "acme", "pools": ["linux", "deploy"]},
            {"name": "ops", "organization": "globex", "pools": ["linux", "deploy"]},
        ],
        "targets": [{"name": t} for t in TARGETS],
    })


def submit_jobs(conn, *, builds: int, deployments: int, sleepers: int) -> None:
    projects = ("web", "api", "ops")
    with conn.transaction():
        for i in range(builds):
            command = ["false"] if i % FAIL_EVERY == 0 else ["true"]
            transitions.submit(conn, project=projects[i % 3], pool="linux", command=command)
        for i in range(deployments):
            command = ["false"] if i % FAIL_EVERY == 0 else ["true"]
            transitions.submit(conn, project=projects[i % 3], pool="deploy", command=command,
                               target=TARGETS[i % len(TARGETS)])
        for i in range(sleepers):
            transitions.submit(conn, project=projects[i % 3], pool="linux", command=["sleep", "1.2"])


@dataclasses.dataclass
class Run:
    """What a run left: its scheduler logs and exit codes, whether every job ended in time,
    and the watcher's samples and violations."""

    logs: str
    exit_codes: list[int | None]
    finished: bool
    samples: int
    violations: list[str]


def run_schedulers(world, db_url: str, pooled_url: str, tmp_path: Path, *,
                   env_extra: dict[str, str] | None = None, deadline_s: float = DEADLINE_S) -> Run:
    """Start the schedulers on ``pooled_url``, wait until every job ended (or ``deadline_s``
    passed, or a scheduler exited), then SIGTERM them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=pooled_url, PGDISPATCH_LEASE_SECONDS="5",
               PGDISPATCH_HEARTBEAT_SECONDS="0.4", PGDISPATCH_CLAIM_INTERVAL_SECONDS="0.2", PGDISPATCH_CLAIM_IDLE_CAP_SECONDS="1",
               PGDISPATCH_EXPIRE_INTERVAL_SECONDS="0.5", PGDISPATCH_SUMMARY_INTERVAL_SECONDS="2",
               PGDISPATCH_RUNNER_BEAT_SECONDS="1", PGDISPATCH_DUTY_LEASE_SECONDS="3",
               PGDISPATCH_DATA_DIR=str(tmp_path / "data"), **(env_extra or {}))
    procs = processes.start_schedulers(env, tmp_path, SCHEDULERS, lambda i: [
        "--pool", "linux", "--pool", "deploy", "--slots", str(SLOTS), "--no-listen",
        "--name", f"pooled-{i}"])
    finished = False
    try:
        with Watcher(db_url, interval_s=0.05) as watcher:
            deadline = time.monotonic() + deadline_s
            while time.monotonic() < deadline:
                if not world.conn.execute("SELECT count(*) AS n FROM jobs WHERE finished_at IS NULL"
                                          ).fetchone()["n"]:
                    finished = True
                    break
                if any(p.poll() is not None for p, _ in procs):
                    break
                time.sleep(0.2)
    finally:
        exit_codes = processes.stop(procs)
    return Run(processes.logs(procs), exit_codes, finished, watcher.samples, watcher.violations)


def untrue_outcomes(conn) -> list[str]:
    """Every job whose end does not match what its command did: a job not in exactly one
    attempt, a state other than its command's (``false`` failed, else succeeded), an exit
    code that disagrees, a sleeper that never heartbeated."""
    return [r["what"] for r in conn.execute("""
        SELECT format('job %s (%s): %s, %s attempts, exit codes %s, heartbeats %s', j.id,
                      array_to_string(j.command, ' '), j.state, count(a.id),
                      array_agg(a.exit_code), count(a.last_heartbeat_at)) AS what
          FROM jobs j LEFT JOIN attempts a ON a.job_id = j.id
         GROUP BY j.id
        HAVING count(a.id) <> 1
            OR j.state <> CASE WHEN j.command = ARRAY['false'] THEN 'failed' ELSE 'succeeded' END
            OR min(a.exit_code) IS DISTINCT FROM CASE WHEN j.command = ARRAY['false'] THEN 1 ELSE 0 END
            OR (j.command[1] = 'sleep' AND count(a.last_heartbeat_at) = 0)
         ORDER BY j.id""")]


def test_four_scheduler_processes_behind_the_pooler_record_every_true_outcome(
        world, db_url, pooler, tmp_path):
    build_world(world)
    submit_jobs(world.conn, builds=BUILDS, deployments=DEPLOYMENTS, sleepers=SLEEPERS)
    started = time.monotonic()
    run = run_schedulers(world, db_url, pooler.url(db_url), tmp_path)
    elapsed = time.monotonic() - started
    assert run.finished, f"jobs left after {DEADLINE_S} s\n{run.logs}"
    assert run.exit_codes == [0] * SCHEDULERS, run.logs
    c = world.conn
    span = c.execute("SELECT count(*) AS attempts, count(DISTINCT runner_id) AS runners "
                     "FROM attempts").fetchone()
    print(f"\n{BUILDS + DEPLOYMENTS + SLEEPERS} jobs through PgBouncer by {SCHEDULERS} scheduler "
          f"processes in {elapsed:.1f} s wall; {run.samples} watcher samples")
    assert untrue_outcomes(c) == []
    assert span["attempts"] == BUILDS + DEPLOYMENTS + SLEEPERS
    assert c.execute("SELECT count(*) AS n FROM delivery_receipts").fetchone()["n"] == span["attempts"]
    assert consistency.history_violations(c) == []
    assert consistency.violations(c) == []
    assert check_invariants(c) == []
    assert run.samples >= 10 and run.violations == []
    lims = limits(c)
    overlaps = max_overlaps(c)
    assert {k: v for k, v in overlaps.items() if k in lims and v > lims[k]} == {}, overlaps
    # the limits bind: each organization and the bounded project is filled to its limit
    assert [overlaps[("organization", o)] for o in ("acme", "globex")] == [5, 4], overlaps
    assert overlaps[("project", "web")] == 3, overlaps
    assert span["runners"] == SCHEDULERS
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
