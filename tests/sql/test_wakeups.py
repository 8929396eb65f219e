"""One waiter chosen per claimable job (sql/functions/wakeups.sql, the pgd_notify_queued
trigger in sql/functions/submit.sql): the job's NOTIFY goes to one live, idle, listening
runner of its pool, on that runner's own channel; a dead, stopped or draining listener, or
one with no free slot, is never chosen; with none left the pool's broadcast is sent."""

from __future__ import annotations

import pytest

from pgdispatch.sql import db, transitions
from pgdispatch.sql.scheduling import WAKEUP_CHANNEL, listen_runner, runner_channel

pytestmark = pytest.mark.own_database


@pytest.fixture
def ear(db_url):
    """A session listening on the broadcast and on every runner channel named later;
    ``ear.heard()`` -> the channels notified since the last call."""
    conn = db.connect(db_url, application_name="pgd-test-ear", statement_deadline_seconds=None)
    conn.execute(f"LISTEN {WAKEUP_CHANNEL}")

    class Ear:
        def listen(self, runner_id: int) -> None:
            conn.execute(f"LISTEN {runner_channel(runner_id)}")

        def heard(self) -> list[str]:
            conn.execute("SELECT 1")  # notifications are read with the next answer
            return sorted(n.channel for n in conn.notifies(timeout=0.5, stop_after=100))
    yield Ear()
    conn.close()


@pytest.fixture
def listener(db_url):
    """``listener(runner_id)`` -> an open session registered as the runner's listener."""
    opened = []

    def register(runner_id: int):
        c = db.connect(db_url, application_name="pgdispatch-listener")
        listen_runner(c, runner_id=runner_id)
        opened.append(c)
        return c
    yield register
    for c in opened:
        c.close()


def test_a_submit_wakes_one_idle_listener_on_its_own_channel(world, ear, listener):
    world.setup()
    a, b = world.runner(), world.runner()
    for r in (a, b):
        ear.listen(r)
        listener(r)
    world.job()
    assert len(ear.heard()) == 1  # one of the two, not the broadcast
    world.job()
    # the other one next: the one woken least recently
    assert ear.heard() != [WAKEUP_CHANNEL]


def test_a_bulk_submit_wakes_as_many_listeners_as_jobs_at_most(world, ear, listener, conn):
    world.setup()
    runners = [world.runner() for _ in range(3)]
    for r in runners:
        ear.listen(r)
        listener(r)
    with conn.transaction():
        for _ in range(2):
            transitions.submit(conn, project="web", pool="linux", command=["true"])
    assert len(ear.heard()) == 2
    with conn.transaction():
        for _ in range(5):
            transitions.submit(conn, project="web", pool="linux", command=["true"])
    assert ear.heard() == sorted(runner_channel(r) for r in runners)


@pytest.mark.parametrize("why", ["dead", "stopped", "draining", "full"])
def test_a_listener_that_cannot_claim_is_never_chosen(world, ear, listener, why):
    world.setup()
    r = world.runner(slots=1)
    ear.listen(r)
    session = listener(r)
    if why == "dead":
        session.close()
        world.conn.execute("SELECT pg_sleep(0.2)")  # the session's row leaves pg_stat_activity
    elif why == "stopped":
        world.conn.execute("UPDATE runners SET stopped_at = now() WHERE id = %s", (r,))
    elif why == "draining":
        world.conn.execute("UPDATE runners SET draining = true WHERE id = %s", (r,))
    else:
        world.job()
        assert ear.heard() == [runner_channel(r)]
        assert transitions.claim(world.conn, runner_id=r, pools=world.pool_ids(("linux",)),
                                 claim_token=transitions.new_claim_token(), lease_seconds=30)
    world.job()
    assert ear.heard() == [WAKEUP_CHANNEL]  # the pool's broadcast instead


def test_a_claims_answer_says_whether_more_is_waiting(world):
    world.setup()
    r = world.runner()
    pools = world.pool_ids(("linux",))
    world.job(), world.job()

    def claim():
        return transitions.claim(world.conn, runner_id=r, pools=pools,
                                 claim_token=transitions.new_claim_token(), lease_seconds=30)
    assert claim().more_waiting is True
    assert claim().more_waiting is False
    assert claim() is None


@pytest.mark.parametrize("queued, more", [(3, False), (4, True)])
def test_a_batch_answer_says_whether_more_than_it_took_is_waiting(world, queued, more):
    """A batch of 3 takes every job of 3 (nothing else waits) or leaves the fourth: the
    jobs it took are still queued when it asks (pgd_more_waiting counts past them)."""
    world.setup()
    r = world.runner(slots=10)
    for _ in range(queued):
        world.job()
    got = transitions.claim_batch(world.conn, runner_id=r, pools=world.pool_ids(("linux",)),
                                  claim_tokens=[transitions.new_claim_token() for _ in range(3)],
                                  lease_seconds=30)
    assert len(got) == 3
    assert {c.more_waiting for c in got} == {more}
