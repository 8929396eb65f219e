"""The benchmarks still run against today's schema and functions: ``python -m bench smoke``
(bench/smoke.py: every benchmark once, at sizes that take seconds) in a subprocess, as
``make bench-smoke`` runs it, so that a change that breaks a benchmark fails the suite. And
the tests stand on their own: none imports ``bench``."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the peers' systems, whose series (pgqueuer-batch10, procrastinate-c4, ...) need
# bench/requirements.txt (make bench-smoke installs it; make test does not)
PEERS = ("pgqueuer-", "procrastinate-")


def test_every_benchmark_runs_at_smoke_size(tmp_path):
    # its own embedded server: on a DATABASE_URL server the tests create only pgd_test_*
    # databases (tests/conftest.py), and the benchmarks create pgd_bench_* ones
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    proc = subprocess.run([sys.executable, "-m", "bench", "smoke", "--keep", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    output = f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, output
    summary = json.loads((tmp_path / "smoke.json").read_text())
    assert [o for o in summary["outcomes"] if "error" in o] == [], output
    assert {o["benchmark"] for o in summary["outcomes"]} >= {"fairness", "notify", "costs",
                                                               "running", "e2e", "all", "report",
                                                               "console"}
    # a series may be left out only for a peer that is not installed
    unavailable = summary["unavailable"]
    assert all(s.startswith(PEERS) for s in unavailable), unavailable
    assert all("cannot be imported" in why for why in unavailable.values()), unavailable
    assert {"pgdispatch", "pgdispatch-bound", "pgdispatch-batch10", "pgdispatch-batch200",
            "raw-claim", "raw-claim-batch200", "tpcb", "ledger-without-all-batch10"} <= set(summary["series"])
    # the end-to-end run through the real scheduler gives every part's figures
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert e2e["errors"] == {}, e2e["errors"]
    assert set(e2e["latency"]["summary"]["idle"]) == {
        "submit", "dependency", "approval", "resume_project", "resume_pool", "slot_freed",
        "runner_full"}
    assert set(e2e["latency"]["summary"]["load"]) == set(e2e["latency"]["summary"]["idle"]) - {"runner_full"}
    assert all({"p50_ms", "p95_ms", "p99_ms"} <= set(s) for by in e2e["latency"]["summary"].values()
               for s in by.values())
    assert {"scheduler", "posix_spawn", "popen"} == set(e2e["throughput"]["median_jobs_per_s"])
    assert "ratio_to_ceiling" in e2e["throughput"]
    assert e2e["cpu"]["percent_of_one_core"] >= 0 and e2e["cpu"]["left_behind"] == 0
    # the console at scale: every page measured, each with its figures, none failed
    console = json.loads((tmp_path / "console.json").read_text())
    assert console["errors"] == {}, console["errors"]
    pages = console["pages"]
    assert {"overview", "queue", "jobs", "job detail (running)", "job detail (retried)",
            "jobs explain (queued)", "search common word", "reads.search_jobs no match"} <= set(pages)
    assert {f"queue ?reason={code}" for code in ("dependency_pending", "capacity_project",
                                                 "target_uncertain", "ready")} <= set(pages)
    assert {f"jobs ?state={state}" for state in ("queued", "running", "failed", "superseded")} <= set(pages)
    assert all({"p50_ms", "p95_ms", "max_ms", "calls", "slow"} <= set(r) for r in pages.values())
    assert console["build"]["jobs_by_state"]["uncertain"] == 1
    # the best-against-best comparison names the series and N it took for pgdispatch
    run = json.loads((tmp_path / "all.json").read_text())
    best = run["comparisons"]["best"]["pgdispatch"]
    assert best["median"] == max(c["median"] for s, by_n in run["summary"].items()
                                 if run["series"][s]["system"] == "pgdispatch" for c in by_n.values())
    assert run["summary"][best["series"]][str(best["clients"])]["median"] == best["median"]
    # the ledger's variant ran beside pgdispatch at its batch (bench/ledger.py)
    assert run["series"]["ledger-without-all-batch10"]["system"] == "pgdispatch-without-all"
    assert run["summary"]["ledger-without-all-batch10"] and run["summary"]["pgdispatch-batch10"]


def bench_imports(path: Path) -> list[str]:
    """The absolute imports of ``bench`` (or a module of it) in the Python file ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                 else [])
        found += [n for n in names if n == "bench" or n.startswith("bench.")]
    return found


def test_no_test_imports_bench():
    """What tests share with the benchmarks lives in test support (tests/fairness/workload.py,
    tests/variants.py), which bench imports; never the other way round."""
    offenders = {str(p.relative_to(ROOT)): bench_imports(p) for p in (ROOT / "tests").rglob("*.py")}
    assert {p: names for p, names in offenders.items() if names} == {}
