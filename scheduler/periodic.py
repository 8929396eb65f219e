"""The guard every APScheduler job runs under: a database outage never kills a job.

A failing run is logged (a warning for the first failure of an outage, then quietly until it
recovers) and the job backs off: later runs are skipped for a jittered, doubling delay capped
at ``cap_seconds``, so a scheduler waiting out an outage does not hammer the server.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from pgdispatch.sql import DatabaseUnavailable, Forbidden

log = logging.getLogger(__name__)


class Periodic:
    """A callable for APScheduler that runs ``fn()`` and survives its failures.

    Args:
        name: for the log.
        fn: the work; its return value is ignored.
        base_seconds / cap_seconds: backoff after consecutive failures, in seconds:
            uniform(0.5, 1) * min(cap, base * 2 ** (failures - 1)).
        is_exclusive: a call made while another runs returns at once (so APScheduler never
            sees overlapping runs pile up); False when ``fn`` handles overlap itself.
    """

    def __init__(self, name: str, fn: Callable[[], object], *, base_seconds: float = 0.2,
                 cap_seconds: float = 5.0, is_exclusive: bool = True):
        self.name = name
        self.fn = fn
        self.base_seconds = base_seconds
        self.cap_seconds = cap_seconds
        self.is_exclusive = is_exclusive
        self.failures = 0
        self._skip_until = 0.0
        self._lock = threading.Lock()
        self._running = threading.Lock()

    def __call__(self) -> None:
        """Run once unless backing off or (exclusive) already running; never raises."""
        if time.monotonic() < self._skip_until:
            return
        if self.is_exclusive:
            if not self._running.acquire(blocking=False):
                return
            try:
                self._run()
            finally:
                self._running.release()
        else:
            self._run()

    def _run(self) -> None:
        try:
            self.fn()
        except DatabaseUnavailable as exc:
            self._failed(f"database unavailable: {exc}")
        except Forbidden as exc:
            # the server refuses this host (a revoked grant or login): not a bug, no traceback
            self._failed(f"refused by the database: {exc}")
        except Exception as exc:
            log.exception("%s failed", self.name)
            self._failed(f"{type(exc).__name__}: {exc}")
        else:
            with self._lock:
                if self.failures:
                    log.info("%s: recovered after %d failed runs", self.name, self.failures)
                self.failures = 0
                self._skip_until = 0.0

    def _failed(self, why: str) -> None:
        with self._lock:
            self.failures += 1
            delay = min(self.cap_seconds, self.base_seconds * 2 ** (self.failures - 1))
            delay *= random.uniform(0.5, 1.0)
            self._skip_until = time.monotonic() + delay
            level = logging.WARNING if self.failures == 1 else logging.DEBUG
            log.log(level, "%s: %s; backing off %.2f s (failure %d)", self.name, why, delay,
                    self.failures)
