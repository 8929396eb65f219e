"""Organization and pool capacity as stripes (sql/functions/capacity.sql; before the stripes
there was one row per slot): a limit of n is split over 8 stripes whose caps sum to n; a claim
takes a slot from a stripe with room and adds it to that stripe's held count; a release
subtracts it; lowering a limit below the held slots stops new claims only and owes the
difference; the fairness re-check runs while capacity is scarce."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from pgdispatch.sql import db, limits, transitions


def stripes(conn, kind: str) -> list[tuple[int, int]]:
    """(cap, held) of each stripe of the only organization or pool, in stripe order."""
    assert kind in {"organization", "pool"}
    return [(r["cap"], r["held"]) for r in conn.execute(
        "SELECT cap, held FROM capacity_stripes WHERE kind = %s ORDER BY stripe_no", (kind,))]


def caps(conn, kind: str) -> list[int]:
    return [cap for cap, _ in stripes(conn, kind)]


def held(conn, kind: str) -> int:
    return sum(h for _, h in stripes(conn, kind))


def room(conn, kind: str) -> int:
    return sum(cap - h for cap, h in stripes(conn, kind))


def running(conn) -> dict[str, int]:
    return conn.execute(
        "SELECT (SELECT pgd_organization_running(id) FROM organizations) AS org,"
        "       (SELECT pgd_pool_running(id) FROM pools) AS pool").fetchone()


def scarce(conn) -> bool:
    return conn.execute(
        "SELECT pgd_capacity_scarce(o.id, q.id, pgd_racing_claims()) AS scarce"
        "  FROM organizations o, pools q").fetchone()["scarce"]


def owed(conn) -> dict[str, int]:
    return {r["kind"]: r["owed"] for r in conn.execute("SELECT kind, owed FROM capacity_debts")}


def stripe_violations(conn) -> list:
    """Every owner whose stripes break the invariant of sql/functions/capacity.sql: caps minus
    what is owed equal the limit; a stripe's held count is its running attempts' slots; while
    anything is owed every stripe is full."""
    return conn.execute("""
        WITH owners AS (
            SELECT 'organization' AS kind, id, max_running AS lim FROM organizations
            UNION ALL SELECT 'pool', id, slots FROM pools
        ), attempts_held AS (
            SELECT 'organization' AS kind, p.organization_id AS owner_id,
                   a.organization_stripe AS stripe_no, count(*) AS n
              FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
             WHERE a.state = 'running' GROUP BY 1, 2, 3
            UNION ALL
            SELECT 'pool', j.pool_id, a.pool_stripe, count(*)
              FROM attempts a JOIN jobs j ON j.id = a.job_id
             WHERE a.state = 'running' GROUP BY 1, 2, 3
        )
        SELECT o.kind, o.id, o.lim, sum(s.cap) AS caps, coalesce(max(d.owed), 0) AS owed,
               array_agg(s.held ORDER BY s.stripe_no) AS held,
               array_agg(coalesce(h.n, 0) ORDER BY s.stripe_no) AS attempts
          FROM owners o
          JOIN capacity_stripes s ON s.kind = o.kind AND s.owner_id = o.id
          LEFT JOIN capacity_debts d ON d.kind = o.kind AND d.owner_id = o.id
          LEFT JOIN attempts_held h ON (h.kind, h.owner_id, h.stripe_no) = (s.kind, s.owner_id, s.stripe_no)
         GROUP BY o.kind, o.id, o.lim
        HAVING sum(s.cap) - coalesce(max(d.owed), 0) <> o.lim
            OR count(*) <> 8
            OR bool_or(s.held <> coalesce(h.n, 0))
            OR (coalesce(max(d.owed), 0) > 0 AND bool_or(s.held < s.cap))
        """).fetchall()


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


def test_a_limit_is_split_over_eight_stripes_and_follows_the_limit(world):
    world.setup(org_limit=3, pool_slots=19)
    assert stripes(world.conn, "organization") == [(1, 0)] * 3 + [(0, 0)] * 5
    assert caps(world.conn, "pool") == [3, 3, 3, 2, 2, 2, 2, 2]
    world.apply({"organizations": [{"name": "acme", "max_running": 5}],
                 "pools": [{"name": "linux", "slots": 1}]})
    assert caps(world.conn, "organization") == [1] * 5 + [0] * 3
    assert caps(world.conn, "pool") == [1] + [0] * 7
    assert stripe_violations(world.conn) == [] and owed(world.conn) == {}


def test_claims_hold_one_slot_each_and_completions_free_it(world):
    world.setup(org_limit=2, pool_slots=5)
    runner = world.runner()
    for _ in range(3):
        world.job()
    first, second = world.claim(runner), world.claim(runner)
    assert world.claim(runner) is None  # the organization's two slots are held
    assert running(world.conn) == {"org": 2, "pool": 2}
    assert stripes(world.conn, "organization") == [(1, 1), (1, 1)] + [(0, 0)] * 6
    recorded = world.conn.execute(
        "SELECT organization_stripe AS s FROM attempts WHERE id = ANY (%s) ORDER BY s",
        ([first.attempt_id, second.attempt_id],)).fetchall()
    assert [r["s"] for r in recorded] == [1, 2]
    assert stripe_violations(world.conn) == []
    world.complete(first)
    assert running(world.conn) == {"org": 1, "pool": 1}
    assert stripe_violations(world.conn) == []
    assert world.claim(runner) is not None


def test_lowering_a_limit_below_the_held_slots_stops_new_claims_only(world):
    """Limit 3 with 3 running, lowered to 1: the stripes are full and 2 slots are owed; the
    first two slots released are retired; only when the last of the 3 ends is one free."""
    world.setup(org_limit=3, pool_slots=10)
    runner = world.runner()
    for _ in range(5):
        world.job()
    claims = [world.claim(runner) for _ in range(3)]
    world.apply({"organizations": [{"name": "acme", "max_running": 1}]})
    assert stripes(world.conn, "organization") == [(1, 1)] * 3 + [(0, 0)] * 5
    assert owed(world.conn) == {"organization": 2}
    assert world.claim(runner) is None
    world.complete(claims[1])
    assert owed(world.conn) == {"organization": 1} and room(world.conn, "organization") == 0
    assert world.claim(runner) is None  # 2 running, limit 1
    world.complete(claims[0])
    assert owed(world.conn) == {} and room(world.conn, "organization") == 0
    assert world.claim(runner) is None  # 1 running, limit 1
    assert stripe_violations(world.conn) == []
    world.complete(claims[2])
    assert room(world.conn, "organization") == 1
    assert world.claim(runner) is not None
    assert world.claim(runner) is None
    assert running(world.conn)["org"] == 1
    assert stripe_violations(world.conn) == []


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
    assert held(world.conn, "organization") == 4 and room(world.conn, "organization") == 1
    assert world.claim(runner) is not None and world.claim(runner) is None
    world.complete(claims[0])
    assert running(world.conn)["org"] == 4
    assert stripe_violations(world.conn) == []


def test_a_batch_release_retires_no_more_than_is_owed(world):
    world.setup(org_limit=10, pool_slots=4)
    runner = world.runner()
    got = six_jobs_claimed_in_one_batch(world, runner)
    assert len(got) == 4
    world.apply({"pools": [{"name": "linux", "slots": 2}]})
    assert owed(world.conn) == {"pool": 2}
    complete_in_one_batch(world, got[:3])
    assert owed(world.conn) == {}
    assert held(world.conn, "pool") == 1 and room(world.conn, "pool") == 1
    assert stripe_violations(world.conn) == []
    assert world.claim(runner) is not None and world.claim(runner) is None


def test_a_batch_takes_as_many_as_the_organization_and_pool_slots_give(world):
    world.setup(org_limit=3, pool_slots=5)
    runner = world.runner()
    got = six_jobs_claimed_in_one_batch(world, runner)
    assert len(got) == 3
    assert running(world.conn) == {"org": 3, "pool": 3}
    assert stripe_violations(world.conn) == []
    answers = complete_in_one_batch(world, got)
    assert all(a["status"] == "recorded" for a in answers)
    assert running(world.conn) == {"org": 0, "pool": 0}
    assert stripe_violations(world.conn) == []


def test_a_batch_takes_slots_from_as_many_stripes_as_it_needs(world):
    """A pool of 16 is 2 slots a stripe: a batch of 6 takes three stripes' slots, each
    attempt records its stripe, and the batch completion gives each its slots back."""
    world.setup(org_limit=100, pool_slots=16)
    runner = world.runner()
    got = six_jobs_claimed_in_one_batch(world, runner)
    assert len(got) == 6
    full = [h for cap, h in stripes(world.conn, "pool") if h]
    assert full == [2, 2, 2]
    assert stripe_violations(world.conn) == []
    complete_in_one_batch(world, got[1:5])
    assert held(world.conn, "pool") == 2 and stripe_violations(world.conn) == []


def test_an_expired_lease_frees_its_slots(world):
    world.setup(org_limit=1, pool_slots=1)
    runner = world.runner()
    world.job(max_attempts=3)
    c = world.claim(runner)
    world.expire_now(c.attempt_id)
    transitions.expire_leases(world.conn)
    assert running(world.conn) == {"org": 0, "pool": 0}
    assert stripe_violations(world.conn) == []


def test_a_claim_passes_locked_stripes_and_never_waits_for_one(world, db_url):
    """Another transaction holds every pool stripe with room but one: the claim takes that
    one. With all of them held, the claim finds nothing at once (lock_timeout would fail a
    claim that waited)."""
    world.setup(org_limit=100, pool_slots=8)
    runner = world.runner()
    for _ in range(3):
        world.job()
    with db.connect(db_url, application_name="stripe-holder") as other:
        with other.transaction():
            other.execute("SELECT 1 FROM capacity_stripes WHERE kind = 'pool' AND stripe_no <> 5"
                          " FOR UPDATE")
            world.conn.execute("SET lock_timeout = '500ms'")
            c = world.claim(runner)
            assert c is not None
            row = world.conn.execute("SELECT pool_stripe FROM attempts WHERE id = %s",
                                     (c.attempt_id,)).fetchone()
            assert row["pool_stripe"] == 5
            with other.transaction():
                other.execute("SELECT 1 FROM capacity_stripes WHERE kind = 'pool' FOR UPDATE")
            # stripe 5 is full now; the others are locked (by a transaction that stays open:
            # a claim that waited for one would fail on lock_timeout, not return None)
            assert world.claim(runner) is None
    assert world.claim(runner) is not None
    assert stripe_violations(world.conn) == []


def test_the_stripes_hold_at_most_their_caps(world):
    """The CHECK of capacity_stripes (sql/schema.sql): an update past a stripe's cap fails,
    whoever makes it."""
    world.setup(org_limit=1, pool_slots=1)
    with pytest.raises(psycopg.errors.CheckViolation):
        world.conn.execute("UPDATE capacity_stripes SET held = held + 1 WHERE stripe_no = 2")


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
    """The scarcity rule as the slot rows first had it, from plain counts: a limit below the
    racing claims, or more slots held than the limit leaves for them."""
    row = conn.execute(
        "SELECT o.max_running AS org_limit, q.slots AS pool_limit, pgd_racing_claims() AS racing,"
        "       (SELECT count(*) FROM jobs j WHERE j.state = 'running') AS org_held,"
        "       (SELECT count(*) FROM jobs j WHERE j.state = 'running' AND j.pool_id = q.id) AS pool_held"
        "  FROM organizations o, pools q").fetchone()
    r = row["racing"]
    return (row["org_limit"] < r or row["pool_limit"] < r
            or row["org_held"] > row["org_limit"] - r or row["pool_held"] > row["pool_limit"] - r)


def test_scarcity_read_from_free_slots_agrees_with_the_held_count(world):
    """pgd_capacity_scarce (sql/functions/capacity.sql) reads the free slots from the stripes
    where the slot rows' first rule counted held slots: over limits on either side of twice the
    racing claims, 0 to 30 jobs held, 1 to 61 racing and limits lowered below the held jobs
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
    organization limit of 6; once they have made 20 claims an operator lowers it to 2 while up
    to 4 jobs run, and the loops go on until 30 more claims. Every claim stamped after the
    lowering returned must find, counting itself, at most 2 attempts of the organization
    running at its claimed_at (the jobs already running may finish above the limit; nothing
    new may start until they do)."""
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
    # counted claims, not seconds: on a busy machine a fixed time may hold few of them
    deadline = time.monotonic() + 60
    while sum(claimed) < 20 and not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    limits.set_organization_limit(world.conn, organization="acme", max_running=2,
                                  expected_max_running=6, actor="alice")
    lowered_at = world.conn.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
    while not errors and time.monotonic() < deadline and world.conn.execute(
            "SELECT count(*) AS n FROM attempts WHERE claimed_at > %s", (lowered_at,)).fetchone()["n"] < 30:
        time.sleep(0.02)
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
    assert held(world.conn, "organization") == 0 and sum(caps(world.conn, "organization")) == 2
    assert owed(world.conn) == {} and stripe_violations(world.conn) == []
