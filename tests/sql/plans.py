"""What the query-plan tests need to read plans that do not change from run to run.

A plan follows the statistics, the table sizes and the planner's settings. Tests that assert
a plan pin all three: the planner's settings at PostgreSQL's built-in defaults in every
session that plans (``pin_planner``), whatever the server's configuration; the statistics as
the test's own ANALYZE left them, taken from every row rather than a sample (``analyze_all``:
a 30,000-row sample of a larger table gives different estimates each time); and autovacuum
off for the tables meanwhile (``quiet_autovacuum``), so that none re-analyzes or vacuums them
in the middle of a test. In a transaction that the test rolls back, no other session sees
the rows, so autovacuum cannot touch them and only ANALYZE runs (VACUUM cannot run there).
"""

from __future__ import annotations

import json
import math

from psycopg.pq import TransactionStatus

PLANNER_SETTINGS = """
SELECT count(set_config(name, boot_val, false)) AS n FROM pg_settings
 WHERE category LIKE 'Query Tuning%'
    OR name IN ('work_mem', 'hash_mem_multiplier', 'max_parallel_workers_per_gather')
"""
PUBLIC_TABLES = "SELECT tablename AS t FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
# ANALYZE samples 300 rows per unit of statistics target
ROWS_PER_TARGET = 300


def plan_nodes(plan: dict):
    """``plan`` (EXPLAIN's JSON) and every node under it, depth first."""
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


def explain(conn, statement: str, params=()) -> dict:
    """The top plan node of ``EXPLAIN (FORMAT JSON) statement``."""
    return conn.execute("EXPLAIN (FORMAT JSON) " + statement, params).fetchone()["QUERY PLAN"][0]["Plan"]


def _in_transaction(conn) -> bool:
    return conn.info.transaction_status != TransactionStatus.IDLE


def pin_planner(conn) -> None:
    """This session's planner settings at PostgreSQL's built-in defaults."""
    assert conn.execute(PLANNER_SETTINGS).fetchone()["n"] > 0


def quiet_autovacuum(conn) -> None:
    """No autovacuum (or auto-analyze) of this database's tables from now on."""
    if _in_transaction(conn):
        return
    for r in conn.execute(PUBLIC_TABLES).fetchall():
        conn.execute(f"ALTER TABLE {r['t']} SET (autovacuum_enabled = false)")


def analyze_all(conn) -> None:
    """(VACUUM) ANALYZE every table with a statistics target whose sample holds all its rows:
    the statistics (and the visibility map the planner reads for index-only scans) are then
    the same in every run, not those of whichever rows a sample picked."""
    verb = "ANALYZE" if _in_transaction(conn) else "VACUUM ANALYZE"
    for r in conn.execute(PUBLIC_TABLES).fetchall():
        rows = conn.execute(f"SELECT count(*) AS n FROM {r['t']}").fetchone()["n"]
        conn.execute(f"SET default_statistics_target = {max(100, math.ceil(rows / ROWS_PER_TARGET))}")
        conn.execute(f"{verb} {r['t']}")
    conn.execute("RESET default_statistics_target")


def record_plans(conn) -> list[dict]:
    """Turn on auto_explain (NOTICE level, JSON, nested statements, every duration) in this
    session, with the planner pinned; returns the list each statement's plan is appended to
    from now on (the caller may clear it between the calls it wants)."""
    plans: list[dict] = []

    def on_notice(diag) -> None:
        message = diag.message_primary or ""
        if "plan:" in message:
            plans.append(json.loads(message[message.index("{"):]))

    conn.add_notice_handler(on_notice)
    pin_planner(conn)
    conn.execute("LOAD 'auto_explain'")
    for setting, value in (("log_min_duration", "0"), ("log_nested_statements", "on"),
                           ("log_format", "json"), ("log_level", "notice")):
        conn.execute(f"SET auto_explain.{setting} = {value}")
    return plans
