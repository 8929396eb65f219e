"""Claims racing on real connections: one job, one slot, a loaded system, one target.

Every race here is paired with a demonstration that the same harness reports the fault when
the claim is replaced by a deliberately broken copy (``pgd_claim_broken`` in harness.py,
installed in that test's database only).
"""

from __future__ import annotations

from pgdispatch.sql import Conflict, transitions

from .harness import (broken_claim, check_now, install_broken_claim, raise_first_error, run_load,
                      run_together)

LEASE_S = 30.0


def real_claim(runner_id: int, pool_ids: list[int]):
    """A racer's claim through sql.transitions (pgd_claim)."""
    def claim(conn):
        return transitions.claim(conn, runner_id=runner_id, pools=pool_ids,
                                 claim_token=transitions.new_claim_token(), lease_seconds=LEASE_S)
    return claim


def bad_claim(runner_id: int, pool_ids: list[int], *, sleep_s: float, skip_locked: bool):
    def claim(conn):
        return broken_claim(conn, runner_id=runner_id, pools=pool_ids, sleep_s=sleep_s,
                            skip_locked=skip_locked)
    return claim


def count(conn, sql: str, *args) -> int:
    return conn.execute(sql, args).fetchone()["n"]


# --- (a) eight claimers, one queued job -------------------------------------------------

def race_for_one_job(world, db_url, make_claim, *, claimers: int = 8) -> dict:
    """Queue one job, release ``claimers`` racers at once; report what they got."""
    job = world.job()
    outcomes = run_together(db_url, [make_claim] * claimers)
    row = world.row("jobs", job["id"])
    return {
        "claims": [o.value for o in outcomes if o.value is not None],
        "errors": [o.error for o in outcomes if o.error is not None],
        "attempts": count(world.conn, "SELECT count(*) AS n FROM attempts WHERE job_id = %s", job["id"]),
        "generation": row["generation"],
        "job": job["id"],
    }


def test_eight_claimers_on_one_job_make_exactly_one_attempt(world, db_url):
    world.setup()
    runner = world.runner(slots=8)
    claim = real_claim(runner, world.pool_ids(("linux",)))
    for round_no in range(5):
        r = race_for_one_job(world, db_url, claim)
        if r["errors"]:
            raise r["errors"][0]
        assert len(r["claims"]) == 1, f"round {round_no}: {len(r['claims'])} claims returned"
        assert r["claims"][0].job_id == r["job"] and r["claims"][0].generation == 1
        assert r["attempts"] == 1 and r["generation"] == 1
        assert world.counters() == {"org": round_no + 1, "project": round_no + 1,
                                    "pool": round_no + 1, "attempts": round_no + 1}
    assert check_now(world.conn) == []


def test_harness_catches_a_claim_without_skip_locked(world, db_url):
    """The broken claim neither locks the job nor re-checks its state: all eight racers
    read it queued and each takes a slot from a stripe. The database's backstop still
    refuses every claim of it but the first: the partial unique index of running attempts
    (one per job) refuses the second attempt, so the harness sees seven errors, and their
    slots go back with their transactions. (With the slot rows that came before the stripes, the
    partial unique index of held organization slots, one per job, was hit first; stripes count
    slots and name no job, so there is no such index.) With that backstop dropped it sees eight
    claims, eight attempts, generation 8, and eight slots held for one job."""
    world.setup()
    runner = world.runner(slots=8)
    install_broken_claim(world.conn)
    claim = bad_claim(runner, world.pool_ids(("linux",)), sleep_s=0.2, skip_locked=False)

    r = race_for_one_job(world, db_url, claim)
    assert len(r["claims"]) == 1 and len(r["errors"]) == 7
    assert all(isinstance(e, Conflict) and "attempts_one_running_per_job" in str(e) for e in r["errors"])
    assert world.counters() == {"org": 1, "project": 1, "pool": 1, "attempts": 1}
    assert check_now(world.conn) == []

    world.conn.execute("DROP INDEX attempts_one_running_per_job")
    r = race_for_one_job(world, db_url, claim)
    assert not r["errors"]
    assert len(r["claims"]) == 8 and r["attempts"] == 8 and r["generation"] == 8
    # (each claim counts on its project as it takes its slots: 9, as many as the slots)
    assert world.counters() == {"org": 9, "project": 9, "pool": 9, "attempts": 9}


# --- (b) the last organization slot -------------------------------------------------------

def race_for_last_slot(world, db_url, make_claim) -> dict:
    """Two claimers at once; ``org_running`` is acme's held slots afterwards."""
    outcomes = run_together(db_url, [make_claim, make_claim])
    raise_first_error(outcomes)
    org = world.conn.execute("SELECT sum(s.held)::integer AS n FROM capacity_stripes s "
                             "JOIN organizations o ON o.id = s.owner_id "
                             "WHERE s.kind = 'organization' AND o.name = 'acme'").fetchone()
    return {"claims": sum(o.value is not None for o in outcomes), "org_running": org["n"],
            "running_attempts": world.counters()["attempts"]}


def test_two_claimers_for_the_last_organization_slot_admit_one(world, db_url):
    world.setup(org_limit=5)
    runner = world.runner(slots=8)
    pools = world.pool_ids(("linux",))
    claim = real_claim(runner, pools)
    for _ in range(12):
        world.job()
    held = [world.claim(runner) for _ in range(4)]
    for round_no in range(5):
        r = race_for_last_slot(world, db_url, claim)
        assert r == {"claims": 1, "org_running": 5, "running_attempts": 5}, f"round {round_no}: {r}"
        assert check_now(world.conn) == []
        # free one slot for the next round: back to 4 of 5
        c = held.pop(0) if held else None
        if c is None:
            row = world.conn.execute("SELECT a.id, a.generation, a.claim_token FROM attempts a "
                                     "WHERE a.state = 'running' ORDER BY a.id LIMIT 1").fetchone()
            transitions.complete(world.conn, attempt_id=row["id"], generation=row["generation"],
                                 outcome="succeeded", receipt_key=f"{row['claim_token']}:complete")
        else:
            world.complete(c)


def test_harness_catches_a_claim_with_a_stale_capacity_check(world, db_url):
    """Both broken claimers read 4 of 5 slots held, sleep, and both take a slot: one takes
    the last stripe with room, the other (finding none free) a full stripe with its cap
    raised past the limit: 6 of 5, and caps that no longer sum to the limit."""
    world.setup(org_limit=5)
    runner = world.runner(slots=8)
    install_broken_claim(world.conn)
    for _ in range(6):
        world.job()
    for _ in range(4):
        world.claim(runner)
    claim = bad_claim(runner, world.pool_ids(("linux",)), sleep_s=0.3, skip_locked=True)
    r = race_for_last_slot(world, db_url, claim)
    assert r == {"claims": 2, "org_running": 6, "running_attempts": 6}
    found = check_now(world.conn)
    assert "organization acme: 6 running, limit 5" in found
    assert "organization acme: 8 stripes with caps 6 and 0 owed do not split the limit 5" in found


# --- (c) a loaded system: organizations, project bounds and a pool ---------------------

LOOPS = 12  # more claim->complete loops than the pool's 8 slots, or its limit could not be exceeded


def build_loaded_world(world, *, jobs_per_project: int) -> tuple[int, list[int]]:
    """Two organizations of 5, each with two projects bounded at 3, sharing pool linux (8):
    every limit can bind (5 + 5 > 8, 3 + 3 > 5)."""
    world.apply({
        "organizations": [{"name": "acme", "max_running": 5}, {"name": "globex", "max_running": 5}],
        "pools": [{"name": "linux", "slots": 8}],
        "projects": [
            {"name": "web", "organization": "acme", "pools": ["linux"], "max_running": 3},
            {"name": "api", "organization": "acme", "pools": ["linux"], "max_running": 3},
            {"name": "shop", "organization": "globex", "pools": ["linux"], "max_running": 3},
            {"name": "ops", "organization": "globex", "pools": ["linux"], "max_running": 3},
        ],
    })
    runner = world.runner(slots=LOOPS)
    for i in range(jobs_per_project):
        for project in ("web", "api", "shop", "ops"):
            world.job(project=project, command=["echo", str(i)])
    return runner, world.pool_ids(("linux",))


def test_loaded_claimers_never_exceed_any_limit_and_reach_every_one(world, db_url):
    """300 short jobs through 12 claim -> complete loops. Sampled held slots and counters
    never pass their limits nor disagree with the running attempts, and the stripes' caps
    always split the limits; the sweep of the attempts' [claimed_at, finished_at) finds every
    limit reached and none exceeded (this sweep failed with "pool linux: 12 of 8" while those
    columns were stamped with now(): see harness.py); every job ran exactly once."""
    runner, pools = build_loaded_world(world, jobs_per_project=75)
    # holds of 2-10 ms: since completions stopped queueing behind their project's claims (the
    # project claim lock, sql/functions/capacity.sql) jobs end sooner, and with 1-5 ms the
    # pool's 8 slots were filled at once in only some runs
    report = run_load(db_url, claim=real_claim(runner, pools), loops=LOOPS, total_jobs=300,
                      hold_s=(0.002, 0.010))
    if report.errors:
        raise report.errors[0]
    assert report.completed == 300
    assert report.retries == 0, "a deadlock: some transaction broke the lock order"
    assert report.watcher.samples >= 20, "the watcher hardly sampled"
    assert report.watcher.violations == []
    assert report.over_limit() == {}
    # every limit was reached, so the bound above was really tested
    expected = {k: v for k, v in report.limits.items() if k[0] != "target"}
    assert {k: report.overlaps.get(k) for k in expected} == expected

    c = world.conn
    jobs = c.execute("SELECT state, generation, attempts_made, count(*) AS n FROM jobs "
                     "GROUP BY 1, 2, 3").fetchall()
    assert jobs == [{"state": "succeeded", "generation": 1, "attempts_made": 1, "n": 300}]
    attempts = c.execute("SELECT state, attempt_no, generation, count(*) AS n, "
                         "count(DISTINCT job_id) AS jobs FROM attempts GROUP BY 1, 2, 3").fetchall()
    assert attempts == [{"state": "succeeded", "attempt_no": 1, "generation": 1, "n": 300, "jobs": 300}]
    assert count(c, "SELECT count(*) AS n FROM delivery_receipts") == 300
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert len([n for n in report.per_loop if n > 0]) >= LOOPS // 2, report.per_loop


def test_harness_catches_overadmission_under_load(world, db_url):
    """The same load with the stale-read claim: the watcher sees held slots and counters
    over their limits (and stripe caps raised past them) and the sweep of the attempts' intervals sees more attempts than the
    limits at once."""
    runner, pools = build_loaded_world(world, jobs_per_project=15)
    install_broken_claim(world.conn)
    report = run_load(db_url, claim=bad_claim(runner, pools, sleep_s=0.03, skip_locked=True),
                      loops=LOOPS, total_jobs=60, hold_s=(0.005, 0.015))
    if report.errors:
        raise report.errors[0]
    over = report.over_limit()
    assert over, f"the sweep missed the over-admission: {report.overlaps}"
    assert any(k[0] == "pool" or k[0] == "organization" for k in over), over
    assert any("running, limit" in v for v in report.watcher.violations), report.watcher.violations[:5]


# --- (d) deployments to one target ---------------------------------------------------------

DEPLOYERS = (("acme", "web", "deploy-a"), ("globex", "shop", "deploy-b"), ("initech", "ops", "deploy-c"))


def build_deploy_world(world, *, deployments: int, builds: int) -> tuple[int, list[int]]:
    """Three organizations, each with its own project and pool, all deploying to one target:
    claims share no organization, project or pool row, so the target row is the only thing
    that can stop a second holder (and builds on the same pools keep the claimers busy)."""
    world.apply({
        "organizations": [{"name": org, "max_running": 100} for org, _, _ in DEPLOYERS],
        "pools": [{"name": pool, "slots": 8} for _, _, pool in DEPLOYERS],
        "projects": [{"name": project, "organization": org, "pools": [pool]}
                     for org, project, pool in DEPLOYERS],
        "targets": [{"name": "production"}],
    })
    pools = tuple(pool for _, _, pool in DEPLOYERS)
    runner = world.runner(pools=pools, slots=24)
    for i in range(max(deployments, builds)):
        _, project, pool = DEPLOYERS[i % len(DEPLOYERS)]
        if i < deployments:
            world.job(project=project, pool=pool, target="production", command=["deploy", str(i)])
        if i < builds:
            world.job(project=project, pool=pool, command=["build", str(i)])
    return runner, world.pool_ids(pools)


def test_deployment_claimers_never_make_two_holders_of_a_target(world, db_url):
    runner, pools = build_deploy_world(world, deployments=30, builds=30)
    report = run_load(db_url, claim=real_claim(runner, pools), loops=6, total_jobs=60,
                      hold_s=(0.002, 0.006))
    if report.errors:
        raise report.errors[0]
    assert report.completed == 60
    assert report.retries == 0, "a deadlock: some transaction broke the lock order"
    assert report.watcher.samples >= 20
    assert report.watcher.violations == []
    assert report.overlaps[("target", "production")] == 1
    assert report.over_limit() == {}
    c = world.conn
    assert count(c, "SELECT count(*) AS n FROM jobs WHERE state = 'succeeded'") == 60
    assert c.execute("SELECT state, holder_job_id FROM targets").fetchall() == [
        {"state": "free", "holder_job_id": None}]
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}


def test_harness_catches_two_holders_of_a_target(world, db_url):
    """The broken claim checks the target on a stale read. With the database's backstop
    (the partial unique index jobs_one_holder_per_target) the second holder is refused with
    an error; with it dropped, the watcher and the sweep both see two holders."""
    runner, pools = build_deploy_world(world, deployments=12, builds=0)
    install_broken_claim(world.conn)
    claim = bad_claim(runner, pools, sleep_s=0.1, skip_locked=True)

    report = run_load(db_url, claim=claim, loops=4, total_jobs=12)
    assert report.errors, "the unique index should have refused a second holder"
    assert all(isinstance(e, Conflict) and "jobs_one_holder_per_target" in str(e) for e in report.errors)

    world.conn.execute("DROP INDEX jobs_one_holder_per_target")
    report = run_load(db_url, claim=claim, loops=4, total_jobs=12 - report.completed)
    if report.errors:
        raise report.errors[0]
    assert report.overlaps[("target", "production")] >= 2
    assert ("target", "production") in report.over_limit()
    assert any(v.startswith("target production") for v in report.watcher.violations)
