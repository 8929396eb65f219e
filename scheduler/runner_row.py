"""The runner keep-alive: mark this scheduler's runner row alive, with its draining flag
(console and explain read both), and carry the duty election (scheduler/duties.py times the
beats: every ``runner_beat_seconds``, every ``duty_lease_seconds / 3`` while holding)."""

from __future__ import annotations

from typing import Any

from pgdispatch.sql import transitions
from pgdispatch.sql.db import checkout


def beat(pool, *, runner_id: int, is_draining: bool, beat_seconds: float = 15.0,
         duty_lease_seconds: float = 20.0) -> list[dict[str, Any]]:
    """Set the runner's last_heartbeat_at to the database's now and its draining flag;
    renew the duties it holds and take over lapsed ones (draining: release its own), each
    for ``duty_lease_seconds``. ``beat_seconds``: this runner's longest gap between beats.

    Returns every duty row (sql.transitions.beat_runner).
    Raises:
        DatabaseUnavailable: not recorded; the next beat will.
    """
    with checkout(pool) as conn:
        return transitions.beat_runner(conn, runner_id=runner_id, is_draining=is_draining,
                                       beat_seconds=beat_seconds,
                                       duty_lease_seconds=duty_lease_seconds)


def stop(pool, *, runner_id: int) -> None:
    """Mark the runner stopped (at shutdown) and release its duties, so that another
    runner's next beat takes them over at once.

    Raises:
        DatabaseUnavailable: not recorded (its duties then lapse a lease later).
    """
    with checkout(pool) as conn:
        transitions.stop_runner(conn, runner_id=runner_id)


def cleanup(pool, *, runner_id: int, term: int, batch: int = 100) -> dict[str, Any] | None:
    """One batch of the cleanup duty (sql.transitions.run_cleanup): {"lost": [runner ids],
    "pruned": n}, or None when this runner does not hold the duty in ``term``.

    Raises:
        DatabaseUnavailable: nothing changed; the next run will.
    """
    with checkout(pool) as conn:
        return transitions.run_cleanup(conn, runner_id=runner_id, term=term, batch=batch)
