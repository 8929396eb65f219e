"""Fairness benchmark: how the claim shares a pool between projects (DESIGN.md, "Fairness").

Run it from the repository root::

    python -m bench fairness [--asymmetric-claims N] [--weighted-claims N]
                             [--threads-seconds S] [--seed N] [--variants a,b]

It starts its own embedded PostgreSQL in a temporary directory, or, when ``DATABASE_URL`` is
set, creates (and afterwards drops) its own ``pgd_bench_fairness_*`` databases on that server.
Each run gets a fresh migrated database.

Three claim functions are compared, each in its own database:

* ``pgdispatch`` — ``pgd_claim`` as migrated: candidate (project, pool) pairs ordered by
  weighted running share (``running / weight``, fewest first), least recently served first
  between equals (``pgd_claim_candidates``); priority orders jobs only inside a project; each
  candidate is re-checked by a fresh read under its project row lock (migration 0007).
* ``single-read`` — the same order, but the project chosen from the one lock-free read
  (``install_single_read``: the re-check switched off).
* ``global-order`` — a benchmark/test-only copy of ``pgd_claim_candidates``
  (``install_global_order``) whose order is the head job's ``(priority DESC, id)``: one plain
  global priority/FIFO queue across projects. Everything else (reservations, bounds, SKIP
  LOCKED) is the real function's.

Three workloads. The first two are driven by one simulated runner on one real connection
through ``sql.transitions.claim`` and ``sql.transitions.complete`` (``drive``), the third by
real concurrent claimers (``drive_concurrent``):

* ``asymmetric`` — project ``big`` with 10,000 queued jobs submitted first and project
  ``small`` with 10 submitted after; weight 1 each; a pool of 4 slots. Every job runs for the
  same (virtual) time, so once the pool is full each claim follows the completion of the
  oldest running job.
* ``weighted-3to1`` — projects ``heavy`` (weight 3) and ``light`` (weight 1) with backlogs
  larger than the run (submitted interleaved, so a global FIFO alternates between them); a
  pool of 8 slots; durations uniform in [1, 10) virtual time units, seeded.
* ``weighted-3to1-threads`` — the same projects and pool; 12 claim loops, each on its own
  connection, claim -> sleep 20-60 ms -> complete; a sampler reads the running counts every
  4 ms; 1 s of warm-up, then ``--threads-seconds`` measured.

Figures: Jain's fairness index (Jain, Chiu & Hawe, DEC-TR-301, 1984) of weighted running
share, ``J = (Σx)² / (n·Σx²)`` with ``x_i = running_i / weight_i`` over the projects that still
have queued work, taken after every claim once the pool has filled (for the threaded
workload: every sample) and averaged (1.0 = every project runs exactly its weighted share;
1/n = one project has it all);
the small project's wait in claims; running and completed ratios. Results are printed as a
table and saved as JSON under ``bench/results/`` (gitignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import heapq
import itertools
import json
import os
import platform
import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from sql import config, db, migrate, transitions

from .common import RESULTS_DIR, bench_server, scratch_database, template_database

# The global priority/FIFO order: a candidate (project, pool) ranks by its head job, the one
# pgd_claim would take from it — (priority DESC, id) across all projects.
GLOBAL_ORDER = """(SELECT ARRAY[-j.priority::bigint, j.id]
                      FROM jobs j
                     WHERE j.project_id = pp.project_id AND j.pool_id = pp.pool_id
                       AND j.state = 'queued' AND j.ready_at <= now()
                     ORDER BY j.priority DESC, j.id
                     LIMIT 1)"""

# pgd_claim_candidates' ORDER BY (the fairness order), up to its LIMIT.
_CANDIDATE_ORDER = re.compile(r"(\n\s*ORDER BY )((?:(?!ORDER BY).)*?)(\n\s*LIMIT \d+;?)(?=\n)", re.S)

def function_sql(name: str) -> str:
    """The text of ``CREATE [OR REPLACE] FUNCTION name(...) ... $$;`` as last (re)defined in
    sql/migrations (the migrated function), written as ``CREATE FUNCTION``.

    Raises:
        ValueError: no migration defines ``name``.
    """
    for path in sorted(migrate.MIGRATIONS_DIR.glob("*.sql"), reverse=True):
        text = path.read_text().replace(f"CREATE OR REPLACE FUNCTION {name}(", f"CREATE FUNCTION {name}(")
        start = text.find(f"CREATE FUNCTION {name}(")
        if start >= 0:
            body = text.index("AS $$", start)
            return text[start:text.index("$$;", body + len("AS $$")) + len("$$;")]
    raise ValueError(f"no migration defines {name}")


def variant_sql(name: str, replace: Sequence[tuple[str, str]] = (), *,
                order_by: str | None = None) -> str:
    """``CREATE OR REPLACE FUNCTION name`` from the migrated text with each ``(old, new)`` of
    ``replace`` substituted (each ``old`` must occur) and, for pgd_claim_candidates, its ORDER
    BY replaced by ``order_by``. For benchmarks and tests only: installed, it replaces the real
    function in that database."""
    sql = function_sql(name).replace(f"CREATE FUNCTION {name}(", f"CREATE OR REPLACE FUNCTION {name}(", 1)
    for old, new in replace:
        assert old in sql, f"not in {name}: {old!r}; update bench/fairness.py with the function"
        sql = sql.replace(old, new)
    if order_by is not None:
        sql, n = _CANDIDATE_ORDER.subn(lambda m: m.group(1) + order_by + m.group(3), sql, count=1)
        assert n == 1, f"no ORDER BY ... LIMIT n; in {name}"
    return sql


def candidate_order() -> str:
    """The fairness ORDER BY of the migrated pgd_claim_candidates (for reports)."""
    match = _CANDIDATE_ORDER.search(function_sql("pgd_claim_candidates"))
    assert match, "pgd_claim_candidates' ORDER BY not found: update bench/fairness.py"
    return " ".join(match.group(2).split())


# pgd_fairer_candidate_exists answering "no" whatever the shares (same signature as 0011's)
NO_FAIRNESS_RECHECK = """
CREATE OR REPLACE FUNCTION pgd_fairer_candidate_exists(p_pool_ids bigint[], p_org_id bigint,
    p_project projects, p_running integer)
RETURNS boolean LANGUAGE sql STABLE AS $$ SELECT false $$
"""


def install_global_order(conn) -> None:
    """Make pgd_claim in this database a plain global priority/FIFO queue across projects:
    candidates in the head job's order, and no re-check of weighted shares under the project
    claim lock (migrations 0007, 0011)."""
    conn.execute(variant_sql("pgd_claim_candidates", order_by=GLOBAL_ORDER))
    conn.execute(NO_FAIRNESS_RECHECK)


def install_single_read(conn) -> None:
    """Make pgd_claim in this database choose its project from one lock-free read, as it did
    before tests/fairness (same order; no re-check under the project row lock, migration 0007)."""
    conn.execute(NO_FAIRNESS_RECHECK)


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

    Jobs go through pgd_submit (the function behind ``sql.transitions.submit``), one
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
    oldest among equals) completes through ``sql.transitions.complete`` and the clock moves to
    its end. Claims go through ``sql.transitions.claim`` on ``conn``. After each claim the
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


def run_workload(conn, workload: Workload, *, claims: int, seed: int,
                 until: Callable[[Trace], bool] | None = None) -> Trace:
    """Set up ``workload`` in this (fresh, migrated) database and drive it."""
    world = setup(conn, workload.projects, slots=workload.slots, interleave=workload.interleave)
    rng = random.Random(seed)
    lo, hi = workload.durations
    return drive(conn, runner_id=world["runner_id"], pool_ids=world["pool_ids"], slots=workload.slots,
                 claims=claims, duration=(lambda: lo) if lo == hi else (lambda: rng.uniform(lo, hi)),
                 names=world["names"], weights={p.name: p.weight for p in workload.projects},
                 queued={p.name: p.jobs for p in workload.projects}, until=until)


def summarize(workload: Workload, variant: str, trace: Trace, wall_seconds: float) -> dict[str, Any]:
    """The figures of one run (JSON-ready)."""
    jain = trace.jain_steps()
    mean_running = trace.mean_running()
    out: dict[str, Any] = {
        "workload": workload.name, "variant": variant, "claims": len(trace.steps),
        "slots": workload.slots,
        "projects": [dataclasses.asdict(p) for p in workload.projects],
        "jain_mean": statistics.fmean(jain) if jain else None,
        "jain_min": min(jain) if jain else None,
        "jain_steps": len(jain),
        "mean_running": mean_running,
        "completed": trace.completed,
        "claim_ms_median": 1000 * statistics.median(s.claim_seconds for s in trace.steps),
        "wall_seconds": wall_seconds,
    }
    if workload.name == "asymmetric":
        small = workload.projects[1]
        numbers = trace.claim_numbers(small.name)
        out["small_first_start_claim"] = numbers[0] if numbers else None
        out["small_all_started_claim"] = numbers[-1] if len(numbers) == small.jobs else None
        out["small_started"] = len(numbers)
        out["small_mean_wait_claims"] = statistics.fmean(numbers) if len(numbers) == small.jobs else None
    else:
        heavy, light = (p.name for p in workload.projects)
        out["running_ratio"] = (mean_running[heavy] / mean_running[light]
                                if mean_running.get(light) else None)
        out["completed_ratio"] = (trace.completed[heavy] / trace.completed[light]
                                  if trace.completed[light] else None)
    return out



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
    import threading

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

VARIANTS: dict[str, Callable[[Any], None] | None] = {
    "pgdispatch": None,
    "single-read": install_single_read,
    "global-order": install_global_order,
}


def summarize_concurrent(name: str, variant: str, report: ConcurrentReport, *, weights: dict[str, int],
                         loops: int, slots: int, seconds: float) -> dict[str, Any]:
    """The figures of one ``drive_concurrent`` run (JSON-ready)."""
    heavy, light = weights
    jain = [j for j in (jain_index([s[p] / weights[p] for p in weights]) for s in report.samples)
            if j is not None]
    mean_running = report.mean_running()
    return {
        "workload": name, "variant": variant, "claims": report.claims, "slots": slots,
        "loops": loops, "seconds": seconds, "samples": len(report.samples),
        "jain_mean": statistics.fmean(jain) if jain else None,
        "jain_min": min(jain) if jain else None,
        "mean_running": mean_running, "completed": report.completed,
        "running_ratio": mean_running[heavy] / mean_running[light] if mean_running.get(light) else None,
        "completed_ratio": (report.completed[heavy] / report.completed[light]
                            if report.completed[light] else None),
        "claims_per_second": report.claims / seconds,
        "errors": [repr(e) for e in report.errors],
    }


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "—"
    return format(value, spec) if isinstance(value, float) else str(value)


def table(results: list[dict[str, Any]]) -> str:
    """The printed table of a list of ``summarize`` / ``summarize_concurrent`` results."""
    head = ("workload", "claim", "claims", "Jain mean", "Jain min", "small: 1st / all started (claims)",
            "running ratio", "completed ratio")
    rows = []
    for r in results:
        if r["workload"] == "asymmetric":
            all_started = (r["small_all_started_claim"]
                           or f"not in {r['claims']} ({r['small_started']} started)")
            small = f"{_fmt(r['small_first_start_claim'])} / {all_started}"
            ratios = ("—", "—")
        else:
            small = "—"
            ratios = (_fmt(r["running_ratio"], ".2f"), _fmt(r["completed_ratio"], ".2f"))
        rows.append((r["workload"], r["variant"], str(r["claims"]), _fmt(r["jain_mean"]),
                     _fmt(r["jain_min"]), small, *ratios))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every workload against every claim variant; print the table, save the JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench fairness", description=__doc__.split("\n")[0])
    parser.add_argument("--big-jobs", type=int, default=10000, help="asymmetric: the big project's jobs")
    parser.add_argument("--asymmetric-claims", type=int, default=10100,
                        help="asymmetric: stop after this many claims, or once the small project's "
                             "jobs have all started")
    parser.add_argument("--weighted-claims", type=int, default=3000, help="3:1: claims per run")
    parser.add_argument("--threads-seconds", type=float, default=8.0,
                        help="3:1 with threads: measured seconds per run (after 1 s of warm-up)")
    parser.add_argument("--threads", type=int, default=12, help="3:1 with threads: claim loops (8 slots)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random durations")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated claim variants (default: {','.join(VARIANTS)})")
    args = parser.parse_args(list(argv) if argv is not None else None)
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}

    asym = asymmetric(big_jobs=args.big_jobs)
    weigh = weighted(jobs_each=args.weighted_claims + 100)
    small = asym.projects[1]

    def small_all_started(trace: Trace) -> bool:
        return trace.steps[-1].project == small.name and trace.wait_for(small.name, small.jobs) is not None

    results = []
    started_at = dt.datetime.now(dt.timezone.utc)
    version = None
    with bench_server() as (server_url, server_kind), \
            template_database(server_url, "pgd_bench_fairness_template") as template:
        for variant, install in variants.items():
            for workload, claims, until in ((asym, args.asymmetric_claims, small_all_started),
                                            (weigh, args.weighted_claims, None)):
                with scratch_database(server_url, "pgd_bench_fairness", template=template) as url, \
                        db.connect(url, application_name="bench-fairness") as conn:
                    if install is not None:
                        install(conn)
                    version = conn.execute("SHOW server_version").fetchone()["server_version"]
                    t0 = time.perf_counter()
                    trace = run_workload(conn, workload, claims=claims, seed=args.seed, until=until)
                    result = summarize(workload, variant, trace, time.perf_counter() - t0)
                results.append(result)
                print(f"  {workload.name} / {variant}: {result['claims']} claims "
                      f"in {result['wall_seconds']:.1f} s", flush=True)
            # the same 3:1 workload with real concurrency: claim loops on their own connections
            threaded = weighted(jobs_each=int(400 * (args.threads_seconds + 1)))
            with scratch_database(server_url, "pgd_bench_fairness", template=template) as url, \
                    db.connect(url, application_name="bench-fairness") as conn:
                if install is not None:
                    install(conn)
                world = setup(conn, threaded.projects, slots=threaded.slots, interleave=True)
                report = drive_concurrent(url, runner_id=world["runner_id"], pool_ids=world["pool_ids"],
                                          names=world["names"], loops=args.threads,
                                          seconds=args.threads_seconds + 1.0, warmup_seconds=1.0,
                                          hold_seconds=(0.02, 0.06), seed=args.seed)
            result = summarize_concurrent("weighted-3to1-threads", variant, report,
                                          weights={p.name: p.weight for p in threaded.projects},
                                          loops=args.threads, slots=threaded.slots,
                                          seconds=args.threads_seconds)
            results.append(result)
            print(f"  weighted-3to1-threads / {variant}: {result['claims']} claims "
                  f"({result['claims_per_second']:.0f}/s)", flush=True)
            if report.errors:
                raise report.errors[0]
    order = {"asymmetric": 0, "weighted-3to1": 1, "weighted-3to1-threads": 2}
    results.sort(key=lambda r: order.get(r["workload"], 9))
    print()
    print(table(results))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"fairness-{started_at:%Y%m%dT%H%M%SZ}.json"
    out.write_text(json.dumps({
        "benchmark": "fairness", "started_at": started_at.isoformat(), "server": server_kind,
        "server_version": version, "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_average": os.getloadavg(), "seed": args.seed,
        "arguments": vars(args), "pgdispatch_candidate_order": candidate_order(),
        "global_order": " ".join(GLOBAL_ORDER.split()), "results": results,
    }, indent=2, default=str) + "\n")
    print(f"\nsaved {out}")
    return 0
