"""reads.list_jobs with an age bound (older than): the list is in creation order, read from
jobs_created_idx (created_at, id) (migration 0022) — every page, either way, lists what a
sort of every row in Python lists, and a page reads the index from the bound, not every job
newer than it (docs/benchmarks.md, "Console at scale")."""

from __future__ import annotations

import json
import random
from datetime import timedelta

import pytest

from pgdispatch.sql import reads
from pgdispatch.sql.queries import Q

from .plans import analyze_all, pin_planner, plan_nodes, quiet_autovacuum

HOUR = 3600.0
DAY = 86400.0


@pytest.fixture
def aged(world):
    """Jobs of two projects in several states, their created_at shuffled out of id order
    (ties included: several jobs created in the same microsecond), with a gap in the ids
    (ids that are no job's, as after a job is deleted). Returns the rows and the list's now."""
    world.setup()
    world.apply({"organizations": [{"name": "globex", "max_running": 10}]})
    world.project("api", org="globex", pools=("linux",))
    runner = world.runner(slots=50)
    for i in range(24):
        world.job(project="web" if i % 3 else "api")
    for i in range(12):
        claim = world.claim(runner)
        if i % 4 != 3:  # three finished to one running
            world.complete(claim, "failed" if i % 4 == 2 else "succeeded")
    world.conn.execute("SELECT setval('jobs_id_seq', nextval('jobs_id_seq') + 5)")
    for i in range(10):
        world.job(project="web" if i % 2 else "api")
    now = world.conn.execute("SELECT now() AS now").fetchone()["now"]
    rng = random.Random(22)
    ids = [r["id"] for r in world.conn.execute("SELECT id FROM jobs ORDER BY id")]
    # on the half hour, up to 10 days back (so that no age bound below, whole hours, falls
    # on one), every fourth a tie with another job
    hours = [rng.randrange(0, 240) + 0.5 for _ in ids]
    for k in range(0, len(ids), 4):
        hours[k] = hours[(k + 7) % len(ids)]
    for job_id, h in zip(ids, hours, strict=True):
        world.conn.execute("UPDATE jobs SET created_at = %s WHERE id = %s",
                           (now - timedelta(hours=h), job_id))
    rows = list(world.conn.execute(
        "SELECT j.id, j.state, j.created_at, p.name AS project FROM jobs j "
        "JOIN projects p ON p.id = j.project_id"))
    assert sorted(r["id"] for r in rows) != [r["id"] for r in sorted(rows, key=lambda r: r["created_at"])]
    return {"rows": rows, "now": now}


def newest_created_first(aged, *, older_than_seconds, state=None, project=None):
    """The ids that match, from all the rows: by (created_at, id), newest first."""
    bound = aged["now"] - timedelta(seconds=older_than_seconds)
    match = [r for r in aged["rows"] if r["created_at"] <= bound
             and state in (None, r["state"]) and project in (None, r["project"])]
    return [r["id"] for r in sorted(match, key=lambda r: (r["created_at"], r["id"]), reverse=True)]


def pages(conn, *, limit, **kw):
    """Every page of list_jobs from the call ``kw`` (cursor included), each followed by its
    ``next``; each page's ids in the order listed."""
    out, cursor = [], {}
    while True:
        page = reads.list_jobs(conn, limit=limit, **kw, **cursor)
        assert page["order"] == ("oldest_first" if "after_id" in {**kw, **cursor} else "newest_first")
        out.append([j["id"] for j in page["jobs"]])
        if page["next"] is None:
            return out
        cursor = page["next"]
        kw = {k: v for k, v in kw.items() if k not in ("before_id", "after_id")}


FILTERS = [{}, {"state": "succeeded"}, {"state": "queued"}, {"project": "api"},
           {"state": "succeeded", "project": "web"}, {"state": "running", "project": "api"}]


@pytest.mark.parametrize("older_than_seconds", [0.0, HOUR, DAY, 5 * DAY, 20 * DAY])
def test_every_page_either_way_is_the_creation_order(conn, aged, older_than_seconds):
    """Newest created first and paged back, oldest first from after_id 0 and paged forward,
    and from jobs of the list both ways, and windows between two of them: each
    lists every match exactly once, in (created_at, id) order."""
    for filters in FILTERS:
        want = newest_created_first(aged, older_than_seconds=older_than_seconds, **filters)
        kw = dict(older_than_seconds=older_than_seconds, **filters)
        for limit in (1, 3, 50):
            back = pages(conn, limit=limit, **kw)
            assert sum(back, []) == want, (filters, limit)
            assert all(len(p) == limit for p in back[:-1]), (filters, limit)
            assert sum(pages(conn, limit=limit, after_id=0, **kw), []) == want[::-1], (filters, limit)
        for k in range(0, len(want), 3):
            job_id = want[k]
            assert sum(pages(conn, limit=4, before_id=job_id, **kw), []) == want[k + 1:], (filters, k)
            assert sum(pages(conn, limit=4, after_id=job_id, **kw), []) == want[:k][::-1], (filters, k)
            for m in range(k + 1, min(k + 7, len(want))):
                window = sum(pages(conn, limit=2, after_id=want[m], before_id=job_id, **kw), [])
                assert window == want[k + 1:m][::-1], (filters, k, m)


def test_a_cursor_that_is_no_job_stands_beside_the_next_job_by_id(conn, aged):
    """A before_id that is no job's stands at the created_at of the next job above it by id,
    an after_id at that of the next job below it (the ids of the gap; 0 and the largest id:
    no bound), so that it cuts the list as it would cut the id order."""
    by_id = {r["id"]: r for r in aged["rows"]}
    ids = sorted(by_id)
    gap = [i for i in range(ids[0], ids[-1]) if i not in by_id]
    assert len(gap) >= 5
    want = newest_created_first(aged, older_than_seconds=HOUR)
    key = {i: (by_id[i]["created_at"], i) for i in want}
    for cursor in (*gap, 0, reads.MAX_BIGINT):
        above = [i for i in ids if i > cursor]
        below = [i for i in ids if i < cursor]
        before_at = (by_id[above[0]]["created_at"], cursor) if above else None
        after_at = (by_id[below[-1]]["created_at"], cursor) if below else None
        if cursor:  # before_id 0 is none (reads.list_jobs)
            assert sum(pages(conn, limit=2, older_than_seconds=HOUR, before_id=cursor), []) == [
                i for i in want if before_at is None or key[i] < before_at], cursor
        assert sum(pages(conn, limit=2, older_than_seconds=HOUR, after_id=cursor), []) == [
            i for i in want if after_at is None or key[i] > after_at][::-1], cursor


def test_without_an_age_bound_and_with_younger_than_the_order_stays_by_id(conn, aged):
    """Without older_than the list stays in id order, with younger_than alone too (recent
    jobs are the newest ids); with both bounds it is in creation order, between them."""
    every = sorted((r["id"] for r in aged["rows"]), reverse=True)
    assert sum(pages(conn, limit=4), []) == every
    bound = aged["now"] - timedelta(hours=48)
    young = [i for i in every if next(r for r in aged["rows"] if r["id"] == i)["created_at"] > bound]
    assert sum(pages(conn, limit=4, younger_than_seconds=2 * DAY), []) == young
    # both bounds: creation order, between them
    both = newest_created_first(aged, older_than_seconds=HOUR)
    both = [i for i in both if next(r for r in aged["rows"] if r["id"] == i)["created_at"] > bound]
    assert sum(pages(conn, limit=4, older_than_seconds=HOUR, younger_than_seconds=2 * DAY), []) == both


QUEUED = 20000
FINISHED = 20000


@pytest.mark.own_database  # the plan follows the statistics of ANALYZE (tests/conftest.py)
def test_an_age_bound_reads_the_creation_index_from_the_bound(conn, world):
    """With 20,000 queued jobs created now, newer by id than 20,000 finished ones created
    over the last 10 days, an age-bounded page (with a state and a project or none; newest
    first, oldest first, from a cursor deep in the history, in a window, with a younger bound
    too) is one range of jobs_created_idx from its nearer end: no node of the plan reads
    more than a few pages' rows, and the index scan a few buffers (before 0022: jobs_pkey,
    jobs_state_idx or jobs_project_idx walked back through the 20,000 queued jobs; with the
    age bound apart from the cursor's, the scan started from the bound and walked down to a
    cursor)."""
    world.setup()
    world.project("api", org="acme", pools=("linux",))
    c = conn
    quiet_autovacuum(c)
    web, api, linux = c.execute(
        "SELECT (SELECT id FROM projects WHERE name = 'web') AS web, "
        "(SELECT id FROM projects WHERE name = 'api') AS api, "
        "(SELECT id FROM pools WHERE name = 'linux') AS linux").fetchone().values()
    c.execute("""
        INSERT INTO jobs (project_id, pool_id, state, command, created_at, started_at, finished_at)
        SELECT CASE WHEN g %% 4 = 0 THEN %(api)s ELSE %(web)s END, %(q)s, s.state, ARRAY['true'],
               now() - interval '10 days' + g * interval '40 seconds',
               now() - interval '10 days' + g * interval '40 seconds',
               now() - interval '10 days' + g * interval '40 seconds'
          FROM generate_series(1, %(n)s) g,
               LATERAL (SELECT CASE g %% 100 WHEN 0 THEN 'failed' ELSE 'succeeded' END) s(state)""",
              {"web": web, "api": api, "q": linux, "n": FINISHED})
    c.execute("INSERT INTO jobs (project_id, pool_id, state, command) "
              "SELECT %s, %s, 'queued', ARRAY['true'] FROM generate_series(1, %s)", (web, linux, QUEUED))
    analyze_all(c)
    pin_planner(c)
    # cursors: a job created 9 days ago (deep), one 20 jobs later, one 1.67 days ago (late)
    nth = "SELECT id FROM jobs WHERE state = 'succeeded' ORDER BY id OFFSET %s LIMIT 1"
    deep, above, late = (c.execute(nth, (n,)).fetchone()["id"]
                         for n in (FINISHED // 10, FINISHED // 10 + 20, FINISHED * 9 // 10))
    both = (DAY, 7 * DAY)
    cases = [({}, {}, both), ({"state": "succeeded", "project": "api"}, {}, both),
             ({"project": "web"}, {}, both), ({}, {"after_id": 0}, both),
             ({"state": "succeeded"}, {"after_id": 0}, both), ({}, {"before_id": deep}, both),
             ({"state": "succeeded", "project": "api"}, {"after_id": deep}, both),
             ({"younger_than_seconds": 9 * DAY}, {"after_id": 0}, both),
             ({"younger_than_seconds": 9.5 * DAY}, {"after_id": deep}, both),
             ({}, {"after_id": deep, "before_id": above}, both),
             # a few jobs between the cursor and the younger bound: the scan ends there
             ({"younger_than_seconds": 1.68 * DAY}, {"before_id": late}, (DAY,))]
    for filters, cursor, older_thans in cases:
        for older_than in older_thans:
            with c.transaction():
                ids = reads._job_filter_ids(c, organization=None, project=filters.get("project"),
                                            pool=None, target=None, runner_id=None)
                Q.begin_job_list(c)
                params = dict(state=filters.get("state"), project_ids=ids["project_ids"], pool_id=None,
                              target_id=None, runner_id=None, older_than_seconds=older_than,
                              younger_than_seconds=filters.get("younger_than_seconds"),
                              before_id=cursor.get("before_id", reads.MAX_BIGINT),
                              after_id=cursor.get("after_id"), limit=50)
                params.update(Q.find_job_list_bounds(
                    c, before_id=params["before_id"], after_id=params["after_id"],
                    older_than_seconds=older_than,
                    younger_than_seconds=filters.get("younger_than_seconds")))
                plan = c.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + Q.list_jobs.sql,
                                 params).fetchone()["QUERY PLAN"][0]["Plan"]
            case = (filters, cursor, older_than, json.dumps(plan, indent=1))
            nodes = list(plan_nodes(plan))
            on_jobs = {n.get("Index Name") for n in nodes if n.get("Relation Name") == "jobs"}
            assert "jobs_created_idx" in on_jobs, case
            # jobs_pkey only looks rows up by id: the page's rows
            assert on_jobs <= {"jobs_created_idx", "jobs_pkey"}, case
            # no walk: no node of the plan reads more than a few pages' rows of the 40,000,
            # nor skips them in the index (a scan from the age bound down to a cursor reads
            # past them without a row: only its buffers show it)
            assert max(n.get("Actual Rows", 0) * max(n.get("Actual Loops", 1), 1)
                       + n.get("Rows Removed by Filter", 0) for n in nodes) <= 500, case
            assert max(n["Shared Hit Blocks"] + n["Shared Read Blocks"] for n in nodes
                       if n.get("Index Name") == "jobs_created_idx") <= 20, case
            page = reads.list_jobs(c, older_than_seconds=older_than, **filters, **cursor)
            assert page["jobs"], case[:3]
