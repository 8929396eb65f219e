"""The project claim lock (sql/functions/capacity.sql), on real connections holding real
transactions.

Claims of a project with no bound take its claim lock shared, so they do not wait for each
other; a pause or a bound change takes it exclusively after its row lock, so it waits for
the claims in flight and the claims that come after it see it. A claim of a project with a
bound takes the lock exclusively and counts the running jobs under it. Each property that a
lock provides is shown to fail for a claim whose lock is weakened (a copy of pgd_claim
installed in that test's database only).
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from pgdispatch.sql import db

from ..variants import variant_sql

LOCK_TIMEOUT = "400ms"


def claim_sql(conn, runner_id: int, pool_ids: list[int]) -> dict | None:
    """pgd_claim on ``conn`` in whatever transaction is open there."""
    return conn.execute("SELECT * FROM pgd_claim(%s, %s, %s, 30)",
                        (runner_id, pool_ids, str(uuid.uuid4()))).fetchone()


def waiting_on_advisory(conn, pid: int, timeout_s: float = 10.0) -> None:
    """Wait until backend ``pid`` waits for an advisory lock (a project claim lock)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = conn.execute("SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s",
                           (pid,)).fetchone()
        if row and (row["wait_event_type"], row["wait_event"]) == ("Lock", "advisory"):
            return
        time.sleep(0.02)
    raise AssertionError(f"backend {pid} never waited for a project claim lock")


@pytest.fixture
def web(world, db_url):
    """Project web (no bound) with three queued jobs, a runner, and three more connections."""
    world.setup()
    runner = world.runner(slots=8)
    for _ in range(3):
        world.job()
    conns = [db.connect(db_url) for _ in range(3)]
    yield {"runner": runner, "pools": world.pool_ids(("linux",)), "conns": conns}
    for c in conns:
        c.close()


def running(world) -> int:
    return world.conn.execute("SELECT count(*) AS n FROM jobs WHERE state = 'running'").fetchone()["n"]


def claims_side_by_side(web) -> dict | None:
    a, b, _ = web["conns"]
    a.execute("BEGIN")
    assert claim_sql(a, web["runner"], web["pools"]) is not None
    b.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
    try:
        return claim_sql(b, web["runner"], web["pools"])
    finally:
        a.execute("ROLLBACK")


def test_claims_of_a_project_without_a_bound_do_not_wait_for_each_other(web):
    """A second claim of web gets the next job while the first is uncommitted."""
    assert claims_side_by_side(web) is not None


def test_the_side_by_side_check_fails_for_an_exclusive_claim_lock(world, web):
    world.conn.execute(variant_sql(world.conn, "pgd_claim", [
        ("PERFORM pg_advisory_xact_lock_shared(", "PERFORM pg_advisory_xact_lock(")]))
    with pytest.raises(psycopg.errors.LockNotAvailable):
        claims_side_by_side(web)


def waiting_on_a_lock(conn, pid: int, timeout_s: float = 10.0) -> None:
    """Wait until backend ``pid`` waits for any heavyweight lock (a row or a claim lock)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                           (pid,)).fetchone()
        if row and row["wait_event_type"] == "Lock":
            return
        time.sleep(0.02)
    raise AssertionError(f"backend {pid} never waited for a lock")


def pause_during_claims(world, web) -> None:
    """Two claims of web in flight: the first stamps the project row (so the pause's UPDATE
    waits for that row), the second finds the row taken and skips its stamp, so only its
    claim lock holds the pause off. After the first commits, the pause must still wait for
    the second; a third claim queues behind the pause and then finds web paused."""
    a1, a2, p = web["conns"]
    a1.execute("BEGIN")
    assert claim_sql(a1, web["runner"], web["pools"]) is not None
    a2.execute("BEGIN")
    assert claim_sql(a2, web["runner"], web["pools"]) is not None
    with ThreadPoolExecutor(2) as pool:
        pause = pool.submit(p.execute, "SELECT pgd_pause_project('web', 'freeze', 'test')")
        waiting_on_a_lock(world.conn, p.info.backend_pid)  # the row, held by a1's stamp
        a1.execute("COMMIT")
        waiting_on_advisory(world.conn, p.info.backend_pid)  # a2's claim lock
        with db.connect(world.conn.info.dsn) as b:
            later = pool.submit(claim_sql, b, web["runner"], web["pools"])
            waiting_on_advisory(world.conn, b.info.backend_pid)  # queued behind the pause
            a2.execute("COMMIT")
            pause.result(timeout=10)
            assert later.result(timeout=10) is None
    assert running(world) == 2


def test_a_pause_waits_for_the_claims_in_flight_and_holds_off_the_next(world, web):
    pause_during_claims(world, web)


def test_the_pause_check_fails_for_a_claim_without_the_claim_lock(world, web):
    """Without the claim lock the pause commits as soon as the first claim has, and the
    second claim, still in flight, then commits a job of the paused project."""
    world.conn.execute(variant_sql(world.conn, "pgd_claim", [
        ("                PERFORM pg_advisory_xact_lock(pgd_claim_lock_class(), pgd_claim_lock_key(c.project_id));\n",
         "                NULL;\n"),
        ("                PERFORM pg_advisory_xact_lock_shared(pgd_claim_lock_class(), pgd_claim_lock_key(c.project_id));\n",
         "                NULL;\n")]))
    with pytest.raises(AssertionError, match="never waited for a project claim lock"):
        pause_during_claims(world, web)
    paused = world.conn.execute("SELECT paused_at IS NOT NULL AS p FROM projects "
                                "WHERE name = 'web'").fetchone()["p"]
    assert paused and running(world) == 1  # the pause has committed, the second claim not yet
    web["conns"][1].execute("COMMIT")
    assert running(world) == 2  # a job of the paused project, started after the pause


def bound_during_claims(world, web) -> list:
    """Two claims of web in flight (as in the pause test); a bound of 3 waits for both; two
    claims queued behind the bound change read "no bound" before their lock was granted and
    find the bound under their shared lock. Returns what those two claims got.

    Each of the two runs in a transaction committed by ``commit_once_settled``, so that
    whether the second counts the first's job depends on the locks alone, not on whether the
    first's commit was quick enough to land before the second counted."""
    world.job()
    a1, a2, c = web["conns"]
    for a in (a1, a2):
        a.execute("BEGIN")
        assert claim_sql(a, web["runner"], web["pools"]) is not None
    with ThreadPoolExecutor(3) as pool:
        bound = pool.submit(c.execute, "UPDATE projects SET max_running = 3 WHERE name = 'web'")
        waiting_on_a_lock(world.conn, c.info.backend_pid)
        a1.execute("COMMIT")
        waiting_on_advisory(world.conn, c.info.backend_pid)
        with db.connect(world.conn.info.dsn) as b1, db.connect(world.conn.info.dsn) as b2:
            later = {}
            for b in (b1, b2):
                b.execute("BEGIN")
                later[b] = pool.submit(claim_sql, b, web["runner"], web["pools"])
            for b in (b1, b2):
                waiting_on_advisory(world.conn, b.info.backend_pid)
            a2.execute("COMMIT")
            bound.result(timeout=10)
            commit_once_settled(world.conn, later)
            return [f.result() for f in later.values()]


def commit_once_settled(conn, claims: dict, timeout_s: float = 10.0) -> None:
    """Commit the open transactions of ``claims`` (connection -> its claim's future) in
    rounds: once every claim has either answered or waits for a lock, commit those that
    answered. Claims that do not wait for each other thus all answer before any commits;
    a claim waiting for another's lock is let through by that one's commit."""
    pending = dict(claims)
    deadline = time.monotonic() + timeout_s
    while pending:
        answered = [b for b, f in pending.items() if f.done()]
        waiting = [b for b, f in pending.items() if not f.done() and conn.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
            (b.info.backend_pid,)).fetchone()["wait_event_type"] == "Lock"]
        if answered and len(answered) + len(waiting) == len(pending):
            for b in answered:
                b.execute("COMMIT")
                del pending[b]
            continue
        assert time.monotonic() < deadline, "claims neither answered nor waited for a lock"
        time.sleep(0.02)


def test_a_bound_set_during_claims_holds_for_the_claims_after_it(world, web):
    """The two queued claims pass web over under their shared lock and come back for it
    with the exclusive lock, one after the other: one takes the third slot of the bound,
    the other finds it full."""
    got = bound_during_claims(world, web)
    assert sorted(g is None for g in got) == [False, True]
    assert running(world) == 3


def test_the_bound_check_fails_for_a_claim_that_counts_under_a_shared_lock(world, web):
    world.conn.execute(variant_sql(world.conn, "pgd_claim", [
        ("                IF NOT v_excl THEN\n", "                IF false THEN\n")]))
    got = bound_during_claims(world, web)
    assert [g is None for g in got] == [False, False]
    assert running(world) == 4  # over the bound of 3, set before either claim was granted


def test_claims_of_a_bounded_project_take_turns(world, web):
    """With a bound, the running jobs are counted under the exclusive lock: a second claim
    waits for the first to commit."""
    world.conn.execute("UPDATE projects SET max_running = 5 WHERE name = 'web'")
    with pytest.raises(psycopg.errors.LockNotAvailable):
        claims_side_by_side(web)


def test_a_claim_that_passes_the_project_over_keeps_no_claim_lock(world, web):
    """The claim lock is taken inside the candidate's subtransaction: a candidate passed
    over (here: no free pool slot) gives it back at once, so a pause does not wait for a
    transaction that took nothing."""
    world.conn.execute("UPDATE pools SET slots = 1 WHERE name = 'linux'")
    assert claim_sql(world.conn, web["runner"], web["pools"]) is not None
    a, p, _ = web["conns"]
    a.execute("BEGIN")
    assert claim_sql(a, web["runner"], web["pools"]) is None
    p.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
    p.execute("SELECT pgd_pause_project('web', 'freeze', 'test')")
    a.execute("ROLLBACK")
