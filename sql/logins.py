"""The embedded server's logins: with DATABASE_URL unset, each component logs in as its
own role (docs/operations.md, "Database roles"), never as the server's superuser.

``./.pgdispatch/logins/`` (0700) holds one password per login, random, in a file only its
OS user may read (0600), and ``pgpass`` in libpq's password-file format; the URLs name
the file (``passfile=``), so that no URL, and no environment that holds one, carries a
password. Logins: ``pgdispatch_migrate`` (migrator: ``db upgrade``, ``apply``),
``pgdispatch_console`` (web), ``pgdispatch_cli`` (admin: every other CLI command; it acts
as itself in the audit log), and one scheduler login per runner name
(``pgdispatch_runner`` for a plain ``pgdispatch scheduler``; ``pgdispatch_runner_<name>``
for the demo's).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from . import roles

MIGRATOR, WEB, CLI, RUNNER = "pgdispatch_migrate", "pgdispatch_console", "pgdispatch_cli", "pgdispatch_runner"
KINDS = {MIGRATOR: "migrator", WEB: "web", CLI: "admin"}


def runner_login(name: str | None = None) -> str:
    """The scheduler login of runner ``name`` (None: the shared one of plain schedulers)."""
    if not name:
        return RUNNER
    return (RUNNER + "_" + re.sub(r"[^a-z0-9_]", "_", name.lower()))[:63]


def _dir(data_dir: Path | str) -> Path:
    path = Path(data_dir).resolve() / "logins"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def ensure_login(superuser_url: str, data_dir: Path | str, name: str, kind: str) -> str:
    """Make login ``name`` (group ``kind``, a key of roles.GROUPS) exist with the password
    kept in ``data_dir/logins/<name>.password`` (made, random, when missing), and return
    its URL: ``superuser_url`` with that user and ``passfile``.

    Raises:
        InvalidInput, Conflict, Forbidden: as roles.set_login.
    """
    folder = _dir(data_dir)
    secret = folder / f"{name}.password"
    is_new = not secret.exists()
    if is_new:
        _write_private(secret, secrets.token_urlsafe(24))
    password = secret.read_text().strip()
    passfile = folder / "pgpass"
    lines = [ln for ln in (passfile.read_text().splitlines() if passfile.exists() else [])
             if ln.split(":")[3:4] != [name]]
    # libpq's format: host:port:database:user:password, ':' and '\\' escaped
    escaped = password.replace("\\", "\\\\").replace(":", "\\:")
    _write_private(passfile, "\n".join([*lines, f"*:*:*:{name}:{escaped}"]) + "\n")
    if is_new or not _exists(superuser_url, name):
        roles.set_login(superuser_url, name=name, kind=kind, password=password)
    return login_url(superuser_url, name, passfile)


def _exists(url: str, name: str) -> bool:
    from .db import connect

    with connect(url, application_name="pgdispatch-logins") as conn:
        return conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s AND rolcanlogin",
                            (name,)).fetchone() is not None


def login_url(url: str, user: str, passfile: Path) -> str:
    """``url`` with ``user`` and no password of its own, reading it from ``passfile``."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    query = [(k, v) for k, v in parse_qsl(parts.query) if k not in ("user", "password", "passfile")]
    query.append(("passfile", str(passfile)))
    return urlunsplit((parts.scheme, f"{quote(user)}@{host}", parts.path, urlencode(query),
                       parts.fragment))


def grant_pools(superuser_url: str, login: str, pools: list[str]) -> list[str]:
    """On the embedded server, grant runner login ``login`` the pools it is started for
    (those that exist), adding to its grants, never removing one; returns the pools newly
    granted, each audited (``grant_runner_pools`` by the server's superuser).

    The embedded server is the local operator's own: whoever may start its scheduler may
    also apply a ``[[runners]]`` grant, so a plain ``pgdispatch scheduler --pool linux``
    there works without one. With DATABASE_URL set nothing grants itself: the apply file's
    ``[[runners]]`` does (docs/operations.md, "Runner hosts and protected targets").
    """
    import json

    from .db import connect
    from .queries import Q

    with connect(superuser_url, application_name="pgdispatch-logins") as conn, conn.transaction():
        before = set(Q.list_runner_login_pools(conn, login=login) or [])
        Q.grant_runner_pools(conn, login=login, pools=pools)
        added = sorted(set(Q.list_runner_login_pools(conn, login=login) or []) - before)
        if added:
            actor = conn.execute("SELECT session_user AS u").fetchone()["u"]
            Q.record_event(conn, actor=actor, action="grant_runner_pools", subject=f"login:{login}",
                           reason="embedded server: the scheduler's own pools",
                           details=json.dumps({"pools": added}))
    return added
