"""A transition's server session killed half-way (issue 3, transaction aborts).

A test-only pause point (tests/faults/pause_point.py), installed in the test's database and
nowhere else: a trigger on ``attempts`` (BEFORE INSERT for a claim, BEFORE UPDATE for a
completion or an expiry) that waits for an advisory lock the test holds. Every transition
writes its attempt row last (sql/functions/claim.sql, complete.sql and expire.sql: after the
organization and pool stripes), so it stalls there having taken — and changed — its job, target
and stripe rows (and a claim its project's claim lock and, for the tie-break stamp, its project
row): a claim has added a slot to the held count of one organization stripe with room and of one
pool stripe with room, a completion or an expiry has subtracted the job's two slots from the
stripes its attempt records. The organization and pool rows themselves are not locked by any of
them. The test proves the locks are held (and those rows free), then kills the session with
``pg_terminate_backend`` from another connection, releases the lock, and checks that nothing was
half-applied: the stored state (stripes, held counts and the attempts' stripes included) is
exactly what it was before, every project's running jobs and every organization's and pool's
held slots equal the running attempts behind them, stripe by stripe, every target is held
exactly when a running or uncertain deployment holds it — and the same transition then goes
through.

The checker (tests/faults/consistency.py) is shown catching a claim written as separate
autocommit statements, killed at the same point, and stripes broken directly.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import psycopg
import pytest

from pgdispatch.sql import DatabaseUnavailable, db, transitions

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


KINDS_OF_OWNER = ("organization", "pool")


def locked_stripes(conn, owners: dict[str, int]) -> dict[str, list[int]]:
    """The stripe numbers of ``{"organization": org_id, "pool": pool_id}`` another session
    holds a row lock on.

    Every stripe of the owner, minus those this session can lock (FOR UPDATE SKIP LOCKED, in
    a transaction rolled back at once): the stripe a claim takes a slot from or a release
    gives one back to is row-locked until it commits, while its new held count is not
    visible to anyone else yet."""
    out = {}
    for kind in KINDS_OF_OWNER:
        with conn.transaction(force_rollback=True):
            every = conn.execute("SELECT stripe_no FROM capacity_stripes "
                                 "WHERE kind = %s AND owner_id = %s ORDER BY stripe_no",
                                 (kind, owners[kind])).fetchall()
            lockable = {r["stripe_no"] for r in conn.execute(
                "SELECT stripe_no FROM capacity_stripes WHERE kind = %s AND owner_id = %s "
                "FOR UPDATE SKIP LOCKED", (kind, owners[kind])).fetchall()}
        out[kind] = [r["stripe_no"] for r in every if r["stripe_no"] not in lockable]
    return out


def first_stripes_with_room(conn, owners: dict[str, int], pid: int) -> dict[str, list[int]]:
    """The stripe a claim by backend ``pid`` takes a slot from, of the organization and of
    the pool: the first with room (held < cap, as committed) in that backend's order
    (pgd_stripe_order: stripe number plus pid, modulo the stripes)."""
    out = {}
    for kind in KINDS_OF_OWNER:
        row = conn.execute("""
            SELECT stripe_no FROM capacity_stripes
             WHERE kind = %s AND owner_id = %s AND held < cap
             ORDER BY (stripe_no + %s) %% pgd_capacity_stripes() LIMIT 1""",
                           (kind, owners[kind], pid)).fetchone()
        out[kind] = [row["stripe_no"]] if row else []
    return out


def kill_mid_transition(world, db_url, fn: Callable[[Any], Any], rows: dict[str, int],
                        stripes: dict[str, list[int]] | Callable[[int], dict[str, list[int]]],
                        owners: dict[str, int]):
    """Run ``fn`` until it stalls at the pause point, show it holds ``rows`` and, of the
    stripes of ``owners`` (see ``locked_stripes``), exactly ``stripes`` (or
    ``stripes(victim_pid)``), and that the organization and pool rows are not locked; kill
    its session, open the pause point; returns the victim (its error says how it ended)."""
    hot_rows = {"organizations": owners["organization"], "pools": owners["pool"]}
    pause_point.shut(world.conn)
    try:
        victim = PausedTransition(db_url, fn)
        expected = stripes(victim.pid) if callable(stripes) else stripes
        victim.start()
        pause_point.wait_paused(world.conn, victim.pid)
        assert locked_rows(world.conn, rows) == list(rows), \
            "the transition should stall holding every row of its lock order"
        assert locked_stripes(world.conn, owners) == expected, \
            "the transition should stall holding the stripes it takes or frees slots in, no other"
        assert locked_rows(world.conn, hot_rows) == [], \
            "no transition locks the organization or pool row (sql/functions/capacity.sql)"
        terminate(world.conn, victim.pid)
        victim.join()
    finally:
        pause_point.open_(world.conn)
    assert locked_rows(world.conn, rows) == [], "locks must go with the session"
    assert locked_stripes(world.conn, owners) == {k: [] for k in KINDS_OF_OWNER}, \
        "stripe locks must go with the session"
    return victim


def setup_world(world, kind: str) -> dict[str, Any]:
    """acme (limit 3) / web (bound 2) on pool linux (2 slots), a target, a runner and a job.

    ``rows``: the rows of the lock order every transition of this job holds by id (job,
    target); ``project``: the project's id (a claim also holds its row, for the tie-break
    stamp); ``owners``: whose stripes it takes or frees slots in (the organization's and the
    pool's)."""
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
    owners = {"organization": c.execute("SELECT id FROM organizations").fetchone()["id"],
              "pool": c.execute("SELECT id FROM pools").fetchone()["id"]}
    return {"job": job, "runner": world.runner(slots=4), "rows": ids, "owners": owners,
            "project": c.execute("SELECT id FROM projects").fetchone()["id"]}


def held_of(world, w) -> dict[str, dict[int, int]]:
    """The committed held count of every stripe of the world's organization and pool that
    holds a slot, by stripe number."""
    out = {}
    for kind in KINDS_OF_OWNER:
        out[kind] = {r["stripe_no"]: r["held"] for r in world.conn.execute(
            "SELECT stripe_no, held FROM capacity_stripes "
            "WHERE kind = %s AND owner_id = %s AND held > 0 ORDER BY stripe_no",
            (kind, w["owners"][kind])).fetchall()}
    return out


def stripes_of(world, attempt_id: int) -> dict[str, list[int]]:
    """The organization stripe and the pool stripe attempt ``attempt_id`` holds its slots in."""
    row = world.row("attempts", attempt_id)
    return {"organization": [row["organization_stripe"]], "pool": [row["pool_stripe"]]}


def one_slot_each(stripes: dict[str, list[int]]) -> dict[str, dict[int, int]]:
    """The held counts of ``stripes_of`` an attempt when it is the only one running."""
    return {kind: {no: 1 for no in nos} for kind, nos in stripes.items()}


NOTHING_HELD = {"organization": {}, "pool": {}}
KINDS = ["build", "deployment"]


@pytest.mark.parametrize("kind", KINDS)
def test_claim_killed_half_way_leaves_nothing_behind(world, db_url, kind):
    w = setup_world(world, kind)
    before = consistency.snapshot(world.conn)
    pools = world.pool_ids(("linux",))

    def claim(conn):
        return transitions.claim(conn, runner_id=w["runner"], pools=pools,
                                 claim_token=transitions.new_claim_token(), lease_seconds=30)

    # stalled holding one stripe of the organization and one of the pool, the first with
    # room in its backend's order, each already holding one more slot (not visible to
    # others until the commit)
    victim = kill_mid_transition(world, db_url, claim, w["rows"] | {"projects": w["project"]},
                                 lambda pid: first_stripes_with_room(world.conn, w["owners"], pid),
                                 w["owners"])
    assert isinstance(victim.error, DatabaseUnavailable), victim.error
    assert consistency.snapshot(world.conn) == before
    assert consistency.violations(world.conn) == []
    assert world.row("jobs", w["job"]["id"])["state"] == "queued"
    assert held_of(world, w) == NOTHING_HELD

    # the job is still there to claim, and the claim is whole
    c = world.claim(w["runner"])
    assert c is not None and c.job_id == w["job"]["id"] and c.generation == 1
    assert consistency.violations(world.conn) == []
    assert world.counters() == {"org": 1, "project": 1, "pool": 1, "attempts": 1}
    assert held_of(world, w) == one_slot_each(stripes_of(world, c.attempt_id))
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

    # stalled holding the two stripes the attempt holds its slots in, both already given
    # back (not visible to others yet)
    mine = stripes_of(world, c.attempt_id)
    held = held_of(world, w)
    assert held == one_slot_each(mine)
    victim = kill_mid_transition(world, db_url, complete, w["rows"] | {"attempts": c.attempt_id},
                                 mine, w["owners"])
    assert isinstance(victim.error, DatabaseUnavailable), victim.error
    # the slots it had already given back, the job and target it had already moved on: all
    # rolled back with the session
    assert consistency.snapshot(world.conn) == before
    assert consistency.violations(world.conn) == []
    assert world.counters() == {"org": 1, "project": 1, "pool": 1, "attempts": 1}
    assert held_of(world, w) == held

    # the runner's retry with the same receipt key is the first delivery, not a repeat
    result = world.complete(c, outcome=outcome, exit_code=0 if outcome == "succeeded" else 1)
    assert result["repeated"] is False
    assert result["job_state"] == ("succeeded" if outcome == "succeeded" else "queued")
    assert consistency.violations(world.conn) == []
    assert consistency.history_violations(world.conn) == []
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert held_of(world, w) == NOTHING_HELD


@pytest.mark.parametrize("kind", KINDS)
def test_expiry_killed_half_way_leaves_nothing_behind(world, db_url, kind):
    w = setup_world(world, kind)
    c = world.claim(w["runner"])
    world.expire_now(c.attempt_id)
    before = consistency.snapshot(world.conn)

    # stalled holding the two stripes the attempt holds its slots in, both already given
    # back (not visible to others yet)
    mine = stripes_of(world, c.attempt_id)
    held = held_of(world, w)
    assert held == one_slot_each(mine)
    victim = kill_mid_transition(world, db_url, lambda conn: transitions.expire_one(conn),
                                 w["rows"] | {"attempts": c.attempt_id}, mine, w["owners"])
    assert isinstance(victim.error, DatabaseUnavailable), victim.error
    assert consistency.snapshot(world.conn) == before
    assert consistency.violations(world.conn) == []
    assert world.row("attempts", c.attempt_id)["state"] == "running"
    assert held_of(world, w) == held

    # the next expiry pass ends the lease, once (no backoff, so the job is claimable at once)
    done = transitions.expire_leases(world.conn, backoff_base_seconds=0.001,
                                     backoff_cap_seconds=0.001)
    assert [d["attempt_id"] for d in done] == [c.attempt_id]
    assert world.row("attempts", c.attempt_id)["state"] == \
        ("lost" if kind == "deployment" else "expired")
    assert consistency.violations(world.conn) == []
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert held_of(world, w) == NOTHING_HELD
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
    pgd_claim's (sql/functions/claim.sql), in its order: a slot of the organization and one of
    the pool, each from a stripe with room taken SKIP LOCKED and added to its held count, then
    the project's running count (pgd_count_running); the attempt would record the three
    stripes."""
    ids = conn.execute("""SELECT j.project_id, j.pool_id, p.organization_id AS org_id
                            FROM jobs j JOIN projects p ON p.id = j.project_id
                           WHERE j.id = %s""", (job_id,)).fetchone()
    taken = {}
    for kind, owner in (("organization", ids["org_id"]), ("pool", ids["pool_id"])):
        row = conn.execute("""
            UPDATE capacity_stripes s SET held = s.held + 1
             WHERE (s.kind, s.owner_id, s.stripe_no) = (
                   SELECT f.kind, f.owner_id, f.stripe_no FROM capacity_stripes f
                    WHERE f.kind = %(kind)s AND f.owner_id = %(owner)s AND f.held < f.cap
                    ORDER BY f.stripe_no
                    LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED)
            RETURNING s.stripe_no""", {"kind": kind, "owner": owner}).fetchone()
        assert row is not None, f"no {kind} stripe with room"
        taken[kind] = row["stripe_no"]
    taken["project"] = conn.execute("SELECT pgd_count_running(%s, 1) AS s",
                                    (ids["project_id"],)).fetchone()["s"]
    conn.execute("UPDATE jobs SET state = 'running', generation = generation + 1, "
                 "attempts_made = attempts_made + 1 WHERE id = %s", (job_id,))
    conn.execute("""INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token,
                                          state, claimed_at, lease_expires_at,
                                          organization_stripe, pool_stripe, project_stripe)
                    SELECT id, attempts_made, generation, %s, gen_random_uuid(), 'running',
                           clock_timestamp(), clock_timestamp() + interval '30 seconds', %s, %s, %s
                      FROM jobs WHERE id = %s""",
                 (runner_id, taken["organization"], taken["pool"], taken["project"], job_id))


def test_checker_catches_a_claim_split_over_autocommit_statements(world, db_url):
    w = setup_world(world, "build")
    before = consistency.snapshot(world.conn)
    job_id = w["job"]["id"]

    def broken(conn):
        return claim_in_two_steps(conn, job_id=job_id, runner_id=w["runner"])

    # the broken claim holds nothing while it waits: its first statements already committed
    nothing = {"organization": [], "pool": []}
    victim = kill_mid_transition(world, db_url, broken, {}, nothing, w["owners"])
    assert isinstance(victim.error, psycopg.OperationalError), victim.error
    assert consistency.snapshot(world.conn) != before
    # the slots stay held (the first stripe with room of each), by no attempt: the job is
    # running without one
    assert held_of(world, w) == {"organization": {1: 1}, "pool": {1: 1}}
    found = consistency.violations(world.conn)
    assert "organization acme: held slots 1, running attempts 0" in found
    assert "project web: running jobs 1, running attempts 0" in found
    assert "pool linux: held slots 1, running attempts 0" in found
    assert "organization acme: stripe 1 holds 1 slots, running attempts on it 0" in found
    assert "pool linux: stripe 1 holds 1 slots, running attempts on it 0" in found
    assert any(f.startswith("project web: running stripe ") and f.endswith(" counts 1, running attempts on it 0")
               for f in found), found
    assert f"job {job_id} is running without a running attempt of generation 1" in found
    assert (f"job {job_id}: attempts_made 1, generation 1, but 0 attempts up to generation 0"
            in found)
    assert len(found) == 8, found


# the CHECK (owed > 0) of capacity_debts, dropped to write a debt of nothing
DROP_OWED_CHECK = """
DO $$
DECLARE c text;
BEGIN
    FOR c IN SELECT conname FROM pg_constraint
              WHERE conrelid = 'capacity_debts'::regclass AND contype = 'c'
                AND pg_get_constraintdef(oid) LIKE '%owed%'
    LOOP
        EXECUTE format('ALTER TABLE capacity_debts DROP CONSTRAINT %I', c);
    END LOOP;
END $$"""


def test_checker_catches_broken_stripes(world):
    """The stripe clauses of tests/faults/consistency.py, each on stripes or attempts changed
    directly, as a broken claim, release or limit change would leave them: a slot given back to
    the wrong stripe, a running attempt that records no stripe, caps that do not add up to the
    limit, room while slots are owed, a missing stripe, an empty debt, and stripes of an owner
    that does not exist. Each is undone before the next."""
    w = setup_world(world, "build")
    c = world.claim(w["runner"])
    mine = stripes_of(world, c.attempt_id)
    org, pool = mine["organization"][0], mine["pool"][0]
    other = next(s for s in (1, 2, 3) if s != org)  # another organization stripe with room
    assert consistency.violations(world.conn) == []

    def caught(corrupt: list[str], undo: list[str], lines: list[str]) -> None:
        with world.conn.transaction():
            for sql in corrupt:
                world.conn.execute(sql)
        try:
            assert sorted(consistency.violations(world.conn)) == sorted(lines)
        finally:
            with world.conn.transaction():
                for sql in undo:
                    world.conn.execute(sql)
        assert consistency.violations(world.conn) == []

    def add(kind: str, stripe_no: int, column: str, n: int) -> str:
        return (f"UPDATE capacity_stripes SET {column} = {column} + ({n}) "
                f"WHERE kind = '{kind}' AND stripe_no = {stripe_no}")

    # the running attempt's organization slot given back to another stripe (held counts
    # still sum to the running attempts)
    caught([add("organization", org, "held", -1), add("organization", other, "held", 1)],
           [add("organization", org, "held", 1), add("organization", other, "held", -1)],
           [f"organization acme: stripe {org} holds 0 slots, running attempts on it 1",
            f"organization acme: stripe {other} holds 1 slots, running attempts on it 0"])
    # the running attempt records no pool stripe, its slot held all the same
    caught([f"UPDATE attempts SET pool_stripe = NULL WHERE id = {c.attempt_id}"],
           [f"UPDATE attempts SET pool_stripe = {pool} WHERE id = {c.attempt_id}"],
           [f"job {c.job_id} is running but its attempt {c.attempt_id} holds no slot of its "
            f"pool linux (stripe none)",
            f"pool linux: stripe {pool} holds 1 slots, running attempts on it 0"])
    # a cap raised past the limit (4 slots of acme's limit 3 claimable)
    caught([add("organization", 8, "cap", 1)], [add("organization", 8, "cap", -1)],
           ["organization acme: stripe caps 4 minus 0 owed, limit 3"])
    # a slot owed (and a cap raised by as much, so that the caps minus what is owed still
    # equal the limit) while stripes have room: a claim would take a slot due for retiring
    caught(["INSERT INTO capacity_debts (kind, owner_id, owed) "
            f"VALUES ('pool', {w['owners']['pool']}, 1)", add("pool", 8, "cap", 1)],
           ["DELETE FROM capacity_debts", add("pool", 8, "cap", -1)],
           [f"pool linux owes 1 slots but stripe {s} has room (held 0 of cap 1)"
            for s in sorted({1, 2, 8} - {pool})])
    # a stripe missing (with no cap, so that the caps still add up)
    caught(["DELETE FROM capacity_stripes WHERE kind = 'pool' AND stripe_no = 5"],
           [f"INSERT INTO capacity_stripes (kind, owner_id, stripe_no, cap) "
            f"VALUES ('pool', {w['owners']['pool']}, 5, 0)"],
           ["pool linux has 7 stripes, not 8"])
    # an empty debt, and stripes of an organization that does not exist
    caught([DROP_OWED_CHECK,
            "INSERT INTO capacity_debts (kind, owner_id, owed) "
            f"VALUES ('organization', {w['owners']['organization']}, 0)",
            "INSERT INTO capacity_stripes (kind, owner_id, stripe_no, cap) "
            "VALUES ('organization', 999, 1, 0)"],
           ["DELETE FROM capacity_debts", "DELETE FROM capacity_stripes WHERE owner_id = 999"],
           ["organization acme: a debt of 0 slots",
            "stripes of organization 999, which does not exist"])


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
