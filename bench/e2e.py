"""End to end through the real scheduler process: dispatch latency by the way a job becomes
ready, throughput of real ``true`` commands beside this machine's own spawn ceiling, and the
scheduler's CPU while it looks after many long jobs (issue 21, item 4).

Run it from the repository root::

    python -m bench e2e                  # about 30 minutes, most of it slot_freed's idle
                                         # samples waiting for a poll (below)
    python -m bench e2e --quick          # about 8 minutes: 20 rounds, shorter windows
    python -m bench e2e [--parts latency,throughput,cpu] [--ways submit,dependency,...]
                        [--slots 8] [--samples 100] [--gap-seconds 0.1,0.3]
                        [--load-fraction 0.5] [--load-job-seconds 0.5]
                        [--throughput-jobs 2000] [--repeats 3] [--stats-wait-seconds 11]
                        [--long-jobs 100] [--long-seconds 600] [--settle-seconds 10]
                        [--window-seconds 60] [--sample-timeout-seconds 60]
                        [--set PGDISPATCH_NAME=VALUE ...] [--seed 1] [--out FILE.json]

One server for the invocation (``bench.common.bench_server``: an embedded PostgreSQL in a
temporary directory, or ``DATABASE_URL``'s, whose role must be able to create databases);
each part gets a fresh copy of a migrated template and its own scheduler: the product's CLI,
``python -m pgdispatch scheduler --pool bench --pool side --slots S --name e2e-<part>
--grace-seconds 5``, a process of its own with ``DATABASE_URL`` set to the part's database,
LISTEN/NOTIFY on (the default), every other setting the product's default unless the bench's
environment or ``--set`` gives a ``PGDISPATCH_*`` value (recorded in the JSON). A part starts
once the runner is registered and its wake-up listener has registered its session
(``runners.listen_pid``). Jobs run as the scheduler's own user: with ``--set
PGDISPATCH_RUN_AS=...`` (the bench run as root) they run sandboxed, which adds the sweep of
/proc after every job (scheduler/sandbox.py) to what is measured.

**Clocks.** Every timestamp is CLOCK_REALTIME on this one machine: the bench's
``time.time()``, PostgreSQL's ``clock_timestamp()`` (gettimeofday), and the job's own
``date +%s.%N`` (clock_gettime(CLOCK_REALTIME)). Latencies are in milliseconds.

**Latency** (part ``latency``). A measured job's command is ``date +%s.%N``, with no shell:
its first act is to read the clock, and it prints it; the scheduler captures the output and
reports it with the outcome (``attempts.output_tail``). So the *start* is the moment the
command's own process runs, after the scheduler's fork and exec and the ``date`` binary's
start-up (the *command floor*, measured alone: a bare ``subprocess.Popen`` of the same
command with the scheduler's arguments, from the call to the clock the command prints;
p50 about 0.7 ms here). The *ready* moment, for each way a job becomes ready:

* ``submit`` — ``transitions.submit`` of the job, in a transaction the bench commits: the
  bench's clock just before COMMIT is sent;
* ``approval`` — a job submitted with ``requires_approval`` (blocked), a pause of
  U(``--gap-seconds``), then ``transitions.approve_job``: the clock before its COMMIT;
* ``resume_project`` — a job submitted into the paused project ``paused``, a pause, then
  ``transitions.resume_project`` (the project paused again afterwards): before its COMMIT;
* ``resume_pool`` — the same with the paused pool ``side`` (``transitions.resume_pool``);
* ``dependency`` — a job depending on a ``true`` job, both submitted at once: the
  predecessor's ``attempts.finished_at``, the ``clock_timestamp()`` of the completing
  transaction's last statement (sql/functions/complete.sql: after releasing the dependents
  and its slots), just before the scheduler commits it;
* ``slot_freed`` — in project ``bound`` (``max_running = 1``): a blocker ``sleep
  BLOCKER_SECONDS`` runs, then the measured job is submitted and waits on the project's
  bound; ready when the blocker's completion commits (its ``attempts.finished_at``, as above);
* ``runner_full`` (idle only) — S blockers fill every slot of the scheduler (project
  ``fill``), then the measured job is submitted and waits for a slot; ready at the first
  blocker's ``attempts.finished_at``.

Both ends bound the commit from before, so each latency includes the ready transaction's
commit (its WAL flush; the client-side commits' round trip is saved as ``commit_ms``): an
upper bound. Reported per way: p50, p95, p99 (nearest rank) and max of ready → start, and
the p50 of its two legs, ready → ``attempts.claimed_at`` (the claim's clock after its
reservations) and claimed → start. Each round takes every way once, in a shuffled order, with
a pause of U(``--gap-seconds``) before each sample, so the scheduler is idle when the job
becomes ready; the first round is a warm-up, not counted. Two conditions, one after the
other on one scheduler:

* ``idle`` — nothing else runs;
* ``load`` — a second process submits ``sleep --load-job-seconds`` jobs to project ``load``
  one per transaction, Poisson arrivals at ``--load-fraction`` x S / job seconds per
  second, so that on average that fraction of the S slots is busy (the achieved mean is
  reported, from the load jobs' attempts). ``runner_full`` is left out: the load's own
  jobs come and go in the slots it needs full. Poisson arrivals fill all S slots now and
  then (at half of 8 slots busy on average, about 5 % of the time): a measured job that
  becomes ready then cannot be claimed by this runner until a slot frees, as in
  ``runner_full``. So each load sample also gets a *dispatchable* moment (``dispatchable``):
  the later of its ready moment and the last time before its claim that the runner went
  from all S slots held to one free (an ``attempts.finished_at``). Counted as holding a
  slot: the runner's attempts running at the ready moment, and those claimed after it for
  jobs ready before it (ahead of it in the queue); a job that became ready after it and was
  claimed first is not counted, so that wait stays the measured job's. Reported beside
  ready → start: how many samples met a full runner (their dispatchable moment later than
  the ready one; ``held_slots``: the slots held at the ready moment), and p50/p95/p99/max
  from the dispatchable moment, on which the target is judged
  (for a sample that never met a full runner the two are the same).

**Throughput** (part ``throughput``). ``--throughput-jobs`` queued ``true`` jobs inserted in
one statement (as pgd_submit writes them; the product's trigger notifies), the scheduler
(S slots) idle beforehand; jobs/s = jobs / (the last attempt's ``finished_at`` - the clock
before the insert's COMMIT). Beside it, in the bench process, the same number of ``true``
processes at the same concurrency S: ``posix_spawn`` (one thread: ``os.posix_spawn`` with
a new session, stdio on /dev/null, ``os.waitpid(-1)`` reaping any, a new one started for
each reaped: this machine's spawn ceiling from Python) and ``popen`` (S threads, each
``subprocess.Popen`` with the scheduler's arguments: new session, output on a pipe read to
its end, ``close_fds``, the job's working directory and a small environment). A warm-up
batch of 2 x S jobs first; then ``--repeats`` rounds of the three, the first rotating each
round; medians (min-max beside them) and the ratio of the scheduler's median to each bare
loop's (the target: >= 0.8 of the ceiling). Beside the scheduler's jobs/s, where its time
goes, in ms of CPU per job: the scheduler process's own (every thread), its commands' (its
reaped children), the server's (the postmaster and its children, when it runs here); and,
when the bench may set ``track_functions`` (a superuser), calls per job of the claim,
complete, heartbeat and wake-up functions and the five of most self time
(``pg_stat_user_functions``, read ``--stats-wait-seconds`` after the runs, once the
scheduler's idle sessions have reported; self time includes waiting for locks and a CPU).

**CPU per long job** (part ``cpu``). A scheduler with ``--long-jobs`` slots; that many
``sleep --long-seconds`` jobs inserted at once; once every one runs (its attempt running and
its ``sleep`` process a child of the scheduler) and ``--settle-seconds`` passed, CPU over
``--window-seconds``: utime + stime (/proc/PID/stat) of the scheduler (all its threads),
its reaped children, and every descendant that is not a job's command (its watchdog,
scheduler/watchdog.py); the ``sleep`` processes are left out. Reported: CPU seconds, % of
one core for all the jobs (the target: <= 1 % for 100; for another count, 0.01 % a job),
% per job, the scheduler's threads, resident memory and database connections, and the
server's CPU over the same window. Checked: every job still running at the window's end.
Then every job is cancelled (``transitions.cancel_job``; the runner learns it at its next
heartbeat, so the time until the last attempt ended is reported), the scheduler stopped
(SIGTERM), and no ``sleep`` of the part may be left (one left is killed by its pid and fails
the run).

Output: markdown tables on stdout, and ``bench/results/e2e-<UTC timestamp>.json``
(gitignored; ``--out`` elsewhere): the command, machine, server and scheduler settings, every
sample (ms) and the summaries. Exit status 1 when a part failed (a job not dispatched within
``--sample-timeout-seconds``, a check above), 2 for bad arguments. On a shared machine the
figures are noisy: say what else ran.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import multiprocessing
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pgdispatch.sql import PgDispatchError, Settings, config, db, transitions

from .common import (INSERT_QUEUED_JOBS, POOL, RESULTS_DIR, ROOT, bench_server, database_name,
                     git_commit, machine, percentile, scratch_database, server_settings,
                     template_database)

PARTS = ("latency", "throughput", "cpu")
# the ways a job becomes ready, in the tables' order; the load condition leaves the last out
TRIGGERS = ("submit", "dependency", "approval", "resume_project", "resume_pool", "slot_freed",
            "runner_full")
LOAD_TRIGGERS = TRIGGERS[:-1]
SIDE_POOL = "side"
# the measured job: its first act reads CLOCK_REALTIME, and it prints it
FIRST_ACT = ("date", "+%s.%N")
BLOCKER_SECONDS = 0.2
TARGET_P99_MS = 50.0
TARGET_RATIO = 0.8
TARGET_CPU_PERCENT = 1.0
# set by the bench for its schedulers, never passed through
OWN_VARIABLES = ("PGDISPATCH_DATA_DIR", "PGDISPATCH_LISTEN", "PGDISPATCH_LISTEN_URL")
POLL_SECONDS = 0.02
CLK_TCK = os.sysconf("SC_CLK_TCK")
ACTOR = "bench-e2e"
# ``jobs`` queued jobs running ``command`` in one project, as common.INSERT_QUEUED_JOBS writes
# its no-op ones (bench set-up; the product's trigger notifies)
INSERT_COMMAND_JOBS = """
INSERT INTO jobs (project_id, pool_id, state, command, submitted_by)
SELECT %(project_id)s, %(pool_id)s, 'queued', %(command)s::text[], 'bench'
  FROM generate_series(1, %(jobs)s::bigint)
"""


def config_text(slots: int) -> str:
    """The apply file: limits that never bind but the ones a way of becoming ready needs
    (project ``bound``; the runner's own slots for ``runner_full``)."""
    free = 100_000
    lines = ["[[organizations]]", 'name = "bench"', f"max_running = {free}",
             "[[pools]]", f'name = "{POOL}"', f"slots = {free}",
             "[[pools]]", f'name = "{SIDE_POOL}"', f"slots = {free}"]
    for name, pools, bound in (("m", [POOL, SIDE_POOL], None), ("paused", [POOL], None),
                               ("bound", [POOL], 1), ("fill", [POOL], None), ("load", [POOL], None)):
        lines += ["[[projects]]", f'name = "{name}"', 'organization = "bench"',
                  f"pools = {json.dumps(pools)}"]
        if bound is not None:
            lines.append(f"max_running = {bound}")
    return "\n".join(lines) + "\n"


# --- the scheduler process ----------------------------------------------------------------------


def passed_settings(overrides: Sequence[str]) -> dict[str, str]:
    """PGDISPATCH_* of the bench's environment and each ``--set NAME=VALUE``.

    Raises: ValueError naming the bad item."""
    out = {k: v for k, v in os.environ.items()
           if k.startswith("PGDISPATCH_") and k not in OWN_VARIABLES}
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("PGDISPATCH_") or name in OWN_VARIABLES:
            raise ValueError(f"--set {item!r}: want PGDISPATCH_NAME=VALUE "
                             f"(not {', '.join(OWN_VARIABLES)})")
        out[name] = value
    return out


@dataclasses.dataclass
class Scheduler:
    """One real scheduler process and what the bench knows of it."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    runner_id: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait, SIGKILL when it will not stop; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        return self.proc.returncode


@contextlib.contextmanager
def running_scheduler(url: str, watch, *, name: str, slots: int, settings: dict[str, str],
                      folder: Path, timeout_s: float = 90.0):
    """Start the product's scheduler on ``url`` and wait until it is registered and its
    listener's session is on the runner row; yields the Scheduler, stops it afterwards.

    Raises: RuntimeError (with its log's tail) when it exits or is not ready in time."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PGDISPATCH_") and k != "DATABASE_URL"}
    env.update(settings, DATABASE_URL=url, PGDISPATCH_DATA_DIR=str(folder / "data"))
    log_path = folder / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pgdispatch", "scheduler", "--pool", POOL, "--pool", SIDE_POOL,
             "--slots", str(slots), "--name", name, "--grace-seconds", "5"],
            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    sched = Scheduler(name, proc, log_path)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            row = watch.execute("SELECT id, listen_pid FROM runners WHERE name = %s "
                                "AND stopped_at IS NULL", (name,)).fetchone()
            if row and row["listen_pid"] is not None:
                sched.runner_id = row["id"]
                break
            if proc.poll() is not None:
                raise RuntimeError(f"scheduler {name} exited ({proc.returncode}):\n{sched.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"scheduler {name} not listening after {timeout_s:g} s:\n"
                                   f"{sched.log_tail()}")
            time.sleep(0.1)
        yield sched
    finally:
        code = sched.stop()
        if code not in (0, None):
            print(f"    scheduler {name} exited {code}:\n{sched.log_tail(600)}", flush=True)


# --- reading the database ----------------------------------------------------------------------

ATTEMPT = """
SELECT a.state, extract(epoch FROM a.claimed_at)::float8 AS claimed,
       extract(epoch FROM a.finished_at)::float8 AS finished, a.output_tail, a.error
  FROM attempts a WHERE a.job_id = %s ORDER BY a.attempt_no LIMIT 1
"""


def wait_attempt(watch, job_id: int, *, timeout_s: float, finished: bool = True,
                 sched: Scheduler | None = None) -> dict[str, Any]:
    """The first attempt of ``job_id`` once it exists (``finished``: once it has ended).

    Raises: RuntimeError when it does not come in ``timeout_s`` (or the scheduler died)."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = watch.execute(ATTEMPT, (job_id,)).fetchone()
        if row is not None and (not finished or row["finished"] is not None):
            return row
        if sched is not None and sched.proc.poll() is not None:
            raise RuntimeError(f"scheduler exited ({sched.proc.returncode}):\n{sched.log_tail()}")
        if time.monotonic() > deadline:
            state = watch.execute("SELECT state FROM jobs WHERE id = %s", (job_id,)).fetchone()
            raise RuntimeError(f"job {job_id} ({state['state'] if state else '?'}) "
                               f"{'not finished' if finished else 'not claimed'} in {timeout_s:g} s")
        time.sleep(POLL_SECONDS)


def first_act(row: dict[str, Any], job_id: int) -> float:
    """The clock the measured job printed (epoch seconds).

    Raises: RuntimeError when it did not succeed or printed no clock."""
    if row["state"] != "succeeded":
        raise RuntimeError(f"measured job {job_id} {row['state']}: {row['error']}")
    try:
        return float((row["output_tail"] or "").split()[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"measured job {job_id} printed no clock: {row['output_tail']!r}") from None


# --- part 1: latency ------------------------------------------------------------------------------


@dataclasses.dataclass
class Lab:
    """What a latency sample needs: the bench's two sessions, the scheduler, the sizes."""

    act: Any      # the session that submits and acts, as a CI system or an operator would
    watch: Any    # the session that reads the outcome
    sched: Scheduler
    slots: int
    gap: tuple[float, float]
    timeout_s: float
    rng: random.Random

    def pause(self) -> None:
        time.sleep(self.rng.uniform(*self.gap))

    def committed(self, fn: Callable[[Any], Any]) -> tuple[Any, float, float]:
        """``fn(act)`` in one transaction; (its result, the clock just before COMMIT was
        sent, the COMMIT's round trip in ms)."""
        with self.act.transaction():
            out = fn(self.act)
            ready = time.time()
        return out, ready, (time.time() - ready) * 1000.0

    def submit(self, project: str, command: Sequence[str], *, pool: str = POOL,
               **kwargs: Any) -> int:
        return transitions.submit(self.act, project=project, pool=pool, command=list(command),
                                  submitted_by=ACTOR, **kwargs)["id"]

    def observe(self, job_id: int) -> dict[str, Any]:
        """The measured job's attempt once ended: claimed (epoch s) and its first act."""
        row = wait_attempt(self.watch, job_id, timeout_s=self.timeout_s, sched=self.sched)
        return {"job_id": job_id, "claimed": row["claimed"], "start": first_act(row, job_id)}

    def finished_at(self, job_id: int) -> float:
        return wait_attempt(self.watch, job_id, timeout_s=self.timeout_s, sched=self.sched)["finished"]


def sample_submit(lab: Lab) -> dict[str, Any]:
    lab.pause()
    job, ready, commit_ms = lab.committed(
        lambda c: transitions.submit(c, project="m", pool=POOL, command=list(FIRST_ACT),
                                     submitted_by=ACTOR))
    return lab.observe(job["id"]) | {"ready": ready, "commit_ms": commit_ms}


def sample_dependency(lab: Lab) -> dict[str, Any]:
    lab.pause()
    with lab.act.transaction():
        first = lab.submit("m", ["true"])
        job = lab.submit("m", FIRST_ACT, depends_on=[first])
    seen = lab.observe(job)
    return seen | {"ready": lab.finished_at(first)}


def sample_approval(lab: Lab) -> dict[str, Any]:
    job = lab.submit("m", FIRST_ACT, requires_approval=True)
    lab.pause()
    _, ready, commit_ms = lab.committed(
        lambda c: transitions.approve_job(c, job_id=job, actor=ACTOR))
    return lab.observe(job) | {"ready": ready, "commit_ms": commit_ms}


def sample_resume_project(lab: Lab) -> dict[str, Any]:
    job = lab.submit("paused", FIRST_ACT)
    lab.pause()
    _, ready, commit_ms = lab.committed(
        lambda c: transitions.resume_project(c, project="paused", actor=ACTOR))
    try:
        return lab.observe(job) | {"ready": ready, "commit_ms": commit_ms}
    finally:
        transitions.pause_project(lab.act, project="paused", reason="bench: between samples",
                                  actor=ACTOR)


def sample_resume_pool(lab: Lab) -> dict[str, Any]:
    job = lab.submit("m", FIRST_ACT, pool=SIDE_POOL)
    lab.pause()
    _, ready, commit_ms = lab.committed(
        lambda c: transitions.resume_pool(c, pool=SIDE_POOL, actor=ACTOR))
    try:
        return lab.observe(job) | {"ready": ready, "commit_ms": commit_ms}
    finally:
        transitions.pause_pool(lab.act, pool=SIDE_POOL, reason="bench: between samples",
                               actor=ACTOR)


def sample_slot_freed(lab: Lab) -> dict[str, Any]:
    lab.pause()
    blocker = lab.submit("bound", ["sleep", f"{BLOCKER_SECONDS:g}"])
    wait_attempt(lab.watch, blocker, timeout_s=lab.timeout_s, finished=False, sched=lab.sched)
    job = lab.submit("bound", FIRST_ACT)
    seen = lab.observe(job)
    ready = lab.finished_at(blocker)
    if seen["claimed"] < ready:
        raise RuntimeError(f"job {job} claimed before project bound's blocker {blocker} ended")
    return seen | {"ready": ready}


def sample_runner_full(lab: Lab) -> dict[str, Any]:
    lab.pause()
    with lab.act.transaction():
        blockers = [lab.submit("fill", ["sleep", f"{BLOCKER_SECONDS * 1.5:g}"])
                    for _ in range(lab.slots)]
    for b in blockers:
        wait_attempt(lab.watch, b, timeout_s=lab.timeout_s, finished=False, sched=lab.sched)
    job = lab.submit("m", FIRST_ACT)
    seen = lab.observe(job)
    ready = min(lab.finished_at(b) for b in blockers)
    if seen["claimed"] < ready:
        raise RuntimeError(f"job {job} claimed while all {lab.slots} slots ran blockers")
    return seen | {"ready": ready}


SAMPLES: dict[str, Callable[[Lab], dict[str, Any]]] = {
    "submit": sample_submit, "dependency": sample_dependency, "approval": sample_approval,
    "resume_project": sample_resume_project, "resume_pool": sample_resume_pool,
    "slot_freed": sample_slot_freed, "runner_full": sample_runner_full}


def load_worker(url: str, rate_per_s: float, job_seconds: float, seed: int, stop, submitted) -> None:
    """The background load (a process of its own): ``sleep job_seconds`` jobs to project
    ``load``, one per transaction, Poisson arrivals at ``rate_per_s`` on a fixed timeline."""
    rng = random.Random(seed)
    with db.connect(url, application_name="bench-e2e-load") as conn:
        due = time.monotonic()
        while not stop.is_set():
            due += rng.expovariate(rate_per_s)
            if stop.wait(max(0.0, due - time.monotonic())):
                break
            transitions.submit(conn, project="load", pool=POOL,
                               command=["sleep", f"{job_seconds:g}"], submitted_by="bench-e2e-load")
            with submitted.get_lock():
                submitted.value += 1


@contextlib.contextmanager
def background_load(url: str, *, rate_per_s: float, job_seconds: float, seed: int):
    """Run ``load_worker`` in a spawned process while the block runs; yields a dict that is
    filled afterwards with the jobs submitted and the seconds it ran."""
    ctx = multiprocessing.get_context("spawn")
    stop, submitted = ctx.Event(), ctx.Value("l", 0)
    proc = ctx.Process(target=load_worker, args=(url, rate_per_s, job_seconds, seed, stop, submitted),
                       name="bench-e2e-load", daemon=True)
    out: dict[str, Any] = {}
    proc.start()
    started = time.time()
    try:
        yield out
    finally:
        stop.set()
        proc.join(15)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        out.update(submitted=submitted.value, started=started, ended=time.time(),
                   exit_code=proc.exitcode)


# a load sample's runner around its wait: its other attempts still running at the ready
# moment or claimed before the sample's claim (seconds since the epoch; dispatchable_at)
RUNNER_AROUND = """
SELECT extract(epoch FROM a.claimed_at)::float8 AS claimed,
       extract(epoch FROM a.finished_at)::float8 AS finished,
       extract(epoch FROM j.ready_at)::float8 AS ready_at
  FROM attempts a JOIN jobs j ON j.id = a.job_id
 WHERE a.runner_id = %(runner_id)s AND a.job_id <> %(job_id)s
   AND a.claimed_at < to_timestamp(%(claimed)s)
   AND coalesce(a.finished_at, 'infinity') > to_timestamp(%(ready)s)
"""


def dispatchable_at(sample: dict[str, Any], others: Sequence[dict[str, Any]],
                    slots: int) -> tuple[int, float]:
    """(slots held at the sample's ready moment, its dispatchable moment: the module
    docstring) from ``others``, RUNNER_AROUND's rows; times in seconds since the epoch."""
    ready, claimed = sample["ready"], sample["claimed"]
    held = 0
    events: list[tuple[float, int]] = []
    for o in others:
        if o["claimed"] <= ready:
            held += 1  # running at the ready moment
        elif o["ready_at"] is not None and o["ready_at"] <= ready:
            events.append((o["claimed"], 1))  # ahead of it in the queue
        else:
            continue  # ready after it, claimed before it: its slot stays the sample's wait
        if o["finished"] is not None and o["finished"] < claimed:
            events.append((o["finished"], -1))
    at, count = ready, held
    for t, step in sorted(events, key=lambda e: (e[0], -e[1])):
        if step < 0 and count >= slots > count + step:
            at = max(at, t)  # the runner had a slot again
        count += step
    return held, at


# dispatchable_at's cases (slots 2; each attempt (claimed, finished, its job's ready_at); the
# answer (held at ready, dispatchable)): checked by every latency run, the smoke run's too,
# since the target under load is judged from that moment
DISPATCHABLE_CASES = (
    # full at the ready moment: until a slot frees
    ((10.0, 16.0), ((9.0, 15.0, 8.0), (9.5, 30.0, 8.0)), (2, 15.0)),
    # a free slot taken by a job queued ahead of it: until that one ends
    ((10.0, 14.5), ((9.0, 30.0, 8.0), (11.0, 14.0, 9.5)), (1, 14.0)),
    # ... by a job ready after it: the sample's own wait
    ((10.0, 14.5), ((9.0, 30.0, 8.0), (11.0, 14.0, 10.5)), (1, 10.0)),
    # never full
    ((10.0, 11.0), ((9.0, 10.5, 8.0), (10.6, None, 9.0)), (1, 10.0)),
    # full, room at 12, refilled by a job ahead at 12.5, room again at 15: the last one
    ((10.0, 15.5), ((9.0, 12.0, 8.0), (9.5, 15.0, 8.0), (12.5, None, 9.0)), (2, 15.0)),
)


def check_dispatchable() -> None:
    """Raise AssertionError when dispatchable_at answers a case of DISPATCHABLE_CASES wrong."""
    for (ready, claimed), others, want in DISPATCHABLE_CASES:
        got = dispatchable_at({"ready": ready, "claimed": claimed},
                              [{"claimed": c, "finished": f, "ready_at": r} for c, f, r in others], 2)
        assert got == want, f"dispatchable_at: {got} for {want} in {(ready, claimed), others}"


LOAD_SHAPE = """
SELECT count(*) AS jobs,
       coalesce(sum(extract(epoch FROM least(a.finished_at, to_timestamp(%(t1)s))
                             - greatest(a.claimed_at, to_timestamp(%(t0)s))))
                FILTER (WHERE a.claimed_at < to_timestamp(%(t1)s)
                          AND coalesce(a.finished_at, 'infinity') > to_timestamp(%(t0)s)), 0)::float8
           AS busy_seconds,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM a.claimed_at - j.ready_at))
           AS claim_wait_p50_s
  FROM jobs j JOIN projects p ON p.id = j.project_id AND p.name = 'load'
  JOIN attempts a ON a.job_id = j.id
"""


def command_floor(samples: int) -> list[float]:
    """ms from ``subprocess.Popen`` of FIRST_ACT, with the scheduler's arguments, to the
    clock it prints: what the command's own start costs, with no scheduler."""
    out = []
    with tempfile.TemporaryDirectory(prefix="pgd-bench-e2e-floor-") as cwd:
        for _ in range(samples):
            t0 = time.time()
            proc = subprocess.Popen(list(FIRST_ACT), start_new_session=True, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, close_fds=True,
                                    cwd=cwd, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
            text = proc.stdout.read()
            proc.wait()
            proc.stdout.close()
            out.append((float(text.split()[-1]) - t0) * 1000.0)
    return out


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p95/p99/max of ready → start (ms), and the p50 of each leg; for load samples
    (``dispatchable`` set: the module docstring) also how many found the runner full and
    p50/p95/p99/max from the dispatchable moment, on which the target is judged."""
    total = [(s["start"] - s["ready"]) * 1000.0 for s in samples]
    judged = total
    extra: dict[str, Any] = {}
    if samples and all("dispatchable" in s for s in samples):
        judged = [(s["start"] - s["dispatchable"]) * 1000.0 for s in samples]
        extra = {"runner_full_samples": sum(s["dispatchable"] > s["ready"] for s in samples),
                 "dispatch_p50_ms": percentile(judged, 50), "dispatch_p95_ms": percentile(judged, 95),
                 "dispatch_p99_ms": percentile(judged, 99), "dispatch_max_ms": max(judged)}
    to_claim = [(s["claimed"] - s["ready"]) * 1000.0 for s in samples]
    to_start = [(s["start"] - s["claimed"]) * 1000.0 for s in samples]
    commits = [s["commit_ms"] for s in samples if s.get("commit_ms") is not None]
    return {"samples": len(total), "p50_ms": percentile(total, 50), "p95_ms": percentile(total, 95),
            "p99_ms": percentile(total, 99), "max_ms": max(total) if total else None,
            "ready_to_claim_p50_ms": percentile(to_claim, 50),
            "claim_to_start_p50_ms": percentile(to_start, 50),
            "commit_p50_ms": percentile(commits, 50), **extra,
            "meets_target": None if not judged else percentile(judged, 99) <= TARGET_P99_MS}


def latency_condition(lab: Lab, triggers: Sequence[str], rounds: int) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` rounds (plus a warm-up) of every trigger in a shuffled order."""
    out: dict[str, list[dict[str, Any]]] = {t: [] for t in triggers}
    for r in range(rounds + 1):
        order = list(triggers)
        lab.rng.shuffle(order)
        for trigger in order:
            sample = SAMPLES[trigger](lab)
            if r:  # round 0 warms up
                out[trigger].append(sample)
    return out


def run_latency(server_url: str, template: str, args, settings: dict[str, str],
                rng: random.Random) -> dict[str, Any]:
    """Part 1 (module docstring): both conditions on one scheduler."""
    check_dispatchable()
    part: dict[str, Any] = {"slots": args.slots, "samples_per_way": args.samples,
                            "gap_seconds": list(args.gap), "blocker_seconds": BLOCKER_SECONDS,
                            "command": list(FIRST_ACT)}
    floor = command_floor(max(20, args.samples))
    part["command_floor"] = {"samples": len(floor), "p50_ms": percentile(floor, 50),
                             "p99_ms": percentile(floor, 99)}
    with scratch_database(server_url, "pgd_bench_e2e", template=template) as url, \
            tempfile.TemporaryDirectory(prefix="pgd-bench-e2e-") as tmp, \
            db.connect(url, application_name="bench-e2e-watch") as watch, \
            db.connect(url, application_name="bench-e2e-act") as act:
        folder = Path(tmp)
        config.apply_config(watch, config_text(args.slots), actor="bench", env={})
        transitions.pause_project(watch, project="paused", reason="bench: between samples", actor=ACTOR)
        transitions.pause_pool(watch, pool=SIDE_POOL, reason="bench: between samples", actor=ACTOR)
        with running_scheduler(url, watch, name="e2e-latency", slots=args.slots, settings=settings,
                               folder=folder) as sched:
            lab = Lab(act=act, watch=watch, sched=sched, slots=args.slots, gap=args.gap,
                      timeout_s=args.sample_timeout_seconds, rng=rng)
            raw: dict[str, Any] = {}
            print(f"  latency, idle: {args.samples} rounds of {len(args.ways)} ways", flush=True)
            raw["idle"] = latency_condition(lab, args.ways, args.samples)
            rate = args.load_fraction * args.slots / args.load_job_seconds
            print(f"  latency, load: {rate:.1f} jobs/s of sleep {args.load_job_seconds:g} s",
                  flush=True)
            with background_load(url, rate_per_s=rate, job_seconds=args.load_job_seconds,
                                 seed=args.seed) as load:
                time.sleep(max(2.0, 2 * args.load_job_seconds))  # to the steady state
                t0 = time.time()
                raw["load"] = latency_condition(lab, [w for w in args.ways if w in LOAD_TRIGGERS],
                                                args.samples)
                t1 = time.time()
            for sample in (s for by in raw["load"].values() for s in by):
                others = watch.execute(RUNNER_AROUND, {
                    "runner_id": sched.runner_id, "job_id": sample["job_id"],
                    "ready": sample["ready"], "claimed": sample["claimed"]}).fetchall()
                sample["held_slots"], sample["dispatchable"] = dispatchable_at(
                    sample, others, args.slots)
            shape = watch.execute(LOAD_SHAPE, {"t0": t0, "t1": t1}).fetchone()
            part["load"] = {"rate_per_s": rate, "job_seconds": args.load_job_seconds,
                            "fraction_asked": args.load_fraction, "submitted": load["submitted"],
                            "achieved_rate_per_s": load["submitted"] / (load["ended"] - load["started"]),
                            "mean_busy_slots": shape["busy_seconds"] / (t1 - t0),
                            "mean_busy_fraction": shape["busy_seconds"] / (t1 - t0) / args.slots,
                            "claim_wait_p50_ms": None if shape["claim_wait_p50_s"] is None
                            else shape["claim_wait_p50_s"] * 1000.0, "measured_seconds": t1 - t0}
            if load["exit_code"] not in (0, None):
                raise RuntimeError(f"the load process exited {load['exit_code']}")
    part["summary"] = {cond: {t: summarize(s) for t, s in by.items()} for cond, by in raw.items()}
    part["samples"] = raw
    return part


# --- processes (/proc) ----------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on; None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    return []


def children_of(pid: int) -> dict[int, list[int]]:
    """Every process below ``pid``: parent pid -> child pids (one scan of /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields:
                parents.setdefault(int(fields[1]), []).append(int(entry.name))
    tree: dict[int, list[int]] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        tree[p] = parents.get(p, [])
        todo += tree[p]
    return tree


def own_and_reaped_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds of ``pid`` itself (utime + stime, every thread) and of its reaped
    children (cutime + cstime); NaN when it is gone."""
    fields = _stat(pid)
    if fields is None:
        return float("nan"), float("nan")
    return ((int(fields[11]) + int(fields[12])) / CLK_TCK,
            (int(fields[13]) + int(fields[14])) / CLK_TCK)


def postmaster_pid(conn) -> int | None:
    """The server's postmaster (the parent of this session's backend) when it runs here."""
    backend = conn.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"]
    with contextlib.suppress(OSError):
        if "postgres" in Path(f"/proc/{backend}/comm").read_text():
            fields = _stat(backend)
            return int(fields[1]) if fields else None
    return None


def server_cpu_seconds(postmaster: int | None) -> float | None:
    """CPU seconds of the postmaster, its reaped children and its live ones; None when the
    server is not on this machine."""
    if postmaster is None:
        return None
    own, reaped = own_and_reaped_seconds(postmaster)
    return own + reaped + sum(own_and_reaped_seconds(c)[0]
                              for c in children_of(postmaster).get(postmaster, []))


# --- part 2: throughput --------------------------------------------------------------------------


def bare_posix_spawn(jobs: int, concurrency: int) -> float:
    """``jobs`` ``true`` processes, ``concurrency`` at a time, from one thread with
    os.posix_spawn; seconds from the first spawn to the last reap."""
    path = shutil.which("true") or "/bin/true"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    actions = [(os.POSIX_SPAWN_OPEN, fd, "/dev/null", os.O_RDWR, 0) for fd in (0, 1, 2)]
    started = reaped = 0
    t0 = time.perf_counter()
    while reaped < jobs:
        while started < jobs and started - reaped < concurrency:
            os.posix_spawn(path, ["true"], env, file_actions=actions, setsid=True)
            started += 1
        pid, status = os.waitpid(-1, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"true exited {os.waitstatus_to_exitcode(status)}")
        reaped += 1
    return time.perf_counter() - t0


def bare_popen(jobs: int, concurrency: int) -> float:
    """``jobs`` ``true`` processes from ``concurrency`` threads, each starting one with
    subprocess.Popen as the scheduler does (supervision.start_command's arguments), reading
    its output to the end and reaping it; seconds from the start to the last reap."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    left = [jobs]
    lock = threading.Lock()
    failures: list[str] = []

    def worker(cwd: str) -> None:
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            proc = subprocess.Popen(["true"], start_new_session=True, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    close_fds=True, cwd=cwd, env=env)
            proc.stdout.read()
            if proc.wait() != 0:
                failures.append(f"true exited {proc.returncode}")
            proc.stdout.close()

    with tempfile.TemporaryDirectory(prefix="pgd-bench-e2e-popen-") as cwd:
        threads = [threading.Thread(target=worker, args=(cwd,), name=f"bare-{i}")
                   for i in range(concurrency)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    if failures:
        raise RuntimeError(failures[0])
    return seconds


def scheduler_batch(watch, *, jobs: int, project_id: int, pool_id: int, timeout_s: float,
                    sched: Scheduler, postmaster: int | None) -> dict[str, Any]:
    """``jobs`` ``true`` jobs inserted at once; seconds from the clock before the insert's
    COMMIT to the last attempt's finished_at, and the CPU it took, in ms per job: the
    scheduler's own (every thread), its commands' (its reaped children: the ``true``s and
    their fork in the scheduler's name) and the server's (None when not on this machine),
    from before the insert until the bench saw the last job end (polled every 50 ms)."""
    last = watch.execute("SELECT coalesce(max(id), 0) AS id FROM jobs").fetchone()["id"]
    own0, reaped0 = own_and_reaped_seconds(sched.pid)
    server0 = server_cpu_seconds(postmaster)
    with watch.transaction():
        watch.execute(INSERT_QUEUED_JOBS, {"project_ids": [project_id], "pool_id": pool_id, "jobs": jobs})
        ready = time.time()
    deadline = time.monotonic() + timeout_s
    while True:
        row = watch.execute("SELECT count(*) FILTER (WHERE finished_at IS NULL) AS left, "
                            "count(*) FILTER (WHERE state <> 'succeeded') AS bad FROM jobs "
                            "WHERE id > %s", (last,)).fetchone()
        if not row["left"]:
            break
        if sched.proc.poll() is not None:
            raise RuntimeError(f"scheduler exited ({sched.proc.returncode}):\n{sched.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{row['left']} of {jobs} jobs not finished in {timeout_s:g} s")
        time.sleep(0.05)
    own1, reaped1 = own_and_reaped_seconds(sched.pid)
    server1 = server_cpu_seconds(postmaster)
    if row["bad"]:
        raise RuntimeError(f"{row['bad']} of {jobs} true jobs did not succeed")
    end = watch.execute("SELECT extract(epoch FROM max(a.finished_at))::float8 AS t, "
                        "extract(epoch FROM min(a.claimed_at))::float8 AS first "
                        "FROM attempts a WHERE a.job_id > %s", (last,)).fetchone()
    return {"seconds": end["t"] - ready, "first_claim_ms": (end["first"] - ready) * 1000.0,
            "scheduler_cpu_ms_per_job": (own1 - own0) * 1000.0 / jobs,
            "commands_cpu_ms_per_job": (reaped1 - reaped0) * 1000.0 / jobs,
            "server_cpu_ms_per_job": None if server0 is None else (server1 - server0) * 1000.0 / jobs}


# the functions whose calls per job the throughput part reports (pg_stat_user_functions)
COUNTED_FUNCTIONS = ("pgd_claim", "pgd_claim_batch", "pgd_complete", "pgd_complete_batch",
                     "pgd_heartbeat", "pgd_choose_waiter")


def function_stats(watch) -> dict[str, dict[str, float]] | None:
    """Calls and self time (ms) of every function of the database so far; None when
    track_functions is off (it could not be set)."""
    if watch.execute("SHOW track_functions").fetchone()["track_functions"] != "all":
        return None
    return {r["funcname"]: {"calls": r["calls"], "self_ms": r["self_ms"]} for r in watch.execute(
        "SELECT funcname, sum(calls)::bigint AS calls, sum(self_time)::float8 AS self_ms "
        "FROM pg_stat_user_functions GROUP BY funcname")}


def per_job(before: dict | None, after: dict | None, jobs: int) -> dict[str, Any] | None:
    """Calls per job of COUNTED_FUNCTIONS, and the five functions of most self time per job
    (ms; it includes waiting for locks and for a CPU)."""
    if before is None or after is None:
        return None
    delta = {k: {m: v[m] - before.get(k, {}).get(m, 0) for m in ("calls", "self_ms")}
             for k, v in after.items()}
    top = sorted(delta.items(), key=lambda kv: -kv[1]["self_ms"])[:5]
    return {"calls_per_job": {k: delta.get(k, {"calls": 0})["calls"] / jobs for k in COUNTED_FUNCTIONS},
            "self_ms_per_job_top5": {k: v["self_ms"] / jobs for k, v in top}}


def run_throughput(server_url: str, template: str, args, settings: dict[str, str]) -> dict[str, Any]:
    """Part 2 (module docstring)."""
    jobs, slots = args.throughput_jobs, args.slots
    runs: dict[str, list[float]] = {"scheduler": [], "posix_spawn": [], "popen": []}
    extra: list[dict[str, Any]] = []
    # CPU of a bare loop per job: the bench process's own and its reaped `true`s' (os.times)
    bare_cpu: dict[str, list[float]] = {"posix_spawn": [], "popen": []}
    with scratch_database(server_url, "pgd_bench_e2e", template=template) as url, \
            tempfile.TemporaryDirectory(prefix="pgd-bench-e2e-") as tmp, \
            db.connect(url, application_name="bench-e2e-watch") as watch:
        config.apply_config(watch, config_text(slots), actor="bench", env={})
        with contextlib.suppress(Exception):  # not a superuser: no call counts
            watch.execute(f"ALTER DATABASE {database_name(url)} SET track_functions = 'all'")
            watch.execute("SET track_functions = 'all'")
        project_id = watch.execute("SELECT id FROM projects WHERE name = 'load'").fetchone()["id"]
        pool_id = watch.execute("SELECT id FROM pools WHERE name = %s", (POOL,)).fetchone()["id"]
        postmaster = postmaster_pid(watch)
        with running_scheduler(url, watch, name="e2e-throughput", slots=slots, settings=settings,
                               folder=Path(tmp)) as sched:
            batch = dict(project_id=project_id, pool_id=pool_id, sched=sched, postmaster=postmaster,
                         timeout_s=max(120.0, jobs / 5))
            scheduler_batch(watch, jobs=2 * slots, **batch)  # warm-up: threads, connections
            bare_posix_spawn(2 * slots, slots)
            # an idle session's statistics reach the views within about 10 s (PGSTAT_IDLE_INTERVAL)
            time.sleep(args.stats_wait_seconds)
            calls0 = function_stats(watch) if args.stats_wait_seconds else None
            kinds = list(runs)
            for r in range(args.repeats):
                for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                    if kind == "scheduler":
                        got = scheduler_batch(watch, jobs=jobs, **batch)
                        extra.append(got)
                        seconds = got["seconds"]
                    else:
                        t0 = os.times()
                        seconds = (bare_posix_spawn if kind == "posix_spawn" else bare_popen)(jobs, slots)
                        t1 = os.times()
                        bare_cpu[kind].append(1000.0 * sum(b - a for a, b in zip(t0[:4], t1[:4])) / jobs)
                    runs[kind].append(jobs / seconds)
                    print(f"  throughput {kind}: {jobs / seconds:.0f} jobs/s", flush=True)
            time.sleep(args.stats_wait_seconds)
            calls = per_job(calls0, function_stats(watch) if calls0 is not None else None,
                            jobs * args.repeats)
    med = {k: statistics.median(v) for k, v in runs.items()}
    ceiling = max(med["posix_spawn"], med["popen"])

    def median_of(key: str) -> float | None:
        values = [r[key] for r in extra if r[key] is not None]
        return statistics.median(values) if values else None

    spawn_cpu = statistics.median(bare_cpu["posix_spawn"])
    cores = os.cpu_count() or 1
    return {"jobs": jobs, "concurrency": slots, "repeats": args.repeats, "jobs_per_s": runs,
            "median_jobs_per_s": med, "scheduler_runs": extra,
            "bare_cpu_ms_per_job": {k: statistics.median(v) for k, v in bare_cpu.items()},
            # at TARGET_RATIO of the ceiling, what the cores leave per job beside a bare
            # spawn's own CPU: the most a scheduler's and the server's work per job may cost
            "cores": cores, "budget_ms_per_job_at_target":
                cores * 1000.0 / (TARGET_RATIO * ceiling) - spawn_cpu,
            "scheduler_cpu_ms_per_job": median_of("scheduler_cpu_ms_per_job"),
            "commands_cpu_ms_per_job": median_of("commands_cpu_ms_per_job"),
            "server_cpu_ms_per_job": median_of("server_cpu_ms_per_job"),
            "functions": calls, "stats_wait_seconds": args.stats_wait_seconds,
            "ratio_to_posix_spawn": med["scheduler"] / med["posix_spawn"],
            "ratio_to_popen": med["scheduler"] / med["popen"],
            "ratio_to_ceiling": med["scheduler"] / ceiling,
            "meets_target": med["scheduler"] / ceiling >= TARGET_RATIO}


# --- part 3: CPU per long job ------------------------------------------------------------------


def job_pids(root: int, command: Sequence[str]) -> set[int]:
    """The scheduler's children running ``command`` (the jobs' own processes)."""
    return {c for c in children_of(root).get(root, []) if _cmdline(c) == list(command)}


def tree_cpu_seconds(root: int, exclude: set[int]) -> tuple[float, list[dict[str, Any]]]:
    """utime + stime of ``root`` (every thread), its reaped children (cutime + cstime), and
    of every descendant not in ``exclude`` nor below one, with theirs; and those helpers."""
    tree = children_of(root)
    ticks = 0
    helpers = []
    todo = [root]
    while todo:
        pid = todo.pop()
        fields = _stat(pid)
        if fields is None:
            continue
        ticks += sum(int(fields[i]) for i in (11, 12, 13, 14))
        if pid != root:
            helpers.append({"pid": pid, "command": " ".join(_cmdline(pid))[:120]})
        todo += [c for c in tree.get(pid, []) if c not in exclude]
    return ticks / CLK_TCK, helpers


def _status(pid: int, key: str) -> str | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return line.split(":", 1)[1].strip()
    return None


def run_cpu(server_url: str, template: str, args, settings: dict[str, str]) -> dict[str, Any]:
    """Part 3 (module docstring)."""
    n = args.long_jobs
    command = ["sleep", f"{args.long_seconds:g}"]
    part: dict[str, Any] = {"jobs": n, "command": command, "settle_seconds": args.settle_seconds,
                            "window_seconds": args.window_seconds}
    pids: set[int] = set()
    with scratch_database(server_url, "pgd_bench_e2e", template=template) as url, \
            tempfile.TemporaryDirectory(prefix="pgd-bench-e2e-") as tmp, \
            db.connect(url, application_name="bench-e2e-watch") as watch:
        config.apply_config(watch, config_text(n), actor="bench", env={})
        project_id = watch.execute("SELECT id FROM projects WHERE name = 'load'").fetchone()["id"]
        pool_id = watch.execute("SELECT id FROM pools WHERE name = %s", (POOL,)).fetchone()["id"]
        try:
            with running_scheduler(url, watch, name="e2e-cpu", slots=n, settings=settings,
                                   folder=Path(tmp)) as sched:
                watch.execute(INSERT_COMMAND_JOBS, {"project_id": project_id, "pool_id": pool_id,
                                                    "jobs": n, "command": command})
                deadline = time.monotonic() + args.sample_timeout_seconds
                while True:
                    running = watch.execute("SELECT count(*) AS n FROM attempts WHERE state = 'running'"
                                            ).fetchone()["n"]
                    pids = job_pids(sched.pid, command)
                    if running == n and len(pids) == n:
                        break
                    if sched.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{running} attempts running, {len(pids)} sleep processes "
                                           f"of {n} jobs:\n{sched.log_tail()}")
                    time.sleep(0.2)
                time.sleep(args.settle_seconds)
                postmaster = postmaster_pid(watch)
                cpu0, _ = tree_cpu_seconds(sched.pid, pids)
                server0 = server_cpu_seconds(postmaster)
                t0 = time.monotonic()
                time.sleep(args.window_seconds)
                cpu1, helpers = tree_cpu_seconds(sched.pid, pids)
                server1 = server_cpu_seconds(postmaster)
                elapsed = time.monotonic() - t0
                still = watch.execute("SELECT count(*) AS n FROM attempts WHERE state = 'running'"
                                      ).fetchone()["n"]
                alive = len(job_pids(sched.pid, command) & pids)
                if still != n or alive != n:
                    raise RuntimeError(f"{still} attempts running, {alive} of the {n} sleep processes "
                                       f"alive at the window's end")
                percent = (cpu1 - cpu0) / elapsed * 100.0
                rss_kb = _status(sched.pid, "VmRSS")
                part.update(
                    cpu_seconds=cpu1 - cpu0, measured_seconds=elapsed, percent_of_one_core=percent,
                    percent_per_job=percent / n, meets_target=percent <= TARGET_CPU_PERCENT * n / 100,
                    server_percent_of_one_core=None if server0 is None
                    else (server1 - server0) / elapsed * 100.0,
                    helpers=helpers, threads=int(_status(sched.pid, "Threads") or 0),
                    rss_mb=int(rss_kb.split()[0]) / 1024 if rss_kb else None,
                    server_connections=watch.execute(
                        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() "
                        "AND application_name NOT LIKE 'bench-e2e%%'").fetchone()["n"])
                print(f"  cpu: {percent:.2f} % of one core for {n} jobs over {elapsed:.0f} s", flush=True)
                t_cancel = time.monotonic()
                ids = [r["id"] for r in watch.execute("SELECT id FROM jobs WHERE project_id = %s",
                                                      (project_id,))]
                for job_id in ids:
                    transitions.cancel_job(watch, job_id=job_id, actor=ACTOR, reason="bench: done")
                deadline = time.monotonic() + 3 * float(
                    settings.get("PGDISPATCH_HEARTBEAT_SECONDS", 10)) + 30
                while watch.execute("SELECT count(*) AS n FROM attempts WHERE state = 'running'"
                                    ).fetchone()["n"] and time.monotonic() < deadline:
                    time.sleep(0.2)
                part["cancel_to_all_ended_seconds"] = time.monotonic() - t_cancel
                part["cancelled"] = watch.execute(
                    "SELECT count(*) AS n FROM attempts WHERE state = 'cancelled'").fetchone()["n"]
        finally:
            left = {p for p in pids if _cmdline(p) == command}
            for pid in left:  # the part's own jobs, by pid, only if the scheduler left them
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            part["left_behind"] = len(left)
    if part["left_behind"]:
        raise RuntimeError(f"{part['left_behind']} sleep processes were left behind (killed)")
    if part.get("cancelled") != n:
        raise RuntimeError(f"{part.get('cancelled')} of {n} attempts cancelled")
    return part


# --- output ------------------------------------------------------------------------------------


def _f(value: Any, fmt: str = ".1f") -> str:
    return "–" if value is None else format(value, fmt)


def latency_table(part: dict[str, Any]) -> str:
    lines = ["| becomes ready by | condition | samples | p50 ms | p95 ms | p99 ms | max ms "
             "| ready→claim p50 | claim→start p50 | met a full runner | from dispatchable "
             "p50 / p95 / p99 / max ms | p99 ≤ 50 ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for trigger in TRIGGERS:
        for cond, by in part["summary"].items():
            s = by.get(trigger)
            if s is None:
                continue
            full, dispatch = "–", "–"
            if "dispatch_p99_ms" in s:
                full = str(s["runner_full_samples"])
                dispatch = " / ".join(_f(s[f"dispatch_{k}_ms"]) for k in ("p50", "p95", "p99", "max"))
            lines.append(f"| {trigger} | {cond} | {s['samples']} | {_f(s['p50_ms'])} | {_f(s['p95_ms'])} "
                         f"| {_f(s['p99_ms'])} | {_f(s['max_ms'])} | {_f(s['ready_to_claim_p50_ms'])} "
                         f"| {_f(s['claim_to_start_p50_ms'])} | {full} | {dispatch} "
                         f"| {'yes' if s['meets_target'] else 'NO'} |")
    f, load = part["command_floor"], part["load"]
    lines += ["", f"command floor (bare Popen of `{' '.join(FIRST_ACT)}` to its clock): p50 "
              f"{_f(f['p50_ms'], '.2f')} ms, p99 {_f(f['p99_ms'], '.2f')} ms; load: "
              f"{load['achieved_rate_per_s']:.1f} jobs/s of sleep {load['job_seconds']:g} s, "
              f"{load['mean_busy_slots']:.1f} of {part['slots']} slots busy on average"]
    return "\n".join(lines)


def throughput_table(part: dict[str, Any]) -> str:
    lines = [f"| runner ({part['jobs']} × `true`, concurrency {part['concurrency']}) "
             "| jobs/s (median) | min–max |", "|---|---:|---:|"]
    for kind, label in (("scheduler", "pgdispatch scheduler"), ("posix_spawn", "bare posix_spawn loop"),
                        ("popen", "bare Popen threads")):
        v = part["jobs_per_s"][kind]
        lines.append(f"| {label} | {statistics.median(v):.0f} | {min(v):.0f}–{max(v):.0f} |")
    lines += ["", f"scheduler ÷ posix_spawn {part['ratio_to_posix_spawn']:.2f}, ÷ Popen "
              f"{part['ratio_to_popen']:.2f}; ÷ the faster (ceiling) {part['ratio_to_ceiling']:.2f} "
              f"(target ≥ {TARGET_RATIO}: {'yes' if part['meets_target'] else 'NO'})",
              f"CPU per job: scheduler {_f(part['scheduler_cpu_ms_per_job'], '.2f')} ms, its commands "
              f"{_f(part['commands_cpu_ms_per_job'], '.2f')} ms, server "
              f"{_f(part['server_cpu_ms_per_job'], '.2f')} ms"]
    if part.get("bare_cpu_ms_per_job"):
        bare = part["bare_cpu_ms_per_job"]
        lines.append(f"CPU per job of the bare loops (the bench process and its `true`s): "
                     f"posix_spawn {bare['posix_spawn']:.2f} ms, Popen {bare['popen']:.2f} ms; at "
                     f"{TARGET_RATIO} of the ceiling, {part['cores']} cores leave "
                     f"{part['budget_ms_per_job_at_target']:.2f} ms per job beside a bare spawn "
                     "for the scheduler's and the server's work")
    fn = part.get("functions")
    if fn:
        lines.append("calls per job: " + ", ".join(f"{k} {v:.2f}" for k, v in fn["calls_per_job"].items())
                     + "; most self time per job: "
                     + ", ".join(f"{k} {v:.2f} ms" for k, v in fn["self_ms_per_job_top5"].items()))
    return "\n".join(lines)


def cpu_table(part: dict[str, Any]) -> str:
    return "\n".join([
        "| long jobs | window s | scheduler CPU s | % of one core | % per job | threads | RSS MB "
        "| DB connections | server % of one core | cancel → all ended s | ≤ 1 % per 100 jobs |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {part['jobs']} | {part['measured_seconds']:.1f} | {part['cpu_seconds']:.2f} "
        f"| {part['percent_of_one_core']:.2f} | {part['percent_per_job']:.4f} | {part['threads']} "
        f"| {_f(part['rss_mb'])} | {part['server_connections']} "
        f"| {_f(part['server_percent_of_one_core'], '.2f')} "
        f"| {_f(part.get('cancel_to_all_ended_seconds'))} | {'yes' if part['meets_target'] else 'NO'} |",
        "", "helpers counted: " + (", ".join(h["command"] for h in part["helpers"]) or "none")])


# --- the command -------------------------------------------------------------------------------


def _gap(text: str) -> tuple[float, float]:
    try:
        low, _, high = text.partition(",")
        gap = (float(low), float(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want MIN,MAX seconds, got {text!r}") from None
    if not 0 <= gap[0] <= gap[1] <= 60:
        raise argparse.ArgumentTypeError(f"want MIN,MAX seconds with 0 <= MIN <= MAX <= 60, got {text!r}")
    return gap


def _ways(text: str) -> list[str]:
    ways = [w for w in text.split(",") if w]
    if not ways or set(ways) - set(TRIGGERS):
        raise argparse.ArgumentTypeError(f"want a comma-separated list of {', '.join(TRIGGERS)}, "
                                         f"got {text!r}")
    return [w for w in TRIGGERS if w in ways]


def _parts(text: str) -> list[str]:
    parts = [p for p in text.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        raise argparse.ArgumentTypeError(f"want a comma-separated list of {', '.join(PARTS)}, got {text!r}")
    return parts


class _Parser(argparse.ArgumentParser):
    """Bad input: one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = _Parser(prog="python -m bench e2e", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer samples and shorter windows (20 rounds, 400 jobs, 1 repeat, 10 s)")
    p.add_argument("--parts", type=_parts, default=list(PARTS), help="latency,throughput,cpu (all)")
    p.add_argument("--ways", type=_ways, default=list(TRIGGERS),
                   help=f"the ways of becoming ready to sample ({','.join(TRIGGERS)})")
    p.add_argument("--slots", type=int, default=8, help="the scheduler's slots in latency and throughput (8)")
    p.add_argument("--samples", type=int, help="rounds: samples per way and condition (100; quick 20)")
    p.add_argument("--gap-seconds", dest="gap", type=_gap, default=(0.1, 0.3),
                   help="pause before each sample, U(MIN,MAX) seconds (0.1,0.3)")
    p.add_argument("--load-fraction", type=float, default=0.5,
                   help="share of the slots the background load keeps busy (0.5)")
    p.add_argument("--load-job-seconds", type=float, default=0.5, help="each load job's sleep (0.5)")
    p.add_argument("--throughput-jobs", type=int, help="true jobs per throughput run (2000; quick 400)")
    p.add_argument("--repeats", type=int, help="throughput rounds (3; quick 1)")
    p.add_argument("--stats-wait-seconds", type=float, default=11.0,
                   help="before reading function call counts, for idle sessions to report them "
                        "(11; 0: not counted)")
    p.add_argument("--long-jobs", type=int, default=100, help="sleep jobs running at once (100)")
    p.add_argument("--long-seconds", type=float, default=600.0, help="each long job's sleep (600)")
    p.add_argument("--settle-seconds", type=float, help="after they all run (10; quick 3)")
    p.add_argument("--window-seconds", type=float, help="the CPU window (60; quick 10)")
    p.add_argument("--sample-timeout-seconds", type=float, default=60.0,
                   help="a job not dispatched in this long fails the run (60)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                   help="a PGDISPATCH_* setting for the schedulers (repeatable)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, help="JSON file (default bench/results/e2e-<UTC>.json)")
    args = p.parse_args(list(argv))
    for name, quick, full in (("samples", 20, 100), ("throughput_jobs", 400, 2000), ("repeats", 1, 3),
                              ("settle_seconds", 3.0, 10.0), ("window_seconds", 10.0, 60.0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if min(args.slots, args.samples, args.throughput_jobs, args.repeats, args.long_jobs) < 1:
        p.error("--slots, --samples, --throughput-jobs, --repeats and --long-jobs must be at least 1")
    if args.slots > 1000 or args.long_jobs > 1000:
        p.error("--slots and --long-jobs must be at most 1000")
    if not 0 < args.load_fraction <= 1 or args.load_job_seconds <= 0:
        p.error("--load-fraction must be in (0, 1] and --load-job-seconds above 0")
    if min(args.settle_seconds, args.sample_timeout_seconds, args.stats_wait_seconds) < 0 \
            or args.window_seconds <= 0:
        p.error("--settle-seconds, --sample-timeout-seconds and --stats-wait-seconds must be >= 0, "
                "--window-seconds > 0")
    if args.long_seconds < args.settle_seconds + args.window_seconds + args.sample_timeout_seconds:
        p.error("--long-seconds must outlast --settle-seconds + --window-seconds + "
                "--sample-timeout-seconds (a long job must not end inside the window)")
    if args.out is not None:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            p.error(f"--out {args.out}: {exc.strerror}")
        if args.out.is_dir():
            p.error(f"--out {args.out} is a directory")
    try:
        args.settings = passed_settings(args.overrides)
        Settings.from_env(dict(args.settings))  # refused here, not by each scheduler
    except (ValueError, PgDispatchError) as exc:
        p.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench e2e``: the parts asked for, the tables, the JSON; 1 if one failed."""
    argv = list(argv if argv is not None else sys.argv[1:])
    args = parse(argv)
    started = dt.datetime.now(dt.timezone.utc)
    doc: dict[str, Any] = {
        "benchmark": "e2e", "started_at": started.isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench", "e2e", *argv]), "git": git_commit(),
        "machine": machine(), "scheduler_settings_passed": args.settings,
        "clocks": "CLOCK_REALTIME on one machine: the bench's time.time(), PostgreSQL's "
                  "clock_timestamp(), the job's date +%s.%N",
        "params": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
                   if k not in ("out", "settings")}, "errors": {}}
    rng = random.Random(args.seed)
    runners = {"latency": lambda s, t: run_latency(s, t, args, args.settings, rng),
               "throughput": lambda s, t: run_throughput(s, t, args, args.settings),
               "cpu": lambda s, t: run_cpu(s, t, args, args.settings)}
    tables = {"latency": latency_table, "throughput": throughput_table, "cpu": cpu_table}
    with bench_server() as (server_url, kind), \
            template_database(server_url, "pgd_bench_e2e_template") as template:
        doc["server"] = kind
        doc["server_settings"] = server_settings(server_url)
        for name in args.parts:
            print(f"== e2e {name}", flush=True)
            t0 = time.monotonic()
            try:
                doc[name] = runners[name](server_url, template)
                doc[name]["wall_seconds"] = time.monotonic() - t0
                doc[name]["load_average_after"] = os.getloadavg()
            except Exception as exc:  # reported; the other parts still run
                doc["errors"][name] = f"{type(exc).__name__}: {exc}"
                print(f"  FAILED: {doc['errors'][name]}", flush=True)
    out = args.out or RESULTS_DIR / f"e2e-{started:%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nEnd to end through the real scheduler ({doc['server']} PostgreSQL "
          f"{doc['server_settings'].get('server_version')}, {doc['machine']['cpus']} CPUs, "
          f"load average {doc['machine']['loadavg_at_start']})")
    for name in args.parts:
        if name in doc:
            print(f"\n{tables[name](doc[name])}")
    for name, why in doc["errors"].items():
        print(f"\n{name}: FAILED: {why}")
    print(f"\nsaved {out}")
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
