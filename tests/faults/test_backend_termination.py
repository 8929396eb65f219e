"""A transition's server session killed half-way (issue 3, transaction aborts).

A test-only pause point (tests/faults/pause_point.py), installed in the test's database and
nowhere else: a trigger on ``attempts`` (BEFORE INSERT for a claim, BEFORE UPDATE for a
completion or an expiry) that waits for an advisory lock the test holds. Every transition
writes its attempt row last, so it stalls there having taken — and, for completion and
expiry, already changed — its organization, project, pool, job and target rows. The test
proves the locks are held, then kills the session with ``pg_terminate_backend`` from another
connection, releases the lock, and checks that nothing was half-applied: the stored state
is exactly what it was before, every counter equals the running attempts behind it, every
target is held exactly when a running or uncertain deployment holds it — and the same
transition then goes through.

The checker (tests/faults/consistency.py) is shown catching a claim written as separate
autocommit statements, killed at the same point.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import psycopg
import pytest

from sql import DatabaseUnavailable, db, transitions

from . import consistency, pause_point

WAIT_S = 30.0


class PausedTransition:
    """Runs ``fn(conn)`` on its own connection in a thread while the pause point is shut."""

    def __init__(self, db_url: str, fn: Callable[[Any], Any]):
        self.conn = db.connect(db_url, application_name="pgd-test-victim")
        self.pid = self.conn.info.backend_pid
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="racer-victim")

    def _run(self) -> None:
        try:
            self.value = self.fn(self.conn)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc

    def start(self) -> "PausedTransition":
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the terminated transition never returned"
        self.conn.close()


def terminate(conn, pid: int) -> None:
    """pg_terminate_backend(pid), then wait until the session is gone."""
    assert conn.execute("SELECT pg_terminate_backend(%s) AS ok", (pid,)).fetchone()["ok"]
    deadline = time.monotonic() + WAIT_S
    while conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
        assert time.monotonic() < deadline, f"session {pid} survived pg_terminate_backend"
        time.sleep(0.01)


def locked_rows(conn, rows: dict[str, int]) -> list[str]:
    """Which of ``{table: id}`` another session holds a row lock on (FOR UPDATE NOWAIT)."""
    held = []
    for table, id_ in rows.items():
        try:
            with conn.transaction():
                conn.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR UPDATE NOWAIT", (id_,))
        except psycopg.errors.LockNotAvailable:
            held.append(table)
    return held


def kill_mid_transition(world, db_url, fn: Callable[[Any], Any], rows: dict[str, int]):
    """Run ``fn`` until it stalls at the pause point, show it holds ``rows``, kill its
    session, open the pause point; returns the victim (its error says how it ended)."""
    pause_point.shut(world.conn)
    try:
        victim = PausedTransition(db_url, fn).start()
        pause_point.wait_paused(world.conn, victim.pid)
        assert locked_rows(world.conn, rows) == list(rows), \
            "the transition should stall holding every row of its lock order"
        terminate(world.conn, victim.pid)
        victim.join()
    finally:
        pause_point.open_(world.conn)
    assert locked_rows(world.conn, rows) == [], "locks must go with the session"
    return victim


def setup_world(world, kind: str) -> dict[str, Any]:
    """acme (limit 3) / web (bound 2) on pool linux (2 slots), a target, a runner and a job."""
    world.setup(org_limit=3, pool_slots=2, project_limit=2, targets=("production",))
    # every transition writes its attempt row last: a claim inserts it, a completion or an
    # expiry updates it
    pause_point.install(world.conn, "attempts", "INSERT OR UPDATE")
    target = "production" if kind == "deployment" else None
    job = world.job(target=target, max_attempts=3)
    c = world.conn
    ids = {
        "organizations": c.execute("SELECT id FROM organizations").fetchone()["id"],
        "projects": c.execute("SELECT id FROM projects").fetchone()["id"],
        "pools": c.execute("SELECT id FROM pools").fetchone()["id"],
        "jobs": job["id"],
    }
    if target:
        ids["targets"] = c.execute("SELECT id FROM targets").fetchone()["id"]
    return {"job": job, "runner": world.runner(slots=4), "rows": ids}


KINDS = ["build", "deployment"]


@pytest.mark.parametrize("kind", KINDS)
def test_claim_killed_half_way_leaves_nothing_behind(world, db_url, kind):
    w = setup_world(world, kind)
    before = consistency.snapshot(world.conn)
    pools = world.pool_ids(("linux",))

    def claim(conn):
        return transitions.claim(conn, runner_id=w["runner"], pools=pools,
                                 claim_token=transitions.new_claim_token(), lease_seconds=30)

    victim = kill_mid_transition(world, db_url, claim, w["rows"])
    assert isinstance(victim.error, DatabaseUnavailable), victim.error
    assert consistency.snapshot(world.conn) == before
    assert consistency.violations(world.conn) == []
    assert world.row("jobs", w["job"]["id"])["state"] == "queued"

    # the job is still there to claim, and the claim is whole
    c = world.claim(w["runner"])
    assert c is not None and c.job_id == w["job"]["id"] and c.generation == 1
    assert consistency.violations(world.conn) == []
    assert world.counters() == {"org": 1, "project": 1, "pool": 1, "attempts": 1}
    assert world.complete(c)["job_state"] == "succeeded"
    assert consistency.violations(world.conn) == []
    assert consistency.history_violations(world.conn) == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_completion_killed_half_way_leaves_nothing_behind(world, db_url, kind, outcome):
    w = setup_world(world, kind)
    c = world.claim(w["runner"])
    before = consistency.snapshot(world.conn)
    assert consistency.violations(world.conn) == []

    def complete(conn):
        return world.complete(c, outcome=outcome, exit_code=0 if outcome == "succeeded" else 1,
                              conn=conn)

    victim = kill_mid_transition(world, db_url, complete, w["rows"] | {"attempts": c.attempt_id})
    assert isinstance(victim.error, DatabaseUnavailable), victim.error
    # the counters it had already decremented, the job and target it had already moved on:
    # all rolled back with the session
    assert consistency.snapshot(world.conn) == before
    assert consistency.violations(world.conn) == []
    assert world.counters() == {"org": 1, "project": 1, "pool": 1, "attempts": 1}

    # the runner's retry with the same receipt key is the first delivery, not a repeat
    result = world.complete(c, outcome=outcome, exit_code=0 if outcome == "succeeded" else 1)
    assert result["repeated"] is False
    assert result["job_state"] == ("succeeded" if outcome == "succeeded" else "queued")
    assert consistency.violations(world.conn) == []
    assert consistency.history_violations(world.conn) == []
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}


@pytest.mark.parametrize("kind", KINDS)
def test_expiry_killed_half_way_leaves_nothing_behind(world, db_url, kind):
    w = setup_world(world, kind)
    c = world.claim(w["runner"])
    world.expire_now(c.attempt_id)
    before = consistency.snapshot(world.conn)

    victim = kill_mid_transition(world, db_url, lambda conn: transitions.expire_one(conn),
                                 w["rows"] | {"attempts": c.attempt_id})
    assert isinstance(victim.error, DatabaseUnavailable), victim.error
    assert consistency.snapshot(world.conn) == before
    assert consistency.violations(world.conn) == []
    assert world.row("attempts", c.attempt_id)["state"] == "running"

    # the next expiry pass ends the lease, once (no backoff, so the job is claimable at once)
    done = transitions.expire_leases(world.conn, backoff_base_seconds=0.001,
                                     backoff_cap_seconds=0.001)
    assert [d["attempt_id"] for d in done] == [c.attempt_id]
    assert world.row("attempts", c.attempt_id)["state"] == \
        ("lost" if kind == "deployment" else "expired")
    assert consistency.violations(world.conn) == []
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    if kind == "deployment":
        assert world.row("targets", w["rows"]["targets"])["state"] == "uncertain"
        transitions.resolve_target(world.conn, target="production", outcome="retry",
                                   note="checked: not deployed", actor="alice")
    c2 = world.claim(w["runner"])
    assert c2 is not None and c2.generation == 2
    assert consistency.violations(world.conn) == []
    assert consistency.history_violations(world.conn) == []


# --- the checker catches a transition that is not one transaction ----------------------

def claim_in_two_steps(conn, *, job_id: int, runner_id: int) -> None:
    """A deliberately broken claim: capacity and the job taken in autocommit statements
    (each committed on its own), the attempt inserted afterwards."""
    ids = conn.execute("""SELECT j.project_id, j.pool_id, p.organization_id AS org_id
                            FROM jobs j JOIN projects p ON p.id = j.project_id
                           WHERE j.id = %s""", (job_id,)).fetchone()
    conn.execute("UPDATE organizations SET running = running + 1 WHERE id = %s", (ids["org_id"],))
    conn.execute("UPDATE projects SET running = running + 1 WHERE id = %s", (ids["project_id"],))
    conn.execute("UPDATE pools SET running = running + 1 WHERE id = %s", (ids["pool_id"],))
    conn.execute("UPDATE jobs SET state = 'running', generation = generation + 1, "
                 "attempts_made = attempts_made + 1 WHERE id = %s", (job_id,))
    conn.execute("""INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token,
                                          state, claimed_at, lease_expires_at)
                    SELECT id, attempts_made, generation, %s, gen_random_uuid(), 'running',
                           clock_timestamp(), clock_timestamp() + interval '30 seconds'
                      FROM jobs WHERE id = %s""", (runner_id, job_id))


def test_checker_catches_a_claim_split_over_autocommit_statements(world, db_url):
    w = setup_world(world, "build")
    before = consistency.snapshot(world.conn)
    job_id = w["job"]["id"]

    def broken(conn):
        return claim_in_two_steps(conn, job_id=job_id, runner_id=w["runner"])

    # the broken claim holds nothing while it waits: its first statements already committed
    victim = kill_mid_transition(world, db_url, broken, {})
    assert isinstance(victim.error, psycopg.OperationalError), victim.error
    assert consistency.snapshot(world.conn) != before
    found = consistency.violations(world.conn)
    assert "organization acme: running counter 1, running attempts 0" in found
    assert "project web: running counter 1, running attempts 0" in found
    assert "pool linux: running counter 1, running attempts 0" in found
    assert f"job {job_id} is running without a running attempt of generation 1" in found
    assert (f"job {job_id}: attempts_made 1, generation 1, but 0 attempts up to generation 0"
            in found)
    assert len(found) == 5, found


def test_checker_catches_a_target_left_held(world):
    """The target clauses: a running deployment whose target is free, and a target held by
    a job that has ended (written directly, as a broken claim or release would leave them)."""
    w = setup_world(world, "deployment")
    c = world.claim(w["runner"])
    assert consistency.violations(world.conn) == []
    held = world.conn.execute("SELECT * FROM targets").fetchone()
    world.conn.execute("UPDATE targets SET state = 'free', holder_job_id = NULL, held_since = NULL")
    assert consistency.violations(world.conn) == [
        f"deployment job {c.job_id} is running but target production is free (holder )"]
    world.conn.execute("UPDATE targets SET state = 'held', holder_job_id = %s, held_since = %s",
                       (c.job_id, held["held_since"]))
    assert consistency.violations(world.conn) == []
    world.complete(c)
    assert consistency.violations(world.conn) == []
    world.conn.execute("UPDATE targets SET state = 'held', holder_job_id = %s, held_since = now()",
                       (c.job_id,))
    assert consistency.violations(world.conn) == [
        f"target production is held (holder {c.job_id}) but job {c.job_id} is succeeded"]
