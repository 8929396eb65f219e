"""The summaries duty: refresh the per-(project, pool) queue summary the console reads and
the current minute of its history (queue_history per pool; queue_reason_history, the
waiting jobs by primary reason counted with sql/explain.py's summary_reason_counts, which
transitions.run_summaries runs in the same transaction), every ``summary_interval_seconds``, by
the holder of the duty only (scheduler/duties.py). One statement's worth of work in one
transaction; it writes summary rows only, never a job row, and stamps the duty done if this
runner still holds it in the term it was taken in (else it is undone whole).

No job row can stop it: the statement only counts, compares and takes the least ready_at
(sql/functions/summaries.sql), so unlike the expiry pass it has no row to skip. A pass that
fails (the database unavailable) is logged and retried by scheduler/periodic.py."""

from __future__ import annotations

from pgdispatch.sql import transitions
from pgdispatch.sql.db import checkout


def refresh_queue_summary(pool, *, runner_id: int, term: int, live_seconds: float = 90.0) -> bool:
    """Recount the waiting jobs into queue_summaries, queue_history and queue_reason_history,
    as the holder of the summaries duty in ``term``. Returns False when the duty is no longer
    held in that term (nothing written). ``live_seconds``: a runner beaten longer ago is not
    live (as the console's read_world: the lease).

    Raises:
        DatabaseUnavailable: the refresh did not happen; the next run will do it.
    """
    with checkout(pool) as conn:
        return transitions.run_summaries(conn, runner_id=runner_id, term=term,
                                        live_seconds=live_seconds)
