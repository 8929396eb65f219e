"""The output tail: the last bytes a job's command wrote, kept in memory, bounded.

The command's stdout and stderr share one pipe. The supervision loop (supervision.py) reads
it into an ``OutputTail`` as the command writes, a heartbeat sends a snapshot of it when it
has grown (heartbeats.py), and the completion reports the whole tail (reporting.py). Nothing
of the output is written to disk: the database keeps the tail with the attempt.
"""

from __future__ import annotations

import os
import threading

OUTPUT_TAIL_BYTES = 64 * 1024
_READ_BYTES = 64 * 1024  # one read of the pipe; a pipe holds 64 KiB by default on Linux


class OutputTail:
    """A ring buffer that keeps the last ``limit`` bytes written to it (OUTPUT_TAIL_BYTES).

    ``total_bytes`` counts every byte written, kept or dropped.
    """

    def __init__(self, limit: int = OUTPUT_TAIL_BYTES):
        self.limit = limit
        self._buf = bytearray()
        self._lock = threading.Lock()  # written by the execution, read by the heartbeat
        self.total_bytes = 0

    def write(self, chunk: bytes) -> None:
        """Append ``chunk``, dropping the oldest bytes beyond the limit."""
        with self._lock:
            self.total_bytes += len(chunk)
            self._buf += chunk
            if len(self._buf) > self.limit:
                del self._buf[:len(self._buf) - self.limit]

    def read_from(self, fd: int) -> bool:
        """Append what the non-blocking descriptor ``fd`` has ready; True at end of file."""
        try:
            chunk = os.read(fd, _READ_BYTES)
        except BlockingIOError:
            return False
        if not chunk:
            return True
        self.write(chunk)
        return False

    def text(self) -> str:
        """The kept bytes as UTF-8 text (undecodable bytes replaced)."""
        with self._lock:
            return self._buf.decode("utf-8", errors="replace")

    def snapshot(self, limit_bytes: int) -> tuple[int, str]:
        """(bytes written so far, the last ``limit_bytes`` of them as UTF-8 text)."""
        with self._lock:
            return self.total_bytes, self._buf[-limit_bytes:].decode("utf-8", errors="replace")
