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

import contextlib
import json
import os
import pwd
import re
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
# one user per slot (--run-as with {slot}): pgdispatch-test-slot-1, -2
SLOT_PATTERN = "pgdispatch-test-slot-{slot}"
HOSTILE = (Path(__file__).parent / "hostile_job.py").read_text()
ROOT = Path(__file__).resolve().parents[2]


def job_user(name: str = JOB_USER) -> pwd.struct_passwd:
    """The job's user ``name``, created with useradd when missing."""
    assert os.geteuid() == 0, ("the job sandbox tests run as root (they create a user and run a "
                               "scheduler that switches to it); run them as root, as CI does")
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                        "--shell", "/usr/sbin/nologin", name], check=True,
                       capture_output=True, timeout=30)
        return pwd.getpwnam(name)


def slot_users(slots: int = 2) -> list[pwd.struct_passwd]:
    """The users of SLOT_PATTERN for slots 1 to ``slots``, created when missing."""
    return [job_user(SLOT_PATTERN.replace("{slot}", str(n))) for n in range(1, slots + 1)]


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


@contextlib.contextmanager
def running_scheduler(folder: Path, url: str, *scheduler_args: str, slots: int = 1):
    """A ``pgdispatch scheduler`` for pool linux started in ``folder`` with the credentials in
    its environment, as a runner host's; stopped (SIGTERM, waited for) on leaving."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "DATABASE_URL": url, "PGPASSWORD": url.split(":")[2].split("@")[0],
           "PGDISPATCH_SECRET_KEY": SECRET_KEY, "PGDISPATCH_CLAIM_INTERVAL_SECONDS": "0.2",
           "PGDISPATCH_CLAIM_IDLE_CAP_SECONDS": "1",
           "PYTHONPATH": str(ROOT)}
    log = open(folder / "scheduler.log", "wb")
    scheduler = subprocess.Popen([sys.executable, "-m", "pgdispatch", "scheduler", "--pool", "linux",
                                  "--slots", str(slots), "--grace-seconds", "5", *scheduler_args],
                                 env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
    log.close()
    try:
        yield scheduler
    finally:
        scheduler.terminate()
        scheduler.wait(30)


def submit(url: str, folder: Path, *command: str, timeout: int = 60) -> int:
    """Submit ``command`` to project web, pool linux; returns the job's id."""
    submitted = run_pgdispatch(url, folder, "submit", "--project", "web", "--pool", "linux",
                               "--timeout", str(timeout), "--", *command)
    assert submitted.returncode == 0, submitted.stderr
    return json.loads(submitted.stdout)["id"]


def wait_for_job(url: str, folder: Path, scheduler: subprocess.Popen, job_id: int,
                 states: tuple[str, ...] = ("succeeded", "failed", "cancelled"),
                 timeout_s: float = 60) -> dict:
    """The job (reads.show_job) once its state is one of ``states``."""
    deadline = time.monotonic() + timeout_s
    with db.connect(url) as conn:
        while True:
            job = reads.show_job(conn, job_id=job_id)
            if job["state"] in states:
                return job
            assert scheduler.poll() is None, (folder / "scheduler.log").read_text()
            assert time.monotonic() < deadline, f"job {job_id} is still {job['state']}"
            time.sleep(0.1)


def job_report(job: dict) -> dict:
    """The JSON of the last ``REPORT `` line in the job's output tail."""
    tail = job["attempts"][-1]["output_tail"]
    lines = [line for line in tail.splitlines() if line.startswith("REPORT ")]
    assert lines, tail
    return json.loads(lines[-1][len("REPORT "):])


def run_hostile_job(folder: Path, url: str, *scheduler_args: str) -> tuple[dict, str]:
    """Start ``pgdispatch scheduler`` in ``folder`` with the credentials in its environment,
    run hostile_job.py through it, stop it; returns (the job's report, its output tail)."""
    data_dir = folder / ".pgdispatch"
    try:
        with running_scheduler(folder, url, *scheduler_args) as scheduler:
            with db.connect(url) as conn:
                socket_path = conn.execute("SELECT current_setting('unix_socket_directories') AS d"
                                           ).fetchone()["d"]
                port = conn.execute("SELECT current_setting('port') AS p").fetchone()["p"]
            job_id = submit(url, folder, "python3", "-c", HOSTILE, str(data_dir), str(folder),
                            f"{socket_path}/.s.PGSQL.{port}", port)
            job = wait_for_job(url, folder, scheduler, job_id, ("succeeded", "failed"))
        tail = job["attempts"][-1]["output_tail"]
        assert job["state"] == "succeeded", tail
        return job_report(job), tail
    finally:
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


# A job that leaves a process behind: double fork and setsid (out of the job's process group
# and session), writing a marker every 0.1 s; the job exits once the marker is there.
LEAVE_BEHIND = r"""
( setsid sh -c 'while :; do date +%s%N > "$0"; sleep 0.1; done' "$1" & )
while [ ! -s "$1" ]; do sleep 0.05; done
echo "REPORT {\"uid\": $(id -u)}"
"""


def marker_is_still_written(marker: Path, seconds: float = 1.0) -> bool:
    """Whether ``marker`` changes within ``seconds`` (something still writes it)."""
    before = marker.read_text()
    time.sleep(seconds)
    return marker.read_text() != before


def processes_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is ``uid``, from /proc."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines()
                          if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in "ZX":
            pids.append(int(status.parent.name))
    return pids


@pytest.fixture
def shared_tmp():
    """A folder every user may write into (sticky, as /tmp), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="pgd-test-shared-"))
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_nothing_a_job_started_outlives_its_report(runner_host, shared_tmp):
    """A process that left the job's group and session (setsid) is killed by its uid before
    the outcome is recorded, with a user per slot."""
    folder, url, _ = runner_host
    users = slot_users(1)
    marker = shared_tmp / "marker"
    with running_scheduler(folder, url, "--run-as", SLOT_PATTERN) as scheduler:
        job_id = submit(url, folder, "sh", "-c", LEAVE_BEHIND, "sh", str(marker))
        job = wait_for_job(url, folder, scheduler, job_id)
        assert job["state"] == "succeeded", job["attempts"][-1]["output_tail"]
        assert job_report(job)["uid"] == users[0].pw_uid
        assert processes_of(users[0].pw_uid) == []
        assert marker.exists() and not marker_is_still_written(marker)
    log = (folder / "scheduler.log").read_text()
    assert re.search(r"killed \d+ processes of pgdispatch-test-slot-1 left behind by a job", log), log


def test_with_a_shared_user_a_job_s_leftover_lives_while_another_job_runs(runner_host,
                                                                          shared_tmp):
    """The variant (a plain --run-as, shared by the slots): the check above fails while
    another job of the same uid runs, since its processes cannot be told apart from the
    leftover; the leftover dies with the last job of that uid (here: the scheduler's stop)."""
    folder, url, _ = runner_host
    user = job_user()
    marker = shared_tmp / "marker"
    with running_scheduler(folder, url, "--run-as", JOB_USER, slots=2) as scheduler:
        sleeper = submit(url, folder, "sleep", "60")
        wait_for_job(url, folder, scheduler, sleeper, ("running",))
        job_id = submit(url, folder, "sh", "-c", LEAVE_BEHIND, "sh", str(marker))
        job = wait_for_job(url, folder, scheduler, job_id)
        assert job["state"] == "succeeded", job["attempts"][-1]["output_tail"]
        assert marker_is_still_written(marker), "the leftover was killed: the variant shows nothing"
        assert processes_of(user.pw_uid)
        cancelled = run_pgdispatch(url, folder, "jobs", "cancel", str(sleeper))
        assert cancelled.returncode == 0, cancelled.stderr
        wait_for_job(url, folder, scheduler, sleeper, ("cancelled",))
        # the sleeper was the last job of the uid: nothing of it is left
        assert processes_of(user.pw_uid) == []
        assert not marker_is_still_written(marker)


# Two jobs that meet: each writes its pid and working directory into the shared folder,
# waits for the other, tries to read the other's environment and files, waits until the
# other has tried too, and reports.
PEEK = r"""
import json, os, sys, time
rdv, me = sys.argv[1], str(os.getpid())
with open("secret.txt", "w") as f:
    f.write("secret of " + me)
with open(os.path.join(rdv, "at-" + me), "w") as f:
    f.write(os.getcwd())

def wait_for(prefix):
    deadline = time.time() + 30
    while time.time() < deadline:
        names = [n for n in os.listdir(rdv) if n.startswith(prefix) and n != prefix + me]
        if names:
            return names[0][len(prefix):]
        time.sleep(0.05)
    sys.exit("the other job never came")

other = wait_for("at-")
with open(os.path.join(rdv, "at-" + other)) as f:
    other_cwd = f.read()

def attempt(fn):
    try:
        return fn()
    except OSError:
        return None

report = {"uid": os.getuid(), "cwd": os.getcwd(),
          "environ": attempt(lambda: open("/proc/%s/environ" % other, "rb").read()[:300].decode(errors="replace")),
          "listing": attempt(lambda: os.listdir(other_cwd)),
          "secret": attempt(lambda: open(os.path.join(other_cwd, "secret.txt")).read())}
open(os.path.join(rdv, "done-" + me), "w").close()
wait_for("done-")
print("REPORT " + json.dumps(report))
"""


def run_two_jobs_that_meet(folder: Path, url: str, shared: Path, run_as: str) -> list[dict]:
    """PEEK twice at once on a scheduler with 2 slots run as ``run_as``; their reports."""
    with running_scheduler(folder, url, "--run-as", run_as, slots=2) as scheduler:
        ids = [submit(url, folder, "python3", "-c", PEEK, str(shared)) for _ in range(2)]
        jobs = [wait_for_job(url, folder, scheduler, job_id) for job_id in ids]
    for job in jobs:
        assert job["state"] == "succeeded", job["attempts"][-1]["output_tail"]
    return [job_report(job) for job in jobs]


def test_concurrent_jobs_run_as_different_users_and_cannot_reach_each_other(runner_host,
                                                                            shared_tmp):
    folder, url, _ = runner_host
    users = slot_users(2)
    reports = run_two_jobs_that_meet(folder, url, shared_tmp, SLOT_PATTERN)
    assert sorted(r["uid"] for r in reports) == sorted(u.pw_uid for u in users)
    for report in reports:
        assert (report["environ"], report["listing"], report["secret"]) == (None, None, None)
        assert not Path(report["cwd"]).exists()


def test_concurrent_jobs_sharing_a_user_read_each_other(runner_host, shared_tmp):
    """The variant: with a plain --run-as the same jobs read each other's environment and
    files, which shows the check above can fail."""
    folder, url, _ = runner_host
    job_user()
    reports = run_two_jobs_that_meet(folder, url, shared_tmp, JOB_USER)
    assert reports[0]["uid"] == reports[1]["uid"]
    for report in reports:
        assert "PGDISPATCH_JOB_ID=" in report["environ"]
        assert report["secret"].startswith("secret of ") and "secret.txt" in report["listing"]


def test_run_as_refuses_a_pattern_whose_users_are_missing(tmp_path):
    slot_users(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL="postgresql://nobody@127.0.0.1:1/never-contacted")
    base = [sys.executable, "-m", "pgdispatch", "scheduler", "--pool", "linux"]
    # slots 1 and 2 exist, 3 does not
    missing = subprocess.run([*base, "--slots", "3", "--run-as", SLOT_PATTERN], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        "error: --run-as: no such user 'pgdispatch-test-slot-3' (slot 3 of --run-as "
        f"{SLOT_PATTERN}; create one user per slot, 1 to 3)")


# What a job left behind when its scheduler died without reaching the job's end (SIGKILL):
# a process of a slot's user, out of any session of the new scheduler, writing a marker.
ORPHAN = 'while :; do date +%s%N > "$0"; sleep 0.1; done'


@pytest.mark.parametrize("run_as", ["per-slot", "shared"])
def test_a_new_scheduler_kills_what_an_earlier_runs_jobs_left_behind(runner_host, shared_tmp,
                                                                    run_as):
    """With a user per slot, the users are the scheduler's alone: at start it kills every
    process of theirs before taking a job (an earlier run killed with SIGKILL could not).
    The variant, a plain shared --run-as user that another scheduler may use, is left
    alone: the orphan lives on, which the check would see."""
    folder, url, _ = runner_host
    user = slot_users(1)[0] if run_as == "per-slot" else job_user()
    marker = shared_tmp / "orphan"
    orphan = subprocess.Popen(["setsid", "sh", "-c", ORPHAN, str(marker)], user=user.pw_uid,
                              group=user.pw_gid, extra_groups=[], cwd=shared_tmp,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not (marker.exists() and marker.read_text()):
            assert time.monotonic() < deadline, "the orphan did not start"
            time.sleep(0.05)
        args = ("--run-as", SLOT_PATTERN if run_as == "per-slot" else JOB_USER)
        with running_scheduler(folder, url, *args) as scheduler:
            # up and serving, before any job ran: nothing but the start-up sweep was there
            deadline = time.monotonic() + 30
            while "serving linux" not in (folder / "scheduler.log").read_text():
                assert scheduler.poll() is None and time.monotonic() < deadline, \
                    (folder / "scheduler.log").read_text()
                time.sleep(0.05)
            if run_as == "per-slot":
                assert not marker_is_still_written(marker)
                assert processes_of(user.pw_uid) == []
            else:
                assert marker_is_still_written(marker), "the variant shows nothing"
        log = (folder / "scheduler.log").read_text()
        if run_as == "per-slot":
            assert re.search(rf"killed \d+ processes of {user.pw_name} left behind by an "
                             r"earlier run's jobs", log), log
    finally:
        orphan.kill()
        orphan.wait(10)
        for pid in processes_of(user.pw_uid):
            os.kill(pid, 9)


def test_a_second_scheduler_with_the_same_slot_users_is_refused_and_kills_nothing(runner_host):
    """Two schedulers on one host with one --run-as pattern: the second is refused at start
    (one line, exit 2, naming the user and the holder's pid) before its start-up sweep, so
    the first one's running job lives on (found by a fresh-user run: two demos on one host
    SIGKILLed each other's jobs as leftovers)."""
    folder, url, _ = runner_host
    with running_scheduler(folder, url, "--run-as", SLOT_PATTERN) as first:
        job_id = submit(url, folder, "sleep", "30")
        wait_for_job(url, folder, first, job_id, ("running",))
        second_folder = folder / "second"
        second_folder.mkdir()
        with running_scheduler(second_folder, url, "--run-as", SLOT_PATTERN) as second:
            assert second.wait(60) == 2
        log = (second_folder / "scheduler.log").read_text()
        user = slot_users(1)[0]
        assert re.search(rf"job user {user.pw_name} \(uid {user.pw_uid}\) is in use by another "
                         rf"scheduler on this host \(pid {first.pid}\)", log), log
        assert "Traceback" not in log
        shown = json.loads(run_pgdispatch(url, folder, "jobs", "show", str(job_id), "--json").stdout)
        assert shown["state"] == "running", shown
        assert first.poll() is None
