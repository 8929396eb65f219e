"""Readers of an organization's or a pool's ``running`` after migration 0008: the number of
its held slots (pgd_organization_running, pgd_pool_running), under the same key and with the
same meaning as the dropped counter columns, a held slot above a lowered limit included."""

from __future__ import annotations

import pytest

from sql import console, db, reads
from sql.explain import explain_job
from sql.queries import Q

from ..faults import consistency
from ..faults.invariants import check_invariants


def two_running_above_lowered_limits(world) -> tuple[list, dict]:
    """acme (limit 3) and linux (3 slots) with 3 jobs claimed and the first completed, then
    both limits lowered to 1 by an operator: 2 running jobs hold slots 2 and 3 of each."""
    world.setup(org_limit=3, pool_slots=3)
    runner = world.runner(slots=8)
    claims = []
    for _ in range(3):
        world.job()
        claims.append(world.claim(runner))
    world.complete(claims[0])
    changed = {
        "organization": console.set_organization_limit(world.conn, organization="acme", max_running=1,
                                                       expected_max_running=3, actor="alice"),
        "pool": console.set_pool_slots(world.conn, pool="linux", slots=1, expected_slots=3,
                                       actor="alice"),
    }
    return claims, changed


def test_limit_changes_answer_the_running_jobs(world):
    claims, changed = two_running_above_lowered_limits(world)
    assert changed == {"organization": {"organization": "acme", "max_running": 1, "running": 2,
                                        "changed": True},
                       "pool": {"pool": "linux", "slots": 1, "running": 2, "changed": True}}
    world.complete(claims[1])
    again = console.set_organization_limit(world.conn, organization="acme", max_running=4,
                                           expected_max_running=1, actor="alice")
    assert again == {"organization": "acme", "max_running": 4, "running": 1, "changed": True}


def test_lists_and_overview_count_held_slots(world):
    claims, _ = two_running_above_lowered_limits(world)
    limits = console.list_limits(world.conn)
    assert [(o["name"], o["max_running"], o["running"]) for o in limits["organizations"]] == \
        [("acme", 1, 2)]
    assert [(p["name"], p["slots"], p["running"]) for p in limits["pools"]] == [("linux", 1, 2)]
    assert [(p["name"], p["running"]) for p in limits["projects"]] == [("web", 2)]
    overview = reads.overview(world.conn)
    assert [(o["name"], o["running"]) for o in overview["organizations"]] == [("acme", 2)]
    assert [(p["name"], p["running"]) for p in overview["pools"]] == [("linux", 2)]
    for c in claims[1:]:
        world.complete(c)
    overview = reads.overview(world.conn)
    assert [o["running"] for o in overview["organizations"] + overview["pools"]] == [0, 0]


def test_explain_counts_held_slots_above_a_lowered_limit(world):
    two_running_above_lowered_limits(world)
    job = world.job()
    reasons = explain_job(world.conn, job_id=job["id"])["reasons"]
    assert [(r["code"], r["message"]) for r in reasons] == [
        ("capacity_organization", "organization acme: 2 of 1 running"),
        ("capacity_pool", "pool linux: 2 of 1 slots")]
    assert reasons[1]["details"] == {"pool": "linux", "running": 2, "slots": 1}


@pytest.mark.parametrize("kind", ["organization", "pool"])
def test_lock_before_a_limit_change_still_locks_the_row(world, db_url, kind):
    """lock_organization / lock_pool read ``running`` from the slots but still lock the
    organization's or pool's row (FOR UPDATE): a second locker cannot have it meanwhile."""
    world.setup()
    table = "organizations" if kind == "organization" else "pools"
    name = "acme" if kind == "organization" else "linux"
    lock = Q.lock_organization if kind == "organization" else Q.lock_pool
    with world.conn.transaction():
        row = lock(world.conn, name=name)
        assert row["name"] == name and row["running"] == 0
        with db.connect(db_url) as other:
            with pytest.raises(Exception) as info:
                other.execute(f"SELECT id FROM {table} WHERE name = %s FOR UPDATE NOWAIT", (name,))
            assert getattr(info.value, "sqlstate", None) == "55P03"


def test_consistency_checks_read_the_slots(world):
    """tests/faults' checkers (consistency.violations, invariants.check_invariants) hold an
    organization's and a pool's held slots to their running attempts, one slot of each per
    running job, and no slot to a job that is not running (or of another pool)."""
    world.setup(org_limit=3, pool_slots=3, pools=("linux", "mac"))
    runner = world.runner(slots=8)
    world.job()
    world.job()
    done, run = world.claim(runner), world.claim(runner)
    world.complete(done)
    a, b = done.job_id, run.job_id
    assert consistency.violations(world.conn) == []
    assert check_invariants(world.conn) == []
    snap = consistency.snapshot(world.conn)
    assert [r["running"] for r in snap["organizations"] + snap["pools"]] == [1, 1, 0]
    assert [r["job_id"] for r in snap["organization_slots"] + snap["pool_slots"]] == [b, b]

    def caught(corrupt: str, undo: str, lines: list[str], checks: list[str]) -> None:
        world.conn.execute(corrupt)
        try:
            assert sorted(consistency.violations(world.conn)) == sorted(lines)
            assert sorted(check_invariants(world.conn)) == sorted(checks)
            assert consistency.snapshot(world.conn) != snap
        finally:
            world.conn.execute(undo)
        assert consistency.violations(world.conn) == [] and check_invariants(world.conn) == []

    slot_no = world.conn.execute("SELECT slot_no FROM organization_slots WHERE job_id = %s",
                                 (b,)).fetchone()["slot_no"]
    caught(f"UPDATE organization_slots SET job_id = NULL WHERE job_id = {b}",
           f"UPDATE organization_slots SET job_id = {b} WHERE slot_no = {slot_no}",
           ["organization acme: held slots 0, running attempts 1",
            f"job {b} is running but holds 0 slots of its organization acme"],
           ["counters: organization acme holds 0 slots but 1 attempts are running",
            f"counters: running job {b} holds 0 slots of its organization"])
    caught(f"UPDATE pool_slots s SET job_id = {a} FROM pools q "
           f"WHERE q.id = s.pool_id AND q.name = 'linux' AND s.slot_no = 3",
           f"UPDATE pool_slots SET job_id = NULL WHERE job_id = {a}",
           ["pool linux: held slots 2, running attempts 1",
            f"pool linux: slot 3 is held by job {a}, which is succeeded, of pool linux"],
           ["counters: pool linux holds 2 slots but 1 attempts are running",
            f"counters: pool linux slot 3 is held by job {a}, which is succeeded"])
    caught(f"UPDATE pool_slots s SET job_id = {b} FROM pools q "
           f"WHERE q.id = s.pool_id AND q.name = 'mac' AND s.slot_no = 1",
           f"UPDATE pool_slots s SET job_id = NULL FROM pools q "
           f"WHERE q.id = s.pool_id AND q.name = 'mac'",
           ["pool mac: held slots 1, running attempts 0",
            f"pool mac: slot 1 is held by job {b}, which is running, of pool linux"],
           ["counters: pool mac holds 1 slots but 0 attempts are running",
            f"counters: pool mac slot 1 is held by job {b}, a running job of another pool"])
