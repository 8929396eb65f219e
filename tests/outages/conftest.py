"""PgBouncers of this test's own, each configured to misbehave, in front of the test server
or of a port where nothing listens; and a PostgreSQL server of the test's own to stop.

The pattern of tests/pooling/conftest.py (Debian's PgBouncer 1.18, transaction pooling,
trust authentication, not run as root), one PgBouncer per call instead of one per session,
with its admin console open to the server's user (PAUSE, RESUME, SHOW)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import psycopg.conninfo
import pytest

from ..conftest import with_database
from ..faults.chaos_server import OwnServer

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bouncer:
    """One PgBouncer process in transaction pooling; ``settings`` are [pgbouncer] lines
    (seconds for the timeouts). ``route`` is the libpq route of its one server, e.g.
    ``host=/tmp/x port=5432 user=postgres``."""

    def __init__(self, route: str, *, user: str, run_as: str | None, **settings: object):
        assert os.path.exists(PGBOUNCER), "pgbouncer is needed: apt-get install pgbouncer (.ci/run does)"
        self.user = user
        # not under pytest's tmp_path: its parent is root's alone, and PgBouncer runs as another user
        self.folder = Path(tempfile.mkdtemp(prefix="pgd-test-outage-"))
        self.port = free_port()
        lines = {"listen_addr": "127.0.0.1", "listen_port": self.port, "unix_socket_dir": "",
                 "auth_type": "trust", "auth_file": self.folder / "users.txt",
                 "admin_users": user, "pool_mode": "transaction", "default_pool_size": 2,
                 "max_client_conn": 50, "logfile": self.folder / "pgbouncer.log",
                 "pidfile": self.folder / "pgbouncer.pid", **settings}
        (self.folder / "pgbouncer.ini").write_text(
            f"[databases]\n* = {route}\n\n[pgbouncer]\n"
            + "".join(f"{k} = {v}\n" for k, v in lines.items()))
        (self.folder / "users.txt").write_text(f'"{user}" ""\n')
        argv = [PGBOUNCER, str(self.folder / "pgbouncer.ini")]
        if run_as:
            shutil.chown(self.folder, run_as)
            for f in self.folder.iterdir():
                shutil.chown(f, run_as)
            argv[1:1] = ["-u", run_as]
        with open(self.folder / "stderr.log", "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                assert self.proc.poll() is None, f"pgbouncer exited: {self.log_tail()}"
                assert time.monotonic() < deadline, "pgbouncer did not listen in 10 s"
                time.sleep(0.05)

    def url(self, database: str) -> str:
        """A URL for ``database`` through this PgBouncer."""
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}?connect_timeout=5"

    def admin(self, command: str) -> None:
        """Run ``command`` (PAUSE, RESUME...) on the admin console (simple query protocol)."""
        with psycopg.connect(self.url("pgbouncer"), autocommit=True) as conn:
            result = conn.pgconn.exec_(command.encode())
            assert result.status == psycopg.pq.ExecStatus.COMMAND_OK, result.error_message

    def kill(self) -> None:
        """SIGKILL: every client connection is reset, and the port stops listening."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def log_tail(self, chars: int = 2000) -> str:
        text = ""
        for name in ("stderr.log", "pgbouncer.log"):
            try:
                text += (self.folder / name).read_text(errors="replace")[-chars:]
            except OSError:
                pass
        return text

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def _route(url: str) -> tuple[str, str, str | None]:
    """(libpq route, user, who PgBouncer runs as) for the server of ``url``."""
    server = psycopg.conninfo.conninfo_to_dict(url)
    host = server.get("host") or "127.0.0.1"
    user = server.get("user") or "postgres"
    route = f"host={host} port={server.get('port') or 5432} user={user}"
    if server.get("password"):
        route += f" password={server['password']}"
    run_as = None
    if os.geteuid() == 0:
        # PgBouncer will not run as root; it runs as the owner of the server's socket folder
        # (the embedded server's user), or nobody for a server on TCP
        run_as = pwd.getpwuid(Path(host).stat().st_uid).pw_name if host.startswith("/") else "nobody"
    return route, user, run_as


@pytest.fixture
def make_bouncer(server_url):
    """``make_bouncer(**settings)``: a PgBouncer in front of the test server;
    ``make_bouncer(upstream_url=url, ...)`` in front of another server;
    ``make_bouncer(nowhere=True, ...)`` in front of a loopback port where nothing listens.
    Every one is stopped at the end of the test."""
    made: list[Bouncer] = []

    def make(*, upstream_url: str | None = None, nowhere: bool = False, **settings) -> Bouncer:
        route, user, run_as = _route(upstream_url or server_url)
        if nowhere:
            route = f"host=127.0.0.1 port={free_port()} user={user}"
        b = Bouncer(route, user=user, run_as=run_as, **settings)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


@pytest.fixture
def own_server():
    """A PostgreSQL server of this test's own, to stop and start (tests/faults/chaos_server.py)."""
    server = OwnServer()
    yield server
    server.close()
