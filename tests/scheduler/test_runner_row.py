"""The runner keep-alive job: the runner row stays live, and says when it is draining."""

from __future__ import annotations

from .conftest import FAST, wait_until


def test_the_runner_row_is_kept_alive_and_marked_draining(world, start_scheduler):
    world.setup()
    s, _ = start_scheduler(name="builder-1", slots=3)

    def row():
        return world.conn.execute("SELECT * FROM runners WHERE id = %s", (s.runner_id,)).fetchone()

    first = row()
    assert (first["name"], first["slots"], first["draining"]) == ("builder-1", 3, False)
    wait_until(lambda: row()["last_heartbeat_at"] > first["last_heartbeat_at"],
               timeout=FAST.heartbeat_seconds * 4, what="a runner heartbeat")
    s.drain(grace_seconds=0)
    assert row()["draining"] is True and row()["stopped_at"] is None
    s.stop(grace_seconds=0)
    assert row()["stopped_at"] is not None
