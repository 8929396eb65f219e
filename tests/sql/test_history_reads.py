"""Finished history stays out of the console's reads: the overview's counts and the jobs page
by state read index ranges bounded by what they show, however many finished jobs there are
(migrations/0005_history.sql; docs/benchmarks.md, "Latency at size")."""

from __future__ import annotations

import json
import re

import pytest

from pgdispatch.sql import migrate, reads, transitions

from .plans import analyze_all, explain, pin_planner, plan_nodes, quiet_autovacuum

QUEUED = 3000
FINISHED = 30000

# Committed, not rolled back (tests/conftest.py): the plans follow the statistics, and an
# ANALYZE writes a table's row count in place, outside the transaction, where autovacuum of
# the shared database (woken by earlier tests' rolled-back rows) may overwrite it mid-test.
pytestmark = pytest.mark.own_database


def statement(name: str) -> str:
    """The named statement of sql/jobs.sql, its :parameters left in place."""
    text = (migrate.MIGRATIONS_DIR.parent / "jobs.sql").read_text()
    match = re.search(rf"-- name: {name}\n(?:--[^\n]*\n)*(.*?;)", text, re.S)
    assert match, f"{name} not found in sql/jobs.sql"
    return match.group(1).rstrip(";")


@pytest.fixture
def history(world):
    """Queued jobs newer than many finished ones (1 % failed, 1 % cancelled), analyzed;
    autovacuum off and the planner pinned (tests/sql/plans.py)."""
    world.setup()
    c = world.conn
    quiet_autovacuum(c)
    pin_planner(c)
    project, pool = c.execute("SELECT p.id AS p, q.id AS q FROM projects p, pools q "
                              "WHERE p.name = 'web' AND q.name = 'linux'").fetchone().values()
    c.execute("""
        INSERT INTO jobs (project_id, pool_id, state, command, created_at, finished_at)
        SELECT %(p)s, %(q)s, s.state, ARRAY['true'], now() - interval '2 days',
               now() - interval '2 days' + g * interval '1 second'
          FROM generate_series(1, %(n)s) g,
               LATERAL (SELECT CASE g %% 100 WHEN 0 THEN 'failed' WHEN 1 THEN 'cancelled'
                                             ELSE 'succeeded' END) s(state)""",
              {"p": project, "q": pool, "n": FINISHED})
    c.execute("INSERT INTO jobs (project_id, pool_id, state, command) "
              "SELECT %s, %s, 'queued', ARRAY['true'] FROM generate_series(1, %s)",
              (project, pool, QUEUED))
    analyze_all(c)
    return {"project_id": project, "pool_id": pool}


def is_bounded_range(node: dict) -> bool:
    """``node`` reads jobs as an index range bounded by the state (running or uncertain) or by
    the last hour of finished jobs, never the whole table or the whole history."""
    if node["Node Type"] not in ("Index Scan", "Index Only Scan"):
        return False
    cond = node.get("Index Cond", "")
    return (node["Index Name"] == "jobs_active_idx"
            or (node["Index Name"] == "jobs_state_idx"
                and re.fullmatch(r"\(state = '(running|uncertain)'::text\)", cond) is not None)
            or (node["Index Name"] == "jobs_finished_idx" and cond.startswith("(finished_at > ")))


def assert_one_range_of_the_state_index(plan: dict) -> None:
    nodes = list(plan_nodes(plan))
    on_jobs = [n for n in nodes if n.get("Relation Name") == "jobs"]
    assert [(n["Node Type"], n.get("Index Name"), n.get("Scan Direction")) for n in on_jobs] == [
        ("Index Scan", "jobs_state_idx", "Backward")], json.dumps(plan, indent=1)
    assert not any("Sort" in n["Node Type"] for n in nodes), json.dumps(plan, indent=1)


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_jobs_in_one_state_read_one_range_of_the_state_index(conn, history, plan_cache_mode):
    """Custom plans (the first calls of a connection) and the generic plan a prepared
    statement may switch to; rare states (1 %) and common ones, at the top and deep down."""
    sql = (statement("list_recent_jobs_in_state").replace(":state", "$1")
           .replace(":before_id", "$2").replace(":limit", "$3"))
    conn.execute(f"PREPARE recent(text, bigint, bigint) AS {sql}")
    conn.execute(f"SET plan_cache_mode = {plan_cache_mode}")
    for state, before_id in (("failed", 2**63 - 1), ("cancelled", 2**63 - 1), ("succeeded", 2**63 - 1),
                             ("cancelled", FINISHED // 2), ("queued", 2**63 - 1)):
        assert_one_range_of_the_state_index(explain(conn, f"EXECUTE recent('{state}', {before_id}, 50)"))


def test_jobs_in_one_state_newest_first_and_paged(conn, history):
    first = reads.list_recent_jobs(conn, state="failed", limit=50)
    assert len(first) == 50 and {j["state"] for j in first} == {"failed"}
    ids = [j["id"] for j in first]
    assert ids == sorted(ids, reverse=True)
    older = reads.list_recent_jobs(conn, state="failed", limit=50, before_id=ids[-1])
    assert older and older[0]["id"] < ids[-1] and {j["state"] for j in older} == {"failed"}
    assert [j["state"] for j in reads.list_recent_jobs(conn, limit=3)] == ["queued"] * 3


def test_the_overview_counts_come_from_the_summary_and_bounded_ranges(conn, world, history):
    runner = world.runner(slots=2)
    claim = world.claim(runner)
    world.complete(claim)                      # succeeded now: counted in the last hour
    world.claim(runner)                        # running
    world.job(requires_approval=True)          # blocked
    transitions.summarize_queue(conn)
    counts = reads.overview(conn)["jobs_by_state"]
    assert counts == {"blocked": 1, "queued": QUEUED - 2, "running": 1, "uncertain": 0,
                      "succeeded": 1, "failed": 0, "cancelled": 0, "superseded": 0}
    plan = explain(conn, statement("count_recent_jobs_by_state"))
    scans = [n for n in plan_nodes(plan) if n.get("Relation Name") == "jobs"]
    # every read of jobs is one bounded index range: the running and uncertain jobs (the
    # partial jobs_active_idx, or the state's range of jobs_state_idx: which one is the
    # planner's choice, by the visibility map), the last hour of jobs_finished_idx
    assert scans and all(is_bounded_range(n) for n in scans), json.dumps(plan, indent=1)
    assert "jobs_finished_idx" in {n["Index Name"] for n in scans}, json.dumps(plan, indent=1)


def test_exact_counts_by_state_still_count_every_state(conn, world, history):
    """count_jobs_by_state (the demo's throttle) stays exact: every active state counted,
    finished ones over the last hour."""
    runner = world.runner(slots=2)
    world.complete(world.claim(runner))
    world.claim(runner)
    counts = {r["state"]: r["n"] for r in conn.execute(statement("count_jobs_by_state"))}
    assert counts == {"blocked": 0, "queued": QUEUED - 2, "running": 1, "uncertain": 0,
                      "succeeded": 1, "failed": 0, "cancelled": 0, "superseded": 0}


def test_job_lists_in_one_state_read_ranges_of_the_state_index(conn, history):
    """reads.list_jobs by state (the Jobs page, the holder links, `jobs list --state`): each
    direction one range of jobs_state_idx, however deep the history, for rare states and
    for the queue, with the other filters unset or set. Planned with its values, prepared or
    not (begin_job_list: a generic plan reads a whole state's range and sorts it)."""
    with conn.transaction():
        reads.list_jobs(conn, state="failed", limit=1)
        assert conn.execute("SHOW plan_cache_mode").fetchone()["plan_cache_mode"] == "force_custom_plan"
    sql = statement("list_jobs")
    names = list(dict.fromkeys(re.findall(r"(?<!:):(\w+)", sql)))
    types = {"state": "text", "older_than_seconds": "float8", "younger_than_seconds": "float8",
             "project_ids": "bigint[]", "upper_at": "timestamptz", "lower_at": "timestamptz"}
    for i, name in enumerate(names, 1):
        sql = re.sub(rf"(?<!:):{name}\b", f"${i}", sql)
    conn.execute(f"PREPARE jobs_in_state({', '.join(types.get(n, 'bigint') for n in names)}) AS {sql}")
    conn.execute("SET plan_cache_mode = force_custom_plan")
    for state, after_id, project in (("failed", None, None), ("cancelled", None, history["project_id"]),
                                     ("succeeded", None, None), ("running", None, None),
                                     ("queued", None, None), ("failed", 0, None)):
        values = {"state": f"'{state}'", "before_id": str(2**63 - 1), "limit": "50",
                  "after_id": "NULL" if after_id is None else str(after_id),
                  "project_ids": "NULL" if project is None else f"ARRAY[{project}]::bigint[]"}
        args = ", ".join(values.get(n, "NULL") for n in names)
        plan = explain(conn, f"EXECUTE jobs_in_state({args})")
        # jobs_pkey: the page's own rows, looked up by id; a Bitmap Heap Scan (the range read
        # whole, then sorted) has no index name
        on_jobs = [n for n in plan_nodes(plan) if n.get("Relation Name") == "jobs"
                   and n.get("Index Name") != "jobs_pkey"]
        assert on_jobs and all(n.get("Index Name") == "jobs_state_idx" for n in on_jobs), (
            state, json.dumps(plan, indent=1))
