"""Jobs cannot reach the control plane (issue 17, item 3): a real ``pgdispatch scheduler
--run-as USER`` runs a hostile job (hostile_job.py) that tries every way to its scheduler's
credentials, and gets nothing; the same job under a scheduler without ``--run-as`` gets them
(the variant that shows the check can fail).

The scheduler is set up as a runner host would be: DATABASE_URL with the password and
PGPASSWORD and the session key in its environment (a systemd EnvironmentFile), the embedded
server's data directory (its password file) beside it. These tests need root, as CI runs
them: they create the job's user and run the scheduler as root, and fail when they cannot.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from pgdispatch.sql import db, embedded, migrate, reads

from ..cli.support import CONFIG, run_pgdispatch

JOB_USER = "pgdispatch-test-job"
HOSTILE = (Path(__file__).parent / "hostile_job.py").read_text()
ROOT = Path(__file__).resolve().parents[2]


def job_user() -> pwd.struct_passwd:
    """The job's user, created with useradd when missing."""
    assert os.geteuid() == 0, ("the job sandbox tests run as root (they create a user and run a "
                               "scheduler that switches to it); run them as root, as CI does")
    try:
        return pwd.getpwnam(JOB_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                        "--shell", "/usr/sbin/nologin", JOB_USER], check=True,
                       capture_output=True, timeout=30)
        return pwd.getpwnam(JOB_USER)


@pytest.fixture(scope="module")
def runner_host():
    """A runner host's folder (0755, root's) with the embedded server's data directory in it,
    migrated and configured; yields (folder, url with the password, password)."""
    job_user()
    folder = Path(tempfile.mkdtemp(prefix="pgd-test-runner-host-"))
    os.chmod(folder, 0o755)
    data_dir = folder / ".pgdispatch"
    server, url = embedded.start_server(data_dir, cleanup_mode=None)
    try:
        migrate.upgrade(url)
        proc = run_pgdispatch(url, folder, "apply", _config(folder))
        assert proc.returncode == 0, proc.stderr
        password = embedded.passfile(data_dir).read_text().strip().rsplit(":", 1)[1]
        info = server.get_postmaster_info()
        # as an operator writes it into an EnvironmentFile: the password in the URL itself
        secret_url = (f"postgresql://postgres:{password}@/postgres?host={info.socket_dir}"
                      f"&port={info.port}")
        yield folder, secret_url, password
    finally:
        embedded.stop_embedded(data_dir)
        shutil.rmtree(folder, ignore_errors=True)


def _config(folder: Path) -> str:
    path = folder / "config.toml"
    path.write_text(CONFIG)
    return str(path)


SECRET_KEY = "session-key-" + "k" * 20


def run_hostile_job(folder: Path, url: str, *scheduler_args: str) -> tuple[dict, str]:
    """Start ``pgdispatch scheduler`` in ``folder`` with the credentials in its environment,
    run hostile_job.py through it, stop it; returns (the job's report, its output tail)."""
    data_dir = folder / ".pgdispatch"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "DATABASE_URL": url, "PGPASSWORD": url.split(":")[2].split("@")[0],
           "PGDISPATCH_SECRET_KEY": SECRET_KEY, "PGDISPATCH_CLAIM_INTERVAL_SECONDS": "0.2",
           "PYTHONPATH": str(ROOT)}
    log = open(folder / "scheduler.log", "wb")
    scheduler = subprocess.Popen([sys.executable, "-m", "pgdispatch", "scheduler", "--pool", "linux",
                                  "--slots", "1", "--grace-seconds", "5", *scheduler_args],
                                 env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
    log.close()
    try:
        with db.connect(url) as conn:
            socket_path = conn.execute("SELECT current_setting('unix_socket_directories') AS d"
                                       ).fetchone()["d"]
            port = conn.execute("SELECT current_setting('port') AS p").fetchone()["p"]
        submitted = run_pgdispatch(url, folder, "submit", "--project", "web", "--pool", "linux",
                                   "--timeout", "60", "--", "python3", "-c", HOSTILE,
                                   str(data_dir), str(folder),
                                   f"{socket_path}/.s.PGSQL.{port}", port)
        assert submitted.returncode == 0, submitted.stderr
        job_id = json.loads(submitted.stdout)["id"]
        deadline = time.monotonic() + 60
        with db.connect(url) as conn:
            while True:
                job = reads.show_job(conn, job_id=job_id)
                if job["state"] in ("succeeded", "failed"):
                    break
                assert scheduler.poll() is None, (folder / "scheduler.log").read_text()
                assert time.monotonic() < deadline, f"the job did not end: {job['state']}"
                time.sleep(0.2)
        tail = job["attempts"][-1]["output_tail"]
        lines = [line for line in tail.splitlines() if line.startswith("REPORT ")]
        assert job["state"] == "succeeded" and lines, tail
        return json.loads(lines[-1][len("REPORT "):]), tail
    finally:
        scheduler.terminate()
        scheduler.wait(30)
        for leftover in (folder / "written-by-a-job", folder / ".pgdispatch" / "written-by-a-job"):
            leftover.unlink(missing_ok=True)


def what_leaked(report: dict, tail: str, password: str) -> list[str]:
    """Every credential or reach the job got, in words; [] when it got nothing."""
    leaks = []
    if report["scheduler_environ"] is not None:
        leaks.append("read /proc/<scheduler>/environ")
    if report["other_environs"]:
        leaks.append(f"read other users' environ: {sorted(report['other_environs'])[:5]}")
    if report["scheduler_cwd"] is not None:
        leaks.append("resolved /proc/<scheduler>/cwd")
    if report["data_dir_listing"] is not None:
        leaks.append("listed the data directory")
    if report["data_dir_files"]:
        leaks.append(f"read data directory files: {sorted(report['data_dir_files'])[:5]}")
    if report["credential_env"]:
        leaks.append(f"inherited {sorted(report['credential_env'])}")
    if report["inherited_fds"]:
        leaks.append(f"inherited descriptors {report['inherited_fds']}")
    for where, answer in report["connections"].items():
        if "without a password" in answer:
            leaks.append(f"connected to {where} without a password")
    if report["written"]:
        leaks.append(f"wrote {report['written']}")
    for name, secret in (("the database password", password), ("the session key", SECRET_KEY)):
        if secret in tail:
            leaks.append(f"its output holds {name}")
    return leaks


def test_a_job_run_as_another_user_reaches_no_credential(runner_host):
    folder, url, password = runner_host
    user = job_user()
    report, tail = run_hostile_job(folder, url, "--run-as", JOB_USER)
    assert (report["uid"], report["gid"]) == (user.pw_uid, user.pw_gid)
    assert report["groups"] in ([], [user.pw_gid])
    assert report["home"] == report["cwd"] and report["cwd"].startswith(tempfile.gettempdir())
    assert not Path(report["cwd"]).exists(), "the job's directory outlived it"
    assert what_leaked(report, tail, password) == []
    # the scheduler's command line is readable by all: it holds no password, nor does the job's
    assert "pgdispatch scheduler" in report["scheduler_cmdline"]
    assert set(report["env_names"]) <= {"PATH", "LANG", "HOME", "USER", "LOGNAME", "PWD",
                                        "SHLVL", "_", "LC_CTYPE", "PGDISPATCH_JOB_ID",
                                        "PGDISPATCH_ATTEMPT", "PGDISPATCH_ATTEMPT_ID",
                                        "PGDISPATCH_GENERATION"}, report["env_names"]
    # it did try the database: the server's socket is out of its reach
    assert report["connections"], report
    log = (folder / "scheduler.log").read_text()
    assert f"jobs run as {JOB_USER} (uid {user.pw_uid}" in log and "AS ROOT" not in log


def test_the_same_job_under_a_scheduler_without_run_as_gets_the_credentials(runner_host):
    """The variant: the check above is one that fails when jobs run as the scheduler's user."""
    folder, url, password = runner_host
    report, tail = run_hostile_job(folder, url)
    leaks = what_leaked(report, tail, password)
    assert "read /proc/<scheduler>/environ" in leaks
    assert any(leak.startswith("read data directory files") for leak in leaks), leaks
    assert "its output holds the database password" in leaks
    assert report["uid"] == 0
    assert "RUNNING JOBS AS ROOT" in (folder / "scheduler.log").read_text()


def test_run_as_refuses_a_missing_user_and_a_scheduler_that_cannot_switch(tmp_path):
    job_user()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL="postgresql://nobody@127.0.0.1:1/never-contacted")
    base = [sys.executable, "-m", "pgdispatch", "scheduler", "--pool", "linux", "--slots", "1"]
    missing = subprocess.run([*base, "--run-as", "no-such-user-pgd"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == "error: --run-as: no such user 'no-such-user-pgd'"
    root = subprocess.run([*base, "--run-as", "root"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert root.returncode == 2 and "unprivileged" in root.stderr.strip().splitlines()[-1]
    # root without the capabilities to switch users (a container's root): refused at start
    capless = subprocess.run(["setpriv", "--bounding-set=-setuid,-setgid",
                              "--inh-caps=-setuid,-setgid", *base, "--run-as", JOB_USER],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert capless.returncode == 2, capless.stderr
    assert capless.stderr.strip().splitlines()[-1] == (
        f"error: --run-as {JOB_USER}: cannot start a process as that user: "
        f"Operation not permitted")


def test_a_password_on_the_command_line_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL="postgresql://nobody@127.0.0.1:1/never-contacted")
    proc = subprocess.run([sys.executable, "-m", "pgdispatch", "scheduler", "--pool", "linux",
                           "--slots", "1", "--listen-url", "postgresql://u:hunter2@127.0.0.1/x"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "PGDISPATCH_LISTEN_URL" in proc.stderr.strip().splitlines()[-1]


def test_the_embedded_server_refuses_a_connection_without_password(server_url, tmp_path):
    """scram-sha-256 for the socket and loopback (sql/embedded.py): the superuser's name is
    not enough, wherever the socket's folder can be reached from."""
    if os.environ.get("DATABASE_URL"):
        pytest.fail("this test checks the embedded server: run it without DATABASE_URL")
    params = psycopg.conninfo.conninfo_to_dict(server_url)
    assert "password" not in params and params.get("passfile")
    with db.connect(server_url) as conn:  # the passfile authenticates
        hba = conn.execute("SELECT array_agg(DISTINCT auth_method) AS m FROM pg_hba_file_rules"
                           ).fetchone()["m"]
    assert hba == ["scram-sha-256"]
    bare = {k: v for k, v in params.items() if k != "passfile"}
    env_without = {k: v for k, v in os.environ.items() if k not in ("PGPASSFILE", "PGPASSWORD")}
    code = ("import sys, psycopg\n"
            "try:\n    psycopg.connect(**dict(a.split('=', 1) for a in sys.argv[1:])).close()\n"
            "except psycopg.OperationalError as e:\n    print(e)\n    sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code, *(f"{k}={v}" for k, v in bare.items())],
                          env={**env_without, "HOME": str(tmp_path)}, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 3 and "no password supplied" in proc.stdout, proc.stdout + proc.stderr
    wrong = subprocess.run([sys.executable, "-c", code, *(f"{k}={v}" for k, v in bare.items()),
                            "password=guess"], env={**env_without, "HOME": str(tmp_path)},
                           capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 3 and "password authentication failed" in wrong.stdout
    assert (Path(params["passfile"]).stat().st_mode & 0o777) == 0o600
