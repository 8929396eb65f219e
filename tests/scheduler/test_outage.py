"""A database outage does not crash the scheduler: it backs off, recovers, and a job that
finished during the outage is reported once the database is back."""

from __future__ import annotations

import dataclasses
import time
from urllib.parse import urlsplit

from pgdispatch.sql import db

from .conftest import FAST, group_is_alive, wait_until


def cut_off(server_url: str, db_url: str, *, is_cut: bool) -> None:
    """Test-only outage of this test's database: refuse new connections and drop the
    scheduler's (the test's own connection, application "pgd-test", stays), or end it."""
    name = urlsplit(db_url).path.lstrip("/")
    assert name.startswith("pgd_test_")
    with db.connect(server_url) as admin:
        admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS {'false' if is_cut else 'true'}")
        if is_cut:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = %s AND application_name <> 'pgd-test'", (name,))


def receipt_count(conn, attempt_id: int) -> int:
    return conn.execute("SELECT count(*) AS n FROM delivery_receipts WHERE attempt_id = %s",
                        (attempt_id,)).fetchone()["n"]


def test_a_job_finishing_during_an_outage_is_reported_after_it(world, start_scheduler,
                                                               server_url, db_url):
    world.setup()
    job = world.job(command=["sh", "-c", "sleep 1; echo survived"])
    # A lease long enough to outlast the outage, so the job is not self-fenced.
    settings = dataclasses.replace(FAST, lease_seconds=12.0, heartbeat_seconds=1.0)
    s, signals = start_scheduler(settings=settings)
    claim, _ = signals.next_started()
    cut_off(server_url, db_url, is_cut=True)
    try:
        time.sleep(2.5)  # the outage itself: heartbeats and the completion fail meanwhile
        assert signals.completed.empty()
    finally:
        cut_off(server_url, db_url, is_cut=False)
    result = signals.next_completed(timeout=15)
    assert result.outcome == "succeeded" and result.is_reported
    assert world.row("jobs", job["id"])["state"] == "succeeded"
    receipts = receipt_count(world.conn, claim.attempt_id)
    assert receipts == 1
    # The periodic jobs survived the outage: new work is still claimed and run.
    after = world.job(command=["true"])
    result = signals.next_completed(timeout=15)
    assert result.claim.job_id == after["id"] and result.outcome == "succeeded"


def test_a_job_whose_heartbeats_all_fail_for_a_lease_is_killed_unreported(
        world, start_scheduler, server_url, db_url):
    world.setup()
    job = world.job(command=["sleep", "60"])
    settings = dataclasses.replace(FAST, lease_seconds=2.0, heartbeat_seconds=0.5)
    s, signals = start_scheduler(settings=settings)
    claim, pid = signals.next_started()
    cut_off(server_url, db_url, is_cut=True)
    try:
        cut_at = time.monotonic()
        # Self-fencing: within a lease of the last heartbeat sent, the group is killed.
        result = signals.next_completed(timeout=settings.lease_seconds + 3)
        assert time.monotonic() - cut_at <= settings.lease_seconds + 0.5
    finally:
        cut_off(server_url, db_url, is_cut=False)
    assert result.stop_reason == "self_fenced"
    assert result.outcome is None and not result.is_reported
    assert not group_is_alive(pid)
    # Nothing was reported: the attempt is left to the lease expiry, like a dead runner's.
    receipts = receipt_count(world.conn, claim.attempt_id)
    assert receipts == 0
    wait_until(lambda: world.row("attempts", claim.attempt_id)["state"] == "expired",
               timeout=15, what="the lease expiry")
    assert world.row("jobs", job["id"])["state"] == "failed"
