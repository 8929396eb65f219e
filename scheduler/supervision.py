"""Process supervision: a job's command in its own process group, watched until it ends.

The command starts in a new session (``start_new_session``), so its process id is also its
process group id and every way of stopping it reaches the whole tree. ``Supervisor.supervise``
reads the command's output into the tail and decides, from the heartbeat's flags, the clock
and ``request_stop``, whether and how to stop it; it returns why it stopped the command:

* ``fenced`` (a heartbeat was fenced out) and ``self_fenced`` (no heartbeat succeeded for
  the lease, less ``fence_margin_seconds``): SIGKILL to the group at once, since another
  runner may already have the job;
* ``cancel`` (requested, seen in a heartbeat's answer), ``timeout`` (the claim's
  ``timeout_seconds``) and ``shutdown`` (``request_stop``): SIGTERM, then SIGKILL after
  ``kill_grace_seconds`` (at once with ``hurry``);
* None: the command exited by itself.

Nothing of the group survives the job: ``end_command`` kills what is left and reaps it. A
process that left the group (``setsid``) is the sandbox's to find and kill, by its uid
(sandbox.py, ``RunAs``).
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pgdispatch.sql import Settings
from pgdispatch.sql.transitions import Claim

from .heartbeats import Heartbeat, fence_margin_seconds
from .output import OutputTail
from .sandbox import JobUser, Sandbox

log = logging.getLogger(__name__)

# Bounds reading the pipe after the group is gone: a process that escaped the group (setsid)
# may hold it open forever.
_READ_REST_SECONDS = 2.0


class CommandNotStarted(Exception):
    """The command could not be started; ``exit_code`` is 127 (not found) or 126 (found but
    not executable, or refused), as a shell reports them, and ``error`` says why."""

    def __init__(self, exit_code: int, error: str):
        super().__init__(error)
        self.exit_code = exit_code
        self.error = error


def start_command(claim: Claim, *, sandbox: Sandbox, workdir: Path,
                  user: JobUser | None = None) -> subprocess.Popen:
    """Start the claim's command in a new session, stdin from /dev/null, stdout and stderr
    into one pipe, in ``workdir``, as ``user`` (the job's lease, sandbox.py; None: this
    process's user) with the sandbox's environment and none of this process's other
    descriptors.

    Raises:
        CommandNotStarted: the program is missing, not executable, or the arguments refused.
    """
    try:
        return subprocess.Popen(claim.command, start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                **sandbox.popen_kwargs(claim, workdir, user))
    except (OSError, ValueError) as exc:
        exit_code = 127 if isinstance(exc, (FileNotFoundError, NotADirectoryError)) else 126
        raise CommandNotStarted(
            exit_code, f"{claim.command[0]}: {getattr(exc, 'strerror', None) or exc}") from None


def end_command(proc: subprocess.Popen, *, before_reap: Callable[[], None]) -> None:
    """SIGKILL whatever is left of the command's process group, call ``before_reap``, then
    reap the leader and close the pipe."""
    _kill_group(proc.pid, signal.SIGKILL)
    # Until proc.wait() the unreaped leader keeps its pid, so the group id cannot have gone
    # to another process group yet: before_reap may still name it (the watchdog's disarm).
    before_reap()
    proc.wait()
    proc.stdout.close()


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        # a member changed its uid (setuid program); the rest of the group got the signal
        log.warning("could not signal every process in group %d with %s", pgid,
                    signal.Signals(sig).name)


class _Waker:
    """A self-pipe that wakes the supervision loop's select() from other threads."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        """Make the next select() return (a no-op once closed)."""
        with self._lock:  # never write to a closed (and perhaps reused) descriptor
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"x")
            except BlockingIOError:
                pass  # already has bytes pending: it will wake anyway

    def drain(self) -> None:
        """Empty the pipe, so that select() waits again."""
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close both ends; later wakes do nothing."""
        with self._lock:
            self._closed = True
            os.close(self.read_fd)
            os.close(self._write_fd)


class Supervisor:
    """Watches one claim's command and stops it by the rules in this module's docstring.

    Args:
        claim: the attempt: its timeout_seconds, and its ids for the log.
        settings: lease_seconds, from which the self-fence deadline is counted.
        kill_grace_seconds: between SIGTERM and SIGKILL when stopping the command.
    """

    def __init__(self, claim: Claim, *, settings: Settings, kill_grace_seconds: float = 5.0):
        self.claim = claim
        self.settings = settings
        self.kill_grace_seconds = kill_grace_seconds
        self._stop_requested = threading.Event()
        self._hurry = threading.Event()
        self._waker = _Waker()

    def wake(self) -> None:
        """Make the loop look at the heartbeat's flags now (safe from any thread, and after
        ``close``)."""
        self._waker.wake()

    def request_stop(self, *, hurry: bool = False) -> None:
        """Stop the command (stop reason ``shutdown``): SIGTERM, then SIGKILL after
        kill_grace_seconds, or at once with ``hurry``. Works before and during ``supervise``."""
        self._stop_requested.set()
        if hurry:
            self._hurry.set()
        self._waker.wake()

    def close(self) -> None:
        """Release the wake-up pipe; later ``wake`` and ``request_stop`` calls do nothing."""
        self._waker.close()

    def supervise(self, proc: subprocess.Popen, hb: Heartbeat, tail: OutputTail, *,
                  after_exit: Callable[[], None] | None = None) -> str | None:
        """Read output into ``tail`` and enforce the rules until the command exits; returns
        the stop reason (fenced, self_fenced, cancel, timeout, shutdown, or None).
        ``after_exit`` is called once the leader has exited and the group is killed, before
        the leader is reaped and the rest of the output read (the sandbox kills what escaped
        the group, which may hold the output pipe open)."""
        claim = self.claim
        # Fence a margin before the lease could lapse, at the same moment as the watchdog.
        lease = self.settings.lease_seconds - fence_margin_seconds(self.settings.lease_seconds)
        out_fd = proc.stdout.fileno()
        os.set_blocking(out_fd, False)
        timeout_at = time.monotonic() + claim.timeout_seconds
        sel = selectors.DefaultSelector()
        sel.register(out_fd, selectors.EVENT_READ, "out")
        sel.register(self._waker.read_fd, selectors.EVENT_READ, "wake")
        pidfd = None
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, "exit")
        except (AttributeError, OSError):
            pass  # no pidfd (old kernel, or forbidden): poll for the exit instead
        stop_reason: str | None = None
        term_sent_at: float | None = None
        killed = False
        is_exited = False
        try:
            while True:
                now = time.monotonic()
                if not is_exited:
                    # WNOWAIT: leave the child a zombie, so its pid (and so its process group
                    # id) cannot be reused before the final killpg.
                    is_exited = os.waitid(os.P_PID, proc.pid,
                                          os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
                if is_exited:
                    if stop_reason is None and now - hb.last_ok_sent_at >= lease:
                        # killed by the watchdog at the fence deadline (or ended just then):
                        # the lease may be gone, so this attempt is no longer ours to report
                        stop_reason = "self_fenced"
                    break
                if stop_reason not in ("fenced", "self_fenced"):
                    if hb.is_fenced.is_set():
                        stop_reason = "fenced"
                    elif now - hb.last_ok_sent_at >= lease:
                        stop_reason = "self_fenced"
                    if stop_reason in ("fenced", "self_fenced"):
                        _kill_group(proc.pid, signal.SIGKILL)
                        killed = True
                if stop_reason is None:
                    if hb.is_cancel_requested.is_set():
                        stop_reason = "cancel"
                    elif now >= timeout_at:
                        stop_reason = "timeout"
                    elif self._stop_requested.is_set():
                        stop_reason = "shutdown"
                    if stop_reason is not None:
                        log.info("job %d attempt %d: stopping (%s)", claim.job_id,
                                 claim.attempt_no, stop_reason)
                        _kill_group(proc.pid, signal.SIGTERM)
                        term_sent_at = now
                is_kill_due = term_sent_at is not None and (
                    now - term_sent_at >= self.kill_grace_seconds or self._hurry.is_set())
                if is_kill_due and not killed:
                    _kill_group(proc.pid, signal.SIGKILL)
                    killed = True

                deadlines = [hb.last_ok_sent_at + lease, timeout_at]
                if term_sent_at is not None and not killed:
                    deadlines.append(term_sent_at + self.kill_grace_seconds)
                # Sleep to the next deadline: every other event wakes the loop (output, the
                # command's exit through its pidfd, the heartbeat's fence and cancel flags and
                # a stop request through the wake-up pipe), and a beat that moves the fence
                # deadline later only makes this wake early. (A cap of 1 s here woke each
                # running job every second: 1.2 % of a core for 100 of them, bench/e2e.py.)
                wait = min(deadlines) - time.monotonic()
                if pidfd is None:
                    wait = min(wait, 0.05)
                for key, _ in sel.select(timeout=max(0.0, wait)):
                    if key.data == "out":
                        self._read(out_fd, tail, sel)
                    elif key.data == "wake":
                        self._waker.drain()
            # The leader exited; read what is left once the rest of the group is gone too.
            _kill_group(proc.pid, signal.SIGKILL)
            if after_exit is not None:
                after_exit()
            self._read_rest(out_fd, tail, sel)
            return stop_reason
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)

    @staticmethod
    def _read(fd: int, tail: OutputTail, sel: selectors.BaseSelector) -> bool:
        """Read what is available; at end of file unregister ``fd``. True at end of file."""
        if not tail.read_from(fd):
            return False
        try:
            sel.unregister(fd)
        except KeyError:
            pass
        return True

    def _read_rest(self, fd: int, tail: OutputTail, sel: selectors.BaseSelector) -> None:
        deadline = time.monotonic() + _READ_REST_SECONDS
        if fd not in sel.get_map():
            return
        while time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                if key.data == "out" and self._read(fd, tail, sel):
                    return
                if key.data == "wake":
                    self._waker.drain()
        log.warning("job %d attempt %d: output pipe still open after the process group ended",
                    self.claim.job_id, self.claim.attempt_no)
