"""The web's /metrics under a real multi-worker ``pgdispatch web``: whichever worker answers a
scrape, the web's own counters are the sum over every worker (prometheus_client's
multiprocess mode, webapp/metrics.py and webapp/serve.py), so they never go back — not
between scrapes, not when gunicorn replaces its workers — and no series describes one worker."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_SECONDS = 30.0
DEADLINES = "pgdispatch_statement_deadlines_total"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(fn, what: str, out: Path):
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not (value := fn()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n"
                                 f"{out.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    return value


def _workers(pid: int) -> set[int]:
    """The gunicorn workers: the arbiter's child processes."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {int(c) for c in children}


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_counters_are_summed_over_the_workers_and_never_go_back(db_url, console_url, world,
                                                                 tmp_path):
    world.setup(pools=("linux",))
    port, out = _free_port(), tmp_path / "web.log"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PGDISPATCH_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(DATABASE_URL=console_url, PGDISPATCH_DATA_DIR=str(tmp_path / "data"),
               PGDISPATCH_STATEMENT_DEADLINE_SECONDS="1",
               # one given is replaced by a fresh one of its own
               PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    with open(out, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pgdispatch", "web", "--workers", "2",
                                 "--bind", f"127.0.0.1:{port}"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"

    def answering() -> bool:
        assert proc.poll() is None, out.read_text(errors="replace")
        try:
            return len(_workers(proc.pid)) == 2 and _get(url)[0] == 200
        except OSError:  # not listening yet
            return False

    try:
        _until(answering, "two workers answering", out)
        files = Path(re.search(r"counters are summed in (\S+) ", out.read_text()).group(1))
        assert files != tmp_path and files.stat().st_mode & 0o777 == 0o700

        def total(text: str) -> float:
            match = re.search(rf"^{DEADLINES} ([0-9.e+-]+)$", text, re.M)
            assert match, text
            return float(match.group(1))

        text = _get(url)[1]
        assert total(text) == 0
        assert "# TYPE pgdispatch_transaction_retries_total counter" in text  # before any retry
        assert "pgdispatch_claim_seconds" not in text and "_created" not in text
        assert not re.search(r"^(process|python)_", text, re.M), "one worker's own series"

        # scrapes stuck behind a lock past the statement deadline: each counts one deadline
        # in the worker that took it; taken at once, both workers take some
        answers: list[int] = []
        with psycopg.connect(db_url) as locker:
            locker.execute("LOCK TABLE runners IN ACCESS EXCLUSIVE MODE")
            threads = [threading.Thread(target=lambda: answers.append(_get(url)[0]))
                       for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        cut = sum(1 for a in answers if a != 200)
        assert len(answers) == 8 and cut >= 2, answers

        # every scrape, whichever worker answers it, says the sum
        assert {total(_get(url)[1]) for _ in range(12)} == {cut}

        # gunicorn replaces every worker (SIGHUP): the old workers' counts stay in the sum
        old = _workers(proc.pid)
        proc.send_signal(signal.SIGHUP)
        _until(lambda: len(_workers(proc.pid)) == 2 and not _workers(proc.pid) & old,
               "two new workers", out)
        _until(answering, "a new worker answering", out)
        assert {total(_get(url)[1]) for _ in range(12)} == {cut}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, out.read_text(errors="replace")
    assert not files.exists(), "the arbiter removes its directory when it stops"
