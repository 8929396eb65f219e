"""The fleet: what N idle scheduler hosts cost one PostgreSQL, how fast a fleet dispatches,
and whether every job still runs exactly once — direct and through a real PgBouncer.

Run it from the repository root::

    python -m bench fleet                       # N = 4, 40, 200; about 25-35 minutes
    python -m bench fleet --quick               # smoke run: N = 4, 12, short windows
    python -m bench fleet [--counts 4,40,200] [--routes direct,pooled-listen,pooled-poll]
                          [--slots 4] [--settle-seconds 30] [--window-seconds 30]
                          [--spaced-jobs 100] [--gap-seconds 0.2,0.5] [--burst-jobs 500]
                          [--paused-jobs 10000] [--wave 10] [--pool-size 20]
                          [--set PGDISPATCH_NAME=VALUE ...] [--no-takeover] [--out FILE.json]

One server for the invocation (``bench.common.bench_server``: an embedded PostgreSQL, or
``DATABASE_URL``'s, whose role must be a superuser: the bench reads every session's
statistics and sets ``track_functions``). One PgBouncer in front of it (tests/pooling/pgbouncer.py, as bench/pooled.py uses:
``pool_mode = transaction``, ``default_pool_size`` ``--pool-size``, prepared statements off,
as the schedulers' default PGDISPATCH_PREPARE_THRESHOLD is). Routes:

* ``direct`` — DATABASE_URL straight to PostgreSQL, listening on it (the default scheduler);
* ``pooled-listen`` — DATABASE_URL through PgBouncer, ``--listen-url`` straight to PostgreSQL;
* ``pooled-poll`` — DATABASE_URL through PgBouncer, ``--no-listen``: polling only.

For each route and each N of ``--counts`` (a *cell*): a fresh copy of a migrated template
with ``track_functions = 'all'``, a project ``p0`` and a paused project ``p1`` in pool
``bench``; N real scheduler processes, the product's CLI (``python -m pgdispatch scheduler
--pool bench --slots S --name fleet-<route>-<i>``), started ``--wave`` at a time, each wave
registered (and listening) before the next starts. A cell that does not fit — a scheduler
or listener refused with "remaining connection slots are reserved" / "too many clients",
or not registered in time — is reported as such with how many did fit, and the larger N
of that route are skipped (the ``direct`` route's figure is the direct-connection ceiling).

Then, in order:

1. settle ``--settle-seconds`` (an idle back-off reaches its cap), then an **idle window** of
   ``--window-seconds``: transactions of the bench database (``pg_stat_database``
   xact_commit + xact_rollback deltas; the bench samples from the ``postgres`` database, so
   none of its own counts), calls of every function (``pg_stat_user_functions``, read at
   the window's edges), CPU of the server's processes (utime + stime of the postmaster,
   its children and its reaped children, from /proc; embedded server only) and of
   PgBouncer, server connections of the database (``pg_stat_activity``, sampled every
   second: the maximum), PgBouncer's SHOW POOLS / SERVERS / CLIENTS at the end, and the
   schedulers' resident memory;
2. ``--paused-jobs`` queued jobs inserted into the paused project (notifications off for
   that one statement), settle, and the same idle window again: a waiting backlog that no
   one may claim must not raise the idle cost;
3. **spaced dispatch**: ``--spaced-jobs`` no-op jobs (``true``) submitted one at a time
   through the route's DATABASE_URL (``pgdispatch.sql.transitions.submit``, as a CI
   system submits) with a pause of U(``--gap-seconds``) between them;
4. **burst**: ``--burst-jobs`` no-op jobs inserted in one statement (as pgd_submit writes
   them); its drain time is from the insert to the last job finished;
5. with ``--takeover`` (the default) and a ``duty_leases`` table in the schema, once per
   invocation: the holder of the duties is killed (SIGKILL) and the gap from its death to
   the new holder's ``held_since`` is read from the database;
6. SIGTERM to every scheduler, and the **exactly-once** check over every job of the cell:
   each job of ``p0`` has exactly one attempt, no two attempts of one job overlap, every
   job and attempt succeeded, and no job of the paused project was ever claimed. A
   violation fails the benchmark (exit 1, "EXACTLY-ONCE VIOLATED").

Dispatch latency is read from the database: ``attempts.claimed_at`` (the claim's
clock_timestamp() after its reservations) minus ``jobs.ready_at`` (the submitting
transaction's now(): ready on submit), milliseconds; p50/p95/p99 by nearest rank. *Extra
claim transactions per job* in a phase: calls of ``pgd_claim`` and ``pgd_claim_batch`` in it,
minus the idle window's claim rate times the phase's length, minus the jobs, over the jobs
(0: each job cost one claim beyond what idle polling costs anyway; negative: fewer idle
polls happened while busy).

Scheduler settings: every ``PGDISPATCH_*`` variable of the bench's own environment (except
the data folder and the listener's, which the bench sets) and each ``--set`` is passed to
every scheduler, and recorded with the values they resolve to (``Settings.from_env``), so
the same command measures the code before and after a settings change
(PGDISPATCH_CLAIM_IDLE_CAP_SECONDS, PGDISPATCH_DUTY_LEASE_SECONDS, ...).

Output: a markdown table on stdout and in ``bench/results/fleet-<UTC timestamp>.md``, and
``bench/results/fleet-<UTC timestamp>.json`` (gitignored): the machine, the exact command,
server and scheduler settings, and every figure. Statistics reach pg_stat views with a lag
(a backend flushes at most once a second, an idle one within about 10 s): over a window of
30 s the deltas are steady-state figures, not exact counts. On a shared machine the CPU and
latency figures are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pgdispatch.sql import Settings, config, db, transitions
from tests.pooling import pgbouncer

from .common import (INSERT_QUEUED_JOBS, POOL, RESULTS_DIR, ROOT, bench_server, config_text,
                     database_name, git_commit, limits, machine, percentile, scratch_database,
                     server_settings, template_database)

ROUTES = ("direct", "pooled-listen", "pooled-poll")
CLAIM_FUNCTIONS = ("pgd_claim", "pgd_claim_batch")
# what PostgreSQL answers a connection beyond max_connections (a superuser past the reserved
# slots: "too many clients already"; another login: "remaining connection slots are reserved")
CONNECTION_LIMIT = ("remaining connection slots are reserved", "too many clients already")
# settings the schedulers read, recorded as given (the resolved values are recorded too)
KNOWN_SETTINGS = ("CLAIM_INTERVAL", "CLAIM_IDLE_CAP", "EXPIRE_INTERVAL", "SUMMARY_INTERVAL",
                  "HEARTBEAT", "RUNNER_BEAT", "DUTY_LEASE", "LEASE")
# set by the bench per route, never passed through
OWN_VARIABLES = ("PGDISPATCH_DATA_DIR", "PGDISPATCH_LISTEN", "PGDISPATCH_LISTEN_URL")
JOB_TIMEOUT_S = 300.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- processes ------------------------------------------------------------------------------


@dataclasses.dataclass
class Fleet:
    """The scheduler processes of one cell."""

    route: str
    names: list[str]
    procs: list[subprocess.Popen]
    folder: Path
    killed: set[int] = dataclasses.field(default_factory=set)

    def log_tail(self, i: int, chars: int = 400) -> str:
        path = self.folder / f"{self.names[i]}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def refused(self, indices: Sequence[int]) -> str | None:
        """The first connection-limit line in the logs of schedulers ``indices``, if any."""
        for i in indices:
            for line in self.log_tail(i, 20000).splitlines():
                if any(s in line for s in CONNECTION_LIMIT):
                    return line.strip()[-300:]
        return None

    def stop(self, timeout_s: float = 60.0) -> list[int | None]:
        """SIGTERM every scheduler, wait, SIGKILL what is left; the exit codes."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        return [p.returncode for p in self.procs]


def scheduler_env(passed: dict[str, str]) -> dict[str, str]:
    """The environment of every scheduler: the bench's, without any database URL or
    PGDISPATCH_* setting of its own, plus ``passed``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PGDISPATCH_") and k != "DATABASE_URL"}
    env.update(passed)
    return env


def passed_settings(overrides: Sequence[str]) -> dict[str, str]:
    """PGDISPATCH_* of the bench's environment and ``--set NAME=VALUE``, for the schedulers."""
    out = {k: v for k, v in os.environ.items()
           if k.startswith("PGDISPATCH_") and k not in OWN_VARIABLES}
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("PGDISPATCH_") or name in OWN_VARIABLES:
            raise SystemExit(f"--set {item!r}: want PGDISPATCH_NAME=VALUE (not {', '.join(OWN_VARIABLES)})")
        out[name] = value
    return out


def resolved_settings(passed: dict[str, str]) -> dict[str, Any]:
    """What a scheduler resolves from ``passed``: every Settings field but secrets and paths."""
    settings = Settings.from_env(dict(passed))
    values = dataclasses.asdict(settings)
    for private in ("database_url", "secret_key", "data_dir"):
        values.pop(private, None)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}


def start_fleet(route: str, n: int, *, direct_url: str, route_url: str, slots: int, wave: int,
                env: dict[str, str], folder: Path, mon, watch, timeout_s: float
                ) -> tuple[Fleet, dict[str, Any]]:
    """Start ``n`` schedulers of ``route``, ``wave`` at a time; each wave registered (and,
    with a listener, listening) before the next. Returns the fleet and how it fit:
    ``{"fits": bool, "registered": k, "listening": l, "refusal": line | None, ...}``."""
    env = dict(env, DATABASE_URL=route_url, PGDISPATCH_DATA_DIR=str(folder / "data"))
    listen = {"direct": [], "pooled-listen": ["--listen-url", direct_url],
              "pooled-poll": ["--no-listen"]}[route]
    listening_wanted = route != "pooled-poll"
    fleet = Fleet(route, [], [], folder)
    dbname = database_name(direct_url)
    started = time.monotonic()
    fit: dict[str, Any] = {"fits": True, "registered": 0, "listening": 0, "refusal": None}
    for first in range(0, n, wave):
        batch = range(first, min(n, first + wave))
        for i in batch:
            name = f"fleet-{route}-{i}"
            with open(folder / f"{name}.log", "wb") as log:
                fleet.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "pgdispatch", "scheduler", "--pool", POOL,
                     "--slots", str(slots), "--name", name, "--grace-seconds", "5", *listen],
                    env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL))
            fleet.names.append(name)
        want = len(fleet.procs)
        deadline = time.monotonic() + timeout_s
        while True:
            fit["registered"] = watch.execute(
                "SELECT count(*) AS n FROM runners WHERE stopped_at IS NULL").fetchone()["n"]
            fit["listening"] = listening(mon, dbname)
            refusal = fleet.refused(batch)
            exited = [fleet.names[i] for i in batch if fleet.procs[i].poll() is not None]
            if refusal or exited:
                fit.update(fits=False, refusal=refusal,
                           exited={fleet.names[i]: fleet.log_tail(i) for i in batch
                                   if fleet.procs[i].poll() is not None})
                break
            if fit["registered"] >= want and (not listening_wanted or fit["listening"] >= want):
                break
            if time.monotonic() > deadline:
                if fit["registered"] >= want:
                    # registered but not seen listening, and nothing refused: measured anyway
                    # (a listener that runs other statements on its session is not seen)
                    fit["warning"] = f"{fit['listening']} of {want} seen listening after {timeout_s:g} s"
                    break
                fit.update(fits=False, refusal=f"not registered in {timeout_s:g} s")
                break
            time.sleep(0.25)
        print(f"    {route}: {fit['registered']}/{n} registered, {fit['listening']} listening "
              f"({time.monotonic() - started:.0f} s)", flush=True)
        if not fit["fits"]:
            break
    fit["start_seconds"] = time.monotonic() - started
    fit["server_connections"] = server_connections(mon, dbname)
    return fleet, fit


# --- what the server and PgBouncer say --------------------------------------------------------


def listening(mon, dbname: str) -> int:
    """Wake-up listeners of ``dbname``: sessions named as sql/scheduling.py's listener names
    its own, or whose last statement was a LISTEN."""
    return mon.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = %s "
                       "AND (application_name = 'pgdispatch-listener' OR query ILIKE 'LISTEN %%')",
                       (dbname,)).fetchone()["n"]


def server_connections(mon, dbname: str) -> int:
    """Client backends connected to ``dbname`` now, but the bench's own (its watch and
    submit sessions, by application_name; through PgBouncer the submitter's server
    connection is a pooled one and counts)."""
    return mon.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = %s "
                       "AND backend_type = 'client backend' "
                       "AND application_name NOT LIKE 'bench-fleet%%'", (dbname,)).fetchone()["n"]


def transactions(mon, dbname: str) -> int:
    """xact_commit + xact_rollback of ``dbname`` (read from another database: no own count)."""
    return mon.execute("SELECT xact_commit + xact_rollback AS n FROM pg_stat_database "
                       "WHERE datname = %s", (dbname,)).fetchone()["n"]


def function_calls(watch) -> dict[str, int]:
    """Calls per function of the bench database so far (track_functions = 'all')."""
    return {r["funcname"]: r["calls"] for r in watch.execute(
        "SELECT funcname, sum(calls)::bigint AS calls FROM pg_stat_user_functions "
        "GROUP BY funcname")}


def claim_calls(calls: dict[str, int]) -> int:
    return sum(calls.get(f, 0) for f in CLAIM_FUNCTIONS)


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # from field 3 (state) on


def postmaster_pid(mon) -> int | None:
    """The server's postmaster (the parent of this session's backend), when it is local."""
    fields = _stat(mon.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"])
    return int(fields[1]) if fields else None


def server_cpu_seconds(postmaster: int) -> float:
    """CPU seconds of the postmaster, its live children and its reaped children."""
    own = _stat(postmaster)
    if own is None:
        return float("nan")
    ticks = sum(int(own[i]) for i in (11, 12, 13, 14))
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and fields[1] == str(postmaster):
                ticks += int(fields[11]) + int(fields[12])
    return ticks / CLK_TCK


def process_cpu_seconds(pid: int) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK if fields else float("nan")


def rss_mb(pids: Sequence[int]) -> float:
    """Resident memory of ``pids`` in MiB."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


def pgbouncer_view(bouncer: pgbouncer.PgBouncer | None, dbname: str) -> dict[str, Any] | None:
    """PgBouncer's pools of ``dbname`` and its server and client connections to it."""
    if bouncer is None:
        return None
    pools = [r for r in bouncer.show("POOLS") if r.get("database") == dbname]
    servers = [r for r in bouncer.show("SERVERS") if r.get("database") == dbname]
    clients = [r for r in bouncer.show("CLIENTS") if r.get("database") == dbname]
    return {"pools": pools, "server_connections": len(servers),
            "client_connections": len(clients),
            "clients_waiting": sum(int(p.get("cl_waiting") or 0) for p in pools)}


# --- the phases ------------------------------------------------------------------------------


def idle_window(seconds: float, *, n: int, mon, watch, dbname: str, postmaster: int | None,
                bouncer: pgbouncer.PgBouncer | None, fleet: Fleet) -> dict[str, Any]:
    """One idle window's figures (module docstring, step 1)."""
    f0 = function_calls(watch)
    x0 = transactions(mon, dbname)
    c0 = server_cpu_seconds(postmaster) if postmaster else None
    b0 = process_cpu_seconds(bouncer.pid) if bouncer else None
    t0 = time.monotonic()
    peak = 0
    while time.monotonic() - t0 < seconds:
        peak = max(peak, server_connections(mon, dbname))
        time.sleep(min(1.0, max(0.0, seconds - (time.monotonic() - t0))))
    elapsed = time.monotonic() - t0
    x1 = transactions(mon, dbname)
    c1 = server_cpu_seconds(postmaster) if postmaster else None
    b1 = process_cpu_seconds(bouncer.pid) if bouncer else None
    f1 = function_calls(watch)
    calls = {k: v - f0.get(k, 0) for k, v in f1.items() if v - f0.get(k, 0)}
    tx_s = (x1 - x0) / elapsed
    cpu_ms_s = None if c0 is None else (c1 - c0) * 1000 / elapsed
    return {
        "seconds": elapsed, "transactions": x1 - x0, "tx_per_s": tx_s, "tx_per_s_per_scheduler": tx_s / n,
        "server_cpu_ms_per_s": cpu_ms_s,
        "server_cpu_ms_per_s_per_scheduler": None if cpu_ms_s is None else cpu_ms_s / n,
        "pgbouncer_cpu_ms_per_s": None if b0 is None else (b1 - b0) * 1000 / elapsed,
        "claim_calls_per_s": claim_calls(calls) / elapsed,
        "function_calls_per_s": {k: v / elapsed for k, v in sorted(calls.items(), key=lambda kv: -kv[1])},
        "server_connections_max": peak, "pgbouncer": pgbouncer_view(bouncer, dbname),
        "scheduler_rss_mb": rss_mb([p.pid for p in fleet.procs if p.poll() is None]) / max(1, n),
    }


def wait_finished(watch, ids: Sequence[int], timeout_s: float) -> float:
    """Until every job of ``ids`` has finished; returns the database's clock then (epoch s).

    Raises: RuntimeError when some did not finish in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = watch.execute("SELECT count(*) AS n FROM jobs WHERE id = ANY(%s) AND finished_at IS NULL",
                             (list(ids),)).fetchone()["n"]
        if not left:
            return watch.execute("SELECT extract(epoch FROM max(finished_at))::float8 AS t FROM jobs "
                                 "WHERE id = ANY(%s)", (list(ids),)).fetchone()["t"]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{left} of {len(ids)} jobs not finished in {timeout_s:g} s")
        time.sleep(0.1)


def latencies_ms(watch, ids: Sequence[int]) -> list[float]:
    """claimed_at of the first attempt minus ready_at, per job, milliseconds."""
    return [r["ms"] for r in watch.execute(
        "SELECT extract(epoch FROM a.claimed_at - j.ready_at)::float8 * 1000 AS ms FROM jobs j "
        "JOIN attempts a ON a.job_id = j.id AND a.attempt_no = 1 WHERE j.id = ANY(%s)", (list(ids),))]


def summary(latencies: list[float]) -> dict[str, Any]:
    return {"jobs": len(latencies), "p50_ms": percentile(latencies, 50),
            "p95_ms": percentile(latencies, 95), "p99_ms": percentile(latencies, 99),
            "max_ms": max(latencies) if latencies else None}


def extra_claims(watch, before: dict[str, int], *, jobs: int, seconds: float,
                 idle_claims_per_s: float) -> dict[str, Any]:
    calls = claim_calls(function_calls(watch)) - claim_calls(before)
    return {"claim_calls": calls, "idle_claims_expected": idle_claims_per_s * seconds,
            "extra_claims_per_job": (calls - idle_claims_per_s * seconds - jobs) / jobs,
            "claim_calls_per_job_raw": calls / jobs}


def spaced(route_url: str, watch, *, jobs: int, gap_s: tuple[float, float], rng: random.Random,
           idle_claims_per_s: float) -> dict[str, Any]:
    """Step 3: one job at a time through the route, then the latencies."""
    before = function_calls(watch)
    t0 = time.monotonic()
    ids = []
    with db.connect(route_url, application_name="bench-fleet-submit") as conn:
        for i in range(jobs):
            if i:
                time.sleep(rng.uniform(*gap_s))
            ids.append(transitions.submit(conn, project="p0", pool=POOL, command=["true"],
                                          submitted_by="bench-fleet")["id"])
    wait_finished(watch, ids, JOB_TIMEOUT_S)
    seconds = time.monotonic() - t0
    return {**summary(latencies_ms(watch, ids)), "seconds": seconds,
            **extra_claims(watch, before, jobs=jobs, seconds=seconds,
                           idle_claims_per_s=idle_claims_per_s)}


def burst(watch, *, jobs: int, project_id: int, pool_id: int, idle_claims_per_s: float
          ) -> dict[str, Any]:
    """Step 4: ``jobs`` jobs in one statement, then the latencies and the drain time."""
    before = function_calls(watch)
    t0 = time.monotonic()
    last = watch.execute("SELECT coalesce(max(id), 0) AS id FROM jobs").fetchone()["id"]
    watch.execute(INSERT_QUEUED_JOBS, {"project_ids": [project_id], "pool_id": pool_id, "jobs": jobs})
    ids = [r["id"] for r in watch.execute("SELECT id FROM jobs WHERE id > %s AND project_id = %s",
                                          (last, project_id))]
    ready = watch.execute("SELECT extract(epoch FROM min(ready_at))::float8 AS t FROM jobs "
                          "WHERE id = ANY(%s)", (ids,)).fetchone()["t"]
    finished = wait_finished(watch, ids, JOB_TIMEOUT_S)
    seconds = time.monotonic() - t0
    return {**summary(latencies_ms(watch, ids)), "drain_seconds": finished - ready,
            "seconds": seconds, **extra_claims(watch, before, jobs=jobs, seconds=seconds,
                                               idle_claims_per_s=idle_claims_per_s)}


def takeover(watch, fleet: Fleet, timeout_s: float) -> dict[str, Any]:
    """Step 5: SIGKILL the holder of the duties; the gap to the next holder, per duty."""
    if watch.execute("SELECT to_regclass('duty_leases') IS NOT NULL AS ok").fetchone()["ok"] is False:
        return {"measured": False, "why": "no duty_leases table"}
    cols = [r["column_name"] for r in watch.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'duty_leases' "
        "ORDER BY ordinal_position")]
    holder = next((c for c in cols if "runner" in c or "holder" in c), None)
    if holder is None or "held_since" not in cols:
        return {"measured": False, "why": f"duty_leases has no holder/held_since column: {cols}"}
    key = next((c for c in cols if c in ("duty", "name", "duty_name")), cols[0])
    # column names come from the catalog, not from input
    held = f"SELECT d.{key}::text AS duty, d.{holder} AS holder, d.held_since, r.name FROM duty_leases d " \
           f"JOIN runners r ON r.id = d.{holder}"
    deadline = time.monotonic() + timeout_s
    rows = []
    while not rows and time.monotonic() < deadline:
        rows = [r for r in watch.execute(held) if r["name"] in fleet.names]
        time.sleep(0.2)
    if not rows:
        return {"measured": False, "why": f"no duty held by a bench scheduler in {timeout_s:g} s"}
    victim = rows[0]["name"]
    duties = {r["duty"] for r in rows if r["name"] == victim}
    i = fleet.names.index(victim)
    fleet.procs[i].send_signal(signal.SIGKILL)
    fleet.procs[i].wait(10)
    fleet.killed.add(i)
    died = watch.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
    gaps: dict[str, float | None] = dict.fromkeys(duties)
    while any(v is None for v in gaps.values()) and time.monotonic() < deadline + timeout_s:
        for r in watch.execute(held):
            if r["duty"] in gaps and gaps[r["duty"]] is None and r["name"] != victim \
                    and r["held_since"] is not None and r["held_since"] >= died:
                gaps[r["duty"]] = (r["held_since"] - died).total_seconds()
        time.sleep(0.2)
    return {"measured": True, "killed": victim, "duties": sorted(duties), "gap_seconds": gaps,
            "max_gap_seconds": None if None in gaps.values() else max(gaps.values())}


EXACTLY_ONCE = """
SELECT
  (SELECT count(*) FROM jobs WHERE project_id = %(p0)s) AS jobs,
  (SELECT count(*) FROM jobs WHERE project_id = %(p0)s AND state <> 'succeeded') AS jobs_not_succeeded,
  (SELECT count(*) FROM jobs j WHERE project_id = %(p0)s
      AND (SELECT count(*) FROM attempts a WHERE a.job_id = j.id) <> 1) AS jobs_without_exactly_one_attempt,
  (SELECT count(*) FROM attempts WHERE state <> 'succeeded') AS attempts_not_succeeded,
  (SELECT count(*) FROM attempts a JOIN attempts b ON a.job_id = b.job_id AND a.id < b.id
      AND tstzrange(a.claimed_at, coalesce(a.finished_at, 'infinity'))
       && tstzrange(b.claimed_at, coalesce(b.finished_at, 'infinity'))) AS overlapping_attempts,
  (SELECT count(*) FROM attempts a JOIN jobs j ON j.id = a.job_id
      WHERE j.project_id = %(p1)s) AS paused_jobs_claimed
"""


def exactly_once(watch, *, p0: int, p1: int, expected: int) -> dict[str, Any]:
    """Step 6: the counts of EXACTLY_ONCE; ``ok`` when each is as it must be."""
    row = dict(watch.execute(EXACTLY_ONCE, {"p0": p0, "p1": p1}).fetchone())
    row["expected_jobs"] = expected
    row["ok"] = row["jobs"] == expected and all(v == 0 for k, v in row.items()
                                                if k not in ("jobs", "expected_jobs"))
    return row


def at_rest(server_url: str, template: str, seconds: float, postmaster: int | None) -> dict[str, Any]:
    """The server's own CPU with no scheduler (autovacuum, checkpointer, the bench's one
    sample a second): what every cell's server CPU includes, so the slope between counts,
    not the figure at small N, is the cost of a scheduler."""
    with scratch_database(server_url, "pgd_bench_fleet", template=template) as url, \
            db.connect(server_url, application_name="bench-fleet-monitor") as mon:
        dbname = database_name(url)
        x0 = transactions(mon, dbname)
        c0 = server_cpu_seconds(postmaster) if postmaster else None
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            server_connections(mon, dbname)
            time.sleep(1.0)
        elapsed = time.monotonic() - t0
        return {"seconds": elapsed, "tx_per_s": (transactions(mon, dbname) - x0) / elapsed,
                "server_cpu_ms_per_s": None if c0 is None
                else (server_cpu_seconds(postmaster) - c0) * 1000 / elapsed}


# --- one cell ----------------------------------------------------------------------------------


def run_cell(route: str, n: int, *, server_url: str, template: str, bouncer, args,
             env: dict[str, str], postmaster: int | None, rng: random.Random,
             do_takeover: bool) -> dict[str, Any]:
    """Every step of the module docstring for one route and N, on a fresh database."""
    cell: dict[str, Any] = {"route": route, "schedulers": n}
    with scratch_database(server_url, "pgd_bench_fleet", template=template) as url, \
            tempfile.TemporaryDirectory(prefix="pgd-bench-fleet-") as tmp, \
            db.connect(server_url, application_name="bench-fleet-monitor") as mon:
        dbname = database_name(url)
        mon.execute(f"ALTER DATABASE {dbname} SET track_functions = 'all'")
        folder = Path(tmp)
        os.chmod(folder, 0o755)
        with db.connect(url, application_name="bench-fleet-watch") as watch:
            config.apply_config(watch, config_text(limits(n * args.slots, binding=False), 2),
                                actor="bench", env={})
            transitions.pause_project(watch, project="p1", reason="bench: a backlog no one may claim",
                                      actor="bench")
            p0, p1 = (watch.execute("SELECT id FROM projects WHERE name = %s", (p,)).fetchone()["id"]
                      for p in ("p0", "p1"))
            pool_id = watch.execute("SELECT id FROM pools WHERE name = %s", (POOL,)).fetchone()["id"]
            route_url = url if route == "direct" else bouncer.url(url)
            fleet, fit = start_fleet(route, n, direct_url=url, route_url=route_url,
                                     slots=args.slots, wave=args.wave, env=env, folder=folder,
                                     mon=mon, watch=watch, timeout_s=args.start_timeout_seconds)
            cell["fit"] = fit
            try:
                if not fit["fits"]:
                    return cell
                window = dict(n=n, mon=mon, watch=watch, dbname=dbname, postmaster=postmaster,
                              bouncer=None if route == "direct" else bouncer, fleet=fleet)
                time.sleep(args.settle_seconds)
                cell["idle"] = idle_window(args.window_seconds, **window)
                print(f"    idle: {cell['idle']['tx_per_s']:.1f} tx/s "
                      f"({cell['idle']['tx_per_s_per_scheduler']:.2f} per scheduler)", flush=True)
                watch.execute("SET pgdispatch.notify = 'off'")
                watch.execute(INSERT_QUEUED_JOBS, {"project_ids": [p1], "pool_id": pool_id,
                                                   "jobs": args.paused_jobs})
                watch.execute("RESET pgdispatch.notify")
                watch.execute("ANALYZE jobs")
                time.sleep(args.settle_seconds)
                cell["idle_paused_backlog"] = idle_window(args.window_seconds, **window)
                cell["idle_paused_backlog"]["paused_jobs"] = args.paused_jobs
                print(f"    idle, {args.paused_jobs} paused jobs waiting: "
                      f"{cell['idle_paused_backlog']['tx_per_s']:.1f} tx/s", flush=True)
                idle_claims = cell["idle"]["claim_calls_per_s"]
                cell["spaced"] = spaced(route_url, watch, jobs=args.spaced_jobs, gap_s=args.gap,
                                        rng=rng, idle_claims_per_s=idle_claims)
                cell["burst"] = burst(watch, jobs=args.burst_jobs, project_id=p0, pool_id=pool_id,
                                      idle_claims_per_s=idle_claims)
                print(f"    spaced p99 {cell['spaced']['p99_ms']:.0f} ms, burst p99 "
                      f"{cell['burst']['p99_ms']:.0f} ms, extra claims/job "
                      f"{cell['spaced']['extra_claims_per_job']:.2f}", flush=True)
                if do_takeover:
                    try:
                        cell["takeover"] = takeover(watch, fleet,
                                                    timeout_s=args.takeover_timeout_seconds)
                    except Exception as exc:  # a schema this bench did not foresee: say so
                        cell["takeover"] = {"measured": False, "why": f"{type(exc).__name__}: {exc}"}
                    print(f"    duty takeover: {cell['takeover']}", flush=True)
            finally:
                codes = fleet.stop()
                cell["exit_codes_nonzero"] = {fleet.names[i]: c for i, c in enumerate(codes)
                                              if c not in (0, None) and i not in fleet.killed}
            cell["exactly_once"] = exactly_once(watch, p0=p0, p1=p1,
                                                expected=args.spaced_jobs + args.burst_jobs)
    return cell


# --- output ------------------------------------------------------------------------------------


def _f(value: Any, fmt: str = ".2f") -> str:
    return "–" if value is None else format(value, fmt)


def table(cells: list[dict[str, Any]]) -> str:
    lines = ["| route | N | idle tx/s per sched | … with paused backlog | server CPU ms/s per sched "
             "| server conns (max) | PgBouncer server / client conns | spaced p50 / p95 / p99 ms "
             "| burst p50 / p95 / p99 ms (drain s) | extra claims/job spaced / burst | exactly once |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for c in cells:
        if "idle" not in c:
            fit = c.get("fit", {})
            why = fit.get("refusal") or c.get("error") or "did not run"
            # the server's own words, not the log line's prefix
            why = next((phrase for phrase in CONNECTION_LIMIT if phrase in why), why)
            lines.append(f"| {c['route']} | {c['schedulers']} | does not fit: "
                         f"{fit.get('registered', 0)} registered, {fit.get('listening', 0)} listening "
                         f"({why[:80]}) | | | | | | | | |")
            continue
        i, ip, s, b = c["idle"], c["idle_paused_backlog"], c["spaced"], c["burst"]
        pgb = i["pgbouncer"]
        conns = "–" if pgb is None else f"{pgb['server_connections']} / {pgb['client_connections']}"
        lines.append(
            f"| {c['route']} | {c['schedulers']} | {_f(i['tx_per_s_per_scheduler'])} "
            f"| {_f(ip['tx_per_s_per_scheduler'])} | {_f(i['server_cpu_ms_per_s_per_scheduler'])} "
            f"| {i['server_connections_max']} "
            f"| {conns} "
            f"| {_f(s['p50_ms'], '.0f')} / {_f(s['p95_ms'], '.0f')} / {_f(s['p99_ms'], '.0f')} "
            f"| {_f(b['p50_ms'], '.0f')} / {_f(b['p95_ms'], '.0f')} / {_f(b['p99_ms'], '.0f')} "
            f"({_f(b['drain_seconds'], '.1f')}) "
            f"| {_f(s['extra_claims_per_job'])} / {_f(b['extra_claims_per_job'])} "
            f"| {'yes' if c['exactly_once']['ok'] else 'NO'} |")
    return "\n".join(lines)


def parse_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("want positive whole numbers, e.g. 4,40,200")
    return counts


def parse_gap(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    gap = (float(low), float(high or low))
    if not 0 <= gap[0] <= gap[1]:
        raise argparse.ArgumentTypeError("want MIN,MAX seconds with 0 <= MIN <= MAX")
    return gap


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench fleet``: every cell, the table, the JSON; 1 if exactly-once failed."""
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench fleet", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: N = 4, 12, short windows and few jobs (figures are not results)")
    p.add_argument("--counts", type=parse_counts, help="scheduler counts (4,40,200; quick 4,12)")
    p.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated: {', '.join(ROUTES)}")
    p.add_argument("--slots", type=int, default=4, help="slots of each scheduler (4)")
    p.add_argument("--settle-seconds", type=float, help="before each idle window (30; quick 2)")
    p.add_argument("--window-seconds", type=float, help="each idle window (30; quick 4)")
    p.add_argument("--spaced-jobs", type=int, help="jobs submitted one at a time (100; quick 10)")
    p.add_argument("--gap", "--gap-seconds", dest="gap", type=parse_gap,
                   help="pause between spaced submits, U(MIN,MAX) seconds (0.2,0.5; quick 0.05,0.2)")
    p.add_argument("--burst-jobs", type=int, help="jobs inserted at once (500; quick 50)")
    p.add_argument("--paused-jobs", type=int, help="jobs waiting in a paused project (10000; quick 1000)")
    p.add_argument("--wave", type=int, default=10, help="schedulers started at a time (10)")
    p.add_argument("--pool-size", type=int, default=20, help="PgBouncer default_pool_size (20)")
    p.add_argument("--start-timeout-seconds", type=float, default=90.0,
                   help="for one wave to register and listen (90)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                   help="a PGDISPATCH_* setting for every scheduler (repeatable)")
    p.add_argument("--takeover", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the duty takeover gap once, if duty_leases exists (on)")
    p.add_argument("--takeover-timeout-seconds", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, help="JSON file (default bench/results/fleet-<UTC>.json)")
    args = p.parse_args(argv)
    quick = args.quick
    args.counts = args.counts or ([4, 12] if quick else [4, 40, 200])
    defaults = {"settle_seconds": (2.0, 30.0), "window_seconds": (4.0, 30.0),
                "spaced_jobs": (10, 100), "gap": ((0.05, 0.2), (0.2, 0.5)),
                "burst_jobs": (50, 500), "paused_jobs": (1000, 10000)}
    for name, (q, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, q if quick else full)
    routes = [r for r in args.routes.split(",") if r]
    if set(routes) - set(ROUTES) or min(args.slots, args.wave, args.spaced_jobs, args.burst_jobs) < 1:
        p.error(f"routes are {', '.join(ROUTES)}; slots, wave and job counts at least 1")
    passed = passed_settings(args.overrides)
    env = scheduler_env(passed)
    started = dt.datetime.now(dt.timezone.utc)
    facts = {"benchmark": "fleet", "started_at": started.isoformat(),
             "command": shlex.join(["python", "-m", "bench", "fleet", *argv]), "quick": quick,
             "git": git_commit(), "machine": machine() | {"memory_gib": _memory_gib()},
             "pgbouncer": pgbouncer.version(),
             "scheduler_settings": {"passed": passed, "resolved": resolved_settings(passed),
                                    "known_names_unset": [f"PGDISPATCH_{k}_SECONDS" for k in KNOWN_SETTINGS
                                                          if f"PGDISPATCH_{k}_SECONDS" not in passed]},
             "params": {k: v for k, v in vars(args).items() if k != "out"}}
    cells: list[dict[str, Any]] = []
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    failed = False
    with bench_server() as (server_url, server_kind), \
            template_database(server_url, "pgd_bench_fleet_template") as template:
        facts["server"] = server_kind
        with db.connect(server_url) as conn:
            facts["server_settings"] = server_settings(server_url) | {
                k: conn.execute(f"SHOW {k}").fetchone()[k]
                for k in ("superuser_reserved_connections", "reserved_connections")
                if conn.execute("SELECT 1 FROM pg_settings WHERE name = %s", (k,)).fetchone()}
            postmaster = postmaster_pid(conn) if server_kind == "embedded" else None
        bouncer = None
        if any(r != "direct" for r in routes):
            bouncer = pgbouncer.PgBouncer(server_url, pool_size=args.pool_size,
                                          max_client_conn=max(args.counts) * (args.slots + 6) + 200)
        takeover_done = not args.takeover
        facts["at_rest"] = at_rest(server_url, template, args.window_seconds, postmaster)
        print(f"== at rest: server CPU {_f(facts['at_rest']['server_cpu_ms_per_s'], '.1f')} ms/s",
              flush=True)
        try:
            for route in routes:
                for n in sorted(args.counts):
                    print(f"== {route}, N = {n}", flush=True)
                    t_cell = time.monotonic()
                    try:
                        cell = run_cell(route, n, server_url=server_url, template=template,
                                        bouncer=bouncer, args=args, env=env, postmaster=postmaster,
                                        rng=rng, do_takeover=not takeover_done and n >= 2)
                    except Exception as exc:  # reported in the table; the other cells still run
                        cell = {"route": route, "schedulers": n, "error": f"{type(exc).__name__}: {exc}"}
                        print(f"    FAILED: {cell['error']}", flush=True)
                        failed = True
                    cell["wall_seconds"] = time.monotonic() - t_cell
                    cell["load_1min"] = os.getloadavg()[0]
                    cells.append(cell)
                    if cell.get("takeover", {}).get("measured") or \
                            cell.get("takeover", {}).get("why") == "no duty_leases table":
                        takeover_done = True
                    once = cell.get("exactly_once")
                    if once is not None and not once["ok"]:
                        print(f"    EXACTLY-ONCE VIOLATED: {once}", flush=True)
                        failed = True
                    if "fit" in cell and not cell["fit"]["fits"]:
                        print(f"    does not fit: {cell['fit']['refusal']}; skipping larger N "
                              f"of {route}", flush=True)
                        break
        finally:
            if bouncer is not None:
                bouncer.stop()
    direct = [c for c in cells if c["route"] == "direct" and "fit" in c]
    ceiling = next(({"fits": False, "schedulers_registered": c["fit"]["registered"],
                     "tried": c["schedulers"], "refusal": c["fit"]["refusal"],
                     "server_connections": c["fit"]["server_connections"]}
                    for c in direct if not c["fit"]["fits"]),
                   {"fits": True, "schedulers": max((c["schedulers"] for c in direct), default=None)})
    takeovers = [c["takeover"] for c in cells if "takeover" in c]
    facts.update(cells=cells, direct_ceiling=ceiling if direct else None,
                 takeover=takeovers[0] if takeovers else None,
                 elapsed_seconds=time.monotonic() - t0, load_average_after=os.getloadavg())
    text = "\n".join([
        f"Fleet: idle cost, dispatch and exactly-once per route and scheduler count "
        f"({server_kind} PostgreSQL {facts['server_settings'].get('server_version')}, "
        f"{facts['pgbouncer']}, {facts['machine']['cpus']} CPUs; slots {args.slots} each)",
        f"command: {facts['command']}",
        f"scheduler settings passed: {passed or 'none (defaults)'}",
        f"server at rest (no scheduler): {_f(facts['at_rest']['server_cpu_ms_per_s'], '.1f')} "
        f"ms/s CPU", "",
        table(cells), "",
        "direct-connection ceiling: " + (
            "not measured" if not direct else
            f"{ceiling['schedulers_registered']} schedulers registered of {ceiling['tried']} tried, "
            f"then: {ceiling['refusal']}; max_connections "
            f"{facts['server_settings']['max_connections']}"
            if not ceiling["fits"] else f"all {ceiling['schedulers']} fit"),
        "duty takeover: " + (json.dumps(facts["takeover"], default=str) if takeovers else "not measured"),
    ])
    print("\n" + text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = args.out or RESULTS_DIR / f"fleet-{started:%Y%m%dT%H%M%SZ}.json"
    out.write_text(json.dumps(facts, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(text + "\n")
    print(f"saved {out} and {out.with_suffix('.md').name}")
    if failed:
        print("FLEET BENCHMARK FAILED (see above)", file=sys.stderr)
    return 1 if failed else 0


def _memory_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
