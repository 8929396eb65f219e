"""The summary job refreshes the per-(project, pool) queue summary."""

from __future__ import annotations

from .conftest import wait_until


def test_the_queue_summary_is_refreshed(world, start_scheduler):
    world.setup(pools=("linux", "mac"))
    for _ in range(3):
        world.job(pool="mac")  # no scheduler serves mac: these stay queued
    world.job(pool="mac", delay_seconds=3600)
    start_scheduler(pools=("linux",))

    def summary():
        return world.conn.execute(
            "SELECT s.queued_ready, s.queued_delayed FROM queue_summaries s "
            "JOIN pools q ON q.id = s.pool_id WHERE q.name = 'mac'").fetchone()

    row = wait_until(summary, timeout=10, what="a queue summary row")
    assert (row["queued_ready"], row["queued_delayed"]) == (3, 1)
