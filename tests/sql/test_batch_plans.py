"""pgd_complete_batch probes each item's attempt and job by primary key, whatever the
statistics say runs.

The plans are read through auto_explain as the function itself runs them, over more batches
than PL/pgSQL needs to switch to a cached generic plan, with statistics taken while nothing
ran and hundreds of jobs running since: the case in which a partial index of running rows
(attempts_runner_idx, jobs_active_idx) looks empty to the planner and is walked whole once
per item (sql/functions/complete.sql, the fast path's comment). What the plans depend on is
pinned (tests/sql/plans.py).
"""

from __future__ import annotations

import json

import pytest

from pgdispatch.sql import db, transitions

from ..variants import variant_sql
from .plans import analyze_all, pin_planner, plan_nodes, quiet_autovacuum, record_plans

RUNNING = 400
BATCH = 20
BATCHES = 8

# the fast path's item probes as they were, their conditions inside the OFFSET 0 subqueries
CONDITIONS_INSIDE = [
    ("SELECT a.job_id, a.runner_id, a.state, a.generation FROM attempts a\n"
     "                     WHERE a.id = x.attempt_id OFFSET 0) a",
     "SELECT a.job_id, a.runner_id, a.state, a.generation FROM attempts a\n"
     "                     WHERE a.id = x.attempt_id AND a.state = 'running'\n"
     "                       AND a.generation = x.generation OFFSET 0) a"),
    ("FROM jobs j WHERE j.id = a.job_id OFFSET 0) w",
     "FROM jobs j WHERE j.id = a.job_id AND j.state = 'running' AND j.target_id IS NULL\n"
     "                       AND j.generation = x.generation OFFSET 0) w"),
]


@pytest.fixture
def stale(world, db_url):
    """One organization, pool and project; statistics taken with nothing running, then
    RUNNING jobs claimed and left running, and BATCH * BATCHES more queued."""
    quiet_autovacuum(world.conn)
    pin_planner(world.conn)
    world.apply({"organizations": [{"name": "acme", "max_running": 10000}],
                 "pools": [{"name": "linux", "slots": 10000}],
                 "projects": [{"name": "web", "organization": "acme", "pools": ["linux"]}]})
    c = world.conn
    c.execute("""INSERT INTO jobs (project_id, pool_id, state, command)
                 SELECT p.id, q.id, 'queued', ARRAY['make', g::text]
                   FROM projects p, pools q, generate_series(1, %s) g""",
              (RUNNING + BATCH * BATCHES,))
    analyze_all(c)
    runner = world.runner(pools=("linux",), slots=10000)
    pool_id = c.execute("SELECT id FROM pools WHERE name = 'linux'").fetchone()["id"]
    with db.connect(db_url) as other:
        got = transitions.claim_batch(other, runner_id=runner, pools=[pool_id], lease_seconds=600,
                                      claim_tokens=[transitions.new_claim_token() for _ in range(RUNNING)])
    assert len(got) == RUNNING
    return {"runner": runner, "pool_id": pool_id}


def batch_plans(db_url, runner: int, pool_id: int) -> list[dict]:
    """The plans of every statement BATCHES complete_batch calls run (auto_explain, JSON),
    each after a claim_batch of BATCH jobs (not recorded)."""
    recorded: list[dict] = []
    with db.connect(db_url) as conn:
        plans = record_plans(conn)
        for _ in range(BATCHES):
            got = transitions.claim_batch(conn, runner_id=runner, pools=[pool_id], lease_seconds=600,
                                          claim_tokens=[transitions.new_claim_token() for _ in range(BATCH)])
            assert len(got) == BATCH
            plans.clear()
            answers = transitions.complete_batch(conn, items=[
                {"attempt_id": c.attempt_id, "generation": c.generation, "outcome": "succeeded",
                 "exit_code": 0, "receipt_key": c.receipt_key} for c in got])
            recorded += plans
            assert [a["status"] for a in answers] == ["recorded"] * BATCH
    return recorded


def assert_probes_by_primary_key(plans: list[dict]) -> None:
    fast = [p for p in plans if "WITH items AS MATERIALIZED" in p["Query Text"]]
    assert len(fast) == BATCHES, [p["Query Text"][:60] for p in plans]
    for p in fast:
        for table in ("attempts", "jobs"):
            scans = [n for n in plan_nodes(p["Plan"]) if n.get("Relation Name") == table]
            assert scans, json.dumps(p["Plan"], indent=1)
            assert all(n.get("Index Name") == f"{table}_pkey" for n in scans), json.dumps(p["Plan"], indent=1)


def test_the_fast_path_probes_items_by_primary_key(db_url, world, stale):
    assert_probes_by_primary_key(batch_plans(db_url, stale["runner"], stale["pool_id"]))


def test_the_check_fails_with_the_conditions_inside_the_probes(db_url, world, stale):
    """The check can fail: with the state and generation conditions inside the probes (as
    before), the plans walk the partial indexes of running rows that the statistics say are
    empty."""
    world.conn.execute(variant_sql(world.conn, "pgd_complete_batch", CONDITIONS_INSIDE))
    with pytest.raises(AssertionError):
        assert_probes_by_primary_key(batch_plans(db_url, stale["runner"], stale["pool_id"]))

