"""A real PgBouncer started from a config in a temporary folder: what the pooling tests
(tests/pooling/conftest.py) and the pooled-latency benchmark (bench/pooled.py) share.

``PgBouncer(server_url, pool_size=N)`` routes every database name (``*``) to the server in
transaction pooling with N server connections per database and user; ``session_alias``
adds a database entry of the same database in session pooling. tests/outages/conftest.py
makes misbehaving ones (other settings, a route to nowhere, PAUSE, SIGKILL).
"""

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
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg.conninfo


def with_database(url: str, name: str) -> str:
    """The same server URL pointing at database ``name``."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _password_from(passfile: str | None) -> str | None:
    """The password of a libpq password file's first entry (the embedded server's
    ``*:*:*:postgres:password``): PgBouncer reads no passfile of its own."""
    if not passfile:
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


class PgBouncer:
    """One PgBouncer process routing every database name (``*``) to one server, in
    transaction pooling, with its admin console open to the server's user (``admin``).

    Args:
        server_url: the URL of the server to route to (its host, port, user, password).
        pool_size: ``default_pool_size``, server connections per database and user.
        nowhere: route to a loopback port where nothing listens instead (the server's user
            still logs in, and PgBouncer runs as for that server).
        connect_timeout: seconds, added to every URL ``url`` gives, when set.
        logins: {login: password}: route each client as itself (its own server login and
            pool) instead of as the server's user; those logins' passwords.
        settings: more [pgbouncer] lines, or other values for the defaults below (seconds
            for the timeouts), e.g. ``query_wait_timeout=1``, ``max_client_conn=2``.
    """

    def __init__(self, server_url: str, *, pool_size: int, nowhere: bool = False,
                 connect_timeout: float | None = None, logins: dict[str, str] | None = None,
                 **settings: object):
        assert os.path.exists(PGBOUNCER), \
            "pgbouncer is needed: apt-get install pgbouncer (.ci/run does)"
        server = psycopg.conninfo.conninfo_to_dict(server_url)
        host = server.get("host") or "127.0.0.1"
        self.user = server.get("user") or "postgres"
        if nowhere:
            self.route = f"host=127.0.0.1 port={_free_port()} user={self.user}"
        else:
            self.route = f"host={host} port={server.get('port') or 5432} user={self.user}"
            password = server.get("password") or _password_from(server.get("passfile"))
            if password and not logins:
                self.route += f" password={password}"
        if logins:
            # each client logs in to the server as itself (a pool per login, as a deployment
            # with one login per process has): no user in the route, the passwords PgBouncer
            # answers the server's SCRAM challenge with in its auth_file
            self.route = self.route.replace(f" user={self.user}", "")
        self.aliases: dict[str, str] = {}
        # not under pytest's tmp_path: its parent is root's alone, and PgBouncer runs as another user
        self.folder = Path(tempfile.mkdtemp(prefix="pgd-test-pgbouncer-"))
        self.port = _free_port()
        self._base = f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres"
        if connect_timeout is not None:
            self._base += f"?connect_timeout={connect_timeout:g}"
        # max_client_conn: four schedulers' pools (slots + 4 each), their listeners, a web
        # app's pool and the test's own connections, with room to spare
        self.settings = {
            "listen_addr": "127.0.0.1", "listen_port": self.port, "unix_socket_dir": "",
            "auth_type": "trust", "auth_file": self.folder / "users.txt",
            "admin_users": self.user, "pool_mode": "transaction",
            "default_pool_size": pool_size, "max_client_conn": 400,
            "logfile": self.folder / "pgbouncer.log", "pidfile": self.folder / "pgbouncer.pid",
            **settings}
        self.ini = self.folder / "pgbouncer.ini"
        self._write_config()
        (self.folder / "users.txt").write_text(f'"{self.user}" ""\n' + "".join(
            f'"{name}" "{secret}"\n' for name, secret in (logins or {}).items()))
        argv = [PGBOUNCER, str(self.ini)]
        if os.geteuid() == 0:
            # PgBouncer will not run as root; it runs as the owner of the server's socket folder
            # (the embedded server's user), or nobody for a server on TCP
            run_as = (pwd.getpwuid(Path(host).stat().st_uid).pw_name if host.startswith("/")
                      else "nobody")
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
                break
            except OSError:
                assert self.proc.poll() is None, f"pgbouncer exited: {self.log()}"
                assert time.monotonic() < deadline, "pgbouncer did not listen in 10 s"
                time.sleep(0.05)

    def _write_config(self) -> None:
        aliases = "".join(f"{alias} = {self.route} dbname={dbname} pool_mode=session\n"
                          for alias, dbname in self.aliases.items())
        self.ini.write_text(f"[databases]\n{aliases}* = {self.route}\n\n[pgbouncer]\n"
                            + "".join(f"{k} = {v}\n" for k, v in self.settings.items()))

    def database_url(self, database: str) -> str:
        """A URL for the database named ``database`` through this PgBouncer."""
        return with_database(self._base, database)

    def url(self, db_url: str) -> str:
        """``db_url``'s database through this PgBouncer, in transaction pooling."""
        return self.database_url(psycopg.conninfo.conninfo_to_dict(db_url)["dbname"])

    def session_alias(self, db_url: str) -> str:
        """A URL through this PgBouncer to ``db_url``'s database by a database entry of its
        own with ``pool_mode = session`` (added to the config, which PgBouncer reloads on
        SIGHUP)."""
        dbname = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
        alias = f"{dbname}_session"
        url = self.database_url(alias)
        self.aliases[alias] = dbname
        self._write_config()
        self.proc.send_signal(signal.SIGHUP)
        # until reloaded, the alias goes to the wildcard entry: a database of that name,
        # which does not exist
        deadline = time.monotonic() + 10
        while True:
            try:
                with psycopg.connect(url, prepare_threshold=None) as conn:
                    assert conn.execute("SELECT current_database()").fetchone()[0] == dbname
                return url
            except psycopg.OperationalError:
                assert time.monotonic() < deadline, f"pgbouncer did not reload: {self.log()}"
                time.sleep(0.05)

    def admin(self, command: str) -> None:
        """Run ``command`` (PAUSE, RESUME...) on the admin console (simple query protocol)."""
        with psycopg.connect(self.database_url("pgbouncer"), autocommit=True) as conn:
            result = conn.pgconn.exec_(command.encode())
            assert result.status == psycopg.pq.ExecStatus.COMMAND_OK, result.error_message

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW <what>`` (POOLS, SERVERS, CLIENTS...) on the admin console (simple query
        protocol), as a list of rows of text."""
        with psycopg.connect(self.database_url("pgbouncer"), autocommit=True) as conn:
            result = conn.pgconn.exec_(f"SHOW {what}".encode())
            assert result.status == psycopg.pq.ExecStatus.TUPLES_OK, result.error_message
            names = [result.fname(i).decode() for i in range(result.nfields)]
            return [{n: (None if (v := result.get_value(r, i)) is None else v.decode())
                     for i, n in enumerate(names)} for r in range(result.ntuples)]

    @property
    def pid(self) -> int:
        """PgBouncer's process id (its CPU time is in /proc)."""
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: every client connection is reset, and the port stops listening."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def log(self, chars: int = 3000) -> str:
        """The tail of PgBouncer's log and stderr."""
        return "\n".join(p.read_text(errors="replace")[-chars:]
                         for p in (self.folder / "stderr.log", self.folder / "pgbouncer.log")
                         if p.exists())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)
