"""Configuration read once from the environment, shared by every pgdispatch process."""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path

from .errors import InvalidInput


# Upper bounds of the duration settings (seconds). A lease is what pgd_claim accepts; a
# backoff is at most what a submit's delay may be, so that every ready_at the database
# computes (now() + backoff) stays a time PostgreSQL and Python both hold (an unbounded
# cap once overflowed the interval and stopped every expiry pass at that row).
MAX_LEASE_SECONDS = 86400.0
MAX_INTERVAL_SECONDS = 3600.0
# the runner beat and the duty lease: pgd_beat_runner's own bound (sql/functions/runners.sql)
MAX_DUTY_SECONDS = 300.0
# a freed slot's wait for others to free (claim_coalesce_seconds): a dispatch delay, so small
MAX_COALESCE_SECONDS = 0.1
MIN_STATEMENT_DEADLINE_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 2592000.0  # 30 days, pgd_backoff_seconds' own clamp too
MAX_PREPARE_THRESHOLD = 1_000_000
# the console's banner for a pinned xmin horizon (PGDISPATCH_HORIZON_ALERT_SECONDS): a week
MAX_HORIZON_ALERT_SECONDS = 604800.0


def _float(env: dict[str, str], name: str, default: float, *, maximum: float,
           minimum: float = 0.0) -> float:
    """``env[name]`` as seconds in (0, maximum] and at least ``minimum``, or ``default``
    when unset or empty.

    Raises:
        InvalidInput: not a number, not above 0, below ``minimum`` or above ``maximum`` (one
            line, naming it).
    """
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidInput(f"{name} must be a number of seconds, got {raw!r}") from None
    if not (0 < value <= maximum and value >= minimum):  # NaN fails every comparison
        lowest = f"at least {minimum:g}" if minimum > 0 else "more than 0"
        raise InvalidInput(f"{name} must be {lowest} and at most {maximum:g} seconds, "
                           f"got {raw!r}")
    return value


def _prepare_threshold(env: dict[str, str]) -> int | None:
    """``PGDISPATCH_PREPARE_THRESHOLD``: None (never prepare) when unset, empty or ``off``,
    else how many times psycopg runs a statement on a connection before it prepares it on
    the server (0: at once), as psycopg's ``prepare_threshold``.

    Raises:
        InvalidInput: neither ``off`` nor a whole number in 0..MAX_PREPARE_THRESHOLD.
    """
    name = "PGDISPATCH_PREPARE_THRESHOLD"
    raw = env.get(name)
    if raw is None or raw.strip() == "" or raw.strip().lower() == "off":
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_PREPARE_THRESHOLD:
        raise InvalidInput(f"{name} must be off (never prepare statements on the server) or a "
                           f"whole number of runs from 0 to {MAX_PREPARE_THRESHOLD}, got {raw!r}")
    return int(text)


def _job_env_allow(env: dict[str, str]) -> tuple[str, ...]:
    """``PGDISPATCH_JOB_ENV_ALLOW``: comma-separated names of more environment variables a
    job inherits from its scheduler (scheduler/sandbox.py); () when unset.

    Raises:
        InvalidInput: a name that is not a variable name, or one that carries the scheduler's
            database credentials or settings (DATABASE_URL, PG*, PGDISPATCH_*).
    """
    name = "PGDISPATCH_JOB_ENV_ALLOW"
    names = tuple(n.strip() for n in (env.get(name) or "").split(",") if n.strip())
    for n in names:
        if not (n.isascii() and (n[0].isalpha() or n[0] == "_") and n.replace("_", "").isalnum()):
            raise InvalidInput(f"{name}: not an environment variable name: {n!r}")
        if n == "DATABASE_URL" or n.startswith("PG"):
            raise InvalidInput(f"{name}: {n} would hand the scheduler's database settings "
                               f"to every job")
    return names


def create_private_once(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (mode 0600) unless it exists: written aside, then linked
    into place, so that the write is atomic and, of processes starting at once, the first to
    link wins and every one then reads that file, never a half-written or a different one."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Process settings; every duration is in seconds.

    Attributes:
        database_url: libpq URL, or None for the embedded server under ``data_dir``.
        data_dir: where the embedded server and the demo's generated secret live.
        lease_seconds: lease granted by a claim or a heartbeat.
        heartbeat_seconds: how often a running job's lease is extended (default lease / 3).
        claim_interval_seconds: how often an idle scheduler looks for work.
        claim_idle_cap_seconds: while claims find nothing, the poll interval doubles from
            claim_interval_seconds up to this (scheduler/claiming.py; at least the interval).
        claim_coalesce_seconds: how long a slot freed while other jobs still run waits for
            more slots to free before they are claimed together (scheduler/claiming.py,
            ClaimWaker; at most MAX_COALESCE_SECONDS).
        expire_interval_seconds: how often a scheduler runs the expiry pass.
        summary_interval_seconds: how often the holder of the summaries duty refreshes the
            queue summary and its history.
        runner_beat_seconds: how often a scheduler that holds no duty beats its runner row
            (the keep-alive; a holder beats every duty_lease_seconds / 3).
        duty_lease_seconds: how long a duty stays with its holder without a renewal; a
            holder dead or stalled that long is replaced at the next beat of another
            (docs/operations.md, "Elected duties").
        backoff_base_seconds / backoff_cap_seconds: retry backoff (see pgd_backoff_seconds).
        statement_deadline_seconds: how long a client waits for any answer from the
            database before it cancels, closes the connection and retries on a fresh one
            (sql/db.py, Connection).
        secret_key: session signing key for the console; None until resolved.
        bind: console address, HOST:PORT.
        prepare_threshold: None (the default, safe on every route) never prepares a statement
            on the server; N lets psycopg prepare one after N runs on a connection, for a
            direct connection or a pooler that keeps prepared statements per client
            (PgBouncer 1.21 or later with max_prepared_statements). Never through a
            transaction pooler without that (docs/operations.md, PgBouncer).
        run_as: the OS user a scheduler runs its jobs as (PGDISPATCH_RUN_AS, ``--run-as``),
            or a pattern with ``{slot}`` naming one user per slot; None: its own user
            (scheduler/sandbox.py).
        job_env_allow: more environment names a job inherits (PGDISPATCH_JOB_ENV_ALLOW).
        horizon_alert_seconds: the overview warns when one session or prepared transaction
            has held the xmin horizon back longer than this (PGDISPATCH_HORIZON_ALERT_SECONDS;
            docs/operations.md, "The database's health").
    """

    database_url: str | None = None
    data_dir: Path = Path(".pgdispatch")
    lease_seconds: float = 30.0
    heartbeat_seconds: float = 10.0
    claim_interval_seconds: float = 1.0
    claim_idle_cap_seconds: float = 15.0
    claim_coalesce_seconds: float = 0.005
    expire_interval_seconds: float = 5.0
    summary_interval_seconds: float = 5.0
    runner_beat_seconds: float = 15.0
    duty_lease_seconds: float = 20.0
    backoff_base_seconds: float = 2.0
    backoff_cap_seconds: float = 300.0
    statement_deadline_seconds: float = 30.0
    secret_key: str | None = None
    bind: str = "127.0.0.1:8000"
    prepare_threshold: int | None = None
    run_as: str | None = None
    job_env_allow: tuple[str, ...] = ()
    horizon_alert_seconds: float = 300.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> "Settings":
        """Read ``PGDISPATCH_*`` and ``DATABASE_URL`` (DESIGN.md, Configuration).

        Raises:
            InvalidInput: a variable is present but not a number of seconds within its bound
                (MAX_LEASE_SECONDS, MAX_INTERVAL_SECONDS, MAX_BACKOFF_SECONDS), the backoff
                base is above its cap, the claim idle cap is below the claim interval, the
                heartbeat is not shorter than the lease, or the duty lease is not longer
                than the runner beat;
                PGDISPATCH_PREPARE_THRESHOLD is neither ``off`` nor a whole number;
                PGDISPATCH_JOB_ENV_ALLOW names a credential (see ``_job_env_allow``).
        """
        env = dict(os.environ if env is None else env)
        def seconds(name: str, default: float, maximum: float, minimum: float = 0.0) -> float:
            return _float(env, f"PGDISPATCH_{name}_SECONDS", default, maximum=maximum,
                          minimum=minimum)

        lease = seconds("LEASE", 30.0, MAX_LEASE_SECONDS)
        claim_interval = seconds("CLAIM_INTERVAL", 1.0, MAX_INTERVAL_SECONDS)
        values = dict(
            database_url=env.get("DATABASE_URL") or None,
            data_dir=Path(env.get("PGDISPATCH_DATA_DIR") or ".pgdispatch"),
            lease_seconds=lease,
            heartbeat_seconds=seconds("HEARTBEAT", lease / 3, MAX_LEASE_SECONDS),
            claim_interval_seconds=claim_interval,
            # unset, the cap is never below the interval (an interval of 30 s polls every 30 s)
            claim_idle_cap_seconds=seconds("CLAIM_IDLE_CAP", max(15.0, claim_interval),
                                           MAX_INTERVAL_SECONDS),
            claim_coalesce_seconds=seconds("CLAIM_COALESCE", 0.005, MAX_COALESCE_SECONDS),
            expire_interval_seconds=seconds("EXPIRE_INTERVAL", 5.0, MAX_INTERVAL_SECONDS),
            summary_interval_seconds=seconds("SUMMARY_INTERVAL", 5.0, MAX_INTERVAL_SECONDS),
            runner_beat_seconds=seconds("RUNNER_BEAT", 15.0, MAX_DUTY_SECONDS),
            duty_lease_seconds=seconds("DUTY_LEASE", 20.0, MAX_DUTY_SECONDS),
            backoff_base_seconds=seconds("BACKOFF_BASE", 2.0, MAX_BACKOFF_SECONDS),
            backoff_cap_seconds=seconds("BACKOFF_CAP", 300.0, MAX_BACKOFF_SECONDS),
            # below a second, healthy statements on a busy server would be cancelled
            statement_deadline_seconds=seconds("STATEMENT_DEADLINE", 30.0, MAX_INTERVAL_SECONDS,
                                               minimum=MIN_STATEMENT_DEADLINE_SECONDS),
            secret_key=env.get("PGDISPATCH_SECRET_KEY") or None,
            bind=env.get("PGDISPATCH_BIND") or "127.0.0.1:8000",
            prepare_threshold=_prepare_threshold(env),
            run_as=(env.get("PGDISPATCH_RUN_AS") or "").strip() or None,
            job_env_allow=_job_env_allow(env),
            horizon_alert_seconds=seconds("HORIZON_ALERT", 300.0, MAX_HORIZON_ALERT_SECONDS),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        if settings.backoff_base_seconds > settings.backoff_cap_seconds:
            raise InvalidInput(
                f"PGDISPATCH_BACKOFF_BASE_SECONDS ({settings.backoff_base_seconds:g}) must not be "
                f"more than PGDISPATCH_BACKOFF_CAP_SECONDS ({settings.backoff_cap_seconds:g})")
        if settings.claim_idle_cap_seconds < settings.claim_interval_seconds:
            raise InvalidInput(
                f"PGDISPATCH_CLAIM_IDLE_CAP_SECONDS ({settings.claim_idle_cap_seconds:g}) must not "
                f"be less than PGDISPATCH_CLAIM_INTERVAL_SECONDS "
                f"({settings.claim_interval_seconds:g})")
        if settings.heartbeat_seconds >= settings.lease_seconds:
            raise InvalidInput(
                f"heartbeat ({settings.heartbeat_seconds:g} s) must be shorter than the lease "
                f"({settings.lease_seconds:g} s)")
        if settings.duty_lease_seconds <= settings.runner_beat_seconds:
            # a non-holder must beat within a lease, or a dead holder's duty waits a beat longer
            raise InvalidInput(
                f"PGDISPATCH_DUTY_LEASE_SECONDS ({settings.duty_lease_seconds:g}) must be more "
                f"than PGDISPATCH_RUNNER_BEAT_SECONDS ({settings.runner_beat_seconds:g})")
        return settings

    def with_overrides(self, **overrides) -> "Settings":
        """A copy with the given non-None fields replaced."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def resolved_secret_key(self) -> str:
        """The session key: PGDISPATCH_SECRET_KEY, else one generated once into data_dir."""
        if self.secret_key:
            return self.secret_key
        path = self.data_dir / "secret_key"
        if not path.exists():
            # write aside, then link into place: atomic, and the first process to link wins,
            # so concurrent starters never read a half-written or a different key
            self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            create_private_once(path, secrets.token_urlsafe(48))
        return path.read_text().strip()
