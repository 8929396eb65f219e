"""Fixtures for in-process scheduler tests: a real Scheduler on this test's database, with
River-style test signals (queues fed by its callbacks) to wait on instead of sleeping."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pgdispatch.scheduler.executor import ExecutionResult
from pgdispatch.scheduler.main import Scheduler
from pgdispatch.sql import Settings

# Short lease and fast intervals, so that every rule shows within a second or two.
# The idle backoff is capped at 0.8 s (four ticks), so tests that find work by polling (a
# retry's backoff elapsing) do not wait for the production cap of 15 s.
FAST = Settings(lease_seconds=3.0, heartbeat_seconds=1.0, claim_interval_seconds=0.2,
                claim_idle_cap_seconds=0.8,
                runner_beat_seconds=1.0, duty_lease_seconds=3.0,
                expire_interval_seconds=0.2, summary_interval_seconds=0.3,
                backoff_base_seconds=0.05, backoff_cap_seconds=0.1)


class Signals:
    """What a scheduler reports through its callbacks, as queues."""

    def __init__(self) -> None:
        self.claimed: queue.Queue = queue.Queue()
        self.started: queue.Queue = queue.Queue()
        self.completed: queue.Queue = queue.Queue()

    def next_started(self, timeout: float = 10.0) -> tuple[Any, int]:
        """(claim, pid) of the next command started."""
        return self.started.get(timeout=timeout)

    def next_completed(self, timeout: float = 15.0) -> ExecutionResult:
        """The next finished execution (reported or not)."""
        return self.completed.get(timeout=timeout)


@pytest.fixture
def start_scheduler(db_url):
    """Start a Scheduler: ``start_scheduler(pools=..., slots=..., settings=...)`` returns
    (scheduler, signals); ``database_url`` (default: the test's database) and ``listen``
    are the Scheduler's own. Every one is stopped at teardown (grace 0)."""
    started: list[Scheduler] = []

    def start(*, pools=("linux",), slots: int = 2, settings: Settings = FAST,
              kill_grace_seconds: float = 1.0,
              name: str | None = None, database_url: str | None = None,
              listen: bool = True) -> tuple[Scheduler, Signals]:
        signals = Signals()
        s = Scheduler(settings, database_url=database_url or db_url, pools=list(pools),
                      slots=slots, name=name, kill_grace_seconds=kill_grace_seconds,
                      listen=listen, on_claimed=signals.claimed.put,
                      on_started=lambda c, pid: signals.started.put((c, pid)),
                      on_completed=signals.completed.put)
        assert s.start()
        started.append(s)
        return s, signals

    yield start
    for s in started:
        s.stop(grace_seconds=0)


@pytest.fixture
def pid_files(tmp_path):
    """A directory where job commands write their pids; whatever they name is killed at
    teardown, so a failing test leaves no process behind."""
    d = tmp_path / "pids"
    d.mkdir()
    yield d
    for f in d.glob("*.pid"):
        try:
            pid = int(f.read_text().strip())
        except ValueError:
            continue
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def is_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (a reparented zombie may never be reaped
    in a container, so os.kill(pid, 0) alone would say yes)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def group_is_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is still in process group ``pgid``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def wait_until(fn: Callable[[], Any], *, timeout: float = 15.0, interval: float = 0.05,
               what: str = "condition") -> Any:
    """Poll ``fn`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {value!r}")
        time.sleep(interval)


def wait_for_file(path: Path, timeout: float = 10.0) -> str:
    """The content of ``path`` once it exists and is not empty."""
    return wait_until(lambda: path.exists() and path.read_text().strip(), timeout=timeout,
                      what=str(path))
