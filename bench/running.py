"""Claim latency with many jobs running: what a single claim costs while N jobs hold capacity.

Run it from the repository root::

    python -m bench running [--running 0,5000,20000] [--claims 200] [--out FILE.json]

One server for the invocation (an embedded PostgreSQL in a temporary directory, or
``DATABASE_URL``'s; see bench/claim.py), a fresh copy of a migrated template per size. For
each N in ``--running``: the bench organization and pool with limits that do not bind
(100,000, an organization's largest limit: so N is at most 99,999, one slot left for
the timed claim), 4 projects without a bound, N + ``--claims`` queued no-op jobs; N of them are
claimed in batches of 500 with a one-hour lease and left running (so N organization and pool
slots are held and N jobs count as running for fairness), then ``VACUUM ANALYZE``. Then
``--claims`` times, one session: ``pgdispatch.sql.transitions.claim`` one job (timed: the call's wall
clock in milliseconds, ``time.perf_counter``), then complete it (not timed), so the running
count stays N. Reported: p50, p95 and p99 (nearest rank) per N, and the ratio of each p50 to
the first N's.

Why: every claim reads, without locks, whether capacity is scarce
(``pgd_capacity_scarce``) and each candidate project's running count
(``pgd_claim_candidates``); both were counts over the running jobs, until the scarcity read
counted free slots and the project count was kept on its stripes (project_running_stripes,
sql/functions/capacity.sql): both now read a few rows whatever runs (docs/benchmarks.md,
"Claim cost with many jobs running").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pgdispatch.sql import db, transitions

from .common import (FREE_LIMIT, POOL, RESULTS_DIR, bench_server, limits, percentile, prepare,
                     scratch_database, template_database)

BATCH = 500


def measure(server_url: str, template: str, *, running: int, claims: int) -> dict[str, Any]:
    """One size: ``running`` jobs left running, then ``claims`` timed single claims."""
    with scratch_database(server_url, "pgd_bench_running", template=template) as url:
        pool_ids = prepare(url, jobs=running + claims, projects=4, limit=limits(1, binding=False))
        with db.connect(url, application_name="bench-running") as conn:
            runner = transitions.register_runner(conn, name="bench-running", pools=[POOL],
                                                 slots=1, hostname="bench", pid=os.getpid())
            held = 0
            while held < running:
                got = transitions.claim_batch(
                    conn, runner_id=runner, pools=pool_ids, lease_seconds=3600,
                    claim_tokens=[transitions.new_claim_token()
                                  for _ in range(min(BATCH, running - held))])
                if not got:
                    raise AssertionError(f"only {held} of {running} jobs could be claimed")
                held += len(got)
            conn.execute("VACUUM ANALYZE")
            times = []
            for _ in range(claims):
                start = time.perf_counter()
                c = transitions.claim(conn, runner_id=runner, pools=pool_ids,
                                      claim_token=transitions.new_claim_token(), lease_seconds=3600)
                times.append((time.perf_counter() - start) * 1000.0)
                if c is None:
                    raise AssertionError("a claim found nothing to take")
                transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                     outcome="succeeded", exit_code=0, receipt_key=c.receipt_key)
            still = conn.execute("SELECT count(*) AS n FROM jobs WHERE state = 'running'").fetchone()["n"]
            if still != running:
                raise AssertionError(f"{still} jobs running after the claims, expected {running}")
    return {"running": running, "claims": claims, "p50_ms": statistics.median(times),
            "p95_ms": percentile(times, 95), "p99_ms": percentile(times, 99)}


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table."""
    base = rows[0]["p50_ms"]
    lines = ["| running jobs | claim p50, ms | p95, ms | p99, ms | p50 vs first |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['running']:,} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | "
                     f"{r['p99_ms']:.2f} | {r['p50_ms'] / base:.2f}× |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 0, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench running``: measure each size, print the table, save the JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench running", description=__doc__.split("\n")[0])
    parser.add_argument("--running", type=_ints, default=[0, 5000, 20000],
                        help="jobs left running, comma-separated (0,5000,20000)")
    parser.add_argument("--claims", type=int, default=200, help="timed claims per size (200)")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/running-<UTC>.json)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.claims < 1:
        parser.error("--claims must be at least 1")
    if max(args.running) >= FREE_LIMIT:
        parser.error(f"--running must stay below {FREE_LIMIT:,} (the organization's limit; "
                     "the timed claim needs one slot)")
    created = dt.datetime.now(dt.timezone.utc)
    with bench_server() as (server_url, kind), template_database(server_url) as template:
        rows = []
        for n in args.running:
            rows.append(measure(server_url, template, running=n, claims=args.claims))
            print(f"running {n:,}: claim p50 {rows[-1]['p50_ms']:.2f} ms", flush=True)
    print(table(rows))
    out = args.out or RESULTS_DIR / f"running-{created.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"created_at": created.isoformat(timespec="seconds"),
                               "command": ["python -m bench running", *(argv or [])],
                               "server": kind, "runs": rows}, indent=1))
    print(f"saved: {out}")
    return 0
