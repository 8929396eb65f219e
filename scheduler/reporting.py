"""Completion reporting: an attempt's outcome recorded in the database, retried until it is.

Two parts. ``CompletionReporter``, one per scheduler, sends the reports: a lone report with
``transitions.complete``; reports that arrive while another is in flight wait for it and
then go together, up to ``max_batch`` of them, in one ``transitions.complete_batch``
transaction (group commit: batching never delays a report that finds the reporter idle).
``report_outcome``, called by each execution, keeps that execution's retry rules: a report
that got no answer from the database (a lost connection, a stalled one, a pooler's or a
statement's error; alone or as part of a batch) is sent again under the attempt's receipt
key, which the database answers with the first answer instead of recording the outcome twice.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from pgdispatch.sql import (Conflict, DatabaseUnavailable, FencedOut, Forbidden, InvalidInput, NotFound,
                            Settings, transitions)
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

    No report waits on another's answer for longer than PATIENCE_SECONDS: one still unanswered
    by then is sent again by its own caller, alone, on a connection of its own — whether it
    was still queued or was part of a batch whose answer is late (a stalled connection waits
    for the statement deadline, sql/db.py). Sending a report twice is safe: the database
    answers a repeated receipt key with its first answer; whichever answer comes first is
    the one the caller gets.

    Args:
        pool: the connection pool.
        settings: the retry backoff (seconds) given to the database, and heartbeat_seconds,
            which bounds how long a connection checkout may wait (at least 1 s).
        max_batch: most reports in one transaction (1..1000).
    Raises:
        InvalidInput: ``max_batch`` outside 1..1000.
    """

    PATIENCE_SECONDS = 1.0

    def __init__(self, pool, settings: Settings, *, max_batch: int = 1):
        self.pool = pool
        self.settings = settings
        self.max_batch = check_max_batch(max_batch)
        self.checkout_seconds = max(1.0, settings.heartbeat_seconds)
        self._changed = threading.Condition()
        self._queue: list[_Report] = []
        self._senders = 0  # sends in flight
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
                the same receipt key). NotFound, InvalidInput, Conflict: refused. Any other
                exception: the report failed in a way the database did not answer.
        """
        item = dict(attempt_id=attempt_id, generation=generation, outcome=outcome,
                    receipt_key=receipt_key, exit_code=exit_code,
                    error=error, output_tail=output_tail)
        if self.max_batch == 1:
            return self._complete_one(item)
        report = _Report(item)
        impatient_at = time.monotonic() + self.PATIENCE_SECONDS
        with self._changed:
            self._queue.append(report)
        while True:
            with self._changed:
                while not report.is_done and self._senders:
                    left = impatient_at - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
                if report.is_done:
                    break
                if report in self._queue:
                    # ours first, then whoever else is waiting
                    self._queue.remove(report)
                    batch = [report] + self._queue[:self.max_batch - 1]
                    del self._queue[:self.max_batch - 1]
                else:
                    # ours is in a batch whose answer is late: send it again, alone
                    batch = [report]
                self._senders += 1
            try:
                self._send(batch)
            finally:
                with self._changed:
                    self._senders -= 1
                    self._changed.notify_all()
            impatient_at = time.monotonic() + self.PATIENCE_SECONDS
        if report.error is not None:
            raise report.error
        return report.answer

    def _send(self, batch: list[_Report]) -> None:
        """Answer every report of ``batch`` that nobody answered meanwhile; whatever goes
        wrong, none of them is left unanswered."""
        results: list[tuple[_Report, dict[str, Any] | None, BaseException | None]] = []
        try:
            if len(batch) == 1:
                results = [self._send_one(batch[0])]
                return
            try:
                with checkout(self.pool, timeout_seconds=self.checkout_seconds) as conn:
                    self.batches_sent += 1
                    answers = transitions.complete_batch(
                        conn, items=[r.item for r in batch],
                        backoff_base_seconds=self.settings.backoff_base_seconds,
                        backoff_cap_seconds=self.settings.backoff_cap_seconds)
            except (FencedOut, Forbidden, NotFound, InvalidInput, Conflict) as exc:
                # The whole batch was refused for one bad report (an unknown attempt, a receipt
                # key of another attempt): nothing of it was recorded. Send them one by one,
                # so each gets its own answer and one does not sink the others.
                log.warning("a batch of %d reports was refused (%s); sending them one by one",
                            len(batch), exc)
                results = [self._send_one(r) for r in batch]
                return
            except Exception as exc:  # noqa: BLE001 - each one retries under its own rules
                # an instance each: they are raised on different threads
                results = [(r, None, _again(exc)) for r in batch]
                return
            if len(answers) != len(batch):
                raise RuntimeError(f"complete_batch answered {len(answers)} of {len(batch)}")
            for r, answer in zip(batch, answers):
                if answer.get("attempt_id") not in (None, r.item["attempt_id"]):
                    raise RuntimeError(f"complete_batch answered attempt {answer['attempt_id']} "
                                       f"for attempt {r.item['attempt_id']}")
                if answer.get("status") == "fenced":
                    results.append((r, None, FencedOut(
                        answer.get("error") or f"attempt {r.item['attempt_id']} is fenced out")))
                else:
                    results.append((r, answer, None))
        except Exception as exc:  # a bug: fail the reports instead of leaving them waiting
            log.exception("reporting %d outcome(s) failed", len(batch))
            results = [(r, None, _again(exc)) for r in batch]
        finally:
            with self._changed:
                answered = {id(r) for r, _, _ in results}
                for r, answer, error in results:
                    if not r.is_done:
                        r.answer, r.error, r.is_done = answer, error, True
                for r in batch:
                    if id(r) not in answered and not r.is_done:
                        r.error = RuntimeError(f"attempt {r.item['attempt_id']}: report not sent")
                        r.is_done = True

    def _send_one(self, report: _Report
                  ) -> tuple[_Report, dict[str, Any] | None, BaseException | None]:
        try:
            return report, self._complete_one(report.item), None
        except Exception as exc:  # handed to the caller, who decides what it means
            return report, None, exc

    def _complete_one(self, item: dict[str, Any]) -> dict[str, Any]:
        with checkout(self.pool, timeout_seconds=self.checkout_seconds) as conn:
            return transitions.complete(
                conn, **item, backoff_base_seconds=self.settings.backoff_base_seconds,
                backoff_cap_seconds=self.settings.backoff_cap_seconds)


def _again(exc: BaseException) -> BaseException:
    """A fresh instance of a retryable failure, for one of several reports."""
    if isinstance(exc, DatabaseUnavailable):
        return DatabaseUnavailable(str(exc))
    return RuntimeError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def report_outcome(reporter: CompletionReporter, claim: Claim, *, outcome: str,
                   exit_code: int | None, error: str | None, output_tail: str,
                   lease_from: Callable[[], float], lease_seconds: float,
                   abandon: threading.Event) -> dict[str, Any] | None:
    """Complete the claim's attempt with ``outcome``; the database's answer, or None when
    nothing was recorded (fenced out, refused, or given up). Never raises.

    Only an answer from the database ends it: the outcome recorded (or its receipt repeated),
    fenced out, or refused (NotFound, InvalidInput, Conflict: the database's own SQLSTATE
    PD* answers). Every other failure — a lost connection, no answer within the statement
    deadline, an error a pooler sent in the server's place, a statement error, a server
    restart — is sent again, on a fresh connection (sql/db.py, checkout, discards the one
    that failed), with jittered backoff (at most 5 s); the receipt key makes a repeat
    harmless. The caller keeps the lease alive meanwhile (its heartbeats go on until the
    report is answered). A succeeded/failed report keeps trying past the lease, for up to
    LATE_REPORT_SECONDS: the database accepts it late as long as nobody has claimed the job
    since (for a deployment, it is what frees an uncertain target); other outcomes give up
    when the lease would lapse. Either gives up at the latest LATE_REPORT_SECONDS after the
    lease it had when reporting began, however long the heartbeats keep it alive.

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
    # the heartbeats may keep the lease alive for as long as the report keeps failing; it
    # still gives up in the end, and the lease expiry decides
    began = time.monotonic()
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
        except (Forbidden, NotFound, InvalidInput, Conflict) as exc:
            log.error("job %d attempt %d: report of %s refused: %s", claim.job_id,
                      claim.attempt_no, outcome, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - not the database's answer: send it again
            try_no += 1
            expires_at = lease_from() + lease_seconds
            delay = random.uniform(0, min(5.0, 0.1 * 2 ** try_no))
            now = time.monotonic()
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            stop_at = min(expires_at, began + lease_seconds) + LATE_REPORT_SECONDS
            if (abandon.is_set() or (not is_late_ok and now + delay >= expires_at)
                    or now + delay >= stop_at):
                log.error("job %d attempt %d: could not report %s (%s); giving up, the lease "
                          "expiry will decide", claim.job_id, claim.attempt_no, outcome, reason)
                return None
            if isinstance(exc, DatabaseUnavailable):
                log.warning("job %d attempt %d: reporting %s failed (%s); retry %d in %.2f s",
                            claim.job_id, claim.attempt_no, outcome, reason, try_no, delay)
            else:
                log.error("job %d attempt %d: reporting %s failed (%s: %s); retry %d in %.2f s",
                          claim.job_id, claim.attempt_no, outcome, type(exc).__name__, reason,
                          try_no, delay)
            abandon.wait(delay)
