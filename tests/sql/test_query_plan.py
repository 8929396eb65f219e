"""The claim's job selection is served by jobs_claim_idx, not a scan of the jobs table.

The SELECT is taken verbatim from pgd_claim as the database defines it (so the test follows
the function when it changes) and explained three ways: with literal ids (a custom
plan), as a prepared statement forced to a generic plan (what PL/pgSQL switches to after a
few calls), and, through auto_explain, as the plans pgd_claim itself runs. What the plans
depend on (statistics, planner settings) is pinned (tests/sql/plans.py).
"""

from __future__ import annotations

import json
import re

import pytest

from pgdispatch.sql import db, transitions

from ..variants import function_sql, variant_sql
from .plans import analyze_all, explain, pin_planner, plan_nodes, quiet_autovacuum, record_plans

PROJECTS = ("web", "api", "shop", "ops", "docs")
QUEUED_PER_PROJECT = 800
FINISHED = 20000


def claim_selection_sql(conn) -> str:
    """pgd_claim's job-selection statement, as the database defines it, with ``INTO v_job``
    removed and the candidate's ids left as ``c.project_id`` / ``c.pool_id`` for the caller
    to bind."""
    body = function_sql(conn, "pgd_claim")
    match = re.search(r"SELECT j\.\* INTO v_job\s+FROM jobs j.*?SKIP LOCKED", body, re.S)
    assert match, "pgd_claim's job selection not found: update this test with the function"
    return match.group(0).replace(" INTO v_job", "")


@pytest.fixture
def loaded(world):
    """Several projects with thousands of queued jobs and many more finished ones, analyzed;
    autovacuum off and the planner pinned (tests/sql/plans.py)."""
    quiet_autovacuum(world.conn)
    pin_planner(world.conn)
    world.apply({
        "organizations": [{"name": "acme", "max_running": 1000}],
        "pools": [{"name": "linux", "slots": 1000}, {"name": "mac", "slots": 1000}],
        "projects": [{"name": p, "organization": "acme", "pools": ["linux", "mac"]} for p in PROJECTS],
        "targets": [{"name": "production"}],
    })
    c = world.conn
    c.execute("""
        INSERT INTO jobs (project_id, pool_id, state, priority, command)
        SELECT p.id, q.id, 'queued', (g %% 7) - 3, ARRAY['make', g::text]
          FROM projects p, pools q, generate_series(1, %s) g
         WHERE q.name = CASE WHEN g %% 4 = 0 THEN 'mac' ELSE 'linux' END""", (QUEUED_PER_PROJECT,))
    c.execute("""
        INSERT INTO jobs (project_id, pool_id, state, command, attempts_made, generation,
                          started_at, finished_at, created_at)
        SELECT p.id, q.id, 'succeeded', ARRAY['make', g::text], 1, 1,
               now() - interval '1 day', now() - interval '1 day', now() - interval '2 days'
          FROM (SELECT id, row_number() OVER (ORDER BY id) - 1 AS n FROM projects) p,
               pools q, generate_series(1, %s) g
         WHERE q.name = 'linux' AND g %% %s = p.n""", (FINISHED, len(PROJECTS)))
    analyze_all(c)
    ids = {r["name"]: r["id"] for r in c.execute("SELECT id, name FROM projects")}
    pool = c.execute("SELECT id FROM pools WHERE name = 'linux'").fetchone()["id"]
    counts = c.execute("SELECT state, count(*) AS n FROM jobs GROUP BY 1 ORDER BY 1").fetchall()
    assert counts == [{"state": "queued", "n": QUEUED_PER_PROJECT * len(PROJECTS)},
                      {"state": "succeeded", "n": FINISHED}]
    return {"project_ids": ids, "pool_id": pool}


def assert_uses_claim_index(plan: dict) -> None:
    nodes = list(plan_nodes(plan))
    on_jobs = [n for n in nodes if n.get("Relation Name") == "jobs"]
    assert on_jobs, "no scan of jobs in the plan"
    for n in on_jobs:
        assert n["Node Type"] in ("Index Scan", "Index Only Scan"), json.dumps(plan, indent=1)
        assert n["Index Name"] == "jobs_claim_idx", json.dumps(plan, indent=1)
    # the index yields (priority DESC, id) order, so LIMIT 1 stops at the first unlocked row
    assert not any(n["Node Type"] in ("Sort", "Incremental Sort") for n in nodes), json.dumps(plan, indent=1)


def test_claim_selection_with_literal_ids_uses_the_claim_index(conn, loaded):
    sql = claim_selection_sql(conn)
    for project_id in loaded["project_ids"].values():
        statement = sql.replace("c.project_id", str(project_id)).replace("c.pool_id", str(loaded["pool_id"]))
        assert_uses_claim_index(explain(conn, statement))


def test_claim_selection_as_a_generic_plan_uses_the_claim_index(conn, loaded):
    statement = claim_selection_sql(conn).replace("c.project_id", "$1").replace("c.pool_id", "$2")
    conn.execute(f"PREPARE pick(bigint, bigint) AS {statement}")
    conn.execute("SET plan_cache_mode = force_generic_plan")
    project_id = loaded["project_ids"]["web"]
    assert_uses_claim_index(explain(conn, f"EXECUTE pick({project_id}, {loaded['pool_id']})"))


def test_pgd_claim_runs_its_selections_on_the_claim_index(db_url, world, loaded):
    """auto_explain, at NOTICE level, reports every statement pgd_claim runs; over more
    claims than PL/pgSQL needs to switch to a cached generic plan."""
    runner = world.runner(pools=("linux",), slots=100)
    plans = claim_plans(db_url, runner, loaded["pool_id"], complete=False)
    selections = [p for p in plans if "SKIP LOCKED" in p["Query Text"] and "FROM jobs j" in p["Query Text"]]
    assert len(selections) == 8, [p["Query Text"][:60] for p in plans]
    for p in selections:
        assert_uses_claim_index(p["Plan"])
    # the candidate query (pgd_claim_candidates, a SQL function inlined into pgd_claim's
    # statement) and its EXISTS probe must not scan the jobs table either
    candidates = [p for p in plans if "pgd_claim_candidates(" in p["Query Text"]]
    assert candidates
    for p in candidates:
        # a probe of the claim index per (project, pool), never a scan or a bitmap over the
        # project's whole history (OFFSET 0 in the EXISTS); and the project's running jobs
        # counted on the index of running jobs
        scans = [n for n in plan_nodes(p["Plan"]) if n.get("Relation Name") == "jobs"]
        assert scans and all(n["Node Type"] in ("Index Scan", "Index Only Scan")
                             and n["Index Name"] in ("jobs_claim_idx", "jobs_active_idx")
                             for n in scans), json.dumps(p["Plan"], indent=1)
        assert "jobs_claim_idx" in {n["Index Name"] for n in scans}


def test_the_check_fails_without_the_claim_index(conn, loaded):
    """With jobs_claim_idx dropped the same selection is planned some other way (a scan of
    the jobs table or another index, and a sort), and the check says so."""
    conn.execute("DROP INDEX jobs_claim_idx")
    conn.execute("ANALYZE jobs")
    statement = (claim_selection_sql(conn).replace("c.project_id", str(loaded["project_ids"]["web"]))
                 .replace("c.pool_id", str(loaded["pool_id"])))
    with pytest.raises(AssertionError):
        assert_uses_claim_index(explain(conn, statement))


def claim_plans(db_url, runner: int, pool_id: int, *, claims: int = 8, complete: bool) -> list[dict]:
    """The plans of every statement ``claims`` claims run, from auto_explain at NOTICE level
    (JSON); each claim completed after it when ``complete``."""
    with db.connect(db_url) as conn:
        plans = record_plans(conn)
        for _ in range(claims):
            c = transitions.claim(conn, runner_id=runner, pools=[pool_id],
                                  claim_token=transitions.new_claim_token(), lease_seconds=30)
            assert c is not None
            if complete:
                transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                     outcome="succeeded", receipt_key=c.receipt_key)
    return plans


def candidate_plans(db_url, runner: int, pool_id: int) -> list[dict]:
    """The candidate read's plans over 8 claims, each completed."""
    return [p for p in claim_plans(db_url, runner, pool_id, complete=True)
            if "pgd_claim_candidates(" in p["Query Text"]]


def many_owners(conn, n: int = 12500) -> None:
    """``n`` more organizations and ``n`` more pools, each with its 8 stripes of one slot
    (written directly: the trigger's split, run per row, is not what is measured): 100,000
    stripes with room of each kind; then every table analyzed again (``analyze_all``), so
    that the plans see 12,500 organizations and pools, not the few of the last analysis."""
    for table in ("organizations", "pools"):
        conn.execute(f"ALTER TABLE {table} DISABLE TRIGGER pgd_sync_stripes")
    conn.execute("INSERT INTO organizations (name, max_running) SELECT 'org' || g, 8 FROM generate_series(1, %s) g",
                 (n,))
    conn.execute("INSERT INTO pools (name, slots) SELECT 'pool' || g, 8 FROM generate_series(1, %s) g", (n,))
    conn.execute("""
        INSERT INTO capacity_stripes (kind, owner_id, stripe_no, cap)
        SELECT 'organization', o.id, g, 1 FROM organizations o, generate_series(1, 8) g
         WHERE o.name LIKE 'org%%'
        UNION ALL
        SELECT 'pool', q.id, g, 1 FROM pools q, generate_series(1, 8) g WHERE q.name LIKE 'pool%%'""")
    for table in ("organizations", "pools"):
        conn.execute(f"ALTER TABLE {table} ENABLE TRIGGER pgd_sync_stripes")
    analyze_all(conn)


def assert_probes_stripes(plan: dict) -> None:
    """Every read of capacity_stripes in ``plan`` is a probe of one owner's stripes on the
    primary key (kind, owner_id, stripe_no), not a scan of every stripe of a kind (or of the
    table) joined or hashed against the candidates."""
    scans = [n for n in plan_nodes(plan) if n.get("Relation Name") == "capacity_stripes"]
    assert scans and all(n["Node Type"] in ("Index Scan", "Index Only Scan")
                         and n["Index Name"] == "capacity_stripes_pkey"
                         and re.search(r"\(owner_id = \w+\.id\)", n.get("Index Cond", ""))
                         for n in scans), json.dumps(plan, indent=1)


def test_the_candidate_read_probes_stripes(db_url, world, loaded):
    """With 100,000 stripes with room of each kind analyzed, the candidate read probes the
    stripes of the candidate's organization and of its pool once per candidate (LIMIT 1
    OFFSET 0 in each EXISTS of pgd_claim_candidates, as in its job probe). Written as a plain
    EXISTS, the planner may make one a semi-join over every stripe of its kind (the test
    below; with the slot rows that came before the stripes that was 11 ms a claim instead of
    0.9, bench latency)."""
    world.apply({"organizations": [{"name": "acme", "max_running": 100000}],
                 "pools": [{"name": "linux", "slots": 100000}]})
    many_owners(world.conn)
    runner = world.runner(pools=("linux",), slots=100)
    candidates = candidate_plans(db_url, runner, loaded["pool_id"])
    assert candidates
    for p in candidates:
        assert_probes_stripes(p["Plan"])


def test_the_stripe_probe_check_fails_for_a_plain_exists(db_url, world, loaded):
    """The check can fail: with plain EXISTS probes (no LIMIT 1 OFFSET 0) the candidate read
    scans every organization stripe with room and merges them with the organizations, in
    every claim's plan (the custom ones and the generic one PL/pgSQL caches after five); the
    statistics and settings it is planned with are pinned (tests/sql/plans.py)."""
    world.apply({"organizations": [{"name": "acme", "max_running": 100000}],
                 "pools": [{"name": "linux", "slots": 100000}]})
    many_owners(world.conn)
    world.conn.execute(variant_sql(world.conn, "pgd_claim_candidates", [
        ("AND s.held < s.cap\n                              LIMIT 1 OFFSET 0)", "AND s.held < s.cap)"),
        ("AND s.held < s.cap\n                    LIMIT 1 OFFSET 0)", "AND s.held < s.cap)")]))
    runner = world.runner(pools=("linux",), slots=100)
    candidates = candidate_plans(db_url, runner, loaded["pool_id"])
    assert candidates
    for p in candidates:
        with pytest.raises(AssertionError):
            assert_probes_stripes(p["Plan"])


def empty_claim_buffers(conn, pool_id: int) -> int:
    """Shared buffers the candidate read of an empty claim touches (hit + read): a count."""
    rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                        "SELECT * FROM pgd_claim_candidates(%s, NULL)", ([pool_id],)).fetchone()
    plan = next(iter(rows.values()))[0]["Plan"]
    return plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)


def test_an_empty_claim_reads_as_much_with_ten_thousand_jobs_in_paused_projects(world):
    """Idle cost is flat in queue depth (issue 18): jobs waiting in a paused project are not
    looked at by an empty claim's candidate read."""
    world.setup()
    world.project("big", org="acme", pools=("linux",))
    pool_id = world.pool_ids(("linux",))[0]
    world.conn.execute("UPDATE projects SET paused_at = now(), pause_reason = 'test' "
                       "WHERE name IN ('web', 'big')")
    empty = empty_claim_buffers(world.conn, pool_id)
    project_id = world.conn.execute("SELECT id FROM projects WHERE name = 'big'").fetchone()["id"]
    world.conn.execute(
        "INSERT INTO jobs (project_id, pool_id, state, command, ready_at, submitted_by) "
        "SELECT %s, %s, 'queued', ARRAY['true'], now(), 'test' FROM generate_series(1, 10000)",
        (project_id, pool_id))
    world.conn.execute("ANALYZE jobs")
    assert empty_claim_buffers(world.conn, pool_id) <= empty + 2


def head_probe_sql(conn) -> list[str]:
    """pgd_target_head's two probes (sql/functions/claim.sql), as the database defines them,
    with the target id left as ``p_target_id`` and the priority as ``v_priority``."""
    body = function_sql(conn, "pgd_target_head")
    first = re.search(r"SELECT j\.priority, j\.id INTO v_priority, v_id\s+(FROM jobs j.*?LIMIT 1)", body, re.S)
    second = re.search(r"RETURN \((SELECT j\.id\s+FROM jobs j.*?LIMIT 1)\)", body, re.S)
    assert first and second, "pgd_target_head's probes not found: update this test with the function"
    return ["SELECT j.priority, j.id " + first.group(1), second.group(1)]


@pytest.mark.parametrize("drop_index", [False, True], ids=["real", "without the index"])
def test_the_target_head_probes_use_the_target_queue_index(conn, loaded, drop_index):
    """Thousands of queued deployments to one target among the builds: both probes of the
    head are ordered scans of jobs_target_queue_idx (no sort); without the index (a
    deliberately broken schema) the same check fails."""
    conn.execute("""
        INSERT INTO jobs (project_id, pool_id, target_id, state, priority, command)
        SELECT p.id, q.id, t.id, 'queued', (g % 3) - 1, ARRAY['deploy', g::text]
          FROM projects p, pools q, targets t, generate_series(1, 2000) g
         WHERE q.name = 'linux' AND t.name = 'production'""")
    if drop_index:
        conn.execute("DROP INDEX jobs_target_queue_idx")
    analyze_all(conn)
    target = conn.execute("SELECT id FROM targets WHERE name = 'production'").fetchone()["id"]
    failures = []
    for sql in head_probe_sql(conn):
        plan = explain(conn, sql.replace("p_target_id", str(target)).replace("v_priority", "1"))
        nodes = list(plan_nodes(plan))
        on_jobs = [n for n in nodes if n.get("Relation Name") == "jobs"]
        if not (on_jobs and all(n.get("Index Name") == "jobs_target_queue_idx" for n in on_jobs)
                and not any(n["Node Type"] in ("Sort", "Incremental Sort") for n in nodes)):
            failures.append(json.dumps(plan, indent=1))
    assert (failures != []) == drop_index, failures
