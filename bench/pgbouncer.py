"""A real PgBouncer for the fleet benchmark (bench/fleet.py): started from a config written
to a temporary folder, listening on a loopback port, every database name (``*``) routed to
one server in transaction pooling, its admin console open to the server's user.

The benchmark keeps its own launcher rather than importing tests/ (the tests stand on their
own, and bench must not depend on test support that may change under them); it follows the
same recipe as tests/pooling/pgbouncer.py, with what a fleet needs on top: room for
thousands of client connections, ``SHOW`` answers as rows, and the process id for its CPU.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg.conninfo

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _passfile_password(passfile: str | None) -> str | None:
    """The password of a libpq passfile's first entry: PgBouncer reads no passfile."""
    if not passfile or not os.path.exists(passfile):
        return None
    for line in Path(passfile).read_text().splitlines():
        fields = line.split(":")
        if len(fields) == 5:
            return fields[4]
    return None


def version() -> str | None:
    """``pgbouncer --version``'s first line; None when it is not installed."""
    if not os.path.exists(PGBOUNCER):
        return None
    out = subprocess.run([PGBOUNCER, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else None


class Bouncer:
    """One PgBouncer process in front of ``server_url``'s server.

    Args:
        server_url: the server to route to (host or socket folder, port, user, password or
            passfile).
        pool_size: ``default_pool_size``, server connections per database and user.
        max_client_conn: client connections it accepts in all.
        settings: more or other ``[pgbouncer]`` lines.
    Raises:
        RuntimeError: pgbouncer is not installed, exits, or does not listen within 10 s.
    """

    def __init__(self, server_url: str, *, pool_size: int, max_client_conn: int,
                 **settings: object):
        if not os.path.exists(PGBOUNCER):
            raise RuntimeError("pgbouncer is needed (apt-get install pgbouncer)")
        server = psycopg.conninfo.conninfo_to_dict(server_url)
        host = server.get("host") or "127.0.0.1"
        self.user = server.get("user") or "postgres"
        route = f"host={host} port={server.get('port') or 5432} user={self.user}"
        password = server.get("password") or _passfile_password(server.get("passfile"))
        if password:
            route += f" password={password}"
        # not under a root-only temporary folder: PgBouncer refuses to run as root and runs
        # as the server's user, which must read this folder
        self.folder = Path(tempfile.mkdtemp(prefix="pgd-bench-pgbouncer-"))
        self.port = _free_port()
        values = {
            "listen_addr": "127.0.0.1", "listen_port": self.port, "unix_socket_dir": "",
            "auth_type": "trust", "auth_file": self.folder / "users.txt",
            "admin_users": self.user, "stats_users": self.user,
            "pool_mode": "transaction", "default_pool_size": pool_size,
            "max_client_conn": max_client_conn,
            "logfile": self.folder / "pgbouncer.log", "pidfile": self.folder / "pgbouncer.pid",
            **settings}
        (self.folder / "pgbouncer.ini").write_text(
            f"[databases]\n* = {route}\n\n[pgbouncer]\n"
            + "".join(f"{k} = {v}\n" for k, v in values.items()))
        (self.folder / "users.txt").write_text(f'"{self.user}" ""\n')
        argv = [PGBOUNCER, str(self.folder / "pgbouncer.ini")]
        if os.geteuid() == 0:
            run_as = (pwd.getpwuid(Path(host).stat().st_uid).pw_name if host.startswith("/")
                      else "nobody")
            shutil.chown(self.folder, run_as)
            for f in self.folder.iterdir():
                shutil.chown(f, run_as)
            argv[1:1] = ["-u", run_as]
        with open(self.folder / "stderr.log", "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not start: {self.log()}") from None
                time.sleep(0.05)

    def url(self, db_url: str) -> str:
        """``db_url``'s database through this PgBouncer (transaction pooling)."""
        name = urlsplit(db_url).path.lstrip("/")
        return urlunsplit(("postgresql", f"{self.user}@127.0.0.1:{self.port}", "/" + name, "", ""))

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW <what>`` on the admin console (simple query protocol) as a list of rows."""
        admin = urlunsplit(("postgresql", f"{self.user}@127.0.0.1:{self.port}", "/pgbouncer", "", ""))
        with psycopg.connect(admin, autocommit=True) as conn:
            result = conn.pgconn.exec_(f"SHOW {what}".encode())
            if result.status != psycopg.pq.ExecStatus.TUPLES_OK:
                raise RuntimeError(f"SHOW {what}: {result.error_message.decode(errors='replace')}")
            names = [result.fname(i).decode() for i in range(result.nfields)]
            return [{n: (None if (v := result.get_value(r, i)) is None else v.decode())
                     for i, n in enumerate(names)} for r in range(result.ntuples)]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self, chars: int = 3000) -> str:
        """The tail of PgBouncer's stderr and log."""
        return "\n".join(p.read_text(errors="replace")[-chars:]
                         for p in (self.folder / "stderr.log", self.folder / "pgbouncer.log")
                         if p.exists())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)
