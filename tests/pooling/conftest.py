"""A real PgBouncer (Debian's package, 1.18) in transaction pooling in front of the test
server, started once per session on a loopback port from a config in a temporary folder."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg.conninfo
import pytest

from ..conftest import with_database

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def pgbouncer_url(server_url):
    """The server's URL through PgBouncer (pool_mode transaction, one server connection per
    database and user, so that every client's transactions share it); any database name."""
    assert os.path.exists(PGBOUNCER), "pgbouncer is needed: apt-get install pgbouncer (.ci/run does)"
    server = psycopg.conninfo.conninfo_to_dict(server_url)
    host = server.get("host") or "127.0.0.1"
    route = f"host={host} port={server.get('port') or 5432} user={server.get('user') or 'postgres'}"
    if server.get("password"):
        route += f" password={server['password']}"
    # not under pytest's tmp_path: its parent is root's alone, and PgBouncer runs as another user
    folder = Path(tempfile.mkdtemp(prefix="pgd-test-pgbouncer-"))
    port = _free_port()
    ini = folder / "pgbouncer.ini"
    ini.write_text(f"""[databases]
* = {route}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / 'users.txt'}
pool_mode = transaction
default_pool_size = 1
max_client_conn = 200
logfile = {folder / 'pgbouncer.log'}
pidfile = {folder / 'pgbouncer.pid'}
""")
    (folder / "users.txt").write_text(f'"{server.get("user") or "postgres"}" ""\n')
    argv = [PGBOUNCER, str(ini)]
    if os.geteuid() == 0:
        # PgBouncer will not run as root; it runs as the owner of the server's socket folder
        # (the embedded server's user), or nobody for a server on TCP
        user = (pwd.getpwuid(Path(host).stat().st_uid).pw_name if host.startswith("/")
                else "nobody")
        shutil.chown(folder, user)
        for f in folder.iterdir():
            shutil.chown(f, user)
        argv[1:1] = ["-u", user]
    with open(folder / "stderr.log", "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert proc.poll() is None, \
                f"pgbouncer exited: {(folder / 'stderr.log').read_text()[-500:]}"
            assert time.monotonic() < deadline, "pgbouncer did not listen in 10 s"
            time.sleep(0.05)
    user = server.get("user") or "postgres"
    yield lambda url: with_database(f"postgresql://{user}@127.0.0.1:{port}/postgres",
                                    psycopg.conninfo.conninfo_to_dict(url)["dbname"])
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(folder, ignore_errors=True)
