"""The checkers can fail: each invariant check fires on a deliberately corrupted database,
and the runs checker on a record that disagrees with the attempts.

A small but complete history is built through the real transitions (succeeded, failed,
retried, cancelled, queued, blocked and running jobs; a deployment that succeeded, one that
runs, one whose lease lapsed so its target is uncertain). The checker finds nothing wrong with
it. Then, one corruption per test, rows are changed directly in this test's database — with
the constraint, unique index or immutability trigger that would refuse the change dropped
first — and the check meant to catch it must report it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import pytest

from pgdispatch.sql import transitions

from .chaos_runs import reruns, runs_violations
from .invariants import CHECKS, check_invariants, max_overlap

# Committed, not rolled back (tests/conftest.py): the history waits for a backoff to pass,
# which needs now() to move on, and the checker reads in a REPEATABLE READ transaction of
# its own, which cannot begin inside the test's.
pytestmark = pytest.mark.own_database


@dataclasses.dataclass
class History:
    """Ids of the jobs and attempts of the healthy history."""

    ok: int              # build, succeeded at its first attempt
    retried: int         # build, failed once then succeeded: two attempts
    failed: int          # build, failed with no attempts left
    cancelled: int       # cancelled while queued
    deployed: int        # deployment to production, succeeded
    lost: int            # deployment to staging, lease lapsed: job and target uncertain
    running: int         # build, running now
    deploying: int       # deployment to production, running now (target held)
    queued: int          # build, waiting
    blocked: int         # build, waits on `queued`
    running_attempt: int
    deploying_attempt: int
    superseded: int      # deployment to canary (supersede = true), superseded by `superseding`
    superseding: int     # deployment to canary, waiting (delayed)


def _fast_fail(world, claim):
    return world.complete(claim, "failed", exit_code=1, backoff_base_seconds=0.001,
                          backoff_cap_seconds=0.001)


@pytest.fixture
def history(world) -> History:
    world.setup(org_limit=3, pool_slots=3, targets=("production", "staging"))
    runner = world.runner(slots=8)

    def run_one(**submit) -> tuple[dict, transitions.Claim]:
        job = world.job(**submit)
        claim = world.claim(runner)
        assert claim is not None and claim.job_id == job["id"]
        return job, claim

    ok, c = run_one()
    world.complete(c, exit_code=0)
    retried, c = run_one(max_attempts=2)
    _fast_fail(world, c)
    time.sleep(0.01)  # past the 1 ms backoff
    c = world.claim(runner)
    assert c is not None and c.job_id == retried["id"] and c.attempt_no == 2
    world.complete(c, exit_code=0)
    failed, c = run_one()
    _fast_fail(world, c)
    deployed, c = run_one(target="production")
    world.complete(c, exit_code=0)
    lost, c = run_one(target="staging")
    world.expire_now(c.attempt_id)
    assert transitions.expire_one(world.conn)["job_state"] == "uncertain"
    running, c_run = run_one()
    deploying, c_dep = run_one(target="production")
    cancelled = world.job(delay_seconds=3600)
    transitions.cancel_job(world.conn, job_id=cancelled["id"], actor="test")
    queued = world.job(delay_seconds=3600)
    blocked = world.job(depends_on=[queued["id"]])
    world.apply({"targets": [{"name": "canary", "supersede": True}]})
    superseded = world.job(target="canary", delay_seconds=3600)
    superseding = world.job(target="canary", delay_seconds=3600)
    return History(superseded=superseded["id"], superseding=superseding["id"],
                   ok=ok["id"], retried=retried["id"], failed=failed["id"],
                   cancelled=cancelled["id"], deployed=deployed["id"], lost=lost["id"],
                   running=running["id"], deploying=deploying["id"], queued=queued["id"],
                   blocked=blocked["id"], running_attempt=c_run.attempt_id,
                   deploying_attempt=c_dep.attempt_id)


def drop_checks(conn, table: str, mentioning: str) -> None:
    """Drop the CHECK constraints of ``table`` whose definition mentions ``mentioning``."""
    rows = conn.execute("""
        SELECT conname FROM pg_constraint
         WHERE conrelid = %s::regclass AND contype = 'c'
           AND pg_get_constraintdef(oid) LIKE %s""", (table, f"%{mentioning}%")).fetchall()
    assert rows, f"no CHECK on {table} mentions {mentioning}"
    for r in rows:
        conn.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{r["conname"]}"')


def drop_unique(conn, table: str, columns: str) -> None:
    """Drop the UNIQUE constraint of ``table`` over exactly ``columns`` ("a, b")."""
    rows = conn.execute("""
        SELECT conname FROM pg_constraint
         WHERE conrelid = %s::regclass AND contype = 'u'
           AND pg_get_constraintdef(oid) = %s""", (table, f"UNIQUE ({columns})")).fetchall()
    assert len(rows) == 1, rows
    conn.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{rows[0]["conname"]}"')


def first_attempt(conn, job_id: int) -> int:
    return conn.execute("SELECT id FROM attempts WHERE job_id = %s ORDER BY attempt_no LIMIT 1",
                        (job_id,)).fetchone()["id"]


def release_stripes_of(conn, attempt_id: int) -> None:
    """Give back the organization and pool slots ``attempt_id`` holds in its stripes, as
    pgd_release_slots would."""
    freed = conn.execute("""
        UPDATE capacity_stripes s SET held = s.held - 1
          FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
         WHERE a.id = %s
           AND ((s.kind, s.owner_id, s.stripe_no) = ('organization', p.organization_id,
                                                     a.organization_stripe)
                OR (s.kind, s.owner_id, s.stripe_no) = ('pool', j.pool_id, a.pool_stripe))""",
                         (attempt_id,))
    assert freed.rowcount == 2


def test_the_healthy_history_has_no_violations(world, history):
    assert check_invariants(world.conn) == []
    # and it has what the corruptions below need
    states = {r["id"]: r["state"] for r in world.conn.execute("SELECT id, state FROM jobs")}
    assert states[history.lost] == "uncertain" and states[history.deploying] == "running"
    assert states[history.blocked] == "blocked" and states[history.cancelled] == "cancelled"
    held = world.conn.execute("SELECT name, state FROM targets ORDER BY name").fetchall()
    assert [(t["name"], t["state"]) for t in held] == [("canary", "free"), ("production", "held"),
                                                       ("staging", "uncertain")]
    assert (states[history.superseded], states[history.superseding]) == ("superseded", "queued")


def test_an_empty_database_has_no_violations(conn):
    assert check_invariants(conn) == []


def test_max_overlap_sweep():
    assert max_overlap([]) == (0, None)
    assert max_overlap([(1, 2), (2, 3)]) == (1, 1)  # half-open: touching is not overlapping
    assert max_overlap([(1, 3), (2, 4), (2.5, None)]) == (3, 2.5)


# One corruption per check: (the check that must fire, what to do to the database).
Corruption = Callable[[object, History], None]


def _invalid_state(c, h):
    drop_checks(c, "jobs", "'blocked'::text")
    c.execute("UPDATE jobs SET state = 'limbo' WHERE id = %s", (h.queued,))


def _generation_skipped(c, h):
    c.execute("UPDATE jobs SET generation = generation + 5 WHERE id = %s", (h.ok,))


def _blocked_without_blocker(c, h):
    drop_checks(c, "jobs", "pending_dependencies > 0")
    c.execute("UPDATE jobs SET state = 'blocked' WHERE id = %s", (h.queued,))


def _terminal_without_finished_at(c, h):
    drop_checks(c, "jobs", "finished_at IS NOT NULL")
    c.execute("UPDATE jobs SET finished_at = NULL WHERE id = %s", (h.ok,))


def _running_job_lost_its_attempt(c, h):
    c.execute("UPDATE attempts SET state = 'expired', finished_at = clock_timestamp() "
              "WHERE id = %s", (h.running_attempt,))
    # the held slots follow, so that the organization and pool counts still equal the
    # running attempts behind them, stripe by stripe (the job, still running, now holds no
    # slot, and its project counts it: the counters check sees that too, but the
    # running-attempt check must see the missing attempt)
    release_stripes_of(c, h.running_attempt)


def _queued_job_still_running(c, h):
    c.execute("UPDATE jobs SET state = 'queued' WHERE id = %s", (h.running,))


def _repeated_attempt_no(c, h):
    drop_unique(c, "attempts", "job_id, attempt_no")
    c.execute("UPDATE attempts SET attempt_no = 1 WHERE job_id = %s AND attempt_no = 2",
              (h.retried,))


def _attempts_overlap(c, h):
    c.execute("""UPDATE attempts a SET finished_at = b.claimed_at + interval '1 second'
                   FROM attempts b
                  WHERE a.job_id = %s AND b.job_id = a.job_id
                    AND a.attempt_no = 1 AND b.attempt_no = 2""", (h.retried,))


def _succeeded_twice(c, h):
    c.execute("UPDATE attempts SET state = 'succeeded' WHERE job_id = %s AND attempt_no = 1",
              (h.retried,))


def _slot_held_by_a_finished_job(c, h):
    # a slot of the pool's stripe with room (3 slots, 2 running jobs) held with no running
    # attempt behind it: the release of a job that succeeded long ago never happened
    held = c.execute("""UPDATE capacity_stripes SET held = held + 1
                         WHERE (kind, owner_id, stripe_no) = (
                               SELECT kind, owner_id, stripe_no FROM capacity_stripes
                                WHERE kind = 'pool' AND held < cap ORDER BY stripe_no LIMIT 1)""")
    assert held.rowcount == 1


def _running_job_lost_its_slot(c, h):
    # a running job's organization slot given back under it: a release of the wrong job
    freed = c.execute("""UPDATE capacity_stripes s SET held = s.held - 1
                           FROM attempts a
                          WHERE a.id = %s AND s.kind = 'organization'
                            AND s.stripe_no = a.organization_stripe""", (h.running_attempt,))
    assert freed.rowcount == 1


def _cap_past_the_limit(c, h):
    # a stripe of the organization with one slot more than its share: the caps add up to 4
    # for a limit of 3, so a claim could hold a fourth slot
    c.execute("UPDATE capacity_stripes SET cap = cap + 1 "
              "WHERE kind = 'organization' AND stripe_no = 8")


def _room_while_owed(c, h):
    # a slot owed by the pool (and a cap raised by as much, so that the caps minus what is
    # owed still equal its 3 slots) while its stripes have room: a claim would take a slot
    # that should have been retired
    c.execute("INSERT INTO capacity_debts (kind, owner_id, owed) "
              "SELECT 'pool', id, 1 FROM pools")
    c.execute("UPDATE capacity_stripes SET cap = cap + 1 WHERE kind = 'pool' AND stripe_no = 8")


def _history_over_the_limit(c, h):
    # two finished builds stretched to now + 1 h: with the two running attempts, 4 held the
    # organization (limit 3) at once
    c.execute("UPDATE attempts SET finished_at = now() + interval '1 hour' "
              "WHERE job_id IN (%s, %s)", (h.ok, h.failed))


def _target_freed_under_a_deployment(c, h):
    c.execute("UPDATE targets SET state = 'free', holder_job_id = NULL, held_since = NULL "
              "WHERE name = 'production'")


def _two_holders(c, h):
    c.execute("DROP INDEX jobs_one_holder_per_target")
    c.execute("""UPDATE jobs SET state = 'uncertain', finished_at = NULL,
                        target_id = (SELECT id FROM targets WHERE name = 'production')
                  WHERE id = %s""", (h.lost,))


def _deployments_overlap(c, h):
    c.execute("UPDATE attempts SET finished_at = now() + interval '1 hour' WHERE job_id = %s",
              (h.deployed,))


def _receipt_moved_to_a_running_attempt(c, h):
    c.execute("DROP TRIGGER delivery_receipts_immutable ON delivery_receipts")
    c.execute("""UPDATE delivery_receipts SET attempt_id = %s
                  WHERE attempt_id = (SELECT id FROM attempts WHERE job_id = %s)""",
              (h.running_attempt, h.ok))


def _ran_before_its_dependency(c, h):
    c.execute("INSERT INTO job_dependencies (job_id, depends_on_job_id) VALUES (%s, %s)",
              (h.ok, h.queued))


def _waits_on_a_failed_dependency(c, h):
    c.execute("INSERT INTO job_dependencies (job_id, depends_on_job_id) VALUES (%s, %s)",
              (h.blocked, h.failed))
    c.execute("UPDATE jobs SET pending_dependencies = 2 WHERE id = %s", (h.blocked,))


def _claimed_in_a_paused_pool(c, h):
    # a pause of the pool on record from a day ago, never resumed: every attempt of it since
    # was claimed while it was paused
    c.execute("""INSERT INTO audit_events (actor, action, subject, details)
                 SELECT 'x', 'pause_pool', 'pool:' || q.name,
                        jsonb_build_object('paused_at', now() - interval '1 day')
                   FROM pools q WHERE q.id = (SELECT pool_id FROM jobs WHERE id = %s)""", (h.ok,))


def _claimed_after_a_drain(c, h):
    c.execute("""INSERT INTO audit_events (actor, action, subject, details)
                 SELECT 'x', 'drain_runner', 'runner:' || a.runner_id,
                        jsonb_build_object('drain_requested_at', now() - interval '1 day')
                   FROM attempts a WHERE a.job_id = %s""", (h.ok,))

def _superseded_one_waits_again(c, h):
    # the older deployment back in the queue beside the newer one: two survivors
    c.execute("UPDATE jobs SET state = 'queued', finished_at = NULL WHERE id = %s", (h.superseded,))


def _retried_one_waits_beside_a_newer(c, h):
    # the older deployment had run once and went back to the queue (a retry) beside the
    # newer one, instead of ending superseded (pgd_supersede_stale)
    c.execute("UPDATE jobs SET attempts_made = 1, failures = 1 WHERE id = %s", (h.superseding,))
    c.execute("INSERT INTO jobs (project_id, pool_id, target_id, state, command, ready_at, "
              "submitted_by) SELECT project_id, pool_id, target_id, 'queued', command, ready_at, "
              "submitted_by FROM jobs WHERE id = %s", (h.superseding,))


def _waits_on_a_superseded_dependency(c, h):
    # a job blocked on a superseded deployment: it would wait forever
    drop_checks(c, "job_dependencies", "depends_on")
    c.execute("INSERT INTO job_dependencies (job_id, depends_on_job_id) VALUES (%s, %s)",
              (h.blocked, h.superseded))
    c.execute("UPDATE jobs SET pending_dependencies = pending_dependencies + 1 WHERE id = %s",
              (h.blocked,))


def _running_deployment_superseded(c, h):
    # a running deployment superseded (what pgd_supersede_older must never do), audited as
    # the system's action: its attempt runs on after the supersede
    c.execute("UPDATE jobs SET state = 'superseded', finished_at = now() WHERE id = %s",
              (h.deploying,))
    c.execute("INSERT INTO audit_events (actor, action, subject, details) VALUES "
              "('system', 'supersede', %s, jsonb_build_object('superseded_by', %s::bigint, "
              "'target', 'production'))", (f"job:{h.deploying}", h.superseding))


CORRUPTIONS: list[tuple[str, Corruption]] = [
    ("steering", _claimed_in_a_paused_pool),
    ("steering", _claimed_after_a_drain),
    ("job_state", _invalid_state),
    ("job_columns", _generation_skipped),
    ("job_columns", _blocked_without_blocker),
    ("finished_at", _terminal_without_finished_at),
    ("running_attempt", _running_job_lost_its_attempt),
    ("running_attempt", _queued_job_still_running),
    ("attempt_numbering", _repeated_attempt_no),
    ("attempt_overlap", _attempts_overlap),
    ("succeeded_once", _succeeded_twice),
    ("counters", _slot_held_by_a_finished_job),
    ("counters", _running_job_lost_its_slot),
    ("stripes", _cap_past_the_limit),
    ("stripes", _room_while_owed),
    ("capacity_overlap", _history_over_the_limit),
    ("target_holder", _target_freed_under_a_deployment),
    ("target_holder", _two_holders),
    ("target_overlap", _deployments_overlap),
    ("receipts", _receipt_moved_to_a_running_attempt),
    ("dependencies", _ran_before_its_dependency),
    ("dependencies", _waits_on_a_failed_dependency),
    ("dependencies", _waits_on_a_superseded_dependency),
    ("supersede", _superseded_one_waits_again),
    ("supersede", _retried_one_waits_beside_a_newer),
    ("supersede", _running_deployment_superseded),
]


def test_every_check_has_a_corruption():
    assert {check for check, _ in CORRUPTIONS} == set(CHECKS)


@pytest.mark.parametrize("check, corrupt", CORRUPTIONS,
                         ids=[fn.__name__.lstrip("_") for _, fn in CORRUPTIONS])
def test_each_check_fires_on_its_corruption(world, history, check, corrupt):
    assert check_invariants(world.conn) == []
    with world.conn.transaction():
        corrupt(world.conn, history)
    found = check_invariants(world.conn)
    print("\n".join(found))
    assert any(v.startswith(f"{check}: ") for v in found), found


# The runs checker (chaos_runs.runs_violations): the job commands' own record against the
# attempts. A consistent record passes; each kind of disagreement is reported.
RUNS_OK = [(1, 1, "start", None), (1, 1, "done", 0),
           (2, 1, "start", None), (2, 1, "done", 1), (2, 2, "start", None), (2, 2, "done", 0),
           (3, 1, "start", None)]  # killed (fenced) before it finished
ATTEMPTS_OK = [{"job_id": 1, "attempt_no": 1, "state": "succeeded"},
               {"job_id": 2, "attempt_no": 1, "state": "failed"},
               {"job_id": 2, "attempt_no": 2, "state": "succeeded"},
               {"job_id": 3, "attempt_no": 1, "state": "expired"}]


def test_runs_checker_passes_a_consistent_record():
    assert runs_violations(RUNS_OK, ATTEMPTS_OK) == []
    assert reruns(RUNS_OK) == 1


@pytest.mark.parametrize("runs, attempts, expect", [
    (RUNS_OK + [(1, 1, "start", None)], ATTEMPTS_OK, "job 1 attempt 1 was started 2 times"),
    (RUNS_OK + [(4, 1, "start", None)], ATTEMPTS_OK, "job 4 attempt 1 ran, but the database"),
    ([r for r in RUNS_OK if r[:3] != (1, 1, "done")], ATTEMPTS_OK,
     "job 1 attempt 1 is recorded succeeded, but its command never finished"),
    (RUNS_OK, [dict(a, state="succeeded") if a["job_id"] == 2 and a["attempt_no"] == 1 else a
               for a in ATTEMPTS_OK], "job 2 attempt 1 is recorded succeeded"),
], ids=["claim-run-twice", "unknown-attempt", "success-never-ran", "success-that-failed"])
def test_runs_checker_fires(runs, attempts, expect):
    found = runs_violations(runs, attempts)
    assert any(expect in v for v in found), found
