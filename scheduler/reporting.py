"""Completion reporting: an attempt's outcome recorded in the database, retried until it is.

Two parts. ``CompletionReporter``, one per scheduler, sends the reports: a lone report with
``transitions.complete``; reports that arrive while another is in flight wait for it and
then go together, up to ``max_batch`` of them, in one ``transitions.complete_batch``
transaction (group commit: batching never delays a report that finds the reporter idle).
``report_outcome``, called by each execution, keeps that execution's retry rules: a report
whose answer was lost (DatabaseUnavailable, alone or as part of a batch) is sent again under
the attempt's receipt key, which the database answers with the first answer instead of
recording the outcome twice.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from pgdispatch.sql import DatabaseUnavailable, FencedOut, PgDispatchError, Settings, transitions
from pgdispatch.sql.db import checkout
from pgdispatch.sql.transitions import Claim
from pgdispatch.sql.validate import check_max_batch

log = logging.getLogger(__name__)

# how long past its lease a finished attempt keeps trying to report (a database outage)
LATE_REPORT_SECONDS = 900.0


@dataclasses.dataclass
class _Report:
    """One attempt's completion waiting for the reporter; ``answer`` or ``error`` once sent."""

    item: dict[str, Any]
    answer: dict[str, Any] | None = None
    error: BaseException | None = None
    is_done: bool = False


class CompletionReporter:
    """Records attempts' outcomes, several in one transaction when they are waiting together.

    A report that finds nothing in flight is sent at once, alone, with
    ``transitions.complete``. Reports that arrive meanwhile queue up; when the one in flight
    has its answer, the next caller sends every queued report (at most ``max_batch``) in one
    ``transitions.complete_batch``. So a batch forms only from reports that would have waited
    anyway, and a quiet scheduler's reports are exactly what they were without batching.
    With ``max_batch`` 1 every report is its own ``complete`` call, sent concurrently.

    Args:
        pool: the connection pool.
        settings: the retry backoff (seconds) given to the database, and heartbeat_seconds,
            which bounds how long a connection checkout may wait (at least 1 s).
        max_batch: most reports in one transaction (1..1000).
    Raises:
        InvalidInput: ``max_batch`` outside 1..1000.
    """

    def __init__(self, pool, settings: Settings, *, max_batch: int = 1):
        self.pool = pool
        self.settings = settings
        self.max_batch = check_max_batch(max_batch)
        self.checkout_seconds = max(1.0, settings.heartbeat_seconds)
        self._changed = threading.Condition()
        self._queue: list[_Report] = []
        self._is_sending = False
        self.batches_sent = 0  # complete_batch transactions sent (for tests and logs)

    def complete(self, *, attempt_id: int, generation: int, outcome: str, receipt_key: str,
                 exit_code: int | None = None, error: str | None = None,
                 output_tail: str | None = None) -> dict[str, Any]:
        """Record one outcome, as ``transitions.complete`` does (same arguments, answer and
        errors), perhaps in one transaction with others. Blocks until it is answered.

        Returns:
            {"status", "job_id", "attempt_id", "job_state", "attempt_state", "ready_at",
             "is_late_report", "repeated"}.
        Raises:
            FencedOut: the attempt is not the job's current one (nothing recorded for it).
            DatabaseUnavailable: no answer came (it may have committed: send it again with
                the same receipt key). NotFound, InvalidInput, Conflict: refused.
        """
        item = dict(attempt_id=attempt_id, generation=generation, outcome=outcome,
                    receipt_key=receipt_key, exit_code=exit_code,
                    error=error, output_tail=output_tail)
        if self.max_batch == 1:
            return self._complete_one(item)
        report = _Report(item)
        with self._changed:
            self._queue.append(report)
        while True:
            with self._changed:
                while self._is_sending and not report.is_done:
                    self._changed.wait()
                if not report.is_done:
                    # Nobody is sending and ours is still queued: we send, ours among them.
                    self._is_sending = True
                    batch = self._queue[:self.max_batch]
                    del self._queue[:self.max_batch]
            if report.is_done:
                break
            try:
                self._send(batch)
            finally:
                with self._changed:
                    self._is_sending = False
                    self._changed.notify_all()
        if report.error is not None:
            raise report.error
        return report.answer

    def _send(self, batch: list[_Report]) -> None:
        """Answer every report of ``batch``; whatever goes wrong, none is left unanswered."""
        try:
            if len(batch) == 1:
                self._send_one(batch[0])
                return
            try:
                with checkout(self.pool, timeout_seconds=self.checkout_seconds) as conn:
                    self.batches_sent += 1
                    answers = transitions.complete_batch(
                        conn, items=[r.item for r in batch],
                        backoff_base_seconds=self.settings.backoff_base_seconds,
                        backoff_cap_seconds=self.settings.backoff_cap_seconds)
            except DatabaseUnavailable as exc:
                for r in batch:
                    # each one retries, under its own rules and receipt key (an instance each:
                    # they are raised on different threads)
                    r.error = DatabaseUnavailable(str(exc))
                return
            except PgDispatchError as exc:
                # The whole batch was refused for one bad report (an unknown attempt, a receipt
                # key of another attempt): nothing of it was recorded. Send them one by one,
                # so each gets its own answer and one does not sink the others.
                log.warning("a batch of %d reports was refused (%s); sending them one by one",
                            len(batch), exc)
                for r in batch:
                    self._send_one(r)
                return
            if len(answers) != len(batch):
                raise RuntimeError(f"complete_batch answered {len(answers)} of {len(batch)}")
            for r, answer in zip(batch, answers):
                if answer.get("attempt_id") not in (None, r.item["attempt_id"]):
                    raise RuntimeError(f"complete_batch answered attempt {answer['attempt_id']} "
                                       f"for attempt {r.item['attempt_id']}")
                if answer.get("status") == "fenced":
                    r.error = FencedOut(answer.get("error") or
                                        f"attempt {r.item['attempt_id']} is fenced out")
                else:
                    r.answer = answer
        except Exception:  # a bug: fail the reports instead of leaving them waiting
            log.exception("reporting %d outcome(s) failed", len(batch))
        finally:
            for r in batch:
                if r.answer is None and r.error is None:
                    r.error = RuntimeError(f"attempt {r.item['attempt_id']}: report not sent")
                r.is_done = True

    def _send_one(self, report: _Report) -> None:
        try:
            report.answer = self._complete_one(report.item)
        except Exception as exc:  # handed to the caller, who decides what it means
            report.error = exc

    def _complete_one(self, item: dict[str, Any]) -> dict[str, Any]:
        with checkout(self.pool, timeout_seconds=self.checkout_seconds) as conn:
            return transitions.complete(
                conn, **item, backoff_base_seconds=self.settings.backoff_base_seconds,
                backoff_cap_seconds=self.settings.backoff_cap_seconds)


def report_outcome(reporter: CompletionReporter, claim: Claim, *, outcome: str,
                   exit_code: int | None, error: str | None, output_tail: str,
                   lease_from: Callable[[], float], lease_seconds: float,
                   abandon: threading.Event) -> dict[str, Any] | None:
    """Complete the claim's attempt with ``outcome``; the database's answer, or None when
    nothing was recorded (fenced out, refused, or given up). What the database answers never
    raises; a bug in the reporter does (RuntimeError: the report was not sent).

    After a lost connection the report is sent again, with jittered backoff (at most 5 s),
    until it is recorded or fenced out; the receipt key makes a repeat harmless. A
    succeeded/failed report keeps trying past the lease, for up to LATE_REPORT_SECONDS: the
    database accepts it late as long as nobody has claimed the job since (for a deployment,
    it is what frees an uncertain target); other outcomes give up when the lease would lapse.

    Args:
        lease_from: the ``time.monotonic()`` the lease now runs from (the send time of the
            last heartbeat that succeeded, or of the claim); asked again at each retry.
        lease_seconds: how long the lease runs from then, in seconds.
        abandon: once set, the next failure gives up at once (the scheduler is exiting).
    Returns:
        ``CompletionReporter.complete``'s answer (``job_state``, ``is_late_report``, ...).
    """
    is_late_ok = outcome in ("succeeded", "failed")
    try_no = 0
    while True:
        try:
            return reporter.complete(
                attempt_id=claim.attempt_id, generation=claim.generation, outcome=outcome,
                receipt_key=claim.receipt_key, exit_code=exit_code, error=error,
                output_tail=output_tail)
        except FencedOut as exc:
            log.warning("job %d attempt %d: %s not recorded: %s", claim.job_id,
                        claim.attempt_no, outcome, exc)
            return None
        except DatabaseUnavailable as exc:
            try_no += 1
            expires_at = lease_from() + lease_seconds
            delay = random.uniform(0, min(5.0, 0.1 * 2 ** try_no))
            now = time.monotonic()
            if (abandon.is_set() or (not is_late_ok and now + delay >= expires_at)
                    or now + delay >= expires_at + LATE_REPORT_SECONDS):
                log.error("job %d attempt %d: could not report %s (%s); giving up, the lease "
                          "expiry will decide", claim.job_id, claim.attempt_no, outcome, exc)
                return None
            log.warning("job %d attempt %d: reporting %s failed (%s); retry %d in %.2f s",
                        claim.job_id, claim.attempt_no, outcome, exc, try_no, delay)
            abandon.wait(delay)
        except PgDispatchError as exc:
            log.error("job %d attempt %d: report of %s refused: %s", claim.job_id,
                      claim.attempt_no, outcome, exc)
            return None
