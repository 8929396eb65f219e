"""LISTEN behind transaction pooling: a scheduler whose DATABASE_URL goes through PgBouncer
in transaction mode listens on a separate session route (``listen_url``, the CLI's
``--listen-url``): direct to PostgreSQL, or a PgBouncer database entry with
``pool_mode = session``. It polls every 30 s here, so a job whose command starts within a
few seconds of its submit was started on the notification.

Controls: without a listener URL such a scheduler does not listen (one warning names the
fix) and the job waits for the poll; and the listener pointed at the transaction-pooled
route itself (the broken variant) LISTENs on a server connection it does not keep and
hears nothing, so the job waits too.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time

import pytest

from pgdispatch.scheduler.main import Scheduler

from ..scheduler.conftest import FAST, wait_until

SLOW_POLL = dataclasses.replace(FAST, claim_interval_seconds=30.0)
# a notification reaches the claimer in milliseconds (bench/pooled.py); the poll takes 30 s
WITHIN_S = 5.0


@pytest.fixture
def scheduler(db_url, pooler):
    """``scheduler(listen_url)`` -> a queue of the claims whose command started, of a
    started scheduler on the transaction-pooled route that polls every 30 s."""
    started: list[Scheduler] = []

    def start(listen_url: str | None) -> queue.Queue:
        commands: queue.Queue = queue.Queue()
        s = Scheduler(SLOW_POLL, database_url=pooler.url(db_url), listen_url=listen_url,
                      pools=["linux"], slots=2, kill_grace_seconds=1.0,
                      on_started=lambda claim, pid: commands.put(claim))
        assert s.start()
        started.append(s)
        # the first poll runs at start; let it find the queue empty before the test submits
        time.sleep(0.5)
        return commands

    yield start
    for s in started:
        s.stop(grace_seconds=0)


def listening(conn) -> list[int]:
    """Server sessions of this database whose last statement was the listener's LISTEN, or
    its registration, which follows the LISTENs (sql/scheduling.py listen_for_work)."""
    return [r["pid"] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND (query = 'LISTEN pgdispatch_queued' OR query LIKE 'SELECT pgd_listen_runner(%%')")]


@pytest.mark.parametrize("route", ["direct", "session alias"])
def test_a_job_starts_on_the_notification_through_the_listener_url(world, db_url, pooler,
                                                                    scheduler, route):
    world.setup()
    listen_url = db_url if route == "direct" else pooler.session_alias(db_url)
    commands = scheduler(listen_url)
    wait_until(lambda: listening(world.conn), what="the listener's session")
    submitted = time.monotonic()
    job = world.job(command=["true"])
    claim = commands.get(timeout=WITHIN_S)
    assert claim.job_id == job["id"]
    assert time.monotonic() - submitted < WITHIN_S  # the poll would take up to 30 s


def test_without_a_listener_url_a_pooled_scheduler_does_not_listen(world, scheduler, caplog):
    world.setup()
    with caplog.at_level(logging.WARNING, logger="pgdispatch.sql.scheduling"):
        commands = scheduler(None)
        wait_until(lambda: "goes through a connection pooler" in caplog.text,
                   what="the listener's warning")
    assert "--listen-url" in caplog.text
    world.job(command=["true"])
    with pytest.raises(queue.Empty):
        commands.get(timeout=3)
    assert listening(world.conn) == []


def test_the_check_fails_with_the_listener_on_the_transaction_pooled_route(world, db_url,
                                                                           pooler, scheduler):
    """Broken variant: the transaction-pooled route given as the listener URL."""
    world.setup()
    commands = scheduler(pooler.url(db_url))
    # Its session's last statement is soon another client's, so there is nothing to wait on:
    # a second is ample for the listener to connect and LISTEN. Had it connected only after
    # the submit, the claim pass it makes on connecting would start the job, and this fail.
    time.sleep(1.0)
    world.job(command=["true"])
    with pytest.raises(queue.Empty):
        commands.get(timeout=WITHIN_S)
