"""Where and as whom a job's command runs: its OS user, its working directory, its environment.

Jobs are untrusted code (DESIGN.md, "Roles and trust"). With ``--run-as USER`` (or
PGDISPATCH_RUN_AS) a scheduler started as root runs every command as that user: its uid, its
primary group and no supplementary group, so that nothing the scheduler's user may read —
``/proc/<scheduler>/environ``, the data directory with the embedded server's password file,
the session key — is readable by the job.

``--run-as`` with ``{slot}`` in it (``pgdispatch-job-{slot}``) names one user per slot (1 to
``--slots``): each running job takes a free slot's user, so that no two jobs of a scheduler
ever share a uid and one job cannot read another's ``/proc/<pid>/environ``, files or working
directory, nor signal it. A plain name is shared by every job (weaker: concurrent jobs can
reach each other).

Nothing a job started outlives it (``RunAs.sweep``): when the command ends, however it
ends, the scheduler SIGKILLs every process of the job's uid (found in /proc by real uid,
repeated until none is left) once no other job of this scheduler runs as that uid — always,
with ``{slot}``; with a shared user it kills what is left in the job's session at least. Only
then is the working directory removed and the user given to the next job. A process that
left the job's process group and session (``setsid``) is reached this way too.

Every job, with or without ``--run-as``, gets:

* a fresh working directory (mode 0700, owned by the job's user; HOME with ``--run-as``),
  removed when the job ends;
* an environment built from an allow-list (``JOB_ENV_ALLOW``, the ``LC_*`` family, and the
  names in PGDISPATCH_JOB_ENV_ALLOW), plus the PGDISPATCH_JOB_* variables naming the attempt;
  nothing else of the scheduler's environment (DATABASE_URL, PGPASSWORD, PGPASSFILE, the
  PGDISPATCH_* settings) reaches it;
* no open descriptor of the scheduler (``close_fds``: its database sockets stay behind).

The command keeps its own session and process group (supervision.py): the scheduler, as
root, can still signal the whole group of another user's processes.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from pgdispatch.sql import InvalidInput, Settings
from pgdispatch.sql.transitions import Claim

log = logging.getLogger(__name__)

# What a job inherits from its scheduler's environment, besides LC_* and the configured extras.
JOB_ENV_ALLOW = ("PATH", "LANG", "TZ", "HOME", "TMPDIR")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
# what ``--run-as`` replaces with the slot's number (1 to --slots)
SLOT_FIELD = "{slot}"
# A job's leftovers are killed in rounds (a process may fork between the scan and the kill);
# bounded, so that a job can never hold its slot forever.
_SWEEP_ROUNDS = 50
_SWEEP_PAUSE_SECONDS = 0.02
# Per-slot users are one scheduler's alone: each holds a lock per uid here (root's own
# directory: a job's user cannot create it first, nor take a lock in it) for its lifetime.
JOB_USER_LOCKS = Path("/run/pgdispatch/job-users")
_held_locks: dict[int, int] = {}  # uid -> descriptor of its lock, for this process's lifetime


@dataclasses.dataclass(frozen=True)
class JobUser:
    """The OS user jobs run as (``--run-as``): name, uid and primary gid."""

    name: str
    uid: int
    gid: int


def resolve_run_as(name: str) -> JobUser:
    """The user ``name`` (or a numeric uid), checked that this process can run commands as it.

    Raises:
        InvalidInput: no such user; it is root, or has root's group, or is this process's own;
            this process is not root or cannot switch to it (one line, naming why).
    """
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, OverflowError):
        raise InvalidInput(f"--run-as: no such user {name!r}") from None
    user = JobUser(entry.pw_name, entry.pw_uid, entry.pw_gid)
    if user.uid == 0 or user.gid == 0:
        raise InvalidInput(f"--run-as: {user.name} is root or in root's group; jobs need an "
                           f"unprivileged user")
    if user.uid in (os.getuid(), os.geteuid()):
        raise InvalidInput(f"--run-as: {user.name} is the scheduler's own user (uid {user.uid}); "
                           f"jobs need a user of their own")
    if os.geteuid() != 0:
        raise InvalidInput(f"--run-as {user.name}: the scheduler must run as root to start jobs "
                           f"as another user (it runs as uid {os.geteuid()})")
    # a real switch, so that a root without CAP_SETUID/CAP_SETGID (a container) is refused now
    # rather than at every job
    true = shutil.which("true") or "/bin/true"
    try:
        subprocess.run([true], user=user.uid, group=user.gid, extra_groups=[], cwd="/",
                       env={"PATH": DEFAULT_PATH}, check=True, timeout=10,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        raise InvalidInput(f"--run-as {user.name}: cannot start a process as that user: "
                           f"{getattr(exc, 'strerror', None) or exc}") from None
    return user


def resolve_run_as_users(run_as: str, *, slots: int) -> tuple[JobUser, ...]:
    """The users ``run_as`` names for a scheduler with ``slots`` slots: with ``{slot}`` in it,
    one per slot (``{slot}`` replaced by 1 to ``slots``), each ``resolve_run_as``-checked and
    no two with the same uid; else the one user, shared by every slot.

    Raises:
        InvalidInput: as ``resolve_run_as`` (for the first user that fails, naming its slot),
            or two slots' users have the same uid.
    """
    if SLOT_FIELD not in run_as:
        return (resolve_run_as(run_as),)
    users: list[JobUser] = []
    for slot in range(1, slots + 1):
        name = run_as.replace(SLOT_FIELD, str(slot))
        try:
            user = resolve_run_as(name)
        except InvalidInput as exc:
            raise InvalidInput(f"{exc} (slot {slot} of --run-as {run_as}; create one user per "
                               f"slot, 1 to {slots})") from None
        twin = next((u for u in users if u.uid == user.uid), None)
        if twin is not None:
            raise InvalidInput(f"--run-as {run_as}: {twin.name} and {user.name} have the same "
                               f"uid {user.uid}; every slot needs a uid of its own")
        users.append(user)
    return tuple(users)


def _proc_entries() -> Iterator[tuple[int, int, int | None, str]]:
    """(pid, real uid, session id, state letter) of every process in /proc, skipping those
    that end while being read. The session id is None when it cannot be read."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                status = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        uid = state = None
        for line in status.splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])  # real, effective, saved, filesystem
            elif line.startswith("State:"):
                state = line.split()[1]
        # the command name (field 2) is in parentheses and may hold spaces or parentheses
        fields = stat[stat.rfind(")") + 2:].split()
        sid = int(fields[3]) if len(fields) > 3 else None
        if uid is not None and state is not None:
            yield pid, uid, sid, state


def processes_of(uid: int, *, sid: int | None = None) -> list[int]:
    """The pids of the live processes whose real uid is ``uid`` (and, when given, whose
    session is ``sid``); zombies are left out: they are dead and wait for their parent."""
    return [pid for pid, puid, psid, state in _proc_entries()
            if puid == uid and state not in ("Z", "X") and (sid is None or psid == sid)
            and pid != os.getpid()]


def kill_processes_of(uid: int, *, sid: int | None = None) -> int:
    """SIGKILL every process ``processes_of(uid, sid=sid)`` finds, again and again until a
    scan finds none (at most _SWEEP_ROUNDS rounds); returns how many were killed. Logs a
    warning when some were still there after the last round."""
    killed = 0
    for round_no in range(_SWEEP_ROUNDS):
        pids = processes_of(uid, sid=sid)
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        if round_no:
            time.sleep(_SWEEP_PAUSE_SECONDS)
    left = processes_of(uid, sid=sid)
    if left:
        log.warning("uid %d: %d processes still alive after %d rounds of SIGKILL: %s", uid,
                    len(left), _SWEEP_ROUNDS, left[:10])
    return killed


class RunAs:
    """One job's hold on its OS user (``Sandbox.take_user``), from before its working
    directory is made until after it is removed.

    Attributes:
        user: whom the job runs as; None: as the scheduler's own user.
    """

    def __init__(self, sandbox: "Sandbox", user: JobUser | None):
        self._sandbox = sandbox
        self.user = user
        self._is_swept = False
        self._is_released = False

    def kill_session(self, sid: int) -> None:
        """SIGKILL what is left of the job's session ``sid`` (processes of the job's uid
        only). Call it before the session leader is reaped: until then ``sid`` cannot be
        another session's id."""
        if self.user is None:
            return  # processes of the scheduler's own uid: the group kill is all there is
        try:
            kill_processes_of(self.user.uid, sid=sid)
        except OSError as exc:
            log.warning("could not look for processes left in session %d: %s", sid, exc)

    def sweep(self) -> None:
        """Kill every process of the job's uid when no other job of this scheduler runs as
        it (always with ``{slot}`` users). Idempotent."""
        if self._is_swept or self.user is None:
            return
        self._is_swept = True
        self._sandbox._sweep(self.user)

    def release(self) -> None:
        """Give the user back for the next job (after ``sweep``). Idempotent."""
        if self._is_released:
            return
        self._is_released = True
        self.sweep()
        if self.user is not None:
            self._sandbox._release(self.user)


def job_environment(claim: Claim, *, base: Mapping[str, str] | None = None,
                    allow: Sequence[str] = (), user: JobUser | None = None,
                    workdir: Path | None = None) -> dict[str, str]:
    """The environment a job's command runs with: from ``base`` (default the scheduler's own)
    only JOB_ENV_ALLOW, LC_* and ``allow``; HOME, USER and LOGNAME of ``user`` (HOME is
    ``workdir``) when given; and PGDISPATCH_JOB_ID, PGDISPATCH_ATTEMPT (attempt number,
    from 1), PGDISPATCH_ATTEMPT_ID and PGDISPATCH_GENERATION."""
    base = os.environ if base is None else base
    wanted = set(JOB_ENV_ALLOW) | set(allow)
    env = {k: v for k, v in base.items() if k in wanted or k.startswith("LC_")}
    env.setdefault("PATH", DEFAULT_PATH)
    if user is not None:
        env.update(USER=user.name, LOGNAME=user.name)
        if workdir is not None:
            env["HOME"] = str(workdir)
    env.update(PGDISPATCH_JOB_ID=str(claim.job_id), PGDISPATCH_ATTEMPT=str(claim.attempt_no),
               PGDISPATCH_ATTEMPT_ID=str(claim.attempt_id),
               PGDISPATCH_GENERATION=str(claim.generation))
    return env


class Sandbox:
    """How a scheduler starts its jobs' commands (see the module docstring).

    Args:
        user: the one user every job runs as (a plain ``--run-as``); None: the scheduler's own.
        env_allow: extra environment names passed through (Settings.job_env_allow).
        users: one user per slot (``--run-as`` with ``{slot}``), instead of ``user``.
    """

    def __init__(self, user: JobUser | None = None, env_allow: tuple[str, ...] = (), *,
                 users: Sequence[JobUser] = ()):
        if user is not None and users:
            raise ValueError("give user or users, not both")
        self.users: tuple[JobUser, ...] = tuple(users) or ((user,) if user is not None else ())
        self.user = user
        self.env_allow = tuple(env_allow)
        self.is_per_slot = bool(users)
        self._lock = threading.Condition()
        self._running: dict[int, int] = {}  # uid -> jobs running as it

    def take_user(self) -> RunAs:
        """A user for one job: a free slot's user (``{slot}``: one no other job runs as), the
        shared user, or None (the scheduler's own). Release it with ``RunAs.release``.

        Raises:
            RuntimeError: every slot's user is taken (more jobs than slots: a bug).
        """
        with self._lock:
            if self.is_per_slot:
                user = next((u for u in self.users if not self._running.get(u.uid)), None)
                if user is None:
                    raise RuntimeError("every slot's user runs a job")
            elif self.users:
                user = self.users[0]
            else:
                return RunAs(self, None)
            self._running[user.uid] = self._running.get(user.uid, 0) + 1
            return RunAs(self, user)

    def _sweep(self, user: JobUser) -> None:
        with self._lock:
            # held while killing: no job of this uid starts meanwhile (take_user waits)
            if self._running.get(user.uid, 0) <= 1:
                try:
                    killed = kill_processes_of(user.uid)
                except OSError as exc:  # no /proc: nothing to scan; the group kill stands
                    log.warning("could not look for processes of %s left behind: %s",
                                user.name, exc)
                    return
                if killed:
                    log.info("killed %d processes of %s left behind by a job", killed, user.name)

    def claim_users(self, lock_dir: Path = JOB_USER_LOCKS) -> None:
        """Take the slots' users (``{slot}`` only) for this process: an exclusive ``flock``
        per uid in ``lock_dir``, held until the process ends (a crash releases it too), the
        holder's pid written in it. Found by a fresh-user run: two schedulers on one host
        with the same pattern (two demos) SIGKILLed each other's jobs as leftovers, and each
        job only said "killed by SIGKILL". A scheduler that cannot lock its directory (not
        root: it cannot run jobs as other users either) logs why and goes on.

        Raises:
            InvalidInput: another live process holds one of the users (names it, and its
                pid), or ``lock_dir`` is not this user's own (writable by others).
        """
        if not self.is_per_slot:
            return
        try:
            lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("could not make %s to lock the job users (%s): another scheduler on "
                        "this host using the same --run-as pattern would kill these jobs",
                        lock_dir, exc)
            return
        st = lock_dir.stat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise InvalidInput(f"{lock_dir} must be owned by uid {os.geteuid()} and writable by "
                               f"it alone to lock the job users")
        for user in self.users:
            if user.uid in _held_locks:
                continue  # this process holds it already (another sandbox of it)
            path = lock_dir / f"{user.uid}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise InvalidInput(
                    f"job user {user.name} (uid {user.uid}) is in use by another scheduler on "
                    f"this host (pid {holder}): give each scheduler its own --run-as pattern "
                    f"(docs/operations.md, \"Running jobs as another user\")") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _held_locks[user.uid] = fd

    def sweep_leftovers(self) -> int:
        """Before the first job: SIGKILL every process of the slots' users (``{slot}`` only),
        which an earlier run of this scheduler left behind when it died without reaching its
        jobs' end (SIGKILL, a crash, the machine's OOM killer). The users are this
        scheduler's alone (docs/operations.md: two schedulers on one host use different
        patterns), so nothing of them may run before it does. Returns how many were killed.
        A plain, shared ``--run-as`` user is left alone: another scheduler may use it."""
        if not self.is_per_slot:
            return 0
        killed = 0
        for user in self.users:
            try:
                n = kill_processes_of(user.uid)
            except OSError as exc:  # no /proc: nothing to scan
                log.warning("could not look for processes of %s left behind: %s", user.name, exc)
                return killed
            if n:
                log.warning("killed %d processes of %s left behind by an earlier run's jobs",
                            n, user.name)
            killed += n
        return killed

    def _release(self, user: JobUser) -> None:
        with self._lock:
            self._running[user.uid] -= 1

    def make_workdir(self, claim: Claim, user: JobUser | None = None) -> Path:
        """A new empty directory for one attempt (0700, owned by ``user``, the job's), under
        the system's temporary directory."""
        path = Path(tempfile.mkdtemp(prefix=f"pgdispatch-job-{claim.job_id}-{claim.attempt_no}-"))
        if user is not None:
            os.chown(path, user.uid, user.gid)
        return path

    @staticmethod
    def remove_workdir(path: Path) -> None:
        """Remove an attempt's directory and whatever the job left in it (symbolic links are
        removed, never followed)."""
        # Most jobs leave their directory empty: one rmdir, instead of rmtree's open, scan,
        # stat and rmdir, each of which gives up the GIL and waits to get it back behind the
        # other job threads (8 % of a short job's wall time, bench/e2e.py throughput). rmdir
        # removes only an empty directory and never follows a symbolic link (ENOTDIR): all
        # else goes to rmtree, as before.
        try:
            os.rmdir(path)
            return
        except OSError:
            pass
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            log.warning("could not remove all of the job's directory %s", path)

    def popen_kwargs(self, claim: Claim, workdir: Path, user: JobUser | None = None) -> dict:
        """The subprocess.Popen arguments for the command: who (``user``), where, which
        environment."""
        kwargs: dict = {"cwd": workdir, "close_fds": True,
                        "env": job_environment(claim, allow=self.env_allow, user=user,
                                               workdir=workdir)}
        if user is not None:
            kwargs.update(user=user.uid, group=user.gid, extra_groups=[])
        return kwargs


def from_settings(settings: Settings, *, slots: int = 1) -> Sandbox:
    """The sandbox ``settings`` asks for, for a scheduler with ``slots`` slots: ``run_as``
    resolved (``resolve_run_as_users``) and ``job_env_allow``; with ``{slot}``, what an
    earlier run's jobs left behind is killed first (``Sandbox.sweep_leftovers``), once the
    users are this process's (``Sandbox.claim_users``); warns when that leaves jobs running
    as root (``warn_if_root``).

    Raises:
        InvalidInput: as ``resolve_run_as_users`` and ``Sandbox.claim_users``.
    """
    env_allow = tuple(settings.job_env_allow)
    if not settings.run_as:
        sandbox = Sandbox(env_allow=env_allow)
    elif SLOT_FIELD in settings.run_as:
        users = resolve_run_as_users(settings.run_as, slots=max(slots, 1))
        sandbox = Sandbox(env_allow=env_allow, users=users)
        log.info("jobs run as %s, one user per slot (uids %s)", settings.run_as,
                 ", ".join(str(u.uid) for u in users))
        sandbox.claim_users()  # before the sweep: never kill another scheduler's jobs
        sandbox.sweep_leftovers()
    else:
        user = resolve_run_as(settings.run_as)
        sandbox = Sandbox(user=user, env_allow=env_allow)
        log.info("jobs run as %s (uid %d, gid %d)", user.name, user.uid, user.gid)
        if slots > 1:
            log.warning("--run-as %s: the %d slots' jobs share one uid and can reach each other "
                        "(read each other's environment and files); use %s%s for a user per "
                        "slot", user.name, slots, user.name, "-" + SLOT_FIELD)
    warn_if_root(sandbox)
    return sandbox


def warn_if_root(sandbox: Sandbox) -> None:
    """Log, loudly, when jobs would run as root (the scheduler is root and has no --run-as)."""
    if not sandbox.users and os.geteuid() == 0:
        log.warning("RUNNING JOBS AS ROOT: the scheduler runs as root without --run-as, so "
                    "every job can read its database credentials and the embedded server's "
                    "password file; give it --run-as USER (docs/operations.md, \"Running jobs "
                    "as another user\")")
