"""Runner hosts as real `pgdispatch scheduler` processes, each logged in as its own database
login: the server, not --pool, decides what each may take (sql/functions/claim.sql,
"Runner grants"). The same rules against the functions directly, with their over-privileged
variants: tests/sql/test_runner_grants.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..concurrency import processes
from ..factories import World
from ..logins import Logins
from .conftest import wait_until

GROUP = "pgdispatch_scheduler"


@pytest.fixture
def logins(db_url):
    made = Logins(db_url)  # in the group roles db upgrade made (sql/roles.sql)
    yield made
    made.drop()


def host_env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=url, PGDISPATCH_LEASE_SECONDS="3", PGDISPATCH_HEARTBEAT_SECONDS="0.5",
               PGDISPATCH_CLAIM_INTERVAL_SECONDS="0.2", PGDISPATCH_CLAIM_IDLE_CAP_SECONDS="1", PGDISPATCH_EXPIRE_INTERVAL_SECONDS="0.3",
               PGDISPATCH_RUNNER_BEAT_SECONDS="1", PGDISPATCH_DUTY_LEASE_SECONDS="3")
    return env


def setup(conn, grants: list[dict]) -> World:
    w = World(conn)
    w.apply({"organizations": [{"name": "acme", "max_running": 10}],
             "pools": [{"name": "linux", "slots": 10}, {"name": "macos", "slots": 10}],
             "projects": [{"name": "web", "organization": "acme", "pools": ["linux", "macos"]}],
             "runners": grants})
    return w


def test_a_host_granted_linux_cannot_start_for_macos(conn, logins):
    login, url = logins.make("runner_linux", groups=(GROUP,))
    setup(conn, [{"login": login, "pools": ["linux"]}])
    done = subprocess.run([sys.executable, "-m", "pgdispatch", "scheduler", "--pool", "macos", "--slots", "1"],
                          env=host_env(url), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: login {login} is not granted pool macos (granted: linux); an apply file's "
        f"[[runners]] grants it")
    assert "Traceback" not in done.stderr
    assert conn.execute("SELECT count(*) AS n FROM runners").fetchone()["n"] == 0


def test_revoking_a_hosts_grant_stops_its_claims_and_its_running_job(conn, logins, tmp_path):
    login, url = logins.make("runner_a", groups=(GROUP,))
    w = setup(conn, [{"login": login, "pools": ["linux"]}])
    running = w.job(command=["sleep", "60"], max_attempts=2)
    procs = processes.start_schedulers(host_env(url), tmp_path, 1,
                                       lambda i: ["--pool", "linux", "--slots", "2", "--name", "a"])
    try:
        wait_until(lambda: w.row("jobs", running["id"])["state"] == "running", timeout=30,
                   what=f"the host to claim the job\n{processes.logs(procs)}")
        [runner] = conn.execute("SELECT * FROM runners").fetchall()
        assert runner["login"] == login
        # the grant goes, the host keeps running
        w.apply({"runners": [{"login": "some_other_host", "pools": ["macos"]}]})
        later = w.job(command=["true"])
        # its heartbeat is fenced: the command is stopped; the expiry pass re-queues the build
        wait_until(lambda: conn.execute(
            "SELECT state FROM attempts WHERE job_id = %s", (running["id"],)).fetchone()["state"] == "expired",
            timeout=30, what=f"the attempt to expire\n{processes.logs(procs)}")
        assert w.row("jobs", running["id"])["state"] == "queued"
        log = wait_until(lambda: "is not granted pool linux" in processes.logs(procs) and processes.logs(procs),
                         timeout=15, what="the refusal in the host's log")
        assert f"login {login} of runner {runner['id']} is not granted pool linux" in log
        assert "heartbeat fenced out" in log
        # and nothing more is claimed: both jobs wait, the re-queued one included
        assert conn.execute("SELECT count(*) AS n FROM attempts").fetchone()["n"] == 1
        assert w.row("jobs", later["id"])["state"] == "queued"
        assert procs[0][0].poll() is None
    finally:
        codes = processes.stop(procs)
    assert codes == [0], processes.logs(procs)
    assert w.row("jobs", later["id"])["state"] == "queued"
