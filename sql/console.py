"""The audited submit the console, the API and the CLI call."""
# removed by the lead with the audited pgd_submit

from __future__ import annotations

from typing import Any

from .audit import record_event
from .db import transition
from .transitions import submit


@transition("submit_job_audited")
def submit_job(conn, *, actor: str, **kwargs: Any) -> dict[str, Any]:
    """``transitions.submit`` plus a ``submit_job`` audit event in the same transaction when
    the job is new (a repeated idempotency key changes nothing and records nothing).
    Takes submit's keyword arguments; ``actor`` is recorded as ``submitted_by`` too."""
    job = submit(conn, submitted_by=actor, **kwargs)
    if job["is_new"]:
        record_event(conn, actor=actor, action="submit_job", subject=f"job:{job['id']}",
                     details={"project": job["project"], "pool": job["pool"],
                              "target": job.get("target")})
    return job
