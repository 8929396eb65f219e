"""The summary job: refresh the per-(project, pool) queue summary the console reads, every
``summary_interval_seconds``. One statement; it writes summary rows only, never a job row.

No job row can stop it: the statement only counts, compares and takes the least ready_at
(sql/summaries.sql), so unlike the expiry pass it has no row to skip. A pass that fails (the
database unavailable) is logged and retried by scheduler/periodic.py."""

from __future__ import annotations

from pgdispatch.sql import transitions
from pgdispatch.sql.db import checkout


def refresh_queue_summary(pool) -> None:
    """Recount the waiting jobs into queue_summaries.

    Raises:
        DatabaseUnavailable: the refresh did not happen; the next run will do it.
    """
    with checkout(pool) as conn:
        transitions.summarize_queue(conn)
