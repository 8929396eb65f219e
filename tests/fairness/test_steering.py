"""Fairness and limits with an operator steering the fleet (issue 20, item 6): a pool paused
and a runner drained while claim loops on real connections race. Limits hold throughout (the
Watcher and the interval sweep), nothing is claimed in the paused pool nor by the drained
runner (by the audit log's times), the small project still does not wait behind the big one,
the other runner takes up the drained one's share, and the paused pool runs once resumed."""

from __future__ import annotations

import random
import threading
import time

from pgdispatch.sql import db, transitions
from tests.concurrency.harness import Watcher, limits, max_overlaps, run_together
from tests.faults.consistency import steering_violations, violations

SLOTS = 4


def _setup(world) -> dict:
    world.apply({
        "organizations": [{"name": "acme", "max_running": 100}],
        "pools": [{"name": "linux", "slots": SLOTS}, {"name": "gpu", "slots": 2}],
        "projects": [{"name": "big", "organization": "acme", "pools": ["linux"]},
                     {"name": "small", "organization": "acme", "pools": ["linux"]},
                     {"name": "ml", "organization": "acme", "pools": ["gpu"]}],
    })
    # the big project's 400 jobs first, then the small one's 10, then the gpu pool's 20
    world.conn.execute("""
        INSERT INTO jobs (project_id, pool_id, state, command, submitted_by)
        SELECT p.id, q.id, 'queued', ARRAY['true'], 'bench'
          FROM (VALUES ('big', 'linux', 400), ('small', 'linux', 10), ('ml', 'gpu', 20)) v(proj, pool, n)
          JOIN projects p ON p.name = v.proj JOIN pools q ON q.name = v.pool
         CROSS JOIN generate_series(1, v.n)
         ORDER BY p.id""")
    world.conn.execute("ANALYZE jobs")
    drained = world.runner(pools=("linux", "gpu"), slots=SLOTS, name="to-drain")
    other = world.runner(pools=("linux", "gpu"), slots=SLOTS, name="other")
    return {"drained": drained, "other": other, "pools": world.pool_ids(("linux", "gpu"))}


def test_limits_and_fairness_hold_while_a_pool_is_paused_and_a_runner_drained(world, db_url):
    w = _setup(world)
    stop = threading.Event()
    lock = threading.Lock()
    done: dict[str, list] = {"drained": [], "other": []}

    def loop(runner_key: str, seed: int):
        def run(conn):
            rng = random.Random(seed)
            while not stop.is_set():
                c = transitions.claim(conn, runner_id=w[runner_key], pools=w["pools"],
                                      claim_token=transitions.new_claim_token(), lease_seconds=60)
                if c is None:
                    time.sleep(0.002)
                    continue
                time.sleep(rng.uniform(0.002, 0.01))
                transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                     outcome="succeeded", exit_code=0, receipt_key=c.receipt_key)
                with lock:
                    done[runner_key].append((time.monotonic(), c.project_id))
        return run

    def operator(conn):
        time.sleep(0.4)
        transitions.pause_pool(conn, pool="gpu", reason="driver update", actor="alice")
        transitions.drain_runner(conn, runner_id=w["drained"], reason="reboot", actor="alice")
        drained_at = time.monotonic()
        time.sleep(1.2)
        transitions.resume_pool(conn, pool="gpu", actor="bob")
        time.sleep(1.0)
        stop.set()
        return drained_at

    fns = ([loop("drained", i) for i in range(SLOTS)] + [loop("other", 10 + i) for i in range(SLOTS)]
           + [operator])
    with Watcher(db_url) as watcher:
        outcomes = run_together(db_url, fns, timeout_s=60)
    for o in outcomes:
        if o.error is not None:
            raise o.error
    drained_at = outcomes[-1].value
    assert watcher.samples > 50 and not watcher.violations, watcher.violations[:5]
    lims = limits(world.conn)
    over = {k: v for k, v in max_overlaps(world.conn).items() if k in lims and v > lims[k]}
    assert over == {}
    assert steering_violations(world.conn) == [] and violations(world.conn) == []
    # the drained runner completed nothing it claimed after its drain (its claims in flight
    # then end within a hold), the other took up its share
    late = [t for t, _ in done["drained"] if t > drained_at + 0.5]
    assert late == []
    assert len([t for t, _ in done["other"] if t > drained_at]) > 20
    # fairness: the small project's 10 jobs did not wait behind the big project's 400
    ids = {r["name"]: r["id"] for r in world.conn.execute("SELECT id, name FROM projects")}
    order = [r["project_id"] for r in world.conn.execute(
        "SELECT j.project_id FROM attempts a JOIN jobs j ON j.id = a.job_id "
        "WHERE j.pool_id = (SELECT id FROM pools WHERE name = 'linux') ORDER BY a.claimed_at")]
    assert order[:40].count(ids["small"]) == 10, "the small project waited behind the big one"
    # the paused pool ran after its resume: every gpu claim lies outside the pause
    gpu = world.conn.execute("SELECT count(*) AS n FROM attempts a JOIN jobs j ON j.id = a.job_id "
                             "WHERE j.pool_id = (SELECT id FROM pools WHERE name = 'gpu')").fetchone()["n"]
    assert gpu > 0
    with db.connect(db_url) as conn:
        assert transitions.claim(conn, runner_id=w["drained"], pools=w["pools"],
                                 claim_token=transitions.new_claim_token(), lease_seconds=60) is None
