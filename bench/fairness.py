"""Fairness benchmark: how the claim shares a pool between projects (DESIGN.md, "Fairness").

Run it from the repository root::

    python -m bench fairness [--big-jobs N] [--asymmetric-claims N] [--weighted-claims N]
                             [--threads-seconds S] [--threads-warmup-seconds S] [--threads N]
                             [--seed N] [--variants a,b] [--out FILE.json]

It starts its own embedded PostgreSQL in a temporary directory, or, when ``DATABASE_URL`` is
set, creates (and afterwards drops) its own ``pgd_bench_fairness_*`` databases on that server.
Each run gets a fresh copy of a migrated template. The workloads, the drivers and the claim
variants are the ones tests/fairness checks, in ``tests/fairness/workload.py``; this module
runs them at benchmark sizes.

Three claim functions are compared, each in its own database:

* ``pgdispatch`` — ``pgd_claim`` as the database defines it: candidate (project, pool) pairs ordered by
  weighted running share (``running / weight``, fewest first), least recently served first
  between equals (``pgd_claim_candidates``); priority orders jobs only inside a project; each
  candidate is re-checked by a fresh read under its project's claim lock while capacity is
  scarce (``pgd_fairer_candidate_exists``).
* ``single-read`` — the same order, but the project chosen from the one lock-free read
  (``install_single_read``: the re-check switched off).
* ``global-order`` — a benchmark/test-only copy of the live ``pgd_claim_candidates``
  (``install_global_order``) whose order is the head job's ``(priority DESC, id)``: one plain
  global priority/FIFO queue across projects. Everything else (reservations, bounds, SKIP
  LOCKED) is the real function's.

Three workloads. The first two are driven by one simulated runner on one real connection
through ``pgdispatch.sql.transitions.claim`` and ``pgdispatch.sql.transitions.complete`` (``drive``), the third by
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
  4 ms; ``--threads-warmup-seconds`` (1 s) of warm-up, then ``--threads-seconds`` measured.

Figures: Jain's fairness index (Jain, Chiu & Hawe, DEC-TR-301, 1984) of weighted running
share, ``J = (Σx)² / (n·Σx²)`` with ``x_i = running_i / weight_i`` over the projects that still
have queued work, taken after every claim once the pool has filled (for the threaded
workload: every sample) and averaged (1.0 = every project runs exactly its weighted share;
1/n = one project has it all);
the small project's wait in claims; running and completed ratios. Results are printed as a
table and saved as JSON under ``bench/results/`` (gitignored), or ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pgdispatch.sql import db
from tests.fairness.workload import (GLOBAL_ORDER, ConcurrentReport, Trace, Workload, asymmetric, drive,
                                     drive_concurrent, install_global_order, install_single_read,
                                     jain_index, setup, weighted)
from tests.variants import candidate_order

from .common import RESULTS_DIR, bench_server, scratch_database, template_database


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
    parser.add_argument("--threads-warmup-seconds", type=float, default=1.0,
                        help="3:1 with threads: warm-up seconds, not measured (1)")
    parser.add_argument("--threads", type=int, default=12, help="3:1 with threads: claim loops (8 slots)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random durations")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated claim variants (default: {','.join(VARIANTS)})")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/fairness-<UTC>.json)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}

    asym = asymmetric(big_jobs=args.big_jobs)
    weigh = weighted(jobs_each=args.weighted_claims + 100)
    small = asym.projects[1]

    def small_all_started(trace: Trace) -> bool:
        return trace.steps[-1].project == small.name and trace.wait_for(small.name, small.jobs) is not None

    results = []
    started_at = dt.datetime.now(dt.timezone.utc)
    version = pgdispatch_order = None
    with bench_server() as (server_url, server_kind), \
            template_database(server_url, "pgd_bench_fairness_template") as template:
        for variant, install in variants.items():
            for workload, claims, until in ((asym, args.asymmetric_claims, small_all_started),
                                            (weigh, args.weighted_claims, None)):
                with scratch_database(server_url, "pgd_bench_fairness", template=template) as url, \
                        db.connect(url, application_name="bench-fairness") as conn:
                    pgdispatch_order = pgdispatch_order or candidate_order(conn)
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
            threaded = weighted(jobs_each=int(400 * (args.threads_seconds + args.threads_warmup_seconds)))
            with scratch_database(server_url, "pgd_bench_fairness", template=template) as url, \
                    db.connect(url, application_name="bench-fairness") as conn:
                if install is not None:
                    install(conn)
                world = setup(conn, threaded.projects, slots=threaded.slots, interleave=True)
                report = drive_concurrent(url, runner_id=world["runner_id"], pool_ids=world["pool_ids"],
                                          names=world["names"], loops=args.threads,
                                          seconds=args.threads_seconds + args.threads_warmup_seconds,
                                          warmup_seconds=args.threads_warmup_seconds,
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
    out = args.out or RESULTS_DIR / f"fairness-{started_at:%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "fairness", "started_at": started_at.isoformat(), "server": server_kind,
        "server_version": version, "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_average": os.getloadavg(), "seed": args.seed,
        "arguments": vars(args), "pgdispatch_candidate_order": pgdispatch_order,
        "global_order": " ".join(GLOBAL_ORDER.split()), "results": results,
    }, indent=2, default=str) + "\n")
    print(f"\nsaved {out}")
    return 0
