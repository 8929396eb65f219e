"""The scheduler process: ``pgdispatch scheduler --pool Q --slots N`` calls ``run``.

An APScheduler BackgroundScheduler drives five interval jobs, one module each:
claiming (fill free slots), runner_row (keep this runner's row alive, and carry the
election of the duties: scheduler/duties.py), and the duties, which only their elected
holder does: expiry (end lapsed leases; every scheduler for its own pools when the duty is
overdue), summaries (refresh the queue summary) and cleanup. Each claimed job runs in an
``executor.Execution`` thread. Every database call is one short transaction on a
connection borrowed from the pool; none is held while a job runs.

Shutdown (SIGTERM or SIGINT, or ``stop_event``): stop claiming and mark the runner draining,
let running jobs finish within the grace period, then stop the rest — a build is handed back
(re-queued, not a failure), a deployment reported lost (its outcome is unknown) — and mark
the runner stopped. A second signal skips the rest of the grace period and kills at once.

An operator's drain (pgd_drain_runner: console, CLI, API) is learnt from the database with
the next beat (the beat's answer carries it: sql/runners.sql, beat_runner), no signal: the
scheduler stops claiming (the database refuses its claims already) and ignores wake-ups,
lets its jobs finish, and once the drain's deadline passes (timed from the beat's db_now on
the monotonic clock) stops its running *builds* through the shutdown path, so each is
handed back (re-queued, no failure counted) and runs elsewhere; a deployment is never cut
by a drain. A resume is learnt the same way, or at once: its NOTIFY on this runner's
channel makes a wake-up, which while drained asks for a beat now instead of a claim.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.background import BackgroundScheduler

from pgdispatch.sql import DatabaseUnavailable, Settings, transitions
from pgdispatch.sql.db import checkout
from pgdispatch.sql.scheduling import (check_listen_url, listen_for_work, make_scheduler_pool,
                                       runner_pool_ids)
from pgdispatch.sql.transitions import Claim
from pgdispatch.sql.validate import check_max_batch

from . import expiry, runner_row, sandbox as sandboxes, summaries
from .duties import CLEANUP_INTERVAL_SECONDS, Duties
from .claiming import DEFAULT_MAX_BATCH, Claimer, ClaimWaker
from .executor import Execution, ExecutionResult
from .heartbeats import HeartbeatSender, fence_margin_seconds
from .periodic import Periodic
from .reporting import CompletionReporter
from .sandbox import Sandbox
from .watchdog import Watchdog

log = logging.getLogger(__name__)

CLAIM_JOB = "claim"
BEAT_JOB = "runner"
DRAIN_DEADLINE_JOB = "drain-deadline"


def default_runner_name() -> str:
    """``hostname:pid``, the runner name when none is given."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Scheduler:
    """One scheduler's moving parts; ``run`` drives it, and in-process tests use it directly.

    Args:
        settings: intervals, lease and backoff (seconds).
        database_url: the PostgreSQL to use.
        pools: pool names this runner serves.
        slots: how many jobs it runs at once.
        name: runner name (default ``hostname:pid``).
        kill_grace_seconds: between SIGTERM and SIGKILL when a job's command is stopped.
        max_batch: most builds claimed, and most outcomes reported, in one transaction
            (``--max-batch``, default 10; 1: one job per transaction). See claiming.py and
            reporting.CompletionReporter.
        listen: also wake the claim job when a job of its pools becomes claimable (LISTEN,
            sql.scheduling.listen_for_work; ``--no-listen`` turns it off). Polling every
            claim interval stays either way.
        listen_url: where the listener connects (``--listen-url``): a session route, direct
            to PostgreSQL or a pooler database in session mode, while everything else goes
            to ``database_url``. When None the listener uses ``database_url``, unless that
            goes through a pooler: then it does not listen (one warning; see
            listen_for_work), since behind transaction pooling a LISTEN hears nothing.
        sandbox: how jobs' commands are started (sandbox.Sandbox: ``--run-as``, the
            environment's allow-list); default: as this process's user.
        on_claimed(claim), on_started(claim, pid), on_completed(ExecutionResult): test
            signals, called from worker threads (River-style): wait on them instead of
            sleeping. on_completed is called for every claim, reported or not.
    Raises:
        InvalidInput: ``max_batch`` outside 1..1000, or a ``listen_url`` libpq cannot parse.
    """

    def __init__(self, settings: Settings, *, database_url: str, pools: list[str], slots: int,
                 name: str | None = None, kill_grace_seconds: float = 5.0,
                 max_batch: int = DEFAULT_MAX_BATCH, listen: bool = True,
                 listen_url: str | None = None, sandbox: Sandbox | None = None,
                 on_claimed: Callable[[Claim], None] | None = None,
                 on_started: Callable[[Claim, int], None] | None = None,
                 on_completed: Callable[[ExecutionResult], None] | None = None):
        self.settings = settings
        self.database_url = database_url
        self.pools = list(pools)
        self.slots = slots
        self.name = name or default_runner_name()
        self.kill_grace_seconds = kill_grace_seconds
        self.max_batch = check_max_batch(max_batch)
        self.listen = listen
        self.listen_url = check_listen_url(listen_url) if listen_url else None
        self.sandbox = sandbox or Sandbox(env_allow=tuple(settings.job_env_allow))
        self.on_claimed = on_claimed
        self.on_started = on_started
        self.on_completed = on_completed
        self.runner_id: int | None = None
        self.pool_ids: list[int] = []
        self._db = None
        self._aps: BackgroundScheduler | None = None
        self._claimer: Claimer | None = None
        self._waker: ClaimWaker | None = None
        self._heartbeats: HeartbeatSender | None = None
        self._reporter: CompletionReporter | None = None
        self._active: dict[int, Execution] = {}  # attempt id -> execution
        self._watchdog: Watchdog | None = None
        self._changed = threading.Condition()
        self._is_draining = False
        # an operator's drain, as the last beat said it (None: not drained), and the
        # monotonic time its deadline passes (None: no deadline)
        self._drain: dict | None = None
        self._drain_deadline: float | None = None
        self._is_closed = False
        # Held while a beat moves its own APScheduler job, and while stop() marks the
        # scheduler closed: APScheduler's shutdown(wait=True) holds its job-store lock while
        # it waits for running jobs, so a beat job calling modify_job once shutdown began
        # would wait for that lock forever, and shutdown for the beat.
        self._reschedule_lock = threading.Lock()
        self._listener: threading.Thread | None = None
        self._listener_stop = threading.Event()
        self._duties: Duties | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, *, stop_event: threading.Event | None = None) -> bool:
        """Register the runner row and start the periodic jobs.

        While the database is unreachable, registration is retried with backoff until it
        succeeds or ``stop_event`` is set. Returns False when stopped before registering.

        Raises:
            NotFound: a pool name is unknown. InvalidInput: bad slots or name.
        """
        stop_event = stop_event or threading.Event()
        # Guards jobs against this process being frozen or killed (scheduler/watchdog.py):
        # it acts a tenth of a lease (at most 1 s) before the lease could lapse.
        self._watchdog = Watchdog(margin_seconds=fence_margin_seconds(self.settings.lease_seconds))
        self._db = make_scheduler_pool(
            self.database_url, slots=self.slots,
            statement_deadline_seconds=self.settings.statement_deadline_seconds,
            prepare_threshold=self.settings.prepare_threshold)
        try:
            if not self._register(stop_event):
                self._db.close()
                self._db = None
                self._close_watchdog()
                return False
        except BaseException:
            self._db.close()
            self._db = None
            self._close_watchdog()
            raise
        s = self.settings
        self._duties = Duties(self._db, s, runner_id=self.runner_id,
                              is_draining=lambda: self._is_draining,
                              reschedule=self._reschedule_beat, on_answer=self._learn_drain)
        try:  # take the lapsed duties now, so that the duty jobs' first runs do them
            self._duties.beat()
        except Exception as exc:  # DatabaseUnavailable and kin: the beat job retries
            log.warning("first runner beat failed: %s", exc)
        self._reporter = CompletionReporter(self._db, s, max_batch=self.max_batch)
        # one thread beats for every running job, those due together in one transaction
        self._heartbeats = HeartbeatSender(self._db, s)
        self._heartbeats.start()
        self._claimer = Claimer(self._db, s, runner_id=self.runner_id, pool_ids=self.pool_ids,
                                free_slots=self.free_slots, launch=self._launch,
                                is_draining=self.is_claiming_stopped, max_batch=self.max_batch,
                                is_running=lambda: self.free_slots() < self.slots)
        # wake-ups claim on a thread of their own: an APScheduler job run per wake-up cost a
        # tenth of the scheduler's CPU at 100 jobs/s (bench/e2e.py, throughput)
        self._waker = ClaimWaker(self._claimer.fill, free_slots=self.free_slots,
                                 batch_slots=min(self.slots, self.max_batch + 1),
                                 coalesce_seconds=s.claim_coalesce_seconds)
        self._waker.start()
        aps = BackgroundScheduler(
            timezone=dt.timezone.utc, executors={"default": ThreadPoolExecutor(max_workers=8)},
            job_defaults={"coalesce": True, "misfire_grace_time": None})
        now = dt.datetime.now(dt.timezone.utc)
        # Overlapping runs return at once (Periodic, Claimer.fill), so a slow run during an
        # outage never makes APScheduler skip-and-warn. A claim wake-up while a fill runs
        # makes that fill go round again instead of being dropped.
        jobs = [
            (CLAIM_JOB, Periodic("claim", self._claimer.poll, is_exclusive=False),
             s.claim_interval_seconds, now),
            ("expire", Periodic("expire", lambda: expiry.run_expiry(
                self._db, s, self._duties, runner_id=self.runner_id, pool_ids=self.pool_ids)),
             s.expire_interval_seconds, now),
            ("summarize", Periodic("summarize", self._run_summaries),
             s.summary_interval_seconds, now),
            ("cleanup", Periodic("cleanup", self._run_cleanup), CLEANUP_INTERVAL_SECONDS, now),
            # its next run is moved by each beat (Duties.next_beat_delay)
            (BEAT_JOB, Periodic("runner keep-alive", self._duties.beat), s.runner_beat_seconds,
             now),
        ]
        for job_id, fn, seconds, first_run in jobs:
            kwargs = {"next_run_time": first_run} if first_run is not None else {}
            aps.add_job(fn, "interval", id=job_id, name=job_id, seconds=seconds,
                        max_instances=4, **kwargs)
        self._aps = aps  # before start: the first beat reschedules itself through it
        aps.start()
        self._arm_drain_deadline()  # drained before it started: the first beat said so
        if self.listen:
            self._listener = threading.Thread(
                target=listen_for_work, name="wakeup-listener", daemon=True,
                args=(self.listen_url or self.database_url, self.pool_ids, self.wake_claimer,
                      self._listener_stop),
                kwargs={"is_session_route": self.listen_url is not None,
                        "runner_id": self.runner_id})
            self._listener.start()
        log.info("scheduler %s (runner %d) serving %s with %d slots; lease %g s, heartbeat %g s, "
                 "batches of up to %d", self.name, self.runner_id, ", ".join(self.pools),
                 self.slots, s.lease_seconds, s.heartbeat_seconds, self.max_batch)
        return True

    def _register(self, stop_event: threading.Event) -> bool:
        delay = 0.2
        while not stop_event.is_set():
            try:
                with checkout(self._db) as conn:
                    self.runner_id = transitions.register_runner(
                        conn, name=self.name, pools=self.pools, slots=self.slots,
                        hostname=socket.gethostname(), pid=os.getpid())
                    self.pool_ids = runner_pool_ids(conn, runner_id=self.runner_id)
                return True
            except DatabaseUnavailable as exc:
                log.warning("cannot register the runner yet: %s; retrying in %.1f s", exc, delay)
                stop_event.wait(delay)
                delay = min(5.0, delay * 2)
        return False

    def stop(self, *, grace_seconds: float = 30.0, hurry: threading.Event | None = None) -> None:
        """Drain (see ``drain``), then stop the periodic jobs, mark the runner stopped and
        close the pool. Safe to call twice."""
        if self._is_closed:
            return
        self.drain(grace_seconds=grace_seconds, hurry=hurry)
        with self._reschedule_lock:
            self._is_closed = True
        self._listener_stop.set()
        if self._listener is not None:
            self._listener.join(timeout=5)
        if self._waker is not None:
            self._waker.stop()
            self._waker.join(timeout=5)
        if self._heartbeats is not None:  # drained: no job runs or reports any more
            self._heartbeats.stop()
            self._heartbeats.join(timeout=self.settings.heartbeat_seconds)
        if self._aps is not None:
            self._aps.shutdown(wait=True)
        if self.runner_id is not None:
            for try_no in range(3):
                try:
                    runner_row.stop(self._db, runner_id=self.runner_id)
                    break
                except Exception as exc:  # DatabaseUnavailable and kin
                    log.warning("could not mark runner %d stopped: %s", self.runner_id, exc)
                    time.sleep(0.5 * (try_no + 1))
        if self._db is not None:
            self._db.close()
        self._close_watchdog()
        log.info("scheduler %s stopped", self.name)

    def _close_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None

    def drain(self, *, grace_seconds: float = 30.0, hurry: threading.Event | None = None) -> None:
        """Stop claiming, mark the runner draining, and wait up to ``grace_seconds`` for the
        running jobs to end by themselves (less if ``hurry`` is set meanwhile); then stop
        the rest (builds handed back, deployments lost) and wait for their reports."""
        hurry = hurry or threading.Event()
        self._is_draining = True
        if self._aps is not None:
            try:
                self._aps.remove_job(CLAIM_JOB)
            except JobLookupError:
                pass
        if self._duties is not None:
            try:
                self._duties.beat()  # draining: gives up every duty held
            except Exception as exc:
                log.warning("could not mark runner %d draining: %s", self.runner_id, exc)
        n = len(self.running())
        if n:
            log.info("draining: waiting up to %g s for %d running job(s)", grace_seconds, n)
        deadline = time.monotonic() + grace_seconds
        self._wait_idle(deadline, hurry)
        if not self.running():
            return
        # Stop what is left. Reports are retried at most until each lease would expire.
        deadline = time.monotonic() + self.kill_grace_seconds + self.settings.lease_seconds + 2
        while self.running() and time.monotonic() < deadline:
            for e in self.running():
                e.request_stop(hurry=hurry.is_set())
            self._wait_idle(min(deadline, time.monotonic() + 0.2), None)
        for e in self.running():
            log.error("job %d attempt %d: abandoning its report", e.claim.job_id,
                      e.claim.attempt_no)
            e.abandon()
            e.join(2.0)

    def _wait_idle(self, deadline: float, hurry: threading.Event | None) -> None:
        with self._changed:
            while self._active and not (hurry is not None and hurry.is_set()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._changed.wait(min(remaining, 0.1))

    # -- slots -------------------------------------------------------------------------------

    def running(self) -> list[Execution]:
        """The executions in progress now."""
        with self._changed:
            return list(self._active.values())

    def free_slots(self) -> int:
        """How many more jobs this scheduler may start now."""
        with self._changed:
            return self.slots - len(self._active)

    def is_claiming_stopped(self) -> bool:
        """Whether this scheduler claims nothing now: it is shutting down, or an operator
        drained it (as its last beat said)."""
        return self._is_draining or self._drain is not None

    @property
    def operator_drain(self) -> dict | None:
        """The operator's drain of this runner as the last beat said it ({"drain_requested_at",
        "drain_requested_by", "drain_reason", "drain_deadline"}), or None."""
        return self._drain

    def _learn_drain(self, rows: list[dict]) -> None:
        """A beat's answer: start or end an operator's drain, and time its deadline."""
        row = rows[0] if rows else None
        if row is None or "drain_requested_at" not in row:
            return
        if row["drain_requested_at"] is None:
            if self._drain is not None:
                log.info("runner %d resumed by an operator: claiming again", self.runner_id)
                self._drain = None
                self._drain_deadline = None
                self._remove_job(DRAIN_DEADLINE_JOB)
                self.wake_claimer()
            return
        drain = {k: row[k] for k in ("drain_requested_at", "drain_requested_by", "drain_reason",
                                     "drain_deadline")}
        if drain == self._drain:
            return
        self._drain = drain
        if drain["drain_deadline"] is None:
            self._drain_deadline = None
            self._remove_job(DRAIN_DEADLINE_JOB)
            left = None
        else:
            left = max(0.0, (drain["drain_deadline"] - row["db_now"]).total_seconds())
            self._drain_deadline = time.monotonic() + left
            self._arm_drain_deadline()
        log.info("runner %d drained by %s (%s): claiming nothing, %d job(s) running%s",
                 self.runner_id, drain["drain_requested_by"], drain["drain_reason"],
                 len(self.running()),
                 "" if left is None else f"; builds handed back in {left:.0f} s")

    def _arm_drain_deadline(self) -> None:
        """Run _hand_back_builds when the drain's deadline passes (once the jobs run: the
        first beat comes before them, and start() arms it then)."""
        if self._drain_deadline is None or self._aps is None or self._is_closed:
            return
        left = max(0.0, self._drain_deadline - time.monotonic())
        self._aps.add_job(self._hand_back_builds, "date", id=DRAIN_DEADLINE_JOB,
                          name=DRAIN_DEADLINE_JOB, replace_existing=True,
                          run_date=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=left))

    def _is_past_drain_deadline(self) -> bool:
        return (self._drain is not None and self._drain_deadline is not None
                and time.monotonic() >= self._drain_deadline)

    def _hand_back_builds(self) -> None:
        """The drain's deadline passed: stop every running build (handed back, re-queued, no
        failure counted). Deployments go on: a drain never cuts one."""
        if not self._is_past_drain_deadline():
            return  # resumed meanwhile, or the deadline moved
        builds = [e for e in self.running() if not e.claim.is_deployment]
        if builds:
            log.info("drain deadline passed: handing back %d build(s)", len(builds))
        for e in builds:
            e.request_stop(why=f"runner drained by {self._drain['drain_requested_by']} "
                               f"({self._drain['drain_reason']}); handed back at its deadline")

    def _remove_job(self, job_id: str) -> None:
        if self._aps is None:
            return
        try:
            self._aps.remove_job(job_id)
        except JobLookupError:
            pass

    def wake_claimer(self, *, slot_freed: bool = False) -> None:
        """Run a claim round now instead of at the next poll: work is known to be waiting
        (a wake-up heard, or — ``slot_freed`` — a job ended while work was waiting: then the
        round may wait up to claim_coalesce_seconds for more slots to free, ClaimWaker).
        While an operator's drain holds, a wake-up (a resume's NOTIFY among them) asks for a
        beat now instead, which learns whether the drain still holds."""
        if self._is_draining or self._aps is None:
            return
        if self._drain is not None:
            self._reschedule_beat(0)
            return
        if self._claimer is not None:
            self._claimer.note_wakeup()  # back to fast polling (scheduler/claiming.py)
        if self._waker is not None:
            self._waker.wake(slot_freed=slot_freed)

    def _launch(self, claim: Claim, sent_at: float) -> None:
        execution = Execution(claim, pool=self._db, settings=self.settings, sent_at=sent_at,
                              kill_grace_seconds=self.kill_grace_seconds,
                              on_started=self.on_started, on_completed=self._completed,
                              watchdog=self._watchdog, reporter=self._reporter,
                              sandbox=self.sandbox, heartbeats=self._heartbeats)
        with self._changed:
            self._active[claim.attempt_id] = execution
            self._changed.notify_all()
        if self.on_claimed is not None:
            try:
                self.on_claimed(claim)
            except Exception:
                log.exception("on_claimed callback failed")
        execution.start()
        if self._is_draining:
            execution.request_stop()
        elif self._is_past_drain_deadline() and not claim.is_deployment:
            execution.request_stop(why="runner drained past its deadline; handed back")

    def _completed(self, result: ExecutionResult) -> None:
        with self._changed:
            self._active.pop(result.claim.attempt_id, None)
            self._changed.notify_all()
        # a freed slot claims at once only when work is known to be waiting; else the poll
        if self._claimer is not None and self._claimer.is_work_waiting():
            self.wake_claimer(slot_freed=True)
        if self.on_completed is not None:
            self.on_completed(result)

    def _reschedule_beat(self, delay_seconds: float) -> None:
        with self._reschedule_lock:
            if self._aps is None or self._is_closed:
                # the first beat, before the jobs start (the beat job's first run is now), or
                # stopping: no more beats, and shutdown must not wait for this one
                return
            try:
                self._aps.modify_job(BEAT_JOB, next_run_time=dt.datetime.now(dt.timezone.utc)
                                     + dt.timedelta(seconds=delay_seconds))
            except Exception:  # JobLookupError: the job is gone
                pass

    def _run_summaries(self) -> None:
        term = self._duties.term("summaries")
        if term is not None and not summaries.refresh_queue_summary(
                self._db, runner_id=self.runner_id, term=term,
                live_seconds=self.settings.lease_seconds):
            self._duties.lost("summaries", term)

    def _run_cleanup(self) -> None:
        term = self._duties.term("cleanup")
        if term is None:
            return
        done = runner_row.cleanup(self._db, runner_id=self.runner_id, term=term)
        if done is None:
            self._duties.lost("cleanup", term)
        elif done["lost"]:
            log.warning("runners %s not beaten for a while: marked lost",
                        ", ".join(map(str, done["lost"])))


def _install_signal_handlers(stop_event: threading.Event,
                             hurry: threading.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT: the first sets ``stop_event``, the next sets ``hurry``. Only in the
    main thread (Python delivers signals there). Returns a function restoring the old ones."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_signal(signum, frame):
        # No logging here: the handler may interrupt a thread holding the logging lock.
        if stop_event.is_set():
            hurry.set()
        else:
            stop_event.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return restore


def run(settings: Settings, *, database_url: str, pools: list[str], slots: int,
        name: str | None = None, grace_seconds: float = 30.0,
        max_batch: int = DEFAULT_MAX_BATCH, listen: bool = True,
        listen_url: str | None = None, stop_event: threading.Event | None = None,
        watch: Callable[[Scheduler], None] | None = None, sandbox: Sandbox | None = None) -> int:
    """Run a scheduler until SIGTERM/SIGINT (or ``stop_event``), then drain and stop.

    Registers the runner row (``name``, default ``hostname:pid``) for ``pools`` with
    ``slots`` slots, claims and runs jobs, and on stop waits up to ``grace_seconds`` for
    running jobs before handing them back (see the module docstring). Signal handlers are
    installed only when called from the main thread. ``watch(scheduler)`` is called before
    it starts (``pgdispatch.scheduler.metrics.Exporter.watch``: this process's metrics endpoint).
    ``max_batch``: most builds claimed, and most outcomes reported, in one transaction
    (1 turns batching off). ``listen``: wake on NOTIFY as well as polling; ``listen_url``:
    the session route the listener uses (see Scheduler). ``sandbox``: how jobs are started;
    default ``sandbox.from_settings(settings, slots=slots)`` (``settings.run_as``, checked
    first).

    Returns:
        0, the process exit code, once stopped.
    Raises:
        NotFound: a pool name is unknown. InvalidInput: bad slots, name, max_batch or
        listen_url, or a run_as user this process cannot run jobs as. (Nothing is then
        written.)
    """
    if logging.getLogger("apscheduler").level == logging.NOTSET:
        # APScheduler logs every run of every job at INFO: several lines a second here.
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
    if sandbox is None:
        sandbox = sandboxes.from_settings(settings, slots=slots)
    stop_event = stop_event if stop_event is not None else threading.Event()
    hurry = threading.Event()
    restore = _install_signal_handlers(stop_event, hurry)
    try:
        scheduler = Scheduler(settings, database_url=database_url, pools=pools, slots=slots,
                              name=name, max_batch=max_batch, listen=listen,
                              listen_url=listen_url, sandbox=sandbox)
        if watch is not None:
            watch(scheduler)
        if not scheduler.start(stop_event=stop_event):
            return 0
        try:
            # A timed wait, so the main thread runs signal handlers promptly.
            while not stop_event.wait(0.5):
                pass
            log.info("stop requested; draining (grace %g s)", grace_seconds)
        finally:
            scheduler.stop(grace_seconds=grace_seconds, hurry=hurry)
        return 0
    finally:
        restore()
