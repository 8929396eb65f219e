"""Fairness workloads driven through the real claim, and the claim variants that are unfair
on purpose: the support of tests/fairness (and of tests elsewhere that need a loaded pool),
which ``bench/fairness.py`` runs at benchmark sizes.

Jobs are claimed through ``pgdispatch.sql.transitions.claim`` and completed through
``pgdispatch.sql.transitions.complete`` on real connections: one simulated runner over virtual time
(``drive``) or real concurrent claim loops (``drive_concurrent``). The variants replace
functions in the one database they are installed in (``tests/variants.py``).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pgdispatch.sql import config, db, transitions

from ..variants import variant_sql

# The global priority/FIFO order: a candidate (project, pool) ranks by its head job, the one
# pgd_claim would take from it — (priority DESC, id) across all projects.
GLOBAL_ORDER = """(SELECT ARRAY[-j.priority::bigint, j.id]
                      FROM jobs j
                     WHERE j.project_id = pp.project_id AND j.pool_id = pp.pool_id
                       AND j.state = 'queued' AND j.ready_at <= now()
                     ORDER BY j.priority DESC, j.id
                     LIMIT 1)"""


def install_global_order(conn) -> None:
    """Make pgd_claim in this database a plain global priority/FIFO queue across projects:
    candidates in the head job's order (``GLOBAL_ORDER``), and no re-check of weighted shares
    under the project claim lock (``install_single_read``)."""
    conn.execute(variant_sql(conn, "pgd_claim_candidates", order_by=GLOBAL_ORDER))
    install_single_read(conn)


def install_single_read(conn) -> None:
    """Make pgd_claim in this database choose its project from its one lock-free read of the
    candidates (the same order; no re-check under the project's claim lock): every
    ``pgd_fairer_candidate_exists`` answers "no", whatever the shares."""
    rows = conn.execute("""
        SELECT p.pronamespace::regnamespace AS schema, pg_get_function_arguments(p.oid) AS args
          FROM pg_proc p WHERE p.proname = 'pgd_fairer_candidate_exists'""").fetchall()
    assert rows, "no pgd_fairer_candidate_exists: update install_single_read with pgd_claim"
    for r in rows:  # with each one's own parameters: CREATE OR REPLACE keeps their names
        conn.execute(f"CREATE OR REPLACE FUNCTION {r['schema']}.pgd_fairer_candidate_exists({r['args']}) "
                     "RETURNS boolean LANGUAGE sql STABLE AS $$ SELECT false $$")


def jain_index(xs: Sequence[float]) -> float | None:
    """Jain's fairness index ``(Σx)² / (n·Σx²)``; None when every x is zero or none is given."""
    square_sum = sum(x * x for x in xs)
    if not xs or square_sum == 0:
        return None
    return sum(xs) ** 2 / (len(xs) * square_sum)


# --- workloads ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProjectSpec:
    """One project of a workload: its queued jobs (all submitted before the first claim)."""

    name: str
    jobs: int
    weight: int = 1
    max_running: int | None = None
    priority: int = 0


_SUBMIT_CHUNK = 1000


def setup(conn, projects: Sequence[ProjectSpec], *, slots: int, interleave: bool = False,
          bulk_insert: bool = False, org_limit: int = 100000, pool: str = "linux") -> dict[str, Any]:
    """Declare one organization, a pool of ``slots``, the projects, and one runner; then
    enqueue every project's jobs: project after project in the order given, or with
    ``interleave`` one job of each project in turn.

    Jobs go through pgd_submit (the function behind ``pgdispatch.sql.transitions.submit``), one
    statement per chunk of 1,000 with ANALYZE between chunks (a PL/pgSQL plan cached while the
    table was small would scan it whole for every later submit). With ``bulk_insert`` they are
    inserted directly, as queued jobs with pgd_submit's values: much faster, for tests.

    Returns:
        {"runner_id", "pool_ids", "project_ids": {name: id}, "names": {id: name}}.
    """
    lines = ['[[organizations]]', 'name = "bench"', f'max_running = {org_limit}',
             '[[pools]]', f'name = "{pool}"', f'slots = {slots}']
    for p in projects:
        lines += ['[[projects]]', f'name = "{p.name}"', 'organization = "bench"', f'pools = ["{pool}"]',
                  f'weight = {p.weight}']
        if p.max_running is not None:
            lines.append(f'max_running = {p.max_running}')
    config.apply_config(conn, "\n".join(lines), actor="bench", env={})
    # rows (project, priority, g) in submission order, g = the job's number in its project
    rows = """SELECT u.project, u.priority, g
                FROM unnest(%(names)s::text[], %(prios)s::int[], %(counts)s::int[])
                     WITH ORDINALITY AS u(project, priority, jobs, o),
                     generate_series(1, u.jobs) g
               WHERE g BETWEEN %(lo)s AND %(hi)s
               ORDER BY {order}"""
    submit = """SELECT count(*) AS n FROM (
                    SELECT (pgd_submit(s.project, %(pool)s, NULL, ARRAY['true', s.g::text], s.priority,
                                       1, 3600, 0, false, ARRAY[]::bigint[], NULL, 'bench')).job_id
                      FROM ({rows}) s) x"""
    insert = """INSERT INTO jobs (project_id, pool_id, state, priority, command, submitted_by)
                SELECT p.id, q.id, 'queued', s.priority, ARRAY['true', s.g::text], 'bench'
                  FROM ({rows}) s JOIN projects p ON p.name = s.project JOIN pools q ON q.name = %(pool)s
                 ORDER BY {order}"""
    groups = [list(projects)] if interleave else [[p] for p in projects]
    order = "g, u.o" if interleave else "g"
    for group in groups:
        params = {"pool": pool, "names": [p.name for p in group], "prios": [p.priority for p in group],
                  "counts": [p.jobs for p in group]}
        top = max(p.jobs for p in group)
        if bulk_insert:
            conn.execute(insert.format(rows=rows.format(order=order), order="s.g" if not interleave else
                                       "s.g, array_position(%(names)s::text[], s.project)"),
                         {**params, "lo": 1, "hi": top})
        else:
            for lo in range(1, top + 1, _SUBMIT_CHUNK):
                conn.execute(submit.format(rows=rows.format(order=order)),
                             {**params, "lo": lo, "hi": lo + _SUBMIT_CHUNK - 1})
                conn.execute("ANALYZE jobs")
    conn.execute("ANALYZE jobs")
    runner_id = transitions.register_runner(conn, name="bench-runner", pools=[pool], slots=slots,
                                            hostname="bench")
    pool_ids = [conn.execute("SELECT id FROM pools WHERE name = %s", (pool,)).fetchone()["id"]]
    ids = {r["name"]: r["id"] for r in conn.execute("SELECT id, name FROM projects")}
    return {"runner_id": runner_id, "pool_ids": pool_ids, "project_ids": ids,
            "names": {v: k for k, v in ids.items()}}


@dataclasses.dataclass
class Step:
    """One successful claim: which project got it, and every project's running count and
    queued count (before this claim) as the database and the driver saw them right after."""

    claim_no: int
    project: str
    priority: int
    running: dict[str, int]
    queued_before: dict[str, int]
    claim_seconds: float


@dataclasses.dataclass
class Trace:
    """What one ``drive`` run saw."""

    steps: list[Step]
    completed: dict[str, int]
    weights: dict[str, int]
    slots: int

    def claim_numbers(self, project: str) -> list[int]:
        """The claim numbers (1-based, over all projects) at which ``project``'s jobs started."""
        return [s.claim_no for s in self.steps if s.project == project]

    def wait_for(self, project: str, n: int) -> int | None:
        """Claims until ``project``'s ``n``-th job started; None if it did not in this run."""
        numbers = self.claim_numbers(project)
        return numbers[n - 1] if len(numbers) >= n else None

    def jain_steps(self, *, warmup: int | None = None) -> list[float]:
        """Jain's index of weighted running share after each claim past ``warmup`` claims
        (default: the pool's slots), over the projects that had queued work before it."""
        warmup = self.slots if warmup is None else warmup
        out = []
        for s in self.steps[warmup:]:
            backlogged = [p for p, q in s.queued_before.items() if q > 0]
            if len(backlogged) < 2:
                continue
            j = jain_index([s.running[p] / self.weights[p] for p in backlogged])
            if j is not None:
                out.append(j)
        return out

    def mean_running(self, *, warmup: int | None = None) -> dict[str, float]:
        """Each project's running count averaged over the claims past ``warmup``."""
        warmup = self.slots if warmup is None else warmup
        steps = self.steps[warmup:]
        return {p: statistics.fmean(s.running[p] for s in steps) for p in self.weights} if steps else {}


def drive(conn, *, runner_id: int, pool_ids: Sequence[int], slots: int, claims: int,
          duration: Callable[[], float], names: dict[int, str], weights: dict[str, int],
          queued: dict[str, int], until: Callable[[Trace], bool] | None = None,
          lease_seconds: float = 3600.0) -> Trace:
    """Simulate one runner with ``slots`` slots for up to ``claims`` successful claims.

    A discrete-event loop over virtual time: each claimed job runs ``duration()`` virtual time
    units; when the runner is full, or a claim finds nothing, the job that ends first (the
    oldest among equals) completes through ``pgdispatch.sql.transitions.complete`` and the clock moves to
    its end. Claims go through ``pgdispatch.sql.transitions.claim`` on ``conn``. After each claim the
    projects' running counters are read back from the database. Stops early when ``until``
    says so or nothing is left to claim or complete.
    """
    trace = Trace(steps=[], completed={p: 0 for p in weights}, weights=dict(weights), slots=slots)
    queued = dict(queued)
    running: list[tuple[float, int, transitions.Claim]] = []
    seq = itertools.count()
    now = 0.0

    def complete_next() -> None:
        nonlocal now
        end, _, c = heapq.heappop(running)
        now = end
        transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                             outcome="succeeded", exit_code=0, receipt_key=c.receipt_key)
        trace.completed[names[c.project_id]] += 1

    for claim_no in range(1, claims + 1):
        if len(running) >= slots:
            complete_next()
        while True:
            started = time.perf_counter()
            c = transitions.claim(conn, runner_id=runner_id, pools=pool_ids,
                                  claim_token=transitions.new_claim_token(), lease_seconds=lease_seconds)
            elapsed = time.perf_counter() - started
            if c is not None or not running:
                break
            complete_next()  # nothing eligible now (a bound, or no work): let time pass
        if c is None:
            break
        heapq.heappush(running, (now + duration(), next(seq), c))
        project = names[c.project_id]
        before = dict(queued)
        queued[project] -= 1
        rows = conn.execute("SELECT p.id, pgd_project_running(p.id) AS running, j.priority "
                            "FROM projects p, jobs j WHERE j.id = %s", (c.job_id,)).fetchall()
        trace.steps.append(Step(claim_no=claim_no, project=project, priority=rows[0]["priority"],
                                running={names[r["id"]]: r["running"] for r in rows if r["id"] in names},
                                queued_before=before, claim_seconds=elapsed))
        if until is not None and until(trace):
            break
    return trace


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named workload: projects (in submission order), pool slots, job durations."""

    name: str
    projects: tuple[ProjectSpec, ...]
    slots: int
    interleave: bool
    durations: tuple[float, float]  # uniform [lo, hi) virtual time units; lo == hi: constant


def asymmetric(*, big_jobs: int = 10000, small_jobs: int = 10, slots: int = 4) -> Workload:
    """One project with ``big_jobs`` queued first, one with ``small_jobs`` after; equal weights
    and equal durations (the oldest running job completes before each claim once full)."""
    return Workload("asymmetric", (ProjectSpec("big", big_jobs), ProjectSpec("small", small_jobs)),
                    slots=slots, interleave=False, durations=(1.0, 1.0))


def weighted(*, jobs_each: int, slots: int = 8, heavy_weight: int = 3) -> Workload:
    """Two backlogged projects with weights ``heavy_weight``:1, interleaved, random durations."""
    return Workload("weighted-3to1" if heavy_weight == 3 else f"weighted-{heavy_weight}to1",
                    (ProjectSpec("heavy", jobs_each, weight=heavy_weight), ProjectSpec("light", jobs_each)),
                    slots=slots, interleave=True, durations=(1.0, 10.0))


@dataclasses.dataclass
class ConcurrentReport:
    """What ``drive_concurrent`` saw after its warm-up: sampled running counts per project,
    completions per project, claims completed in all, and the claim loops' errors."""

    samples: list[dict[str, int]]
    completed: dict[str, int]
    claims: int
    errors: list[BaseException]

    def mean_running(self) -> dict[str, float]:
        """Each project's running count averaged over the samples."""
        if not self.samples:
            return {}
        return {p: statistics.fmean(s[p] for s in self.samples) for p in self.completed}


def drive_concurrent(db_url: str, *, runner_id: int, pool_ids: Sequence[int], names: dict[int, str],
                     loops: int, seconds: float, warmup_seconds: float,
                     hold_seconds: tuple[float, float] = (0.002, 0.012),
                     sample_interval_seconds: float = 0.004, seed: int = 1,
                     lease_seconds: float = 3600.0) -> ConcurrentReport:
    """Real concurrency: ``loops`` threads, each a runner slot on its own connection, claim ->
    sleep uniform ``hold_seconds`` (seconds) -> complete, for ``seconds`` (seconds); one more
    thread samples every project's running counter every ``sample_interval_seconds``. Samples
    and completions from the first ``warmup_seconds`` are left out."""
    stop = threading.Event()
    lock = threading.Lock()
    start = time.monotonic()
    measure_from = start + warmup_seconds
    completed = {n: 0 for n in names.values()}
    samples: list[dict[str, int]] = []
    errors: list[BaseException] = []
    claims = [0]

    def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        try:
            with db.connect(db_url, application_name=f"bench-loop-{i}") as conn:
                while not stop.is_set():
                    c = transitions.claim(conn, runner_id=runner_id, pools=pool_ids,
                                          claim_token=transitions.new_claim_token(),
                                          lease_seconds=lease_seconds)
                    if c is None:
                        time.sleep(0.001)
                        continue
                    time.sleep(rng.uniform(*hold_seconds))
                    transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                         outcome="succeeded", exit_code=0, receipt_key=c.receipt_key)
                    with lock:
                        if time.monotonic() >= measure_from:
                            claims[0] += 1
                            completed[names[c.project_id]] += 1
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            errors.append(exc)
            stop.set()

    def sampler() -> None:
        try:
            with db.connect(db_url, application_name="bench-sampler") as conn:
                while not stop.is_set():
                    rows = conn.execute("SELECT id, pgd_project_running(id) AS running "
                                        "FROM projects").fetchall()
                    if time.monotonic() >= measure_from:
                        samples.append({names[r["id"]]: r["running"] for r in rows if r["id"] in names})
                    time.sleep(sample_interval_seconds)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=loop, args=(i,), name=f"bench-loop-{i}") for i in range(loops)]
    threads.append(threading.Thread(target=sampler, name="bench-sampler"))
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        errors.append(RuntimeError(f"threads still running after stop: {alive}"))
    return ConcurrentReport(samples=samples, completed=completed, claims=claims[0], errors=errors)
