"""Batched claims and completions: same guarantees as one at a time, on real connections."""

from __future__ import annotations

import threading

from pgdispatch.sql import db, transitions


def tokens(n: int) -> list[str]:
    return [transitions.new_claim_token() for _ in range(n)]


def test_claim_batch_takes_jobs_in_priority_order_within_capacity(world):
    world.setup(org_limit=5, pool_slots=8, project_limit=4)
    runner = world.runner()
    low = [world.job()["id"] for _ in range(3)]
    high = world.job(priority=5)["id"]
    world.job(pool="linux")  # a sixth, beyond every limit
    sent = tokens(10)
    got = transitions.claim_batch(world.conn, runner_id=runner, pools=world.pool_ids(("linux",)),
                                  claim_tokens=sent, lease_seconds=30)
    assert [c.job_id for c in got] == [high, *low]           # bounded by the project's 4
    assert all(c.generation == 1 and c.attempt_no == 1 for c in got)
    assert len({c.claim_token for c in got}) == 4
    assert [c.claim_token for c in got] == sent[:4]          # the tokens in the order sent
    assert world.counters() == {"org": 4, "project": 4, "pool": 4, "attempts": 4}
    # the batch's recovery finds the four that committed, each with its own token
    found = transitions.recover_claims(world.conn, claim_tokens=sent, runner_id=runner)
    assert [(c, state) for c, state in found] == [(c, "running") for c in got]


def test_concurrent_batches_never_exceed_the_organization_limit(world, db_url):
    world.setup(org_limit=5, pool_slots=50)
    runners = [world.runner(slots=10) for _ in range(4)]
    for _ in range(40):
        world.job()
    barrier = threading.Barrier(4)
    results: list[list] = [[] for _ in runners]

    def claimer(i: int) -> None:
        with db.connect(db_url) as conn:
            barrier.wait()
            results[i] = transitions.claim_batch(conn, runner_id=runners[i],
                                                 pools=world.pool_ids(("linux",)),
                                                 claim_tokens=tokens(10), lease_seconds=30)
    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    claimed = [c.job_id for r in results for c in r]
    assert len(claimed) == 5 and len(set(claimed)) == 5
    assert world.counters() == {"org": 5, "project": 5, "pool": 5, "attempts": 5}


def test_complete_batch_releases_everything_once_and_answers_repeats(world):
    world.setup(org_limit=10, pool_slots=10)
    runner = world.runner()
    for _ in range(3):
        world.job(max_attempts=2)
    got = transitions.claim_batch(world.conn, runner_id=runner, pools=world.pool_ids(("linux",)),
                                  claim_tokens=tokens(3), lease_seconds=30)
    items = [{"attempt_id": c.attempt_id, "generation": c.generation, "receipt_key": c.receipt_key,
              "outcome": o, "exit_code": e} for c, o, e in zip(got, ["succeeded", "failed", "succeeded"],
                                                             [0, 1, 0])]
    first = transitions.complete_batch(world.conn, items=items)
    assert [a["job_state"] for a in first] == ["succeeded", "queued", "succeeded"]
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    again = transitions.complete_batch(world.conn, items=items)
    assert all(a["repeated"] for a in again)
    assert world.row("jobs", got[1].job_id)["failures"] == 1
    # a stale generation in a batch is fenced without undoing the rest
    stale = dict(items[0], generation=99, receipt_key="other")
    out = transitions.complete_batch(world.conn, items=[stale])
    assert out[0]["status"] == "fenced"


def test_batch_loops_across_organizations_sharing_a_pool_never_deadlock(world, db_url):
    """Four loops claim and complete in batches while two organizations share one pool: the
    batch completion locks everything in the global order first, so no deadlock (the server's
    own count), no retry, every job done once, counters back to 0."""
    world.setup(org="acme", project="web", org_limit=6, pool_slots=8)
    world.apply({"organizations": [{"name": "globex", "max_running": 6}],
                 "projects": [{"name": "api", "organization": "globex", "pools": ["linux"]}]})
    runners = [world.runner(slots=5) for _ in range(4)]
    for i in range(160):
        world.job(project="web" if i % 2 else "api")
    deadlocks = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    before = world.conn.execute(deadlocks).fetchone()["deadlocks"]
    errors: list[BaseException] = []

    def loop(runner_id: int) -> None:
        try:
            with db.connect(db_url) as conn:
                idle = 0
                while idle < 20:
                    got = transitions.claim_batch(conn, runner_id=runner_id,
                                                  pools=world.pool_ids(("linux",)),
                                                  claim_tokens=tokens(5), lease_seconds=30)
                    if not got:
                        idle += 1
                        continue
                    idle = 0
                    transitions.complete_batch(conn, items=[
                        {"attempt_id": c.attempt_id, "generation": c.generation,
                         "receipt_key": c.receipt_key, "outcome": "succeeded", "exit_code": 0}
                        for c in got])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(r,)) for r in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    states = world.conn.execute("SELECT state, count(*) AS n FROM jobs GROUP BY state").fetchall()
    assert {r["state"]: r["n"] for r in states} == {"succeeded": 160}
    assert world.conn.execute("SELECT count(*) AS n FROM attempts").fetchone()["n"] == 160
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert world.conn.execute(deadlocks).fetchone()["deadlocks"] == before


def _mixed_round(world, runner: int, target: str, build: str, deploy_pool: str) -> tuple[list[dict], dict]:
    """Submit and claim one mixed set of work and say how to complete it: three builds that
    succeed (two of them the upstreams of a dependent waiting on both, one the upstream of a
    dependent that also waits on a job never run), a build that fails with a retry left, a
    build reported twice under one key, a deployment that succeeds, and a report with a stale
    generation. Builds run on pool ``build``, the deployment on ``deploy_pool``. Returns the
    completion items (in that order) and the ids to inspect."""
    ok = [world.job(pool=build)["id"] for _ in range(3)]
    never = world.job(pool=build, requires_approval=True)["id"]  # an approval nobody gives
    both = world.job(pool=build, depends_on=[ok[0], ok[2]])["id"]
    half = world.job(pool=build, depends_on=[ok[1], never])["id"]
    retry = world.job(pool=build, max_attempts=2)["id"]
    twice = world.job(pool=build)["id"]
    deploy = world.job(pool=deploy_pool, target=target)["id"]
    stale = world.job(pool=build)["id"]
    wanted = [*ok, retry, twice, stale]
    claims = {}
    while len(claims) < len(wanted):
        c = world.claim(runner, pools=(build,))
        claims[c.job_id] = c
    assert sorted(claims) == sorted(wanted)
    d = world.claim(runner, pools=(deploy_pool,))
    assert d.job_id == deploy, "the deployment must be the deploy pool's first claim"

    def item(c, outcome="succeeded", **kw):
        return {"attempt_id": c.attempt_id, "generation": c.generation, "outcome": outcome,
                "receipt_key": c.receipt_key, "exit_code": 0 if outcome == "succeeded" else 1, **kw}
    items = [item(claims[j]) for j in ok]
    items += [item(claims[retry], "failed"), item(claims[twice]), item(claims[twice]), item(d),
              item(claims[stale], generation=claims[stale].generation + 7)]
    return items, {"ok": ok, "both": both, "half": half, "retry": retry, "twice": twice,
                   "deploy": deploy, "stale": stale}


def _outcome(world, answers: list[dict], ids: dict, target: str) -> dict:
    """What a round left behind, without ids and times: the answers, every job's state (and
    failures, pending dependencies), the target's state."""
    keep = ("status", "job_state", "attempt_state", "is_late_report", "repeated")
    jobs = {k: [world.row("jobs", i) for i in (v if isinstance(v, list) else [v])] for k, v in ids.items()}
    return {
        "answers": [{k: a.get(k) for k in keep} for a in answers],
        "jobs": {k: [(j["state"], j["failures"], j["pending_dependencies"]) for j in v]
                 for k, v in jobs.items()},
        "target": world.conn.execute("SELECT state, holder_job_id FROM targets WHERE name = %s",
                                     (target,)).fetchone(),
    }


def test_set_based_batch_leaves_exactly_what_one_at_a_time_completion_leaves(world):
    """The fast path of pgd_complete_batch (successful builds, set-based) and the per-item
    path must be indistinguishable: the same mixed round completed once as a batch and once
    item by item leaves the same answers, job states, failures, dependents and target."""
    pools = ("linux", "deploy", "linux2", "deploy2")
    world.setup(org_limit=50, pool_slots=50, pools=pools, targets=("blue", "green"))
    runner = world.runner(pools=pools, slots=50)

    items, ids = _mixed_round(world, runner, "blue", "linux", "deploy")
    batched = transitions.complete_batch(world.conn, items=items)
    after_batch = _outcome(world, batched, ids, "blue")
    # only the job whose report was fenced still holds its slots
    assert world.counters() == {"org": 1, "project": 1, "pool": 1, "attempts": 1}

    items, ids = _mixed_round(world, runner, "green", "linux2", "deploy2")
    single = []
    for it in items:
        try:
            with world.conn.transaction():
                single.append(transitions.complete(world.conn, **it))
        except transitions.FencedOut:
            single.append({"status": "fenced"})
    after_single = _outcome(world, single, ids, "green")
    assert world.counters() == {"org": 2, "project": 2, "pool": 2, "attempts": 2}

    after_batch["target"].pop("holder_job_id"), after_single["target"].pop("holder_job_id")
    assert after_batch == after_single
    # and what that is: the dependent of two successes is queued, the other still blocked
    assert after_batch["jobs"]["both"] == [("queued", 0, 0)]
    assert after_batch["jobs"]["half"] == [("blocked", 0, 1)]
    assert [a["status"] for a in batched][-1] == "fenced"
    assert [a["repeated"] for a in batched[4:6]] == [False, True]
    receipts = world.conn.execute("SELECT count(*) AS n FROM delivery_receipts").fetchone()["n"]
    assert receipts == 2 * 6  # one per distinct key, the fenced report has none


def test_claims_answer_the_pool_and_how_long_each_job_waited(world):
    """ready_at to claimed_at, in seconds, for the scheduler's wait-time histogram
    (scheduler/metrics.py): a single claim and each job of a batch."""
    world.setup()
    runner = world.runner(slots=10)
    jobs = [world.job()["id"] for _ in range(3)]
    for age, job_id in zip((300, 200, 100), jobs):  # test-only: ready some time ago
        world.conn.execute("UPDATE jobs SET ready_at = now() - make_interval(secs => %s) "
                           "WHERE id = %s", (age, job_id))
    single = world.claim(runner)
    assert (single.job_id, single.pool) == (jobs[0], "linux")
    assert 300 <= single.wait_seconds < 330
    batch = transitions.claim_batch(world.conn, runner_id=runner, pools=world.pool_ids(("linux",)),
                                    claim_tokens=[transitions.new_claim_token() for _ in range(5)],
                                    lease_seconds=30)
    assert [(c.job_id, c.pool) for c in batch] == [(jobs[1], "linux"), (jobs[2], "linux")]
    assert 200 <= batch[0].wait_seconds < 230 and 100 <= batch[1].wait_seconds < 130
