"""Several schedulers running the expiry pass at once, alone and beside claimers.

DESIGN.md: expire() is "safe to run from every scheduler at once". Each lapsed attempt must
be ended exactly once, its slots released exactly once, and a deployment must leave its job
and target uncertain (target still reserved).
"""

from __future__ import annotations

import collections
import threading
import time

import pytest

from pgdispatch.sql import transitions

from .harness import (Watcher, broken_expire_one, check_now, install_broken_expire,
                      raise_first_error, run_together, transaction_retries)

TARGETS = tuple(f"env-{i}" for i in range(10))
BACKOFF = dict(backoff_base_seconds=0.001, backoff_cap_seconds=0.002)


def build_lapsed(world, *, builds: int = 40, extra_queued: int = 0) -> dict:
    """Two organizations; ``builds`` builds (half with one attempt, half with three) and one
    deployment per target, all claimed and then lapsed; ``extra_queued`` fresh builds queued."""
    world.apply({
        "organizations": [{"name": "acme", "max_running": 100}, {"name": "globex", "max_running": 100}],
        "pools": [{"name": "linux", "slots": 100}, {"name": "deploy", "slots": 100}],
        "projects": [
            {"name": "web", "organization": "acme", "pools": ["linux", "deploy"]},
            {"name": "shop", "organization": "globex", "pools": ["linux", "deploy"]},
        ],
        "targets": [{"name": t} for t in TARGETS],
    })
    runner = world.runner(pools=("linux", "deploy"), slots=200)
    for i in range(builds):
        world.job(project=("web", "shop")[i % 2], max_attempts=1 + 2 * (i % 4 < 2))
    for i, target in enumerate(TARGETS):
        world.job(project=("web", "shop")[i % 2], pool="deploy", target=target)
    claims = [world.claim(runner, pools=("linux", "deploy")) for _ in range(builds + len(TARGETS))]
    assert all(c is not None for c in claims)
    world.conn.execute("UPDATE attempts SET lease_expires_at = clock_timestamp() - interval '1 second'")
    for i in range(extra_queued):
        world.job(project=("web", "shop")[i % 2])
    return {"runner": runner, "claims": {c.attempt_id: c for c in claims}}


def check_expired_once(world, lapsed: dict, reported: list[int]) -> None:
    """Every lapsed attempt reported exactly once, and left as DESIGN.md says."""
    dupes = {a: n for a, n in collections.Counter(reported).items() if n > 1}
    assert dupes == {}, f"attempts expired more than once: {dupes}"
    assert set(reported) == set(lapsed)
    rows = world.conn.execute(
        "SELECT a.id, a.state AS attempt, j.state AS job, j.max_attempts, j.target_id, "
        "       t.state AS target, t.holder_job_id = j.id AS holds "
        "  FROM attempts a JOIN jobs j ON j.id = a.job_id LEFT JOIN targets t ON t.id = j.target_id "
        " WHERE a.id = ANY(%s)", (list(lapsed),)).fetchall()
    assert len(rows) == len(lapsed)
    for r in rows:
        if r["target_id"] is not None:
            assert (r["attempt"], r["job"], r["target"], r["holds"]) == ("lost", "uncertain", "uncertain", True), r
        else:
            assert r["attempt"] == "expired", r
            # out of attempts: failed; else queued again (and maybe claimed again since)
            assert r["job"] == "failed" if r["max_attempts"] == 1 else r["job"] != "failed", r


def test_concurrent_expiry_passes_end_each_lease_exactly_once(world, db_url):
    lapsed = build_lapsed(world)["claims"]
    retries_before = transaction_retries()
    with Watcher(db_url) as watcher:
        outcomes = run_together(db_url, [lambda conn: transitions.expire_leases(conn, **BACKOFF)] * 4)
    raise_first_error(outcomes)
    assert watcher.violations == []
    reported = [r["attempt_id"] for o in outcomes for r in o.value]
    assert len(reported) == 50
    check_expired_once(world, lapsed, reported)
    assert transitions.expire_leases(world.conn) == []
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert check_now(world.conn) == []
    assert transaction_retries() == retries_before, "a deadlock between expiry passes"
    # more than one pass did real work, so they really ran side by side
    assert sum(1 for o in outcomes if o.value) >= 2, [len(o.value) for o in outcomes]


def test_expiry_passes_beside_claimers(world, db_url):
    """Three expiry passes and four claim -> complete loops at once. The re-queued builds
    come back after a millisecond of backoff, so claimers take them again while the passes
    are still expiring their siblings."""
    setup = build_lapsed(world, extra_queued=60)
    lapsed, runner = setup["claims"], setup["runner"]
    # the next deployments to half the targets: held now, uncertain soon, never free
    blocked = [world.job(project="web", pool="deploy", target=t)["id"] for t in TARGETS[:5]]
    pools = world.pool_ids(("linux", "deploy"))
    expirers_done = threading.Event()
    expirers_left = [3]
    lock = threading.Lock()

    def expirer(conn):
        done = []
        try:
            while True:
                batch = transitions.expire_leases(conn, limit=5, **BACKOFF)
                done += batch
                if not batch:
                    return done
        finally:
            with lock:
                expirers_left[0] -= 1
                if expirers_left[0] == 0:
                    expirers_done.set()

    def claimer(conn):
        completed = 0
        while True:
            c = transitions.claim(conn, runner_id=runner, pools=pools,
                                  claim_token=transitions.new_claim_token(), lease_seconds=30)
            if c is None:
                if expirers_done.is_set():
                    return completed
                time.sleep(0.001)
                continue
            time.sleep(0.001)
            transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                 outcome="succeeded", receipt_key=c.receipt_key)
            completed += 1

    retries_before = transaction_retries()
    with Watcher(db_url) as watcher:
        outcomes = run_together(db_url, [expirer] * 3 + [claimer] * 4)
    raise_first_error(outcomes)
    assert watcher.violations == []
    reported = [r["attempt_id"] for o in outcomes[:3] for r in o.value]
    check_expired_once(world, lapsed, reported)
    completed = sum(o.value for o in outcomes[3:])
    assert completed >= 60, completed
    # no attempt but the lapsed ones was expired; every other attempt completed
    states = world.conn.execute(
        "SELECT state, count(*) AS n FROM attempts WHERE NOT id = ANY(%s) GROUP BY state",
        (list(lapsed),)).fetchall()
    assert states == [{"state": "succeeded", "n": completed}]
    # fencing held: a job's attempts have distinct generations, the last one is the job's
    bad = world.conn.execute(
        "SELECT j.id FROM jobs j JOIN attempts a ON a.job_id = j.id GROUP BY j.id, j.generation "
        "HAVING max(a.generation) <> j.generation OR count(*) <> count(DISTINCT a.generation)").fetchall()
    assert bad == []
    assert world.conn.execute("SELECT array_agg(DISTINCT state) AS s, sum(generation) AS g FROM jobs "
                              "WHERE id = ANY(%s)", (blocked,)).fetchone() == {"s": ["queued"], "g": 0}
    reclaimed = world.conn.execute("SELECT count(*) AS n FROM jobs WHERE generation = 2").fetchone()["n"]
    assert reclaimed > 0, "no expired build was claimed again: the passes and claims did not interleave"
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert check_now(world.conn) == []
    assert transaction_retries() == retries_before, "a deadlock between expiry and claims"


def test_harness_catches_an_expiry_without_locks(world, db_url):
    """The broken pass picks the oldest lapsed lease by a plain read and ends it without a
    lock or re-check: four passes released together all end the same attempt, and each pass
    counts the job's failure again. (The job's organization and pool slots are freed by job
    id, so the passes after the first find them free already.)"""
    lapsed = build_lapsed(world)["claims"]
    install_broken_expire(world.conn)

    def passes(conn):
        return [broken_expire_one(conn, sleep_s=0.05) for _ in range(3)]

    outcomes = run_together(db_url, [passes] * 4)
    assert [o.error for o in outcomes if o.error is not None] == []
    reported = [r["attempt_id"] for o in outcomes for r in o.value if r is not None]
    with pytest.raises(AssertionError, match="expired more than once"):
        check_expired_once(world, lapsed, reported)
    recounted = world.conn.execute(
        "SELECT j.id, j.failures, count(a.id) AS ended FROM jobs j JOIN attempts a ON a.job_id = j.id "
        "WHERE a.state <> 'running' GROUP BY j.id HAVING j.failures > count(a.id)").fetchall()
    assert recounted, "no job counted its one expiry more than once"
