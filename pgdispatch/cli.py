"""The ``pgdispatch`` command line (click).

Every command honours DATABASE_URL, else the embedded server in ./.pgdispatch/ (created and
migrated on first use, which it says on stderr). Commands that report data print a table or
``name: value`` lines, and JSON with ``--json`` (``submit`` prints its job as JSON). On bad input a command prints one line on stderr,
changes nothing, and exits non-zero:
2 usage, invalid input or not allowed (Forbidden), 3 not found, 4 conflict (already resolved, fenced out),
5 database unavailable, 1 anything else.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import logging
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import uuid
from typing import Any

import click

from pgdispatch.sql import (Conflict, DatabaseUnavailable, FencedOut, Forbidden, IncompatibleDatabase,
                 InvalidInput, NotFound, PgDispatchError, Settings)
from pgdispatch.sql.validate import JOB_STATES, MAX_BATCH_LIMIT

EXIT_CODES = {InvalidInput: 2, Forbidden: 2, NotFound: 3, Conflict: 4, FencedOut: 4, DatabaseUnavailable: 5,
              IncompatibleDatabase: 6}


def _json_default(value: Any) -> Any:
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal,)):
        return float(value)
    if isinstance(value, (uuid.UUID, bytes)):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def emit(data: Any) -> None:
    """Print ``data`` as indented JSON on stdout."""
    click.echo(json.dumps(data, indent=2, default=_json_default, sort_keys=False))


def _when(ts: dt.datetime | None) -> str:
    """A time as the human tables show it: UTC, to the second."""
    return ts.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ") if ts else "-"


def _seconds(value: float | None) -> str:
    """A duration as ``45 s``, ``12 min``, ``3 h``, ``2 d`` (as the console shows it)."""
    if value is None:
        return "-"
    for limit, unit, size in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if value < limit:
            return f"{value / size:.0f} {unit}"
    return f"{value / 86400:.0f} d"


def _cut(text: str | None, width: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[:width - 1] + "…"


def table(rows: list[dict[str, Any]], columns: list[tuple[str, Any]], *, empty: str) -> None:
    """Print ``rows`` as a plain table with a header: ``columns`` are (heading, row -> cell)
    pairs. ``empty``: the one line printed when there is no row."""
    from tabulate import tabulate

    if not rows:
        click.echo(empty)
        return
    click.echo(tabulate([[cell(r) for _, cell in columns] for r in rows],
                        headers=[heading for heading, _ in columns], tablefmt="plain",
                        disable_numparse=True))


def fields(pairs: list[tuple[str, Any]]) -> None:
    """Print ``name: value`` lines, the names aligned (a value None shows as -)."""
    width = max(len(name) for name, _ in pairs)
    for name, value in pairs:
        click.echo(f"{name + ':':<{width + 1}} {'-' if value is None or value == '' else value}")


class Context:
    """What every command needs: settings, and a database URL resolved on first use."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._urls: dict[str, str] = {}
        self._is_migrated = False

    @property
    def url(self) -> str:
        """The database URL of a CLI command: DATABASE_URL, else the embedded server's (started
        and migrated on first use) as the CLI's own admin login (sql/logins.py)."""
        from pgdispatch.sql import logins

        return self.url_as(logins.CLI, "admin")

    def url_as(self, login: str | None, kind: str | None = None) -> str:
        """DATABASE_URL, else the embedded server's URL for ``login`` (made, in group
        ``kind``, on first use; None: the server's superuser), after migrating it."""
        if self.settings.database_url:
            return self.settings.database_url
        key = login or ""
        if key not in self._urls:
            from pgdispatch.sql import logins, migrate

            server = self.server_url
            if not self._is_migrated:
                migrate.upgrade(server)
                self._is_migrated = True
            self._urls[key] = server if login is None else logins.ensure_login(
                server, self.settings.data_dir, login, kind)
        return self._urls[key]

    @property
    def server_url(self) -> str:
        """The database URL without migrating (for ``db upgrade`` itself). Says so on stderr
        when it is about to create a new embedded database: a command run outside the
        checkout would otherwise quietly answer from an empty one."""
        from pgdispatch.sql import embedded

        if not self.settings.database_url and not embedded.exists(self.settings.data_dir):
            click.echo(f"note: no DATABASE_URL and no database in "
                       f"{self.settings.data_dir.resolve()}: creating a new, empty one there",
                       err=True)
        return embedded.database_url(self.settings)

    def connect(self):
        from pgdispatch.sql import db

        return db.connect(self.url, application_name="pgdispatch-cli",
                          statement_deadline_seconds=self.settings.statement_deadline_seconds,
                          prepare_threshold=self.settings.prepare_threshold)


# Numbers as an operator types them: ASCII digits only. Python's int() and float() also read
# "1_000", " 7 " and other scripts' digits ("١٢"), which no other part of pgdispatch accepts.
_ASCII_WHOLE = re.compile(r"[-+]?[0-9]+")
_ASCII_NUMBER = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


def _shown(value: Any, width: int = 60) -> str:
    """``value`` quoted for an error line, cut to ``width`` characters with …."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 1] + "…"


def _check_ascii(kind: click.ParamType, value: Any, pattern: re.Pattern, what: str, param, ctx) -> None:
    if isinstance(value, str) and not pattern.fullmatch(value):
        kind.fail(f"{_shown(value)} is not a valid {what} (ASCII digits only).", param, ctx)


class WholeNumber(click.types.IntParamType):
    """click's INT, written in ASCII digits only."""

    def convert(self, value, param, ctx):
        _check_ascii(self, value, _ASCII_WHOLE, "integer", param, ctx)
        return super().convert(value, param, ctx)


class IntRange(click.IntRange):
    """click's IntRange, written in ASCII digits only."""

    def convert(self, value, param, ctx):
        _check_ascii(self, value, _ASCII_WHOLE, "integer", param, ctx)
        return super().convert(value, param, ctx)


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange, which lets NaN through (every comparison with it is false) and
    inf where there is no maximum: a number of seconds must be a finite one, written in
    ASCII digits."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{_shown(value)} is not a finite number.", param, ctx)
        _check_ascii(self, value, _ASCII_NUMBER, "number", param, ctx)
        return number


MAX_BIGINT = 2**63 - 1



@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level on stderr.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """pgdispatch: a durable dispatch control plane for build and deployment jobs."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx.obj = Context(Settings.from_env())


# --- database ---------------------------------------------------------------------------

@cli.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def db_upgrade(obj: Context, as_json: bool) -> None:
    """Apply pending migrations and load changed function files (safe to run from several
    hosts at once, and under live traffic)."""
    from pgdispatch.sql import migrate

    url = obj.server_url
    applied = migrate.upgrade(url)
    if as_json:
        emit({"applied": list(applied), "functions_reloaded": applied.functions_reloaded,
              "current": migrate.applied_migrations(url)})
    elif applied or applied.functions_reloaded:
        click.echo(f"applied {len(applied)} migration(s)" + (": " + ", ".join(applied) if applied else "")
                   + "; loaded the function files (sql/functions)")
    else:
        click.echo("applied 0 migration(s) (schema and functions up to date)")


@db.command("roles")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def db_roles(obj: Context, as_json: bool) -> None:
    """Create the group roles (pgdispatch_owner, _migrator, _scheduler, _web, _reader,
    _operator, _admin) where missing, make pgdispatch_owner own the schema and apply the
    grants. Needs CREATEROLE (or a superuser); idempotent."""
    from pgdispatch.sql import roles

    result = roles.set_up(obj.server_url)
    if as_json:
        emit(result)
    else:
        click.echo(f"roles created: {', '.join(result['created']) or 'none (all existed)'}; "
                   f"schema: {result['schema']}")


@db.command("login")
@click.argument("name")
@click.option("--role", "kind", required=True,
              type=click.Choice(["scheduler", "web", "reader", "operator", "admin", "migrator"]),
              help="The group the login joins (and no other pgdispatch group).")
@click.option("--password-env", "password_env", required=True, metavar="VAR",
              help="Name of the environment variable holding the password (never the "
                   "password itself: a command line is visible to every local user).")
@click.option("--connection-limit", type=IntRange(-1, 100000), default=None,
              help="At most this many connections at once (-1: none; default: unchanged, "
                   "none for a new login). Give each runner host its pool size plus a few.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def db_login(obj: Context, name: str, kind: str, password_env: str, connection_limit: int | None,
             as_json: bool) -> None:
    """Create or update the LOGIN role NAME in one group, with a SCRAM-SHA-256 password."""
    from pgdispatch.sql import roles

    if password_env not in os.environ:
        raise InvalidInput(f"--password-env: environment variable {password_env} is not set")
    result = roles.set_login(obj.server_url, name=name, kind=kind,
                             password=os.environ[password_env], connection_limit=connection_limit)
    if as_json:
        emit(result)
    else:
        click.echo(f"login {name} {'created' if result['created'] else 'updated'} in {result['group']}")


@cli.command("apply")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def apply_cmd(obj: Context, path: str, as_json: bool) -> None:
    """Declare organizations, pools, projects, targets and users from a TOML file (idempotent)."""
    from pgdispatch.sql import config

    from pgdispatch.sql import db, logins

    text = config.read_config_file(path)  # before connecting: a missing file creates nothing
    # apply writes the tables as their owner: the embedded server's migrator login
    with db.connect(obj.url_as(logins.MIGRATOR, "migrator"), application_name="pgdispatch-cli",
                    statement_deadline_seconds=obj.settings.statement_deadline_seconds,
                    prepare_threshold=obj.settings.prepare_threshold) as conn:
        result = config.apply_config(conn, text, actor=None)
    if as_json:
        emit(result)
    else:
        click.echo(", ".join(f"{k}: {v}" for k, v in result.items()))


# --- jobs -------------------------------------------------------------------------------

@cli.command("submit", context_settings={"allow_interspersed_args": False})
@click.option("--project", required=True, help="Project name.")
@click.option("--pool", required=True, help="Runner pool name.")
@click.option("--target", default=None, help="Deployment target name (makes this a deployment).")
@click.option("--priority", type=WholeNumber(), default=0, show_default=True, help="-1000..1000; higher first, within the project.")
@click.option("--max-attempts", type=WholeNumber(), default=1, show_default=True, help="1..100.")
@click.option("--timeout", "timeout_seconds", type=WholeNumber(), default=3600, show_default=True, help="Seconds, 1..604800.")
@click.option("--delay", "delay_seconds", type=FiniteFloatRange(0, 2592000), default=0.0, show_default=True, help="Seconds before it may start.")
@click.option("--requires-approval", is_flag=True, help="Wait for an operator's approval.")
@click.option("--depends-on", "depends_on", type=WholeNumber(), multiple=True, help="Job id that must succeed first (repeatable).")
@click.option("--idempotency-key", default=None,
              help="Submitting the same request with the key again returns the first job; "
                   "a different request with it is refused.")
@click.argument("command", nargs=-1, required=True)
@click.pass_obj
def submit_cmd(obj: Context, project: str, pool: str, target: str | None, priority: int,
               max_attempts: int, timeout_seconds: int, delay_seconds: float,
               requires_approval: bool, depends_on: tuple[int, ...], idempotency_key: str | None,
               command: tuple[str, ...]) -> None:
    """Enqueue one job: pgdispatch submit --project P --pool Q [options] -- CMD [ARG]...

    Prints the job as JSON with its id.
    """
    from pgdispatch.sql import transitions

    with obj.connect() as conn:
        # the job and its submit_job audit event commit together (pgd_submit)
        job = transitions.submit(conn, project=project, pool=pool, target=target,
                                 command=list(command), priority=priority,
                                 max_attempts=max_attempts, timeout_seconds=timeout_seconds,
                                 delay_seconds=delay_seconds, requires_approval=requires_approval,
                                 depends_on=list(depends_on), idempotency_key=idempotency_key,
                                 submitted_by=None)
    emit(job)


@cli.group()
def jobs() -> None:
    """Inspect and steer jobs."""


JOB_COLUMNS = [
    ("ID", lambda j: str(j["id"])),
    ("STATE", lambda j: j["state"]),
    ("PROJECT", lambda j: f"{j['organization']}/{j['project']}"),
    ("POOL", lambda j: j["pool"]),
    ("TARGET", lambda j: j["target"] or "-"),
    ("RUNNER", lambda j: j["runner"] or "-"),
    ("AGE", lambda j: _seconds(j["age_seconds"])),
    ("RUNNING/TOOK", lambda j: _seconds(j["running_seconds"] if j["running_seconds"] is not None
                                        else j["duration_seconds"])),
    ("COMMAND", lambda j: _cut(" ".join(j["command"]), 50)),
]


@jobs.command("show")
@click.argument("job_id", type=WholeNumber())
@click.option("--json", "as_json", is_flag=True, help="Print the job as JSON.")
@click.pass_obj
def jobs_show(obj: Context, job_id: int, as_json: bool) -> None:
    """One job with its attempts, how it ended (an operator's resolution of a lost
    deployment: outcome, who, when, note) and its own audit trail, oldest first."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        job = reads.show_job(conn, job_id=job_id)
    if as_json:
        emit(job)
        return
    resolution = job["resolution"]
    if resolution is not None:
        decided = ("resolved", f"{resolution['outcome']} by {resolution['actor']} at "
                               f"{_when(resolution['at'])}" + (f": {resolution['note']}"
                                                              if resolution["note"] else ""))
    else:
        decided = ("last error", job["last_error"])
    fields([("job", job["id"]), ("state", job["state"]),
            ("project", f"{job['project']} (organization {job['organization']})"),
            ("pool", job["pool"]), ("target", job["target"]), ("command", " ".join(job["command"])),
            ("priority", job["priority"]), ("attempts", f"{len(job['attempts'])} of at most {job['max_attempts']}"),
            ("depends on", ", ".join(map(str, job["depends_on"])) or None),
            ("submitted by", job["submitted_by"]), ("created", _when(job["created_at"])),
            ("ready at", _when(job["ready_at"])), ("started", _when(job["started_at"])),
            ("finished", _when(job["finished_at"])), decided])
    if job["attempts"]:
        click.echo("")
        table(job["attempts"], [
            ("ATTEMPT", lambda a: str(a["attempt_no"])), ("STATE", lambda a: a["state"]),
            ("RUNNER", lambda a: a.get("runner_name") or str(a.get("runner_id", "-"))),
            ("CLAIMED", lambda a: _when(a["claimed_at"])), ("FINISHED", lambda a: _when(a["finished_at"])),
            ("TOOK", lambda a: _seconds((a["finished_at"] - a["claimed_at"]).total_seconds())
             if a["finished_at"] else "running"),
            ("EXIT", lambda a: "-" if a["exit_code"] is None else str(a["exit_code"])),
        ], empty="")
    click.echo("")
    click.echo("audit trail (oldest first):" if job["audit"] else "audit trail: none")
    if job["audit"]:
        _audit_table(job["audit"])


@jobs.command("list")
@click.option("--state", type=click.Choice(JOB_STATES), default=None, help="Only jobs in this state.")
@click.option("--organization", default=None, help="Only this organization's jobs.")
@click.option("--project", default=None, help="Only this project's jobs.")
@click.option("--pool", default=None, help="Only jobs for this pool.")
@click.option("--target", default=None, help="Only deployments to this target.")
@click.option("--runner", "runner_id", type=IntRange(1, MAX_BIGINT), default=None,
              help="Only jobs whose latest attempt ran on this runner id (with --state running: "
                   "the jobs it runs now).")
@click.option("--reason", default=None, metavar="CODE",
              help="Only waiting jobs with this reason code (any of their reasons: "
                   "approval_required, capacity_pool…; `jobs explain` names them), oldest first.")
@click.option("--older-than", "older_than", type=FiniteFloatRange(0), default=None,
              metavar="SECONDS", help="Only jobs created at least this long ago; the list is "
                                      "then in creation order (newest created first), --before "
                                      "and --after at their jobs' places in it.")
@click.option("--younger-than", "younger_than", type=FiniteFloatRange(0), default=None,
              metavar="SECONDS", help="Only jobs created less than this long ago.")
@click.option("--limit", type=IntRange(1, 500), default=20, show_default=True)
@click.option("--before", "--before-id", "before_id", type=IntRange(1, MAX_BIGINT), default=None,
              metavar="ID", help="Only jobs with a smaller id, newest first (the next page: the "
                                 "last id shown).")
@click.option("--after", "after_id", type=IntRange(0, MAX_BIGINT), default=None, metavar="ID",
              help="Only jobs with a larger id, oldest first (jobs submitted since ID; with "
                   "--reason, the next page). With --before: the jobs between the two, and "
                   "the next page keeps --before.")
@click.option("--json", "as_json", is_flag=True,
              help='Print the page as GET /api/v1/jobs answers it: {"jobs", "order", "next"}.')
@click.pass_obj
def jobs_list(obj: Context, state: str | None, organization: str | None, project: str | None,
              pool: str | None, target: str | None, runner_id: int | None, reason: str | None,
              older_than: float | None, younger_than: float | None, limit: int,
              before_id: int | None, after_id: int | None, as_json: bool) -> None:
    """Jobs, newest first, filtered: id, state, organization/project, pool, target, runner,
    age, running for (or how long it took) and command; with --reason, how long each has
    waited and since when. When more may match, the options of the next page (this page's
    filters and the cursors) are said on stderr (with --json too)."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        page = reads.list_jobs(conn, state=state, organization=organization, project=project,
                               pool=pool, target=target, runner_id=runner_id, reason=reason,
                               older_than_seconds=older_than, younger_than_seconds=younger_than,
                               before_id=before_id, after_id=after_id, limit=limit,
                               live_seconds=obj.settings.lease_seconds)
    if as_json:
        emit({k: page[k] for k in ("jobs", "order", "next")})
    else:
        now = page["now"]
        waited = [("WAITING", lambda j: _seconds((now - j["waiting_since"]).total_seconds())
                   if j.get("waiting_since") else "-"),
                  ("SINCE", lambda j: _when(j.get("waiting_since"))),
                  ("WHY", lambda j: ", ".join(r["code"] for r in j["reasons"]))]
        table(page["jobs"], JOB_COLUMNS + (waited if reason else []), empty="no jobs match" if any(
            v is not None for v in (state, organization, project, pool, target, runner_id, reason,
                                    older_than, younger_than)) else "no jobs")
    if page["next"]:
        # the whole next page: this page's filters (and limit, when not the default), then
        # the cursors, so that the line run as it stands lists the same jobs onward
        given = [("state", state), ("organization", organization), ("project", project),
                 ("pool", pool), ("target", target), ("runner", runner_id), ("reason", reason),
                 ("older-than", older_than), ("younger-than", younger_than),
                 ("limit", None if limit == 20 else limit)]
        given += [(name.removesuffix("_id"), value) for name, value in page["next"].items()]
        click.echo("more: " + " ".join(f"--{name} {value:g}" if isinstance(value, float)
                                       else f"--{name} {value}"
                                       for name, value in given if value is not None), err=True)


@jobs.command("search")
@click.argument("text")
@click.option("--project", default=None, help="Only this project's jobs.")
@click.option("--submitter", default=None, help="Only jobs submitted by this user or login.")
@click.option("--state", type=click.Choice(JOB_STATES), default=None, help="Only jobs in this state.")
@click.option("--limit", type=IntRange(1, 500), default=20, show_default=True)
@click.option("--before", "--before-id", "before_id", type=IntRange(1, MAX_BIGINT), default=None,
              metavar="ID", help="Only jobs with a smaller id (the next page: the last id shown).")
@click.option("--json", "as_json", is_flag=True,
              help='Print the page as GET /api/v1/jobs/search answers it: {"query", "job_id", '
                   '"jobs", "order", "next"}.')
@click.pass_obj
def jobs_search(obj: Context, text: str, project: str | None, submitter: str | None,
                state: str | None, limit: int, before_id: int | None, as_json: bool) -> None:
    """Find jobs by TEXT: #ID is that job; digits are the job with that id, then the jobs
    whose command contains them; other text (3 characters or more) the jobs whose command
    contains it, any case, newest first. When more may match, the next page's option is said
    on stderr (with --json too)."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        page = reads.search_jobs(conn, q=text, project=project, submitter=submitter, state=state,
                                 before_id=before_id, limit=limit)
    if as_json:
        emit({k: page[k] for k in ("query", "job_id", "jobs", "order", "next")})
    else:
        table(page["jobs"], JOB_COLUMNS + [("SUBMITTED BY", lambda j: j["submitted_by"])],
              empty=f"no job matches {_cut(page['query'], 60)!r}")
    if page["next"]:
        click.echo(f"more: --before {page['next']['before_id']}", err=True)


@jobs.command("explain")
@click.argument("job_id", type=WholeNumber())
@click.option("--json", "as_json", is_flag=True, help="Print the explanation as JSON.")
@click.pass_obj
def jobs_explain(obj: Context, job_id: int, as_json: bool) -> None:
    """Why a job is not running: every reason in precedence order, with numbers."""
    from pgdispatch.sql import explain

    with obj.connect() as conn:
        why = explain.explain_job(conn, job_id=job_id, live_seconds=obj.settings.lease_seconds)
    if as_json:
        emit(why)
        return
    if not why["reasons"]:
        click.echo(f"job {job_id} ({why['state']}): {why['message']}")
        return
    click.echo(f"job {job_id} ({why['state']}) waits for {len(why['reasons'])} reason"
               f"{'' if len(why['reasons']) == 1 else 's'}:")
    for i, r in enumerate(why["reasons"]):
        click.echo(f"  {r['code']}{' (primary)' if i == 0 else ''}: {r['message']}")


def _job_action(name: str, doc: str):
    @jobs.command(name, help=doc)
    @click.argument("job_id", type=WholeNumber())
    @click.option("--reason", default=None, help="Why (recorded in the audit log).")
    @click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
    @click.pass_obj
    def action(obj: Context, job_id: int, reason: str | None, as_json: bool) -> None:
        from pgdispatch.sql import transitions

        fn = getattr(transitions, f"{name}_job")
        with obj.connect() as conn:
            result = fn(conn, job_id=job_id, reason=reason, actor=None)
        emit(result) if as_json else click.echo(f"job {job_id}: {result['state']}")
    return action


_job_action("approve", "Approve a job that requires approval (audited).")
_job_action("cancel", "Cancel a waiting job, or stop a running one (audited).")
_job_action("retry", "Queue a failed or cancelled job again (audited).")


@jobs.command("set-priority")
@click.argument("job_id", type=WholeNumber())
@click.option("--priority", type=WholeNumber(), required=True,
              help="-1000..1000; higher first, within the project.")
@click.option("--reason", default=None, help="Why (recorded in the audit log).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def jobs_set_priority(obj: Context, job_id: int, priority: int, reason: str | None,
                      as_json: bool) -> None:
    """Set the priority of a waiting (blocked or queued) job (audited)."""
    from pgdispatch.sql import transitions

    with obj.connect() as conn:
        result = transitions.set_priority(conn, job_id=job_id, priority=priority, reason=reason,
                                          actor=None)
    emit(result) if as_json else click.echo(
        f"job {job_id}: priority {result['previous_priority']} -> {result['priority']}")


# the past tense of each bulk action, for its report
_BULK_DONE = {"cancel": "cancelled", "retry": "retried", "approve": "approved",
              "reprioritize": "reprioritized"}
BULK_SHOWN = 50  # rows of a preview, and skipped jobs, printed (--json has every one)


@jobs.command("bulk")
@click.argument("action", type=click.Choice(["cancel", "retry", "approve", "reprioritize"]))
@click.option("--state", type=click.Choice(JOB_STATES), default=None,
              help="Only jobs in this state (of those the action takes).")
@click.option("--organization", default=None, help="Only this organization's jobs.")
@click.option("--project", default=None, help="Only this project's jobs.")
@click.option("--pool", default=None, help="Only jobs for this pool.")
@click.option("--target", default=None, help="Only deployments to this target.")
@click.option("--runner", "runner_id", type=IntRange(1, MAX_BIGINT), default=None,
              help="Only jobs whose latest attempt ran on this runner id.")
@click.option("--reason-code", "reason_code", default=None, metavar="CODE",
              help="Only waiting jobs with this reason among theirs (approval_required, "
                   "target_held…; `jobs explain` names them).")
@click.option("--older-than", "older_than", type=FiniteFloatRange(0), default=None,
              metavar="SECONDS", help="Only jobs created at least this long ago.")
@click.option("--younger-than", "younger_than", type=FiniteFloatRange(0), default=None,
              metavar="SECONDS", help="Only jobs created less than this long ago.")
@click.option("--priority", type=WholeNumber(), default=None,
              help="reprioritize: the new priority (-1000..1000).")
@click.option("--reason", default=None, help="Why (recorded in the audit log).")
@click.option("--yes", is_flag=True, help="Apply it; without --yes only the preview is shown.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"preview", "result"} as POST /api/v1/jobs/bulk answers it.')
@click.pass_obj
def jobs_bulk(obj: Context, action: str, state: str | None, organization: str | None,
              project: str | None, pool: str | None, target: str | None, runner_id: int | None,
              reason_code: str | None, older_than: float | None, younger_than: float | None,
              priority: int | None, reason: str | None, yes: bool, as_json: bool) -> None:
    """Cancel, retry, approve or reprioritize every job a filter selects (at most 10,000,
    first by id). Without --yes: the jobs it would take, and nothing changes. With --yes:
    applied in batches of 100 (each its own transaction, in id order); a job that changed
    since the preview is skipped with why. A bulk cancel takes waiting jobs only."""
    from pgdispatch.sql import bulk

    filters = {"state": state, "organization": organization, "project": project, "pool": pool,
               "target": target, "runner_id": runner_id, "reason": reason_code,
               "older_than_seconds": older_than, "younger_than_seconds": younger_than}
    with obj.connect() as conn:
        run = bulk.run_bulk(conn, action=action, filters=filters, priority=priority,
                            reason=reason, actor=None, dry_run=not yes,
                            live_seconds=obj.settings.lease_seconds)
    preview, result = run["preview"], run["result"]
    if as_json:
        emit({"dry_run": not yes, "action": action,
              "preview": {k: v for k, v in preview.items() if k != "now"}, "result": result})
        return
    said = " ".join(f"{k.removesuffix('_seconds').replace('_', '-')}={v}"
                    for k, v in preview["filter"].items())
    n = preview["count"]
    if not n:
        click.echo(f"no jobs to {action}" + (f" (filter: {said})" if said else "")
                   + f"; {action} takes jobs that are {' or '.join(bulk.ACTION_STATES[action])}")
        return
    to = f" to priority {priority}" if action == "reprioritize" else ""
    if result is None:
        click.echo(f"this will {action} {n} job{'s' if n != 1 else ''}{to}"
                   + (f" (filter: {said})" if said else " (no filter: every one it takes)") + ":")
        table(preview["jobs"][:BULK_SHOWN], [
            ("ID", lambda j: str(j["id"])), ("STATE", lambda j: j["state"]),
            ("PROJECT", lambda j: f"{j['organization']}/{j['project']}"),
            ("TARGET", lambda j: j["target"] or "-"), ("PRI", lambda j: str(j["priority"])),
            ("REASON", lambda j: j["reason"] or _cut(j["message"], 30) or "-"),
            ("COMMAND", lambda j: _cut(" ".join(j["command"]), 50))], empty="no jobs")
        if n > BULK_SHOWN:
            click.echo(f"... and {n - BULK_SHOWN} more (--json lists every one)")
        if preview["truncated"]:
            click.echo(f"the filter matched more than {n}: these are the first {n} by id")
        click.echo(f"nothing changed; run it again with --yes to {action} them")
        return
    done, skipped = result["done"], result["skipped"]
    click.echo(f"{_BULK_DONE[action]} {len(done)} of {result['requested']} jobs{to}, skipped "
               f"{len(skipped)} (audit event {result['bulk_event_id']})")
    for s in skipped[:BULK_SHOWN]:
        click.echo(f"  skipped job {s['job_id']}: {_cut(s['why'], 120)}")
    if len(skipped) > BULK_SHOWN:
        click.echo(f"  ... and {len(skipped) - BULK_SHOWN} more skipped (--json lists every one)")
    if preview["truncated"]:
        click.echo(f"the filter matched more than {result['requested']}: run it again for the rest")


# --- projects and targets ---------------------------------------------------------------

@cli.group()
def projects() -> None:
    """Projects: list, show, pause and resume."""


@projects.command("pause")
@click.argument("name")
@click.option("--reason", required=True, help="Why (shown to operators, audited).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def projects_pause(obj: Context, name: str, reason: str, as_json: bool) -> None:
    """Pause a project: its queued jobs wait with reason project_paused."""
    from pgdispatch.sql import transitions

    with obj.connect() as conn:
        result = transitions.pause_project(conn, project=name, reason=reason,
                                            actor=None)
    emit(result) if as_json else click.echo(f"project {name} paused")


@projects.command("resume")
@click.argument("name")
@click.option("--reason", default=None, help="Why (audited).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def projects_resume(obj: Context, name: str, reason: str | None, as_json: bool) -> None:
    """Resume a paused project."""
    from pgdispatch.sql import transitions

    with obj.connect() as conn:
        result = transitions.resume_project(conn, project=name, reason=reason,
                                            actor=None)
    emit(result) if as_json else click.echo(f"project {name} resumed")


@cli.group()
def targets() -> None:
    """Deployment targets: list, show, resolve."""


@targets.command("resolve")
@click.argument("name")
@click.option("--outcome", required=True, type=click.Choice(["succeeded", "failed", "retry"]),
              help="The lost deployment happened (succeeded), did not (failed), or run it again (retry).")
@click.option("--note", required=True, help="What you checked (mandatory, audited).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def targets_resolve(obj: Context, name: str, outcome: str, note: str, as_json: bool) -> None:
    """Resolve an uncertain target."""
    from pgdispatch.sql import transitions

    with obj.connect() as conn:
        result = transitions.resolve_target(conn, target=name, outcome=outcome, note=note,
                                            actor=None)
    emit(result) if as_json else click.echo(
        f"target {name} resolved ({outcome}); job {result['job_id']} is {result['job_state']}")


# --- looking: projects, pools, targets, runners, audit ---------------------------------

def _json_option(what: str):
    return click.option("--json", "as_json", is_flag=True, help=f"Print the {what} as JSON "
                                                             "(a list: as the API answers it).")


def _running_table(jobs_: list[dict[str, Any]]) -> None:
    click.echo("")
    click.echo("running jobs (the holders of its capacity):" if jobs_ else "running jobs: none")
    if jobs_:
        table(jobs_, [c for c in JOB_COLUMNS if c[0] not in ("STATE", "TARGET")], empty="")


def _audit_table(events: list[dict[str, Any]], *, empty: str = "no audit events") -> None:
    table(events, [("ID", lambda e: str(e["id"])), ("AT", lambda e: _when(e["at"])),
                   ("ACTOR", lambda e: e["actor"]), ("ACTION", lambda e: e["action"]),
                   ("SUBJECT", lambda e: e["subject"]), ("WHY", lambda e: _cut(e["reason"], 60))],
          empty=empty)


def _paused(p: dict[str, Any]) -> str:
    if not p["paused_at"]:
        return "no"
    return f"since {_when(p['paused_at'])} by {p.get('paused_by') or '?'}: {p['pause_reason']}"


@projects.command("list")
@_json_option("projects")
@click.pass_obj
def projects_list(obj: Context, as_json: bool) -> None:
    """Every project: organization, running (of its own bound), weight, pools, paused."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        rows = reads.list_projects(conn)
    if as_json:
        emit({"projects": rows})
        return
    table(rows, [("PROJECT", lambda p: p["name"]), ("ORGANIZATION", lambda p: p["organization"]),
                 ("RUNNING", lambda p: f"{p['running']}" + (f" of {p['max_running']}"
                                                           if p["max_running"] is not None else "")),
                 ("WEIGHT", lambda p: str(p["weight"])), ("POOLS", lambda p: ",".join(p["pools"]) or "-"),
                 ("PAUSED", lambda p: _cut(_paused(p), 60))], empty="no projects")


@projects.command("show")
@click.argument("name")
@_json_option("project")
@click.pass_obj
def projects_show(obj: Context, name: str, as_json: bool) -> None:
    """One project: limits, pause, pools, the jobs running for it, its last audit events."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        p = reads.show_project(conn, name=name)
    if as_json:
        emit(p)
        return
    fields([("project", p["name"]), ("organization", p["organization"]),
            ("running", f"{p['running']} of {p['max_running']}" if p["max_running"] is not None
             else f"{p['running']} (no bound of its own)"),
            ("weight", p["weight"]), ("pools", ", ".join(p["pools"]) or None), ("paused", _paused(p))])
    _running_table(p["running_jobs"])
    click.echo("")
    _audit_table(p["audit"])


@targets.command("list")
@_json_option("targets")
@click.pass_obj
def targets_list(obj: Context, as_json: bool) -> None:
    """Every target, uncertain first: state, the job holding it and since when, approval."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        rows = reads.list_targets(conn)
    if as_json:
        emit({"targets": rows})
        return
    table(rows, [("TARGET", lambda t: t["name"]), ("STATE", lambda t: t["state"]),
                 ("HELD BY JOB", lambda t: str(t["holder_job_id"] or "-")),
                 ("PROJECT", lambda t: t["holder_project"] or "-"),
                 ("SINCE", lambda t: _when(t["held_since"])),
                 ("APPROVAL", lambda t: f"by {t['approver_role']}" if t["requires_approval"] else "-")],
          empty="no targets")


@targets.command("show")
@click.argument("name")
@_json_option("target")
@click.pass_obj
def targets_show(obj: Context, name: str, as_json: bool) -> None:
    """One target: state, holder, the evidence of its last attempt, what runs next in its
    deployment order (each with its reason), what was superseded, its last audit events."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        t = reads.show_target(conn, name=name)
    if as_json:
        emit(t)
        return
    fields([("target", t["name"]), ("state", t["state"]),
            ("held by job", t["holder_job_id"]), ("project", t["holder_project"]),
            ("held since", _when(t["held_since"]) if t["held_since"] else None),
            ("approval", f"required, by {t['approver_role']}" if t["requires_approval"] else "not required"),
            ("last attempt", f"{t['attempt_id']} ({t['attempt_state']}) on {t['runner_name']}"
             if t["attempt_id"] else None),
            ("last heartbeat", _when(t["last_heartbeat_at"]) if t["last_heartbeat_at"] else None),
            ("deploy order", t["deploy_order"].replace("_", " ")),
            ("supersede", "every project's older waiting deployments" if t["supersede"] else
             (f"for {', '.join(t['supersede_projects'])}" if t["supersede_projects"] else "no")),
            ("superseded", f"{t['superseded']['total']} ({t['superseded']['last_hour']} in the last hour)")])
    if t["state"] == "uncertain":
        click.echo(f"\nresolve it: pgdispatch targets resolve {t['name']} --outcome "
                   "succeeded|failed|retry --note '…'")
    nxt = t["next"]
    shown = len(nxt["jobs"])
    click.echo(f"\nnext, {nxt['deploy_order'].replace('_', ' ')} ({nxt['waiting']} waiting"
               f"{f', the first {shown} shown' if nxt['waiting'] > shown else ''}):")
    table([{**j, "n": i} for i, j in enumerate(nxt["jobs"], 1)],
          [("#", lambda j: str(j["n"])), ("JOB", lambda j: str(j["job_id"]) + (" (next)" if j["is_head"] else "")),
           ("PROJECT", lambda j: j["project"]), ("STATE", lambda j: j["state"]),
           ("PRIORITY", lambda j: str(j["priority"])), ("REASON", lambda j: j["reason"]),
           ("WHY", lambda j: _cut(j["message"], 80))],
          empty="no deployment waiting")
    if t["superseded"]["latest"]:
        click.echo("\nsuperseded (latest):")
        table(t["superseded"]["latest"],
              [("JOB", lambda s: str(s["job_id"])), ("PROJECT", lambda s: s["project"]),
               ("BY JOB", lambda s: str(s["superseded_by"] or "-")), ("AT", lambda s: _when(s["at"]))],
              empty="")
    click.echo("")
    _audit_table(t["audit"])


@cli.group()
def pools() -> None:
    """Runner pools: list, show, pause and resume."""


@pools.command("list")
@_json_option("pools")
@click.pass_obj
def pools_list(obj: Context, as_json: bool) -> None:
    """Every pool: pool slots (its limit) held, and the runner slots its live runners give."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        rows = reads.list_pools(conn, live_seconds=obj.settings.lease_seconds)
    if as_json:
        emit({"pools": rows})
        return
    table(rows, [("POOL", lambda q: q["name"]),
                 ("POOL SLOTS", lambda q: f"{q['running']} of {q['slots']} taken"),
                 ("RUNNER SLOTS", lambda q: f"{q['runner_slots'] - q['free_runner_slots']} of "
                                            f"{q['runner_slots']} busy" if q["runner_slots"]
                  else "no live runner"),
                 ("PAUSED", lambda q: _cut(_paused(q), 60))], empty="no pools")


@pools.command("show")
@click.argument("name")
@_json_option("pool")
@click.pass_obj
def pools_show(obj: Context, name: str, as_json: bool) -> None:
    """One pool: its slots, its live runners, the jobs running on it."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        q = reads.show_pool(conn, name=name, live_seconds=obj.settings.lease_seconds)
    if as_json:
        emit(q)
        return
    fields([("pool", q["name"]), ("pool slots", f"{q['running']} of {q['slots']} taken"),
            ("runner slots", f"{q['runner_slots'] - q['free_runner_slots']} of {q['runner_slots']} busy, "
                             f"on {len(q['runners'])} live runner(s)" if q["runner_slots"]
             else "no live runner serves it"), ("paused", _paused(q))])
    if q["runners"]:
        click.echo("")
        _runners_table(q["runners"])
    _running_table(q["running_jobs"])


@pools.command("pause")
@click.argument("name")
@click.option("--reason", required=True, help="Why (shown to operators, audited).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def pools_pause(obj: Context, name: str, reason: str, as_json: bool) -> None:
    """Pause a pool: no claim takes from it (running jobs go on); its jobs wait with reason
    pool_paused."""
    from pgdispatch.sql import transitions

    with obj.connect() as conn:
        result = transitions.pause_pool(conn, pool=name, reason=reason, actor=None)
    emit(result) if as_json else click.echo(f"pool {name} paused")


@pools.command("resume")
@click.argument("name")
@click.option("--reason", default=None, help="Why (audited).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def pools_resume(obj: Context, name: str, reason: str | None, as_json: bool) -> None:
    """Resume a paused pool."""
    from pgdispatch.sql import transitions

    with obj.connect() as conn:
        result = transitions.resume_pool(conn, pool=name, reason=reason, actor=None)
    emit(result) if as_json else click.echo(f"pool {name} resumed")


@cli.group()
def runners() -> None:
    """Scheduler processes (runners): list, show, drain and resume."""


@runners.command("drain")
@click.argument("runner_id", type=IntRange(1, MAX_BIGINT))
@click.option("--deadline", "deadline_seconds", type=IntRange(0, 604800), default=None,
              metavar="SECONDS",
              help="After this long its running builds are handed back (re-queued, no failure "
                   "counted) to run elsewhere; deployments are never cut. Default: none.")
@click.option("--reason", required=True, help="Why (shown to operators, audited).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def runners_drain(obj: Context, runner_id: int, deadline_seconds: int | None, reason: str,
                  as_json: bool) -> None:
    """Drain a runner: it takes nothing new and finishes what it runs (its scheduler learns
    it on its next beat), then shows drained."""
    from pgdispatch.sql import transitions

    with obj.connect() as conn:
        result = transitions.drain_runner(conn, runner_id=runner_id, reason=reason, actor=None,
                                          deadline_seconds=deadline_seconds)
    if as_json:
        emit(result)
        return
    click.echo(f"runner {runner_id} draining: it takes no new jobs and shows drained once what "
               "it runs has finished" + (
        f"; its builds are handed back after {deadline_seconds} s" if deadline_seconds is not None
        else ""))


@runners.command("resume")
@click.argument("runner_id", type=IntRange(1, MAX_BIGINT))
@click.option("--reason", default=None, help="Why (audited).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def runners_resume(obj: Context, runner_id: int, reason: str | None, as_json: bool) -> None:
    """Resume a drained runner: it claims again."""
    from pgdispatch.sql import transitions

    with obj.connect() as conn:
        result = transitions.resume_runner(conn, runner_id=runner_id, reason=reason, actor=None)
    emit(result) if as_json else click.echo(f"runner {runner_id} resumed")


def _runner_state(r: dict[str, Any]) -> str:
    if r["stopped_at"]:
        return r.get("stop_reason") or "stopped"
    if not r["is_live"]:
        return "silent" + (f", {r['drain_state']}" if r.get("drain_state") else "")
    if r["draining"]:
        return "draining"
    return r.get("drain_state") or "live"


def _drain(r: dict[str, Any]) -> str | None:
    if not r.get("drain_requested_at"):
        return None
    deadline = (f"; builds handed back at {_when(r['drain_deadline'])}" if r["drain_deadline"]
                else "; no deadline")
    return (f"{r['drain_state']}: by {r['drain_requested_by']} at {_when(r['drain_requested_at'])}: "
            f"{r['drain_reason']}{deadline}")


def _runners_table(rows: list[dict[str, Any]]) -> None:
    table(rows, [("ID", lambda r: str(r["id"])), ("NAME", lambda r: r["name"]),
                 ("HOST", lambda r: f"{r['hostname']}:{r['pid']}" if r["pid"] else r["hostname"] or "-"),
                 ("STATE", _runner_state), ("POOLS", lambda r: ",".join(r["pools"])),
                 ("SLOTS", lambda r: f"{r['slots_used']} of {r['slots']} busy"),
                 ("LAST BEAT", lambda r: _when(r["last_heartbeat_at"]))], empty="no runners")


@runners.command("list")
@_json_option("runners")
@click.pass_obj
def runners_list(obj: Context, as_json: bool) -> None:
    """Runners seen or stopped within the hour: state, pools, runner slots busy, last beat."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        rows = reads.list_runners(conn, live_seconds=obj.settings.lease_seconds)
    if as_json:
        emit({"runners": rows})
        return
    _runners_table(rows)


@runners.command("show")
@click.argument("runner_id", type=IntRange(1, MAX_BIGINT))
@_json_option("runner")
@click.pass_obj
def runners_show(obj: Context, runner_id: int, as_json: bool) -> None:
    """One runner (of any age): its pools and grants, its slots, the jobs it runs now."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        r = reads.show_runner(conn, runner_id=runner_id, live_seconds=obj.settings.lease_seconds)
    if as_json:
        emit(r)
        return
    fields([("runner", f"{r['id']} {r['name']}"), ("state", _runner_state(r)),
            ("host", f"{r['hostname']} pid {r['pid']}"), ("login", r["login"]),
            ("pools", ", ".join(r["pools"])),
            ("granted pools", "every pool (an unbound login)" if r["is_unbound"]
             else ", ".join(r["granted_pools"]) or "none"),
            ("runner slots", f"{r['slots_used']} of {r['slots']} busy"),
            ("started", _when(r["started_at"])), ("last beat", _when(r["last_heartbeat_at"])),
            ("stopped", _when(r["stopped_at"]) if r["stopped_at"] else None),
            ("drain", _drain(r))])
    _running_table(r["running_jobs"])


@cli.group()
def audit() -> None:
    """The audit log."""


@audit.command("list")
@click.option("--actor", default=None, help="Only this actor's events.")
@click.option("--action", default=None, help="Only this action (pause_project, resolve_target…).")
@click.option("--subject", default=None,
              help="Only subjects starting with this (project:web, job:42, target:…).")
@click.option("--job", "job_id", type=IntRange(1, MAX_BIGINT), default=None, metavar="ID",
              help="Only job ID's own trail: every action on it, and the target resolutions "
                   "that decided it.")
@click.option("--limit", type=IntRange(1, 500), default=20, show_default=True)
@click.option("--before", "before_id", type=IntRange(1, MAX_BIGINT), default=None, metavar="ID",
              help="Only events with a smaller id (the next page: the last id shown).")
@click.option("--json", "as_json", is_flag=True,
              help='Print the page as GET /api/v1/audit answers it: {"events", "next"}.')
@click.pass_obj
def audit_list(obj: Context, actor: str | None, action: str | None, subject: str | None,
               job_id: int | None, limit: int, before_id: int | None, as_json: bool) -> None:
    """Audit events, newest first: who did what to which subject, when and why. When more
    may match, the option for the next page is said on stderr (with --json too). A --job
    that does not exist exits 2."""
    from pgdispatch.sql import audit as audit_log
    from pgdispatch.sql.errors import UnknownFilter

    with obj.connect() as conn:
        if job_id is not None and not audit_log.job_exists(conn, job_id=job_id):
            raise UnknownFilter(f"unknown job {job_id}")
        events = audit_log.list_audit_events(conn, before_id=before_id or MAX_BIGINT, limit=limit,
                                             actor=actor, action=action, subject=subject,
                                             job_id=job_id)
    following = {"before_id": events[-1]["id"]} if len(events) == limit else None
    if as_json:
        emit({"events": events, "next": following})
    else:
        _audit_table(events, empty="no audit events match" if (actor or action or subject or job_id)
                     else "no audit events")
    if following:
        click.echo(f"more: --before {following['before_id']}", err=True)


# --- the overview -----------------------------------------------------------------------

@cli.command("overview")
@click.option("--json", "as_json", is_flag=True,
              help="Print it as GET /api/v1/overview answers it.")
@click.pass_obj
def overview_cmd(obj: Context, as_json: bool) -> None:
    """What the console's overview says: how many jobs wait and why (every reason, and the
    primary one), the oldest waiting job per pool and primary reason (how long, since when),
    the capacity of organizations, projects and pools (pool slots and runner slots), the
    uncertain targets, the paused projects and the paused pools (when any)."""
    from pgdispatch.sql import reads

    with obj.connect() as conn:
        o = reads.overview_report(conn, live_seconds=obj.settings.lease_seconds)
    if as_json:
        emit(o)
        return
    age = o["summary_age_seconds"]
    click.echo(f"waiting: {o['waiting']} job(s)" + (
        f" (queue summary refreshed {_seconds(age)} ago)" if age is not None
        else " (no summary yet: is a scheduler running?)"))
    counted = [c for c in o["reason_counts"] if o["reason_counts"][c] or o["primary_counts"][c]]
    if counted:
        click.echo("")
        table([{"code": c} for c in counted], [
            ("REASON", lambda r: r["code"]),
            ("WAITING (ANY REASON)", lambda r: str(o["reason_counts"][r["code"]])),
            ("PRIMARY", lambda r: str(o["primary_counts"][r["code"]]))], empty="")
    click.echo("")
    click.echo("oldest waiting (per pool and primary reason):" if o["oldest_waiting"]
               else "oldest waiting: none waits")
    if o["oldest_waiting"]:
        table(o["oldest_waiting"], [("POOL", lambda w: w["pool"]), ("REASON", lambda w: w["reason"]),
                                    ("WAITING", lambda w: _seconds(w["seconds"])),
                                    ("SINCE", lambda w: _when(w["since"]))], empty="")
    click.echo("")
    table(o["organizations"], [("ORGANIZATION", lambda r: r["name"]),
                               ("RUNNING", lambda r: f"{r['running']} of {r['max_running']}"
                                if r["max_running"] is not None else f"{r['running']} (no bound)")],
          empty="no organizations")
    click.echo("")
    table(o["projects"], [("PROJECT", lambda p: p["name"]), ("ORGANIZATION", lambda p: p["organization"]),
                          ("RUNNING", lambda p: f"{p['running']} of {p['max_running']}"
                           if p["max_running"] is not None else f"{p['running']} (no bound)"),
                          ("PAUSED", lambda p: "yes" if p["paused"] else "no")], empty="no projects")
    click.echo("")
    table(o["pools"], [("POOL", lambda q: q["name"]),
                       ("POOL SLOTS", lambda q: f"{q['running']} of {q['slots']} taken"),
                       ("RUNNER SLOTS", lambda q: f"{q['runner_slots'] - q['free_runner_slots']} of "
                                                  f"{q['runner_slots']} busy" if q["runner_slots"]
                        else "no live runner"),
                       ("LIVE RUNNERS", lambda q: str(q["live_runners"])),
                       ("WAITING", lambda q: str(q["waiting"]))], empty="no pools")
    click.echo("")
    if o["uncertain_targets"]:
        click.echo("uncertain targets (resolve: pgdispatch targets resolve NAME …):")
        table(o["uncertain_targets"], [("TARGET", lambda t: t["name"]),
                                       ("JOB", lambda t: str(t["holder_job_id"] or "-")),
                                       ("PROJECT", lambda t: t["holder_project"] or "-"),
                                       ("SINCE", lambda t: _when(t["held_since"]))], empty="")
    else:
        click.echo("uncertain targets: none")
    click.echo("")
    if o["paused_projects"]:
        click.echo("paused projects:")
        table(o["paused_projects"], [("PROJECT", lambda p: p["name"]),
                                     ("BY", lambda p: p["paused_by"] or "?"),
                                     ("SINCE", lambda p: _when(p["paused_at"])),
                                     ("WHY", lambda p: _cut(p["pause_reason"], 60))], empty="")
    else:
        click.echo("paused projects: none")
    if o.get("paused_pools"):
        click.echo("")
        click.echo("paused pools:")
        table(o["paused_pools"], [("POOL", lambda q: q["name"]),
                                  ("BY", lambda q: q["paused_by"] or "?"),
                                  ("SINCE", lambda q: _when(q["paused_at"])),
                                  ("WHY", lambda q: _cut(q["pause_reason"], 60))], empty="")


@cli.group()
def tokens() -> None:
    """API bearer tokens."""


@tokens.command("create")
@click.option("--user", "username", required=True, help="Existing username the token acts as.")
@click.option("--name", default="api", show_default=True, help="A label for the token.")
@click.option("--expires-in", "expires_in", type=IntRange(1, 10 * 366 * 86400), default=None,
              help="Seconds until the token stops authenticating (default: never).")
@click.option("--expires-at", "expires_at", default=None,
              help="When the token stops authenticating: an ISO 8601 time with its offset "
                   "(2025-07-01T00:00:00+00:00).")
@click.option("--reason", default=None, help="Why (recorded in the audit log).")
@click.pass_obj
def tokens_create(obj: Context, username: str, name: str, expires_in: int | None,
                  expires_at: str | None, reason: str | None) -> None:
    """Create an API token; it is printed once and stored only as a hash. Your database
    login must be an admin's (pgdispatch_admin). Audited as ``create_api_token`` (its id,
    label and expiry, never the token), as from the console."""
    from pgdispatch.sql import accounts

    with obj.connect() as conn:
        issued = accounts.issue_api_token(conn, username=username, name=name, actor=None,
                                          reason=reason,
                                          expires_at=_expiry(expires_in, expires_at))
    click.echo(issued["token"])


def _expiry(expires_in: int | None, expires_at: str | None) -> dt.datetime | None:
    if expires_in is not None and expires_at is not None:
        raise InvalidInput("give --expires-in or --expires-at, not both")
    if expires_in is not None:
        return dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=expires_in)
    if expires_at is None:
        return None
    try:
        when = dt.datetime.fromisoformat(expires_at)
    except ValueError:
        raise InvalidInput(f"--expires-at must be an ISO 8601 time, got {expires_at!r}") from None
    if when.tzinfo is None:
        raise InvalidInput("--expires-at needs its UTC offset (…+00:00), else the time is ambiguous")
    return when


@tokens.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the tokens as JSON.")
@click.pass_obj
def tokens_list(obj: Context, as_json: bool) -> None:
    """Every API token: id, user, label, state (live, expired, revoked), expiry and last use
    (never the token or its hash)."""
    from pgdispatch.sql import accounts

    with obj.connect() as conn:
        rows = accounts.list_api_tokens(conn)
    if as_json:
        emit(rows)
        return
    for t in rows:
        state = "revoked" if t["revoked_at"] else "live" if t["is_live"] else "expired"
        expires = t["expires_at"].isoformat(timespec="seconds") if t["expires_at"] else "never"
        used = t["last_used_at"].isoformat(timespec="seconds") if t["last_used_at"] else "never"
        click.echo(f"{t['id']:>6}  {state:<8} {t['username']:<20} {t['name']:<20} "
                   f"expires {expires}  last used {used}")


@tokens.command("revoke")
@click.argument("token_id", type=IntRange(1, 2**63 - 1))
@click.option("--reason", default=None, help="Why (recorded in the audit log).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def tokens_revoke(obj: Context, token_id: int, reason: str | None, as_json: bool) -> None:
    """Revoke an API token: from the next request on it authenticates nothing. Your database
    login must be an admin's. Audited."""
    from pgdispatch.sql import accounts

    with obj.connect() as conn:
        result = accounts.revoke_api_token(conn, token_id=token_id, actor=None, reason=reason)
    emit(result) if as_json else click.echo(
        f"token {result['token_id']} of {result['username']} revoked")


# --- processes --------------------------------------------------------------------------

@cli.command("expire")
@click.option("--json", "as_json", is_flag=True, help="Print what expired as JSON.")
@click.pass_obj
def expire_cmd(obj: Context, as_json: bool) -> None:
    """Run one lease-expiry pass."""
    from pgdispatch.sql import transitions

    s = obj.settings
    with obj.connect() as conn:
        done = transitions.expire_leases(conn, backoff_base_seconds=s.backoff_base_seconds,
                                         backoff_cap_seconds=s.backoff_cap_seconds)
    emit(done) if as_json else click.echo(f"expired {len(done)} lease(s)")


@cli.command("scheduler")
@click.option("--pool", "pools", multiple=True, required=True, help="Pool to serve (repeatable).")
@click.option("--slots", type=IntRange(1, 10000), required=True, help="Jobs run at once.")
@click.option("--name", default=None, help="Runner name (default host:pid).")
@click.option("--grace-seconds", type=FiniteFloatRange(0, 86400), default=30.0, show_default=True,
              help="On SIGTERM, how long running jobs may finish before being handed back.")
@click.option("--max-batch", type=IntRange(1, MAX_BATCH_LIMIT), default=10, show_default=True,
              envvar="PGDISPATCH_MAX_BATCH",
              help="Most builds claimed, and most outcomes reported, in one transaction "
                   "(1: one job per transaction). Env: PGDISPATCH_MAX_BATCH.")
@click.option("--listen/--no-listen", default=True, show_default=True, envvar="PGDISPATCH_LISTEN",
              help="Also wake on NOTIFY when a job of these pools becomes claimable (polling "
                   "stays). Env: PGDISPATCH_LISTEN.")
@click.option("--listen-url", default=None, envvar="PGDISPATCH_LISTEN_URL",
              help="Database URL of the wake-up listener only: a session route (direct to "
                   "PostgreSQL, or a PgBouncer database in pool_mode session) when "
                   "DATABASE_URL goes through transaction pooling. Without it, a scheduler "
                   "whose DATABASE_URL goes through a pooler does not listen and polls. "
                   "Env: PGDISPATCH_LISTEN_URL.")
@click.option("--run-as", "run_as", default=None, metavar="USER",
              help="Run jobs as unprivileged OS users (the scheduler must be root): with "
                   "{slot} (pgdispatch-job-{slot}) one user per slot, so no two running jobs "
                   "share a uid; a plain name is shared by every slot (weaker). A fresh "
                   "working directory, no credential of the scheduler, and whatever a job "
                   "leaves running of its uid killed when it ends. Env: PGDISPATCH_RUN_AS.")
@click.option("--metrics-port", type=IntRange(0, 65535), default=None,
              envvar="PGDISPATCH_METRICS_PORT",
              help="Serve this process's Prometheus metrics on this port (0: any free port, "
                   "logged). Default: off. Env: PGDISPATCH_METRICS_PORT.")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True,
              envvar="PGDISPATCH_METRICS_ADDR",
              help="Address for --metrics-port (0.0.0.0 for a remote Prometheus). "
                   "Env: PGDISPATCH_METRICS_ADDR.")
@click.pass_obj
def scheduler_cmd(obj: Context, pools: tuple[str, ...], slots: int, name: str | None,
                  grace_seconds: float, max_batch: int, listen: bool, listen_url: str | None,
                  run_as: str | None, metrics_port: int | None, metrics_addr: str) -> None:
    """Run a scheduler process until SIGTERM/SIGINT."""
    logging.getLogger().setLevel(logging.INFO)
    from pgdispatch.scheduler import main as scheduler_main
    from pgdispatch.scheduler import sandbox as sandboxes
    from pgdispatch.sql.db import has_password

    if listen_url and has_password(listen_url) and click.get_current_context(
            ).get_parameter_source("listen_url") == click.core.ParameterSource.COMMANDLINE:
        # every local user, a job included, reads /proc/<pid>/cmdline
        raise InvalidInput("--listen-url: a password on the command line is readable by every "
                           "local user; pass the URL in PGDISPATCH_LISTEN_URL, or the password "
                           "in a passfile")
    if listen_url:
        from pgdispatch.sql.scheduling import check_listen_url

        check_listen_url(listen_url)  # bad input first: one line, before any warning
    # before the database is touched: a user it cannot run jobs as changes nothing
    settings = obj.settings.with_overrides(run_as=run_as)
    sandbox = sandboxes.from_settings(settings, slots=slots)

    watch = None
    if metrics_port is not None:
        from pgdispatch.scheduler.metrics import Exporter

        # listen before registering the runner: a port in use fails having changed nothing
        watch = Exporter(port=metrics_port, addr=metrics_addr).watch
    from pgdispatch.sql import logins

    url = obj.url_as(logins.runner_login(name), "scheduler")
    if not obj.settings.database_url:
        added = logins.grant_pools(obj.server_url, logins.runner_login(name), list(pools))
        if added:
            logging.getLogger("pgdispatch.cli").info(
                "embedded server: runner login %s granted pools %s", logins.runner_login(name),
                ", ".join(added))
    code = scheduler_main.run(settings, database_url=url,
                              pools=list(pools), slots=slots,
                              name=name, grace_seconds=grace_seconds, max_batch=max_batch,
                              listen=listen, listen_url=listen_url or None, watch=watch,
                              sandbox=sandbox)
    sys.exit(code)


@cli.command("web")
@click.option("--bind", default=None, help="HOST:PORT (default PGDISPATCH_BIND or 127.0.0.1:8000).")
@click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True)
@click.pass_obj
def web_cmd(obj: Context, bind: str | None, workers: int) -> None:
    """Serve the console and the JSON API under gunicorn."""
    settings = obj.settings.with_overrides(bind=bind)
    _check_bind(settings.bind)
    logging.getLogger().setLevel(logging.INFO)
    metrics_dir = _web_metrics_dir()
    arbiter = os.getpid()
    try:
        from pgdispatch.sql import logins
        from pgdispatch.webapp import serve
        # the embedded server: the console's own login (pgdispatch_web: reads without secrets,
        # the operator and account transitions; sign-in is a function, sql/functions/accounts.sql)
        serve.serve(settings, database_url=obj.url_as(logins.WEB, "web"), bind=settings.bind,
                    workers=workers)
    finally:
        if os.getpid() == arbiter:  # a worker leaves through here too: not its to remove
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _web_metrics_dir() -> str:
    """A fresh private (0700) directory for prometheus_client's multiprocess files, named in
    PROMETHEUS_MULTIPROC_DIR for this process and the web workers it forks, so that the web's
    /metrics sums every worker's counters (webapp/metrics.py). Any PROMETHEUS_MULTIPROC_DIR
    given is replaced: another process's files there would be summed in. prometheus_client
    reads the variable once, when it is first imported: nothing has imported it yet."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set")
    path = tempfile.mkdtemp(prefix="pgdispatch-web-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


def _check_bind(bind: str) -> None:
    """HOST:PORT that this process can listen on now; else InvalidInput (malformed, unknown
    host) or Conflict (in use, not permitted), so that a clash is one line, not gunicorn's
    retries. Binding and closing a socket (SO_REUSEADDR, as gunicorn binds) is the check."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise InvalidInput(f"bind must be HOST:PORT, got {bind!r}")
    # the families gunicorn binds: IPv6 for a bracketed literal, else IPv4 (a name included)
    if host.startswith("[") and host.endswith("]"):
        family, host = socket.AF_INET6, host[1:-1]
    elif any(c in host for c in ":[]"):
        raise InvalidInput(f"bind must be HOST:PORT with an IPv6 host in brackets "
                           f"([::1]:8000), got {bind!r}")
    else:
        family = socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except (socket.gaierror, UnicodeError, TypeError):  # TypeError: a host not encodable
            raise InvalidInput(f"bind: unknown host {host!r}") from None
        except OSError as exc:
            raise Conflict(f"cannot listen on {bind}: {exc.strerror or exc}") from None


@cli.command("demo")
@click.option("--bind", default=None, help="Console address (default 127.0.0.1:8000).")
@click.option("--duration", type=FiniteFloatRange(0), default=0, help="Stop after this many seconds (0: until Ctrl-C).")
@click.pass_obj
def demo_cmd(obj: Context, bind: str | None, duration: float) -> None:
    """Everything on an embedded server with a steady demo workload; Ctrl-C stops it all."""
    logging.getLogger().setLevel(logging.INFO)
    from pgdispatch import demo

    bind = bind or obj.settings.bind
    _check_bind(bind)
    sys.exit(demo.run(obj.settings, bind=bind, duration_seconds=duration or None))


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning every error into one line on stderr and an exit code."""
    try:
        cli.main(args=argv, prog_name="pgdispatch", standalone_mode=False)
    except getattr(click.exceptions, "NoArgsIsHelpError", ()) as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc), err=True)
        sys.exit(2)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"error: {_one_line(exc.format_message())}", err=True)
        sys.exit(2 if isinstance(exc, click.UsageError) else exc.exit_code or 1)
    except PgDispatchError as exc:
        click.echo(f"error: {_one_line(str(exc))}", err=True)
        sys.exit(next((code for cls, code in EXIT_CODES.items() if isinstance(exc, cls)), 1))
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # a database error we did not translate, a bug
        name = type(exc).__name__
        if name == "UndefinedTable" or name == "UndefinedFunction":
            click.echo("error: the database schema is not migrated; run `pgdispatch db upgrade`", err=True)
            sys.exit(2)
        click.echo(f"error: {name}: {_one_line(str(exc))}", err=True)
        sys.exit(1)
    sys.exit(0)


# An error line quotes what was given: a 100 000-character argument is shown cut.
MAX_ERROR_CHARS = 300


def _one_line(message: str) -> str:
    line = " ".join(message.split()) or "failed"
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS - 1] + "…"
