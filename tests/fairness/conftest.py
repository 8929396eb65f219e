"""Fairness tests: every claim-loop or watcher thread must be gone when its test ends."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture(autouse=True)
def _no_leftover_loops():
    """Fail loudly, not hang later, if a test leaves a claim loop or a watcher behind."""
    yield
    stray = [t.name for t in threading.enumerate() if t.name.startswith(("bench-", "watcher"))]
    assert not stray, f"threads left running: {stray}"
