"""A job never outlives its scheduler, nor runs on past a lease its scheduler could not renew.

The watchdog process (scheduler/watchdog.py) kills a job's process group when the scheduler
is SIGKILLed (its pipe closes) or frozen with SIGSTOP past the lease (the deadline passes),
so that the job's next attempt on another runner never runs beside the old one.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from .test_scheduler_e2e import (LEASE_SECONDS, is_running, job_row, schedulers,  # noqa: F401
                                 wait_until)


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still alive (zombies, which a frozen parent
    cannot reap, do not count)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            return True
    return False


def quiet_sleeper(schedulers) -> list[str]:
    """Writes its pid, then a child sleeps silently (no output to die of SIGPIPE on)."""
    return ["sh", "-c", f"echo $$ > {schedulers.pid_dir}/$PGDISPATCH_JOB_ID.pid; "
                        "sleep 30 > /dev/null 2>&1; echo done"]


def test_sigkilled_scheduler_takes_its_jobs_with_it(world, schedulers):
    world.setup()
    job = world.job(command=quiet_sleeper(schedulers), max_attempts=2)
    a = schedulers.start("a")
    wait_until(lambda: is_running(world.conn, job["id"]), what="the job to run", procs=schedulers)
    pgid = schedulers.job_pid(job["id"])
    assert group_alive(pgid)
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=10)
    # the watchdog sees its pipe close and kills the whole group at once (the bound is
    # generous for a loaded machine; without the watchdog the group lives for 30 s)
    wait_until(lambda: not group_alive(pgid), what="the orphaned job to be killed",
               timeout=3 * LEASE_SECONDS, procs=schedulers)


@pytest.mark.parametrize("frozen", ["process", "process group"])
def test_frozen_scheduler_job_is_killed_before_its_lease_lapses(world, schedulers, frozen):
    """SIGSTOP to the scheduler, or to its whole process group (kill -STOP -PGID, Ctrl-Z in a
    terminal): the watchdog runs in its own session, so it is not frozen with them."""
    world.setup()
    job = world.job(command=quiet_sleeper(schedulers), max_attempts=2)
    a = schedulers.start("a", new_session=True)
    wait_until(lambda: is_running(world.conn, job["id"]), what="the job to run", procs=schedulers)
    pgid = schedulers.job_pid(job["id"])
    freeze = a.send_signal if frozen == "process" else (lambda sig: os.killpg(a.pid, sig))
    freeze(signal.SIGSTOP)
    try:
        frozen_at = time.monotonic()
        wait_until(lambda: not group_alive(pgid), what="the frozen scheduler's job to be killed",
                   timeout=3 * LEASE_SECONDS, procs=schedulers)
        killed_after = time.monotonic() - frozen_at
        # killed about when the lease would lapse (plus scheduling slack on a busy machine)
        assert killed_after <= LEASE_SECONDS + 2.0, killed_after
        # ... and the database had not yet expired the attempt when the group died
        attempts = world.conn.execute("SELECT state, lease_expires_at > now() AS live FROM attempts "
                                      "WHERE job_id = %s", (job["id"],)).fetchall()
        assert [a_["state"] for a_ in attempts] == ["running"]
    finally:
        freeze(signal.SIGCONT)
