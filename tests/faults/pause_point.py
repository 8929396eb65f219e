"""A test-only pause point inside a transition, with no change to production code.

``install(conn, table, events)`` creates, in the test's database only, a BEFORE row trigger
on ``table`` that waits for a shared advisory lock. While the test holds that lock
exclusively (``shut``), any transition writing that table stalls there, in the middle of its
transaction, with every row lock it has taken so far; ``open_`` lets it go on. Transitions
take the shared lock, so they never wait for each other at the pause point.
"""

from __future__ import annotations

import time

PAUSE_KEY = 0x70_67_64_31  # the advisory lock key the pause point waits for
WAIT_S = 30.0

FUNCTION_SQL = f"""
CREATE OR REPLACE FUNCTION test_pause_point() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared({PAUSE_KEY});
    RETURN NEW;
END;
$$;
"""


def install(conn, table: str, events: str) -> None:
    """A pause point BEFORE ``events`` (e.g. ``"INSERT"``, ``"UPDATE"``) on ``table``."""
    assert table.isidentifier() and events.replace(" OR ", "").isalpha()
    conn.execute(FUNCTION_SQL)
    name = f"test_pause_{table}_{events.replace(' OR ', '_').lower()}"
    conn.execute(f"CREATE TRIGGER {name} BEFORE {events} ON {table} "
                 "FOR EACH ROW EXECUTE FUNCTION test_pause_point()")


def shut(conn) -> None:
    """Hold the pause point shut (a session advisory lock on ``conn``)."""
    conn.execute("SELECT pg_advisory_lock(%s)", (PAUSE_KEY,))


def open_(conn) -> None:
    """Let stalled transitions go on."""
    conn.execute("SELECT pg_advisory_unlock(%s)", (PAUSE_KEY,))


def wait_paused(conn, pid: int, timeout_s: float = WAIT_S) -> None:
    """Until session ``pid`` waits at the pause point."""
    wait_for_lock(conn, pid, wait_event="advisory", timeout_s=timeout_s,
                  what="reach the pause point")


def wait_for_lock(conn, pid: int, *, wait_event: str | None = None, timeout_s: float = WAIT_S,
                  what: str = "wait for a lock") -> None:
    """Until session ``pid`` waits for a heavyweight lock (of kind ``wait_event`` if given:
    ``advisory``, ``transactionid``, ``tuple``…)."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = conn.execute("SELECT wait_event_type, wait_event, state FROM pg_stat_activity "
                           "WHERE pid = %s", (pid,)).fetchone()
        if row and row["wait_event_type"] == "Lock" and wait_event in (None, row["wait_event"]):
            return
        assert time.monotonic() < deadline, f"session {pid} did not {what}: {row}"
        time.sleep(0.01)
