"""Heartbeats batched per scheduler (scheduler/heartbeats.py, HeartbeatSender): the leases
of the running jobs whose beats fall due together are renewed in one transaction, and each
job is still fenced on its own answer."""

from __future__ import annotations

import time

from pgdispatch.sql import transitions

from .conftest import FAST, group_is_alive, wait_until


def leases(conn, attempt_ids) -> dict[int, object]:
    rows = conn.execute("SELECT id, lease_expires_at FROM attempts WHERE id = ANY (%s)",
                        (list(attempt_ids),)).fetchall()
    return {r["id"]: r["lease_expires_at"] for r in rows}


def test_the_beats_of_jobs_running_together_go_in_one_transaction(world, start_scheduler):
    world.setup()
    for _ in range(4):
        world.job(command=["sleep", "30"])
    s, signals = start_scheduler(slots=4)
    claims = [signals.next_started()[0] for _ in range(4)]
    ids = [c.attempt_id for c in claims]
    sent = s._heartbeats.transactions
    first = leases(world.conn, ids)
    time.sleep(3.5 * FAST.heartbeat_seconds)
    # three or four beats of each of the four jobs: in as many transactions, not 12 to 16
    assert s._heartbeats.transactions - sent <= 5
    now = leases(world.conn, ids)
    assert all(now[i] > first[i] for i in ids)  # every lease renewed
    for c in claims:
        transitions.cancel_job(world.conn, job_id=c.job_id, actor="test", reason="done")
    for _ in claims:  # the cancel is learnt from a (batched) beat's answer
        assert signals.next_completed().outcome == "cancelled"


def test_a_job_fenced_out_is_stopped_alone_while_the_others_beat_on(world, start_scheduler):
    world.setup()
    for _ in range(3):
        world.job(command=["sleep", "30"])
    s, signals = start_scheduler(slots=3)
    started = [signals.next_started() for _ in range(3)]
    (lost, lost_pid), *others = started
    time.sleep(2.5 * FAST.heartbeat_seconds)  # their beats fall into step: one batch
    # another runner has the job now: its attempt expired and the job claimed again
    world.expire_now(lost.attempt_id)
    assert transitions.expire_one(world.conn)["attempt_id"] == lost.attempt_id
    result = signals.next_completed(timeout=3 * FAST.heartbeat_seconds + 5)
    assert result.claim.attempt_id == lost.attempt_id
    assert result.stop_reason == "fenced" and not result.is_reported
    assert not group_is_alive(lost_pid)
    before = leases(world.conn, [c.attempt_id for c, _ in others])
    wait_until(lambda: all(v > before[k] for k, v in
                           leases(world.conn, [c.attempt_id for c, _ in others]).items()),
               timeout=3 * FAST.heartbeat_seconds, what="the others' leases renewed")
    for c, pid in others:
        assert group_is_alive(pid)
        assert world.row("attempts", c.attempt_id)["state"] == "running"
