"""Claim uniqueness under load with real scheduler processes (issue 3).

Six ``python -m pgdispatch scheduler --pool linux --slots 3`` processes (18 runner slots)
drain 1,500 short jobs through limits that bind: organizations of 5, a project bound of 3
and a pool of 8 slots; one job in ten fails its first attempt and is retried. Afterwards,
from the database alone:

* every job ended exactly once (one successful attempt; the retried ones after exactly one
  failure), its attempts carry distinct generations, and no two attempts of one job
  overlapped in time (tests/faults/consistency.history_violations);
* the most attempts holding each organization, project and pool at once, swept from the
  attempts' ``[claimed_at, finished_at)`` intervals (tests/concurrency/harness.max_overlaps),
  equals its limit — reached, never exceeded — and a watcher sampling the organizations' and
  the pool's held slots (their stripes' held counts) and the projects' counters while the
  schedulers ran saw none over its limit or disagreeing with the running attempts, and the
  stripes' caps always splitting the limits;
* every stripe holds no slot and every project counter is back to 0.

The history checker is shown catching a claim that computes the next generation from a
stale read (and the sweep, in test_claim_races.py, catching over-admission).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pgdispatch.sql import db, transitions

from ..faults import consistency
from . import processes
from .harness import Watcher, attempt_shapes, limits, max_overlaps, run_together

SCHEDULERS = 6
SLOTS = 3
JOBS = int(os.environ.get("PGDISPATCH_PROCESS_LOAD_JOBS", "1500"))
RETRIED_EVERY = 10  # one job in ten fails its first attempt
DEADLINE_S = 240.0
# The tail of the run has only globex's jobs left, so its limit is reached too.
SHARES = {"web": 0.3, "api": 0.3, "ops": 0.4}
FAIL_FIRST = ["sh", "-c", '[ "$PGDISPATCH_ATTEMPT" -gt 1 ]']


def build_world(world) -> None:
    """acme (5: web bounded at 3, api unbounded) and globex (5: ops) on pool linux (8)."""
    world.apply({
        "organizations": [{"name": "acme", "max_running": 5},
                          {"name": "globex", "max_running": 5}],
        "pools": [{"name": "linux", "slots": 8}],
        "projects": [
            {"name": "web", "organization": "acme", "pools": ["linux"], "max_running": 3},
            {"name": "api", "organization": "acme", "pools": ["linux"]},
            {"name": "ops", "organization": "globex", "pools": ["linux"]},
        ],
    })


def submit_jobs(conn, n: int) -> int:
    """``n`` jobs, spread over the projects by SHARES; returns how many fail first."""
    failing = 0
    with conn.transaction():
        i = 0
        for project, share in SHARES.items():
            for _ in range(round(n * share)):
                fail_first = i % RETRIED_EVERY == 0
                failing += fail_first
                transitions.submit(conn, project=project, pool="linux",
                                   command=FAIL_FIRST if fail_first else ["true"],
                                   max_attempts=2 if fail_first else 1)
                i += 1
    return failing


def start_schedulers(db_url: str, tmp_path: Path) -> processes.Procs:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=db_url, PGDISPATCH_LEASE_SECONDS="10",
               PGDISPATCH_HEARTBEAT_SECONDS="2", PGDISPATCH_CLAIM_INTERVAL_SECONDS="0.2", PGDISPATCH_CLAIM_IDLE_CAP_SECONDS="1",
               PGDISPATCH_EXPIRE_INTERVAL_SECONDS="0.5", PGDISPATCH_SUMMARY_INTERVAL_SECONDS="2",
               PGDISPATCH_BACKOFF_BASE_SECONDS="0.1", PGDISPATCH_BACKOFF_CAP_SECONDS="0.2",
               PGDISPATCH_DATA_DIR=str(tmp_path / "data"))
    return processes.start_schedulers(env, tmp_path, SCHEDULERS, lambda i: [
        "--pool", "linux", "--slots", str(SLOTS), "--name", f"s{i}"])


def test_six_scheduler_processes_run_every_job_exactly_once_within_limits(world, db_url,
                                                                          tmp_path):
    build_world(world)
    failing = submit_jobs(world.conn, JOBS)
    procs = start_schedulers(db_url, tmp_path)
    started = time.monotonic()
    try:
        with Watcher(db_url, interval_s=0.05) as watcher:
            deadline = started + DEADLINE_S
            while world.conn.execute("SELECT count(*) AS n FROM jobs WHERE finished_at IS NULL"
                                     ).fetchone()["n"]:
                dead = [path.name for p, path in procs if p.poll() is not None]
                assert not dead, f"schedulers exited: {dead}\n{processes.logs(procs)}"
                assert time.monotonic() < deadline, f"jobs left after {DEADLINE_S} s\n{processes.logs(procs)}"
                time.sleep(0.2)
        elapsed = time.monotonic() - started
    finally:
        exit_codes = processes.stop(procs)
    assert exit_codes == [0] * SCHEDULERS, processes.logs(procs)

    c = world.conn
    span = c.execute("SELECT extract(epoch FROM max(finished_at) - min(claimed_at))::float8 AS s, "
                     "count(*) AS attempts, count(DISTINCT runner_id) AS runners "
                     "FROM attempts").fetchone()
    per_runner = [r["n"] for r in c.execute("SELECT count(*) AS n FROM attempts "
                                            "GROUP BY runner_id ORDER BY 1")]
    print(f"\n{JOBS} jobs ({failing} retried once, {span['attempts']} attempts) by "
          f"{SCHEDULERS} scheduler processes: {JOBS / span['s']:.0f} jobs/s over "
          f"{span['s']:.1f} s of database time ({elapsed:.1f} s wall, with start-up); "
          f"attempts per runner {per_runner}; {watcher.samples} watcher samples")

    # every job ended exactly once, as planned
    assert c.execute("SELECT state, count(*) AS n FROM jobs GROUP BY 1").fetchall() == [
        {"state": "succeeded", "n": JOBS}]
    assert attempt_shapes(c) == [{"states": "failed:1,succeeded:2", "n": failing},
                      {"states": "succeeded:1", "n": JOBS - failing}]
    receipts = c.execute("SELECT count(*) AS n FROM delivery_receipts").fetchone()["n"]
    assert receipts == span["attempts"]
    assert consistency.history_violations(c) == []
    # every limit reached, none exceeded, while it ran and in the attempts' intervals
    assert watcher.samples >= 20 and watcher.violations == []
    lims = {k: v for k, v in limits(c).items() if k[0] != "target"}
    overlaps = max_overlaps(c)
    assert {k: overlaps.get(k) for k in lims} == lims, overlaps
    assert consistency.violations(c) == []
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert span["runners"] == SCHEDULERS, f"some scheduler never claimed: {per_runner}"


# --- the history checker catches a claim that computes the generation from a stale read ---

STALE_GENERATION_CLAIM_SQL = """
CREATE FUNCTION pgd_claim_stale_generation(p_job_id bigint, p_runner_id bigint,
                                           p_sleep_seconds double precision)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_job     jobs%ROWTYPE;
    v_org     bigint;
    v_attempt bigint;
    v_org_stripe  smallint;
    v_pool_stripe smallint;
    v_proj_stripe smallint;
BEGIN
    -- BROKEN: the job is read without a lock and the next generation computed from that read
    SELECT * INTO v_job FROM jobs WHERE id = p_job_id AND state = 'queued';
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT organization_id INTO v_org FROM projects WHERE id = v_job.project_id;
    PERFORM pg_sleep(p_sleep_seconds);
    -- then the lock order: job, organization stripe, pool stripe, project running stripe; the
    -- capacity and the count are taken as
    -- pgd_claim takes it (a slot from a stripe with room, SKIP LOCKED; the attempt records
    -- the stripes), not what this copy gets wrong
    UPDATE jobs SET state = 'running', generation = v_job.generation + 1,
                    attempts_made = v_job.attempts_made + 1
     WHERE id = p_job_id;
    UPDATE capacity_stripes s SET held = s.held + 1
     WHERE (s.kind, s.owner_id, s.stripe_no) = (
           SELECT f.kind, f.owner_id, f.stripe_no FROM capacity_stripes f
            WHERE f.kind = 'organization' AND f.owner_id = v_org AND f.held < f.cap
            ORDER BY pgd_stripe_order(f.stripe_no) LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED)
    RETURNING s.stripe_no INTO v_org_stripe;
    UPDATE capacity_stripes s SET held = s.held + 1
     WHERE (s.kind, s.owner_id, s.stripe_no) = (
           SELECT f.kind, f.owner_id, f.stripe_no FROM capacity_stripes f
            WHERE f.kind = 'pool' AND f.owner_id = v_job.pool_id AND f.held < f.cap
            ORDER BY pgd_stripe_order(f.stripe_no) LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED)
    RETURNING s.stripe_no INTO v_pool_stripe;
    v_proj_stripe := pgd_count_running(v_job.project_id, 1);
    INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                          claimed_at, lease_expires_at, organization_stripe, pool_stripe,
                          project_stripe)
    VALUES (p_job_id, v_job.attempts_made + 1, v_job.generation + 1, p_runner_id,
            gen_random_uuid(), 'running', clock_timestamp(), clock_timestamp() + interval '30 s',
            v_org_stripe, v_pool_stripe, v_proj_stripe)
    RETURNING id INTO v_attempt;
    RETURN v_attempt;
END;
$$;
"""


def test_history_checker_catches_a_claim_with_a_stale_generation(world, db_url):
    """Two of these claims racing for one job both run it with generation 1. The database's
    own backstops (UNIQUE (job_id, attempt_no), UNIQUE (job_id, generation) and one running
    attempt per job; the slot rows' one held organization slot and one held pool slot per job
    went with them when the stripes replaced them) would refuse the second; with them dropped,
    each takes a slot from a stripe as pgd_claim does and the history checker alone reports the
    shared generation and attempt number and the overlap — and, once the first completion ends
    the job, an ended job with an attempt still running."""
    world.setup()
    runner = world.runner()
    job = world.job()
    c = world.conn
    assert consistency.history_violations(c) == []
    c.execute(STALE_GENERATION_CLAIM_SQL)
    for name in c.execute("SELECT conname FROM pg_constraint WHERE conrelid = 'attempts'::regclass "
                          "AND contype = 'u'").fetchall():
        c.execute(f"ALTER TABLE attempts DROP CONSTRAINT {name['conname']}")
    c.execute("DROP INDEX attempts_one_running_per_job")

    def claim(conn):
        return db.in_transaction(conn, lambda cc: cc.execute(
            "SELECT pgd_claim_stale_generation(%s, %s, 0.3) AS id", (job["id"], runner)
        ).fetchone()["id"], tx_name="claim_stale_generation")

    outcomes = run_together(db_url, [claim, claim])
    assert [o.error for o in outcomes] == [None, None]
    first, second = sorted(o.value for o in outcomes)
    found = consistency.history_violations(c)
    assert sorted(found) == sorted([
        f"job {job['id']}: 2 attempts share 1 generations",
        f"job {job['id']}: 2 attempts share 1 attempt numbers",
        f"job {job['id']}: attempt {first} (running) and attempt {second} overlap in time",
    ]), found
    token = c.execute("SELECT claim_token FROM attempts WHERE id = %s", (first,)).fetchone()
    transitions.complete(c, attempt_id=first, generation=1, outcome="succeeded", exit_code=0,
                         receipt_key=f"{token['claim_token']}:complete")
    found = consistency.history_violations(c)
    assert f"job {job['id']} ended succeeded with 1 succeeded and 1 running attempts" in found
