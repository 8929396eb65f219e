"""A transition's server session killed half-way (issue 3, transaction aborts).

A test-only pause point (tests/faults/pause_point.py), installed in the test's database and
nowhere else: a trigger on ``attempts`` (BEFORE INSERT for a claim, BEFORE UPDATE for a
completion or an expiry) that waits for an advisory lock the test holds. Every transition
writes its attempt row last (migrations 0008 and 0011: after the job's organization and pool
slots), so it stalls there having taken — and changed — its job, target and slot rows (and a
claim its project's claim lock and, for the tie-break stamp, its project row): a claim has
set the job id on a free organization slot and a free pool slot, a completion or an expiry
has freed the job's two slots. The organization
and pool rows themselves are no longer locked by any of them. The test proves the locks are
held (and those rows free), then kills the session with ``pg_terminate_backend`` from
another connection, releases the lock, and checks that nothing was half-applied: the stored
state (held slots included) is exactly what it was before, every project's running jobs and
every organization's and pool's held slots equal the running attempts behind them, every target is
held exactly when a running or uncertain deployment holds it — and the same transition then
goes through.

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


SLOT_TABLES = (("organization_slots", "organization_id"), ("pool_slots", "pool_id"))


def locked_slots(conn, owners: dict[str, int]) -> dict[str, list[int | None]]:
    """The slot rows of ``{"organization_slots": org_id, "pool_slots": pool_id}`` another
    session holds a row lock on, each named by its holder as committed (None: a free slot).

    Every slot of the owner, minus those this session can lock (FOR UPDATE SKIP LOCKED, in a
    transaction rolled back at once): a claim's or a release's slot is row-locked until it
    commits, while its new ``job_id`` is not visible to anyone else yet."""
    out = {}
    for table, owner_col in SLOT_TABLES:
        with conn.transaction(force_rollback=True):
            every = conn.execute(f"SELECT slot_no, job_id FROM {table} WHERE {owner_col} = %s "
                                 "ORDER BY slot_no", (owners[table],)).fetchall()
            lockable = {r["slot_no"] for r in conn.execute(
                f"SELECT slot_no FROM {table} WHERE {owner_col} = %s FOR UPDATE SKIP LOCKED",
                (owners[table],)).fetchall()}
        out[table] = [r["job_id"] for r in every if r["slot_no"] not in lockable]
    return out


def kill_mid_transition(world, db_url, fn: Callable[[Any], Any], rows: dict[str, int],
                        slots: dict[str, list[int | None]], owners: dict[str, int]):
    """Run ``fn`` until it stalls at the pause point, show it holds ``rows`` and, of the
    slots of ``owners`` (see ``locked_slots``), exactly ``slots`` (by committed holder), and
    that the organization and pool rows are not locked; kill its session, open the pause
    point; returns the victim (its error says how it ended)."""
    hot_rows = {"organizations": owners["organization_slots"], "pools": owners["pool_slots"]}
    pause_point.shut(world.conn)
    try:
        victim = PausedTransition(db_url, fn).start()
        pause_point.wait_paused(world.conn, victim.pid)
        assert locked_rows(world.conn, rows) == list(rows), \
            "the transition should stall holding every row of its lock order"
        assert locked_slots(world.conn, owners) == slots, \
            "the transition should stall holding the slots it takes or frees, and no other"
        assert locked_rows(world.conn, hot_rows) == [], \
            "no transition locks the organization or pool row (migration 0008)"
        terminate(world.conn, victim.pid)
        victim.join()
    finally:
        pause_point.open_(world.conn)
    assert locked_rows(world.conn, rows) == [], "locks must go with the session"
    assert locked_slots(world.conn, owners) == {t: [] for t, _ in SLOT_TABLES}, \
        "slot locks must go with the session"
    return victim


def setup_world(world, kind: str) -> dict[str, Any]:
    """acme (limit 3) / web (bound 2) on pool linux (2 slots), a target, a runner and a job.

    ``rows``: the rows of the lock order every transition of this job holds by id (job,
    target); ``project``: the project's id (a claim also holds its row, for the tie-break
    stamp); ``owners``: whose slots it takes or frees (the organization's and the pool's)."""
    world.setup(org_limit=3, pool_slots=2, project_limit=2, targets=("production",))
    # every transition writes its attempt row last: a claim inserts it, a completion or an
    # expiry updates it
    pause_point.install(world.conn, "attempts", "INSERT OR UPDATE")
    target = "production" if kind == "deployment" else None
    job = world.job(target=target, max_attempts=3)
    c = world.conn
    ids = {"jobs": job["id"]}
    if target:
        ids["targets"] = c.execute("SELECT id FROM targets").fetchone()["id"]
    owners = {"organization_slots": c.execute("SELECT id FROM organizations").fetchone()["id"],
              "pool_slots": c.execute("SELECT id FROM pools").fetchone()["id"]}
    return {"job": job, "runner": world.runner(slots=4), "rows": ids, "owners": owners,
            "project": c.execute("SELECT id FROM projects").fetchone()["id"]}


def slots_of(world, w) -> dict[str, list[int | None]]:
    """The committed holders of every held slot of the world's organization and pool."""
    out = {}
    for table, owner_col in SLOT_TABLES:
        out[table] = [r["job_id"] for r in world.conn.execute(
            f"SELECT job_id FROM {table} WHERE {owner_col} = %s AND job_id IS NOT NULL "
            "ORDER BY slot_no", (w["owners"][table],)).fetchall()]
    return out


KINDS = ["build", "deployment"]


@pytest.mark.parametrize("kind", KINDS)
def test_claim_killed_half_way_leaves_nothing_behind(world, db_url, kind):
    w = setup_world(world, kind)
    before = consistency.snapshot(world.conn)
    pools = world.pool_ids(("linux",))

    def claim(conn):
        return transitions.claim(conn, runner_id=w["runner"], pools=pools,
                                 claim_token=transitions.new_claim_token(), lease_seconds=30)

    # stalled holding one free slot of the organization and one of the pool, both already
    # given to the job (not visible to others until the commit)
    free = {"organization_slots": [None], "pool_slots": [None]}
    victim = kill_mid_transition(world, db_url, claim, w["rows"] | {"projects": w["project"]},
                                 free, w["owners"])
    assert isinstance(victim.error, DatabaseUnavailable), victim.error
    assert consistency.snapshot(world.conn) == before
    assert consistency.violations(world.conn) == []
    assert world.row("jobs", w["job"]["id"])["state"] == "queued"
    assert slots_of(world, w) == {"organization_slots": [], "pool_slots": []}

    # the job is still there to claim, and the claim is whole
    c = world.claim(w["runner"])
    assert c is not None and c.job_id == w["job"]["id"] and c.generation == 1
    assert consistency.violations(world.conn) == []
    assert world.counters() == {"org": 1, "project": 1, "pool": 1, "attempts": 1}
    assert slots_of(world, w) == {"organization_slots": [c.job_id], "pool_slots": [c.job_id]}
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

    # stalled holding the job's two slots, already freed (not visible to others yet)
    held = slots_of(world, w)
    assert held == {"organization_slots": [c.job_id], "pool_slots": [c.job_id]}
    victim = kill_mid_transition(world, db_url, complete, w["rows"] | {"attempts": c.attempt_id},
                                 held, w["owners"])
    assert isinstance(victim.error, DatabaseUnavailable), victim.error
    # the slots it had already freed, the job and target it had already moved on: all
    # rolled back with the session
    assert consistency.snapshot(world.conn) == before
    assert consistency.violations(world.conn) == []
    assert world.counters() == {"org": 1, "project": 1, "pool": 1, "attempts": 1}
    assert slots_of(world, w) == held

    # the runner's retry with the same receipt key is the first delivery, not a repeat
    result = world.complete(c, outcome=outcome, exit_code=0 if outcome == "succeeded" else 1)
    assert result["repeated"] is False
    assert result["job_state"] == ("succeeded" if outcome == "succeeded" else "queued")
    assert consistency.violations(world.conn) == []
    assert consistency.history_violations(world.conn) == []
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert slots_of(world, w) == {"organization_slots": [], "pool_slots": []}


@pytest.mark.parametrize("kind", KINDS)
def test_expiry_killed_half_way_leaves_nothing_behind(world, db_url, kind):
    w = setup_world(world, kind)
    c = world.claim(w["runner"])
    world.expire_now(c.attempt_id)
    before = consistency.snapshot(world.conn)

    # stalled holding the job's two slots, already freed (not visible to others yet)
    held = slots_of(world, w)
    assert held == {"organization_slots": [c.job_id], "pool_slots": [c.job_id]}
    victim = kill_mid_transition(world, db_url, lambda conn: transitions.expire_one(conn),
                                 w["rows"] | {"attempts": c.attempt_id}, held, w["owners"])
    assert isinstance(victim.error, DatabaseUnavailable), victim.error
    assert consistency.snapshot(world.conn) == before
    assert consistency.violations(world.conn) == []
    assert world.row("attempts", c.attempt_id)["state"] == "running"
    assert slots_of(world, w) == held

    # the next expiry pass ends the lease, once (no backoff, so the job is claimable at once)
    done = transitions.expire_leases(world.conn, backoff_base_seconds=0.001,
                                     backoff_cap_seconds=0.001)
    assert [d["attempt_id"] for d in done] == [c.attempt_id]
    assert world.row("attempts", c.attempt_id)["state"] == \
        ("lost" if kind == "deployment" else "expired")
    assert consistency.violations(world.conn) == []
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert slots_of(world, w) == {"organization_slots": [], "pool_slots": []}
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
    (each committed on its own), the attempt inserted afterwards. The reservations are
    pgd_claim's (migration 0008), in its order: a free organization slot and a free pool
    slot, each taken SKIP LOCKED and given the job."""
    ids = conn.execute("""SELECT j.project_id, j.pool_id, p.organization_id AS org_id
                            FROM jobs j JOIN projects p ON p.id = j.project_id
                           WHERE j.id = %s""", (job_id,)).fetchone()
    for table, owner_col, owner in (("organization_slots", "organization_id", ids["org_id"]),
                                    ("pool_slots", "pool_id", ids["pool_id"])):
        taken = conn.execute(f"""
            UPDATE {table} s SET job_id = %(job)s
             WHERE (s.{owner_col}, s.slot_no) = (
                   SELECT f.{owner_col}, f.slot_no FROM {table} f
                    WHERE f.{owner_col} = %(owner)s AND f.job_id IS NULL
                    ORDER BY f.slot_no
                    LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED)""",
                             {"job": job_id, "owner": owner})
        assert taken.rowcount == 1, f"no free slot in {table}"
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
    nothing = {"organization_slots": [], "pool_slots": []}
    victim = kill_mid_transition(world, db_url, broken, {}, nothing, w["owners"])
    assert isinstance(victim.error, psycopg.OperationalError), victim.error
    assert consistency.snapshot(world.conn) != before
    # the slots stay taken by the job, which is running without an attempt
    assert slots_of(world, w) == {"organization_slots": [job_id], "pool_slots": [job_id]}
    found = consistency.violations(world.conn)
    assert "organization acme: held slots 1, running attempts 0" in found
    assert "project web: running jobs 1, running attempts 0" in found
    assert "pool linux: held slots 1, running attempts 0" in found
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
