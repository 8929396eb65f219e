"""reads.list_waiting (the queue page, and the jobs list with a reason) reads only what its
filters can match: the (project, pool) pairs of its organization, project and pool filters
and of a reason that holds for a whole pair (jobs_waiting_pair_idx), or the waiting jobs that
can have a reason of their own (jobs_waiting_special_idx) — and lists exactly what a walk of
every waiting job, each judged by reasons_for, lists (docs/benchmarks.md, "Console at
scale")."""

from __future__ import annotations

import json

import pytest

from pgdispatch.sql import reads, transitions
from pgdispatch.sql.explain import REASON_CODES, read_world, reasons_for
from pgdispatch.sql.queries import Q

from .plans import analyze_all, pin_planner, plan_nodes, quiet_autovacuum

pytestmark = pytest.mark.own_database


@pytest.fixture
def queue(world):
    """Waiting jobs under every reason, in several projects, pools and targets."""
    world.apply({
        "organizations": [{"name": "acme", "max_running": 100}, {"name": "tight", "max_running": 1}],
        "pools": [{"name": n, "slots": 1 if n == "small" else 100}
                  for n in ("linux", "small", "busy", "frozen", "orphan")],
        "projects": [
            {"name": "web", "organization": "acme", "pools": ["linux", "small", "busy", "frozen", "orphan"]},
            {"name": "bounded", "organization": "acme", "pools": ["linux"], "max_running": 1},
            {"name": "solo", "organization": "tight", "pools": ["linux"]},
            {"name": "still", "organization": "acme", "pools": ["linux"]},
            {"name": "empty", "organization": "acme", "pools": ["linux"]}],
        "targets": [{"name": "prod"}, {"name": "stage"}, {"name": "canary"}],
    })
    main = world.runner(pools=("linux", "frozen"), slots=50, name="main")
    small = world.runner(pools=("small",), slots=5, name="small")
    busy = world.runner(pools=("busy",), slots=1, name="busy")
    # the holders: each the only job its claim can take
    for project, target in (("bounded", None), ("solo", None), ("web", "prod")):
        world.job(project=project, target=target)
        assert world.claim(main) is not None
    world.job(pool="small")
    assert world.claim(small, pools=("small",)) is not None
    world.job(pool="busy")
    assert world.claim(busy, pools=("busy",)) is not None
    world.job(target="canary")
    lost = world.claim(main)
    world.expire_now(lost.attempt_id)
    transitions.expire_leases(world.conn)
    upstream = world.job()["id"]
    for _ in range(3):
        world.job()
        world.job(depends_on=[upstream])
        world.job(requires_approval=True)
        world.job(delay_seconds=600)
        world.job(target="prod")
        world.job(target="stage")
        world.job(target="canary")
        world.job(project="bounded")
        world.job(project="solo")
        world.job(pool="small")
        world.job(pool="busy")
        world.job(pool="frozen")
        world.job(pool="orphan")
        world.job(project="still")
    transitions.pause_project(world.conn, project="still", reason="test", actor="test")
    transitions.pause_pool(world.conn, pool="frozen", reason="test", actor="test")
    return world


def expected(conn, *, reason=None, **filters):
    """The ids a walk of every waiting job lists: the name filters in SQL, the reason judged
    by reasons_for on each row (what list_waiting did for every filter before)."""
    world = read_world(conn)
    rows = list(Q.list_waiting_jobs(conn, after_id=0, limit=100000,
                                    **{k: filters.get(k) for k in ("organization", "project", "pool", "target")}))
    pending = {}
    blocked = [j["id"] for j in rows if j["pending_dependencies"] > 0]
    if blocked:
        for dep in Q.list_pending_dependencies_of_jobs(conn, job_ids=blocked):
            pending.setdefault(dep.pop("job_id"), []).append(dep)
    return [j["id"] for j in rows
            if reason is None or any(r.code == reason for r in reasons_for(j, world, pending.get(j["id"])))]


def listed(conn, *, limit, **kw):
    """Every page of list_waiting, followed by its cursor."""
    out, after = [], 0
    while True:
        page = reads.list_waiting(conn, after_id=after, limit=limit, **kw)
        out += [j["id"] for j in page["jobs"]]
        if page["next_after_id"] is None:
            return out
        after = page["next_after_id"]


FILTERS = [{}, {"organization": "acme"}, {"organization": "tight"}, {"project": "web"},
           {"project": "bounded"}, {"project": "empty"}, {"project": "nosuch"}, {"pool": "linux"},
           {"pool": "small"}, {"pool": "orphan"}, {"target": "prod"}, {"target": "canary"},
           {"target": "nosuch"}, {"project": "web", "pool": "small"},
           {"organization": "acme", "target": "stage"}]


def test_every_reason_and_filter_lists_what_a_walk_of_every_waiting_job_lists(conn, queue):
    reasons = {}
    for code in (None, *REASON_CODES):
        for filters in FILTERS:
            want = expected(conn, reason=code, **filters)
            for limit in (2, 50):
                assert listed(conn, limit=limit, reason=code, **filters) == want, (code, filters, limit)
            if not filters and code:
                reasons[code] = len(want)
    # the queue holds every reason (superseded deployments aside), so every source is read
    assert {c for c, n in reasons.items() if n} >= set(REASON_CODES), reasons


def test_the_filters_read_their_pairs_or_the_special_jobs(conn, queue):
    """The pair ranges of jobs_waiting_pair_idx, and jobs_waiting_special_idx, with many
    plain waiting jobs and finished ones beside them: no scan of every waiting job."""
    c = conn
    quiet_autovacuum(c)
    web, linux = c.execute("SELECT p.id AS p, q.id AS q FROM projects p, pools q "
                           "WHERE p.name = 'web' AND q.name = 'linux'").fetchone().values()
    c.execute("INSERT INTO jobs (project_id, pool_id, state, command) "
              "SELECT %s, %s, 'queued', ARRAY['true'] FROM generate_series(1, 20000)", (web, linux))
    c.execute("INSERT INTO jobs (project_id, pool_id, state, command, finished_at) "
              "SELECT %s, %s, 'succeeded', ARRAY['true'], now() FROM generate_series(1, 20000)", (web, linux))
    analyze_all(c)
    pin_planner(c)
    bounded = c.execute("SELECT id FROM projects WHERE name = 'bounded'").fetchone()["id"]

    def scans(query, **params):
        plan = c.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query.sql, params).fetchone()["QUERY PLAN"][0]["Plan"]
        nodes = list(plan_nodes(plan))
        return ([(n["Node Type"], n.get("Index Name")) for n in nodes if n.get("Relation Name") == "jobs"],
                sum(n.get("Rows Removed by Filter", 0) for n in nodes), json.dumps(plan, indent=1))

    on_jobs, removed, plan = scans(Q.list_waiting_jobs_of_pairs, project_ids=[bounded, bounded],
                                   pool_ids=[linux, linux], after_id=0, limit=200)
    # the pair ranges, then the page's rows by id
    assert {i for _, i in on_jobs} == {"jobs_waiting_pair_idx", "jobs_pkey"} and removed == 0, plan
    on_jobs, removed, plan = scans(Q.list_waiting_special_jobs, project_ids=None, pool_id=None,
                                   target_id=None, after_id=0, limit=200)
    assert {i for _, i in on_jobs} == {"jobs_waiting_special_idx"} and removed == 0, plan
    # and the reads behind the page: a reason of a few jobs, a project of a few
    assert len(reads.list_waiting(c, reason="approval_required")["jobs"]) == 3
    assert len(reads.list_waiting(c, project="bounded")["jobs"]) == 3


def test_the_job_list_filters_are_inlined_into_index_reads(conn, queue):
    """pgd_job_list_match has no sub-SELECT, so it is inlined: a project or target filter
    reads that project's or target's index range, not every job through a function call."""
    c = conn
    quiet_autovacuum(c)
    web, linux = c.execute("SELECT p.id AS p, q.id AS q FROM projects p, pools q "
                           "WHERE p.name = 'web' AND q.name = 'linux'").fetchone().values()
    c.execute("INSERT INTO jobs (project_id, pool_id, state, command, finished_at) "
              "SELECT %s, %s, 'succeeded', ARRAY['true'], now() FROM generate_series(1, 20000)", (web, linux))
    analyze_all(c)
    pin_planner(c)
    for filters, index in (({"project": "bounded"}, "jobs_project_idx"),
                           ({"organization": "tight"}, "jobs_project_idx"),
                           ({"target": "stage"}, "jobs_target_idx")):
        with c.transaction():
            ids = reads._job_filter_ids(c, organization=filters.get("organization"),
                                        project=filters.get("project"), pool=None,
                                        target=filters.get("target"), runner_id=None)
            Q.begin_job_list(c)
            params = dict(state=None, project_ids=ids["project_ids"], pool_id=None,
                          target_id=ids["target_id"], runner_id=None, older_than_seconds=None,
                          younger_than_seconds=None, before_id=reads.MAX_BIGINT, after_id=None,
                          upper_at=None, upper_id=None, lower_at=None, lower_id=None, limit=50)
            plan = c.execute("EXPLAIN (FORMAT JSON) " + Q.list_jobs.sql, params).fetchone()["QUERY PLAN"][0]["Plan"]
        text = json.dumps(plan, indent=1)
        assert "pgd_job_list_match" not in text, text
        assert index in {n.get("Index Name") for n in plan_nodes(plan)}, (filters, text)
        assert reads.list_jobs(c, **filters)["jobs"], filters


def listed_by_age(conn, *, limit, **kw):
    """Every page of list_waiting longest waiting first, followed by its cursor."""
    out, after, since = [], 0, None
    while True:
        page = reads.list_waiting(conn, after_id=after, after_since=since, limit=limit,
                                  sort="oldest", **kw)
        out += [(j["waiting_since"], j["id"]) for j in page["jobs"]]
        if page["next_after_id"] is None:
            return out
        after, since = page["next_after_id"], page["next_after_since"]


def test_longest_waiting_first_lists_what_a_walk_sorted_by_waiting_since_lists(conn, queue):
    """sort "oldest": every reason and filter, paged, is the walk's list sorted by
    (waiting since, id)."""
    for code in (None, "ready", "approval_required", "retry_delayed", "capacity_project",
                 "target_held", "pool_paused"):
        for filters in FILTERS:
            walk = {j["id"]: j["waiting_since"] for j in Q.list_waiting_jobs(
                conn, after_id=0, limit=100000,
                **{k: filters.get(k) for k in ("organization", "project", "pool", "target")})}
            want = sorted((walk[i], i) for i in expected(conn, reason=code, **filters))
            for limit in (2, 50):
                assert listed_by_age(conn, limit=limit, reason=code, **filters) == want, (code, filters, limit)


def test_longest_waiting_first_reads_one_age_range_per_pair(conn, queue):
    """The queue longest waiting first, with 20,000 plain waiting jobs: one range of
    jobs_waiting_age_idx per pair cut at the page, no sort of every waiting job (before 0019
    a Sort of all of them under the LIMIT)."""
    c = conn
    quiet_autovacuum(c)
    web, linux = c.execute("SELECT p.id AS p, q.id AS q FROM projects p, pools q "
                           "WHERE p.name = 'web' AND q.name = 'linux'").fetchone().values()
    c.execute("INSERT INTO jobs (project_id, pool_id, state, command) "
              "SELECT %s, %s, 'queued', ARRAY['true'] FROM generate_series(1, 20000)", (web, linux))
    analyze_all(c)
    pin_planner(c)
    world = read_world(c)
    pairs = reads._every_pair(world)
    for after_since in (None, "2000-01-01T00:00:00Z"):
        plan = c.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + Q.list_waiting_jobs_of_pairs_by_age.sql,
                         dict(pairs, after_since=after_since, after_id=0, limit=50)
                         ).fetchone()["QUERY PLAN"][0]["Plan"]
        nodes = list(plan_nodes(plan))
        on_jobs = {n.get("Index Name") for n in nodes if n.get("Relation Name") == "jobs"}
        assert on_jobs == {"jobs_waiting_age_idx", "jobs_pkey"}, json.dumps(plan, indent=1)
        # each pair's range stops at the page: at most 50 entries a pair, never the 20,000
        assert max(n["Actual Rows"] / max(n.get("Actual Loops", 1), 1) for n in nodes
                   if n.get("Index Name") == "jobs_waiting_age_idx") <= 50, json.dumps(plan, indent=1)
    assert len(reads.list_waiting(c, sort="oldest")["jobs"]) == 50


def walked_jobs_of_runner(conn, runner_id):
    """The ids of every job whose latest attempt is ``runner_id``'s, newest first."""
    return [r["job_id"] for r in conn.execute(
        "SELECT a.job_id FROM attempts a WHERE a.runner_id = %s AND NOT EXISTS "
        "(SELECT 1 FROM attempts b WHERE b.job_id = a.job_id AND b.attempt_no > a.attempt_no) "
        "ORDER BY a.job_id DESC", (runner_id,))]


def paged_jobs(conn, *, limit, forward=False, **kw):
    """Every page of list_jobs, followed by its cursor (newest first, or from after_id 0)."""
    out, cursor = [], ({"after_id": 0} if forward else {})
    while True:
        page = reads.list_jobs(conn, limit=limit, **kw, **cursor)
        out += [j["id"] for j in page["jobs"]]
        if page["next"] is None:
            return out
        cursor = page["next"]


def test_the_runner_filter_lists_the_jobs_of_its_latest_attempts(conn, queue, world):
    """A runner's jobs: its running ones, its ended ones, not a job it ran first that another
    runner took again; every page, either way, with the other filters."""
    other = world.runner(pools=("linux",), slots=5, name="other")
    main = conn.execute("SELECT id FROM runners WHERE name = 'main'").fetchone()["id"]
    for _ in range(3):
        world.job()
        world.complete(world.claim(main))
    # the retried job first in line (priority), run by main, then again by other
    retried = world.job(max_attempts=2, priority=1000)["id"]
    first = world.claim(main)
    assert first.job_id == retried
    world.complete(first, outcome="failed")
    conn.execute("UPDATE jobs SET ready_at = now() WHERE id = %s", (retried,))
    again = world.claim(other)
    assert again.job_id == retried
    world.complete(again)
    world.job()
    world.claim(main)  # running
    for runner in (main, other):
        want = walked_jobs_of_runner(conn, runner)
        assert want, runner
        for limit in (1, 2, 50):
            assert paged_jobs(conn, limit=limit, runner_id=runner) == want, (runner, limit)
            assert paged_jobs(conn, limit=limit, runner_id=runner, forward=True) == want[::-1]
        for state in ("running", "succeeded", "uncertain", "queued"):
            states = {r["id"]: r["state"] for r in conn.execute("SELECT id, state FROM jobs")}
            assert paged_jobs(conn, limit=2, runner_id=runner, state=state) == \
                [i for i in want if states[i] == state], (runner, state)
    assert retried in walked_jobs_of_runner(conn, other)
    assert retried not in walked_jobs_of_runner(conn, main)


def test_the_pool_and_runner_filters_read_their_own_ranges(conn, queue):
    """With 20,000 finished jobs of another pool and runner newer than theirs, a rare pool's
    jobs are one range of jobs_pool_idx and a runner's one range of attempts_runner_done_idx
    (before 0020 and 0021: jobs_pkey walked back through every job)."""
    c = conn
    quiet_autovacuum(c)
    web, linux = c.execute("SELECT p.id AS p, q.id AS q FROM projects p, pools q "
                           "WHERE p.name = 'web' AND q.name = 'linux'").fetchone().values()
    busy = c.execute("SELECT id FROM runners WHERE name = 'busy'").fetchone()["id"]
    main = c.execute("SELECT id FROM runners WHERE name = 'main'").fetchone()["id"]
    c.execute("INSERT INTO jobs (project_id, pool_id, state, command, finished_at, attempts_made, generation) "
              "SELECT %s, %s, 'succeeded', ARRAY['true'], now(), 1, 1 FROM generate_series(1, 20000)", (web, linux))
    c.execute("INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state, "
              "lease_expires_at, finished_at) SELECT id, 1, 1, %s, gen_random_uuid(), 'succeeded', now(), now() "
              "FROM jobs WHERE state = 'succeeded'", (main,))
    analyze_all(c)
    pin_planner(c)
    for filters, index in (({"pool": "small"}, "jobs_pool_idx"),
                           ({"runner_id": busy}, "attempts_runner_idx"),
                           ({"runner_id": busy}, "attempts_runner_done_idx")):
        with c.transaction():
            ids = reads._job_filter_ids(c, organization=None, project=None, pool=filters.get("pool"),
                                        target=None, runner_id=filters.get("runner_id"))
            Q.begin_job_list(c)
            params = dict(state=None, project_ids=None, pool_id=ids["pool_id"], target_id=None,
                          runner_id=ids["runner_id"], older_than_seconds=None,
                          younger_than_seconds=None, before_id=reads.MAX_BIGINT, after_id=None,
                          upper_at=None, upper_id=None, lower_at=None, lower_id=None, limit=50)
            plan = c.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + Q.list_jobs.sql,
                             params).fetchone()["QUERY PLAN"][0]["Plan"]
        text = json.dumps(plan, indent=1)
        nodes = list(plan_nodes(plan))
        assert index in {n.get("Index Name") for n in nodes}, (filters, text)
        # no walk: no node of the plan reads more than a few rows of the 20,000
        assert max(n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0) for n in nodes) < 100, (filters, text)
        assert reads.list_jobs(c, **filters)["jobs"], filters
