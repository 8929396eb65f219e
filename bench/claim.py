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
register their own runner row (``pgdispatch.sql.transitions.register_runner``) and wait on a start
barrier; then each loops a *cycle* until no queued job is left. The clock runs from the
barrier until the last worker has finished (all jobs completed and the queue seen empty);
jobs/s = jobs / that wall-clock time, in seconds. After each run the database is checked:
every job succeeded, the project counters are back to 0 and no organization or pool slot is
held.

Cycles (``@cycle`` registers one; each becomes two series, limits free and limits binding):

* ``pgdispatch`` — today's transitions, one job per transaction: ``pgdispatch.sql.transitions.claim``
  (organization, project and pool capacity reserved, job taken with SKIP LOCKED, generation
  bumped, attempt row inserted) then ``pgdispatch.sql.transitions.complete`` with outcome ``succeeded``
  and the claim's receipt key (delivery receipt written, capacity released).

* ``pgdispatch-batch10``, ``pgdispatch-batch50`` — the batched transitions (``claim_batch``
  of up to 10 or 50 jobs of one project and pool, then ``complete_batch`` of them), with the
  same guarantees: a scheduler with that many free slots.

Limits: *free* sets organization ``max_running`` and pool ``slots`` to 100,000 (checked by
every claim, never reached) and gives the projects no bound of their own (the default: a
project bound makes that project's claims take turns, sql/functions/capacity.sql, so until
the project claim lock went in it was 100,000 too); *binding* sets the
organization and the pool to ⌈N/2⌉ and each project to ⌈N/4⌉, so that about half of the
workers' claims find no capacity (at N = 1 nothing can bind: one loop holds one job at a
time). A worker whose claim finds nothing while jobs are still queued sleeps
``--idle-seconds`` and tries again; those empty claims are counted.

What every throughput series shares (the server, scratch databases, the bench queue, the
worker-process runner with its barrier) is in ``bench/common.py``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from pgdispatch.sql import db, transitions

from .common import (POOL, Bench, Series, limits, prepare, run_costs, run_processes,
                     scratch_database, throughput)

# --- SQL of the run's check (not production code) ------------------------------------------

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


CYCLES: dict[str, Cycle] = {}
SERIES: dict[str, Series] = {}


def cycle(name: str, *, label: str, batch: int) -> Callable[[Cycle], Cycle]:
    """Register a pgdispatch cycle of at most ``batch`` jobs per claim as two series:
    ``name`` (limits free: system "pgdispatch", compared with the peers, which have no
    limits) and ``name-bound`` (limits binding: system "pgdispatch-bound")."""

    def register(fn: Cycle) -> Cycle:
        CYCLES[name] = fn
        for binding in (False, True):
            series_name = f"{name}-bound" if binding else name
            SERIES[series_name] = Series(
                name=series_name, label=f"{label}, limits {'binding' if binding else 'free'}",
                kind="pgdispatch", system="pgdispatch-bound" if binding else "pgdispatch",
                batch=batch,
                run=lambda bench, clients, _c=name, _b=binding, _s=series_name: run_pgdispatch(
                    bench, clients, cycle_name=_c, binding=_b, series=_s))
        return fn

    return register


@cycle("pgdispatch", label="pgdispatch 1 job/txn", batch=1)
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
    """The batched transitions (claim_batch, sql/functions/claim.sql; complete_batch,
    sql/functions/complete.sql): claim up to ``size`` jobs of one (project, pool) in one
    transaction, then complete them all in one — what a scheduler with ``size`` free slots does
    (scheduler/claiming.py)."""

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


# the batch sizes swept, the same as PGQueuer's (bench/peers.py, BATCHES)
BATCHES = (10, 50, 100, 200)
for _size in BATCHES:
    cycle(f"pgdispatch-batch{_size}", label=f"pgdispatch {_size} jobs/txn", batch=_size)(batched(_size))


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
        with run_costs(bench.server_url, bench.jobs) as costs:
            workers = run_processes(
                pgdispatch_worker,
                [(url, i, cycle_name, pool_ids, bench.lease_seconds, bench.idle_seconds)
                 for i in range(clients)],
                timeout_seconds=bench.timeout_seconds)
        check_done(url, bench.jobs + bench.warmup)
    return throughput(series, clients, bench.jobs, workers, limits=limit,
                      empty_claims=sum(w["empty_claims"] for w in workers), **costs)
