"""End to end, as an operator lives it: a deployment's scheduler is SIGKILLed, the target
becomes uncertain, an operator resolves it through the console's HTTP endpoint (a real
`pgdispatch web` under gunicorn), and the next deployment to that target runs."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import requests

from pgdispatch.sql import accounts
from pgdispatch.sql.explain import explain_job

from .test_scheduler_e2e import (ROOT, attempts, is_running, job_row, schedulers, sleeper,  # noqa: F401
                                 wait_until)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def console(db_url, tmp_path):
    """``pgdispatch web`` on a free port; yields its base URL."""
    port = free_port()
    env = {**os.environ, "DATABASE_URL": db_url, "PGDISPATCH_SECRET_KEY": "e2e-secret-key-0123456789",
           "PGDISPATCH_DATA_DIR": str(tmp_path / "web")}
    log = open(tmp_path / "web.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pgdispatch", "web", "--bind", f"127.0.0.1:{port}",
                             "--workers", "1"], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return requests.get(base + "/healthz", timeout=1).status_code == 200
        except requests.RequestException:
            return False
    try:
        wait_until(healthy, what="the console to answer")
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def csrf(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)


def test_lost_deployment_resolved_in_the_console_then_next_deployment_runs(world, schedulers, console):
    world.setup(pools=("deploy",), targets=("staging",))
    accounts.upsert_user(world.conn, username="alice", password="alice-password", role="operator")
    first = world.job(pool="deploy", target="staging", command=sleeper(schedulers))
    second = world.job(pool="deploy", target="staging", command=["sh", "-c", "echo second deploy"])

    a = schedulers.start("a", pools=("deploy",), via_cli=True)
    wait_until(lambda: is_running(world.conn, first["id"]), what="the first deployment", procs=schedulers)
    schedulers.job_pid(first["id"])
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=10)
    schedulers.start("b", pools=("deploy",), via_cli=True)
    wait_until(lambda: job_row(world.conn, first["id"])["state"] == "uncertain",
               what="the first deployment to become uncertain", procs=schedulers)
    assert explain_job(world.conn, job_id=second["id"])["reason"] == "target_uncertain"
    assert job_row(world.conn, second["id"])["state"] == "queued"

    s = requests.Session()
    r = s.post(f"{console}/login", data={"username": "alice", "password": "alice-password",
                                         "csrf_token": csrf(s.get(f"{console}/login").text)})
    assert r.status_code == 200 and r.url.rstrip("/") == console, r.url
    page = s.get(f"{console}/targets/")
    assert "uncertain" in page.text
    r = s.post(f"{console}/targets/staging/resolve",
               data={"outcome": "failed", "note": "still on the old version",
                     "csrf_token": csrf(page.text)}, allow_redirects=False)
    assert r.status_code == 303, r.text

    wait_until(lambda: job_row(world.conn, second["id"])["state"] == "succeeded",
               what="the next deployment to run", procs=schedulers)
    assert job_row(world.conn, first["id"])["state"] == "failed"
    [attempt] = attempts(world.conn, second["id"])
    assert attempt["runner_name"] == "b" and "second deploy" in attempt["output_tail"]
    target = world.conn.execute("SELECT * FROM targets WHERE name = 'staging'").fetchone()
    assert target["state"] == "free" and target["holder_job_id"] is None
    audit = world.conn.execute("SELECT actor, action, reason FROM audit_events "
                               "WHERE subject = 'target:staging'").fetchall()
    assert [(e["actor"], e["action"], e["reason"]) for e in audit] == [
        ("alice", "resolve_target", "still on the old version")]
