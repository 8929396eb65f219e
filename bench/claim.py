"""Claim throughput of pgdispatch: N worker processes doing claim -> complete of no-op jobs.

Run it from the repository root (``python -m bench all`` runs it alternated with the peers and
the ceilings; this runs the pgdispatch series alone)::

    python -m bench claim [--clients 1,4,8,16] [--repeats 3] [--jobs 10000] [--quick]

Each run gets a fresh database (a copy of a migrated template) with one organization, one
pool and ``--projects`` projects (each granted the pool), then ``--jobs`` queued no-op jobs
(``["true"]``), spread round-robin over the projects and bulk-inserted with one
``INSERT ... SELECT generate_series`` (the SQL is here: benchmark set-up, not production).
Before those, ``--warmup`` jobs (2,000) are run to completion in batches and every table is
analyzed, untimed, so that the run starts from a queue with history and current planner
statistics (see ``prepare``).
``clients`` worker processes (``multiprocessing``, spawned) each open their own connection,
register their own runner row (``sql.transitions.register_runner``) and wait on a start
barrier; then each loops a *cycle* until no queued job is left. The clock runs from the
barrier until the last worker has finished (all jobs completed and the queue seen empty);
jobs/s = jobs / that wall-clock time, in seconds. After each run the database is checked:
every job succeeded, the project counters are back to 0 and no organization or pool slot is
held.

Cycles (``@cycle`` registers one; each becomes two series, limits free and limits binding):

* ``pgdispatch`` — today's transitions, one job per transaction: ``sql.transitions.claim``
  (organization, project and pool capacity reserved, job taken with SKIP LOCKED, generation
  bumped, attempt row inserted) then ``sql.transitions.complete`` with outcome ``succeeded``
  and the claim's receipt key (delivery receipt written, capacity released).

* ``pgdispatch-batch10``, ``pgdispatch-batch50`` — the batched transitions (``claim_batch``
  of up to 10 or 50 jobs of one project and pool, then ``complete_batch`` of them), with the
  same guarantees: a scheduler with that many free slots.

Limits: *free* sets organization ``max_running`` and pool ``slots`` to 100,000 (checked by
every claim, never reached) and gives the projects no bound of their own (the default: a
project bound makes that project's claims take turns, migration 0011, so until then it was
100,000 too); *binding* sets the
organization and the pool to ⌈N/2⌉ and each project to ⌈N/4⌉, so that about half of the
workers' claims find no capacity (at N = 1 nothing can bind: one loop holds one job at a
time). A worker whose claim finds nothing while jobs are still queued sleeps
``--idle-seconds`` and tries again; those empty claims are counted.

This module also holds what every throughput series shares: the server (embedded, or
``DATABASE_URL``'s), scratch databases, and the worker-process runner with its barrier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
import os
import queue
import shutil
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sql import config, db, migrate, transitions

POOL = "bench"
ORG = "bench"
FREE_LIMIT = 100_000

# --- SQL of the benchmark set-up (not production code) ------------------------------------

# Queued no-op jobs, round-robin over the projects; every other column takes its default
# (ready now, priority 0, one attempt), exactly as pgd_submit would write them.
INSERT_QUEUED_JOBS = """
INSERT INTO jobs (project_id, pool_id, state, command, submitted_by)
SELECT (%(project_ids)s::bigint[])[1 + g %% cardinality(%(project_ids)s::bigint[])],
       %(pool_id)s, 'queued', ARRAY['true'], 'bench'
  FROM generate_series(0, %(jobs)s::bigint - 1) AS g
"""

HAS_QUEUED = "SELECT EXISTS (SELECT 1 FROM jobs WHERE state = 'queued') AS more"

CHECK_DONE = """
SELECT (SELECT count(*) FROM jobs WHERE state = 'succeeded') AS succeeded,
       (SELECT count(*) FROM jobs) AS jobs,
       (SELECT count(*) FROM attempts WHERE state = 'succeeded') AS attempts,
       (SELECT count(*) FROM delivery_receipts) AS receipts,
       (SELECT coalesce(sum(pgd_organization_running(id)), 0) FROM organizations)
     + (SELECT coalesce(sum(pgd_project_running(id)), 0) FROM projects)
     + (SELECT coalesce(sum(pgd_pool_running(id)), 0) FROM pools) AS running
"""

SERVER_SETTINGS = ("server_version", "fsync", "synchronous_commit", "full_page_writes",
                   "shared_buffers", "max_connections", "work_mem", "max_wal_size")


# --- server and databases -----------------------------------------------------------------


def with_database(url: str, name: str) -> str:
    """``url`` with its database name replaced by ``name``."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


@contextlib.contextmanager
def bench_server() -> Iterator[tuple[str, str]]:
    """The one server of an invocation: DATABASE_URL's, or an embedded one started in a
    temporary directory and stopped (and removed) afterwards. Yields (url, kind)."""
    if os.environ.get("DATABASE_URL"):
        yield os.environ["DATABASE_URL"], "DATABASE_URL"
        return
    from sql.embedded import start_embedded, stop_embedded

    tmp = Path(tempfile.mkdtemp(prefix="pgd-bench-"))
    os.chmod(tmp, 0o755)  # the embedded server may run as its own unprivileged user
    try:
        yield start_embedded(tmp), "embedded"
    finally:
        stop_embedded(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def server_settings(url: str) -> dict[str, str]:
    """The server settings that bear on commit throughput (SHOW ...)."""
    with db.connect(url) as conn:
        return {k: conn.execute(f"SHOW {k}").fetchone()[k] for k in SERVER_SETTINGS}


def create_database(server_url: str, prefix: str, *, template: str | None = None) -> str:
    """Create ``<prefix>_<random>`` (a copy of ``template`` if given); returns its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with db.connect(server_url) as conn:
        conn.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
    return with_database(server_url, name)


def drop_database(server_url: str, url: str) -> None:
    """Drop the database of ``url`` (its sessions are ended first)."""
    name = urlsplit(url).path.lstrip("/")
    with db.connect(server_url) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextlib.contextmanager
def scratch_database(server_url: str, prefix: str, *, template: str | None = None) -> Iterator[str]:
    """A new database for one run, dropped afterwards. Yields its URL."""
    url = create_database(server_url, prefix, template=template)
    try:
        yield url
    finally:
        drop_database(server_url, url)


def make_template(server_url: str) -> str:
    """A migrated pgdispatch database to copy each run's database from; returns its name."""
    url = create_database(server_url, "pgd_bench_template")
    migrate.upgrade(url)
    return urlsplit(url).path.lstrip("/")


@dataclasses.dataclass
class Bench:
    """One invocation: the server, the migrated template, the run sizes, and resources the
    series create lazily (``state``) and release at ``close`` (``cleanups``)."""

    server_url: str
    server_kind: str
    template: str
    jobs: int
    projects: int = 4
    lease_seconds: float = 3600.0
    idle_seconds: float = 0.001
    timeout_seconds: float = 900.0
    tpcb_seconds: float = 10.0
    tpcb_scale: int = 16
    pgqueuer_batch: int = 10
    warmup: int = 2000
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    cleanups: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        """Release what the series created (databases), newest first."""
        while self.cleanups:
            with contextlib.suppress(Exception):
                self.cleanups.pop()()
        drop_database(self.server_url, with_database(self.server_url, self.template))


# --- limits and jobs --------------------------------------------------------------------------


def limits(clients: int, *, binding: bool) -> dict[str, int | None]:
    """Organization, pool and per-project limits for ``clients`` loops (see module doc)."""
    if not binding:
        return {"organization": FREE_LIMIT, "pool": FREE_LIMIT, "project": None}
    return {"organization": math.ceil(clients / 2), "pool": math.ceil(clients / 2),
            "project": math.ceil(clients / 4)}


def config_text(limit: dict[str, int | None], projects: int) -> str:
    """The apply file (TOML) declaring the bench organization, pool and projects."""
    lines = ["[[organizations]]", f'name = "{ORG}"', f"max_running = {limit['organization']}",
             "[[pools]]", f'name = "{POOL}"', f"slots = {limit['pool']}"]
    for p in range(projects):
        lines += ["[[projects]]", f'name = "p{p}"', f'organization = "{ORG}"', f'pools = ["{POOL}"]']
        if limit["project"] is not None:
            lines.append(f"max_running = {limit['project']}")
    return "\n".join(lines) + "\n"


def prepare(url: str, *, jobs: int, projects: int, limit: dict[str, int], warmup: int = 0) -> list[int]:
    """Apply the config and insert ``jobs`` queued no-op jobs; returns the pool ids.

    With ``warmup`` > 0, that many more jobs are queued first and run through claim_batch /
    complete_batch (50 at a time) before the timed run, then every table is analyzed: the
    run then starts with a history and planner statistics that describe a queue in service,
    not an empty install. (PL/pgSQL caches a plan per session; one made while ``attempts``
    held a few rows would scan it sequentially until autovacuum's ANALYZE, which on a live
    system follows within about a minute; a run of seconds on a fresh database never gets
    there.)
    """
    with db.connect(url, application_name="bench-setup") as conn:
        config.apply_config(conn, config_text(limit, projects), actor="bench", env={})
        project_ids = [r["id"] for r in conn.execute("SELECT id FROM projects ORDER BY id")]
        pool_id = conn.execute("SELECT id FROM pools WHERE name = %s", (POOL,)).fetchone()["id"]
        if warmup:
            conn.execute(INSERT_QUEUED_JOBS, {"project_ids": project_ids, "pool_id": pool_id, "jobs": warmup})
            conn.execute("ANALYZE")
            runner_id = transitions.register_runner(conn, name="bench-warmup", pools=[POOL], slots=50,
                                                    hostname="bench", pid=os.getpid())
            while claims := transitions.claim_batch(
                    conn, runner_id=runner_id, pools=[pool_id], lease_seconds=60,
                    claim_tokens=[transitions.new_claim_token() for _ in range(50)]):
                transitions.complete_batch(conn, items=[
                    {"attempt_id": c.attempt_id, "generation": c.generation, "outcome": "succeeded",
                     "exit_code": 0, "receipt_key": c.receipt_key} for c in claims])
            transitions.stop_runner(conn, runner_id=runner_id)
        conn.execute(INSERT_QUEUED_JOBS, {"project_ids": project_ids, "pool_id": pool_id, "jobs": jobs})
        conn.execute("VACUUM ANALYZE")
        return [pool_id]


def check_done(url: str, jobs: int) -> dict[str, int]:
    """Verify a run: every job succeeded once, with one attempt and one receipt, and nothing
    still holds capacity (``running``: the project counters plus the held organization and
    pool slots, 0). Raises AssertionError otherwise. ``jobs`` counts every job in the
    database, warm-up included."""
    with db.connect(url, application_name="bench-check") as conn:
        row = conn.execute(CHECK_DONE).fetchone()
    expected = {"succeeded": jobs, "jobs": jobs, "attempts": jobs, "receipts": jobs, "running": 0}
    if dict(row) != expected:
        raise AssertionError(f"run did not end clean: {dict(row)} != {expected}")
    return dict(row)


# --- cycles -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Loop:
    """What a worker's cycle needs: its runner row, its pools, the lease (seconds)."""

    runner_id: int
    pool_ids: list[int]
    lease_seconds: float


# cycle(conn, loop) -> jobs completed (0: nothing was eligible)
Cycle = Callable[[Any, Loop], int]


@dataclasses.dataclass(frozen=True)
class Series:
    """A throughput series: a name, a label for tables, what it is (``pgdispatch``, ``peer``
    or ``ceiling``), and ``run(bench, clients) -> result`` (one timed run)."""

    name: str
    label: str
    kind: str
    run: Callable[[Bench, int], dict[str, Any]]
    unavailable: Callable[[], str | None] = lambda: None


CYCLES: dict[str, Cycle] = {}
SERIES: dict[str, Series] = {}


def cycle(name: str, *, label: str) -> Callable[[Cycle], Cycle]:
    """Register a pgdispatch cycle as two series: ``name`` (limits free) and ``name-bound``
    (limits binding)."""

    def register(fn: Cycle) -> Cycle:
        CYCLES[name] = fn
        for binding in (False, True):
            series_name = f"{name}-bound" if binding else name
            SERIES[series_name] = Series(
                name=series_name, label=f"{label}, limits {'binding' if binding else 'free'}",
                kind="pgdispatch",
                run=lambda bench, clients, _c=name, _b=binding, _s=series_name: run_pgdispatch(
                    bench, clients, cycle_name=_c, binding=_b, series=_s))
        return fn

    return register


@cycle("pgdispatch", label="pgdispatch 1 job/txn")
def one_per_transaction(conn, loop: Loop) -> int:
    """Today's transitions: claim one job, complete it (outcome succeeded, receipt key)."""
    c = transitions.claim(conn, runner_id=loop.runner_id, pools=loop.pool_ids,
                          claim_token=transitions.new_claim_token(), lease_seconds=loop.lease_seconds)
    if c is None:
        return 0
    transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                         outcome="succeeded", exit_code=0, receipt_key=c.receipt_key)
    return 1


def batched(size: int) -> Cycle:
    """The batched transitions (claim_batch, migrations/0003; complete_batch, 0004): claim up
    to ``size`` jobs of one (project, pool) in one transaction, then complete them all in one
    — what a scheduler with ``size`` free slots does (scheduler/claiming.py)."""

    def run(conn, loop: Loop) -> int:
        claims = transitions.claim_batch(conn, runner_id=loop.runner_id, pools=loop.pool_ids,
                                         claim_tokens=[transitions.new_claim_token() for _ in range(size)],
                                         lease_seconds=loop.lease_seconds)
        if not claims:
            return 0
        transitions.complete_batch(conn, items=[
            {"attempt_id": c.attempt_id, "generation": c.generation, "outcome": "succeeded",
             "exit_code": 0, "receipt_key": c.receipt_key} for c in claims])
        return len(claims)

    run.__doc__ = f"claim_batch of up to {size}, then complete_batch of what it got"
    return run


cycle("pgdispatch-batch10", label="pgdispatch 10 jobs/txn")(batched(10))
cycle("pgdispatch-batch50", label="pgdispatch 50 jobs/txn")(batched(50))


# --- worker processes ---------------------------------------------------------------------------


def run_processes(target: Callable[..., dict[str, Any]], args: Sequence[tuple], *,
                  timeout_seconds: float) -> list[dict[str, Any]]:
    """Run ``target(barrier, *args[i])`` in ``len(args)`` spawned processes that start together.

    ``target`` does its set-up, calls ``barrier.wait()``, reads ``time.monotonic()`` as its
    ``start``, works, and returns a dict with ``start``, ``end`` (monotonic seconds; one
    clock for every process on Linux) and ``done`` (jobs). Returns the dicts in order.

    Raises:
        RuntimeError: a worker failed (its traceback is in the message) or did not finish in
        ``timeout_seconds``; every worker still running is terminated first.
    """
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(args))
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(i, results, target, barrier, a), daemon=True,
                         name=f"bench-worker-{i}")
             for i, a in enumerate(args)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_seconds
    try:
        while len(out) + len(errors) < len(procs):
            try:
                i, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout_seconds:.0f} s")
                    break
                dead = [p.name for j, p in enumerate(procs)
                        if j not in out and not p.is_alive() and p.exitcode not in (0, None)]
                if dead and results.empty():
                    errors.append(f"worker(s) died: {dead}")
                    break
                continue
            if ok:
                out[i] = value
            else:
                errors.append(value)
                barrier.abort()
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.terminate()
                p.join(5)
    if errors:
        raise RuntimeError("benchmark worker failed:\n" + "\n".join(errors))
    return [out[i] for i in range(len(procs))]


def _child(i: int, results, target, barrier, args: tuple) -> None:
    try:
        results.put((i, True, target(barrier, *args)))
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
        results.put((i, False, f"worker {i}:\n{traceback.format_exc()}"))


def throughput(series: str, clients: int, jobs: int, workers: list[dict[str, Any]],
               **extra: Any) -> dict[str, Any]:
    """One run's result from its workers' reports: wall clock from the first start (the
    barrier) to the last end, in seconds, and jobs per second."""
    start = min(w["start"] for w in workers)
    end = max(w["end"] for w in workers)
    done = sum(w["done"] for w in workers)
    if done != jobs:
        raise AssertionError(f"{series}: workers report {done} jobs done, expected {jobs}")
    seconds = end - start
    return {"series": series, "clients": clients, "jobs": jobs, "seconds": seconds,
            "jobs_per_s": jobs / seconds, **extra}


def pgdispatch_worker(barrier, url: str, index: int, cycle_name: str, pool_ids: list[int],
                      lease_seconds: float, idle_seconds: float) -> dict[str, Any]:
    """One claim loop (in its own process): register a runner, wait for the start, then run
    the cycle until no queued job is left."""
    run_cycle = CYCLES[cycle_name]
    with db.connect(url, application_name=f"bench-claim-{index}") as conn:
        runner_id = transitions.register_runner(conn, name=f"bench-{index}", pools=[POOL],
                                                slots=1, hostname="bench", pid=os.getpid())
        loop = Loop(runner_id=runner_id, pool_ids=list(pool_ids), lease_seconds=lease_seconds)
        done = empty = 0
        barrier.wait(timeout=120)
        start = time.monotonic()
        while True:
            n = run_cycle(conn, loop)
            if n:
                done += n
                continue
            if not conn.execute(HAS_QUEUED).fetchone()["more"]:
                break
            empty += 1  # capacity full (binding limits) or a race: try again shortly
            time.sleep(idle_seconds)
        end = time.monotonic()
    return {"start": start, "end": end, "done": done, "empty_claims": empty}


def run_pgdispatch(bench: Bench, clients: int, *, cycle_name: str, binding: bool,
                   series: str) -> dict[str, Any]:
    """One timed run of a pgdispatch cycle at ``clients`` loops on a fresh database."""
    limit = limits(clients, binding=binding)
    with scratch_database(bench.server_url, "pgd_bench_claim", template=bench.template) as url:
        pool_ids = prepare(url, jobs=bench.jobs, projects=bench.projects, limit=limit,
                           warmup=bench.warmup)
        workers = run_processes(
            pgdispatch_worker,
            [(url, i, cycle_name, pool_ids, bench.lease_seconds, bench.idle_seconds)
             for i in range(clients)],
            timeout_seconds=bench.timeout_seconds)
        check_done(url, bench.jobs + bench.warmup)
    return throughput(series, clients, bench.jobs, workers, limits=limit,
                      empty_claims=sum(w["empty_claims"] for w in workers))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench claim``: the pgdispatch series alone (see ``bench.report``)."""
    from bench import report

    return report.run_cli(list(argv or []), prog="python -m bench claim",
                          only=[s.name for s in SERIES.values()], latency=False)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
