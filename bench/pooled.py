"""Dispatch latency behind PgBouncer in transaction pooling: submit -> command started, with
the wake-up listener on a session route (``--listen-url``) against polling alone.

Run it from the repository root::

    python -m bench pooled [--jobs 40] [--modes poll,listen-direct,listen-session]
                           [--claim-interval-seconds 1.0] [--gap-seconds 1.0]
                           [--schedulers 2] [--slots 2] [--out FILE.json]

One server for the invocation (``bench.common.bench_server``: an embedded PostgreSQL, or
``DATABASE_URL``'s), and one PgBouncer in front of it (``tests/pooling/pgbouncer.py``, the
tests' launcher: ``pool_mode = transaction``, three server connections per database and
user, and a database entry of the run's database with ``pool_mode = session``). Each mode
gets a fresh copy of a migrated template and ``--schedulers`` real scheduler processes
(``python -m pgdispatch scheduler --pool bench --slots N``) with DATABASE_URL through the
transaction-pooled route and the claim interval ``--claim-interval-seconds`` (1 s, the
default of PGDISPATCH_CLAIM_INTERVAL_SECONDS). Modes:

* ``poll`` — ``--no-listen``: a job is found by the next claim poll;
* ``listen-direct`` — ``--listen-url`` straight to PostgreSQL;
* ``listen-session`` — ``--listen-url`` through the PgBouncer session-mode entry.

A submitter (its own connection, through the transaction-pooled route, as a CI system
would submit) runs a closed loop of ``--jobs`` jobs: sleep U(0, ``--gap-seconds``), submit
one job (``pgdispatch.sql.transitions.submit``, committed when it returns), wait until its
command has run, repeat; so each job meets idle schedulers at a random phase of their poll.
The command is ``sh -c 'date +%s.%N > FILE'``. Latency = the wall-clock time the command
wrote minus the wall-clock time the submit returned (one machine, one clock), milliseconds:
it includes the claim, the fork and exec of the command, never the commit. Reported per
mode: p50 (the median), p95 (nearest rank) and max.

Output: a markdown table on stdout, and ``bench/results/pooled-<UTC timestamp>.json``
(gitignored): parameters, server settings, every latency.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pgdispatch.sql import config, db, transitions

from tests.pooling.pgbouncer import PGBOUNCER, PgBouncer

from .common import (POOL, RESULTS_DIR, ROOT, bench_server, config_text, limits, percentile,
                     scratch_database, server_settings, template_database)

MODES = ("poll", "listen-direct", "listen-session")
READY_TIMEOUT_S = 30.0
JOB_TIMEOUT_S = 30.0


def start_schedulers(pooled_url: str, listen_url: str | None, *, n: int, slots: int,
                     interval_s: float, folder: Path) -> list[subprocess.Popen]:
    """``n`` scheduler processes on ``pooled_url``; ``--no-listen`` when ``listen_url`` is
    None, else ``--listen-url listen_url``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=pooled_url, PGDISPATCH_CLAIM_INTERVAL_SECONDS=str(interval_s),
               PGDISPATCH_DATA_DIR=str(folder / "data"))
    listen = ["--no-listen"] if listen_url is None else ["--listen-url", listen_url]
    procs = []
    for i in range(n):
        with open(folder / f"scheduler-{i}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pgdispatch", "scheduler", "--pool", POOL, "--slots",
                 str(slots), "--name", f"bench-pooled-{i}", *listen],
                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    return procs


def wait_ready(direct_url: str, *, schedulers: int, listeners: int, procs) -> None:
    """Until every scheduler registered its runner and ``listeners`` of them registered their
    listener session; then one more second, so that each has made its first claim poll."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with db.connect(direct_url, application_name="bench-pooled-watch") as conn:
        while True:
            runners = conn.execute("SELECT count(*) AS n FROM runners WHERE stopped_at IS NULL"
                                   ).fetchone()["n"]
            # a listener registers its session on its runner row after its LISTENs
            # (pgd_listen_runner, sql/functions/wakeups.sql)
            listening = conn.execute(
                "SELECT count(*) AS n FROM runners WHERE stopped_at IS NULL "
                "AND listen_pid IS NOT NULL").fetchone()["n"]
            if runners >= schedulers and listening >= listeners:
                break
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a scheduler exited before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {READY_TIMEOUT_S} s: {runners} runners, "
                                   f"{listening} listeners")
            time.sleep(0.05)
    time.sleep(1.0)


def stop(procs: Sequence[subprocess.Popen]) -> list[int | None]:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
    return [p.returncode for p in procs]


def submit_loop(pooled_url: str, *, jobs: int, gap_s: float, folder: Path,
                rng: random.Random) -> list[float]:
    """The closed loop of the module docstring; the latencies in milliseconds."""
    latencies = []
    with db.connect(pooled_url, application_name="bench-pooled-submit") as conn:
        for i in range(jobs):
            time.sleep(rng.uniform(0, gap_s))
            mark = folder / f"started-{i}"
            transitions.submit(conn, project="p0", pool=POOL,
                               command=["sh", "-c", f"date +%s.%N > {mark}"], submitted_by="bench")
            committed = time.time()
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while True:
                text = mark.read_text().strip() if mark.exists() else ""
                if text:
                    latencies.append((float(text) - committed) * 1000.0)
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"job {i} did not start in {JOB_TIMEOUT_S} s")
                time.sleep(0.002)
    return latencies


def run_mode(server_url: str, template: str, bouncer: PgBouncer, mode: str, *, jobs: int,
             schedulers: int, slots: int, interval_s: float, gap_s: float, seed: int
             ) -> dict[str, Any]:
    """One mode on a fresh database; its latencies and summary."""
    with scratch_database(server_url, "pgd_bench_pooled", template=template) as url, \
            tempfile.TemporaryDirectory(prefix="pgd-bench-pooled-") as tmp:
        folder = Path(tmp)
        with db.connect(url, application_name="bench-setup") as conn:
            config.apply_config(conn, config_text(limits(schedulers * slots, binding=False), 1),
                                actor="bench", env={})
        listen_url = {"poll": None, "listen-direct": url,
                      "listen-session": bouncer.session_alias(url)}[mode]
        procs = start_schedulers(bouncer.url(url), listen_url, n=schedulers, slots=slots,
                                 interval_s=interval_s, folder=folder)
        try:
            wait_ready(url, schedulers=schedulers, listeners=0 if listen_url is None else schedulers,
                       procs=procs)
            latencies = submit_loop(bouncer.url(url), jobs=jobs, gap_s=gap_s, folder=folder,
                                    rng=random.Random(seed))
        finally:
            codes = stop(procs)
        return {"mode": mode, "latencies_ms": latencies, "exit_codes": codes,
                "p50_ms": statistics.median(latencies), "p95_ms": percentile(latencies, 95),
                "max_ms": max(latencies)}


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| mode | jobs | p50 ms | p95 ms | max ms |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in runs:
        lines.append(f"| {r['mode']} | {len(r['latencies_ms'])} | {r['p50_ms']:.0f} | "
                     f"{r['p95_ms']:.0f} | {r['max_ms']:.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench pooled``: run the modes, print the table, save the JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench pooled",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=40, help="jobs per mode (40)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--claim-interval-seconds", type=float, default=1.0,
                        help="the schedulers' poll, seconds (1.0, the default)")
    parser.add_argument("--gap-seconds", type=float, default=1.0,
                        help="pause before each submit: U(0, G) seconds (1.0)")
    parser.add_argument("--schedulers", type=int, default=2, help="scheduler processes (2)")
    parser.add_argument("--slots", type=int, default=2, help="slots of each (2)")
    parser.add_argument("--seed", type=int, default=1, help="of the submit gaps (1)")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/pooled-<UTC>.json)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s): {', '.join(sorted(unknown))}")
    started = dt.datetime.now(dt.timezone.utc)
    runs = []
    with bench_server() as (server_url, server_kind), \
            template_database(server_url, "pgd_bench_pooled_template") as template:
        bouncer = PgBouncer(server_url, pool_size=3)
        try:
            for mode in modes:
                t0 = time.monotonic()
                run = run_mode(server_url, template, bouncer, mode, jobs=args.jobs,
                               schedulers=args.schedulers, slots=args.slots,
                               interval_s=args.claim_interval_seconds, gap_s=args.gap_seconds,
                               seed=args.seed)
                run["wall_seconds"] = time.monotonic() - t0
                runs.append(run)
                print(f"  {mode}: p50 {run['p50_ms']:.0f} ms, p95 {run['p95_ms']:.0f} ms "
                      f"({run['wall_seconds']:.1f} s)", flush=True)
        finally:
            bouncer.stop()
        settings = server_settings(server_url)
    print(f"\nDispatch latency through PgBouncer (transaction pooling; submit returned -> "
          f"command started, ms), {args.schedulers} schedulers, poll every "
          f"{args.claim_interval_seconds:g} s\n")
    print(table(runs))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = args.out or RESULTS_DIR / f"pooled-{started:%Y%m%dT%H%M%SZ}.json"
    out.write_text(json.dumps({
        "benchmark": "pooled", "started_at": started.isoformat(),
        "command": "python -m bench pooled" + (" " + " ".join(argv) if argv else ""),
        "server": server_kind, "server_settings": settings,
        "pgbouncer": subprocess.run([PGBOUNCER, "--version"], capture_output=True,
                                    text=True).stdout.splitlines()[0],
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "load_average_after": os.getloadavg(), "params": vars(args) | {"out": str(out)},
        "runs": runs,
    }, indent=1, default=str) + "\n")
    print(f"saved {out}")
    return 0 if all(c == 0 for r in runs for c in r["exit_codes"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
