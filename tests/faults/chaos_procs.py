"""Real pgdispatch processes for the fault tests: ``python -m scheduler`` and
``python -m pgdispatch web``, each logging to its own file, signalled and killed for real.

``Fleet.close()`` kills every process it started that is still alive. The job commands the
fault tests submit are short (bounded sleeps), so a job orphaned by a SIGKILLed scheduler
ends by itself within seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# Short lease and intervals (seconds), as in tests/e2e: a killed runner's lease lapses in 2 s.
FAST_ENV = {
    "PGDISPATCH_LEASE_SECONDS": "2",
    "PGDISPATCH_HEARTBEAT_SECONDS": "0.5",
    "PGDISPATCH_CLAIM_INTERVAL_SECONDS": "0.2", "PGDISPATCH_CLAIM_IDLE_CAP_SECONDS": "1",
    "PGDISPATCH_EXPIRE_INTERVAL_SECONDS": "0.3",
    # a killed scheduler's duties (the expiry sweep of every pool) pass on within 3 s
    "PGDISPATCH_RUNNER_BEAT_SECONDS": "1",
    "PGDISPATCH_DUTY_LEASE_SECONDS": "3",
    "PGDISPATCH_SUMMARY_INTERVAL_SECONDS": "1",
    "PGDISPATCH_BACKOFF_BASE_SECONDS": "0.1",
    "PGDISPATCH_BACKOFF_CAP_SECONDS": "0.2",
}


def wait_until(fn: Callable[[], Any], *, what: str, timeout_s: float,
               logs: Callable[[], str] = lambda: "", interval_s: float = 0.1) -> Any:
    """Poll ``fn`` until it returns something truthy; fail after ``timeout_s`` seconds,
    with ``logs()`` in the message."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}; "
                                 f"last: {value!r}\n{logs()}")
        time.sleep(interval_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Proc:
    """One started process and its log."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    kind: str
    db_url: str

    @property
    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Fleet:
    """Starts scheduler and web processes under ``tmp_path``; ``close`` kills the survivors.

    Args:
        tmp_path: logs and the web console's data dir go here.
        env: PGDISPATCH_* settings for every process (FAST_ENV by default).
    """

    def __init__(self, tmp_path: Path, env: dict[str, str] | None = None):
        self.tmp_path = tmp_path
        self.env = dict(FAST_ENV if env is None else env)
        self.procs: list[Proc] = []

    def _environ(self, db_url: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("PGDISPATCH_") and k != "DATABASE_URL"}
        env.update(self.env)
        # PYTHONFAULTHANDLER: a process that will not stop is sent SIGABRT, and Python then
        # writes every thread's stack into its log
        env.update(DATABASE_URL=db_url, PGDISPATCH_DATA_DIR=str(self.tmp_path / "data"),
                   PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
        return env

    def _spawn(self, name: str, kind: str, argv: list[str], db_url: str,
               extra_env: dict[str, str] | None = None) -> Proc:
        log_path = self.tmp_path / f"{name}.log"
        env = self._environ(db_url)
        env.update(extra_env or {})
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log_file,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        proc = Proc(name, popen, log_path, kind, db_url)
        self.procs.append(proc)
        return proc

    def start_scheduler(self, name: str, db_url: str, *, pools: tuple[str, ...] = ("linux",),
                        slots: int = 3, grace_seconds: float = 1.0) -> Proc:
        """``python -m scheduler --pool … --slots N --name NAME --grace-seconds S``."""
        argv = [sys.executable, "-m", "pgdispatch.scheduler", "--slots", str(slots), "--name", name,
                "--grace-seconds", str(grace_seconds)]
        for pool in pools:
            argv += ["--pool", pool]
        return self._spawn(name, "scheduler", argv, db_url)

    def start_web(self, name: str, db_url: str, *, port: int, workers: int = 2) -> Proc:
        """``python -m pgdispatch web --bind 127.0.0.1:PORT --workers N``."""
        argv = [sys.executable, "-m", "pgdispatch", "web", "--bind", f"127.0.0.1:{port}",
                "--workers", str(workers)]
        return self._spawn(name, "web", argv, db_url,
                           {"PGDISPATCH_SECRET_KEY": "chaos-test-secret-key-0123456789abcdef"})

    def schedulers(self) -> list[Proc]:
        return [p for p in self.procs if p.kind == "scheduler"]

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {p.name} (exit {p.popen.poll()}) ---\n{p.log_tail(chars)}"
                         for p in self.procs)

    def stop(self, proc: Proc, *, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code (SIGKILL and fail after ``timeout_s``)."""
        if proc.is_alive:
            proc.popen.send_signal(signal.SIGTERM)
        try:
            return proc.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.popen.send_signal(signal.SIGABRT)  # dump the stacks (PYTHONFAULTHANDLER)
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)
            raise AssertionError(f"{proc.name} did not stop within {timeout_s:g} s of SIGTERM\n"
                                 f"{proc.log_tail(12000)}") from None

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive:
                p.popen.kill()
        for p in self.procs:
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def http(method: str, url: str, *, body: Any = None, token: str | None = None,
         timeout_s: float = 15.0) -> tuple[int, Any]:
    """One HTTP request; returns (status, decoded JSON or text). A refused or reset
    connection or a timeout is status 0."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")
