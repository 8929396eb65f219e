"""Organization and pool capacity as slot rows (migration 0008): a limit of n is slot rows
1..n; claims take free ones within the limit, releases free them; lowering a limit stops new
claims only; the fairness re-check runs while capacity is scarce."""

from __future__ import annotations

import threading
import time

from sql import console, db, transitions


def slots(conn, table: str) -> list[tuple[int, bool]]:
    """(slot_no, held) of every row of ``table`` (organization_slots or pool_slots)."""
    assert table in {"organization_slots", "pool_slots"}
    return [(r["slot_no"], r["job_id"] is not None)
            for r in conn.execute(f"SELECT slot_no, job_id FROM {table} ORDER BY slot_no")]


def running(conn) -> dict[str, int]:
    return conn.execute(
        "SELECT (SELECT pgd_organization_running(id) FROM organizations) AS org,"
        "       (SELECT pgd_pool_running(id) FROM pools) AS pool").fetchone()


def scarce(conn) -> bool:
    return conn.execute(
        "SELECT pgd_capacity_scarce(o.id, q.id, pgd_racing_claims()) AS scarce"
        "  FROM organizations o, pools q").fetchone()["scarce"]


def six_jobs_claimed_in_one_batch(world, runner: int) -> list:
    """Submit six jobs and claim them with one claim_batch (as many as capacity gives)."""
    for _ in range(6):
        world.job()
    return transitions.claim_batch(world.conn, runner_id=runner, pools=world.pool_ids(("linux",)),
                                   claim_tokens=[transitions.new_claim_token() for _ in range(6)],
                                   lease_seconds=30)


def complete_in_one_batch(world, claims) -> list:
    """Report every claim of ``claims`` succeeded with one complete_batch; the answers."""
    return transitions.complete_batch(
        world.conn, items=[{"attempt_id": c.attempt_id, "generation": c.generation,
                            "outcome": "succeeded", "receipt_key": c.receipt_key} for c in claims])


def test_a_limit_is_its_slot_rows_and_follows_the_limit(world):
    world.setup(org_limit=3, pool_slots=2)
    assert slots(world.conn, "organization_slots") == [(1, False), (2, False), (3, False)]
    assert slots(world.conn, "pool_slots") == [(1, False), (2, False)]
    world.apply({"organizations": [{"name": "acme", "max_running": 5}],
                 "pools": [{"name": "linux", "slots": 1}]})
    assert [n for n, _ in slots(world.conn, "organization_slots")] == [1, 2, 3, 4, 5]
    assert slots(world.conn, "pool_slots") == [(1, False)]


def test_claims_hold_one_slot_each_and_completions_free_it(world):
    world.setup(org_limit=2, pool_slots=5)
    runner = world.runner()
    for _ in range(3):
        world.job()
    first, second = world.claim(runner), world.claim(runner)
    assert world.claim(runner) is None  # the organization's two slots are held
    assert running(world.conn) == {"org": 2, "pool": 2}
    held = world.conn.execute("SELECT job_id FROM organization_slots WHERE job_id IS NOT NULL"
                              " ORDER BY job_id").fetchall()
    assert [r["job_id"] for r in held] == sorted([first.job_id, second.job_id])
    world.complete(first)
    assert running(world.conn) == {"org": 1, "pool": 1}
    assert world.claim(runner) is not None


def owed(conn) -> dict[str, int]:
    return {r["kind"]: r["owed"] for r in conn.execute("SELECT kind, owed FROM slot_retirements")}


def test_lowering_a_limit_below_the_held_slots_stops_new_claims_only(world):
    """Limit 3 with 3 running, lowered to 1: the 3 stay held and 2 retirements are owed; the
    first two slots freed are deleted; only when the last of the 3 ends is a slot free again."""
    world.setup(org_limit=3, pool_slots=10)
    runner = world.runner()
    for _ in range(5):
        world.job()
    claims = [world.claim(runner) for _ in range(3)]
    world.apply({"organizations": [{"name": "acme", "max_running": 1}]})
    assert slots(world.conn, "organization_slots") == [(1, True), (2, True), (3, True)]
    assert owed(world.conn) == {"organization": 2}
    assert world.claim(runner) is None
    world.complete(claims[1])
    assert slots(world.conn, "organization_slots") == [(1, True), (3, True)]
    assert world.claim(runner) is None  # 2 running, limit 1
    world.complete(claims[0])
    assert slots(world.conn, "organization_slots") == [(3, True)] and owed(world.conn) == {}
    assert world.claim(runner) is None  # 1 running, limit 1
    world.complete(claims[2])
    assert slots(world.conn, "organization_slots") == [(3, False)]
    assert world.claim(runner) is not None
    assert world.claim(runner) is None
    assert running(world.conn)["org"] == 1


def test_raising_a_limit_cancels_what_is_owed_first(world):
    world.setup(org_limit=4, pool_slots=10)
    runner = world.runner()
    for _ in range(6):
        world.job()
    claims = [world.claim(runner) for _ in range(4)]
    world.apply({"organizations": [{"name": "acme", "max_running": 1}]})
    assert owed(world.conn) == {"organization": 3}
    world.apply({"organizations": [{"name": "acme", "max_running": 5}]})
    assert owed(world.conn) == {}
    assert [held for _, held in slots(world.conn, "organization_slots")] == [True] * 4 + [False]
    assert world.claim(runner) is not None and world.claim(runner) is None
    world.complete(claims[0])
    assert running(world.conn)["org"] == 4


def test_a_batch_release_retires_no_more_than_is_owed(world):
    world.setup(org_limit=10, pool_slots=4)
    runner = world.runner()
    got = six_jobs_claimed_in_one_batch(world, runner)
    assert len(got) == 4
    world.apply({"pools": [{"name": "linux", "slots": 2}]})
    assert owed(world.conn) == {"pool": 2}
    complete_in_one_batch(world, got[:3])
    assert owed(world.conn) == {}
    assert sorted(held for _, held in slots(world.conn, "pool_slots")) == [False, True]
    assert world.claim(runner) is not None and world.claim(runner) is None


def test_a_batch_takes_as_many_as_the_organization_and_pool_slots_give(world):
    world.setup(org_limit=3, pool_slots=5)
    runner = world.runner()
    got = six_jobs_claimed_in_one_batch(world, runner)
    assert len(got) == 3
    assert running(world.conn) == {"org": 3, "pool": 3}
    pairs = world.conn.execute(
        "SELECT o.job_id FROM organization_slots o JOIN pool_slots q USING (job_id)").fetchall()
    assert sorted(r["job_id"] for r in pairs) == sorted(c.job_id for c in got)
    answers = complete_in_one_batch(world, got)
    assert all(a["status"] == "recorded" for a in answers)
    assert running(world.conn) == {"org": 0, "pool": 0}


def test_an_expired_lease_frees_its_slots(world):
    world.setup(org_limit=1, pool_slots=1)
    runner = world.runner()
    world.job(max_attempts=3)
    c = world.claim(runner)
    world.expire_now(c.attempt_id)
    transitions.expire_leases(world.conn)
    assert running(world.conn) == {"org": 0, "pool": 0}


def test_capacity_is_scarce_when_free_slots_are_fewer_than_the_live_runners_slots(world):
    """pool of 10, one runner of 8 slots: free 8 of 10 is enough for every racing claim,
    free 7 is not. A stopped or draining runner does not race."""
    world.setup(org_limit=100, pool_slots=10)
    runner = world.runner(slots=8)
    for _ in range(3):
        world.job()
    world.claim(runner)
    world.claim(runner)
    assert not scarce(world.conn)           # 10 - 2 = 8 free, 8 racing
    world.claim(runner)
    assert scarce(world.conn)               # 7 free, 8 racing
    other = world.runner(slots=50)
    transitions.beat_runner(world.conn, runner_id=other, is_draining=True)
    assert scarce(world.conn)
    world.apply({"pools": [{"name": "linux", "slots": 11}]})
    assert not scarce(world.conn)           # 8 free again, the draining runner left out
    transitions.beat_runner(world.conn, runner_id=other, is_draining=False)
    assert scarce(world.conn)               # 8 free, 58 racing
    world.apply({"organizations": [{"name": "acme", "max_running": 3}],
                 "pools": [{"name": "linux", "slots": 1000}]})
    transitions.stop_runner(world.conn, runner_id=other)
    assert scarce(world.conn)               # an organization limit of 3, 8 racing


def scarce_by_held_count(conn) -> bool:
    """0008's rule, from plain counts: a limit below the racing claims, or more slots held
    than the limit leaves for them."""
    row = conn.execute(
        "SELECT o.max_running AS org_limit, q.slots AS pool_limit, pgd_racing_claims() AS racing,"
        "       (SELECT count(*) FROM organization_slots s WHERE s.organization_id = o.id"
        "                                                   AND s.job_id IS NOT NULL) AS org_held,"
        "       (SELECT count(*) FROM pool_slots s WHERE s.pool_id = q.id"
        "                                           AND s.job_id IS NOT NULL) AS pool_held"
        "  FROM organizations o, pools q").fetchone()
    r = row["racing"]
    return (row["org_limit"] < r or row["pool_limit"] < r
            or row["org_held"] > row["org_limit"] - r or row["pool_held"] > row["pool_limit"] - r)


def test_scarcity_read_from_free_slots_agrees_with_the_held_count(world):
    """0013 counts free slots up to the racing claims (or held ones, whichever side is
    smaller) where 0008 counted held slots: over limits on either side of twice the racing
    claims, 0 to 30 jobs held, 1 to 61 racing and limits lowered below the held jobs
    (retirements owed), both rules give the same answer, and each answer occurs."""
    world.setup(org_limit=40, pool_slots=40)
    claimer = world.runner(slots=1)
    for _ in range(30):
        world.job()
    seen = set()
    for held in range(31):
        if held:
            assert world.claim(claimer) is not None
        if held % 5:
            continue
        for org_limit, pool_limit in [(40, 40), (40, 12), (12, 40), (3, 40), (40, 4)]:
            world.apply({"organizations": [{"name": "acme", "max_running": org_limit}],
                         "pools": [{"name": "linux", "slots": pool_limit}]})
            for extra in (0, 2, 7, 19, 60):
                other = world.runner(slots=extra) if extra else None
                expected = scarce_by_held_count(world.conn)
                assert scarce(world.conn) == expected, (held, org_limit, pool_limit, extra)
                seen.add(expected)
                if other is not None:
                    transitions.stop_runner(world.conn, runner_id=other)
        world.apply({"organizations": [{"name": "acme", "max_running": 40}],
                     "pools": [{"name": "linux", "slots": 40}]})
    assert seen == {True, False}


def test_after_a_lowering_commits_no_claim_runs_over_the_new_limit(world, db_url):
    """Four claim loops on their own connections (claim -> 20 ms -> complete) against an
    organization limit of 6; after 1 s an operator lowers it to 2 while up to 4 jobs run.
    Every claim stamped after the lowering returned must find, counting itself, at most 2
    attempts of the organization running at its claimed_at (the jobs already running may
    finish above the limit; nothing new may start until they do)."""
    world.setup(org_limit=6, pool_slots=100)
    runners = [world.runner(slots=1) for _ in range(4)]
    for _ in range(2000):
        world.job()
    pools = world.pool_ids(("linux",))
    stop = threading.Event()
    errors: list[BaseException] = []
    claimed = [0] * len(runners)

    def loop(i: int) -> None:
        try:
            with db.connect(db_url, application_name=f"racer-{i}") as conn:
                while not stop.is_set():
                    c = transitions.claim(conn, runner_id=runners[i], pools=pools,
                                          claim_token=transitions.new_claim_token(), lease_seconds=30)
                    if c is None:
                        time.sleep(0.005)
                        continue
                    claimed[i] += 1
                    time.sleep(0.02)
                    transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                         outcome="succeeded", receipt_key=c.receipt_key)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(i,), name=f"racer-{i}") for i in range(len(runners))]
    for t in threads:
        t.start()
    time.sleep(1.0)
    console.set_organization_limit(world.conn, organization="acme", max_running=2,
                                   expected_max_running=6, actor="alice")
    lowered_at = world.conn.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    over = world.conn.execute("""
        SELECT a.id, a.claimed_at,
               (SELECT count(*) FROM attempts b
                 WHERE b.claimed_at <= a.claimed_at
                   AND (b.finished_at IS NULL OR b.finished_at > a.claimed_at)) AS running
          FROM attempts a
         WHERE a.claimed_at > %s
        """, (lowered_at,)).fetchall()
    assert len(over) > 20, f"too few claims after the lowering to say anything: {len(over)}"
    assert [r for r in over if r["running"] > 2] == [], "claims over the lowered limit"
    assert running(world.conn)["org"] == 0
    assert slots(world.conn, "organization_slots") == [(n, False) for n, _ in
                                                        slots(world.conn, "organization_slots")]
    assert len(slots(world.conn, "organization_slots")) == 2 and owed(world.conn) == {}
