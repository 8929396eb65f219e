"""Wake-ups: LISTEN/NOTIFY against polling for the scheduler's claim loop, and what NOTIFY
costs the submit path.

Run it from the repository root::

    python -m bench notify            # full: about 4-6 minutes on the 2-core machine
    python -m bench notify --quick    # smoke run, about a minute: fewer samples, N = 1 and 8,
                                      # one repeat; its figures are not results
    python -m bench notify [--parts wakeup,throughput,ceiling] [--submits 200] [--claimers 8]
                           [--intervals 1.0,0.2,0.05] [--listen-fallback-seconds 1.0]
                           [--idle-seconds 5] [--herd-jobs 20] [--gap-seconds 1]
                           [--clients 1,4,8] [--jobs 2000] [--pgbench-seconds 5] [--repeats 3]
                           [--listeners 2] [--out FILE.json]

Like the other benchmarks it uses one server for the whole invocation: an embedded PostgreSQL
started in a temporary directory (stopped and removed at the end), or ``DATABASE_URL``'s when
set (the role needs CREATEDB; every ``pgd_bench_notify_*`` database is dropped afterwards).
Every run gets a fresh copy of a migrated template. Every worker is its own process
(``bench.common.run_processes``: spawned, started together on a barrier) with its own
connections. All times are ``time.monotonic()`` (one clock for every process on Linux).
The NOTIFY measured is the product's own: the trigger ``pgd_notify_queued`` on ``jobs``
(channel ``pgdispatch.sql.scheduling.WAKEUP_CHANNEL``, payload the pool id), which every migrated
database has. A run without it switches it off on its scratch database with
``ALTER DATABASE ... SET pgdispatch.notify = 'off'``, the switch docs/operations.md gives
operators.

**Wake-up latency and idle load** (``wakeup``), one run per claim mode. ``--claimers``
claimer processes (default 8), each registered as a runner for its own pool ``lane<i>`` plus
one pool ``shared``. A claimer's *pass* is what scheduler/claiming.py does on each tick:
``pgdispatch.sql.transitions.claim`` until it returns nothing, completing each claimed job (outcome
succeeded) before claiming the next. Modes:

* ``poll <I> s`` — a pass every I seconds at a fixed rate (APScheduler's interval trigger;
  missed ticks coalesced), first tick at a random offset in [0, I). The intervals are
  ``--intervals``; 1.0 s is today's default (``Settings.claim_interval_seconds``,
  ``PGDISPATCH_CLAIM_INTERVAL_SECONDS``).
* ``listen`` — the product's trigger notifies (in poll modes it is switched off), so the
  NOTIFY is sent by the submitting transaction itself and delivered when it commits. Each
  claimer LISTENs on the wake-up channel on a dedicated connection (the one that would have
  to bypass a transaction-pooling PgBouncer) and, as ``pgdispatch.sql.scheduling.listen_for_work``
  does, makes a pass as soon as a notification for one of its pools arrives, plus a
  fallback pass every ``--listen-fallback-seconds`` (default 1.0 s, today's tick: what
  NOTIFY does not announce — delayed retries coming due, capacity freed on another host,
  lost notifications — is then found no later than today).

Phases of each run, on the clock of one submitter process (one thread and connection per
lane):

1. *idle* (``--idle-seconds``, after 0.5 s of settling): nothing queued. Reported: claim
   statements per second summed over all claimers (counted by the claimers), and — when the
   server is the embedded one, on this machine — the CPU time of the claimers' server
   backends from /proc, in milliseconds of CPU per second of wall clock.
2. *latency*: ``--submits`` jobs in all, each lane a closed loop: sleep U(0, G), submit one
   no-op job to the lane's pool with ``pgdispatch.sql.transitions.submit`` (its own transaction), wait
   until a claimer reports the claim, repeat. G is ``--gap-seconds`` (1.0), in poll modes
   rounded up to a multiple of the interval so that a submit falls at a uniformly random
   phase of the tick. With G = 1 s the 8 lanes rarely have claims running at the same
   time (they would queue on the organization row and measure that instead of the wake-up):
   each claimer is idle when its job arrives. Latency =
   monotonic time at which ``claim`` returned the job in the claimer minus monotonic time at
   which the submitting transaction's COMMIT was sent, in milliseconds; p50, p95 (nearest
   rank) and max. Measured from COMMIT sent, the latency is an upper bound: it includes the
   commit itself (its WAL flush; its p50 is saved as ``commit_p50_ms``), which no wake-up
   can beat, since a NOTIFY is delivered only once its transaction has committed. Also given: the p50 to the moment the winning claim statement was
   sent (the wake-up alone, without the claim's own execution).
3. *herd* (listen only, ``--herd-jobs``): jobs submitted one at a time to the pool that every
   claimer serves; reported: claim statements per such job (each notification wakes every
   listener of the channel, and each makes a pass).

**Submit throughput with and without NOTIFY** (``throughput``). For each N in ``--clients``
and each of ``--repeats`` repeats, two runs alternated (which goes first rotates with the
repeat): ``plain`` (the trigger switched off) and ``notify``. N submitter processes each
enqueue ``--jobs``/N no-op jobs through ``pgdispatch.sql.transitions.submit``, one job per transaction;
``--listeners`` more processes (default 2) LISTEN on the wake-up channel and drain what
arrives, in both runs. jobs/s = jobs / (last submitter's end - first submitter's
start), seconds from the barrier; the table gives the median over repeats (min-max beside
it). Checked after each run: every job is in the table and, with notify, every listener
received one notification per job.

While both kinds of run go, a sampler (every 50 ms, own connection) reads the submitters'
sessions from pg_stat_activity; the tables give the mean number of them waiting on
``Lock:object`` (the NOTIFY commit lock, below) and on ``IO:WalSync`` (a commit's WAL flush).

**Ceiling** (``ceiling``): the same comparison with the smallest notifying transaction, so
that client CPU does not hide the server's limit: pgbench (the embedded package's binary, as
in bench/ceiling.py), ``-c N -j min(N, 2) -T --pgbench-seconds`` (whole seconds), script
``CEILING_SCRIPT`` (one queued no-op job inserted straight into ``jobs``, one transaction:
none of pgd_submit's work), with the product's trigger on or switched off,
``--listeners`` listening sessions. Reported: pgbench's tps (transactions/s, without
connection time); checked: every listener got one notification per row.

Why the last two parts: PostgreSQL's NOTIFY page documents that notifications from
different transactions are delivered in the order in which the transactions committed (and
only between transactions). The server keeps that order by serializing notifying commits:
``PreCommit_Notify`` (src/backend/commands/async.c; its comment, not the docs page, says so)
takes a heavyweight lock on "database 0" — one for the whole cluster, whatever the database
— and holds it until the transaction ends, so past its commit record's WAL flush. Notifying
transactions therefore cannot share a WAL flush (group commit) with each other; these parts
measure what that costs here.

**PgBouncer** (not measured; from its documentation). In transaction pooling
(``pool_mode = transaction``) a server connection belongs to a client only for the length of
a transaction, and the feature map on PgBouncer's features page marks LISTEN as never
supported in that mode: the LISTEN registers the server session that happened to run it,
which then serves other clients, so notifications go to whoever holds that session next and
the listener silently gets nothing. Sending is unaffected (the NOTIFY is part of the
submitting transaction and is delivered at its commit). So the listening connection must be
a session: straight to PostgreSQL, or through a PgBouncer database or user entry with
``pool_mode = session`` (both can be set per entry); claims, heartbeats and completions can
keep using the transaction-pooled route. When no session route exists, the scheduler must
fall back to polling at its claim interval, and because NOTIFY is only a hint (lost while
the listener reconnects, and silent for delayed retries coming due or capacity freed
elsewhere), the fallback pass runs in every mode anyway.

Output: markdown tables on stdout, and ``bench/results/notify-<UTC timestamp>.json``
(gitignored): parameters, server settings, machine and load average, every run with its raw
latencies (ms) and counts, the summaries.

Units: latencies in milliseconds (ms); load in claim statements per second (claims/s) and
server CPU milliseconds per second of wall clock (ms/s); submit throughput in jobs per second
(jobs/s, one job per transaction); the ceiling in transactions per second (tx/s).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import multiprocessing
import os
import platform
import queue
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pgdispatch.sql import config, db, transitions
from pgdispatch.sql.scheduling import WAKEUP_CHANNEL

from .common import (RESULTS_DIR, bench_server, database_name, parse_tps, percentile, pgbench,
                     run_processes, scratch_database, server_settings, template_database)

ORG = "bench"
PROJECT = "p0"
SHARED_POOL = "shared"
LEASE_SECONDS = 3600.0
SETTLE_SECONDS = 0.5
HERD_SPACING_SECONDS = 0.15

# --- SQL of the benchmark set-up (scratch databases only; never a migration) -----------------

# Switches the product's NOTIFY trigger off for every later session of the database.
NOTIFY_OFF = "ALTER DATABASE {database} SET pgdispatch.notify = 'off'"

# The ceiling part: the smallest notifying transaction, run by pgbench: one queued job (the
# product's trigger notifies), with the columns pgd_submit would not leave to their defaults.
CEILING_SCRIPT = """INSERT INTO jobs (project_id, pool_id, state, command, submitted_by)
VALUES (:project_id, :pool_id, 'queued', ARRAY['true'], 'bench');
"""

NOTIFY_LOCK_WAIT = "Lock:object"
WAL_FLUSH_WAIT = "IO:WalSync"

POOL_IDS = "SELECT id, name FROM pools WHERE name = ANY (%(names)s::text[])"
COUNT_JOBS = "SELECT count(*) AS n FROM jobs"

# What the submitters' server sessions are doing right now: waiting on their client (idle),
# running, or waiting on a named event. "Lock:object" is the NOTIFY commit lock (a heavyweight
# lock on a shared object, taken by PreCommit_Notify); "IO:WalSync" a commit's WAL flush.
SAMPLE_WAITS = """
SELECT CASE WHEN state = 'idle' THEN 'client'
            WHEN state LIKE 'idle in transaction%%' THEN 'client (in transaction)'
            ELSE coalesce(wait_event_type || ':' || wait_event, 'running') END AS what,
       count(*) AS n
  FROM pg_stat_activity
 WHERE datname = current_database() AND application_name LIKE %(prefix)s
 GROUP BY 1
"""
CLAIMED_JOBS = "SELECT count(*) AS n FROM jobs WHERE state = 'succeeded'"


def config_text(pools: Sequence[str]) -> str:
    """The apply file (TOML): one organization, ``pools`` (slots unbounded for the bench) and
    one project granted all of them; every limit far above what a run reaches."""
    lines = ["[[organizations]]", f'name = "{ORG}"', "max_running = 100000"]
    for p in pools:
        lines += ["[[pools]]", f'name = "{p}"', "slots = 100000"]
    lines += ["[[projects]]", f'name = "{PROJECT}"', f'organization = "{ORG}"',
              "pools = [" + ", ".join(f'"{p}"' for p in pools) + "]", "max_running = 100000"]
    return "\n".join(lines) + "\n"


def setup_world(url: str, pools: Sequence[str], *, notify: bool) -> dict[str, int]:
    """Apply the config and, unless ``notify``, switch the product's NOTIFY trigger off for
    the sessions opened afterwards; returns {pool name: pool id}."""
    with db.connect(url, application_name="bench-setup") as conn:
        config.apply_config(conn, config_text(pools), actor="bench", env={})
        if not notify:
            conn.execute(NOTIFY_OFF.format(database=database_name(url)))
        return {r["name"]: r["id"] for r in conn.execute(POOL_IDS, {"names": list(pools)})}


# --- statistics -----------------------------------------------------------------------------------


def backend_cpu_seconds(pid: int) -> float | None:
    """CPU time (seconds) a local process has run, from /proc/<pid>/schedstat (nanoseconds,
    unlike /proc/<pid>/stat's 10 ms ticks); None if unreadable (e.g. a remote server)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


# --- wake-up workers ------------------------------------------------------------------------------


def _claim_pass(conn, *, runner_id: int, pool_ids: list[int], log: list, out, index: int,
                reason: str) -> None:
    """One pass: claim until nothing is eligible, completing each job; every claim statement
    is logged as (sent, returned, job id or None, reason) and each claim reported on ``out``."""
    while True:
        sent = time.monotonic()
        c = transitions.claim(conn, runner_id=runner_id, pools=pool_ids,
                              claim_token=transitions.new_claim_token(), lease_seconds=LEASE_SECONDS)
        returned = time.monotonic()
        log.append((sent, returned, None if c is None else c.job_id, reason))
        if c is None:
            return
        out.put(("claimed", c.job_id, sent, returned, index))
        transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                             outcome="succeeded", exit_code=0, receipt_key=c.receipt_key)


def claimer_worker(barrier, url: str, index: int, mode: str, interval_s: float, pools: list[str],
                   out, stop, deadline_s: float) -> dict[str, Any]:
    """One claimer process until ``stop`` is set (or ``deadline_s`` seconds have passed).

    ``mode`` is ``poll`` (a pass every ``interval_s`` seconds, fixed rate) or ``listen`` (a
    pass on each notification, plus a fallback pass every ``interval_s`` seconds). Before the
    barrier it reports its server backends' pids on ``out`` as ("pids", index, [pid, ...]).
    Returns {"start", "end", "done", "claims": [(sent, returned, job id | None, reason)],
    "notifications": int}.
    """
    log: list[tuple[float, float, int | None, str]] = []
    notifications = 0
    with db.connect(url, application_name=f"bench-notify-claim-{index}") as conn:
        runner_id = transitions.register_runner(conn, name=f"bench-notify-{index}", pools=pools,
                                                slots=1, hostname="bench", pid=os.getpid())
        pool_ids = sorted(r["id"] for r in conn.execute(POOL_IDS, {"names": pools}))
        pids = [conn.info.backend_pid]
        listener = None
        if mode == "listen":
            listener = db.connect(url, application_name=f"bench-notify-listen-{index}")
            listener.execute(f"LISTEN {WAKEUP_CHANNEL}")
            pids.append(listener.info.backend_pid)
        wanted = {str(p) for p in pool_ids}
        try:
            out.put(("pids", index, pids))
            barrier.wait(timeout=120)
            start = time.monotonic()
            end_by = start + deadline_s
            claim = dict(runner_id=runner_id, pool_ids=pool_ids, log=log, out=out, index=index)
            next_tick = start + random.uniform(0, interval_s)
            if listener is not None:
                _claim_pass(conn, reason="start", **claim)
            while not stop.is_set() and time.monotonic() < end_by:
                now = time.monotonic()
                if listener is not None:
                    # Wake on a notification, or at the fallback tick; look at `stop` at least
                    # every 0.25 s (a notification ends the wait at once).
                    wait = max(0.0, min(next_tick - now, 0.25))
                    notes = list(listener.notifies(timeout=wait, stop_after=1))
                    if notes:
                        notes += listener.notifies(timeout=0)
                        got = sum(1 for n in notes if n.payload in wanted)
                        notifications += got
                        if got:
                            _claim_pass(conn, reason="notify", **claim)
                        continue
                elif now < next_tick:
                    stop.wait(min(next_tick - now, 0.5))
                    continue
                if time.monotonic() >= next_tick:
                    _claim_pass(conn, reason="tick", **claim)
                    next_tick += interval_s
                    if next_tick <= time.monotonic():  # coalesce missed ticks, as APScheduler does
                        next_tick = time.monotonic() + interval_s
            end = time.monotonic()
        finally:
            if listener is not None:
                listener.close()
    return {"start": start, "end": end, "done": sum(1 for e in log if e[2] is not None),
            "claims": log, "notifications": notifications}


def submitter_worker(barrier, url: str, lanes: list[str], submits: int, gap_s: float,
                     idle_s: float, herd_jobs: int, claimers: int, out, stop,
                     measure_cpu: bool, wait_s: float) -> dict[str, Any]:
    """The submitting side of a wake-up run (see the module doc for the phases).

    Returns {"start", "end", "done", "idle": (from, to), "herd": (from, to) | None,
    "cpu_seconds": backend CPU over the idle window (s) | None,
    "latencies": [{"lane", "job_id", "sent", "commit_sent", "committed", "claim_sent",
    "claimed"}]} (monotonic seconds).
    """
    claimed: dict[int, tuple[float, float, int]] = {}
    pids: dict[int, list[int]] = {}
    cond = threading.Condition()
    reading = threading.Event()

    def reader() -> None:
        while not reading.is_set():
            try:
                msg = out.get(timeout=0.2)
            except queue.Empty:
                continue
            with cond:
                if msg[0] == "pids":
                    pids[msg[1]] = msg[2]
                else:
                    claimed[msg[1]] = (msg[2], msg[3], msg[4])
                cond.notify_all()

    def wait_claimed(job_id: int) -> tuple[float, float, int]:
        with cond:
            if not cond.wait_for(lambda: job_id in claimed, timeout=wait_s):
                raise RuntimeError(f"job {job_id} not claimed within {wait_s:.0f} s")
            return claimed[job_id]

    def submit(conn, pool: str) -> tuple[int, float, float, float]:
        """(job id, BEGIN sent, COMMIT sent, COMMIT answered), monotonic seconds."""
        sent = time.monotonic()
        with conn.transaction():  # ours, so that the moment COMMIT leaves can be read
            job = transitions.submit(conn, project=PROJECT, pool=pool, command=["true"],
                                     submitted_by="bench")
            commit_sent = time.monotonic()
        return job["id"], sent, commit_sent, time.monotonic()

    conns = [db.connect(url, application_name=f"bench-notify-submit-{i}") for i in range(len(lanes))]
    thread = threading.Thread(target=reader, name="bench-notify-reader", daemon=True)
    thread.start()
    latencies: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    try:
        barrier.wait(timeout=120)
        start = time.monotonic()
        with cond:
            if not cond.wait_for(lambda: len(pids) == claimers, timeout=30):
                raise RuntimeError(f"only {len(pids)} of {claimers} claimers reported their pids")
        backends = [p for ps in pids.values() for p in ps]
        time.sleep(SETTLE_SECONDS)

        # 1. idle
        idle_from = time.monotonic()
        cpu0 = [backend_cpu_seconds(p) for p in backends] if measure_cpu else []
        time.sleep(idle_s)
        cpu1 = [backend_cpu_seconds(p) for p in backends] if measure_cpu else []
        idle_to = time.monotonic()
        cpu = (sum(b - a for a, b in zip(cpu0, cpu1))
               if measure_cpu and None not in cpu0 + cpu1 else None)

        # 2. latency: one closed loop per lane
        per_lane = [submits // len(lanes) + (1 if i < submits % len(lanes) else 0)
                    for i in range(len(lanes))]

        def lane(i: int) -> None:
            rng = random.Random(i)
            try:
                for _ in range(per_lane[i]):
                    time.sleep(rng.uniform(0, gap_s))
                    job_id, sent, commit_sent, committed = submit(conns[i], lanes[i])
                    claim_sent, claimed_at, _ = wait_claimed(job_id)
                    with cond:
                        latencies.append({"lane": i, "job_id": job_id, "sent": sent,
                                          "commit_sent": commit_sent, "committed": committed,
                                          "claim_sent": claim_sent, "claimed": claimed_at})
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=lane, args=(i,), name=f"bench-lane-{i}")
                   for i in range(len(lanes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

        # 3. herd: every claimer serves the shared pool
        herd = None
        if herd_jobs:
            time.sleep(HERD_SPACING_SECONDS)
            herd_from = time.monotonic()
            for _ in range(herd_jobs):
                job_id, *_ = submit(conns[0], SHARED_POOL)
                wait_claimed(job_id)
                time.sleep(HERD_SPACING_SECONDS)  # let the losers' empty passes land
            herd = (herd_from, time.monotonic())
        end = time.monotonic()
    finally:
        stop.set()
        reading.set()
        thread.join(2)
        for c in conns:
            c.close()
    return {"start": start, "end": end, "done": len(latencies), "idle": (idle_from, idle_to),
            "herd": herd, "cpu_seconds": cpu, "latencies": latencies}


# --- throughput workers ----------------------------------------------------------------------------


def submit_worker(barrier, url: str, index: int, jobs: int, pool: str, finished) -> dict[str, Any]:
    """Enqueue ``jobs`` no-op jobs, one ``transitions.submit`` transaction each.
    Returns {"start", "end" (monotonic s), "done" (jobs)}."""
    with db.connect(url, application_name=f"bench-notify-submit-{index}") as conn:
        barrier.wait(timeout=120)
        start = time.monotonic()
        for _ in range(jobs):
            transitions.submit(conn, project=PROJECT, pool=pool, command=["true"],
                               submitted_by="bench")
        end = time.monotonic()
    with finished.get_lock():
        finished.value += 1
    return {"start": start, "end": end, "done": jobs}


def listen_worker(barrier, url: str, index: int, pool_id: int, submitters: int, expected: int,
                  finished) -> dict[str, Any]:
    """LISTEN on the wake-up channel and count the notifications for the pool until every
    submitter has finished and ``expected`` notifications have arrived (at most 5 s after the
    last submitter). Returns {"start", "end", "done": 0, "received"}."""
    received = 0
    payload = str(pool_id)
    with db.connect(url, application_name=f"bench-notify-listen-{index}") as conn:
        conn.execute(f"LISTEN {WAKEUP_CHANNEL}")
        barrier.wait(timeout=120)
        start = time.monotonic()
        while finished.value < submitters:
            received += sum(1 for n in conn.notifies(timeout=0.2) if n.payload == payload)
        give_up = time.monotonic() + 5.0
        while received < expected and time.monotonic() < give_up:
            received += sum(1 for n in conn.notifies(timeout=0.1) if n.payload == payload)
    return {"start": start, "end": start, "done": 0, "received": received}


ROLES: dict[str, Callable[..., dict[str, Any]]] = {
    "claimer": claimer_worker, "submitter": submitter_worker,
    "submit": submit_worker, "listen": listen_worker,
}


def _role(barrier, role: str, *args: Any) -> dict[str, Any]:
    return ROLES[role](barrier, *args)


class WaitSampler:
    """Samples ``SAMPLE_WAITS`` every ``every_s`` seconds on its own connection while open
    (a context manager). ``summary(sessions)`` is the mean number of the ``sessions``
    sessions in each state, over the samples in which at least one was not idle."""

    def __init__(self, url: str, prefix: str, *, every_s: float = 0.05):
        self.url, self.prefix, self.every_s = url, prefix, every_s
        self.samples: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-wait-sampler", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            with db.connect(self.url, application_name="bench-sampler") as conn:
                while not self._stop.is_set():
                    rows = conn.execute(SAMPLE_WAITS, {"prefix": self.prefix}).fetchall()
                    self.samples.append({r["what"]: r["n"] for r in rows})
                    self._stop.wait(self.every_s)
        except BaseException as exc:  # noqa: BLE001 - reported by summary
            self._error = exc

    def __enter__(self) -> "WaitSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self, sessions: int) -> dict[str, Any]:
        """{"samples": n, "mean": {state: mean sessions in it}} over the busy samples."""
        busy = [s for s in self.samples if s.get("client", 0) < sessions and sum(s.values()) == sessions]
        keys = sorted({k for s in busy for k in s})
        return {"samples": len(busy), "error": None if self._error is None else repr(self._error),
                "mean": {k: sum(s.get(k, 0) for s in busy) / len(busy) for k in keys} if busy else {}}


class ListenerThreads:
    """``count`` threads in this process, each LISTENing on ``channel`` on its own connection
    and counting what arrives, while open (a context manager)."""

    def __init__(self, url: str, channel_name: str, count: int):
        self.url, self.channel_name = url, channel_name
        self.received = [0] * count
        self._stop = threading.Event()
        self._ready = threading.Barrier(count + 1)
        self._errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True,
                                          name=f"bench-listener-{i}") for i in range(count)]

    def _run(self, i: int) -> None:
        try:
            with db.connect(self.url, application_name=f"bench-notify-listen-{i}") as conn:
                conn.execute(f"LISTEN {self.channel_name}")
                self._ready.wait(30)
                while not self._stop.is_set():
                    self.received[i] += sum(1 for _ in conn.notifies(timeout=0.1))
        except BaseException as exc:  # noqa: BLE001 - raised by wait_for
            self._errors.append(exc)
            self._ready.abort()

    def __enter__(self) -> "ListenerThreads":
        for t in self._threads:
            t.start()
        self._ready.wait(30)
        return self

    def wait_for(self, expected: int, *, timeout_s: float = 5.0) -> list[int]:
        """Wait until every listener has ``expected`` notifications (or ``timeout_s``
        seconds); returns the counts."""
        give_up = time.monotonic() + timeout_s
        while min(self.received, default=expected) < expected and time.monotonic() < give_up:
            time.sleep(0.05)
        if self._errors:
            raise self._errors[0]
        return list(self.received)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)


# --- runs -------------------------------------------------------------------------------------------


def gap_seconds(mode: str, interval_s: float, min_gap_s: float) -> float:
    """G of the latency phase, seconds: ``min_gap_s`` in listen mode; in poll mode the
    smallest multiple of the interval that is at least ``min_gap_s``, so that a submit falls
    at a uniformly random phase of the claimer's tick."""
    if mode == "listen":
        return min_gap_s
    return interval_s * max(1, math.ceil(min_gap_s / interval_s - 1e-9))


def wakeup_run(server_url: str, template: str, *, mode: str, interval_s: float, claimers: int,
               submits: int, idle_s: float, herd_jobs: int, min_gap_s: float, measure_cpu: bool,
               timeout_s: float) -> dict[str, Any]:
    """One wake-up run (idle, latency, herd phases) in a fresh database.

    Returns the run as JSON-ready data: mode, interval_s, latency_ms (list), the summaries
    (p50/p95/max ms; idle claims/s; idle CPU ms/s; herd claims per job) and raw counts.
    """
    lanes = [f"lane{i}" for i in range(claimers)]
    ctx = multiprocessing.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    is_listen = mode == "listen"
    gap_s = gap_seconds(mode, interval_s, min_gap_s)
    with scratch_database(server_url, "pgd_bench_notify", template=template) as url:
        setup_world(url, lanes + [SHARED_POOL], notify=is_listen)
        args = [("claimer", url, i, mode, interval_s, [lanes[i], SHARED_POOL], out, stop, timeout_s)
                for i in range(claimers)]
        args.append(("submitter", url, lanes, submits, gap_s, idle_s,
                     herd_jobs if is_listen else 0, claimers, out, stop, measure_cpu,
                     max(30.0, 5 * interval_s)))
        workers = run_processes(_role, args, timeout_seconds=timeout_s)
        with db.connect(url, application_name="bench-check") as conn:
            succeeded = conn.execute(CLAIMED_JOBS).fetchone()["n"]
    claim_workers, sub = workers[:-1], workers[-1]
    expected = submits + (herd_jobs if is_listen else 0)
    if succeeded != expected:
        raise AssertionError(f"{mode}: {succeeded} jobs succeeded, expected {expected}")
    statements = [e for w in claim_workers for e in w["claims"]]
    idle_from, idle_to = sub["idle"]
    idle_claims = sum(1 for e in statements if idle_from <= e[0] < idle_to)
    idle_window = idle_to - idle_from
    lat = sub["latencies"]
    latency_ms = [(x["claimed"] - x["commit_sent"]) * 1000 for x in lat]
    wake_ms = [(x["claim_sent"] - x["commit_sent"]) * 1000 for x in lat]
    commit_ms = [(x["committed"] - x["commit_sent"]) * 1000 for x in lat]
    herd = None
    if sub["herd"]:
        h_from, h_to = sub["herd"]
        herd_claims = sum(1 for e in statements if h_from <= e[0] < h_to)
        # the fallback ticks that fall into the window are not the herd's doing
        herd_ticks = sum(1 for e in statements if h_from <= e[0] < h_to and e[3] == "tick")
        herd = {"jobs": herd_jobs, "claims": herd_claims, "tick_claims": herd_ticks,
                "claims_per_job": (herd_claims - herd_ticks) / herd_jobs}
    label = "listen" if is_listen else f"poll {interval_s:g} s"
    return {
        "mode": mode, "label": label, "interval_s": interval_s, "claimers": claimers,
        "submits": len(latency_ms), "gap_s": gap_s,
        "latency_ms": latency_ms, "wake_ms": wake_ms,
        "p50_ms": percentile(latency_ms, 50), "p95_ms": percentile(latency_ms, 95),
        "max_ms": max(latency_ms) if latency_ms else None,
        "mean_ms": statistics.fmean(latency_ms) if latency_ms else None,
        "wake_p50_ms": percentile(wake_ms, 50),
        "commit_ms": commit_ms, "commit_p50_ms": percentile(commit_ms, 50),
        "idle_seconds": idle_window, "idle_claims": idle_claims,
        "idle_claims_per_s": idle_claims / idle_window,
        "idle_cpu_ms_per_s": (None if sub["cpu_seconds"] is None
                              else sub["cpu_seconds"] * 1000 / idle_window),
        "claim_statements": len(statements),
        "empty_claims": sum(1 for e in statements if e[2] is None),
        "claims_by_reason": {r: sum(1 for e in statements if e[3] == r)
                             for r in sorted({e[3] for e in statements})},
        "notifications": sum(w["notifications"] for w in claim_workers),
        "herd": herd,
    }


def throughput_run(server_url: str, template: str, *, variant: str, clients: int, jobs: int,
                   listeners: int, timeout_s: float) -> dict[str, Any]:
    """One submit-throughput run (``variant`` plain or notify) in a fresh database.
    Returns {"variant", "clients", "jobs", "seconds", "jobs_per_s", "received": [per listener],
    "waits": WaitSampler.summary of the submitters' sessions}."""
    ctx = multiprocessing.get_context("spawn")
    finished = ctx.Value("i", 0)
    pool = "bench"
    with scratch_database(server_url, "pgd_bench_notify", template=template) as url:
        pool_id = setup_world(url, [pool], notify=variant == "notify")[pool]
        per = [jobs // clients + (1 if i < jobs % clients else 0) for i in range(clients)]
        args = [("submit", url, i, per[i], pool, finished) for i in range(clients)]
        want = jobs if variant == "notify" else 0
        args += [("listen", url, i, pool_id, clients, want, finished) for i in range(listeners)]
        with WaitSampler(url, "bench-notify-submit-%") as sampler:
            workers = run_processes(_role, args, timeout_seconds=timeout_s)
        with db.connect(url, application_name="bench-check") as conn:
            in_table = conn.execute(COUNT_JOBS).fetchone()["n"]
    subs, lis = workers[:clients], workers[clients:]
    if in_table != jobs or sum(w["done"] for w in subs) != jobs:
        raise AssertionError(f"{variant} N={clients}: {in_table} jobs in the table, expected {jobs}")
    received = [w["received"] for w in lis]
    if any(r != want for r in received):
        raise AssertionError(f"{variant} N={clients}: listeners received {received}, expected {want} each")
    seconds = max(w["end"] for w in subs) - min(w["start"] for w in subs)
    return {"variant": variant, "clients": clients, "jobs": jobs, "listeners": listeners,
            "seconds": seconds, "jobs_per_s": jobs / seconds, "received": received,
            "waits": sampler.summary(clients)}


def ceiling_run(server_url: str, template: str, *, variant: str, clients: int, seconds: int,
                listeners: int, timeout_s: float) -> dict[str, Any]:
    """One pgbench run of ``CEILING_SCRIPT`` (``variant`` plain or notify) for ``seconds``
    seconds at ``clients`` clients, ``listeners`` listening, in a fresh database.
    Returns {"variant", "clients", "seconds", "tps" and "jobs_per_s" (both transactions/s),
    "rows", "received", "waits"}."""
    pool = "bench"
    with scratch_database(server_url, "pgd_bench_notify_ceiling", template=template) as url:
        pool_id = setup_world(url, [pool], notify=variant == "notify")[pool]
        with db.connect(url, application_name="bench-setup") as conn:
            project_id = conn.execute("SELECT id FROM projects WHERE name = %s", (PROJECT,)).fetchone()["id"]
        with ListenerThreads(url, WAKEUP_CHANNEL, listeners) as lis, \
                tempfile.TemporaryDirectory(prefix="pgd-bench-notify-") as tmp:
            script = Path(tmp) / "jobs.sql"
            script.write_text(CEILING_SCRIPT)
            with WaitSampler(url, "pgbench") as sampler:
                out = pgbench(url, "-n", "-c", str(clients), "-j", str(min(clients, 2)),
                              "-T", str(seconds), "-f", str(script), "-D", f"project_id={project_id}",
                              "-D", f"pool_id={pool_id}", timeout_seconds=timeout_s)
            with db.connect(url, application_name="bench-check") as conn:
                rows = conn.execute(COUNT_JOBS).fetchone()["n"]
            received = lis.wait_for(rows if variant == "notify" else 0)
    want = rows if variant == "notify" else 0
    if any(r != want for r in received):
        raise AssertionError(f"pgbench {variant} N={clients}: listeners received {received}, "
                             f"expected {want} each")
    tps = parse_tps(out)
    return {"variant": variant, "clients": clients, "seconds": seconds, "tps": tps,
            "jobs_per_s": tps, "rows": rows, "listeners": listeners, "received": received,
            "waits": sampler.summary(clients)}


# --- report -----------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def markdown(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def wakeup_table(runs: list[dict[str, Any]]) -> str:
    """Wake-up latency (ms) and idle load per mode."""
    rows = []
    for r in runs:
        rows.append((r["label"], str(r["submits"]), _fmt(r["wake_p50_ms"]), _fmt(r["p50_ms"]),
                     _fmt(r["p95_ms"]), _fmt(r["max_ms"]), _fmt(r["idle_claims_per_s"]),
                     _fmt(r["idle_cpu_ms_per_s"]),
                     _fmt(r["herd"]["claims_per_job"]) if r["herd"] else "—"))
    claimers = runs[0]["claimers"] if runs else 0
    return markdown(("claim wake-up", "submits", "p50 ms to claim sent", "p50 ms", "p95 ms",
                     "max ms", f"idle claims/s ({claimers} claimers)", "idle server CPU ms/s",
                     f"claims per job, {claimers} on one pool"), rows)


def throughput_summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N: median (min, max) of ``jobs_per_s`` for each variant, notify / plain, and the
    mean wait states of the runs (``WaitSampler.summary``'s means)."""
    out = []
    for n in sorted({r["clients"] for r in runs}):
        row: dict[str, Any] = {"clients": n}
        for v in ("plain", "notify"):
            xs = [r["jobs_per_s"] for r in runs if r["clients"] == n and r["variant"] == v]
            row[v] = ({"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": len(xs)}
                      if xs else None)
        row["ratio"] = (row["notify"]["median"] / row["plain"]["median"]
                        if row["plain"] and row["notify"] else None)
        for v in ("plain", "notify"):
            waits = [r["waits"]["mean"] for r in runs if r["clients"] == n and r["variant"] == v]
            row[f"{v}_waits"] = {k: statistics.fmean(w.get(k, 0.0) for w in waits)
                                 for k in sorted({k for w in waits for k in w})}
        out.append(row)
    return out


def throughput_table(summary: list[dict[str, Any]], *, unit: str = "jobs/s") -> str:
    """Throughput by N, plain vs NOTIFY in the transaction, with the mean number of the N
    sessions waiting on the NOTIFY lock and in a WAL flush (from ``WaitSampler``)."""
    def cell(s: dict[str, Any] | None) -> str:
        if not s:
            return "—"
        spread = f" ({s['min']:.0f}–{s['max']:.0f})" if s["runs"] > 1 else ""
        return f"{s['median']:.0f}{spread}"

    def waiting(waits: dict[str, float], key: str) -> str:
        return _fmt(waits.get(key, 0.0), ".2f")

    rows = [(str(r["clients"]), cell(r["plain"]), cell(r["notify"]), _fmt(r["ratio"], ".2f"),
             waiting(r["notify_waits"], NOTIFY_LOCK_WAIT),
             waiting(r["plain_waits"], WAL_FLUSH_WAIT) + " / " + waiting(r["notify_waits"], WAL_FLUSH_WAIT))
            for r in summary]
    return markdown(("N", f"plain {unit}", f"with NOTIFY {unit}", "NOTIFY / plain",
                     "sessions waiting on the NOTIFY lock (NOTIFY runs)",
                     "sessions in WAL flush, plain / NOTIFY"), rows)


# --- main ---------------------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def alternated(repeats: int, clients: Sequence[int]) -> list[tuple[int, int, str]]:
    """(repeat, N, variant) in run order: for each repeat and N both variants, the one that
    goes first rotating with the repeat, so that drift of the machine falls on both alike."""
    variants = ["plain", "notify"]
    return [(rep, n, v) for rep in range(repeats) for n in clients
            for v in variants[rep % 2:] + variants[:rep % 2]]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench notify``: run the parts, print the tables, save the JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench notify",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run (about a minute): fewer submits, jobs and repeats")
    parser.add_argument("--parts", default="wakeup,throughput,ceiling",
                        help="comma-separated: wakeup, throughput, ceiling (all)")
    parser.add_argument("--submits", type=int, help="wake-up: jobs per mode (200; quick 32)")
    parser.add_argument("--claimers", type=int, default=8, help="wake-up: claimer processes (8)")
    parser.add_argument("--intervals", type=_floats, default=[1.0, 0.2, 0.05],
                        help="wake-up: poll intervals in seconds (1.0,0.2,0.05)")
    parser.add_argument("--listen-fallback-seconds", type=float, default=1.0,
                        help="wake-up: fallback pass interval of the listen mode, seconds (1.0)")
    parser.add_argument("--idle-seconds", type=float, help="wake-up: idle window, seconds (5; quick 1)")
    parser.add_argument("--herd-jobs", type=int, help="wake-up: jobs on the shared pool (20; quick 4)")
    parser.add_argument("--gap-seconds", type=float, default=1.0,
                        help="wake-up: a lane's pause before each submit is U(0, G), G at least "
                             "this many seconds (1.0)")
    parser.add_argument("--clients", type=_ints,
                        help="throughput and ceiling: concurrent submitters N (1,4,8; quick 1,8)")
    parser.add_argument("--jobs", type=int, help="throughput: jobs per run (2000; quick 200)")
    parser.add_argument("--pgbench-seconds", type=int,
                        help="ceiling: whole seconds per pgbench run (5; quick 1)")
    parser.add_argument("--repeats", type=int, help="throughput and ceiling: repeats (3; quick 1)")
    parser.add_argument("--listeners", type=int, default=2,
                        help="throughput and ceiling: listening sessions in every run (2)")
    parser.add_argument("--timeout-seconds", type=float, default=600.0, help="per run (600)")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/notify-<UTC>.json)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    quick = args.quick or os.environ.get("BENCH_QUICK") == "1"
    submits = args.submits or (32 if quick else 200)
    idle_s = args.idle_seconds or (1.0 if quick else 5.0)
    herd_jobs = args.herd_jobs if args.herd_jobs is not None else (4 if quick else 20)
    jobs = args.jobs or (200 if quick else 2000)
    pgbench_s = args.pgbench_seconds or (1 if quick else 5)
    repeats = args.repeats or (1 if quick else 3)
    clients = args.clients or ([1, 8] if quick else [1, 4, 8])
    parts = set(args.parts.split(","))
    unknown = parts - {"wakeup", "throughput", "ceiling"}
    if unknown:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")

    started = dt.datetime.now(dt.timezone.utc)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    wakeups: list[dict[str, Any]] = []
    throughputs: list[dict[str, Any]] = []
    ceilings: list[dict[str, Any]] = []
    with bench_server() as (server_url, server_kind), \
            template_database(server_url, "pgd_bench_notify_template") as template:
        settings = server_settings(server_url)
        if "wakeup" in parts:
            modes = [("poll", i) for i in args.intervals] + [("listen", args.listen_fallback_seconds)]
            for mode, interval in modes:
                t_run = time.monotonic()
                run = wakeup_run(server_url, template, mode=mode, interval_s=interval,
                                 claimers=args.claimers, submits=submits, idle_s=idle_s,
                                 herd_jobs=herd_jobs, min_gap_s=args.gap_seconds,
                                 measure_cpu=server_kind == "embedded",
                                 timeout_s=args.timeout_seconds)
                run.update(wall_seconds=time.monotonic() - t_run, load_1min=os.getloadavg()[0])
                wakeups.append(run)
                print(f"  wake-up {run['label']}: p50 {_fmt(run['p50_ms'])} ms, "
                      f"p95 {_fmt(run['p95_ms'])} ms, idle {_fmt(run['idle_claims_per_s'])} "
                      f"claims/s ({run['wall_seconds']:.1f} s)", flush=True)
        if "throughput" in parts:
            for rep, n, v in alternated(repeats, clients):
                t_run = time.monotonic()
                run = throughput_run(server_url, template, variant=v, clients=n, jobs=jobs,
                                     listeners=args.listeners, timeout_s=args.timeout_seconds)
                run.update(repeat=rep, wall_seconds=time.monotonic() - t_run,
                           load_1min=os.getloadavg()[0])
                throughputs.append(run)
                print(f"  submit {v} N={n} #{rep + 1}: {run['jobs_per_s']:.0f} jobs/s "
                      f"({run['wall_seconds']:.1f} s)", flush=True)
        if "ceiling" in parts:
            for rep, n, v in alternated(repeats, clients):
                run = ceiling_run(server_url, template, variant=v, clients=n, seconds=pgbench_s,
                                  listeners=args.listeners,
                                  timeout_s=pgbench_s + args.timeout_seconds)
                run.update(repeat=rep, load_1min=os.getloadavg()[0])
                ceilings.append(run)
                print(f"  pgbench {v} N={n} #{rep + 1}: {run['tps']:.0f} transactions/s",
                      flush=True)
    summary = throughput_summary(throughputs)
    ceiling_summary = throughput_summary(ceilings)
    print()
    if wakeups:
        print(f"Wake-up latency (COMMIT of the submit sent -> claim returned, ms) and idle load; "
              f"listen = LISTEN/NOTIFY + fallback pass every {args.listen_fallback_seconds:g} s\n")
        print(wakeup_table(wakeups))
        print()
    if throughputs:
        print(f"Submit throughput, jobs/s: N submitters, sql.transitions.submit (median of "
              f"{repeats}; {jobs} jobs per run; {args.listeners} listeners)\n")
        print(throughput_table(summary))
        print()
    if ceilings:
        print(f"Ceiling, transactions/s: pgbench, one queued job INSERTed per transaction, N clients "
              f"(median of {repeats}; {pgbench_s:g} s per run; {args.listeners} listeners)\n")
        print(throughput_table(ceiling_summary, unit="tx/s"))
        print()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = args.out or RESULTS_DIR / f"notify-{started:%Y%m%dT%H%M%SZ}.json"
    out.write_text(json.dumps({
        "benchmark": "notify", "started_at": started.isoformat(),
        "command": "python -m bench notify" + (" " + " ".join(argv) if argv else ""),
        "quick": quick, "server": server_kind, "server_settings": settings,
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "elapsed_seconds": time.monotonic() - t0,
        "params": {"submits": submits, "claimers": args.claimers, "intervals": args.intervals,
                   "listen_fallback_seconds": args.listen_fallback_seconds, "idle_seconds": idle_s,
                   "gap_seconds": args.gap_seconds,
                   "herd_jobs": herd_jobs, "clients": clients, "jobs": jobs,
                   "pgbench_seconds": pgbench_s, "repeats": repeats, "listeners": args.listeners},
        "wakeup": wakeups, "throughput": throughputs, "throughput_summary": summary,
        "ceiling": ceilings, "ceiling_summary": ceiling_summary,
    }, indent=1, default=str) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
