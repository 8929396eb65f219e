"""The console under gunicorn (``pgdispatch.webapp.serve.serve``) and the ``pgdispatch.webapp.wsgi`` entry point."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(extra)
    return env


def test_serve_runs_gunicorn_workers_and_stops_on_sigterm(db_url, tmp_path):
    port = _free_port()
    code = ("import sys; from pgdispatch.sql import Settings; from pgdispatch.webapp.serve import serve; "
            f"serve(Settings(data_dir=__import__('pathlib').Path({str(tmp_path)!r})), "
            f"database_url=sys.argv[1], bind='127.0.0.1:{port}', workers=2)")
    proc = subprocess.Popen([sys.executable, "-c", code, db_url], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    assert json.load(r) == {"status": "ok"}
                    break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "gunicorn did not answer in 30 s"
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/login", timeout=5) as r:
            assert b"Sign in" in r.read()
            assert r.headers["X-Frame-Options"] == "DENY"
        # the demo's session key was generated once, before the workers forked
        assert (tmp_path / "secret_key").stat().st_mode & 0o777 == 0o600
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, output
    assert "Booting worker" in output


def test_wsgi_module_builds_the_app_from_the_environment(db_url):
    code = "import pgdispatch.webapp.wsgi as w; print(sorted(w.app.blueprints))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True,
                         text=True, timeout=60,
                         env=_env(DATABASE_URL=db_url, PGDISPATCH_SECRET_KEY="wsgi-test-key-0123456789"))
    assert "'api'" in out.stdout and "'queue'" in out.stdout
