"""The expiry job: end lapsed leases, every ``expire_interval_seconds``.

The holder of the expiry duty (scheduler/duties.py) ends the lapsed leases of every runner,
then stamps the duty done in its own transaction (pgd_expiry_done, fenced by its term) — but
only once a lease may have lapsed: its beats say when the first running lease ends, and
stamp the duty while none has (pgd_beat_runner), so an idle fleet sends no expiry pass. Any
other scheduler does nothing, unless the duty has not been done for longer than a duty lease
(its holder dead or wedged): then it ends the lapsed leases of its own pools itself, so that
no lease outlives the election.

Safe to run from every scheduler at once: each lease is ended in its own short transaction
that skips jobs another transaction holds (sql.transitions.expire_leases, pgd_expire_one).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pgdispatch.sql import Settings, transitions
from pgdispatch.sql.db import checkout

log = logging.getLogger(__name__)


def expire_lapsed_leases(pool, settings: Settings, *, limit: int = 1000,
                         pool_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """One expiry pass over at most ``limit`` lapsed leases (of ``pool_ids`` only, when
    given; else of every pool); returns what each expiry did.

    A build's attempt becomes expired (job re-queued after backoff, or failed when out of
    attempts); a deployment's becomes lost (job and target uncertain).

    Raises:
        DatabaseUnavailable: the pass stopped early; what was expired so far stays expired.
    """
    with checkout(pool) as conn:
        done = transitions.expire_leases(conn, limit=limit,
                                         backoff_base_seconds=settings.backoff_base_seconds,
                                         backoff_cap_seconds=settings.backoff_cap_seconds,
                                         pool_ids=pool_ids)
    for r in done:
        log.warning("lease of job %s attempt id %s expired: %s is now %s", r["job_id"],
                    r["attempt_id"], "deployment" if r["is_deployment"] else "build",
                    r["job_state"])
    return done


def run_expiry(pool, settings: Settings, duties, *, runner_id: int,
               pool_ids: Sequence[int]) -> list[dict[str, Any]]:
    """The expiry job: as the holder of the expiry duty, a pass over every pool and the
    duty's stamp; else, when the duty is overdue (``duties.expiry_is_overdue()``), a pass
    over ``pool_ids`` (this scheduler's own); else nothing. Returns the leases ended.

    Raises:
        DatabaseUnavailable: the pass or the stamp did not finish; the next run retries.
    """
    term = duties.term("expiry")
    if term is not None:
        if not duties.lease_may_have_lapsed():
            return []  # no lease lapses before the next beat looks again (which stamps)
        done = expire_lapsed_leases(pool, settings)
        with checkout(pool) as conn:
            if not transitions.expiry_done(conn, runner_id=runner_id, term=term):
                duties.lost("expiry", term)
        return done
    if duties.expiry_is_overdue():
        return expire_lapsed_leases(pool, settings, pool_ids=pool_ids)
    return []
