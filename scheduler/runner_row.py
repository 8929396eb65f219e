"""The runner keep-alive job: mark this scheduler's runner row alive every
``heartbeat_seconds``, with its draining flag (console and explain read both)."""

from __future__ import annotations

from pgdispatch.sql import transitions
from pgdispatch.sql.db import checkout


def beat(pool, *, runner_id: int, is_draining: bool) -> None:
    """Set the runner's last_heartbeat_at to the database's now, and its draining flag.

    Raises:
        DatabaseUnavailable: not recorded; the next beat will.
    """
    with checkout(pool) as conn:
        transitions.beat_runner(conn, runner_id=runner_id, is_draining=is_draining)


def stop(pool, *, runner_id: int) -> None:
    """Mark the runner stopped (at shutdown).

    Raises:
        DatabaseUnavailable: not recorded.
    """
    with checkout(pool) as conn:
        transitions.stop_runner(conn, runner_id=runner_id)
