"""pgd_heartbeat_batch (sql/functions/runners.sql): one transaction renews the leases of
several attempts, each on exactly pgd_heartbeat's conditions, and leaves out the fenced."""

from __future__ import annotations

import pytest

from pgdispatch.sql import InvalidInput, transitions


def test_a_batch_renews_the_running_and_leaves_out_the_fenced(world):
    world.setup()
    runner = world.runner()
    jobs = [world.job() for _ in range(4)]
    live, stale, ended, cancelled = [world.claim(runner, lease_seconds=5) for _ in jobs]
    world.complete(ended, "succeeded", exit_code=0)
    transitions.cancel_job(world.conn, job_id=cancelled.job_id, actor="alice", reason="wrong")
    leases = transitions.heartbeat_batch(world.conn, beats=[
        (live.attempt_id, live.generation, "so far"),
        (stale.attempt_id, stale.generation + 1, None),   # another generation: fenced
        (ended.attempt_id, ended.generation, None),       # no longer running: fenced
        (cancelled.attempt_id, cancelled.generation, None),
    ], lease_seconds=60)
    assert set(leases) == {live.attempt_id, cancelled.attempt_id}
    assert leases[live.attempt_id].lease_expires_at > live.lease_expires_at
    assert not leases[live.attempt_id].is_cancel_requested
    assert leases[cancelled.attempt_id].is_cancel_requested
    row = world.row("attempts", live.attempt_id)
    assert row["output_tail"] == "so far" and row["lease_expires_at"] > live.lease_expires_at
    # the fenced attempt's lease is untouched
    assert world.row("attempts", stale.attempt_id)["lease_expires_at"] == stale.lease_expires_at
    # a NULL tail keeps what was stored
    transitions.heartbeat_batch(world.conn, beats=[(live.attempt_id, live.generation, None)],
                                lease_seconds=60)
    assert world.row("attempts", live.attempt_id)["output_tail"] == "so far"


def test_a_batch_checks_its_lease_and_size(world):
    world.setup()
    with pytest.raises(InvalidInput):
        transitions.heartbeat_batch(world.conn, beats=[(1, 1, None)], lease_seconds=0)
    with pytest.raises(InvalidInput):
        transitions.heartbeat_batch(world.conn, beats=[(1, 1, None)] * 1001, lease_seconds=30)
    assert transitions.heartbeat_batch(world.conn, beats=[], lease_seconds=30) == {}
    with pytest.raises(Exception) as info:  # the server's own check: unequal lengths
        world.conn.execute("SELECT * FROM pgd_heartbeat_batch('{1,2}', '{1}', 30, '{NULL,NULL}')")
    assert getattr(info.value, "sqlstate", None) == "PD422"
