"""Fairness checks: run a workload through the real claim and say whether it was fair.

The workloads and the simulated runner live in ``workload.py`` (``bench/fairness.py`` runs the
same ones at benchmark sizes): jobs are claimed through ``pgdispatch.sql.transitions.claim`` and completed through
``pgdispatch.sql.transitions.complete`` on real connections to this test's database. Each ``check_*``
raises AssertionError with the figures when the run was unfair; each is shown, in a test, to
fail against a deliberately unfair claim installed in the test's database.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from .workload import ProjectSpec, Trace, drive, setup, weighted

# Test 1: one project with 10,000 jobs queued first, one with 10 after, a pool of 4 slots.
BIG_JOBS = 10000
SMALL_JOBS = 10
ASYMMETRIC_SLOTS = 4
# Two equally weighted projects, equal durations: once the pool is full the small project
# must get at least every second claim, so its n jobs start within 2n claims, plus the
# first fill of the pool.
SMALL_BOUND = 2 * SMALL_JOBS + ASYMMETRIC_SLOTS  # = 24 claims; measured: 20
ASYMMETRIC_CAP = 100  # claims: a run that has not started the small project by then is unfair

# Test 2: weights 3:1 on a pool of 8 slots.
WEIGHTED_SLOTS = 8
RATIO_TOLERANCE = 0.5  # the mean running ratio (and the completed ratio) must be 3.0 ± 0.5


def run_asymmetric(conn, *, small_priority: int = 0, big_priority: int = 0,
                   big_jobs: int = BIG_JOBS, cap: int = ASYMMETRIC_CAP) -> Trace:
    """Queue ``big_jobs`` for project ``big`` first (bulk insert), then ``SMALL_JOBS`` for
    ``small`` through ``pgdispatch.sql.transitions.submit``; claim on a pool of 4 slots, completing the
    oldest running job before each claim once full, until every small job has started or
    ``cap`` claims have been made."""
    from pgdispatch.sql import transitions

    world = setup(conn, [ProjectSpec("big", big_jobs, priority=big_priority),
                               ProjectSpec("small", 0)],
                        slots=ASYMMETRIC_SLOTS, bulk_insert=True)
    with conn.transaction():
        for i in range(SMALL_JOBS):
            transitions.submit(conn, project="small", pool="linux", command=["true", str(i)],
                               priority=small_priority)

    def small_all_started(trace: Trace) -> bool:
        return trace.steps[-1].project == "small" and trace.wait_for("small", SMALL_JOBS) is not None

    return drive(conn, runner_id=world["runner_id"], pool_ids=world["pool_ids"],
                       slots=ASYMMETRIC_SLOTS, claims=cap, duration=lambda: 1.0,
                       names=world["names"], weights={"big": 1, "small": 1},
                       queued={"big": big_jobs, "small": SMALL_JOBS}, until=small_all_started)


def check_small_project_starts_within(trace: Trace, bound: int = SMALL_BOUND) -> int:
    """Every small-project job started within ``bound`` claims; returns the claims it took."""
    numbers = trace.claim_numbers("small")
    assert len(numbers) == SMALL_JOBS and numbers[-1] <= bound, (
        f"the small project's {SMALL_JOBS} jobs did not all start within {bound} claims: "
        f"{len(numbers)} started, at claims {numbers[:12]}, over {len(trace.steps)} claims")
    return numbers[-1]


def run_weighted(conn, *, claims: int, seed: int = 7, warmup: int = 100) -> dict[str, Any]:
    """Projects ``heavy`` (weight 3) and ``light`` (weight 1) with backlogs larger than the
    run, on 8 slots, jobs running uniform [1, 10) virtual time units (seeded); ``claims``
    claims. Returns the trace and its figures after ``warmup`` claims."""
    workload = weighted(jobs_each=claims + 50, slots=WEIGHTED_SLOTS)
    world = setup(conn, workload.projects, slots=workload.slots, interleave=True, bulk_insert=True)
    rng = random.Random(seed)
    trace = drive(conn, runner_id=world["runner_id"], pool_ids=world["pool_ids"],
                        slots=workload.slots, claims=claims, duration=lambda: rng.uniform(1.0, 10.0),
                        names=world["names"], weights={"heavy": 3, "light": 1},
                        queued={"heavy": claims + 50, "light": claims + 50})
    mean = trace.mean_running(warmup=warmup)
    jain = trace.jain_steps(warmup=warmup)
    return {"trace": trace, "mean_running": mean, "running_ratio": mean["heavy"] / mean["light"],
            "completed": trace.completed,
            "completed_ratio": trace.completed["heavy"] / max(trace.completed["light"], 1),
            "jain_mean": statistics.fmean(jain)}


def check_three_to_one(figures: dict[str, Any], *, tolerance: float = RATIO_TOLERANCE) -> None:
    """The mean running ratio and the completed ratio of heavy:light are 3.0 ± ``tolerance``."""
    for key in ("running_ratio", "completed_ratio"):
        assert abs(figures[key] - 3.0) <= tolerance, (
            f"{key} {figures[key]:.2f} is not 3.0 ± {tolerance}: mean running {figures['mean_running']}, "
            f"completed {figures['completed']}")
