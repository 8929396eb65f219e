"""Where and as whom a job's command runs: its OS user, its working directory, its environment.

Jobs are untrusted code (DESIGN.md, "Roles and trust"). With ``--run-as USER`` (or
PGDISPATCH_RUN_AS) a scheduler started as root runs every command as that user: its uid, its
primary group and no supplementary group, so that nothing the scheduler's user may read —
``/proc/<scheduler>/environ``, the data directory with the embedded server's password file,
the session key — is readable by the job. Every job, with or without ``--run-as``, gets:

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
import logging
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from pgdispatch.sql import InvalidInput, Settings
from pgdispatch.sql.transitions import Claim

log = logging.getLogger(__name__)

# What a job inherits from its scheduler's environment, besides LC_* and the configured extras.
JOB_ENV_ALLOW = ("PATH", "LANG", "TZ", "HOME", "TMPDIR")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclasses.dataclass(frozen=True)
class JobUser:
    """The OS user jobs run as (``--run-as``): name, uid and primary gid."""

    name: str
    uid: int
    gid: int


def resolve_run_as(name: str) -> JobUser:
    """The user ``name`` (or a numeric uid), checked that this process can run commands as it.

    Raises:
        InvalidInput: no such user; it is root, or has root's group, or is this process's own
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


@dataclasses.dataclass(frozen=True)
class Sandbox:
    """How a scheduler starts its jobs' commands (see the module docstring).

    Attributes:
        user: the user to run as; None runs them as the scheduler's own user.
        env_allow: extra environment names passed through (Settings.job_env_allow).
    """

    user: JobUser | None = None
    env_allow: tuple[str, ...] = ()

    def make_workdir(self, claim: Claim) -> Path:
        """A new empty directory for one attempt (0700, owned by the job's user), under the
        system's temporary directory."""
        path = Path(tempfile.mkdtemp(prefix=f"pgdispatch-job-{claim.job_id}-{claim.attempt_no}-"))
        if self.user is not None:
            os.chown(path, self.user.uid, self.user.gid)
        return path

    @staticmethod
    def remove_workdir(path: Path) -> None:
        """Remove an attempt's directory and whatever the job left in it (symbolic links are
        removed, never followed)."""
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            log.warning("could not remove all of the job's directory %s", path)

    def popen_kwargs(self, claim: Claim, workdir: Path) -> dict:
        """The subprocess.Popen arguments for the command: who, where, which environment."""
        kwargs: dict = {"cwd": workdir, "close_fds": True,
                        "env": job_environment(claim, allow=self.env_allow, user=self.user,
                                               workdir=workdir)}
        if self.user is not None:
            kwargs.update(user=self.user.uid, group=self.user.gid, extra_groups=[])
        return kwargs


def from_settings(settings: Settings) -> Sandbox:
    """The sandbox ``settings`` asks for: ``run_as`` resolved (``resolve_run_as``) and
    ``job_env_allow``; warns when that leaves jobs running as root (``warn_if_root``).

    Raises:
        InvalidInput: as ``resolve_run_as``.
    """
    user = resolve_run_as(settings.run_as) if settings.run_as else None
    sandbox = Sandbox(user=user, env_allow=tuple(settings.job_env_allow))
    if user is not None:
        log.info("jobs run as %s (uid %d, gid %d)", user.name, user.uid, user.gid)
    warn_if_root(sandbox)
    return sandbox


def warn_if_root(sandbox: Sandbox) -> None:
    """Log, loudly, when jobs would run as root (the scheduler is root and has no --run-as)."""
    if sandbox.user is None and os.geteuid() == 0:
        log.warning("RUNNING JOBS AS ROOT: the scheduler runs as root without --run-as, so "
                    "every job can read its database credentials and the embedded server's "
                    "password file; give it --run-as USER (docs/operations.md, \"Running jobs "
                    "as another user\")")
