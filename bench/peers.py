"""The peers: PGQueuer and Procrastinate processing the same no-op jobs with their own workers.

Run it from the repository root (``python -m bench all`` runs it alternated with pgdispatch
and the ceilings; this runs the peers alone)::

    python -m bench peers [--clients 1,4,8,16] [--repeats 3] [--jobs 10000] [--quick]

Both are installed from the package index into the bench environment at the versions pinned
in ``bench/requirements.txt`` (``make bench`` does it); the versions found are printed and
saved with the results. Each run gets its own fresh database on the same server as
pgdispatch's, the peer's schema installed by its own API, then ``--jobs`` no-op jobs enqueued
in one bulk call of its own API, and ``clients`` worker processes, each with its own
connection(s), started together on a barrier; the clock runs from the barrier until the last
worker has returned (queue drained, every completion written). jobs/s = jobs / seconds.

* ``pgqueuer-batchB`` (B = 10, 50, 100, 200: ``BATCHES``) — per process one
  ``QueueManager`` on an asyncpg connection (the driver of PGQueuer's own benchmark,
  ``tools/benchmark.py``), an async no-op entrypoint, ``run(batch_size=B, mode=drain)``: it
  dequeues up to B jobs per query and writes completions in batches (its log buffer), which
  is its design. Bulk enqueue: ``Queries.enqueue([...], [...], [...])`` (list arguments, one
  statement).
* ``procrastinate-cC`` (C = 1, 4, 16: ``CONCURRENCIES``) — per process an ``App`` on
  ``PsycopgConnector`` (a pool of at most C + 1 connections, so that concurrency is not
  bounded by the pool), an async no-op task, ``run_worker_async(concurrency=C, wait=False,
  listen_notify=False)``: one job per fetch, each completion its own statement;
  ``wait=False`` returns once the queue is empty. Bulk enqueue:
  ``Task.batch_defer_async(*kwargs)``.

Each peer is swept over its setting so that the report compares pgdispatch with each peer
at its best (bench/report.py, ``comparisons``), and at equal batch where both have one.

After each run the peer's own tables are checked: PGQueuer's queue table is empty,
every Procrastinate job is ``succeeded``; and the workers' no-op counters add up to the jobs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

from pgdispatch.sql import db

from .common import Bench, Series, run_costs, run_processes, scratch_database, throughput, version

PGQUEUER_ENTRYPOINT = "bench_noop"
PROCRASTINATE_TASK = "bench_noop"
PACKAGES = ("pgqueuer", "asyncpg", "procrastinate")


def versions() -> dict[str, str | None]:
    """The installed versions of the peers and their drivers (None: not installed)."""
    return {name: version(name) for name in PACKAGES}


def _missing(*modules: str) -> str | None:
    for module in modules:
        try:
            __import__(module)
        except ImportError as exc:
            return f"{module} cannot be imported ({exc}); run: pip install -r bench/requirements.txt"
    return None


def _quiet() -> None:
    # the workers' INFO logs would drown the table; warnings and errors still show
    logging.basicConfig(level=logging.WARNING)
    for name in ("pgqueuer", "procrastinate"):
        logging.getLogger(name).setLevel(logging.WARNING)


# --- PGQueuer -----------------------------------------------------------------------------------


async def _pgqueuer_setup(url: str, jobs: int) -> None:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries

    conn = await asyncpg.connect(dsn=url)
    try:
        queries = Queries(AsyncpgDriver(conn))
        await queries.install()
        await queries.enqueue([PGQUEUER_ENTRYPOINT] * jobs, [None] * jobs, [0] * jobs)
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()


async def _pgqueuer_loop(barrier, url: str, batch_size: int) -> dict[str, Any]:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.types import QueueExecutionMode

    conn = await asyncpg.connect(dsn=url)
    try:
        qm = QueueManager(Queries(AsyncpgDriver(conn)))
        done = 0

        @qm.entrypoint(PGQUEUER_ENTRYPOINT)
        async def noop(job) -> None:
            nonlocal done
            done += 1

        barrier.wait(timeout=120)
        start = time.monotonic()
        await qm.run(batch_size=batch_size, mode=QueueExecutionMode.drain,
                     dequeue_timeout=timedelta(seconds=1))
        end = time.monotonic()
    finally:
        await conn.close()
    return {"start": start, "end": end, "done": done}


def pgqueuer_worker(barrier, url: str, batch_size: int) -> dict[str, Any]:
    """One PGQueuer worker process: a QueueManager draining the queue."""
    _quiet()
    return asyncio.run(_pgqueuer_loop(barrier, url, batch_size))


def run_pgqueuer(bench: Bench, clients: int, *, batch: int) -> dict[str, Any]:
    """One timed PGQueuer run at ``clients`` worker processes, each dequeuing up to
    ``batch`` jobs per query, on a fresh database."""
    with scratch_database(bench.server_url, "pgd_bench_pgqueuer") as url:
        asyncio.run(_pgqueuer_setup(url, bench.jobs))
        with run_costs(bench.server_url, bench.jobs) as costs:
            workers = run_processes(pgqueuer_worker, [(url, batch)] * clients,
                                    timeout_seconds=bench.timeout_seconds)
        with db.connect(url) as conn:
            left = conn.execute("SELECT count(*) AS n FROM pgqueuer").fetchone()["n"]
        if left:
            raise AssertionError(f"pgqueuer: {left} jobs left in the queue after the run")
    return throughput(f"pgqueuer-batch{batch}", clients, bench.jobs, workers, batch_size=batch,
                      driver="asyncpg", **costs)


# --- Procrastinate ------------------------------------------------------------------------------


def _procrastinate_app(url: str, counter: list[int], concurrency: int = 1):
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(
        conninfo=url, min_size=1, max_size=max(2, concurrency + 1)))

    @app.task(name=PROCRASTINATE_TASK)
    async def noop() -> None:
        counter[0] += 1

    return app, noop


async def _procrastinate_setup(url: str, jobs: int) -> None:
    app, noop = _procrastinate_app(url, [0])
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        await noop.batch_defer_async(*({} for _ in range(jobs)))
    with db.connect(url) as conn:
        conn.execute("VACUUM ANALYZE")


async def _procrastinate_loop(barrier, url: str, index: int, concurrency: int) -> dict[str, Any]:
    counter = [0]
    app, _ = _procrastinate_app(url, counter, concurrency)
    async with app.open_async():
        barrier.wait(timeout=120)
        start = time.monotonic()
        await app.run_worker_async(wait=False, concurrency=concurrency, listen_notify=False,
                                   install_signal_handlers=False, delete_jobs="never",
                                   name=f"bench-{index}")
        end = time.monotonic()
    return {"start": start, "end": end, "done": counter[0]}


def procrastinate_worker(barrier, url: str, index: int, concurrency: int) -> dict[str, Any]:
    """One Procrastinate worker process (``concurrency`` jobs at once) that stops once the
    queue is empty."""
    _quiet()
    return asyncio.run(_procrastinate_loop(barrier, url, index, concurrency))


def run_procrastinate(bench: Bench, clients: int, *, concurrency: int) -> dict[str, Any]:
    """One timed Procrastinate run at ``clients`` worker processes of ``concurrency`` each
    on a fresh database: ``bench.procrastinate_jobs`` jobs (``bench.jobs`` when unset; the
    full plan runs fewer, since at about 500 jobs/s its runs took two thirds of the sweep).
    """
    jobs = bench.procrastinate_jobs or bench.jobs
    with scratch_database(bench.server_url, "pgd_bench_procrastinate") as url:
        asyncio.run(_procrastinate_setup(url, jobs))
        with run_costs(bench.server_url, jobs) as costs:
            workers = run_processes(procrastinate_worker, [(url, i, concurrency) for i in range(clients)],
                                    timeout_seconds=bench.timeout_seconds)
        with db.connect(url) as conn:
            rows = {r["status"]: r["n"] for r in conn.execute(
                "SELECT status::text AS status, count(*) AS n FROM procrastinate_jobs GROUP BY 1")}
        if rows != {"succeeded": jobs}:
            raise AssertionError(f"procrastinate: jobs by status after the run: {rows}")
    return throughput(f"procrastinate-c{concurrency}", clients, jobs, workers,
                      concurrency_per_worker=concurrency, driver="psycopg", **costs)


# The settings swept (docs/benchmarks.md, "Method"): PGQueuer's dequeue batch, the same sizes
# as pgdispatch's (bench/claim.py, BATCHES), and Procrastinate's concurrency per worker (its
# worker fetches one job per query; concurrency is how many it runs at once).
BATCHES = (10, 50, 100, 200)
CONCURRENCIES = (1, 4, 16)

SERIES = {
    **{f"pgqueuer-batch{b}": Series(
        f"pgqueuer-batch{b}", f"PGQueuer {{pgqueuer}}, batch {b}", "peer",
        lambda bench, clients, _b=b: run_pgqueuer(bench, clients, batch=_b),
        unavailable=lambda: _missing("pgqueuer", "asyncpg"), system="pgqueuer", batch=b)
       for b in BATCHES},
    **{f"procrastinate-c{c}": Series(
        f"procrastinate-c{c}", f"Procrastinate {{procrastinate}}, concurrency {c}", "peer",
        lambda bench, clients, _c=c: run_procrastinate(bench, clients, concurrency=_c),
        unavailable=lambda: _missing("procrastinate"), system="procrastinate", batch=1)
       for c in CONCURRENCIES},
}
