"""Wake-ups: a job that becomes claimable is claimed at once through LISTEN/NOTIFY
(migrations/0006_wakeups.sql, sql.scheduling.listen_for_work), not at the next poll.

The schedulers here poll every 30 s, so a claim within a few seconds can only come from a
notification; the controls (listening off, notifications switched off in the database) show
that the same job then waits.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from urllib.parse import urlsplit

import pytest

from pgdispatch.scheduler.main import Scheduler
from pgdispatch.sql import db, transitions

from .conftest import FAST, wait_until

SLOW_POLL = dataclasses.replace(FAST, claim_interval_seconds=30.0)


@pytest.fixture
def slow_scheduler(db_url):
    """``slow_scheduler(listen=...)`` -> a queue of claims of a started scheduler that polls
    every 30 s; stopped at teardown."""
    started: list[Scheduler] = []

    def start(*, listen: bool) -> queue.Queue:
        claimed: queue.Queue = queue.Queue()
        s = Scheduler(SLOW_POLL, database_url=db_url, pools=["linux"], slots=2, listen=listen,
                      kill_grace_seconds=1.0, on_claimed=claimed.put)
        assert s.start()
        started.append(s)
        # the first poll runs at start; let it find the queue empty before we submit
        time.sleep(0.5)
        return claimed

    yield start
    for s in started:
        s.stop(grace_seconds=0)


def listener_sessions(conn) -> list[int]:
    return [r["pid"] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgdispatch-listener' "
        "AND datname = current_database()")]


def test_a_submitted_job_is_claimed_at_once_not_at_the_next_poll(world, slow_scheduler):
    world.setup()
    claimed = slow_scheduler(listen=True)
    wait_until(lambda: listener_sessions(world.conn), what="the listener's session")
    submitted = time.monotonic()
    job = world.job()
    claim = claimed.get(timeout=5)
    assert claim.job_id == job["id"]
    assert time.monotonic() - submitted < 5  # the poll would take up to 30 s


def test_without_listening_the_job_waits_for_the_poll(world, slow_scheduler):
    world.setup()
    claimed = slow_scheduler(listen=False)
    world.job()
    with pytest.raises(queue.Empty):
        claimed.get(timeout=3)
    assert listener_sessions(world.conn) == []


def test_notifications_switched_off_in_the_database_leave_the_job_to_the_poll(
        world, slow_scheduler, db_url):
    world.setup()
    name = urlsplit(db_url).path.lstrip("/")
    world.conn.execute(f"ALTER DATABASE {name} SET pgdispatch.notify = 'off'")
    claimed = slow_scheduler(listen=True)
    wait_until(lambda: listener_sessions(world.conn), what="the listener's session")
    with db.connect(db_url) as submitter:  # a new session: it reads the database's setting
        transitions.submit(submitter, project="web", pool="linux", command=["true"])
    with pytest.raises(queue.Empty):
        claimed.get(timeout=3)


def test_the_listener_comes_back_after_its_session_is_killed(world, slow_scheduler):
    world.setup()
    claimed = slow_scheduler(listen=True)
    first = wait_until(lambda: listener_sessions(world.conn), what="the listener's session")
    world.conn.execute("SELECT pg_terminate_backend(%s)", (first[0],))
    again = wait_until(lambda: [p for p in listener_sessions(world.conn) if p not in first],
                       timeout=10, what="a new listener session")
    assert again
    job = world.job()
    assert claimed.get(timeout=5).job_id == job["id"]
