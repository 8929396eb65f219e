"""The fleet benchmark still runs end to end: ``python -m bench fleet --quick`` at the
smallest size (two schedulers per route, windows of seconds) in a subprocess, on its own
embedded server, with a real PgBouncer and real scheduler processes. Its figures mean
nothing here; what counts is that every route runs, every job ran exactly once by the
benchmark's own check, and the results it promises are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUTES = ["direct", "pooled-listen", "pooled-poll"]
SPACED, BURST = 3, 20


def test_fleet_benchmark_runs_every_route_exactly_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    out = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "fleet", "--quick", "--counts", "2", "--slots", "2",
         "--settle-seconds", "0.5", "--window-seconds", "1.5", "--spaced-jobs", str(SPACED),
         "--gap-seconds", "0.02,0.05", "--burst-jobs", str(BURST), "--paused-jobs", "100",
         # a short idle cap: a polling-only job then waits seconds, not up to 15 s, on a
         # machine busy with other tests
         "--set", "PGDISPATCH_CLAIM_IDLE_CAP_SECONDS=2", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    output = f"{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, output
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python -m bench fleet --quick"), doc["command"]
    assert doc["machine"]["cpus"] and doc["scheduler_settings"]["resolved"]["claim_interval_seconds"]
    cells = {c["route"]: c for c in doc["cells"]}
    assert sorted(cells) == sorted(ROUTES), output
    for route, cell in cells.items():
        assert "error" not in cell and cell["fit"]["fits"], (route, cell)
        assert cell["exactly_once"]["ok"], (route, cell["exactly_once"])
        assert cell["exactly_once"]["jobs"] == SPACED + BURST
        assert cell["spaced"]["jobs"] == SPACED and cell["burst"]["jobs"] == BURST
        # the schedulers were seen working: idle transactions of the bench database counted
        assert cell["idle"]["transactions"] > 0, (route, cell["idle"])
        assert cell["idle_paused_backlog"]["paused_jobs"] == 100
    assert cells["pooled-poll"]["idle"]["pgbouncer"]["client_connections"] >= 2
    table = out.with_suffix(".md").read_text()
    assert all(f"| {route} | 2 |" in table for route in ROUTES), table
