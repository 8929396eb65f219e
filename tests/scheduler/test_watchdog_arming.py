"""A heartbeat still in flight when its job ends must not re-arm the watchdog.

The executor disarms the watchdog for a job's process group once the job has ended. A beat
that was sent before and returns after that must not arm the group again: the group id is
free by then, the system may give it to another process group, and the watchdog would
SIGKILL that group when the stale deadline passes. The test uses the real watchdog process
and a real heartbeat held up by a row lock; a live process group stands for the one that
got the id.
"""

from __future__ import annotations

import subprocess
import time

from pgdispatch.scheduler.heartbeats import Heartbeat, fence_margin_seconds
from pgdispatch.scheduler.watchdog import Watchdog
from pgdispatch.sql import Settings, db
from pgdispatch.sql.scheduling import make_scheduler_pool

from .conftest import wait_until

SETTINGS = Settings(lease_seconds=3.0, heartbeat_seconds=0.2, claim_interval_seconds=0.2,
                    claim_idle_cap_seconds=0.8)


def beat_blocked(conn) -> bool:
    """Whether some session waits for a row lock (the beat, behind the test's lock)."""
    return conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND datname = current_database()").fetchone()["n"] > 0


def end_job_during_a_beat(world, db_url, end_job) -> bool:
    """Run a heartbeat for a claimed job whose "process group" is a live bystander; hold
    the attempt's row so that a beat is in flight, end the job with ``end_job(hb)``, let the
    beat finish, and wait past the deadline a re-arm would have set. Returns whether the
    bystander is still alive then."""
    world.setup()
    world.job()
    claim = world.claim(world.runner(), lease_seconds=30)
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    watchdog = Watchdog(margin_seconds=fence_margin_seconds(SETTINGS.lease_seconds))
    pool = make_scheduler_pool(db_url, slots=1)
    try:
        hb = Heartbeat(claim, pool=pool, settings=SETTINGS, sent_at=time.monotonic(),
                       wake=lambda: None, watchdog=watchdog, pgid=bystander.pid)
        with db.connect(db_url, application_name="row-holder") as holder:
            holder.execute("BEGIN")
            holder.execute("SELECT 1 FROM attempts WHERE id = %s FOR UPDATE", (claim.attempt_id,))
            hb.start()
            wait_until(lambda: beat_blocked(world.conn), what="a beat to wait on the attempt row")
            end_job(hb)
            holder.execute("COMMIT")  # the beat succeeds now, after the job ended
        hb.join(timeout=10)
        assert not hb.is_alive() and not hb.is_fenced.is_set()
        time.sleep(SETTINGS.lease_seconds + 0.5)
        return bystander.poll() is None
    finally:
        pool.close()
        watchdog.close()
        if bystander.poll() is None:
            bystander.kill()
        bystander.wait()


def test_a_beat_in_flight_when_the_job_ends_does_not_re_arm_the_watchdog(world, db_url):
    def end_job(hb):  # what Execution does once the command has exited
        hb.stopping.set()
        hb.disarm_watchdog()

    assert end_job_during_a_beat(world, db_url, end_job)


def test_the_check_fails_when_the_beat_re_arms_after_the_disarm(world, db_url):
    """The same run with the disarm sent straight to the watchdog, past the heartbeat (as
    before the fix): the late beat arms the freed group id again, and the watchdog kills the
    bystander at the stale deadline."""

    def end_job(hb):
        hb.stopping.set()
        hb.watchdog.disarm(hb.pgid)

    assert not end_job_during_a_beat(world, db_url, end_job)
