"""``python -m bench smoke``: every benchmark once, at sizes that take seconds, on one server.

Run it from the repository root (``make bench-smoke`` installs ``bench/requirements.txt``
first, so that the peers' series run too; ``make test`` runs it through
tests/bench/test_smoke.py)::

    python -m bench smoke [--keep DIR] [--strict]

The figures mean nothing; what counts is that every benchmark still runs against today's
schema and functions, end to end, with its own checks (a run that does not end clean fails).
One embedded server (or ``DATABASE_URL``'s) serves every benchmark in turn
(``bench.common.shared_server``); the embedded one runs without flushing to disk. Each writes its results to a temporary directory, removed
afterwards, or to ``--keep DIR``, beside ``smoke.json`` (what ran, how long, what failed).
A series that cannot run because its package is not installed (the peers, without
``bench/requirements.txt``) is reported as not run, and fails the smoke run only with
``--strict``. Exit status: 0, or 1 when a benchmark failed (the others still run).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from pgdispatch.sql import db

from .common import shared_server

# The parts `all` runs (claim, peers, ceiling, latency, and the report it writes; the ledger
# series when named: one runs in SMOKE_SERIES).
PARTS_OF_ALL = ("ledger", "claim", "peers", "ceiling", "latency")
# The smoke run's own embedded server is thrown away afterwards and its figures mean nothing:
# it need not flush to disk, which makes creating and dropping its many databases quick. A
# DATABASE_URL server is left as it is.
NO_FLUSH = ("fsync", "synchronous_commit", "full_page_writes")
# Benchmarks with a smoke test of their own, left out of this run: the fleet starts real
# scheduler processes and waits out idle windows (tests/bench/test_fleet.py runs it small).
RUN_ELSEWHERE = ("fleet",)


SMOKE_SERIES = ("pgdispatch", "pgdispatch-bound", "pgdispatch-batch10", "pgdispatch-batch200",
                "pgdispatch-batch200-bound", "pgqueuer-batch10", "pgqueuer-batch200",
                "procrastinate-c1", "procrastinate-c16", "raw-claim", "raw-claim-batch200", "tpcb",
                "ledger-without-all-batch10")


def runs(out: Path) -> list[tuple[str, list[str], list[Path]]]:
    """(benchmark, arguments, files it must write) in run order, at smoke sizes."""
    return [
        ("fairness", ["--big-jobs", "40", "--asymmetric-claims", "60", "--weighted-claims", "40",
                      "--threads-seconds", "0.3", "--threads-warmup-seconds", "0.2", "--threads", "2",
                      "--out", str(out / "fairness.json")], [out / "fairness.json"]),
        ("notify", ["--submits", "4", "--claimers", "2", "--intervals", "0.05",
                    "--idle-seconds", "0.2", "--herd-jobs", "2", "--gap-seconds", "0.05",
                    "--clients", "2", "--jobs", "20", "--pgbench-seconds", "1", "--repeats", "1",
                    "--listeners", "1", "--out", str(out / "notify.json")], [out / "notify.json"]),
        ("pooled", ["--jobs", "2", "--gap-seconds", "0.05", "--claim-interval-seconds", "0.2",
                    "--schedulers", "1", "--slots", "1", "--out", str(out / "pooled.json")],
         [out / "pooled.json"]),
        ("costs", ["--clients", "2", "--repeats", "1", "--jobs", "8", "--history", "100",
                   "--slots", "10", "--no-checkpoint", "--out", str(out / "costs.json")],
         [out / "costs.json"]),
        ("running", ["--running", "0,10", "--claims", "5", "--out", str(out / "running.json")],
         [out / "running.json"]),
        ("claim-wal", ["--claims", "20", "--batch", "5", "--repeats", "1",
                       "--out", str(out / "claim-wal.json")], [out / "claim-wal.json"]),
        ("search", ["--jobs", "3000", "--runs", "2", "--submits", "20", "--repeats", "1",
                    "--out", str(out / "search.json")], [out / "search.json"]),
        # every console page on one small database (the full size: 1M queued, 10M finished)
        ("console", ["--queued", "300", "--history", "2000", "--calls", "2", "--page-seconds", "2",
                     "--out", str(out / "console.json")], [out / "console.json"]),
        # the real scheduler: one round of every way after the warm-up, a short idle cap and
        # heartbeat so that the poll-bound ways and the cancel take about a second
        ("e2e", ["--samples", "1", "--gap-seconds", "0.01,0.02", "--load-job-seconds", "0.2",
                 "--throughput-jobs", "20", "--repeats", "1", "--stats-wait-seconds", "0",
                 "--long-jobs", "3", "--long-seconds", "120", "--settle-seconds", "0.2",
                 "--window-seconds", "0.5", "--sample-timeout-seconds", "30",
                 "--set", "PGDISPATCH_CLAIM_IDLE_CAP_SECONDS=1", "--set", "PGDISPATCH_HEARTBEAT_SECONDS=1",
                 "--out", str(out / "e2e.json")], [out / "e2e.json"]),
        # one of each kind of series, the smallest and the largest batch of each sweep (the
        # sizes between run the same code)
        ("all", ["--series", ",".join(SMOKE_SERIES),
                 "--clients", "1", "--repeats", "1", "--jobs", "20", "--warmup", "20",
                 "--tpcb-seconds", "1", "--tpcb-scale", "1", "--history", "100",
                 "--queued-sizes", "50", "--latency-claims", "5", "--timeout-seconds", "120",
                 "--out", str(out / "all.json"), "--chart", str(out / "all.png")], [out / "all.json"]),
        ("report", [str(out / "all.json"), "--chart", str(out / "report.png")], []),
        # make bench's steps, listed (each is one of the benchmarks above at full size)
        ("plan", ["--list"], []),
    ]


def _entry(name: str) -> Callable[[Sequence[str]], int]:
    from .__main__ import BENCHMARKS

    module, _, function = BENCHMARKS[name].partition(":")
    return getattr(importlib.import_module(module), function or "main")


def uncovered(names: Sequence[str]) -> list[str]:
    """Registered benchmarks that the smoke run does not run (directly or as a part of all)."""
    from .__main__ import BENCHMARKS

    covered = set(names) | set(PARTS_OF_ALL) | {"smoke"} | set(RUN_ELSEWHERE)
    return sorted(set(BENCHMARKS) - covered)


def run_one(name: str, argv: list[str], files: list[Path]) -> dict[str, Any]:
    """Run one benchmark's main in this process; its outcome (JSON-ready)."""
    print(f"== smoke: {name} {' '.join(argv)}", flush=True)
    started = time.monotonic()
    outcome: dict[str, Any] = {"benchmark": name, "argv": argv}
    try:
        status = _entry(name)(argv)
        missing = [str(f) for f in files if not f.exists()]
        if status:
            outcome["error"] = f"exit status {status}"
        elif missing:
            outcome["error"] = f"wrote no {', '.join(missing)}"
    except BaseException as exc:  # noqa: BLE001 - reported; the other benchmarks still run
        if isinstance(exc, KeyboardInterrupt):
            raise
        traceback.print_exc()
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    outcome["seconds"] = time.monotonic() - started
    return outcome


@contextlib.contextmanager
def output_dir(keep: Path | None) -> Iterator[Path]:
    """``keep`` (created), or a temporary directory removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="pgd-bench-smoke-") as tmp:
        yield Path(tmp)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every benchmark at smoke size; print what ran; 1 if any failed."""
    p = argparse.ArgumentParser(prog="python -m bench smoke", description=__doc__.split("\n")[0])
    p.add_argument("--keep", type=Path, help="write the results here (default: a temporary directory)")
    p.add_argument("--strict", action="store_true",
                   help="a series that cannot run (a peer not installed) fails the smoke run")
    opts = p.parse_args(list(argv or []))
    started = time.monotonic()
    with output_dir(opts.keep) as out:
        plan = runs(out)
        outcomes: list[dict[str, Any]] = []
        missing = uncovered([name for name, _, _ in plan])
        if missing:
            outcomes.append({"benchmark": "smoke", "error": f"not in the smoke run: {', '.join(missing)}"})
        with shared_server() as (url, kind):
            if kind == "embedded":
                with db.connect(url, application_name="bench-smoke") as conn:
                    for name in NO_FLUSH:
                        conn.execute(f"ALTER SYSTEM SET {name} = off")
                    conn.execute("SELECT pg_reload_conf()")
            for name, args, files in plan:
                outcomes.append(run_one(name, args, files))
        doc = json.loads((out / "all.json").read_text()) if (out / "all.json").exists() else {}
        unavailable = doc.get("unavailable", {})
        if unavailable and opts.strict:
            outcomes.append({"benchmark": "all", "error": f"series not run: {', '.join(unavailable)}"})
        summary = {"seconds": time.monotonic() - started, "outcomes": outcomes,
                   "unavailable": unavailable, "series": sorted(doc.get("series", {}))}
        (out / "smoke.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\nsmoke run:")
    for o in outcomes:
        took = f"{o['seconds']:5.1f} s" if "seconds" in o else "       "
        print(f"  {o['benchmark']:<9} {took}  {'FAILED: ' + o['error'] if 'error' in o else 'ok'}")
    for name, why in unavailable.items():
        print(f"  not run: {name}: {why}")
    print(f"  {summary['seconds']:.1f} s in all")
    return 1 if any("error" in o for o in outcomes) else 0
