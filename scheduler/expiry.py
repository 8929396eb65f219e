"""The expiry job: end lapsed leases (any runner's), every ``expire_interval_seconds``.

Safe to run from every scheduler at once: each lease is ended in its own short transaction
that skips jobs another transaction holds (sql.transitions.expire_leases, pgd_expire_one).
"""

from __future__ import annotations

import logging
from typing import Any

from pgdispatch.sql import Settings, transitions
from pgdispatch.sql.db import checkout

log = logging.getLogger(__name__)


def expire_lapsed_leases(pool, settings: Settings, *, limit: int = 1000) -> list[dict[str, Any]]:
    """One expiry pass over at most ``limit`` lapsed leases; returns what each expiry did.

    A build's attempt becomes expired (job re-queued after backoff, or failed when out of
    attempts); a deployment's becomes lost (job and target uncertain).

    Raises:
        DatabaseUnavailable: the pass stopped early; what was expired so far stays expired.
    """
    with checkout(pool) as conn:
        done = transitions.expire_leases(conn, limit=limit,
                                         backoff_base_seconds=settings.backoff_base_seconds,
                                         backoff_cap_seconds=settings.backoff_cap_seconds)
    for r in done:
        log.warning("lease of job %s attempt id %s expired: %s is now %s", r["job_id"],
                    r["attempt_id"], "deployment" if r["is_deployment"] else "build",
                    r["job_state"])
    return done
