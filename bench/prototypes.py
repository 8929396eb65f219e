"""Prototypes: design alternatives measured beside the product, never migrated.

Run them by name, alternated with the product and the ceilings on one server::

    python -m bench all --series pgdispatch,proto-slot-rows,proto-slot-rows-no-recheck,raw-claim \\
        --clients 1,8 --repeats 3 --jobs 6000 --no-latency

They are not in the default series of ``python -m bench all``. Each gets its own template: the
migrated schema plus the prototype's SQL, built from the text of
``sql/migrations/0007_hot_rows_last.sql`` by replacing named statements (an assertion fails if
a statement is no longer there, so a prototype cannot silently measure something else). Only
the one-job-per-transaction cycle (``pgd_claim`` then ``pgd_complete``) is covered; batches,
expiry, the console's counts and the capacity explanations are not, which is why these are
prototypes and not options.

* ``proto-slot-rows`` — organization and pool capacity as slot rows instead of counter rows
  (issue 5, "counter rows locked in order vs slot rows taken with SKIP LOCKED"): one row per
  unit of ``max_running`` / ``slots``; a claim takes a free one with
  ``FOR NO KEY UPDATE SKIP LOCKED`` (never waits), a completion frees the job's. The project
  row (bound, fairness re-check) stays as migrated. The organization and pool ``running``
  columns are left at 0, so every run also checks that no slot is still held at the end.
* ``proto-slot-rows-no-recheck`` — the same, with the fairness re-check under the project row
  lock switched off (``bench.fairness.NO_FAIRNESS_RECHECK``): the claim still updates its
  project's counter, but decides from its lock-free read.

Figures and what they say: docs/benchmarks.md, "Single-job claims at 8 claimers".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sql import db

from .claim import (Bench, Series, check_done, drop_database, limits, make_template,
                    pgdispatch_worker, prepare, run_processes, scratch_database, throughput,
                    with_database)
from .fairness import NO_FAIRNESS_RECHECK

MIGRATION_0007 = Path(__file__).resolve().parent.parent / "sql" / "migrations" / "0007_hot_rows_last.sql"

SLOT_TABLES = """
CREATE TABLE proto_organization_slots (
    organization_id bigint NOT NULL REFERENCES organizations (id), slot_no integer NOT NULL,
    job_id bigint, PRIMARY KEY (organization_id, slot_no));
CREATE INDEX ON proto_organization_slots (organization_id, slot_no) WHERE job_id IS NULL;
CREATE INDEX ON proto_organization_slots (job_id) WHERE job_id IS NOT NULL;
CREATE TABLE proto_pool_slots (
    pool_id bigint NOT NULL REFERENCES pools (id), slot_no integer NOT NULL,
    job_id bigint, PRIMARY KEY (pool_id, slot_no));
CREATE INDEX ON proto_pool_slots (pool_id, slot_no) WHERE job_id IS NULL;
CREATE INDEX ON proto_pool_slots (job_id) WHERE job_id IS NOT NULL;

-- a limit of n is n slot rows; lowering it deletes the free rows above n
CREATE FUNCTION proto_sync_slots() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'organizations' THEN
        INSERT INTO proto_organization_slots (organization_id, slot_no)
        SELECT NEW.id, g FROM generate_series(1, NEW.max_running) g ON CONFLICT DO NOTHING;
        DELETE FROM proto_organization_slots
         WHERE organization_id = NEW.id AND slot_no > NEW.max_running AND job_id IS NULL;
    ELSE
        INSERT INTO proto_pool_slots (pool_id, slot_no)
        SELECT NEW.id, g FROM generate_series(1, NEW.slots) g ON CONFLICT DO NOTHING;
        DELETE FROM proto_pool_slots WHERE pool_id = NEW.id AND slot_no > NEW.slots AND job_id IS NULL;
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER proto_sync_slots AFTER INSERT OR UPDATE OF max_running ON organizations
    FOR EACH ROW EXECUTE FUNCTION proto_sync_slots();
CREATE TRIGGER proto_sync_slots AFTER INSERT OR UPDATE OF slots ON pools
    FOR EACH ROW EXECUTE FUNCTION proto_sync_slots();
"""


def take_slot(table: str, owner: str, owner_id: str) -> str:
    """PL/pgSQL: take one free slot row of ``table`` for ``owner`` = ``owner_id`` (SKIP LOCKED,
    never waits), or pass the candidate over."""
    return f"""\
            UPDATE {table} s SET job_id = v_job.id
             WHERE (s.{owner}, s.slot_no) = (
                   SELECT f.{owner}, f.slot_no FROM {table} f
                    WHERE f.{owner} = {owner_id} AND f.job_id IS NULL
                    LIMIT 1 FOR NO KEY UPDATE SKIP LOCKED);
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
"""


# (function, statements as migrated, the prototype's statements)
REPLACEMENTS = (
    ("pgd_claim", """\
            UPDATE organizations o SET running = o.running + 1
             WHERE o.id = c.org_id AND o.running < o.max_running;
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

            UPDATE pools q SET running = q.running + 1
             WHERE q.id = c.pool_id AND q.running < q.slots;
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
""", take_slot("proto_organization_slots", "organization_id", "c.org_id")
        + take_slot("proto_pool_slots", "pool_id", "c.pool_id")),
    ("pgd_complete_attempt", """\
        UPDATE organizations SET running = running - 1 WHERE id = v_ids.org_id;
        UPDATE pools SET running = running - 1 WHERE id = v_ids.pool_id;
""", """\
        UPDATE proto_organization_slots SET job_id = NULL WHERE job_id = v_job.id;
        UPDATE proto_pool_slots SET job_id = NULL WHERE job_id = v_job.id;
"""),
)

SLOTS_HELD = """
SELECT (SELECT count(*) FROM proto_organization_slots WHERE job_id IS NOT NULL)
     + (SELECT count(*) FROM proto_pool_slots WHERE job_id IS NOT NULL) AS held
"""


def migrated_function(text: str, name: str) -> str:
    """The whole ``CREATE [OR REPLACE] FUNCTION name(...) ... $$;`` statement from ``text``.

    Raises:
        AssertionError: no such function in ``text``.
    """
    found = re.search(rf"^CREATE (?:OR REPLACE )?FUNCTION {name}\(.*?^\$\$;$", text, re.M | re.S)
    assert found, f"{name} not found in {MIGRATION_0007.name}"
    return re.sub(r"^CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", found.group(0))


def slot_rows_sql(*, recheck: bool) -> str:
    """The slot-rows prototype: tables, trigger, and pgd_claim / pgd_complete_attempt as
    migrated in 0007 with their organization and pool counter statements replaced.

    Raises:
        AssertionError: a statement to replace is no longer in the migration.
    """
    text = MIGRATION_0007.read_text()
    parts = [SLOT_TABLES]
    for name, old, new in REPLACEMENTS:
        body = migrated_function(text, name)
        assert body.count(old) == 1, f"{name}: the statement to replace is not there once"
        parts.append(body.replace(old, new) + "\n")
    if not recheck:
        parts.append(NO_FAIRNESS_RECHECK + ";\n")
    return "\n".join(parts)


def prototype_template(bench: Bench, key: str, sql_text: str) -> str:
    """A template database for one prototype, made once per invocation (dropped at close)."""
    if key not in bench.state:
        name = make_template(bench.server_url)
        with db.connect(with_database(bench.server_url, name), application_name="bench-prototype") as conn:
            conn.execute(sql_text)
        bench.state[key] = name
        bench.cleanups.append(lambda: drop_database(bench.server_url, with_database(bench.server_url, name)))
    return bench.state[key]


def run_prototype(bench: Bench, clients: int, *, series: str, recheck: bool) -> dict[str, Any]:
    """One timed run of the one-job-per-transaction cycle on a prototype's database."""
    template = prototype_template(bench, series, slot_rows_sql(recheck=recheck))
    limit = limits(clients, binding=False)
    with scratch_database(bench.server_url, "pgd_bench_proto", template=template) as url:
        pool_ids = prepare(url, jobs=bench.jobs, projects=bench.projects, limit=limit,
                           warmup=bench.warmup)
        workers = run_processes(
            pgdispatch_worker,
            [(url, i, "pgdispatch", pool_ids, bench.lease_seconds, bench.idle_seconds)
             for i in range(clients)],
            timeout_seconds=bench.timeout_seconds)
        check_done(url, bench.jobs + bench.warmup)
        with db.connect(url, application_name="bench-prototype-check") as conn:
            held = conn.execute(SLOTS_HELD).fetchone()["held"]
        if held:
            raise AssertionError(f"{series}: {held} slot rows still held after every job ended")
    return throughput(series, clients, bench.jobs, workers, limits=limit,
                      empty_claims=sum(w["empty_claims"] for w in workers))


SERIES = {
    s.name: s for s in (
        Series("proto-slot-rows", "prototype: organization and pool as slot rows, 1 job/txn",
               "prototype", lambda bench, n: run_prototype(bench, n, series="proto-slot-rows",
                                                          recheck=True)),
        Series("proto-slot-rows-no-recheck",
               "prototype: slot rows and no fairness re-check, 1 job/txn", "prototype",
               lambda bench, n: run_prototype(bench, n, series="proto-slot-rows-no-recheck",
                                              recheck=False)),
    )
}
