"""No single row stops a sweep: a lapsed lease whose expiry fails (an error on its row) is
reported — the log, ``pgdispatch_lease_expiry_failures_total``, the job's last_error — and the
same pass ends every other lapsed lease (issue 16, "No single row stops a sweep")."""

from __future__ import annotations

import logging
import re

import pytest
from prometheus_client import REGISTRY

from pgdispatch.sql import transitions

from .catalog import function_source

POISON = """
CREATE FUNCTION pgd_test_poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'poisoned row %', NEW.id;
END;
$$;
CREATE TRIGGER pgd_test_poison BEFORE UPDATE OF state ON jobs
    FOR EACH ROW WHEN (OLD.id = {job_id} AND NEW.state <> OLD.state)
    EXECUTE FUNCTION pgd_test_poison();
"""


def two_lapsed_leases(world):
    """Two running builds whose leases have lapsed, the first (poisoned: its job refuses to
    change state) earlier in lease order; returns (poisoned claim, other claim)."""
    world.setup()
    runner = world.runner()
    world.job()
    world.job()
    first, second = world.claim(runner), world.claim(runner)
    for claim, ago in ((first, "2 minutes"), (second, "1 minute")):
        world.conn.execute(f"UPDATE attempts SET lease_expires_at = now() - interval '{ago}' "
                           "WHERE id = %s", (claim.attempt_id,))
    world.conn.execute(POISON.format(job_id=int(first.job_id)))
    return first, second


def failures_counted() -> float:
    return REGISTRY.get_sample_value("pgdispatch_lease_expiry_failures_total") or 0.0


def test_one_lease_that_cannot_be_ended_does_not_stop_the_pass(world, caplog):
    poisoned, other = two_lapsed_leases(world)
    before = failures_counted()
    with caplog.at_level(logging.ERROR, logger="pgdispatch.sql.transitions"):
        done = transitions.expire_leases(world.conn)
    assert [d["job_id"] for d in done] == [other.job_id]
    assert world.row("jobs", other.job_id)["state"] == "failed"  # max_attempts 1
    stuck = world.row("jobs", poisoned.job_id)
    assert stuck["state"] == "running"
    assert stuck["last_error"] == f"lease expiry failed: poisoned row {poisoned.job_id}"
    assert failures_counted() == before + 1
    logged = [r.getMessage() for r in caplog.records if "could not end the lapsed lease" in r.getMessage()]
    assert len(logged) == 1 and f"attempt {poisoned.attempt_id}" in logged[0]
    # the next pass finds the poisoned lease again, and only that: it ends nothing, quietly
    assert transitions.expire_leases(world.conn) == []


def test_without_the_handler_the_poisoned_row_stops_the_pass(world):
    """The check above can fail: pgd_expire_one without its catch-all handler aborts the
    whole pass at the poisoned row, and the other lapsed lease is never ended."""
    body = function_source("pgd_expire_one")
    broken, n = re.subn(r"            WHEN OTHERS THEN\n.*?                END;\n", "", body, flags=re.S)
    assert n == 1, "update this test with pgd_expire_one"
    world.conn.execute(broken)
    poisoned, other = two_lapsed_leases(world)
    with pytest.raises(Exception, match="poisoned row"), world.conn.transaction():
        transitions.expire_leases(world.conn)
    assert world.row("jobs", other.job_id)["state"] == "running"


def test_no_job_row_can_stop_the_queue_summary(world):
    """The summary pass is one statement (sql/summaries.sql, summarize_queue) that only
    compares, counts and takes the least ready_at of the waiting jobs: no job's values can
    make it fail, so there is no row to skip. Poisoned the way issue 16's backoff did (times
    at both edges of PostgreSQL's range), one project's rows are counted as any other's, the
    healthy project's summary is right, and the overview reads both (the oldest ready time
    of the poisoned one is read as EARLIEST: sql/timestamps.py)."""
    from pgdispatch.sql import reads
    from pgdispatch.sql.queries import Q
    from pgdispatch.sql.timestamps import EARLIEST

    world.setup()
    world.project("api", org="acme", pools=("linux",))
    edges = {"-infinity": "queued", "4713-01-01 00:00+00 BC": "queued",
             "infinity": "queued", "294276-12-31 23:59:59+00": "queued"}
    for ready_at in edges:
        job = world.job(project="web")
        world.conn.execute("UPDATE jobs SET ready_at = %s::timestamptz WHERE id = %s",
                           (ready_at, job["id"]))
    approval = world.job(project="web", requires_approval=True)
    world.conn.execute("UPDATE jobs SET ready_at = 'infinity' WHERE id = %s", (approval["id"],))
    for _ in range(2):
        world.job(project="api")
    world.job(project="api", delay_seconds=60)

    transitions.summarize_queue(world.conn)
    rows = {r["project"]: r for r in Q.read_queue_summaries(world.conn)}
    counted = {p: (r["queued_ready"], r["queued_delayed"], r["blocked_approval"])
               for p, r in rows.items()}
    assert counted == {"web": (2, 2, 1), "api": (2, 1, 0)}
    assert rows["web"]["oldest_ready_at"] == EARLIEST
    assert EARLIEST < rows["api"]["oldest_ready_at"] <= world.conn.execute(
        "SELECT now() AS t").fetchone()["t"]
    seen = reads.overview(world.conn)
    assert seen["jobs_by_state"]["queued"] == 7 and seen["jobs_by_state"]["blocked"] == 1
