"""A finished job's outcome is never lost to a database error or a silent connection (issue 16).

A real scheduler runs real commands through a proxy (tests/faults/proxy.py) in front of this
test's database; at report time one fault of each class hits the report of one job:

* lost: the report commits and the connection drops before its answer;
* stalled: the report commits and its answer never comes, the connection left open;
* swallowed: the report never reaches the server and nothing answers, the connection open;
* pooler: the proxy answers the report itself with an error, as PgBouncer does with its own
  (08P01 query_wait_timeout; 26000 a prepared statement another client made);
* statement: the server raises an error in the report's statement (a test-only trigger);
* restart: the report's server session is terminated half-way (57P01, as in a restart).

Every job then ends with its true outcome (succeeded, each command run once, one receipt),
and the scheduler goes on claiming. The stalled report shows the rest: another job's report
is recorded while the stalled one still waits, and the heartbeats keep the stalled job's
lease alive past its length until the report gets through on a fresh connection.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from ..scheduler.conftest import FAST, wait_until
from ..scheduler.conftest import start_scheduler  # noqa: F401 - a fixture, used by start_through

# a deadline short enough for the test, longer than the lease: without the heartbeats going
# on during the report the stalled job's lease would lapse before its report got through
SETTINGS = dataclasses.replace(FAST, statement_deadline_seconds=5.0)

FAULT_TRIGGER = """
CREATE SEQUENCE test_report_faults;
-- as the test's superuser: it fires inside the transitions, which run as pgdispatch_owner
CREATE FUNCTION test_report_fault() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF nextval('test_report_faults') = 1 THEN
        IF TG_ARGV[0] = 'terminate' THEN
            PERFORM pg_terminate_backend(pg_backend_pid());
            PERFORM pg_sleep(5);
        END IF;
        RAISE EXCEPTION 'injected statement error' USING ERRCODE = 'XX000';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_report_fault BEFORE UPDATE ON attempts FOR EACH ROW
    WHEN (OLD.state = 'running' AND NEW.state <> 'running')
    EXECUTE FUNCTION test_report_fault('{kind}');
"""


@pytest.fixture
def start_through(proxy, start_scheduler):
    """``start_through()``: a scheduler (pool linux, two slots, no listener) whose every
    connection goes through the proxy."""
    return lambda: start_scheduler(settings=SETTINGS, database_url=proxy.db_url, listen=False)


def inject(kind: str, proxy, world) -> None:
    if kind == "lost":
        proxy.arm("pgd_complete")
    elif kind == "stalled":
        proxy.arm("pgd_complete", stall=True)
    elif kind == "swallowed":
        proxy.refuse("pgd_complete", None)
    elif kind == "pooler_08P01":
        proxy.refuse("pgd_complete", "08P01", "query_wait_timeout")
    elif kind == "pooler_26000":
        proxy.refuse("pgd_complete", "26000", 'prepared statement "_pg3_1" does not exist')
    elif kind in ("statement", "restart"):
        world.conn.execute(FAULT_TRIGGER.format(kind="terminate" if kind == "restart" else "error"))
    else:
        raise AssertionError(kind)


def fired(kind: str, proxy, world) -> bool:
    if kind in ("lost", "stalled"):
        return proxy.commits_dropped == 1
    if kind.startswith("pooler") or kind == "swallowed":
        return proxy.refused == 1
    return world.conn.execute("SELECT last_value >= 1 AS f FROM test_report_faults").fetchone()["f"]


def outcomes(world) -> list[tuple]:
    return [tuple(r.values()) for r in world.conn.execute(
        "SELECT j.id, j.state, (SELECT count(*) FROM attempts a WHERE a.job_id = j.id) AS attempts,"
        " (SELECT count(*) FROM delivery_receipts d JOIN attempts a ON a.id = d.attempt_id"
        "   WHERE a.job_id = j.id) AS receipts FROM jobs j ORDER BY j.id").fetchall()]


@pytest.mark.parametrize("kind", ["lost", "stalled", "swallowed", "pooler_08P01", "pooler_26000",
                                  "statement", "restart"])
def test_every_job_ends_with_its_true_outcome(kind, world, proxy, start_through, tmp_path):
    world.setup()
    inject(kind, proxy, world)
    jobs = [world.job(command=["sh", "-c", f"echo {i} >> {tmp_path}/ran"], max_attempts=1)
            for i in range(3)]
    _, signals = start_through()
    # every execution ends, told by the database that its outcome is recorded
    results = [signals.next_completed(timeout=40) for _ in jobs]
    assert sorted((r.claim.job_id, r.outcome, r.is_reported, r.job_state) for r in results) == \
        [(j["id"], "succeeded", True, "succeeded") for j in jobs]
    assert fired(kind, proxy, world)
    assert outcomes(world) == [(j["id"], "succeeded", 1, 1) for j in jobs]
    assert sorted((tmp_path / "ran").read_text().split()) == ["0", "1", "2"]
    # and it goes on claiming
    after = world.job(command=["true"], max_attempts=1)
    wait_until(lambda: world.row("jobs", after["id"])["state"] == "succeeded", timeout=20,
               what="a job submitted after the fault")


def test_a_stalled_report_holds_up_no_other_and_keeps_its_lease(world, proxy, start_through):
    """The stalled report here never reached the server: until it gets through, only the
    heartbeats stand between its job and the expiry pass (which would re-queue the job, a
    second attempt allowed, for the scheduler to run it again)."""
    world.setup()
    proxy.refuse("pgd_complete", None)
    stalled = world.job(command=["true"], max_attempts=2)
    _, signals = start_through()
    wait_until(lambda: proxy.refused == 1, timeout=15, what="the first report stalled")
    began = time.monotonic()
    other = world.job(command=["true"], max_attempts=1)
    result = signals.next_completed(timeout=15)
    # the other job's report was answered while the stalled one still waits for its
    # deadline; and it did not wait for that deadline
    assert result.claim.job_id == other["id"] and result.is_reported
    assert time.monotonic() - began < SETTINGS.statement_deadline_seconds
    assert signals.completed.empty()
    # once the deadline has passed the stalled report is sent again on a fresh connection and
    # recorded. Its lease outlived its length meanwhile: nothing expired it, nothing ran it
    # again.
    result = signals.next_completed(timeout=30)
    assert result.claim.job_id == stalled["id"]
    assert result.is_reported and result.outcome == "succeeded" and result.job_state == "succeeded"
    assert result.run_seconds > SETTINGS.statement_deadline_seconds > SETTINGS.lease_seconds
    assert outcomes(world) == [(stalled["id"], "succeeded", 1, 1), (other["id"], "succeeded", 1, 1)]


def test_a_stalled_heartbeat_gives_up_before_the_lease_could_lapse(world, proxy, start_through):
    """A beat whose answer never comes is given up within the heartbeat interval (not the
    longer statement deadline, which is longer than the lease here), and the next beat renews
    the lease on a fresh connection: the job is not self-fenced and runs to its end once."""
    world.setup()
    proxy.refuse("pgd_heartbeat", None)  # sql/attempts.sql, heartbeat
    job = world.job(command=["sleep", str(3 * SETTINGS.lease_seconds)], max_attempts=2)
    _, signals = start_through()
    result = signals.next_completed(timeout=40)
    assert proxy.refused == 1
    assert result.claim.job_id == job["id"]
    assert (result.stop_reason, result.outcome, result.is_reported) == (None, "succeeded", True)
    assert outcomes(world) == [(job["id"], "succeeded", 1, 1)]
