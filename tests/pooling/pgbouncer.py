"""A real PgBouncer started from a config in a temporary folder: what the pooling tests
(tests/pooling/conftest.py) and the pooled-latency benchmark (bench/pooled.py) share.

``PgBouncer(server_url, pool_size=N)`` routes every database name (``*``) to the server in
transaction pooling with N server connections per database and user; ``session_alias``
adds a database entry of the same database in session pooling.
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


class PgBouncer:
    """One PgBouncer process routing every database name (``*``) to the test server.

    Args:
        server_url: the test server's maintenance URL.
        pool_size: ``default_pool_size``, server connections per database and user.
    """

    def __init__(self, server_url: str, *, pool_size: int):
        assert os.path.exists(PGBOUNCER), \
            "pgbouncer is needed: apt-get install pgbouncer (.ci/run does)"
        server = psycopg.conninfo.conninfo_to_dict(server_url)
        host = server.get("host") or "127.0.0.1"
        self.user = server.get("user") or "postgres"
        self.route = f"host={host} port={server.get('port') or 5432} user={self.user}"
        if server.get("password"):
            self.route += f" password={server['password']}"
        self.pool_size = pool_size
        self.aliases: dict[str, str] = {}
        # not under pytest's tmp_path: its parent is root's alone, and PgBouncer runs as another user
        self.folder = Path(tempfile.mkdtemp(prefix="pgd-test-pgbouncer-"))
        self.port = _free_port()
        self.ini = self.folder / "pgbouncer.ini"
        self._write_config()
        (self.folder / "users.txt").write_text(f'"{self.user}" ""\n')
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
        # max_client_conn: four schedulers' pools (slots + 4 each), their listeners, a web
        # app's pool and the test's own connections, with room to spare
        aliases = "".join(f"{alias} = {self.route} dbname={dbname} pool_mode=session\n"
                          for alias, dbname in self.aliases.items())
        self.ini.write_text(f"""[databases]
{aliases}* = {self.route}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.folder / 'users.txt'}
pool_mode = transaction
default_pool_size = {self.pool_size}
max_client_conn = 400
logfile = {self.folder / 'pgbouncer.log'}
pidfile = {self.folder / 'pgbouncer.pid'}
""")

    def url(self, db_url: str) -> str:
        """``db_url``'s database through this PgBouncer, in transaction pooling."""
        return with_database(f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres",
                             psycopg.conninfo.conninfo_to_dict(db_url)["dbname"])

    def session_alias(self, db_url: str) -> str:
        """A URL through this PgBouncer to ``db_url``'s database by a database entry of its
        own with ``pool_mode = session`` (added to the config, which PgBouncer reloads on
        SIGHUP)."""
        dbname = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
        alias = f"{dbname}_session"
        url = with_database(f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres", alias)
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

    def log(self) -> str:
        """The tail of PgBouncer's log and stderr."""
        return "\n".join(p.read_text(errors="replace")[-3000:]
                         for p in (self.folder / "stderr.log", self.folder / "pgbouncer.log")
                         if p.exists())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)
