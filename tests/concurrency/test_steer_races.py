"""A pool pause and a runner drain against the claims in flight, on real connections.

Two ways a claim can be in flight when the operator acts (sql/functions/claim.sql,
pgd_pool_is_paused and the runner claim lock, say why each is safe):

* it already holds its slot of the pool and has read "not paused", but not committed: the
  pause must wait for it, and stamp its time after it (the fence);
* it has read "not paused" / "not drained" at its start and waits, before its slot, on a
  lock (here: the deployment's target, held by another transaction): a pause that commits
  meanwhile must be seen by its re-read, and a drain must wait for it.

Each is paired with the broken copy the same checks catch: a pause without its fence, a
claim without its re-read, a drain without the runner claim lock. Two operators pausing or
draining at once get one winner.
"""

from __future__ import annotations

import threading
import time

import pytest

from pgdispatch.sql import AlreadyResolved, db, transitions
from tests.faults.consistency import steering_violations
from tests.variants import variant_sql

from .harness import run_together

ACTORS = ("alice", "bob")
PAUSE_FENCE = """    PERFORM s.stripe_no FROM capacity_stripes s
      WHERE s.kind = 'pool' AND s.owner_id = v.id ORDER BY s.stripe_no FOR UPDATE;"""
CLAIM_REREAD = "IF pgd_pool_is_paused(c.pool_id) THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;"
DRAIN_FENCE = "PERFORM pg_advisory_xact_lock(pgd_runner_lock_class(), pgd_runner_lock_key(v.id));"


def _wait_for_lock_wait(conn, application_name: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE application_name = %s",
                           (application_name,)).fetchone()
        if row and row["wait_event_type"] == "Lock":
            return
        time.sleep(0.02)
    raise AssertionError(f"{application_name} never waited on a lock")


class _Thread(threading.Thread):
    """Runs fn(conn) on a connection of its own; keeps the value or the error."""

    def __init__(self, db_url: str, name: str, fn):
        super().__init__(name=f"racer-{name}", daemon=True)
        self.db_url, self.app, self.fn = db_url, name, fn
        self.value = self.error = None

    def run(self) -> None:
        try:
            with db.connect(self.db_url, application_name=self.app) as conn:
                self.value = self.fn(conn)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc


def _claim(world, runner, pools):
    return lambda conn: transitions.claim(conn, runner_id=runner, pools=world.pool_ids(pools),
                                          claim_token=transitions.new_claim_token(),
                                          lease_seconds=30)


def _claim_behind_held_target(world, db_url, runner, act):
    """A deployment's claim that read the small tables at its start waits on its target (a
    row lock held by another transaction) while ``act(conn)`` runs on a third connection;
    then the target is let go. Returns (the claim or None, act's thread: still waiting when
    the target was let go?)."""
    held, release = threading.Event(), threading.Event()

    def hold(conn):
        with conn.transaction():
            conn.execute("SELECT 1 FROM targets WHERE name = 'production' FOR UPDATE")
            held.set()
            release.wait(30)

    holder = _Thread(db_url, "target-holder", hold)
    holder.start()
    assert held.wait(10)
    claimer = _Thread(db_url, "claimer", _claim(world, runner, ("deploy",)))
    claimer.start()
    _wait_for_lock_wait(world.conn, "claimer")
    actor = _Thread(db_url, "operator", act)
    actor.start()
    actor.join(1.0)
    act_waited = actor.is_alive()
    release.set()
    for t in (holder, claimer, actor):
        t.join(30)
        assert not t.is_alive()
    for t in (holder, claimer, actor):
        if t.error is not None:
            raise t.error
    return claimer.value, act_waited


def _pause_during_open_claim(world, db_url, runner):
    """A claim that holds its pool slot and has not committed; a pause meanwhile. Returns
    (whether the pause was still waiting when the claim committed, the claim's attempt's
    claimed_at, the pause's paused_at)."""
    claimed, release = threading.Event(), threading.Event()

    def claim_and_wait(conn):
        with conn.transaction():
            c = _claim(world, runner, ("linux",))(conn)
            claimed.set()
            release.wait(30)
        return c

    claimer = _Thread(db_url, "claimer", claim_and_wait)
    claimer.start()
    assert claimed.wait(10)
    pauser = _Thread(db_url, "operator", lambda conn: transitions.pause_pool(
        conn, pool="linux", reason="maintenance", actor="alice"))
    pauser.start()
    pauser.join(1.0)
    waited = pauser.is_alive()
    release.set()
    for t in (claimer, pauser):
        t.join(30)
        assert not t.is_alive()
        if t.error is not None:
            raise t.error
    assert claimer.value is not None
    claimed_at = world.conn.execute("SELECT claimed_at FROM attempts WHERE id = %s",
                                    (claimer.value.attempt_id,)).fetchone()["claimed_at"]
    paused_at = world.conn.execute("SELECT paused_at FROM pools WHERE name = 'linux'").fetchone()["paused_at"]
    return waited, claimed_at, paused_at


def _deploy_world(world):
    world.setup(pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    world.job(pool="deploy", target="production", command=["deploy"])
    return runner


# --- a pause and a claim that holds its slot ------------------------------------------------

def test_a_pause_waits_for_the_claim_holding_a_slot_and_stamps_its_time_after_it(world, db_url):
    world.setup()
    runner = world.runner()
    world.job()
    waited, claimed_at, paused_at = _pause_during_open_claim(world, db_url, runner)
    assert waited, "the pause committed while a claim of its pool was still in flight"
    assert claimed_at < paused_at
    assert steering_violations(world.conn) == []


def test_catches_a_pause_without_its_fence(world, db_url):
    world.setup()
    runner = world.runner()
    world.job()
    world.conn.execute(variant_sql(world.conn, "pgd_pause_pool", [(PAUSE_FENCE, "")]))
    waited, _, _ = _pause_during_open_claim(world, db_url, runner)
    assert not waited  # what the test above fails on


# --- a pause and a claim before its slot ----------------------------------------------------

def _pause(conn):
    return transitions.pause_pool(conn, pool="deploy", reason="freeze", actor="alice")


def test_a_claim_that_read_not_paused_before_the_pause_rereads_it_and_takes_nothing(world, db_url):
    runner = _deploy_world(world)
    claim, pause_waited = _claim_behind_held_target(world, db_url, runner, _pause)
    assert not pause_waited  # the claim held no slot of the pool yet
    assert claim is None
    assert steering_violations(world.conn) == []
    transitions.resume_pool(world.conn, pool="deploy", actor="bob")
    assert world.claim(runner, pools=("deploy",)) is not None
    assert steering_violations(world.conn) == []


def test_catches_a_claim_that_does_not_reread_the_pause(world, db_url):
    runner = _deploy_world(world)
    world.conn.execute(variant_sql(world.conn, "pgd_claim", [(CLAIM_REREAD, "NULL;")]))
    claim, _ = _claim_behind_held_target(world, db_url, runner, _pause)
    assert claim is not None
    found = steering_violations(world.conn)
    assert len(found) == 1 and "claimed in pool deploy" in found[0] and "while paused" in found[0]


# --- a drain and its runner's claim in flight -----------------------------------------------

def test_a_drain_waits_for_its_runners_claim_in_flight(world, db_url):
    runner = _deploy_world(world)
    claim, drain_waited = _claim_behind_held_target(
        world, db_url, runner,
        lambda conn: transitions.drain_runner(conn, runner_id=runner, reason="reboot", actor="alice"))
    assert drain_waited, "the drain committed while its runner's claim was in flight"
    assert claim is not None  # it read "not drained": it commits first, and counts as before
    assert steering_violations(world.conn) == []
    world.job(pool="deploy", target="production", command=["deploy"])
    assert world.claim(runner, pools=("deploy",)) is None


def test_catches_a_drain_without_the_runner_claim_lock(world, db_url):
    runner = _deploy_world(world)
    world.conn.execute(variant_sql(world.conn, "pgd_drain_runner", [(DRAIN_FENCE, "")]))
    claim, drain_waited = _claim_behind_held_target(
        world, db_url, runner,
        lambda conn: transitions.drain_runner(conn, runner_id=runner, reason="reboot", actor="alice"))
    assert not drain_waited and claim is not None
    found = steering_violations(world.conn)
    assert len(found) == 1 and f"claimed by runner {runner}" in found[0], found


# --- two operators ----------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["pool", "runner"])
def test_two_operators_pausing_or_draining_at_once_get_one_winner(world, db_url, what):
    world.setup()
    runner = world.runner()
    for round_no in range(4):
        if what == "pool":
            act = [lambda conn, a=a: transitions.pause_pool(conn, pool="linux", reason=f"by {a}", actor=a)
                   for a in ACTORS]
            undo = [lambda conn, a=a: transitions.resume_pool(conn, pool="linux", actor=a) for a in ACTORS]
        else:
            act = [lambda conn, a=a: transitions.drain_runner(conn, runner_id=runner, reason=f"by {a}",
                                                              actor=a) for a in ACTORS]
            undo = [lambda conn, a=a: transitions.resume_runner(conn, runner_id=runner, actor=a)
                    for a in ACTORS]
        for fns, said in ((act, "already"), (undo, "not")):
            outcomes = run_together(db_url, fns)
            wins = [i for i, o in enumerate(outcomes) if o.error is None]
            assert len(wins) == 1, f"round {round_no}: {outcomes}"
            loser = outcomes[1 - wins[0]].error
            assert isinstance(loser, AlreadyResolved) and said in str(loser), loser
            if said == "already":
                assert f"by {ACTORS[wins[0]]} at " in str(loser)
            else:
                assert f"resumed by {ACTORS[wins[0]]} at " in str(loser)
    subject = "pool:linux" if what == "pool" else f"runner:{runner}"
    n = world.conn.execute("SELECT count(*) AS n FROM audit_events WHERE subject = %s",
                           (subject,)).fetchone()["n"]
    assert n == 8
