"""Scheduler processes for the tests that run several at once (tests/concurrency,
tests/pooling, tests/scheduler/test_batch_claiming.py): each started as an operator starts
it (``python -m pgdispatch scheduler``) with its output in a log file of its own, stopped
with SIGTERM, and their logs' tails for an assertion's message."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

Procs = list[tuple[subprocess.Popen, Path]]


def start_schedulers(env: dict[str, str], tmp_path: Path, n: int,
                     args: Callable[[int], list[str]]) -> Procs:
    """``n`` processes ``pgdispatch scheduler ARGS(i)`` with environment ``env``; returns
    (process, log file) for each (the logs in ``tmp_path``)."""
    procs: Procs = []
    for i in range(n):
        log_path = tmp_path / f"scheduler-{i}.log"
        with open(log_path, "wb") as log:
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "pgdispatch", "scheduler", *args(i)],
                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL), log_path))
    return procs


def stop(procs: Procs) -> list[int | None]:
    """SIGTERM every one, then wait for each (30 s, then SIGKILL); returns the exit codes."""
    for p, _ in procs:
        p.terminate()
    for p, _ in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
    return [p.returncode for p, _ in procs]


def logs(procs: Procs) -> str:
    """The tail of each one's log, headed by its name and exit code (None: still running)."""
    return "\n".join(f"--- {path.name} (exit {p.poll()}) ---\n"
                     f"{path.read_text(errors='replace')[-3000:]}" for p, path in procs)
