"""Race tests: every racer thread must be gone when its test ends."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture(autouse=True)
def _no_leftover_racers():
    """Fail loudly, not hang later, if a test leaves a racer or watcher thread behind."""
    yield
    stray = [t.name for t in threading.enumerate() if t.name.startswith(("racer-", "watcher"))]
    assert not stray, f"threads left running: {stray}"
