"""Batched claims and completions in the scheduler (scheduler/claiming.py,
scheduler/reporting.py): several builds claimed in one transaction, several outcomes
reported in one, with every guarantee of the one-job transactions kept.

Evidence comes from the database: pgd_claim_batch stamps every attempt of one batch with the
same ``claimed_at`` (one clock_timestamp() per batch), while single claims each take their
own, so attempts grouped by ``claimed_at`` are the claim transactions that took them.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from urllib.parse import urlsplit

import pytest

from pgdispatch.scheduler.claiming import Claimer
from pgdispatch.scheduler.main import Scheduler
from pgdispatch.scheduler.reporting import CompletionReporter
from pgdispatch.sql import DatabaseUnavailable, FencedOut, InvalidInput, db, transitions
from pgdispatch.sql.scheduling import make_scheduler_pool

from ..concurrency import processes
from ..concurrency.harness import Watcher, attempt_shapes, limits, max_overlaps
from ..faults import consistency
from ..faults.conftest import upstream_of
from ..faults.proxy import CommitDroppingProxy
from .conftest import FAST, Signals, wait_until


def claim_groups(conn) -> list[list[int]]:
    """Job ids per claim transaction (attempts sharing claimed_at and runner), oldest first."""
    rows = conn.execute("""
        SELECT array_agg(job_id ORDER BY job_id) AS jobs FROM attempts
         GROUP BY claimed_at, runner_id ORDER BY claimed_at""").fetchall()
    return [r["jobs"] for r in rows]


def each_job_ran_once(conn) -> list[dict]:
    """Jobs that did not end succeeded after exactly one attempt, of generation 1."""
    return conn.execute("""
        SELECT j.id, j.state, count(a.id) AS attempts,
               string_agg(a.state || ':' || a.generation, ',') AS shape
          FROM jobs j LEFT JOIN attempts a ON a.job_id = j.id
         GROUP BY j.id
        HAVING j.state <> 'succeeded' OR count(a.id) <> 1
            OR bool_or(a.state <> 'succeeded' OR a.generation <> 1)""").fetchall()


def wait_all_finished(conn, timeout: float = 30.0) -> None:
    wait_until(lambda: conn.execute("SELECT count(*) AS n FROM jobs WHERE finished_at IS NULL"
                                    ).fetchone()["n"] == 0, timeout=timeout,
               what="every job to finish")


def counting(monkeypatch, name: str) -> list[int]:
    """Wrap transitions.<name> so each call records its batch size (tokens or items)."""
    real = getattr(transitions, name)
    sizes: list[int] = []

    def wrapper(conn, **kw):
        sizes.append(len(kw.get("claim_tokens") or kw.get("items") or [None]))
        return real(conn, **kw)

    monkeypatch.setattr(transitions, name, wrapper)
    return sizes


# --- claiming in batches -------------------------------------------------------------------


def test_six_slots_claim_twenty_builds_in_batches_and_run_each_once(world, start_scheduler,
                                                                    monkeypatch):
    world.setup()
    jobs = [world.job(command=["true"]) for _ in range(20)]
    batch_sizes = counting(monkeypatch, "claim_batch")
    singles = counting(monkeypatch, "claim")
    s, signals = start_scheduler(slots=6)
    done = [signals.next_completed(timeout=20) for _ in jobs]
    assert all(r.outcome == "succeeded" and r.is_reported for r in done)
    assert sorted(r.claim.job_id for r in done) == sorted(j["id"] for j in jobs)
    wait_all_finished(world.conn)
    assert each_job_ran_once(world.conn) == []

    groups = claim_groups(world.conn)
    sizes = sorted((len(g) for g in groups), reverse=True)
    # The first round: one ordinary claim, then one batch for the other five free slots.
    assert sizes[0] in (5, 6), groups
    assert len(groups) < len(jobs), f"one claim transaction per job: {groups}"
    assert all(n <= 6 for n in sizes)
    assert s.max_batch == 10 and batch_sizes and max(batch_sizes) <= 6
    # every job taken by exactly one claim transaction: claims that took something + batches
    assert sum(sizes) == len(jobs)
    assert len(groups) <= len(batch_sizes) + len(singles)
    assert max(batch_sizes) >= 5
    # by the database's clock, never more than six running at once
    rows = world.conn.execute("SELECT claimed_at, finished_at FROM attempts").fetchall()
    events = sorted([(r["claimed_at"], 1) for r in rows] + [(r["finished_at"], -1) for r in rows])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak <= 6
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}


def test_max_batch_one_claims_and_reports_one_job_per_transaction(world, start_scheduler,
                                                                  db_url, monkeypatch):
    world.setup()
    jobs = [world.job(command=["true"]) for _ in range(8)]

    batched = []

    def forbidden(conn, **kw):
        batched.append(kw)
        raise AssertionError("batching is off")

    monkeypatch.setattr(transitions, "claim_batch", forbidden)
    monkeypatch.setattr(transitions, "complete_batch", forbidden)
    real_complete = transitions.complete

    def slow_complete(conn, **kw):
        time.sleep(0.3)  # reports overlap: each must still go alone, side by side
        return real_complete(conn, **kw)

    monkeypatch.setattr(transitions, "complete", slow_complete)
    signals = Signals()
    s = Scheduler(FAST, database_url=db_url, pools=["linux"], slots=4, max_batch=1,
                  kill_grace_seconds=1.0, on_completed=signals.completed.put)
    assert s.start()
    try:
        done = [signals.next_completed(timeout=20) for _ in jobs]
    finally:
        s.stop(grace_seconds=0)
    assert batched == []
    assert all(r.outcome == "succeeded" and r.is_reported for r in done)
    assert all(len(g) == 1 for g in claim_groups(world.conn))
    assert each_job_ran_once(world.conn) == []


def test_max_batch_is_checked():
    for bad in (0, 1001, "10", True):
        with pytest.raises(InvalidInput):
            Scheduler(FAST, database_url="postgresql://unused", pools=["linux"], slots=2,
                      max_batch=bad)


def test_a_deployment_is_claimed_singly_while_builds_are_batched(world, start_scheduler):
    world.setup(targets=("production",))
    builds = [world.job(command=["sleep", "0.2"]) for _ in range(6)]
    # two deployments to one target, ahead of the builds and behind them: a batch never takes
    # one; the ordinary claim that opens each round does, one at a time
    deploys = [world.job(command=["sleep", "0.3"], target="production", priority=5)]
    builds += [world.job(command=["sleep", "0.2"]) for _ in range(10)]
    deploys.append(world.job(command=["sleep", "0.3"], target="production"))
    s, signals = start_scheduler(slots=6)
    done = [signals.next_completed(timeout=30) for _ in range(len(builds) + len(deploys))]
    assert all(r.outcome == "succeeded" for r in done)
    wait_all_finished(world.conn)
    assert each_job_ran_once(world.conn) == []

    groups = claim_groups(world.conn)
    deploy_ids = {d["id"] for d in deploys}
    for g in groups:
        if deploy_ids & set(g):
            assert len(g) == 1, f"a deployment was claimed in a batch: {groups}"
    assert max(len(g) for g in groups) >= 2, f"builds were not batched: {groups}"
    # the target was held by one deployment at a time, and is free again
    assert max_overlaps(world.conn)[("target", "production")] == 1
    assert world.conn.execute("SELECT state FROM targets WHERE name = 'production'"
                              ).fetchone()["state"] == "free"
    # the high-priority deployment opened the first round, before the first batch
    first = world.conn.execute("SELECT job_id FROM attempts ORDER BY claimed_at, id LIMIT 1"
                               ).fetchone()["job_id"]
    assert first == deploys[0]["id"]


# --- a lost answer: every token of a batch is looked up --------------------------------------


def test_every_token_of_a_lost_batch_is_looked_up(world, db_url):
    """What a batch whose answer was lost leaves behind, recovered: three tokens committed
    (one of them expired since), one token left unused; then the same while draining."""
    world.setup()
    for _ in range(3):
        world.job(command=["true"])
    runner = world.runner(slots=8)
    pool_ids = world.pool_ids(("linux",))
    tokens = [transitions.new_claim_token() for _ in range(4)]
    lost = db.connect(db_url)
    claims = transitions.claim_batch(lost, runner_id=runner, pools=pool_ids,
                                     claim_tokens=tokens, lease_seconds=2)
    lost.close()
    assert len(claims) == 3  # the fourth token found no job: it never committed anything
    expired = claims[2]
    world.expire_now(expired.attempt_id)
    assert transitions.expire_one(world.conn)["attempt_id"] == expired.attempt_id
    pool = make_scheduler_pool(db_url, slots=1)
    launched = []
    try:
        claimer = Claimer(pool, FAST, runner_id=runner, pool_ids=pool_ids,
                          free_slots=lambda: 8 - len(launched),
                          launch=lambda c, sent_at: launched.append((c, sent_at)),
                          is_draining=lambda: False)
        claimer._pending.append(list(tokens))  # the batch's tokens, one group, as sent
        before = time.monotonic()
        assert claimer.fill() == 2
    finally:
        pool.close()
    assert claimer._pending == []
    assert sorted(c.attempt_id for c, _ in launched) == sorted(c.attempt_id for c in claims[:2])
    for c, sent_at in launched:
        assert sent_at >= before
        # renewed by a heartbeat before it runs
        assert world.row("attempts", c.attempt_id)["lease_expires_at"] > claims[0].lease_expires_at
    # nothing else was claimed: the expired job was re-queued and failed for good (1 attempt)
    assert world.row("jobs", expired.job_id)["state"] == "failed"


def test_a_draining_scheduler_hands_back_what_a_lost_batch_committed(world, db_url):
    world.setup()
    world.job(command=["true"])
    world.job(command=["true"])
    runner = world.runner(slots=8)
    pool_ids = world.pool_ids(("linux",))
    tokens = [transitions.new_claim_token() for _ in range(2)]
    claims = transitions.claim_batch(world.conn, runner_id=runner, pools=pool_ids,
                                     claim_tokens=tokens, lease_seconds=30)
    assert len(claims) == 2
    pool = make_scheduler_pool(db_url, slots=1)
    draining = threading.Event()
    launched = []
    try:
        claimer = Claimer(pool, FAST, runner_id=runner, pool_ids=pool_ids,
                          free_slots=lambda: 8, launch=lambda c, s: launched.append(c),
                          is_draining=draining.is_set)
        claimer._pending.append(list(tokens))
        draining.set()
        claimer._recover_pending()
    finally:
        pool.close()
    assert launched == [] and claimer._pending == []
    for c in claims:
        job = world.row("jobs", c.job_id)
        # handed back unrun: queued again at once, no failure counted
        assert (job["state"], job["failures"]) == ("queued", 0)
        assert world.row("attempts", c.attempt_id)["state"] == "cancelled"
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}


@pytest.fixture
def reply_proxy(db_url):
    p = CommitDroppingProxy(upstream_of(db_url))
    p.db_url = p.url(urlsplit(db_url).path.lstrip("/"))
    yield p
    p.close()


def test_a_batch_claim_whose_answer_was_lost_runs_every_claim_once(world, reply_proxy):
    world.setup()
    jobs = [world.job(command=["sh", "-c", "echo ran"]) for _ in range(7)]
    reply_proxy.arm("pgd_claim_batch")
    signals = Signals()
    # through the proxy: the first round's ordinary claim takes one job, its batch of five
    # commits but its answer is lost; the next round must find all five by their tokens
    s = Scheduler(FAST, database_url=reply_proxy.db_url, pools=["linux"], slots=6,
                  kill_grace_seconds=1.0, on_completed=signals.completed.put)
    assert s.start()
    try:
        done = [signals.next_completed(timeout=20) for _ in jobs]
        wait_all_finished(world.conn)
    finally:
        s.stop(grace_seconds=0)
    pending = dict(s._claimer._pending)  # once stopped: no claim is in flight
    assert reply_proxy.commits_dropped == 1
    assert pending == {}
    assert all(r.outcome == "succeeded" for r in done)
    assert sorted(r.claim.job_id for r in done) == sorted(j["id"] for j in jobs)
    assert each_job_ran_once(world.conn) == []
    # the lost batch is there: five attempts claimed in one transaction, all run
    assert sorted(len(g) for g in claim_groups(world.conn))[-1] == 5
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}


# --- batched completions -------------------------------------------------------------------


def test_outcomes_that_finish_together_are_reported_in_one_transaction(world, start_scheduler,
                                                                       monkeypatch):
    world.setup()
    marker = 'echo "tail of $PGDISPATCH_JOB_ID"; sleep 0.3'
    jobs = [world.job(command=["sh", "-c", marker]) for _ in range(5)]
    # fails its first attempt: a batched failure re-queues it with backoff, like a lone one
    retried = world.job(command=["sh", "-c", marker + '; [ "$PGDISPATCH_ATTEMPT" -gt 1 ]'],
                        max_attempts=2)
    batch_sizes = counting(monkeypatch, "complete_batch")
    real_complete = transitions.complete

    def slow_complete(conn, **kw):
        time.sleep(0.5)  # the six end within milliseconds: the other reports queue meanwhile
        return real_complete(conn, **kw)

    monkeypatch.setattr(transitions, "complete", slow_complete)
    s, signals = start_scheduler(slots=6)
    done = [signals.next_completed(timeout=20) for _ in range(7)]
    assert batch_sizes and max(batch_sizes) >= 2, batch_sizes
    assert s._reporter.batches_sent == len(batch_sizes)
    by_outcome = collections.Counter((r.outcome, r.job_state, r.is_reported) for r in done)
    assert by_outcome == {("succeeded", "succeeded", True): 6, ("failed", "queued", True): 1}
    wait_all_finished(world.conn)
    c = world.conn
    rows = c.execute("SELECT a.job_id, a.state, a.output_tail, a.exit_code, "
                     "(SELECT count(*) FROM delivery_receipts r WHERE r.attempt_id = a.id) AS n "
                     "FROM attempts a ORDER BY a.id").fetchall()
    assert len(rows) == 7 and all(r["n"] == 1 for r in rows)
    for r in rows:
        assert f"tail of {r['job_id']}" in r["output_tail"]
    assert [(r["state"], r["exit_code"]) for r in rows if r["job_id"] == retried["id"]] == [
        ("failed", 1), ("succeeded", 0)]
    assert world.row("jobs", retried["id"])["failures"] == 1
    assert all(world.row("jobs", j["id"])["state"] == "succeeded" for j in jobs)
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}


def test_a_lost_batch_report_is_sent_again_and_counted_once(world, db_url, reply_proxy):
    """Three reports queue behind one in flight and go in one batch, whose answer is lost:
    each caller gets DatabaseUnavailable, sends again under its receipt key, and the database
    answers the first answers without recording anything twice."""
    world.setup(targets=("production",))
    runner = world.runner(slots=8)
    held = world.job()
    build = world.job(max_attempts=3)
    deploy = world.job(target="production")
    stale = world.job(max_attempts=2)
    claims = [world.claim(runner) for _ in range(4)]
    by_job = {c.job_id: c for c in claims}
    # the stale attempt loses its lease and the job is claimed again: its report is fenced
    world.expire_now(by_job[stale["id"]].attempt_id)
    transitions.expire_one(world.conn, backoff_base_seconds=0.01, backoff_cap_seconds=0.01)
    again = wait_until(lambda: world.claim(runner), what="the expired job to be claimable")

    def item(job, outcome, exit_code, error, output_tail):
        c = by_job[job["id"]]
        return dict(attempt_id=c.attempt_id, generation=c.generation, receipt_key=c.receipt_key,
                    outcome=outcome, exit_code=exit_code, error=error, output_tail=output_tail)

    items = [item(build, "failed", 2, "broke\x00here", "out\x00put"),
             item(deploy, "succeeded", 0, None, "deployed"),
             item(stale, "succeeded", 0, None, "too late")]
    answers: dict[int, object] = {}

    def report(i: int, kw: dict) -> None:
        try:
            answers[i] = reporter.complete(**kw)
        except Exception as exc:  # what an execution would retry on, or give up on
            answers[i] = exc

    pool = make_scheduler_pool(reply_proxy.db_url, slots=1)
    locker = db.connect(db_url)
    try:
        reporter = CompletionReporter(pool, FAST, max_batch=10)
        reply_proxy.arm("pgd_complete_batch")
        with locker.transaction():
            # the lone report of `held` waits on its attempt's row lock, so the reporter is
            # busy while the other three arrive, and they queue up for one batch
            locker.execute("SELECT 1 FROM attempts WHERE id = %s FOR UPDATE",
                           (by_job[held["id"]].attempt_id,))
            threads = [threading.Thread(target=report,
                                        args=(-1, item(held, "succeeded", 0, None, "held")))]
            threads[0].start()
            wait_until(lambda: world.conn.execute(
                "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%%pgd_complete%%'").fetchone()["n"] == 1,
                what="the held report to wait for its row lock")
            threads += [threading.Thread(target=report, args=(i, kw))
                        for i, kw in enumerate(items)]
            for t in threads[1:]:
                t.start()
            wait_until(lambda: len(reporter._queue) == len(items),
                       what="three reports queued behind the held one")
        for t in threads:
            t.join(timeout=20)
        assert not any(t.is_alive() for t in threads)
        assert answers[-1]["job_state"] == "succeeded"
        assert reporter.batches_sent == 1 and reply_proxy.commits_dropped == 1
        assert all(isinstance(answers[i], DatabaseUnavailable) for i in range(3)), answers
        counters = world.counters()
        # sent again as the executions do, each on its own and under its own receipt key
        second = []
        for kw in items:
            try:
                second.append(reporter.complete(**kw))
            except FencedOut as exc:
                second.append(exc)
    finally:
        locker.close()
        pool.close()
    # it had committed: the same receipt keys answer the first answers, recorded once
    assert second[0]["repeated"] is True and second[0]["job_state"] == "queued"
    assert second[1]["repeated"] is True and second[1]["job_state"] == "succeeded"
    assert isinstance(second[2], FencedOut)
    assert reporter.batches_sent == 1
    assert world.counters() == counters
    assert world.row("jobs", build["id"])["failures"] == 1
    attempt = world.row("attempts", by_job[build["id"]].attempt_id)
    assert attempt["output_tail"] == "out\ufffdput" and attempt["error"] == "broke\ufffdhere"
    assert world.conn.execute("SELECT state FROM targets WHERE name = 'production'"
                              ).fetchone()["state"] == "free"
    assert world.row("attempts", again.attempt_id)["state"] == "running"
    assert world.conn.execute("SELECT count(*) AS n FROM delivery_receipts").fetchone()["n"] == 3


# --- several scheduler processes, all batching ---------------------------------------------

PROCESSES = 3
PROCESS_SLOTS = 4
PROCESS_JOBS = 300
JOB_SECONDS = "0.05"


def test_scheduler_processes_batching_never_exceed_a_limit(world, db_url, tmp_path):
    """Three ``pgdispatch scheduler --max-batch 10`` processes (12 slots) drain 300 builds
    of 0.05 s each through limits that bind: organizations of 5 (web bounded at 3), a pool
    of 8; one job in ten fails its first attempt. Every limit is reached and never exceeded;
    every job ends once; and claims really were batched."""
    world.apply({
        "organizations": [{"name": "acme", "max_running": 5},
                          {"name": "globex", "max_running": 5}],
        "pools": [{"name": "linux", "slots": 8}],
        "projects": [
            {"name": "web", "organization": "acme", "pools": ["linux"], "max_running": 3},
            {"name": "api", "organization": "acme", "pools": ["linux"]},
            {"name": "ops", "organization": "globex", "pools": ["linux"]},
        ],
    })
    # Each job runs for JOB_SECONDS, long against a claim cycle, so the limits stay full
    # while work is queued: with `true`, an attempt lasted a few ms, and on a slow machine
    # the eight of the pool were sometimes never running at the same instant.
    fail_first = ["sh", "-c", f'sleep {JOB_SECONDS}; [ "$PGDISPATCH_ATTEMPT" -gt 1 ]']
    failing = 0
    with world.conn.transaction():
        for i in range(PROCESS_JOBS):
            project = ("web", "api", "ops", "ops")[i % 4]
            is_failing = i % 10 == 0
            failing += is_failing
            transitions.submit(world.conn, project=project, pool="linux",
                               command=fail_first if is_failing else ["sleep", JOB_SECONDS],
                               max_attempts=2 if is_failing else 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=db_url, PGDISPATCH_LEASE_SECONDS="10",
               PGDISPATCH_HEARTBEAT_SECONDS="2", PGDISPATCH_CLAIM_INTERVAL_SECONDS="0.2", PGDISPATCH_CLAIM_IDLE_CAP_SECONDS="1",
               PGDISPATCH_EXPIRE_INTERVAL_SECONDS="0.5", PGDISPATCH_SUMMARY_INTERVAL_SECONDS="2",
               PGDISPATCH_RUNNER_BEAT_SECONDS="1", PGDISPATCH_DUTY_LEASE_SECONDS="3",
               PGDISPATCH_BACKOFF_BASE_SECONDS="0.1", PGDISPATCH_BACKOFF_CAP_SECONDS="0.2",
               PGDISPATCH_DATA_DIR=str(tmp_path / "data"), PGDISPATCH_MAX_BATCH="10")
    procs = processes.start_schedulers(env, tmp_path, PROCESSES, lambda i: [
        "--pool", "linux", "--slots", str(PROCESS_SLOTS), "--name", f"b{i}"])

    def logs() -> str:
        return processes.logs(procs)

    c = world.conn
    try:
        with Watcher(db_url, interval_s=0.02) as watcher:
            deadline = time.monotonic() + 180
            while c.execute("SELECT count(*) AS n FROM jobs WHERE finished_at IS NULL"
                            ).fetchone()["n"]:
                dead = [path.name for p, path in procs if p.poll() is not None]
                assert not dead, f"schedulers exited: {dead}\n{logs()}"
                assert time.monotonic() < deadline, f"jobs left after 180 s\n{logs()}"
                time.sleep(0.2)
    finally:
        exit_codes = processes.stop(procs)
    assert exit_codes == [0] * PROCESSES, logs()
    assert "in a batch of" in "".join(path.read_text(errors="replace") for _, path in procs)

    assert c.execute("SELECT state, count(*) AS n FROM jobs GROUP BY 1").fetchall() == [
        {"state": "succeeded", "n": PROCESS_JOBS}]
    assert attempt_shapes(c) == [{"states": "failed:1,succeeded:2", "n": failing},
                      {"states": "succeeded:1", "n": PROCESS_JOBS - failing}]
    attempts = c.execute("SELECT count(*) AS n FROM attempts").fetchone()["n"]
    assert c.execute("SELECT count(*) AS n FROM delivery_receipts").fetchone()["n"] == attempts
    assert consistency.history_violations(c) == []
    assert consistency.violations(c) == []
    assert watcher.samples >= 20 and watcher.violations == []
    lims = limits(c)
    overlaps = max_overlaps(c)
    assert {k: overlaps.get(k) for k in lims} == lims, overlaps
    groups = claim_groups(c)
    print(f"\nmost attempts at once: {overlaps}")
    print(f"{attempts} attempts in {len(groups)} claim transactions; jobs per claim "
          f"transaction: {sorted(collections.Counter(len(g) for g in groups).items())}")
    assert max(len(g) for g in groups) >= 2, "no claim was batched"
    assert len(groups) < attempts
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
