"""A separate process that kills job process groups when their scheduler cannot.

Each scheduler starts one watchdog (``python -m scheduler.watchdog``) with a pipe on its
stdin and tells it, for every running job, the job's process group and a deadline on the
host's monotonic clock (CLOCK_MONOTONIC is one clock for every process on the host):
``arm PGID DEADLINE`` — renewed after every successful heartbeat — and ``disarm PGID`` when
the job has ended. The watchdog SIGKILLs a group

* when its deadline passes: the scheduler could not renew the lease in time because it is
  frozen (SIGSTOP, swapped out) or cut off from the database, so the job may be given to
  another runner (the deadline lies a margin before the lease can lapse);
* when its stdin reaches end of file: the scheduler is gone (even SIGKILL closes its end of
  the pipe), and a job whose supervisor is gone must not go on beside its next attempt.

The watchdog runs in its own session, so that stopping the scheduler's whole process group
(``kill -STOP -PGID``, Ctrl-Z) does not freeze it too, and ignores SIGINT and SIGTERM: a Ctrl-C
meant for the scheduler's drain must not kill jobs that are being given their grace period.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)


def _kill(pgid: int) -> bool:
    """SIGKILL process group ``pgid``; False when there was no such group to kill."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def watch(fd: int = 0) -> int:
    """The watchdog's loop over commands read from ``fd``; returns 0 at end of file."""
    groups: dict[int, float] = {}
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    pending = b""
    while True:
        now = time.monotonic()
        for pgid in [g for g, deadline in groups.items() if deadline <= now]:
            del groups[pgid]
            if _kill(pgid):
                print(f"watchdog: killed process group {pgid}: its lease was not renewed in time",
                      file=sys.stderr, flush=True)
        timeout = max(0.0, min(groups.values()) - now) if groups else None
        if not sel.select(timeout):
            continue
        data = os.read(fd, 65536)
        if not data:
            killed = sorted(pgid for pgid in groups if _kill(pgid))
            if killed:
                print(f"watchdog: scheduler gone; killed process groups {killed}",
                      file=sys.stderr, flush=True)
            return 0
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            parts = line.split()
            if len(parts) == 3 and parts[0] == b"arm":
                groups[int(parts[1])] = float(parts[2])
            elif len(parts) == 2 and parts[0] == b"disarm":
                groups.pop(int(parts[1]), None)


class Watchdog:
    """The scheduler's handle on its watchdog process.

    ``margin_seconds``: how long before the lease could lapse the watchdog acts.
    """

    def __init__(self, *, margin_seconds: float):
        self.margin_seconds = margin_seconds
        self._lock = threading.Lock()
        # its own session: a SIGSTOP sent to the scheduler's process group (kill -STOP -PGID,
        # Ctrl-Z in a terminal) must not freeze the watchdog with the scheduler
        self._proc = subprocess.Popen([sys.executable, "-m", "pgdispatch.scheduler.watchdog"],
                                      stdin=subprocess.PIPE, close_fds=True, start_new_session=True)

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc.stdin is None or self._proc.stdin.closed:
                return
            try:
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                log.error("the watchdog process is gone; jobs are not guarded against a "
                          "frozen or killed scheduler")

    def arm(self, pgid: int, *, lease_from: float, lease_seconds: float) -> None:
        """Kill group ``pgid`` unless re-armed before ``lease_from + lease_seconds`` minus
        the margin (``lease_from``: time.monotonic() when the granting request was sent)."""
        self._send(f"arm {pgid} {lease_from + lease_seconds - self.margin_seconds:.6f}")

    def disarm(self, pgid: int) -> None:
        """Forget group ``pgid`` (its job has ended)."""
        self._send(f"disarm {pgid}")

    def close(self) -> None:
        """End the watchdog (it kills any group still armed) and wait for it."""
        with self._lock:
            if self._proc.stdin and not self._proc.stdin.closed:
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return watch(0)


if __name__ == "__main__":
    sys.exit(main())
