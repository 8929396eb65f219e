"""The database's health (docs/operations.md, "The database's health"): what degrades a
PostgreSQL queue before it hurts. The hot tables' dead tuples, last vacuum and sizes
(``read_table_health``), the sessions, prepared transactions and replication slots that hold
the xmin horizon back so that vacuum cannot remove those dead tuples (``pgd_read_horizon_holders``,
a definer function that returns no query text), and the claim's time inside the database
from PostgreSQL's function statistics. Statements in ``sql/health.sql``."""

from __future__ import annotations

from typing import Any

from psycopg import sql as pgsql

from .db import transition
from .queries import Q

HOLDERS_LIMIT = 20
HOLDER_KINDS = ("session", "prepared", "slot")
# track_functions values under which the server counts calls of PL/pgSQL functions
TRACKS_PL = ("pl", "all")


def oldest_holder(holders: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The holder that has held the horizon longest in seconds (a session's or a prepared
    transaction's age; a slot has no age in seconds), or None."""
    timed = [h for h in holders if h["xact_age_seconds"] is not None]
    return max(timed, key=lambda h: h["xact_age_seconds"], default=None)


def _claim_latency(rows: list[dict[str, Any]], track_functions: str) -> dict[str, Any]:
    calls = sum(r["calls"] for r in rows)
    total_ms = sum(r["total_ms"] for r in rows)
    # the setting read is this session's; the schedulers' sessions may count under another
    # (ALTER DATABASE / ROLE), so counted calls are shown whatever it says here
    if calls:
        why = None
    elif track_functions not in TRACKS_PL:
        why = (f"track_functions is {track_functions!r}: the server counts the claim's calls "
               "only under 'pl' or 'all'")
    else:
        why = "no claim since the statistics were reset"

    return {"is_available": why is None, "why_not": why, "track_functions": track_functions,
            "calls": calls, "total_seconds": total_ms / 1000.0,
            "mean_ms": total_ms / calls if calls else None,
            "functions": rows}


@transition("read_database_health")
def read_database_health(conn, *, holders_limit: int = HOLDERS_LIMIT) -> dict[str, Any]:
    """The Database page and the /metrics gauges: {"tables": the hot tables' tuples, vacuum
    times and sizes in bytes; "holders": the oldest xmin holders (kind session, prepared or
    slot; pid, name, usename, application_name, client_addr, state, xact_age_seconds,
    xmin_age in transactions), oldest xmin first, this session left out; "oldest": the one
    held longest in seconds (``oldest_holder``); "reads_all_stats": whether other roles'
    sessions are visible at all (False: pgdispatch_owner lacks pg_read_all_stats); "claim":
    the claim's calls and mean milliseconds inside the database since the statistics were
    reset, or why not available}."""
    holders = list(Q.read_horizon_holders(conn, limit=holders_limit))
    rows = list(Q.read_claim_function_stats(conn))
    return {"tables": list(Q.read_table_health(conn)), "holders": holders,
            "oldest": oldest_holder(holders),
            "reads_all_stats": bool(Q.reads_all_stats(conn)),
            "claim": _claim_latency(rows, Q.read_track_functions(conn))}


@transition("read_horizon")
def read_horizon(conn, *, holders_limit: int = HOLDERS_LIMIT) -> dict[str, Any]:
    """What the overview's banner needs, without the tables' sizes: {"holders", "oldest",
    "reads_all_stats"} as in ``read_database_health``."""
    holders = list(Q.read_horizon_holders(conn, limit=holders_limit))
    return {"holders": holders, "oldest": oldest_holder(holders),
            "reads_all_stats": bool(Q.reads_all_stats(conn))}


def keep_claim_statistics(conn) -> None:
    """Have the server count the claim functions' calls and time in this database's new
    sessions (ALTER DATABASE … SET track_functions = 'pl'; what ``read_database_health``
    reports as the claim's time). For a login that owns the database or a superuser: the
    demo's embedded server. Raises psycopg.Error otherwise."""
    name = conn.execute("SELECT current_database() AS name").fetchone()["name"]
    conn.execute(pgsql.SQL("ALTER DATABASE {} SET track_functions = 'pl'").format(
        pgsql.Identifier(name)))
