"""Run one claimed job: its command in a subprocess, its lease kept alive, its outcome reported.

One ``Execution`` per claim, on its own thread. The command runs in its own process group
(``start_new_session``), so that every way of stopping it — timeout, cancel, fence, shutdown —
reaches the whole tree, and nothing the job started outlives it. No database connection is
held while the command runs: the heartbeat thread borrows one from the pool for each beat
and the completion borrows one at the end.

Stopping rules (DESIGN.md, "Transitions"):

* timeout (``claim.timeout_seconds``): SIGTERM to the group, SIGKILL after
  ``kill_grace_seconds``; reported ``failed`` with "timed out after N s".
* cancel requested (seen in a heartbeat's answer): SIGTERM, then SIGKILL; reported
  ``cancelled``.
* fenced out (a heartbeat says the attempt is no longer current): SIGKILL at once; nothing is
  reported, since the attempt is no longer ours to report.
* self-fenced (no heartbeat has succeeded for ``lease_seconds``, measured on the monotonic
  clock from the moment the last successful heartbeat — or the claim — was *sent*): the lease
  may be gone and another runner may take the job, so SIGKILL at once and report nothing.
* shutdown (``request_stop``): SIGTERM, then SIGKILL; a build is reported ``handed_back``
  (re-queued, not a failure), a deployment ``lost`` (its outcome is unknown).

Reports go through one ``CompletionReporter`` per scheduler. It sends a lone report with
``transitions.complete``, as before; reports that arrive while another is in flight wait for
it and then go together, up to ``max_batch`` of them, in one ``complete_batch`` transaction
(group commit: batching never delays a report that finds the reporter idle). Each execution
keeps its own retry rules: a batch whose answer was lost fails every report in it with
DatabaseUnavailable, and each one is sent again under its own receipt key, which the database
answers with the first answer instead of recording it twice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from sql import DatabaseUnavailable, FencedOut, PgDispatchError, Settings, transitions
from sql.db import checkout
from sql.transitions import Claim

from .claiming import check_max_batch

log = logging.getLogger(__name__)

OUTPUT_TAIL_BYTES = 64 * 1024
HEARTBEAT_TAIL_BYTES = 16 * 1024
# how long past its lease a finished attempt keeps trying to report (a database outage)
LATE_REPORT_SECONDS = 900.0  # the part of the tail a heartbeat carries, when it changed
# Environment variables a job must not inherit from its scheduler: the database it could
# otherwise write to directly, and the scheduler's own settings and secrets.
_PRIVATE_ENV = ("DATABASE_URL", "PGPASSWORD", "PGPASSFILE")
_PRIVATE_ENV_PREFIX = "PGDISPATCH_"


@dataclasses.dataclass(frozen=True)
class ExecutionResult:
    """What happened to one claim, handed to ``on_completed``.

    Attributes:
        claim: the claim that was run.
        pid: the command's process id (also its process group id), None if it never started.
        outcome: the outcome reported to the database (succeeded, failed, cancelled,
            handed_back, lost), or None when nothing was recorded (fenced out, self-fenced,
            or the report could not be delivered in time).
        exit_code: the command's exit status (negative: killed by that signal; 126/127: could
            not be started).
        error: the error text reported with the outcome, if any.
        output_tail: the last 64 KiB of the command's stdout and stderr, decoded as UTF-8.
        stop_reason: why the scheduler stopped the command: timeout, cancel, fenced,
            self_fenced, shutdown; None when it exited by itself.
        is_reported: whether the database recorded ``outcome`` (a repeated receipt counts).
        job_state: the job's state after the report, when reported.
        run_seconds: from the start of the execution to the end of its report, in seconds.
    """

    claim: Claim
    pid: int | None
    outcome: str | None
    exit_code: int | None
    error: str | None
    output_tail: str
    stop_reason: str | None
    is_reported: bool
    job_state: str | None
    run_seconds: float


class OutputTail:
    """A ring buffer that keeps the last ``limit`` bytes written to it."""

    def __init__(self, limit: int = OUTPUT_TAIL_BYTES):
        self.limit = limit
        self._buf = bytearray()
        self._lock = threading.Lock()  # written by the execution, read by the heartbeat
        self.total_bytes = 0

    def write(self, chunk: bytes) -> None:
        """Append ``chunk``, dropping the oldest bytes beyond the limit."""
        with self._lock:
            self.total_bytes += len(chunk)
            self._buf += chunk
            if len(self._buf) > self.limit:
                del self._buf[:len(self._buf) - self.limit]

    def text(self) -> str:
        """The kept bytes as UTF-8 text (undecodable bytes replaced)."""
        with self._lock:
            return self._buf.decode("utf-8", errors="replace")

    def snapshot(self, limit_bytes: int) -> tuple[int, str]:
        """(bytes written so far, the last ``limit_bytes`` of them as UTF-8 text)."""
        with self._lock:
            return self.total_bytes, self._buf[-limit_bytes:].decode("utf-8", errors="replace")


def fence_margin_seconds(lease_seconds: float) -> float:
    """How long before a lease could lapse a job is fenced (by the executor and the
    watchdog alike): a tenth of the lease, at most one second."""
    return min(1.0, lease_seconds / 10)


def job_environment(claim: Claim, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a job's command runs with: the scheduler's own, without the database
    URL, password or any PGDISPATCH_* setting, plus PGDISPATCH_JOB_ID, PGDISPATCH_ATTEMPT
    (attempt number, from 1), PGDISPATCH_ATTEMPT_ID and PGDISPATCH_GENERATION."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in _PRIVATE_ENV and not k.startswith(_PRIVATE_ENV_PREFIX)}
    env.update(PGDISPATCH_JOB_ID=str(claim.job_id), PGDISPATCH_ATTEMPT=str(claim.attempt_no),
               PGDISPATCH_ATTEMPT_ID=str(claim.attempt_id),
               PGDISPATCH_GENERATION=str(claim.generation))
    return env


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        # a member changed its uid (setuid program); the rest of the group got the signal
        log.warning("could not signal every process in group %d with %s", pgid,
                    signal.Signals(sig).name)


class _Waker:
    """A self-pipe that wakes the execution's select() from other threads."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        with self._lock:  # never write to a closed (and perhaps reused) descriptor
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"x")
            except BlockingIOError:
                pass  # already has bytes pending: it will wake anyway

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self.read_fd)
            os.close(self._write_fd)


class _Heartbeat(threading.Thread):
    """Extends the lease every ``heartbeat_seconds``; records fencing and cancel requests."""

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
        self.last_ok_sent_at = sent_at  # monotonic: when the last request that succeeded was sent
        self.is_fenced = threading.Event()
        self.is_cancel_requested = threading.Event()
        self.stopping = threading.Event()
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
        interval = self.settings.heartbeat_seconds
        wait = interval
        while not self.stopping.wait(wait):
            sent = time.monotonic()
            total, text = self.tail.snapshot(HEARTBEAT_TAIL_BYTES) if self.tail else (0, "")
            try:
                with checkout(self.pool, timeout_seconds=interval) as conn:
                    lease = transitions.heartbeat(
                        conn, attempt_id=self.claim.attempt_id, generation=self.claim.generation,
                        lease_seconds=self.settings.lease_seconds,
                        output_tail=text if total != self._tail_sent_bytes else None)
                self._tail_sent_bytes = total
            except FencedOut:
                log.warning("job %d attempt %d: heartbeat fenced out", self.claim.job_id,
                            self.claim.attempt_no)
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
    With ``max_batch`` 1 every report is its own ``complete`` call, concurrently, as before.

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

    def complete_many(self, items: list[dict[str, Any]]) -> list[dict[str, Any] | BaseException]:
        """Send ``items`` (dicts of ``complete``'s arguments) now, in one transaction when
        there are several: one answer or exception per item, in order; never raises."""
        batch = [_Report(dict(i)) for i in items]
        self._send(batch)
        return [r.error if r.error is not None else r.answer for r in batch]

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


class Execution:
    """Runs one claim on its own thread; see the module docstring for the stopping rules.

    Args:
        claim: what to run.
        pool: the connection pool (from ``sql.scheduling.make_scheduler_pool``).
        settings: lease_seconds, heartbeat_seconds and the retry backoff are read from it.
        sent_at: ``time.monotonic()`` when the claim request was sent (the lease runs from
            no earlier than that).
        kill_grace_seconds: between SIGTERM and SIGKILL when stopping the command.
        on_started: called with (claim, pid) once the command runs.
        on_completed: called with the ExecutionResult when everything is done.
        reporter: the scheduler's CompletionReporter (shared, so that reports can be
            batched); None: this execution reports alone with ``transitions.complete``.
    """

    def __init__(self, claim: Claim, *, pool, settings: Settings, sent_at: float,
                 kill_grace_seconds: float = 5.0,
                 on_started: Callable[[Claim, int], None] | None = None,
                 on_completed: Callable[[ExecutionResult], None] | None = None,
                 watchdog=None, reporter: CompletionReporter | None = None):
        self.claim = claim
        self.reporter = reporter or CompletionReporter(pool, settings, max_batch=1)
        self.watchdog = watchdog  # scheduler.watchdog.Watchdog, or None
        self.pool = pool
        self.settings = settings
        self.sent_at = sent_at
        self.kill_grace_seconds = kill_grace_seconds
        self.on_started = on_started
        self.on_completed = on_completed
        self.pid: int | None = None
        self.result: ExecutionResult | None = None
        self.done = threading.Event()
        self._stop_requested = threading.Event()
        self._hurry = threading.Event()
        self._abandon = threading.Event()
        self._waker = _Waker()
        self._thread = threading.Thread(target=self._run, name=f"job-{claim.job_id}", daemon=True)

    def start(self) -> None:
        """Start running the claim on a new thread."""
        self._thread.start()

    def request_stop(self, *, hurry: bool = False) -> None:
        """Stop the command for a shutdown: SIGTERM, then SIGKILL after kill_grace_seconds
        (at once with ``hurry``); a build is then reported handed_back, a deployment lost."""
        self._stop_requested.set()
        if hurry:
            self._hurry.set()
        self._waker.wake()

    def abandon(self) -> None:
        """Stop retrying an undelivered report (the scheduler is exiting)."""
        self._abandon.set()
        self.request_stop(hurry=True)

    def join(self, timeout_seconds: float | None = None) -> bool:
        """Wait up to ``timeout_seconds`` for the execution to end; True when it has."""
        return self.done.wait(timeout_seconds)

    # -- the execution thread ------------------------------------------------------------

    def _run(self) -> None:
        started = time.monotonic()
        try:
            result = self._execute(started)
        except BaseException:
            log.exception("job %d attempt %d: executor failed", self.claim.job_id,
                          self.claim.attempt_no)
            result = ExecutionResult(self.claim, self.pid, None, None, "executor failed", "",
                                     None, False, None, time.monotonic() - started)
        self.result = result
        try:
            self._waker.close()
        finally:
            self.done.set()
            if self.on_completed is not None:
                try:
                    self.on_completed(result)
                except Exception:
                    log.exception("on_completed callback failed")

    def _execute(self, started: float) -> ExecutionResult:
        claim = self.claim
        try:
            proc = subprocess.Popen(claim.command, start_new_session=True, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=job_environment(claim), close_fds=True)
        except (OSError, ValueError) as exc:
            # The shell's conventions: 127 not found, 126 found but not executable.
            exit_code = 127 if isinstance(exc, (FileNotFoundError, NotADirectoryError)) else 126
            error = f"{claim.command[0]}: {getattr(exc, 'strerror', None) or exc}"
            log.info("job %d attempt %d: could not start: %s", claim.job_id, claim.attempt_no,
                     error)
            return self._report(started, lambda: self.sent_at, "failed", exit_code, error, error,
                                None)

        self.pid = proc.pid
        tail = OutputTail()
        hb = _Heartbeat(claim, pool=self.pool, settings=self.settings, sent_at=self.sent_at,
                        wake=self._waker.wake, tail=tail, watchdog=self.watchdog, pgid=proc.pid)
        if self.watchdog is not None:
            self.watchdog.arm(proc.pid, lease_from=self.sent_at,
                              lease_seconds=self.settings.lease_seconds)
        try:
            if self.on_started is not None:
                try:
                    self.on_started(claim, proc.pid)
                except Exception:
                    log.exception("on_started callback failed")
            hb.start()
            stop_reason = self._supervise(proc, hb, tail)
        finally:
            hb.stopping.set()
            # Whatever happened, nothing of the job's process group survives it.
            _kill_group(proc.pid, signal.SIGKILL)
            # Disarmed before the reap: until proc.wait() the unreaped leader keeps its pid, so
            # the group id cannot have gone to a new job whose arm this disarm would cancel.
            hb.disarm_watchdog()
            proc.wait()
            proc.stdout.close()
        # A beat in flight could otherwise race the completion; it is short or it is stuck.
        hb.join(timeout=self.settings.heartbeat_seconds)

        exit_code = proc.returncode
        output = tail.text()
        if stop_reason in ("fenced", "self_fenced"):
            log.warning("job %d attempt %d: %s; killed the process group, not reporting",
                        claim.job_id, claim.attempt_no,
                        "fenced out" if stop_reason == "fenced" else
                        f"no heartbeat succeeded for {self.settings.lease_seconds:g} s")
            return ExecutionResult(claim, proc.pid, None, exit_code, None, output, stop_reason,
                                   False, None, time.monotonic() - started)
        if stop_reason == "timeout":
            outcome, error = "failed", f"timed out after {claim.timeout_seconds} s"
        elif stop_reason == "cancel":
            outcome, error = "cancelled", "cancelled on request"
        elif stop_reason == "shutdown":
            if claim.is_deployment:
                outcome, error = "lost", "scheduler stopped during the deployment; outcome unknown"
            else:
                outcome, error = "handed_back", "scheduler stopped; job handed back"
        elif exit_code == 0:
            outcome, error = "succeeded", None
        elif exit_code < 0:
            outcome, error = "failed", f"killed by {signal.Signals(-exit_code).name}"
        else:
            outcome, error = "failed", None
        return self._report(started, lambda: hb.last_ok_sent_at, outcome, exit_code, error,
                            output, stop_reason)

    def _supervise(self, proc: subprocess.Popen, hb: _Heartbeat, tail: OutputTail) -> str | None:
        """Read output and enforce the rules until the command exits; returns the stop reason."""
        claim = self.claim
        # Fence a margin before the lease could lapse, at the same moment as the watchdog.
        lease = self.settings.lease_seconds - fence_margin_seconds(self.settings.lease_seconds)
        out_fd = proc.stdout.fileno()
        os.set_blocking(out_fd, False)
        timeout_at = time.monotonic() + claim.timeout_seconds
        sel = selectors.DefaultSelector()
        sel.register(out_fd, selectors.EVENT_READ, "out")
        sel.register(self._waker.read_fd, selectors.EVENT_READ, "wake")
        pidfd = None
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, "exit")
        except (AttributeError, OSError):
            pass  # no pidfd (old kernel, or forbidden): poll for the exit instead
        stop_reason: str | None = None
        term_sent_at: float | None = None
        killed = False
        is_exited = False
        try:
            while True:
                now = time.monotonic()
                if not is_exited:
                    # WNOWAIT: leave the child a zombie, so its pid (and so its process group
                    # id) cannot be reused before the final killpg.
                    is_exited = os.waitid(os.P_PID, proc.pid,
                                          os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
                if is_exited:
                    if stop_reason is None and now - hb.last_ok_sent_at >= lease:
                        # killed by the watchdog at the fence deadline (or ended just then):
                        # the lease may be gone, so this attempt is no longer ours to report
                        stop_reason = "self_fenced"
                    break
                if stop_reason not in ("fenced", "self_fenced"):
                    if hb.is_fenced.is_set():
                        stop_reason = "fenced"
                    elif now - hb.last_ok_sent_at >= lease:
                        stop_reason = "self_fenced"
                    if stop_reason in ("fenced", "self_fenced"):
                        _kill_group(proc.pid, signal.SIGKILL)
                        killed = True
                if stop_reason is None:
                    if hb.is_cancel_requested.is_set():
                        stop_reason = "cancel"
                    elif now >= timeout_at:
                        stop_reason = "timeout"
                    elif self._stop_requested.is_set():
                        stop_reason = "shutdown"
                    if stop_reason is not None:
                        log.info("job %d attempt %d: stopping (%s)", claim.job_id,
                                 claim.attempt_no, stop_reason)
                        _kill_group(proc.pid, signal.SIGTERM)
                        term_sent_at = now
                is_kill_due = term_sent_at is not None and (
                    now - term_sent_at >= self.kill_grace_seconds or self._hurry.is_set())
                if is_kill_due and not killed:
                    _kill_group(proc.pid, signal.SIGKILL)
                    killed = True

                deadlines = [hb.last_ok_sent_at + lease, timeout_at]
                if term_sent_at is not None and not killed:
                    deadlines.append(term_sent_at + self.kill_grace_seconds)
                wait = min(deadlines) - time.monotonic()
                if pidfd is None:
                    wait = min(wait, 0.05)
                for key, _ in sel.select(timeout=max(0.0, min(wait, 1.0))):
                    if key.data == "out":
                        self._read_into(out_fd, tail, sel)
                    elif key.data == "wake":
                        self._waker.drain()
            # The leader exited; read what is left once the rest of the group is gone too.
            _kill_group(proc.pid, signal.SIGKILL)
            self._read_rest(out_fd, tail, sel)
            return stop_reason
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)

    @staticmethod
    def _read_into(fd: int, tail: OutputTail, sel: selectors.BaseSelector) -> bool:
        """Read what is available; at end of file unregister ``fd``. True at end of file."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if chunk:
            tail.write(chunk)
            return False
        try:
            sel.unregister(fd)
        except KeyError:
            pass
        return True

    def _read_rest(self, fd: int, tail: OutputTail, sel: selectors.BaseSelector) -> None:
        # Bounded: a process that escaped the group (setsid) may hold the pipe open forever.
        deadline = time.monotonic() + 2.0
        if fd not in sel.get_map():
            return
        while time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                if key.data == "out" and self._read_into(fd, tail, sel):
                    return
                if key.data == "wake":
                    self._waker.drain()
        log.warning("job %d attempt %d: output pipe still open after the process group ended",
                    self.claim.job_id, self.claim.attempt_no)

    def _report(self, started: float, last_ok_sent_at: Callable[[], float], outcome: str,
                exit_code: int | None, error: str | None, output: str,
                stop_reason: str | None) -> ExecutionResult:
        """Complete the attempt, retrying with backoff after a lost connection (the receipt
        key makes a repeat harmless) until it is recorded or fenced out. A succeeded/failed
        report keeps trying past the lease, for up to LATE_REPORT_SECONDS: the database
        accepts it late as long as nobody has claimed the job since (for a deployment, it is
        what frees an uncertain target); other outcomes give up when the lease would lapse.
        The report goes through ``self.reporter``, maybe in one transaction with others';
        a batch's lost answer is retried here like a lone one's."""
        claim = self.claim
        is_late_ok = outcome in ("succeeded", "failed")
        try_no = 0
        while True:
            try:
                # perhaps in one transaction with other executions' reports (CompletionReporter)
                answer = self.reporter.complete(
                    attempt_id=claim.attempt_id, generation=claim.generation, outcome=outcome,
                    receipt_key=claim.receipt_key, exit_code=exit_code, error=error,
                    output_tail=output)
            except FencedOut as exc:
                log.warning("job %d attempt %d: %s not recorded: %s", claim.job_id,
                            claim.attempt_no, outcome, exc)
                return ExecutionResult(claim, self.pid, None, exit_code, error, output,
                                       stop_reason, False, None, time.monotonic() - started)
            except DatabaseUnavailable as exc:
                try_no += 1
                expires_at = last_ok_sent_at() + self.settings.lease_seconds
                delay = random.uniform(0, min(5.0, 0.1 * 2 ** try_no))
                now = time.monotonic()
                if (self._abandon.is_set() or (not is_late_ok and now + delay >= expires_at)
                        or now + delay >= expires_at + LATE_REPORT_SECONDS):
                    log.error("job %d attempt %d: could not report %s (%s); giving up, the lease "
                              "expiry will decide", claim.job_id, claim.attempt_no, outcome, exc)
                    return ExecutionResult(claim, self.pid, None, exit_code, error, output,
                                           stop_reason, False, None, time.monotonic() - started)
                log.warning("job %d attempt %d: reporting %s failed (%s); retry %d in %.2f s",
                            claim.job_id, claim.attempt_no, outcome, exc, try_no, delay)
                self._abandon.wait(delay)
                continue
            except PgDispatchError as exc:
                log.error("job %d attempt %d: report of %s refused: %s", claim.job_id,
                          claim.attempt_no, outcome, exc)
                return ExecutionResult(claim, self.pid, None, exit_code, error, output,
                                       stop_reason, False, None, time.monotonic() - started)
            elapsed = time.monotonic() - started
            log.info("completed job %d attempt %d: %s (exit %s) in %.1f s; job is %s%s",
                     claim.job_id, claim.attempt_no, outcome, exit_code, elapsed,
                     answer["job_state"], " (late report)" if answer.get("is_late_report") else "")
            return ExecutionResult(claim, self.pid, outcome, exit_code, error, output, stop_reason,
                                   True, answer["job_state"], elapsed)
