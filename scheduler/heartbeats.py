"""Heartbeats: what keeps a running attempt's lease alive while its command runs, and after
it until its outcome is reported.

Each running attempt has a ``Heartbeat``: its lease's state (``last_ok_sent_at``), the flags
its beats raise, its output tail and watchdog. One ``HeartbeatSender`` thread per scheduler
sends the beats: every ``heartbeat_seconds`` after an attempt's last beat (or its start), it
borrows a pool connection (none is held between beats) and extends in one transaction the
leases of every attempt whose beat is due then or within half an interval
(``transitions.heartbeat_batch``; ``transitions.heartbeat`` for a lone one), so the beats of
jobs started apart fall into step and a scheduler with 100 running jobs makes about one
transaction per interval instead of a hundred. A beat sent early only renews a lease
sooner. What a beat learns for an attempt it only records, and wakes that attempt's
supervision loop (supervision.py), which acts on it:

* fenced out (the attempt is no longer the job's current one; missing from the batch's
  answer): ``is_fenced``; the loop kills the process group at once and nothing is reported.
  No more beats for it.
* cancel requested: ``is_cancel_requested``; the loop stops the command and it is reported
  cancelled.
* a beat failed (DatabaseUnavailable and kin), or got no answer within half the interval (a
  stalled connection; sql/db.py, statement_deadline): tried again after a quarter of the
  interval, on a fresh connection, so that the retry still lands well inside the lease.
  ``last_ok_sent_at`` stays where it was, and the loop fences the job itself
  (``fence_margin_seconds`` before the lease could lapse) if no beat succeeds in time: a
  batch's failure is each of its attempts' failure, and a lease renewed for one attempt
  never moves another's clock.

After each successful beat the watchdog's deadline for the attempt's process group is
renewed. A ``Heartbeat`` started without a sender gets one of its own (a thread that ends
with it), as every attempt had before beats were batched.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pgdispatch.sql import FencedOut, Forbidden, Settings, transitions
from pgdispatch.sql.db import checkout, statement_deadline
from pgdispatch.sql.transitions import Claim, Lease

from .output import OutputTail

log = logging.getLogger(__name__)

HEARTBEAT_TAIL_BYTES = 16 * 1024  # the part of the tail a heartbeat carries, when it changed
MAX_BEATS_PER_BATCH = 1000  # pgd_heartbeat_batch's bound


def fence_margin_seconds(lease_seconds: float) -> float:
    """How long before a lease could lapse a job is fenced (by the executor and the
    watchdog alike), in seconds: a tenth of the lease, at most one second."""
    return min(1.0, lease_seconds / 10)


class _Stopping(threading.Event):
    """An Event whose ``set`` also lets the sender drop the heartbeat at once."""

    def __init__(self, on_set: Callable[[], None]):
        super().__init__()
        self._on_set = on_set

    def set(self) -> None:
        super().set()
        self._on_set()


class Heartbeat:
    """One running attempt's lease, kept alive by a HeartbeatSender; records fencing and
    cancel requests.

    Args:
        claim: the running attempt.
        pool: the connection pool (for a sender of its own).
        settings: heartbeat_seconds (the interval, and the connection checkout timeout) and
            lease_seconds (granted by each beat).
        sent_at: ``time.monotonic()`` when the claim was sent: the lease runs from then until
            a beat succeeds.
        wake: called when ``is_fenced`` or ``is_cancel_requested`` is newly set.
        tail: the command's output; each beat carries its last HEARTBEAT_TAIL_BYTES when it
            grew since the last beat that succeeded.
        watchdog / pgid: the scheduler's ``watchdog.Watchdog`` and the job's process group,
            armed after each successful beat; None: no watchdog.
        sender: the scheduler's HeartbeatSender; None: ``start`` starts one of its own.

    Attributes:
        last_ok_sent_at: monotonic time the last successful beat (or the claim) was sent.
        is_fenced / is_cancel_requested: Events, set from the beats' answers.
        stopping: set it to end the beats (they end after the beat in flight, if any).
        command_ended: set once the command has ended; the beats go on (its report may still
            be on its way), a fenced answer then only means the report got there first.
    """

    def __init__(self, claim: Claim, *, pool, settings: Settings, sent_at: float,
                 wake: Callable[[], None], tail: OutputTail | None = None, watchdog=None,
                 pgid: int | None = None, sender: "HeartbeatSender | None" = None):
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
        self.stopping = _Stopping(self._drop)
        self.command_ended = threading.Event()
        self._wake = wake
        self._sender = sender
        self._own_sender: HeartbeatSender | None = None
        # guarded by the sender's lock: when the next beat is due (monotonic), whether one is
        # in flight; _done is set once the sender has let go of it (and before start)
        self.due_at = 0.0
        self._is_in_flight = False
        self._is_over = False  # fenced out (or ended first): no more beats
        self._done = threading.Event()
        self._done.set()
        # arm (after a beat) and disarm (after the job) under one lock, so that a beat still
        # in flight when the job ends cannot re-arm a process group id that is gone, and that
        # the system may give to another process group
        self._watchdog_lock = threading.Lock()
        self._is_disarmed = False

    def start(self) -> None:
        """Start beating: the first beat is due heartbeat_seconds from now."""
        self._done.clear()
        if self._sender is None:
            self._own_sender = HeartbeatSender(self.pool, self.settings,
                                               name=f"heartbeat-{self.claim.job_id}",
                                               is_one_off=True)
            self._own_sender.add(self)
            self._own_sender.start()
        else:
            self._sender.add(self)

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the beats to end (``stopping``, or fenced)."""
        self._done.wait(timeout)
        if self._own_sender is not None and self._done.is_set():
            self._own_sender.join(timeout)

    def is_alive(self) -> bool:
        """Whether beats may still be sent for this attempt."""
        return not self._done.is_set() or (self._own_sender is not None
                                            and self._own_sender.is_alive())

    def _drop(self) -> None:
        sender = self._own_sender or self._sender
        if sender is not None:
            sender.drop(self)

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

    # -- called by the sender's thread ----------------------------------------------------

    def _beat_ok(self, sent: float, lease: Lease, tail_bytes: int) -> None:
        self._tail_sent_bytes = tail_bytes
        self.last_ok_sent_at = max(self.last_ok_sent_at, sent)
        self._arm_watchdog()
        if lease.is_cancel_requested and not self.is_cancel_requested.is_set():
            self.is_cancel_requested.set()
            self._wake()

    def _beat_fenced(self, exc: BaseException | None) -> None:
        self._is_over = True
        # Forbidden: the server no longer believes this host (its login or its group was
        # revoked); its work is handled as a lost runner's, so stop it as fenced.
        if self.command_ended.is_set():
            return  # the report was recorded first: the attempt has ended
        log.warning("job %d attempt %d: heartbeat fenced out%s", self.claim.job_id,
                    self.claim.attempt_no,
                    f" ({exc})" if isinstance(exc, Forbidden) else "")
        self.is_fenced.set()
        self._wake()


class HeartbeatSender(threading.Thread):
    """Sends the beats of every started Heartbeat: those due together in one transaction.

    Args:
        pool: the connection pool.
        settings: heartbeat_seconds (the interval: each attempt's beat is due that long after
            its last one; beats due within half of it go together) and lease_seconds.
        name: the thread's name.
        is_one_off: end the thread once its heartbeats have ended (a Heartbeat's own).

    Attributes:
        transactions: beat transactions sent (for tests and logs).
    """

    def __init__(self, pool, settings: Settings, *, name: str = "heartbeats",
                 is_one_off: bool = False):
        super().__init__(name=name, daemon=True)
        self.pool = pool
        self.settings = settings
        self.is_one_off = is_one_off
        self._cond = threading.Condition()
        self._beats: dict[int, Heartbeat] = {}  # id(heartbeat) -> heartbeat, guarded by _cond
        self._is_stopped = False
        self.transactions = 0

    def add(self, hb: Heartbeat) -> None:
        """Beat for ``hb`` from now on, the first beat due heartbeat_seconds from now."""
        with self._cond:
            hb.due_at = time.monotonic() + self.settings.heartbeat_seconds
            self._beats[id(hb)] = hb
            self._cond.notify()

    def drop(self, hb: Heartbeat) -> None:
        """No more beats for ``hb`` (once the one in flight, if any, is answered)."""
        with self._cond:
            if hb._is_in_flight:
                return  # let go of when its answer comes
            self._let_go(hb)

    def stop(self) -> None:
        """End the thread after the beat in flight, if any; no more beats for anyone."""
        with self._cond:
            self._is_stopped = True
            self._cond.notify()

    def _let_go(self, hb: Heartbeat) -> None:
        self._beats.pop(id(hb), None)
        hb._done.set()
        self._cond.notify()

    def run(self) -> None:
        """Send the beats as they fall due (the thread's body)."""
        interval = self.settings.heartbeat_seconds
        try:
            while True:
                with self._cond:
                    while True:
                        if self._is_stopped or (self.is_one_off and not self._beats):
                            return
                        now = time.monotonic()
                        next_due = min((hb.due_at for hb in self._beats.values()), default=None)
                        if next_due is not None and next_due <= now:
                            break
                        self._cond.wait(None if next_due is None else next_due - now)
                    # every beat due within half an interval goes now: a little early for
                    # some, so that next time they are due together
                    batch = sorted((hb for hb in self._beats.values()
                                    if hb.due_at <= now + interval / 2),
                                   key=lambda hb: hb.due_at)[:MAX_BEATS_PER_BATCH]
                    for hb in batch:
                        hb._is_in_flight = True
                try:
                    self._send(batch)
                finally:
                    with self._cond:
                        for hb in batch:
                            hb._is_in_flight = False
                            if hb.stopping.is_set() or hb._is_over:
                                self._let_go(hb)
        finally:
            with self._cond:
                for hb in list(self._beats.values()):
                    self._let_go(hb)

    def _send(self, batch: list[Heartbeat]) -> None:
        """One beat transaction for ``batch``; records each attempt's answer."""
        interval = self.settings.heartbeat_seconds
        # taken before the request: the lease the database grants runs from no earlier
        sent = time.monotonic()
        beats, totals = [], []
        for hb in batch:
            total, text = hb.tail.snapshot(HEARTBEAT_TAIL_BYTES) if hb.tail else (0, "")
            beats.append((hb.claim.attempt_id, hb.claim.generation,
                          text if total != hb._tail_sent_bytes else None))
            totals.append(total)
        self.transactions += 1
        try:
            with checkout(self.pool, timeout_seconds=interval) as conn, \
                    statement_deadline(conn, interval / 2):
                if len(beats) == 1:
                    attempt_id, generation, tail = beats[0]
                    try:
                        leases = {attempt_id: transitions.heartbeat(
                            conn, attempt_id=attempt_id, generation=generation,
                            lease_seconds=self.settings.lease_seconds, output_tail=tail)}
                    except FencedOut:
                        leases = {}
                else:
                    leases = transitions.heartbeat_batch(
                        conn, beats=beats, lease_seconds=self.settings.lease_seconds)
        except Forbidden as exc:
            for hb in batch:
                hb._beat_fenced(exc)
            return
        except Exception as exc:  # DatabaseUnavailable and kin: try again soon
            retry_at = time.monotonic() + max(0.1, interval / 4)
            for hb in batch:
                log.warning("job %d attempt %d: heartbeat failed: %s", hb.claim.job_id,
                            hb.claim.attempt_no, exc)
                hb.due_at = retry_at
            return
        due_at = sent + interval
        for hb, total in zip(batch, totals):
            lease = leases.get(hb.claim.attempt_id)
            if lease is None:
                hb._beat_fenced(None)
            else:
                hb.due_at = due_at
                hb._beat_ok(sent, lease, total)
