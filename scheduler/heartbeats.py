"""Heartbeats: the thread that keeps a running attempt's lease alive while its command runs,
and after it until its outcome is reported.

Every ``heartbeat_seconds`` a ``Heartbeat`` borrows a pool connection (no connection is held
between beats) and extends the lease with ``transitions.heartbeat``. What it learns it only
records, and wakes the supervision loop (supervision.py), which acts on it:

* fenced out (the attempt is no longer the job's current one): ``is_fenced``; the loop kills
  the process group at once and nothing is reported. The heartbeat thread ends.
* cancel requested: ``is_cancel_requested``; the loop stops the command and it is reported
  cancelled.
* a beat failed (DatabaseUnavailable and kin), or got no answer within half the interval (a
  stalled connection; sql/db.py, statement_deadline): tried again after a quarter of the
  interval, on a fresh connection, so that the retry still lands well inside the lease.
  ``last_ok_sent_at`` stays where it was, and the loop fences the job itself
  (``fence_margin_seconds`` before the lease could lapse) if no beat succeeds in time.

After each successful beat the watchdog's deadline for the process group is renewed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pgdispatch.sql import FencedOut, Forbidden, Settings, transitions
from pgdispatch.sql.db import checkout, statement_deadline
from pgdispatch.sql.transitions import Claim

from .output import OutputTail

log = logging.getLogger(__name__)

HEARTBEAT_TAIL_BYTES = 16 * 1024  # the part of the tail a heartbeat carries, when it changed


def fence_margin_seconds(lease_seconds: float) -> float:
    """How long before a lease could lapse a job is fenced (by the executor and the
    watchdog alike), in seconds: a tenth of the lease, at most one second."""
    return min(1.0, lease_seconds / 10)


class Heartbeat(threading.Thread):
    """Extends the lease every ``heartbeat_seconds``; records fencing and cancel requests.

    Args:
        claim: the running attempt.
        pool: the connection pool.
        settings: heartbeat_seconds (the interval, and the connection checkout timeout) and
            lease_seconds (granted by each beat).
        sent_at: ``time.monotonic()`` when the claim was sent: the lease runs from then until
            a beat succeeds.
        wake: called when ``is_fenced`` or ``is_cancel_requested`` is newly set.
        tail: the command's output; each beat carries its last HEARTBEAT_TAIL_BYTES when it
            grew since the last beat that succeeded.
        watchdog / pgid: the scheduler's ``watchdog.Watchdog`` and the job's process group,
            armed after each successful beat; None: no watchdog.

    Attributes:
        last_ok_sent_at: monotonic time the last successful beat (or the claim) was sent.
        is_fenced / is_cancel_requested: Events, set from the beats' answers.
        stopping: set it to end the thread (it ends after the beat in flight, if any).
        command_ended: set once the command has ended; the beats go on (its report may still
            be on its way), a fenced answer then only means the report got there first.
    """

    def __init__(self, claim: Claim, *, pool, settings: Settings, sent_at: float,
                 wake: Callable[[], None], tail: OutputTail | None = None, watchdog=None,
                 pgid: int | None = None):
        super().__init__(name=f"heartbeat-{claim.job_id}", daemon=True)
        self.claim = claim
        self.watchdog = watchdog
        self.pgid = pgid
        # the output so far rides along with each beat that has news, so that a deployment
        # lost with its runner leaves evidence for the operator who resolves its target
        self.tail = tail
        self._tail_sent_bytes = 0
        self.pool = pool
        self.settings = settings
        self.last_ok_sent_at = sent_at
        self.is_fenced = threading.Event()
        self.is_cancel_requested = threading.Event()
        self.stopping = threading.Event()
        self.command_ended = threading.Event()
        self._wake = wake
        # arm (after a beat) and disarm (after the job) under one lock, so that a beat still
        # in flight when the job ends cannot re-arm a process group id that is gone, and that
        # the system may give to another process group
        self._watchdog_lock = threading.Lock()
        self._is_disarmed = False

    def disarm_watchdog(self) -> None:
        """Tell the watchdog the job's process group has ended; no beat arms it again."""
        with self._watchdog_lock:
            self._is_disarmed = True
            if self.watchdog is not None and self.pgid is not None:
                self.watchdog.disarm(self.pgid)

    def _arm_watchdog(self) -> None:
        with self._watchdog_lock:
            if self._is_disarmed or self.watchdog is None or self.pgid is None:
                return
            self.watchdog.arm(self.pgid, lease_from=self.last_ok_sent_at,
                              lease_seconds=self.settings.lease_seconds)

    def run(self) -> None:
        """Beat until ``stopping`` is set or the attempt is fenced out (the thread's body)."""
        interval = self.settings.heartbeat_seconds
        wait = interval
        while not self.stopping.wait(wait):
            # taken before the request: the lease the database grants runs from no earlier
            sent = time.monotonic()
            total, text = self.tail.snapshot(HEARTBEAT_TAIL_BYTES) if self.tail else (0, "")
            try:
                with checkout(self.pool, timeout_seconds=interval) as conn, \
                        statement_deadline(conn, interval / 2):
                    lease = transitions.heartbeat(
                        conn, attempt_id=self.claim.attempt_id, generation=self.claim.generation,
                        lease_seconds=self.settings.lease_seconds,
                        output_tail=text if total != self._tail_sent_bytes else None)
                self._tail_sent_bytes = total
            except (FencedOut, Forbidden) as exc:
                # Forbidden: the server no longer believes this host (its login or its group
                # was revoked); its work is handled as a lost runner's, so stop it as fenced.
                if self.command_ended.is_set():
                    return  # the report was recorded first: the attempt has ended
                log.warning("job %d attempt %d: heartbeat fenced out%s", self.claim.job_id,
                            self.claim.attempt_no,
                            f" ({exc})" if isinstance(exc, Forbidden) else "")
                self.is_fenced.set()
                self._wake()
                return
            except Exception as exc:  # DatabaseUnavailable and kin: try again soon
                log.warning("job %d attempt %d: heartbeat failed: %s", self.claim.job_id,
                            self.claim.attempt_no, exc)
                wait = max(0.1, interval / 4)
                continue
            self.last_ok_sent_at = max(self.last_ok_sent_at, sent)
            self._arm_watchdog()
            wait = interval
            if lease.is_cancel_requested and not self.is_cancel_requested.is_set():
                self.is_cancel_requested.set()
                self._wake()
