"""The rolled-up queue history the overview charts: per pool and minute (queue_history:
waiting, running, oldest wait, claims and their wait p50/p95) and per primary reason and
minute (queue_reason_history), written by the summaries duty (transitions.run_summaries)
and pruned after 7 days by the cleanup duty. Read-only here."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from .db import transition
from .errors import InvalidInput
from .explain import World
from .queries import Q

# span name -> (seconds shown, seconds per point): an hour by the minute, a day by 10 minutes
SPANS = {"hour": (3600, 60), "day": (86400, 600)}


def _ts(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value) if value is not None else None


def world_from_inputs(inputs: dict[str, Any]) -> tuple[list[dict[str, Any]], World]:
    """The summary rows and the World from the jsonb of pgd_read_summary_inputs
    (sql/functions/summaries.sql): the same values read_world and read_queue_summaries give (timestamps as aware datetimes; tests/sql/test_history.py)."""
    projects = {}
    for p in inputs["projects"]:
        projects[p["id"]] = {**p, "paused_at": _ts(p["paused_at"]),
                             "last_claimed_at": _ts(p["last_claimed_at"])}
    # every timestamp column of queue_summaries ends in _at (sql/schema.sql)
    summaries = [{k: _ts(v) if k.endswith("_at") else v for k, v in s.items()}
                 for s in inputs["summaries"]]
    live = inputs["live"]
    world = World(
        now=_ts(inputs["now"]),
        organizations={o["id"]: o for o in inputs["organizations"]},
        projects=projects,
        pools={q["id"]: {**q, "paused_at": _ts(q.get("paused_at"))} for q in inputs["pools"]},
        targets={},  # a summary row's probe has no target (explain.summary_reason_counts)
        grants={(g[0], g[1]) for g in inputs["grants"]},
        live_pools={r["pool_id"] for r in live if r["runner_slots"] > 0},
        runner_slots={r["pool_id"]: (r["runner_slots"], r["free_runner_slots"])
                      for r in live if r["runner_slots"] > 0},
        ungranted_logins={r["pool_id"]: list(r["ungranted_logins"]) for r in live
                          if r["ungranted_logins"]},
        runner_ids={r["pool_id"]: list(r["runner_ids"]) for r in live if r["runner_slots"] > 0},
    )
    return summaries, world


@transition("record_reason_counts")
def record_reason_counts(conn, *, runner_id: int, term: int, counts: dict[str, int] | str) -> bool:
    """Record the waiting jobs by primary reason ({code: n}, as explain.summary_reason_counts
    counts them from the summary rows) as the current minute's snapshot of
    queue_reason_history, the uncertain jobs added under target_uncertain; the minute keeps
    the snapshot with the most waiting jobs, whole (pgd_record_reason_counts). Fenced by the
    summaries duty: False, and nothing written, when ``runner_id`` does not hold it in
    ``term`` or the connection's login is not the runner's.

    Raises: InvalidInput (nothing written) when ``counts`` is not an object of reason codes
    (explain.REASON_CODES) to whole numbers >= 0, or they sum to more than the summary's
    waiting jobs."""
    text = counts if isinstance(counts, str) else json.dumps(counts)
    return bool(Q.record_reason_counts(conn, runner_id=runner_id, term=term, counts=text))


def check_span(span: str) -> tuple[int, int]:
    """(seconds shown, seconds per point) of a chart span name ("hour", "day").

    Raises: InvalidInput for another name."""
    if span not in SPANS:
        raise InvalidInput(f"unknown span {span!r} (one of: {', '.join(SPANS)})")
    return SPANS[span]


@transition("read_queue_history")
def read_queue_history(conn, *, span: str = "hour") -> dict[str, Any]:
    """The history of the last ``span`` ("hour": by the minute; "day": by 10 minutes), for
    the charts: {"now", "span", "step_seconds", "points": [bucket start, oldest first, every
    bucket of the span], "pools": {pool name: [{"at", "waiting", "running",
    "oldest_wait_seconds", "claimed", "wait_p50_seconds", "wait_p95_seconds"} or None per
    point]}, "reasons": {code: [waiting or None per point]}}. A bucket of several minutes
    takes, per pool, the most waiting and running and the longest oldest wait of its minutes
    (each maybe of another minute), the sum of their claims, the claim-weighted mean of
    their p50 and the largest of their p95; and for the reasons the counts of one minute,
    the one with the most waiting jobs (a snapshot: they sum to jobs waiting at one moment).
    None: no row for that bucket (no summaries duty ran). Reads the two history tables'
    primary keys over the span only.

    Raises: InvalidInput for an unknown span."""
    seconds, step = check_span(span)
    rows = list(Q.read_queue_history(conn, seconds=seconds, step=step))
    reason_rows = list(Q.read_reason_history(conn, seconds=seconds, step=step))
    now = conn.execute("SELECT now() AS now").fetchone()["now"]
    epoch = int(now.timestamp()) // step * step
    points = [dt.datetime.fromtimestamp(epoch - step * k, dt.timezone.utc)
              for k in range(seconds // step - 1, -1, -1)]
    index = {p: i for i, p in enumerate(points)}
    pools: dict[str, list[dict[str, Any] | None]] = {
        r["name"]: [None] * len(points) for r in Q.list_pool_names(conn)}
    for r in rows:
        i = index.get(r["at"])
        if i is not None:
            pools.setdefault(r["pool"], [None] * len(points))[i] = r
    reasons: dict[str, list[int | None]] = {}
    for r in reason_rows:
        i = index.get(r["at"])
        if i is not None:
            reasons.setdefault(r["reason"], [None] * len(points))[i] = r["waiting"]
    return {"now": now, "span": span, "step_seconds": step, "points": points,
            "pools": pools, "reasons": reasons}
