"""Readers of an organization's or a pool's running count: the slots its capacity stripes
hold (pgd_organization_running, pgd_pool_running; sql/functions/capacity.sql), a held slot
above a lowered limit included, as every list, the overview, explain and the consistency
checks read it."""

from __future__ import annotations

import pytest

from pgdispatch.sql import db, limits, reads
from pgdispatch.sql.explain import explain_job
from pgdispatch.sql.queries import Q

from ..faults import consistency
from ..faults.invariants import check_invariants


def two_running_above_lowered_limits(world) -> tuple[list, dict]:
    """acme (limit 3) and linux (3 slots) with 3 jobs claimed and the first completed, then
    both limits lowered to 1 by an operator: 2 running jobs hold a slot of each (in their
    stripes, now full), and 1 slot of each is owed."""
    world.setup(org_limit=3, pool_slots=3)
    runner = world.runner(slots=8)
    claims = []
    for _ in range(3):
        world.job()
        claims.append(world.claim(runner))
    world.complete(claims[0])
    changed = {
        "organization": limits.set_organization_limit(world.conn, organization="acme", max_running=1,
                                                      expected_max_running=3, actor="alice"),
        "pool": limits.set_pool_slots(world.conn, pool="linux", slots=1, expected_slots=3,
                                      actor="alice"),
    }
    return claims, changed


def test_limit_changes_answer_the_running_jobs(world):
    claims, changed = two_running_above_lowered_limits(world)
    assert changed == {"organization": {"organization": "acme", "max_running": 1, "running": 2,
                                        "changed": True},
                       "pool": {"pool": "linux", "slots": 1, "running": 2, "changed": True}}
    world.complete(claims[1])
    again = limits.set_organization_limit(world.conn, organization="acme", max_running=4,
                                          expected_max_running=1, actor="alice")
    assert again == {"organization": "acme", "max_running": 4, "running": 1, "changed": True}


def test_lists_and_overview_count_held_slots(world):
    claims, _ = two_running_above_lowered_limits(world)
    listed = limits.list_limits(world.conn)
    assert [(o["name"], o["max_running"], o["running"]) for o in listed["organizations"]] == \
        [("acme", 1, 2)]
    assert [(p["name"], p["slots"], p["running"]) for p in listed["pools"]] == [("linux", 1, 2)]
    assert [(p["name"], p["running"]) for p in listed["projects"]] == [("web", 2)]
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
        ("capacity_pool", "pool linux: 2 of 1 pool slots taken")]
    assert reasons[1]["details"] == {"pool": "linux", "running": 2, "slots": 1,
                                     "holders": {"pool": "linux"}}


@pytest.mark.parametrize("kind", ["organization", "pool"])
def test_lock_before_a_limit_change_still_locks_the_row(world, db_url, kind):
    """pgd_set_organization_limit / pgd_set_pool_slots read ``running`` from the slots but
    still lock the organization's or pool's row (FOR UPDATE), even for an unchanged save: a
    second locker cannot have it meanwhile."""
    world.setup()
    table = "organizations" if kind == "organization" else "pools"
    name = "acme" if kind == "organization" else "linux"
    with world.conn.transaction():
        if kind == "organization":
            limit = world.conn.execute("SELECT max_running FROM organizations WHERE name = %s",
                                       (name,)).fetchone()["max_running"]
            row = limits.set_organization_limit(world.conn, organization=name, max_running=limit,
                                                expected_max_running=limit, actor="adm")
        else:
            slots = world.conn.execute("SELECT slots FROM pools WHERE name = %s",
                                       (name,)).fetchone()["slots"]
            row = limits.set_pool_slots(world.conn, pool=name, slots=slots, expected_slots=slots,
                                        actor="adm")
        assert row["running"] == 0 and row["changed"] is False
        with db.connect(db_url) as other:
            with pytest.raises(Exception) as info:
                other.execute(f"SELECT id FROM {table} WHERE name = %s FOR UPDATE NOWAIT", (name,))
            assert getattr(info.value, "sqlstate", None) == "55P03"


@pytest.mark.own_database  # the consistency checks set their isolation level
def test_consistency_checks_read_the_stripes(world):
    """tests/faults' checkers (consistency.violations, invariants.check_invariants) hold an
    organization's and a pool's held slots to their running attempts, stripe by stripe: each
    running job's attempt records one stripe of each, each stripe holds exactly the running
    attempts recording it (none of a finished job, none of another pool), and the caps add
    up to the limit."""
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
    ids = {r["name"]: r["id"] for r in world.conn.execute(
        "SELECT name, id FROM organizations UNION ALL SELECT name, id FROM pools")}
    held = world.conn.execute("SELECT organization_stripe AS org, pool_stripe AS pool FROM attempts "
                              "WHERE id = %s", (run.attempt_id,)).fetchone()
    assert [(r["kind"], r["owner_id"], r["stripe_no"], r["held"]) for r in snap["stripes"] if r["held"]] == [
        ("organization", ids["acme"], held["org"], 1), ("pool", ids["linux"], held["pool"], 1)]
    # a stripe with room of linux other than b's, for a slot held by no running attempt
    spare = world.conn.execute("SELECT min(stripe_no) AS n FROM capacity_stripes WHERE kind = 'pool' "
                               "AND owner_id = %s AND held < cap", (ids["linux"],)).fetchone()["n"]
    assert spare is not None and spare != held["pool"]

    def caught(corrupt: str, undo: str, lines: list[str], checks: list[str]) -> None:
        world.conn.execute(corrupt)
        try:
            assert sorted(consistency.violations(world.conn)) == sorted(lines)
            assert sorted(check_invariants(world.conn)) == sorted(checks)
            assert consistency.snapshot(world.conn) != snap
        finally:
            world.conn.execute(undo)
        assert consistency.violations(world.conn) == [] and check_invariants(world.conn) == []

    def stripe(kind: str, owner: str, no: int, change: str) -> str:
        return (f"UPDATE capacity_stripes SET {change} WHERE kind = '{kind}' "
                f"AND owner_id = {ids[owner]} AND stripe_no = {no}")

    # b's organization slot released while b still runs
    caught(stripe("organization", "acme", held["org"], "held = held - 1"),
           stripe("organization", "acme", held["org"], "held = held + 1"),
           ["organization acme: held slots 0, running attempts 1",
            f"organization acme: stripe {held['org']} holds 0 slots, running attempts on it 1"],
           ["counters: organization acme holds 0 slots but 1 attempts are running",
            f"counters: organization acme stripe {held['org']} holds 0 slots but 1 running attempts record it"])
    # b's attempt records no organization stripe: it holds no slot of its organization
    caught(f"UPDATE attempts SET organization_stripe = NULL WHERE id = {run.attempt_id}",
           f"UPDATE attempts SET organization_stripe = {held['org']} WHERE id = {run.attempt_id}",
           [f"job {b} is running but its attempt {run.attempt_id} holds no slot of its organization acme (stripe none)",
            f"organization acme: stripe {held['org']} holds 1 slots, running attempts on it 0"],
           [f"counters: running attempt {run.attempt_id} of job {b} records organization stripe None, "
            f"which its organization does not have",
            f"counters: organization acme stripe {held['org']} holds 1 slots but 0 running attempts record it",
            f"counters: running job {b} holds 0 slots of its organization"])
    # a slot of linux still held after a (succeeded) released its
    caught(stripe("pool", "linux", spare, "held = held + 1"),
           stripe("pool", "linux", spare, "held = held - 1"),
           ["pool linux: held slots 2, running attempts 1",
            f"pool linux: stripe {spare} holds 1 slots, running attempts on it 0"],
           ["counters: pool linux holds 2 slots but 1 attempts are running",
            f"counters: pool linux stripe {spare} holds 1 slots but 0 running attempts record it"])
    # b's pool slot taken from mac, a pool b does not run in
    caught(stripe("pool", "linux", held["pool"], "held = held - 1") + "; "
           + stripe("pool", "mac", 1, "held = held + 1"),
           stripe("pool", "linux", held["pool"], "held = held + 1") + "; "
           + stripe("pool", "mac", 1, "held = held - 1"),
           ["pool linux: held slots 0, running attempts 1",
            "pool mac: held slots 1, running attempts 0",
            f"pool linux: stripe {held['pool']} holds 0 slots, running attempts on it 1",
            "pool mac: stripe 1 holds 1 slots, running attempts on it 0"],
           ["counters: pool linux holds 0 slots but 1 attempts are running",
            "counters: pool mac holds 1 slots but 0 attempts are running",
            f"counters: pool linux stripe {held['pool']} holds 0 slots but 1 running attempts record it",
            "counters: pool mac stripe 1 holds 1 slots but 0 running attempts record it"])
    # a stripe of acme with a slot more than its limit gives
    caught(stripe("organization", "acme", 8, "cap = cap + 1"),
           stripe("organization", "acme", 8, "cap = cap - 1"),
           ["organization acme: stripe caps 4 minus 0 owed, limit 3"],
           ["stripes: organization acme: caps 4 minus 0 owed, but the limit is 3"])
