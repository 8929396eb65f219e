"""A seeded, randomized mix of faults (issue 3, scenario C); see chaos_runner.

Duration: PGDISPATCH_FAULT_SECONDS (default 25 s; ``make test-long``: 120 s). Seed:
PGDISPATCH_FAULT_SEED, else random; either way it is printed first, so a failing run can be
replayed with ``PGDISPATCH_FAULT_SEED=<seed> pytest tests/faults/test_random_faults.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest

from pgdispatch.sql import db

from .chaos_procs import ROOT, Fleet
from .chaos_proxy import ChaosProxy
from .chaos_runner import ACTIONS, BROKEN_CLAIM_SQL, ChaosRun, fault_seconds, fault_seed
from .conftest import upstream_of
from .invariants import check_invariants
from .proxy import CommitDroppingProxy


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path)
    yield f
    f.close()


@pytest.fixture
def proxy(db_url):
    """The proxied scheduler's commit-dropping proxy (overrides tests/faults/conftest's)."""
    p = ChaosProxy.in_front_of(db_url)
    yield p
    p.close()


@pytest.fixture
def chaos(db_url, proxy, fleet, tmp_path):
    """Makes ChaosRun(seed=…, seconds=…) runs on this test's database; closes them after."""
    made = []

    def make(**kw) -> ChaosRun:
        made.append(ChaosRun(db_url, proxy, fleet, tmp_path, **kw))
        return made[-1]
    yield make
    fleet.close()
    for run in made:
        run.close()


# the schedule itself, then up to ~3 min of draining and stopping (pytest-timeout's default
# of 300 s would cut a long profile short)
@pytest.mark.timeout(fault_seconds(os.environ) + 240)
def test_random_fault_schedule_keeps_every_invariant(chaos, fleet, capsys):
    seed, seconds = fault_seed(os.environ), fault_seconds(os.environ)
    with capsys.disabled():
        print(f"\nchaos: seed={seed} duration={seconds:g}s "
              f"(replay: PGDISPATCH_FAULT_SEED={seed} PGDISPATCH_FAULT_SECONDS={seconds:g})")
    run = chaos(seed=seed, seconds=seconds)
    run.setup()
    run.run()
    drained = run.drain()
    summary = run.finish(drain_seconds=drained)
    with capsys.disabled():
        print(summary.line())
    assert summary.violations == [], "\n".join(summary.violations) + "\n" + fleet.logs(1500)
    # the schedule did inject what it claims to mix, and work got done through it
    assert summary.faults["sigkill"] + summary.faults["sigterm"] > 0
    assert summary.faults["terminate_backend"] > 0 and summary.faults["commit_drop"] > 0
    assert summary.attempt_states.get("succeeded", 0) > 0
    # deployments to the superseding targets were superseded through it (issue 20)
    assert summary.job_states.get("superseded", 0) > 0, summary.job_states


def test_the_schedule_catches_a_claim_without_conditional_capacity(chaos, capsys, conn):
    """The same schedule, shorter, against a pgd_claim that checks capacity on a plain read
    and then reserves it unconditionally: the checker must see more attempts at once than
    the limits allow."""
    conn.execute(BROKEN_CLAIM_SQL)
    seed = fault_seed(os.environ)
    # no pauses nor drains: they idle the claimers, and this run must keep them busy
    run = chaos(seed=seed, seconds=8.0, slots=4,
                actions=dict(ACTIONS, pause=0.0, pause_pool=0.0, drain_runner=0.0))
    run.setup()
    run.run()
    summary = run.finish(drain_seconds=0.0)
    found = [v for v in summary.violations if v.startswith("capacity_overlap: ")]
    with capsys.disabled():
        print(f"\nbroken claim: {summary.line()}\n  " + "\n  ".join(summary.violations))
    assert found, summary.violations
    assert check_invariants(conn) != []


VICTIM = """
import sys, time
import pgdispatch.sql.db
from pgdispatch import sql
from pgdispatch.sql import transitions
sql.db.IDLE_IN_TRANSACTION_TIMEOUT_S = float(sys.argv[2])  # short, for the test
conn = sql.db.connect(sys.argv[1])
with conn.transaction():
    claim = transitions.claim(conn, runner_id=int(sys.argv[3]), pools=[int(sys.argv[4])],
                              claim_token=transitions.new_claim_token(), lease_seconds=30)
    print(claim.job_id, flush=True)
    time.sleep(600)  # killed in here: the claim's row locks are held, never committed
"""


def test_pgdispatch_sessions_bound_their_idle_transactions(db_url):
    """Every session sql.db opens, alone or pooled, carries the bound (60 s)."""
    with db.connect(db_url) as c:
        assert c.execute("SHOW idle_in_transaction_session_timeout").fetchone() == {
            "idle_in_transaction_session_timeout": "1min"}
    pool = db.make_pool(db_url, min_size=1, max_size=1)
    try:
        with pool.connection() as c:
            assert c.execute("SHOW idle_in_transaction_session_timeout").fetchone() == {
                "idle_in_transaction_session_timeout": "1min"}
    finally:
        pool.close()


def test_a_claimer_killed_mid_transaction_behind_a_proxy_stalls_nobody(world, db_url):
    """A claimer dies (SIGKILL) inside its claim transaction, behind a proxy that keeps the
    server's socket open (CommitDroppingProxy does: like NAT, a middlebox or a partition,
    the server never hears the client go). Its session holds the organization, project,
    pool and job row locks; only the idle-in-transaction bound that sql.db sets (shortened
    to 1 s in the victim, so the test is quick) ends it. Then the claim it never committed
    is gone and another claimer gets the same job."""
    world.setup()
    runner = world.runner()
    job = world.job()
    pool_id = world.pool_ids(("linux",))[0]
    proxy = CommitDroppingProxy(upstream_of(db_url))
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, proxy.url(urlsplit(db_url).path.lstrip("/")), "1",
         str(runner), str(pool_id)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = victim.stdout.readline().decode().strip()
        assert line == str(job["id"]), victim.stderr.read().decode()
        victim.kill()
        victim.wait(timeout=10)
        killed = time.monotonic()
        world.conn.execute("SET lock_timeout = '20s'")  # fail, do not hang, without the bound
        claim = world.claim(world.runner())
        waited = time.monotonic() - killed
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(timeout=10)
        victim.stdout.close()
        victim.stderr.close()
        proxy.close()
    assert claim is not None and claim.job_id == job["id"] and claim.generation == 1
    assert waited < 10, waited
