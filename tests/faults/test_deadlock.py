"""Deadlocks (issue 3): a real one is retried; the production transitions make none.

1. An operator-like action written only for this test locks the stripe holding the job's
   organization slot and then the job — the reverse of the documented order — while a
   completion (job → target → attempt → organization stripes → pool stripes → debt rows,
   sql/functions/complete.sql) runs on the same job. The two wait for each other; PostgreSQL
   detects the cycle and aborts one transaction with SQLSTATE 40P01. The action runs in
   ``pgdispatch.sql.db.in_transaction``, so the retry path runs for real: the action's first try is the
   victim (its ``deadlock_timeout`` is the shorter one), it is retried and completes, and the
   retry is counted in ``pgdispatch_transaction_retries_total`` and logged as a WARNING by
   ``pgdispatch.sql.db``. The server's own count (``pg_stat_database.deadlocks``) goes up by one: that
   is the instrument of part 2, shown here to catch a lock-order violation.

2. Several connections run the production transitions at random for ~10 s — claim,
   complete, claim and complete in batches, expire, heartbeat, pause/resume, cancel, approve,
   retry, resolve, submit with dependencies, config apply with new limits — and the server
   counts zero deadlocks in the test's database, the process zero retries, and the stored
   state stays whole (tests/faults/consistency.py) throughout.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import threading
import time
from typing import Any

from prometheus_client import REGISTRY

from pgdispatch.sql import Conflict, FencedOut, InvalidInput, audit, config, db, transitions

from . import consistency, pause_point

WAIT_S = 30.0
RETRIES = "pgdispatch_transaction_retries_total"
LOAD_SECONDS = float(os.environ.get("PGDISPATCH_DEADLOCK_LOAD_SECONDS", "10"))


def retries(name: str, sqlstate: str = "40P01") -> float:
    """The retry counter for one transaction name (0 before the first retry)."""
    return REGISTRY.get_sample_value(RETRIES, {"name": name, "sqlstate": sqlstate}) or 0.0


def all_retries() -> float:
    """Every retry this process has counted, whatever the transaction."""
    return sum(s.value for m in REGISTRY.collect() for s in m.samples if s.name == RETRIES)


def deadlocks(conn) -> int:
    """The server's deadlock count for the current database (pg_stat_database)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return conn.execute("SELECT deadlocks FROM pg_stat_database "
                        "WHERE datname = current_database()").fetchone()["deadlocks"]


def wait_for(fn, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}; last {value!r}"
        time.sleep(0.02)


def waits_on_lock(conn, pid: int) -> bool:
    row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                       (pid,)).fetchone()
    return row is not None and row["wait_event_type"] == "Lock"


# --- 1. a real deadlock, retried -------------------------------------------------------

def reprioritize(conn, *, job_id: int, org_id: int, before_job_lock) -> int:
    """An operator-like action written only for this test: bump a job's priority and audit
    it, locking the stripe its running attempt holds its organization slot in and THEN the
    job — the reverse of the documented order.
    ``before_job_lock()`` runs between the two locks. Returns the new priority."""
    # the shorter deadlock_timeout makes this transaction the one that detects the cycle,
    # and so the one PostgreSQL aborts (superuser setting; the tests run as one)
    conn.execute("SET LOCAL deadlock_timeout = '50ms'")
    # (none on the retry: the completion has given the slot back and ended the attempt)
    conn.execute("""
        SELECT 1 FROM capacity_stripes s
         WHERE s.kind = 'organization' AND s.owner_id = %s
           AND s.stripe_no = (SELECT a.organization_stripe FROM attempts a
                               WHERE a.job_id = %s AND a.state = 'running')
           FOR UPDATE""", (org_id, job_id))
    before_job_lock()
    conn.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (job_id,))
    row = conn.execute("UPDATE jobs SET priority = priority + 1 WHERE id = %s RETURNING priority",
                       (job_id,)).fetchone()
    audit.record_event(conn, actor="alice", action="reprioritize", subject=f"job:{job_id}",
                       reason="deadlock test")
    return row["priority"]


def test_a_real_deadlock_is_retried_counted_and_logged(world, db_url, caplog):
    world.setup(org_limit=5)
    runner = world.runner()
    job = world.job()
    claim = world.claim(runner)
    org_id = world.conn.execute("SELECT id FROM organizations").fetchone()["id"]
    deadlocks_before = deadlocks(world.conn)
    action_retries, complete_retries = retries("test_reprioritize"), retries("complete")

    completer = db.connect(db_url, application_name="pgd-test-completer")
    operator = db.connect(db_url, application_name="pgd-test-operator")
    completer.execute("SET deadlock_timeout = '10s'")  # never the detector
    completer_pid = completer.info.backend_pid
    results: dict[str, Any] = {}
    tries = []

    def before_job_lock():
        tries.append(time.monotonic())
        if len(tries) == 1:
            # first try: hold the stripe until the completion holds the job and waits for
            # the stripe; the next statement then closes the cycle
            results["completer"] = threading.Thread(target=complete, name="racer-completer")
            results["completer"].start()
            wait_for(lambda: waits_on_lock(world.conn, completer_pid),
                     "the completion to wait for the organization stripe")

    def complete():
        try:
            results["completion"] = transitions.complete(
                completer, attempt_id=claim.attempt_id, generation=claim.generation,
                outcome="succeeded", exit_code=0, receipt_key=claim.receipt_key)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results["completion"] = exc

    with caplog.at_level(logging.WARNING, logger="pgdispatch.sql.db"):
        priority = db.in_transaction(operator, reprioritize, job_id=job["id"], org_id=org_id,
                                     before_job_lock=before_job_lock,
                                     tx_name="test_reprioritize")
        results["completer"].join(WAIT_S)
    assert not results["completer"].is_alive()
    completer.close()
    operator.close()  # a closing session flushes its statistics

    # the action was aborted once by the deadlock, retried, and its second try completed
    assert len(tries) == 2
    assert priority == 1 and world.row("jobs", job["id"])["priority"] == 1
    assert world.conn.execute("SELECT count(*) AS n FROM audit_events "
                              "WHERE action = 'reprioritize'").fetchone()["n"] == 1
    # the completion it raced was not the victim and went through once
    completion = results["completion"]
    assert isinstance(completion, dict), completion
    assert completion["job_state"] == "succeeded" and completion["repeated"] is False
    assert world.row("jobs", job["id"])["state"] == "succeeded"
    assert consistency.violations(world.conn) == []
    # counted, logged, and seen by the server
    assert retries("test_reprioritize") == action_retries + 1
    assert retries("complete") == complete_retries
    warnings = [r for r in caplog.records if r.name == "pgdispatch.sql.db" and r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        f"test_reprioritize: DeadlockDetected (SQLSTATE 40P01), retry 1 of {db.MAX_TRIES - 1}"]
    wait_for(lambda: deadlocks(world.conn) == deadlocks_before + 1,
             "pg_stat_database to count the deadlock")


# --- a deadlock the random load found, pinned down ------------------------------------

def test_submit_depending_on_a_job_racing_its_completion_does_not_deadlock(world, db_url):
    """pgd_submit locks its dependency FOR SHARE and then inserts the job, whose foreign keys
    take FOR KEY SHARE on the project and pool rows; pgd_complete locked organization, project,
    pool, then the job (in the first lock order; now the job first, the counter rows last). With
    the completion's locks taken FOR UPDATE the two waited for each other (40P01, found by the
    random load below); FOR NO KEY UPDATE does not block a foreign-key check, so there is no
    cycle in either order. The submit is paused (tests/faults/pause_point)
    after its dependency lock, while the completion queues behind it."""
    world.setup()
    runner = world.runner()
    world.job()
    claim = world.claim(runner)
    pause_point.install(world.conn, "jobs", "INSERT")
    deadlocks_before, retries_before = deadlocks(world.conn), all_retries()
    submitter = db.connect(db_url, application_name="pgd-test-submitter")
    completer = db.connect(db_url, application_name="pgd-test-completer")
    results: dict[str, Any] = {}

    def run(name, fn):
        def body():
            try:
                results[name] = fn()
            except BaseException as exc:  # noqa: BLE001 - reported below
                results[name] = exc
        t = threading.Thread(target=body, name=f"racer-{name}")
        t.start()
        return t

    pause_point.shut(world.conn)
    try:
        submit = run("submit", lambda: transitions.submit(
            submitter, project="web", pool="linux", command=["true"], depends_on=[claim.job_id]))
        pause_point.wait_paused(world.conn, submitter.info.backend_pid)
        complete = run("complete", lambda: transitions.complete(
            completer, attempt_id=claim.attempt_id, generation=claim.generation,
            outcome="succeeded", exit_code=0, receipt_key=claim.receipt_key))
        pause_point.wait_for_lock(world.conn, completer.info.backend_pid,
                                  what="queue behind the submit's lock on the job")
    finally:
        pause_point.open_(world.conn)
    for t in (submit, complete):
        t.join(WAIT_S)
        assert not t.is_alive()
    submitter.close()
    completer.close()
    assert isinstance(results["submit"], dict), results["submit"]
    assert isinstance(results["complete"], dict), results["complete"]
    assert results["complete"]["job_state"] == "succeeded"
    # the completion came second, so it released the new job's dependency
    assert world.row("jobs", results["submit"]["id"])["state"] == "queued"
    assert consistency.violations(world.conn) == []
    assert all_retries() == retries_before
    wait_for(lambda: world.conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name LIKE 'pgd-test-%%'"
        " AND pid <> pg_backend_pid()").fetchone()["n"] == 0, "the racers' sessions to end")
    assert deadlocks(world.conn) == deadlocks_before


def claim_in_stripe(world, db_url, stripe_no: int, claim):
    """``claim()``, steered to take its organization slot from stripe ``stripe_no``: another
    session holds every other organization stripe locked meanwhile (those not locked
    already), so that the claim, which never waits for a stripe, passes them (SKIP LOCKED).
    Returns what ``claim()`` returned."""
    with db.connect(db_url, application_name="pgd-test-steer") as steer:
        with steer.transaction():
            steer.execute("SELECT 1 FROM capacity_stripes WHERE kind = 'organization' "
                          "AND stripe_no <> %s ORDER BY owner_id, stripe_no FOR UPDATE SKIP LOCKED",
                          (stripe_no,))
            return claim()


def locked_stripes(conn, kind: str) -> list[int]:
    """The stripes of ``kind`` another session holds a row lock on: every stripe minus those
    this session can lock (FOR UPDATE SKIP LOCKED, in a transaction rolled back at once)."""
    with conn.transaction(force_rollback=True):
        every = [r["stripe_no"] for r in conn.execute(
            "SELECT stripe_no FROM capacity_stripes WHERE kind = %s ORDER BY stripe_no", (kind,))]
        lockable = {r["stripe_no"] for r in conn.execute(
            "SELECT stripe_no FROM capacity_stripes WHERE kind = %s FOR UPDATE SKIP LOCKED",
            (kind,))}
    return [n for n in every if n not in lockable]


def test_a_batch_release_and_a_limit_change_take_stripes_in_the_same_order(world, db_url):
    """A limit change locks every stripe of its organization in stripe order
    (pgd_split_capacity, sql/functions/capacity.sql). A batch completion reporting B (its slot
    in stripe 3) before A (stripe 1) must lock their stripes in the same order: freeing them
    in item order, it would hold stripe 3 while waiting for stripe 1, which the limit change
    holds while it waits for stripe 3 (40P01; as an adversarial run found with the slot rows
    that came before the stripes). pgd_release_slots locks a batch's stripes in (kind, owner,
    stripe) order first. An open batch claim that has taken a slot of stripe 2 (pgd_take_slots:
    the stripe is locked, its held count not yet raised) keeps the limit change waiting in the
    middle until both are queued; the batch runs without the retry wrapper, so a deadlock would
    surface here."""
    world.setup(org_limit=10, pool_slots=100)
    runner = world.runner(slots=4)
    world.job()
    world.job()
    a = claim_in_stripe(world, db_url, 1, lambda: world.claim(runner))
    b = claim_in_stripe(world, db_url, 3, lambda: world.claim(runner))
    stripes = {r["job_id"]: r["organization_stripe"] for r in world.conn.execute(
        "SELECT job_id, organization_stripe FROM attempts WHERE state = 'running'")}
    assert stripes == {a.job_id: 1, b.job_id: 3}
    org_id = world.conn.execute("SELECT id FROM organizations").fetchone()["id"]
    deadlocks_before = deadlocks(world.conn)
    with db.connect(db_url, application_name="pgd-test-open-claim") as holder, \
            db.connect(db_url, application_name="pgd-test-limit") as limit, \
            db.connect(db_url, application_name="pgd-test-batch") as batch:
        holder.execute("BEGIN")
        taken = claim_in_stripe(world, db_url, 2, lambda: holder.execute(
            "SELECT pgd_take_slots('organization', %s, 1) AS units", (org_id,)).fetchone())
        assert taken["units"] == [2]
        results: dict[str, Any] = {}

        def run(name, fn):
            try:
                results[name] = fn()
            except BaseException as exc:  # noqa: BLE001 - asserted below
                results[name] = exc

        items = [{"attempt_id": c.attempt_id, "generation": c.generation, "outcome": "failed",
                  "receipt_key": f"{c.receipt_key}:batch"} for c in (b, a)]
        threads = [
            threading.Thread(target=run, name="racer-limit", args=("limit", lambda: limit.execute(
                "UPDATE organizations SET max_running = 9").rowcount)),
            threading.Thread(target=run, name="racer-batch", args=("batch", lambda: batch.execute(
                "SELECT pgd_complete_batch(%s::jsonb, 2, 300)", (json.dumps(items),)).fetchall())),
        ]
        threads[0].start()
        wait_for(lambda: waits_on_lock(world.conn, limit.info.backend_pid),
                 "the limit change to wait for the open claim's stripe")
        # the limit change holds stripe 1 and waits for stripe 2 (the open claim's)
        assert locked_stripes(world.conn, "organization") == [1, 2]
        threads[1].start()
        wait_for(lambda: waits_on_lock(world.conn, batch.info.backend_pid),
                 "the batch to wait for the limit change")
        # the batch waits for stripe 1 holding no stripe (in item order it would hold 3)
        assert locked_stripes(world.conn, "organization") == [1, 2]
        holder.execute("COMMIT")
        for thread in threads:
            thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert results["limit"] == 1, results
    assert not isinstance(results["batch"], BaseException), results["batch"]
    assert deadlocks(world.conn) == deadlocks_before
    assert consistency.violations(world.conn) == []
    # both slots given back (the open claim's slot was never added), the caps split anew
    assert world.conn.execute("SELECT sum(held) AS held, sum(cap) AS caps FROM capacity_stripes "
                              "WHERE kind = 'organization'").fetchone() == {"held": 0, "caps": 9}


def test_batches_cancelling_shared_dependents_in_opposite_orders_do_not_deadlock(world, db_url):
    """D1 depends on A and C, D2 on B and E. One batch reports A and B failed, another E and C:
    item by item, the first cancels D1 then D2 and the second D2 then D1. Completions of one
    organization no longer queue behind its row (the shared rows come last in the lock order of
    sql/functions/complete.sql), so both run at once; a trigger installed only here makes each
    cancellation of a blocked job take 0.3 s, so the two overlap. pgd_lock_dependents locks
    every item's dependents by id first: no deadlock, both batches answer, D1 and D2 end
    cancelled. (Without it: 40P01, seen once.)"""
    world.setup(org_limit=10, pool_slots=10)
    runner = world.runner(slots=10)
    a, b, c, e = (world.job()["id"] for _ in range(4))
    d1 = world.job(depends_on=[a, c])["id"]
    d2 = world.job(depends_on=[b, e])["id"]
    claims = {cl.job_id: cl for cl in (world.claim(runner) for _ in range(4))}
    assert sorted(claims) == sorted([a, b, c, e])
    world.conn.execute("""
        CREATE FUNCTION test_slow_cancel() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.state = 'cancelled' AND OLD.state = 'blocked' THEN PERFORM pg_sleep(0.3); END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER test_slow_cancel BEFORE UPDATE ON jobs
            FOR EACH ROW EXECUTE FUNCTION test_slow_cancel();""")
    deadlocks_before, retries_before = deadlocks(world.conn), all_retries()

    def failed(job_id: int) -> dict[str, Any]:
        cl = claims[job_id]
        return {"attempt_id": cl.attempt_id, "generation": cl.generation, "outcome": "failed",
                "exit_code": 1, "receipt_key": cl.receipt_key}

    results: dict[str, Any] = {}

    def run(name: str, items: list[dict[str, Any]]) -> None:
        try:
            with db.connect(db_url, application_name=f"pgd-test-{name}") as conn:
                conn.execute("SET deadlock_timeout = '100ms'")
                results[name] = transitions.complete_batch(conn, items=items)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[name] = exc

    first = threading.Thread(target=run, args=("first", [failed(a), failed(b)]))
    second = threading.Thread(target=run, args=("second", [failed(e), failed(c)]))
    first.start()
    time.sleep(0.05)
    second.start()
    for t in (first, second):
        t.join(WAIT_S)
    for name in ("first", "second"):
        assert isinstance(results[name], list), results[name]
        assert [r["job_state"] for r in results[name]] == ["failed", "failed"]
    assert world.row("jobs", d1)["state"] == world.row("jobs", d2)["state"] == "cancelled"
    assert all_retries() == retries_before, "a batch was retried after 40P01"
    assert deadlocks(world.conn) == deadlocks_before
    assert consistency.violations(world.conn) == []


# --- 2. the production transitions under random load: no deadlock ----------------------

PROJECT_POOLS = {"web": ("linux", "arm"), "api": ("linux",), "ops": ("linux", "arm")}
TARGETS = ("production", "staging")


def build_world(world) -> dict[str, Any]:
    """Two organizations, two pools, three projects, two targets, four runners."""
    world.apply({
        "organizations": [{"name": "acme", "max_running": 4}, {"name": "globex", "max_running": 3}],
        "pools": [{"name": "linux", "slots": 5}, {"name": "arm", "slots": 3}],
        "projects": [
            {"name": "web", "organization": "acme", "pools": ["linux", "arm"], "max_running": 2},
            {"name": "api", "organization": "acme", "pools": ["linux"]},
            {"name": "ops", "organization": "globex", "pools": ["linux", "arm"]},
        ],
        "targets": [{"name": t} for t in TARGETS],
    })
    runners = [world.runner(pools=("linux", "arm"), slots=8) for _ in range(4)]
    pools = {"linux": world.pool_ids(("linux",)), "arm": world.pool_ids(("arm",)),
             "both": world.pool_ids(("linux", "arm"))}
    return {"runners": runners, "pools": pools}


class Load:
    """One worker's random walk over the production transitions, on its own connection."""

    EXPECTED = (FencedOut, Conflict)  # lost a race with another worker: fine, and told so

    def __init__(self, conn, setup: dict[str, Any], rng: random.Random):
        self.conn = conn
        self.setup = setup
        self.rng = rng
        self.done: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()

    def pick(self, sql: str, *args) -> dict[str, Any] | None:
        return self.conn.execute(sql + " ORDER BY random() LIMIT 1", args).fetchone()

    def step(self) -> None:
        ops = [(self.submit, 4), (self.claim, 6), (self.complete, 5), (self.heartbeat, 3),
               (self.expire, 2), (self.pause_or_resume, 1), (self.cancel, 1), (self.approve, 1),
               (self.retry, 1), (self.resolve, 1), (self.claim_batch, 2), (self.complete_batch, 2),
               (self.apply_limits, 1)]
        op = self.rng.choices([o for o, _ in ops], weights=[w for _, w in ops])[0]
        try:
            if op() is not False:
                self.done[op.__name__] += 1
        except self.EXPECTED:
            self.refused[op.__name__] += 1

    def submit(self):
        r = self.rng
        parents = []
        if r.random() < 0.3:
            rows = self.conn.execute("SELECT id FROM jobs WHERE state IN ('blocked', 'queued', "
                                     "'running', 'succeeded') ORDER BY id DESC LIMIT 20"
                                     ).fetchall()
            parents = r.sample([x["id"] for x in rows], min(len(rows), r.randint(1, 3)))
        project = r.choice(sorted(PROJECT_POOLS))
        try:
            transitions.submit(self.conn, project=project, pool=r.choice(PROJECT_POOLS[project]),
                               target=r.choice(TARGETS) if r.random() < 0.3 else None,
                               command=["true"], priority=r.randint(-5, 5),
                               max_attempts=r.randint(1, 3),
                               requires_approval=r.random() < 0.15, depends_on=parents)
        except InvalidInput:
            if not parents:
                raise
            return False  # a parent failed or was cancelled since it was read

    def claim(self):
        pools = self.setup["pools"][self.rng.choice(("linux", "arm", "both"))]
        return transitions.claim(self.conn, runner_id=self.rng.choice(self.setup["runners"]),
                                 pools=pools,
                                 claim_token=transitions.new_claim_token(),
                                 lease_seconds=self.rng.choice((0.05, 0.3, 2.0, 10.0)))

    def running_attempt(self):
        return self.pick("SELECT a.id, a.generation, a.claim_token, j.target_id FROM attempts a "
                         "JOIN jobs j ON j.id = a.job_id WHERE a.state = 'running'")

    def complete(self):
        a = self.running_attempt()
        if a is None:
            return False
        outcomes = ["succeeded", "succeeded", "failed", "cancelled", "handed_back"]
        if a["target_id"] is not None:
            outcomes.append("lost")
        outcome = self.rng.choice(outcomes)
        transitions.complete(self.conn, attempt_id=a["id"], generation=a["generation"],
                             outcome=outcome, exit_code={"succeeded": 0, "failed": 1}.get(outcome),
                             receipt_key=f"{a['claim_token']}:complete",
                             backoff_base_seconds=0.05, backoff_cap_seconds=0.2)

    def claim_batch(self):
        pools = self.setup["pools"][self.rng.choice(("linux", "arm", "both"))]
        tokens = [transitions.new_claim_token() for _ in range(self.rng.randint(2, 4))]
        return transitions.claim_batch(self.conn, runner_id=self.rng.choice(self.setup["runners"]),
                                       pools=pools, claim_tokens=tokens,
                                       lease_seconds=self.rng.choice((0.3, 2.0, 10.0))) or False

    def complete_batch(self):
        rows = self.conn.execute("SELECT a.id, a.generation, a.claim_token, j.target_id FROM attempts a "
                                 "JOIN jobs j ON j.id = a.job_id WHERE a.state = 'running' "
                                 "ORDER BY random() LIMIT 3").fetchall()
        if not rows:
            return False
        items = []
        for a in rows:
            outcome = self.rng.choice(["succeeded", "succeeded", "succeeded", "failed", "handed_back"])
            items.append({"attempt_id": a["id"], "generation": a["generation"], "outcome": outcome,
                          "exit_code": {"succeeded": 0, "failed": 1}.get(outcome),
                          "receipt_key": f"{a['claim_token']}:complete"})
        transitions.complete_batch(self.conn, items=items, backoff_base_seconds=0.05,
                                   backoff_cap_seconds=0.2)

    def apply_limits(self):
        # the whole config again with new limits: config apply locks every row it names
        r = self.rng
        config.apply_config(self.conn, "\n".join([
            "[[organizations]]", 'name = "acme"', f"max_running = {r.randint(3, 5)}",
            "[[organizations]]", 'name = "globex"', f"max_running = {r.randint(2, 4)}",
            "[[pools]]", 'name = "linux"', f"slots = {r.randint(4, 6)}",
            "[[pools]]", 'name = "arm"', f"slots = {r.randint(2, 4)}",
            "[[projects]]", 'name = "web"', 'organization = "acme"', 'pools = ["linux", "arm"]',
            f"max_running = {r.randint(1, 3)}",
            "[[projects]]", 'name = "api"', 'organization = "acme"', 'pools = ["linux"]',
            "[[projects]]", 'name = "ops"', 'organization = "globex"', 'pools = ["linux", "arm"]',
            *[line for t in TARGETS for line in ("[[targets]]", f'name = "{t}"')],
        ]), actor="ops", env={})

    def heartbeat(self):
        a = self.running_attempt()
        if a is None:
            return False
        transitions.heartbeat(self.conn, attempt_id=a["id"], generation=a["generation"],
                              lease_seconds=self.rng.choice((0.05, 1.0, 10.0)))

    def expire(self):
        transitions.expire_leases(self.conn, limit=5, backoff_base_seconds=0.05,
                                  backoff_cap_seconds=0.2)

    def pause_or_resume(self):
        p = self.pick("SELECT name, paused_at FROM projects")
        if p["paused_at"] is None:
            transitions.pause_project(self.conn, project=p["name"], reason="load", actor="ops")
        else:
            transitions.resume_project(self.conn, project=p["name"], actor="ops")

    def cancel(self):
        j = self.pick("SELECT id FROM jobs WHERE state IN ('blocked', 'queued', 'running')")
        if j is None:
            return False
        transitions.cancel_job(self.conn, job_id=j["id"], actor="ops", reason="load")

    def approve(self):
        j = self.pick("SELECT id FROM jobs WHERE state = 'blocked' AND requires_approval "
                      "AND approved_at IS NULL")
        if j is None:
            return False
        transitions.approve_job(self.conn, job_id=j["id"], actor="ops")

    def retry(self):
        j = self.pick("SELECT id FROM jobs WHERE state IN ('failed', 'cancelled') "
                      "AND pending_dependencies = 0 "
                      "AND (NOT requires_approval OR approved_at IS NOT NULL)")
        if j is None:
            return False
        transitions.retry_job(self.conn, job_id=j["id"], actor="ops")

    def resolve(self):
        t = self.pick("SELECT name FROM targets WHERE state = 'uncertain'")
        if t is None:
            return False
        transitions.resolve_target(self.conn, target=t["name"], actor="ops", note="load",
                                   outcome=self.rng.choice(("succeeded", "failed", "retry")))


def test_production_transitions_never_deadlock_under_random_load(world, db_url):
    setup = build_world(world)
    seeder = Load(world.conn, setup, random.Random(1))
    for _ in range(60):
        seeder.submit()
    workers = 6
    deadlocks_before = deadlocks(world.conn)
    retries_before = all_retries()
    stop = threading.Event()
    loads: list[Load | None] = [None] * workers
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            with db.connect(db_url, application_name=f"racer-load-{i}") as conn:
                load = loads[i] = Load(conn, setup, random.Random(1000 + i))
                while not stop.is_set():
                    load.step()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=work, args=(i,), name=f"racer-load-{i}")
               for i in range(workers)]
    broken_samples: list[list[str]] = []
    samples = 0
    started = time.monotonic()
    for t in threads:
        t.start()
    try:
        while time.monotonic() - started < LOAD_SECONDS and not stop.is_set():
            found = consistency.violations(world.conn)  # one snapshot, mid-load
            samples += 1
            if found:
                broken_samples.append(found)
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT_S)
    elapsed = time.monotonic() - started
    assert not [t.name for t in threads if t.is_alive()]
    if errors:
        raise errors[0]

    done = sum((ld.done for ld in loads if ld), collections.Counter())
    refused = sum((ld.refused for ld in loads if ld), collections.Counter())
    total = sum(done.values()) + sum(refused.values())
    print(f"\n{total} transitions in {elapsed:.1f} s ({total / elapsed:.0f}/s) on {workers} "
          f"connections; done {dict(done)}; refused (lost a race) {dict(refused)}; "
          f"{samples} consistency samples")
    # every kind of transition really ran, and the load was not trivial
    for name in ("submit", "claim", "complete", "heartbeat", "expire", "pause_or_resume",
                 "cancel", "approve", "retry", "resolve", "claim_batch", "complete_batch",
                 "apply_limits"):
        assert done[name] > 0, f"{name} never ran: {dict(done)}"
    assert total > 500
    assert broken_samples == []
    assert consistency.violations(world.conn) == []
    assert consistency.history_violations(world.conn) == []
    assert all_retries() == retries_before, "a transition was retried after 40P01/40001"
    # a session flushes its statistics when it ends: wait until every worker's has
    wait_for(lambda: world.conn.execute("SELECT count(*) AS n FROM pg_stat_activity "
                                        "WHERE application_name LIKE 'racer-load-%%'"
                                        ).fetchone()["n"] == 0, "the workers' sessions to end")
    assert deadlocks(world.conn) == deadlocks_before
