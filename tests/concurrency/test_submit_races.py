"""Idempotent submission under a race: one key, one job (a partial index, sql/schema.sql).

The key's uniqueness is the partial unique index ``jobs_idempotency_key_idx`` over the jobs
that have a key; pgd_submit names it as its ON CONFLICT arbiter. A submit that finds no job
with its key and inserts while another submit of the same key is still uncommitted must wait
for that one and then return its job, not make a second.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from pgdispatch.sql import db, transitions

from ..sql.catalog import function_source
from ..sql.plans import analyze_all, pin_planner, quiet_autovacuum

KEY = "release-42"
HOLD_S = 0.5  # how long the first submit stays uncommitted while the second one runs


def race_one_key(world, db_url) -> dict:
    """Submit KEY in an open transaction on one connection; submit it again from a thread on
    another; commit the first after HOLD_S seconds. Returns both answers, whether the second
    returned only after the first committed, and how many jobs carry the key."""
    world.setup()
    answers: dict = {}

    def second() -> None:
        with db.connect(db_url, application_name="racer-submit") as conn:
            answers["second"] = transitions.submit(conn, project="web", pool="linux", command=["true"],
                                                   idempotency_key=KEY)
            answers["second_done"] = time.monotonic()

    with db.connect(db_url, application_name="racer-first") as first:
        with first.transaction():
            answers["first"] = transitions.submit(first, project="web", pool="linux", command=["true"],
                                                  idempotency_key=KEY)
            racer = threading.Thread(target=second, name="racer-submit")
            racer.start()
            time.sleep(HOLD_S)
            answers["committed"] = time.monotonic()
        racer.join(timeout=30)
    assert not racer.is_alive(), "the second submit never returned"
    answers["jobs"] = world.conn.execute(
        "SELECT count(*) AS n FROM jobs WHERE idempotency_key = %s", (KEY,)).fetchone()["n"]
    return answers


def test_a_submit_racing_an_uncommitted_submit_of_its_key_returns_that_job(world, db_url):
    got = race_one_key(world, db_url)
    assert got["jobs"] == 1
    assert got["first"]["is_new"] and not got["second"]["is_new"]
    assert got["second"]["id"] == got["first"]["id"]
    assert got["second_done"] >= got["committed"]  # it waited for the first, then read its job


def test_the_race_check_fails_without_the_unique_index(world, db_url):
    """The same race against a submit whose insert has no arbiter, with the index dropped:
    the second submit does not wait and makes a second job, and the checks above see it."""
    body = function_source("pgd_submit")
    broken, n = re.subn(r"ON CONFLICT \(project_id, idempotency_key\) WHERE idempotency_key IS NOT NULL",
                        "ON CONFLICT", body)
    assert n == 1, "pgd_submit's ON CONFLICT not found: update this test with the function"
    world.conn.execute("DROP INDEX jobs_idempotency_key_idx")
    world.conn.execute(broken)
    got = race_one_key(world, db_url)
    assert got["jobs"] == 2
    assert got["first"]["is_new"] and got["second"]["is_new"]
    assert got["second_done"] < got["committed"]


def test_a_key_is_scoped_to_its_project_and_jobs_without_one_stay_out_of_the_index(world):
    world.setup()
    world.project("api", org="acme", pools=("linux",))
    web = world.job(idempotency_key=KEY)
    api = world.job(project="api", idempotency_key=KEY)
    assert web["is_new"] and api["is_new"] and web["id"] != api["id"]
    assert world.job(idempotency_key=KEY)["id"] == web["id"]
    # only keyed jobs enter an index on the key; of the indexes keyed on created_at, the jobs
    # list's creation order (jobs_created_idx, migration 0022) is full, on purpose, and the
    # others hold waiting jobs only (jobs_waiting_age_idx), so finished history adds no entry
    # to them (a partial index may name it in its predicate: jobs_waiting_special_idx)
    indexes = {r["name"]: r["def"] for r in world.conn.execute(
        "SELECT indexrelid::regclass::text AS name, pg_get_indexdef(indexrelid) AS def "
        "FROM pg_index WHERE indrelid = 'jobs'::regclass")}
    on_key = {n: d for n, d in indexes.items() if "idempotency_key" in d}
    assert on_key == {"jobs_idempotency_key_idx":
                      "CREATE UNIQUE INDEX jobs_idempotency_key_idx ON public.jobs USING btree "
                      "(project_id, idempotency_key) WHERE (idempotency_key IS NOT NULL)"}
    by_created = {n: d for n, d in indexes.items() if "created_at" in d.split(" WHERE ")[0]}
    assert by_created.pop("jobs_created_idx", None) == (
        "CREATE INDEX jobs_created_idx ON public.jobs USING btree (created_at, id)")
    by_created = list(by_created.values())
    assert by_created and all(
        d.endswith("WHERE (state = ANY (ARRAY['blocked'::text, 'queued'::text, "
                   "'uncertain'::text]))") for d in by_created), by_created


@pytest.mark.own_database  # the plan follows the statistics of ANALYZE (tests/conftest.py)
def test_the_submit_lookup_reads_the_partial_index_in_a_generic_plan(world):
    """pgd_submit looks a key up with ``project_id = $1 AND idempotency_key = $2``; the
    partial index's predicate (key IS NOT NULL) follows from the strict ``=``, so even the
    generic plan PL/pgSQL settles on reads the index, not the whole jobs table."""
    world.setup()
    c = world.conn
    quiet_autovacuum(c)
    pin_planner(c)
    project = c.execute("SELECT id FROM projects WHERE name = 'web'").fetchone()["id"]
    pool = c.execute("SELECT id FROM pools WHERE name = 'linux'").fetchone()["id"]
    c.execute("""
        INSERT INTO jobs (project_id, pool_id, state, command, idempotency_key)
        SELECT %s, %s, 'queued', ARRAY['true'], CASE WHEN g %% 10 = 0 THEN 'k' || g END
          FROM generate_series(1, 20000) g""", (project, pool))
    analyze_all(c)  # statistics and planner settings pinned: tests/sql/plans.py
    c.execute("SET plan_cache_mode = force_generic_plan")
    c.execute("PREPARE by_key(bigint, text) AS "
              "SELECT id FROM jobs WHERE project_id = $1 AND idempotency_key = $2")
    plan = c.execute(f"EXPLAIN (FORMAT JSON) EXECUTE by_key({int(project)}, 'k10')").fetchone()["QUERY PLAN"]
    c.execute("DEALLOCATE by_key")
    c.execute("RESET plan_cache_mode")
    node = plan[0]["Plan"]
    assert node["Node Type"] in ("Index Scan", "Index Only Scan"), node
    assert node["Index Name"] == "jobs_idempotency_key_idx"
