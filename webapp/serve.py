"""Run the console under gunicorn from Python (``pgdispatch web`` calls ``serve``)."""

from __future__ import annotations

from typing import Any

from gunicorn.app.base import BaseApplication

from pgdispatch import sql
import pgdispatch.sql.embedded
from . import create_app


class ConsoleServer(BaseApplication):
    """A gunicorn application whose workers each build the Flask app (and their own pool)."""

    def __init__(self, settings: sql.Settings, database_url: str, options: dict[str, Any]):
        self.settings = settings
        self.database_url = database_url
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            if key in self.cfg.settings and value is not None:
                self.cfg.set(key, value)

    def load(self):
        return create_app(self.settings, database_url=self.database_url)


def gunicorn_options(*, bind: str, workers: int) -> dict[str, Any]:
    """The gunicorn settings the console runs with."""
    return {
        "bind": bind,
        "workers": workers,
        # threads: htmx polls every 2 s from every open console, and a slow query must not
        # stall the others
        "worker_class": "gthread",
        "threads": 4,
        "timeout": 30,
        "graceful_timeout": 10,
        "keepalive": 5,
        "accesslog": "-",
        "errorlog": "-",
        "preload_app": False,
        "proc_name": "pgdispatch-web",
        # no control socket: its default path is shared by every console of the user (every
        # checkout and test run), and one stopping removed another's
        "control_socket_disable": True,
        # headers from a proxy are trusted only from loopback
        "forwarded_allow_ips": "127.0.0.1,::1",
    }


def serve(settings: sql.Settings, *, database_url: str | None, bind: str, workers: int = 2) -> None:
    """Serve the console and API on ``bind`` (HOST:PORT) with ``workers`` processes until
    SIGTERM or SIGINT.

    The database URL (the embedded server's when None) and the session key are resolved
    once here, before the workers fork, so that they all agree.
    """
    if workers < 1:
        raise sql.InvalidInput(f"workers must be at least 1, got {workers}")
    if not bind or ":" not in bind and not bind.startswith("unix:"):
        raise sql.InvalidInput(f"bind must be HOST:PORT, got {bind!r}")
    database_url = database_url or sql.embedded.database_url(settings)
    settings = settings.with_overrides(secret_key=settings.resolved_secret_key(),
                                       database_url=database_url)
    ConsoleServer(settings, database_url, gunicorn_options(bind=bind, workers=workers)).run()
