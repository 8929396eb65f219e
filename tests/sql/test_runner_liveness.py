"""A runner is live for two of its own beats, however short the reader's bound
(pgd_runner_is_live, sql/functions/runners.sql): the console's bound is the lease, which may
be shorter than the keep-alive interval of a runner that holds no duty."""

from __future__ import annotations

from pgdispatch.sql import reads
from pgdispatch.sql.explain import read_world


def _silent_for(world, runner: int, seconds: float, beat_seconds: float | None) -> None:
    world.conn.execute(
        "UPDATE runners SET last_heartbeat_at = now() - make_interval(secs => %s), "
        "beat_seconds = %s WHERE id = %s", (seconds, beat_seconds, runner))


def _live(world, runner: int, live_seconds: float) -> tuple[bool, bool]:
    """(is the runner listed live, does it serve pool linux), as the console reads them."""
    listed = {r["id"]: r["is_live"] for r in reads.list_runners(world.conn, live_seconds=live_seconds)}
    pool = world.pool_ids(("linux",))[0]
    return listed[runner], pool in read_world(world.conn, live_seconds=live_seconds).live_pools


def test_a_runner_between_two_beats_longer_than_the_lease_is_live(world):
    world.setup()
    runner = world.runner()
    _silent_for(world, runner, 13.0, beat_seconds=15.0)
    assert _live(world, runner, live_seconds=12.0) == (True, True)


def test_a_runner_silent_for_two_beats_is_not_live(world):
    world.setup()
    runner = world.runner()
    _silent_for(world, runner, 31.0, beat_seconds=15.0)
    assert _live(world, runner, live_seconds=12.0) == (False, False)
    # without a recorded beat the reader's bound alone decides
    _silent_for(world, runner, 13.0, beat_seconds=None)
    assert _live(world, runner, live_seconds=12.0) == (False, False)
    assert _live(world, runner, live_seconds=30.0) == (True, True)
