"""Run the console under gunicorn from Python (``pgdispatch web`` calls ``serve``)."""

from __future__ import annotations

import json
import logging
from typing import Any

from gunicorn.app.base import BaseApplication
from gunicorn.http.errors import LimitRequestHeaders, LimitRequestLine
from gunicorn.workers.gthread import ThreadWorker
from prometheus_client import multiprocess

from pgdispatch import sql
import pgdispatch.sql.embedded
from . import create_app
from .metrics import multiprocess_dir

log = logging.getLogger(__name__)


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


# Request heads gunicorn reads before Flask sees the request (its documented settings; the
# first two are its defaults, the request line is raised to the longest it takes).
LIMIT_REQUEST_LINE = 8190       # bytes: method, URL and version
LIMIT_REQUEST_FIELDS = 100      # header fields
LIMIT_REQUEST_FIELD_SIZE = 8190  # bytes of one header field


class ConsoleWorker(ThreadWorker):
    """gunicorn's threaded worker, except that a request line or headers past the limits
    above are refused with ``{"error": ...}`` JSON, the shape of every API error, instead of
    gunicorn's HTML page. gunicorn refuses them before any application code runs, with no
    path parsed (the request line is what was too long), so the answer is JSON for every
    client, the console's included; a browser never sends such a request to it."""

    def handle_error(self, req, client, addr, exc):
        if isinstance(exc, LimitRequestLine):
            status, reason = 414, "URI Too Long"
            message = f"the request line is longer than {LIMIT_REQUEST_LINE} bytes"
        elif isinstance(exc, LimitRequestHeaders):
            status, reason = 431, "Request Header Fields Too Large"
            message = (f"the request headers are too large (at most {LIMIT_REQUEST_FIELDS} "
                       f"fields of {LIMIT_REQUEST_FIELD_SIZE} bytes)")
        else:
            return super().handle_error(req, client, addr, exc)
        self.log.warning("refused a request from %s: %s (%s)", (addr or ("",))[0], message, exc)
        body = json.dumps({"error": message}).encode()
        head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "X-Content-Type-Options: nosniff\r\nCache-Control: no-store\r\n\r\n")
        try:
            client.sendall(head.encode("ascii") + body)
        except OSError:  # the client is gone: nothing to tell it
            pass
        return None


def child_exit(server, worker) -> None:
    """gunicorn's ``child_exit`` hook (in the arbiter, when a worker has exited): tell
    prometheus_client's multiprocess mode that the worker is gone. Its counters stay in the
    sums (they never go back); only live-gauge files would be removed, and the web has none.
    Nothing without ``PROMETHEUS_MULTIPROC_DIR``. For a gunicorn of your own:
    ``from pgdispatch.webapp.serve import child_exit`` in its config file."""
    path = multiprocess_dir()
    if path is not None:
        multiprocess.mark_process_dead(worker.pid, path)


def gunicorn_options(*, bind: str, workers: int) -> dict[str, Any]:
    """The gunicorn settings the console runs with."""
    return {
        "bind": bind,
        "workers": workers,
        # gthread (ConsoleWorker) with threads: htmx polls every 2 s from every open console, and a slow query must not
        # stall the others
        "worker_class": f"{__name__}.ConsoleWorker",
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
        "limit_request_line": LIMIT_REQUEST_LINE,
        "limit_request_fields": LIMIT_REQUEST_FIELDS,
        "limit_request_field_size": LIMIT_REQUEST_FIELD_SIZE,
        "child_exit": child_exit,
    }


def serve(settings: sql.Settings, *, database_url: str | None, bind: str, workers: int = 2) -> None:
    """Serve the console and API on ``bind`` (HOST:PORT) with ``workers`` processes until
    SIGTERM or SIGINT.

    The database URL (the embedded server's when None) and the session key are resolved
    once here, before the workers fork, so that they all agree. With several workers, the
    web's own counters are summed over them only in prometheus_client's multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR`` set before prometheus_client was imported, to an empty
    directory: ``pgdispatch web`` does it; webapp/metrics.py); without it each scrape shows
    one worker's counters.
    """
    if workers < 1:
        raise sql.InvalidInput(f"workers must be at least 1, got {workers}")
    if not bind or ":" not in bind and not bind.startswith("unix:"):
        raise sql.InvalidInput(f"bind must be HOST:PORT, got {bind!r}")
    if multiprocess_dir() is not None:
        log.info("web: the workers' counters are summed in %s (prometheus_client's "
                 "multiprocess files)", multiprocess_dir())
    elif workers > 1:
        log.warning("web: %d workers without PROMETHEUS_MULTIPROC_DIR: each /metrics scrape "
                    "shows the counters of the one worker that answers it", workers)
    database_url = database_url or sql.embedded.database_url(settings)
    settings = settings.with_overrides(secret_key=settings.resolved_secret_key(),
                                       database_url=database_url)
    ConsoleServer(settings, database_url, gunicorn_options(bind=bind, workers=workers)).run()
