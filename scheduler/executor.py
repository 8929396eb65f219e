"""Run one claimed job: its command in a subprocess, its lease kept alive, its outcome reported.

One ``Execution`` per claim, on its own thread. It ties together four parts, a module each:

* supervision.py: the command in its own process group (``start_new_session``), so that every
  way of stopping it reaches the whole tree;
* sandbox.py: as whom, where and with which environment it runs (``--run-as``: a slot's own
  user, taken for the job; a fresh working directory; an allow-listed environment), and,
  once the command has ended however it ended, every process left of the job's uid killed
  (a ``setsid`` escapes the group, not this) before the report is sent, then the working
  directory removed and the user handed back;
* heartbeats.py: the lease kept alive while the command runs (one sender thread per
  scheduler beats for all its running attempts, those due together in one transaction);
* output.py: the last 64 KiB of the command's output, kept in memory;
* reporting.py: the outcome recorded in the database, sent again after a lost answer, and
  perhaps in one transaction with other executions' (one ``CompletionReporter`` per scheduler).

No database connection is held while the command runs: the heartbeat borrows one from the pool
for each beat and the completion borrows one at the end. The heartbeats go on after the
command ends, until its report is answered, so the lease never lapses under a finished job
whose report is still on its way.

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
  (re-queued, not a failure), a deployment ``lost`` (its outcome is unknown). An operator's
  drain past its deadline stops only builds this way (scheduler/main.py): a drain never
  cuts a deployment.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable

from pgdispatch.sql import Settings
from pgdispatch.sql.transitions import Claim

from .heartbeats import Heartbeat, HeartbeatSender
from .output import OutputTail
from .reporting import CompletionReporter, report_outcome
from .sandbox import Sandbox
from .supervision import CommandNotStarted, Supervisor, end_command, start_command

log = logging.getLogger(__name__)


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


class Execution:
    """Runs one claim on its own thread; see the module docstring for the stopping rules.

    Args:
        claim: what to run.
        pool: the connection pool (from ``pgdispatch.sql.scheduling.make_scheduler_pool``).
        settings: lease_seconds, heartbeat_seconds and the retry backoff are read from it.
        sent_at: ``time.monotonic()`` when the claim request was sent (the lease runs from
            no earlier than that).
        kill_grace_seconds: between SIGTERM and SIGKILL when stopping the command (seconds).
        on_started: called with (claim, pid) once the command runs.
        on_completed: called with the ExecutionResult when everything is done.
        reporter: the scheduler's CompletionReporter (shared, so that reports can be
            batched); None: this execution reports alone with ``transitions.complete``.
        watchdog: the scheduler's ``watchdog.Watchdog``, armed for the command's process
            group while it runs; None: no watchdog.
        sandbox: how the command is started (sandbox.Sandbox); default: as this process's
            user, in a fresh directory, with the allow-listed environment.
        heartbeats: the scheduler's heartbeats.HeartbeatSender, which beats for all its
            running attempts together; None: this execution beats alone.
    """

    def __init__(self, claim: Claim, *, pool, settings: Settings, sent_at: float,
                 kill_grace_seconds: float = 5.0,
                 on_started: Callable[[Claim, int], None] | None = None,
                 on_completed: Callable[[ExecutionResult], None] | None = None,
                 watchdog=None, reporter: CompletionReporter | None = None,
                 sandbox: Sandbox | None = None, heartbeats: HeartbeatSender | None = None):
        self.claim = claim
        self.heartbeats = heartbeats
        self.sandbox = sandbox or Sandbox()
        self.reporter = reporter or CompletionReporter(pool, settings, max_batch=1)
        self.watchdog = watchdog
        self.pool = pool
        self.settings = settings
        self.sent_at = sent_at
        self.kill_grace_seconds = kill_grace_seconds
        self.on_started = on_started
        self.on_completed = on_completed
        self.pid: int | None = None
        self.result: ExecutionResult | None = None
        self.done = threading.Event()
        self._abandon = threading.Event()
        self._stop_why: str | None = None
        self._supervisor = Supervisor(claim, settings=settings,
                                      kill_grace_seconds=kill_grace_seconds)
        self._thread = threading.Thread(target=self._run, name=f"job-{claim.job_id}", daemon=True)

    def start(self) -> None:
        """Start running the claim on a new thread."""
        self._thread.start()

    def request_stop(self, *, hurry: bool = False, why: str | None = None) -> None:
        """Stop the command for a shutdown: SIGTERM, then SIGKILL after kill_grace_seconds
        (at once with ``hurry``); a build is then reported handed_back, a deployment lost.
        ``why``: the error text a build's hand-back is reported with (default: the
        scheduler stopped); an operator's drain past its deadline says so."""
        if why is not None and self._stop_why is None:
            self._stop_why = why
        self._supervisor.request_stop(hurry=hurry)

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
            self._supervisor.close()
        finally:
            self.done.set()
            if self.on_completed is not None:
                try:
                    self.on_completed(result)
                except Exception:
                    log.exception("on_completed callback failed")

    def _execute(self, started: float) -> ExecutionResult:
        run_as = self.sandbox.take_user()
        try:
            workdir = self.sandbox.make_workdir(self.claim, run_as.user)
            try:
                return self._execute_in(started, workdir, run_as)
            finally:
                # leftovers first: a process of the job's uid could still write into the
                # directory, or read it, once a later job has it
                run_as.sweep()
                self.sandbox.remove_workdir(workdir)
        finally:
            run_as.release()

    def _execute_in(self, started: float, workdir, run_as) -> ExecutionResult:
        claim = self.claim
        try:
            proc = start_command(claim, sandbox=self.sandbox, workdir=workdir, user=run_as.user)
        except CommandNotStarted as exc:
            log.info("job %d attempt %d: could not start: %s", claim.job_id, claim.attempt_no,
                     exc.error)
            return self._report(started, lambda: self.sent_at, "failed", exc.exit_code,
                                exc.error, exc.error, None)

        self.pid = proc.pid
        tail = OutputTail()
        hb = Heartbeat(claim, pool=self.pool, settings=self.settings, sent_at=self.sent_at,
                       wake=self._supervisor.wake, tail=tail, watchdog=self.watchdog,
                       pgid=proc.pid, sender=self.heartbeats)
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
            stop_reason = self._supervisor.supervise(
                proc, hb, tail,
                after_exit=lambda: (run_as.kill_session(proc.pid), run_as.sweep()))
        except BaseException:
            hb.stopping.set()
            raise
        finally:
            hb.command_ended.set()
            # Whatever happened, nothing of the job's process group survives it. The watchdog
            # is disarmed, and the session's leftovers killed, before the reap: until then the
            # group and session id cannot belong to a new job that this would hit.
            end_command(proc, before_reap=lambda: (hb.disarm_watchdog(),
                                                   run_as.kill_session(proc.pid)))
            # and nothing else of the job's uid (a setsid escapes the session): before the
            # report, so that once the outcome is recorded nothing of the job runs
            run_as.sweep()

        exit_code = proc.returncode
        output = tail.text()
        if stop_reason in ("fenced", "self_fenced"):
            hb.stopping.set()
            log.warning("job %d attempt %d: %s; killed the process group, not reporting",
                        claim.job_id, claim.attempt_no,
                        "fenced out" if stop_reason == "fenced" else
                        f"no heartbeat succeeded for {self.settings.lease_seconds:g} s")
            return ExecutionResult(claim, proc.pid, None, exit_code, None, output, stop_reason,
                                   False, None, time.monotonic() - started)
        outcome, error = _outcome_of(claim, stop_reason, exit_code)
        if outcome == "handed_back" and self._stop_why is not None:
            error = self._stop_why
        # The heartbeats go on until the report is answered: a report that waits (a stalled
        # connection, an outage, a retry) must not let the lease lapse under a job whose
        # command has ended with a true outcome to record.
        try:
            return self._report(started, lambda: hb.last_ok_sent_at, outcome, exit_code,
                                error, output, stop_reason)
        finally:
            hb.stopping.set()
            # a beat still in flight ends on its own (fenced: the attempt has ended), bounded
            # by the statement deadline
            hb.join(timeout=self.settings.heartbeat_seconds)

    def _report(self, started: float, lease_from: Callable[[], float], outcome: str,
                exit_code: int | None, error: str | None, output: str,
                stop_reason: str | None) -> ExecutionResult:
        """Report the outcome (reporting.report_outcome: retried, maybe batched) and say
        what became of it."""
        claim = self.claim
        answer = report_outcome(self.reporter, claim, outcome=outcome, exit_code=exit_code,
                                error=error, output_tail=output, lease_from=lease_from,
                                lease_seconds=self.settings.lease_seconds,
                                abandon=self._abandon)
        elapsed = time.monotonic() - started
        if answer is None:
            return ExecutionResult(claim, self.pid, None, exit_code, error, output, stop_reason,
                                   False, None, elapsed)
        log.info("completed job %d attempt %d: %s (exit %s) in %.1f s; job is %s%s",
                 claim.job_id, claim.attempt_no, outcome, exit_code, elapsed,
                 answer["job_state"], " (late report)" if answer.get("is_late_report") else "")
        return ExecutionResult(claim, self.pid, outcome, exit_code, error, output, stop_reason,
                               True, answer["job_state"], elapsed)


def _outcome_of(claim: Claim, stop_reason: str | None, exit_code: int) -> tuple[str, str | None]:
    """The outcome and error text to report for a command that ended without being fenced."""
    if stop_reason == "timeout":
        return "failed", f"timed out after {claim.timeout_seconds} s"
    if stop_reason == "cancel":
        return "cancelled", "cancelled on request"
    if stop_reason == "shutdown":
        if claim.is_deployment:
            return "lost", "scheduler stopped during the deployment; outcome unknown"
        return "handed_back", "scheduler stopped; job handed back"
    if exit_code == 0:
        return "succeeded", None
    if exit_code < 0:
        return "failed", f"killed by {signal.Signals(-exit_code).name}"
    return "failed", None
