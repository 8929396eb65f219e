"""The console at scale (issue 21, item 5): the server time of every console page, each
filter of the queue and the jobs list, job detail, ``jobs explain`` and the search, on one
database with a million queued jobs and ten million finished ones.

Run it from the repository root::

    python -m bench console [--queued 1000000] [--history 10000000] [--calls 20]
                            [--only REGEX] [--keep] [--reuse URL] [--out FILE]

Method. One database on the invocation's server (embedded, or ``DATABASE_URL``'s), copied
from a migrated template. Bench set-up, not production code:

* *Declared* (``pgdispatch apply``): organization ``bench`` (limits free) and ``tight``
  (``max_running`` 1); pools ``bench``, ``side``, ``small`` (1 slot), ``busy``, ``orphan``
  (no runner serves it) and ``frozen`` (paused); projects p0..p3 (the bulk), ``deploy``,
  ``bounded`` (``max_running`` 1), ``tight`` (organization tight), ``paused`` and ``idle``
  (no job at all); targets ``production``, ``staging`` and ``canary``; a viewer account.
  Live runners: one for bench, side and frozen (1,000 slots), one for small (10), one for
  busy (1 slot).
* *Bulk*: ``--history`` finished jobs with their attempts and receipts as
  bench/latency.py's INSERT_HISTORY writes them (oldest first, over the last 30 days), then
  ``--queued`` ready no-op jobs round-robin over p0..p3 in pool bench, ids given in that
  order. Loaded (``bulk_load``) with what every row would otherwise pay for taken off the
  bulk tables (DROPPED: their primary, unique and foreign keys, the foreign keys that
  reference them, their other indexes, their INSERT triggers), in chunks of HISTORY_CHUNK
  jobs on LOAD_CONNECTIONS connections at once; then each index built again as the schema
  defines it (statistics targets included; on both connections), the keys attached to their
  indexes, the foreign keys added NOT VALID and validated (one anti-join each), the triggers
  enabled, ``VACUUM ANALYZE`` (both connections) and ``CHECKPOINT``. Every constraint, index
  and trigger of the schema is compared before and after (SCHEMA_OBJECTS): a difference
  fails the build. Seconds of each phase, and of each index, are in the JSON's ``build``.
* *Every waiting reason*, through the product's own transitions, after the bulk (so the
  newest ids: a filter that finds them reads past the whole queue when it scans by id):
  the holders first (a job of ``bounded``, of ``tight``, a deployment to ``production``, a
  job in ``small``, one in ``busy``: claimed, running), a deployment to ``canary`` whose
  lease lapsed (``uncertain``, target uncertain), then SPECIAL jobs of each kind: waiting
  on a dependency (a bulk job), on approval, delayed an hour, on held ``production``, in
  ``staging``'s order, on uncertain ``canary``, at ``bounded``'s and ``tight``'s bounds, on
  ``small``'s full slot, on ``busy``'s busy runner, in paused project ``paused``, in paused
  pool ``frozen``, in ``orphan``; then the queue summary refreshed (what the scheduler's
  duty does every few seconds; the overview reads it).

Measured: every page of PAGES (the console's GET routes, each with each of its filters, a
common and a rare value where a filter has both), through the real Flask app's test client
signed in as a viewer (``pgdispatch.webapp.create_app``: the request handled in-process,
rendering included, no network), and ``jobs explain`` (``pgdispatch.sql.explain.explain_job``,
what the CLI calls) and ``reads.search_jobs`` called directly: WARMUP untimed calls, then
``--calls`` timed ones, p50 / p95 / max milliseconds; a page slower than the budget
(``--page-seconds``) stops early after MIN_CALLS. The runners beat before each page. A page
that does not answer 200 (a redirect where one is expected: 302) fails the run.

``--keep`` leaves the database (and, on an embedded server, nothing: use DATABASE_URL) for
``--reuse URL``, which measures an existing one again (e.g. after ``pgdispatch db
upgrade``) without building it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pgdispatch.sql import accounts, config, db, explain, reads, transitions

from .common import (bench_server, create_database, git_commit, machine, percentile,
                     server_settings, template_database)
from .latency import (ADVANCE_JOB_IDS, CONSOLE_PASSWORD, CONSOLE_USER, HISTORY_DAYS,
                      INSERT_HISTORY, NEXT_JOB_ID, Console)

HISTORY_CHUNK = 500_000
WARMUP = 2
MIN_CALLS = 3
SLOW_MS = 100.0
SPECIAL = 20
LEASE_SECONDS = 3600.0
FREE = 100_000
BULK_PROJECTS = ("p0", "p1", "p2", "p3")

CONFIG = f"""
[[organizations]]
name = "bench"
max_running = {FREE}
[[organizations]]
name = "tight"
max_running = 1
""" + "".join(f"""
[[pools]]
name = "{name}"
slots = {slots}
""" for name, slots in (("bench", FREE), ("side", FREE), ("small", 1), ("busy", FREE),
                        ("orphan", FREE), ("frozen", FREE))) + "".join(f"""
[[projects]]
name = "{p}"
organization = "bench"
pools = ["bench"]
""" for p in BULK_PROJECTS) + """
[[projects]]
name = "deploy"
organization = "bench"
pools = ["side", "small", "busy", "orphan", "frozen"]
[[projects]]
name = "bounded"
organization = "bench"
pools = ["side"]
max_running = 1
[[projects]]
name = "tight"
organization = "tight"
pools = ["side"]
[[projects]]
name = "paused"
organization = "bench"
pools = ["side"]
[[projects]]
name = "idle"
organization = "bench"
pools = ["bench"]
[[targets]]
name = "production"
[[targets]]
name = "staging"
[[targets]]
name = "canary"
"""

# Ready no-op jobs as pgd_submit writes them, ids %(first_id)s + g given (see INSERT_HISTORY).
INSERT_QUEUED = """
INSERT INTO jobs (id, project_id, pool_id, state, command, submitted_by)
OVERRIDING SYSTEM VALUE
SELECT %(first_id)s::bigint + g,
       (%(project_ids)s::bigint[])[1 + g %% cardinality(%(project_ids)s::bigint[])],
       %(pool_id)s, 'queued', ARRAY['true'], 'bench'
  FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g
"""
QUEUED_CHUNK = 500_000
LOAD_CONNECTIONS = 2
BULK_TABLES = ["jobs", "attempts", "delivery_receipts"]
# What the load takes off the bulk tables, each with what builds it again: their primary,
# unique and foreign keys (and the foreign keys of other tables that reference them: a key
# cannot go while one does), their other indexes with their columns' statistics targets,
# and their triggers that fire on INSERT. Rows in build order: indexes (a key's too), keys.
DROPPED = """
SELECT 'key' AS kind, c.conrelid::regclass::text AS table_name, c.conname AS name,
       c.contype::text AS contype, pg_get_constraintdef(c.oid) AS definition,
       pg_get_indexdef(c.conindid) AS index_definition, c.conindid::regclass::text AS index_name,
       ARRAY[]::text[] AS statistics
  FROM pg_constraint c
 WHERE c.contype IN ('p', 'u') AND c.conrelid = ANY (%(tables)s::regclass[])
UNION ALL
SELECT 'foreign key', c.conrelid::regclass::text, c.conname, 'f', pg_get_constraintdef(c.oid),
       NULL, NULL, ARRAY[]::text[]
  FROM pg_constraint c
 WHERE c.contype = 'f'
   AND (c.conrelid = ANY (%(tables)s::regclass[]) OR c.confrelid = ANY (%(tables)s::regclass[]))
UNION ALL
SELECT 'index', i.indrelid::regclass::text, i.indexrelid::regclass::text, NULL,
       pg_get_indexdef(i.indexrelid), NULL, NULL,
       ARRAY(SELECT a.attnum || ':' || a.attstattarget FROM pg_attribute a
              WHERE a.attrelid = i.indexrelid AND a.attstattarget IS NOT NULL
                AND a.attstattarget >= 0)
  FROM pg_index i
 WHERE i.indrelid = ANY (%(tables)s::regclass[])
   AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid)
UNION ALL
SELECT 'trigger', t.tgrelid::regclass::text, t.tgname, NULL, NULL, NULL, NULL, ARRAY[]::text[]
  FROM pg_trigger t
 WHERE t.tgrelid = ANY (%(tables)s::regclass[]) AND NOT t.tgisinternal
   AND t.tgtype & 4 <> 0 AND t.tgenabled <> 'D'
"""
# Every constraint, index and user trigger of the schema, as text: the same before the load
# and after it, or the build fails (the bench would measure another schema than the product's).
SCHEMA_OBJECTS = """
SELECT format('constraint %s %s: %s', c.conrelid::regclass, c.conname,
              pg_get_constraintdef(c.oid)) AS item
  FROM pg_constraint c WHERE c.connamespace = current_schema()::regnamespace
UNION ALL
SELECT format('index %s: %s%s statistics %s', i.indexrelid::regclass,
              pg_get_indexdef(i.indexrelid), CASE WHEN NOT i.indisvalid THEN ' INVALID' END,
              ARRAY(SELECT a.attnum || ':' || a.attstattarget FROM pg_attribute a
                     WHERE a.attrelid = i.indexrelid AND a.attstattarget IS NOT NULL))
  FROM pg_index i JOIN pg_class r ON r.oid = i.indrelid
 WHERE r.relnamespace = current_schema()::regnamespace
UNION ALL
SELECT format('trigger %s %s: enabled %s', t.tgrelid::regclass, t.tgname, t.tgenabled)
  FROM pg_trigger t JOIN pg_class r ON r.oid = t.tgrelid
 WHERE r.relnamespace = current_schema()::regnamespace AND NOT t.tgisinternal
 ORDER BY 1
"""
LOAD_SETTINGS = ("SET synchronous_commit = off", "SET work_mem = '512MB'",
                 "SET maintenance_work_mem = '1GB'", "SET max_parallel_maintenance_workers = 0")


def _ids(conn, table: str) -> dict[str, int]:
    return {r["name"]: r["id"] for r in conn.execute(f"SELECT id, name FROM {table}")}


def _claim(conn, runner_id: int, pool_id: int, *, lease_seconds: float = LEASE_SECONDS) -> int:
    c = transitions.claim(conn, runner_id=runner_id, pools=[pool_id],
                          claim_token=transitions.new_claim_token(), lease_seconds=lease_seconds)
    if c is None:
        raise RuntimeError(f"console bench: nothing to claim in pool {pool_id}")
    return c.job_id


def _runners(conn) -> dict[str, int]:
    return {r["name"]: r["id"] for r in conn.execute(
        "SELECT id, name FROM runners WHERE stopped_at IS NULL AND name LIKE 'console-%%'")}


def schema_objects(conn) -> list[str]:
    """SCHEMA_OBJECTS: one line per constraint, index and user trigger of the schema."""
    return [r["item"] for r in conn.execute(SCHEMA_OBJECTS)]


def on_connections(url: str, statements: list[tuple[str, dict[str, Any] | None]], *,
                   done: Callable[[int], None] | None = None) -> list[float]:
    """Run ``statements`` (sql, params), each in its own transaction, on LOAD_CONNECTIONS
    connections at once (each takes the next one as it finishes; LOAD_SETTINGS first), and
    call ``done(index)`` after each. Returns each statement's seconds, in order; the first
    error is raised once every connection stopped."""
    import queue
    import threading

    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(statements)):
        todo.put(i)
    seconds = [0.0] * len(statements)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work() -> None:
        try:
            with db.connect(url, application_name="bench-console-load",
                            statement_deadline_seconds=None) as conn:
                for setting in LOAD_SETTINGS:
                    conn.execute(setting)
                while not errors:
                    try:
                        i = todo.get_nowait()
                    except queue.Empty:
                        return
                    t = time.monotonic()
                    conn.execute(*statements[i])
                    seconds[i] = time.monotonic() - t
                    if done:
                        with lock:
                            done(i)
        except BaseException as exc:  # noqa: BLE001 - raised by the caller below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(min(LOAD_CONNECTIONS, len(statements)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return seconds


def bulk_load(conn, url: str, *, history: int, queued: int,
              progress: Callable[[str], None]) -> dict[str, Any]:
    """The history and the queue (see module doc), loaded with the bulk tables' keys, indexes
    and INSERT triggers taken off (DROPPED), in chunks on LOAD_CONNECTIONS connections, then
    everything built again as it was (SCHEMA_OBJECTS compared: RuntimeError if it differs).
    Returns each phase's seconds and what was rebuilt."""
    projects, pools = _ids(conn, "projects"), _ids(conn, "pools")
    old_runner = transitions.register_runner(conn, name="bench-history", pools=["bench"], slots=1)
    transitions.stop_runner(conn, runner_id=old_runner)
    before = schema_objects(conn)
    dropped = list(conn.execute(DROPPED, {"tables": BULK_TABLES}))
    by_kind = {k: [d for d in dropped if d["kind"] == k] for k in ("key", "foreign key", "index", "trigger")}
    for d in by_kind["trigger"]:
        conn.execute(f"ALTER TABLE {d['table_name']} DISABLE TRIGGER {d['name']}")
    for kind in ("foreign key", "key"):
        for d in by_kind[kind]:
            conn.execute(f"ALTER TABLE {d['table_name']} DROP CONSTRAINT {d['name']}")
    for d in by_kind["index"]:
        conn.execute(f"DROP INDEX {d['name']}")
    started = time.monotonic()
    bulk_ids = [projects[p] for p in BULK_PROJECTS]
    first_id = conn.execute(NEXT_JOB_ID).fetchone()["id"]
    chunks: list[tuple[str, dict[str, Any] | None]] = [
        (INSERT_HISTORY, {"project_ids": bulk_ids, "pool_id": pools["bench"], "runner_id": old_runner,
                          "first": first, "last": min(history, first + HISTORY_CHUNK) - 1,
                          "total": history, "days": HISTORY_DAYS, "first_id": first_id})
        for first in range(0, history, HISTORY_CHUNK)]
    chunks += [(INSERT_QUEUED, {"project_ids": bulk_ids, "pool_id": pools["bench"],
                                "first": first, "last": min(queued, first + QUEUED_CHUNK) - 1,
                                "first_id": first_id + history})
               for first in range(0, queued, QUEUED_CHUNK)]
    loaded = [0]

    def chunk_done(i: int) -> None:
        loaded[0] += 1
        progress(f"chunk {loaded[0]} of {len(chunks)} ({time.monotonic() - started:.0f} s)")

    on_connections(url, chunks, done=chunk_done)
    conn.execute(ADVANCE_JOB_IDS)
    insert_s = time.monotonic() - started
    # the indexes, a key's too (attached below), largest tables first
    order = {t: n for n, t in enumerate(BULK_TABLES)}
    builds = sorted(by_kind["key"] + by_kind["index"], key=lambda d: order.get(d["table_name"], 9))
    progress(f"loaded ({insert_s:.0f} s); building {len(builds)} indexes")
    t = time.monotonic()
    index_seconds = on_connections(url, [(d["index_definition"] or d["definition"], None) for d in builds])
    for d in builds:
        for entry in d["statistics"]:
            attnum, target = entry.split(":")
            conn.execute(f"ALTER INDEX {d['name']} ALTER COLUMN {int(attnum)} SET STATISTICS {int(target)}")
    for d in by_kind["key"]:
        if d["index_name"] != d["name"]:
            raise RuntimeError(f"console bench: key {d['name']} has index {d['index_name']}")
        kind = "PRIMARY KEY" if d["contype"] == "p" else "UNIQUE"
        conn.execute(f"ALTER TABLE {d['table_name']} ADD CONSTRAINT {d['name']} {kind} USING INDEX {d['name']}")
    index_s = time.monotonic() - t
    progress(f"indexes built ({index_s:.0f} s); foreign keys")
    # a foreign key added NOT VALID at once, then validated (one anti-join each) on both
    # connections: VALIDATE locks the referencing table only against schema changes
    t = time.monotonic()
    validate = []
    for d in by_kind["foreign key"]:
        valid = not d["definition"].endswith("NOT VALID")
        conn.execute(f"ALTER TABLE {d['table_name']} ADD CONSTRAINT {d['name']} {d['definition']}"
                     + (" NOT VALID" if valid else ""))
        if valid:
            validate.append((f"ALTER TABLE {d['table_name']} VALIDATE CONSTRAINT {d['name']}", None))
    on_connections(url, validate)
    for d in by_kind["trigger"]:
        conn.execute(f"ALTER TABLE {d['table_name']} ENABLE TRIGGER {d['name']}")
    foreign_s = time.monotonic() - t
    progress(f"foreign keys validated ({foreign_s:.0f} s); vacuum")
    t = time.monotonic()
    on_connections(url, [(f"VACUUM ANALYZE {table}", None) for table in BULK_TABLES])
    vacuum_s = time.monotonic() - t
    t = time.monotonic()
    conn.execute("CHECKPOINT")
    checkpoint_s = time.monotonic() - t
    after = schema_objects(conn)
    if after != before:
        raise RuntimeError("console bench: the schema after the load differs: "
                           f"lost {sorted(set(before) - set(after))}, new {sorted(set(after) - set(before))}")
    return {"insert_seconds": insert_s, "index_build_seconds": index_s,
            "index_seconds": {d["name"]: s for d, s in zip(builds, index_seconds)},
            "foreign_key_seconds": foreign_s, "vacuum_seconds": vacuum_s,
            "checkpoint_seconds": checkpoint_s,
            "rebuilt": {k: [d["name"] for d in v] for k, v in by_kind.items()}}


def add_waiting(conn) -> None:
    """The running holders and SPECIAL waiting jobs of every reason (see module doc)."""
    pools = _ids(conn, "pools")
    main = transitions.register_runner(conn, name="console-main", pools=["bench", "side", "frozen"],
                                       slots=1000)
    small = transitions.register_runner(conn, name="console-small", pools=["small"], slots=10)
    busy = transitions.register_runner(conn, name="console-busy", pools=["busy"], slots=1)

    def submit(project: str, pool: str, *command: str, **kw: Any) -> int:
        return transitions.submit(conn, project=project, pool=pool, command=list(command),
                                  submitted_by=kw.pop("submitted_by", "console-bench"), **kw)["id"]

    # the holders, one claim each when it is the only job its pool can give
    for project, target in (("bounded", None), ("tight", None), ("deploy", "production")):
        submit(project, "side", "make", "hold", f"--project={project}", target=target)
        _claim(conn, main, pools["side"])
    submit("deploy", "small", "make", "hold", "--pool=small")
    _claim(conn, small, pools["small"])
    submit("deploy", "busy", "make", "hold", "--pool=busy")
    _claim(conn, busy, pools["busy"])
    # a deployment lost with its lease: the job uncertain, the target uncertain
    submit("deploy", "side", "./deploy.sh", "canary", "--sha=c0ffee", target="canary")
    _claim(conn, main, pools["side"], lease_seconds=0.5)
    time.sleep(1.0)
    transitions.expire_leases(conn, pool_ids=[pools["side"]])
    upstream = conn.execute("SELECT max(id) AS id FROM jobs WHERE state = 'queued'").fetchone()["id"]
    for i in range(SPECIAL):
        sha = f"--sha={i * 2654435761 % 16**12:012x}"
        submit("p0", "bench", "make", "test", f"--branch=feature-{i}", depends_on=[upstream])
        submit("p1", "bench", "make", "release", f"--branch=release-{i}", requires_approval=True)
        submit("p2", "bench", "pytest", "-k", f"flaky{i}", delay_seconds=3600)
        submit("deploy", "side", "./deploy.sh", "production", sha, target="production")
        submit("deploy", "side", "./deploy.sh", "staging", sha, target="staging")
        submit("deploy", "side", "./deploy.sh", "canary", sha, target="canary")
        submit("bounded", "side", "make", "bounded", f"--n={i}")
        submit("tight", "side", "make", "tight", f"--n={i}")
        submit("deploy", "small", "make", "small", f"--n={i}")
        submit("deploy", "busy", "make", "busy", f"--n={i}")
        submit("paused", "side", "make", "paused", f"--n={i}", submitted_by="rare-bot")
        submit("deploy", "frozen", "make", "frozen", f"--n={i}")
        submit("deploy", "orphan", "make", "orphan", f"--n={i}")
    transitions.pause_project(conn, project="paused", reason="bench: a paused project", actor="bench")
    transitions.pause_pool(conn, pool="frozen", reason="bench: a paused pool", actor="bench")
    conn.execute("ANALYZE jobs")


def build(url: str, *, history: int, queued: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Everything the module doc's set-up lists, on the migrated database ``url``."""
    with db.connect(url, application_name="bench-console-setup",
                    statement_deadline_seconds=None) as conn:
        config.apply_config(conn, CONFIG, actor="bench", env={})
        accounts.upsert_user(conn, username=CONSOLE_USER, password=CONSOLE_PASSWORD, role="viewer")
        started = time.monotonic()
        loaded = bulk_load(conn, url, history=history, queued=queued, progress=progress)
        add_waiting(conn)
        transitions.summarize_queue(conn)
        counts = conn.execute("""SELECT (SELECT count(*) FROM jobs) AS jobs,
                                        (SELECT count(*) FROM attempts) AS attempts,
                                        pg_database_size(current_database()) AS database_bytes"""
                              ).fetchone()
        by_state = {r["state"]: r["n"] for r in conn.execute(
            "SELECT state, count(*) AS n FROM jobs GROUP BY state ORDER BY state")}
    return {**loaded, "build_seconds": time.monotonic() - started, **counts,
            "jobs_by_state": by_state}


def sample_ids(conn) -> dict[str, Any]:
    """The jobs, runners and words the pages name."""
    one = lambda sql: conn.execute(sql).fetchone()["id"]  # noqa: E731
    return {
        "queued": one("SELECT max(id) AS id FROM jobs WHERE state = 'queued' AND submitted_by = 'bench'"),
        "blocked": one("SELECT max(id) AS id FROM jobs WHERE state = 'blocked' AND pending_dependencies > 0"),
        "running": one("SELECT j.id FROM jobs j JOIN targets t ON t.holder_job_id = j.id "
                       "WHERE t.name = 'production'"),
        "uncertain": one("SELECT max(id) AS id FROM jobs WHERE state = 'uncertain'"),
        # succeeded at the second attempt (INSERT_HISTORY's k = 3..7), in the middle of the history
        "retried": one("SELECT id FROM jobs WHERE state = 'succeeded' AND attempts_made = 2 "
                       "AND id >= (SELECT max(id) / 2 FROM jobs WHERE finished_at IS NOT NULL) "
                       "ORDER BY id LIMIT 1"),
        "failed": one("SELECT max(id) AS id FROM jobs WHERE state = 'failed'"),
        "runner": one("SELECT id FROM runners WHERE name = 'console-main' AND stopped_at IS NULL"),
        "history_runner": one("SELECT max(id) AS id FROM runners WHERE name = 'bench-history'"),
    }


def pages(ids: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, path) of every console page measured."""
    out = [("overview", "/"), ("overview, span day", "/?span=day"),
           ("overview fragment (htmx poll)", "/"), ("chart depth (svg)", "/charts/depth.svg")]
    out += [("queue", "/queue/"), ("queue, longest waiting first", "/queue/?sort=oldest"),
            ("queue, page 2", f"/queue/?after_id={ids['queued'] - 1000}")]
    for name, common, rare in (("organization", "bench", "tight"), ("project", "p1", "bounded"),
                               ("pool", "bench", "small"), ("target", None, "production")):
        if common:
            out.append((f"queue ?{name}={common}", f"/queue/?{name}={common}"))
        out.append((f"queue ?{name}={rare}", f"/queue/?{name}={rare}"))
    out.append(("queue ?project=idle (none)", "/queue/?project=idle"))
    for code in explain.REASON_CODES:
        out.append((f"queue ?reason={code}", f"/queue/?reason={code}"))
    out.append(("queue ?reason=ready&sort=oldest", "/queue/?reason=ready&sort=oldest"))
    out.append(("queue ?reason=approval_required&sort=oldest",
                "/queue/?reason=approval_required&sort=oldest"))
    out.append(("jobs", "/jobs/"))
    for state in ("blocked", "queued", "running", "succeeded", "failed", "cancelled", "uncertain",
                  "superseded"):
        out.append((f"jobs ?state={state}", f"/jobs/?state={state}"))
    for name, value in (("organization", "tight"), ("project", "bounded"), ("project", "p1"),
                        ("pool", "small"), ("target", "production"), ("runner", ids["runner"]),
                        ("runner", ids["history_runner"]), ("older_than", 86400),
                        ("younger_than", 3600)):
        out.append((f"jobs ?{name}={value}", f"/jobs/?{name}={value}"))
    out.append(("jobs ?state=succeeded&project=p1&older_than=604800",
                "/jobs/?state=succeeded&project=p1&older_than=604800"))
    out.append(("jobs ?state=running&organization=bench", "/jobs/?state=running&organization=bench"))
    out.append(("jobs, oldest first (after_id=0)", "/jobs/?after_id=0"))
    out.append(("jobs, older page", f"/jobs/?before_id={ids['retried']}"))
    for code in ("dependency_pending", "capacity_project", "target_uncertain", "ready"):
        out.append((f"jobs ?reason={code}", f"/jobs/?reason={code}"))
    for kind in ("queued", "blocked", "running", "uncertain", "retried", "failed"):
        out.append((f"job detail ({kind})", f"/jobs/{ids[kind]}"))
    for name, q in (("common word", "true"), ("word of a few", "production"),
                    ("no match", "zebrafish"), ("id", f"%23{ids['retried']}"),
                    ("branch", "feature-7"), ("hash prefix", "0000a0f"),
                    ("project and word", "make&project=bounded"),
                    ("submitter and word", "make&submitter=rare-bot"),
                    ("state and word", "true&state=failed")):
        out.append((f"search {name}", f"/jobs/search?q={q}"))
    out += [("projects", "/projects/"), ("pools", "/pools/"), ("targets", "/targets/"),
            ("target production", "/targets/production"), ("target staging", "/targets/staging"),
            ("runners", "/runners/"), ("runners, stopped", "/runners/?show=stopped"),
            ("audit", "/audit/"), ("metrics", "/metrics")]
    return out


def calls(ids: dict[str, Any]) -> list[tuple[str, Callable[[Any], Any]]]:
    """(name, fn(conn)) of the reads measured outside the web app."""
    out = [(f"jobs explain ({kind})",
            (lambda job: lambda conn: explain.explain_job(conn, job_id=job))(ids[kind]))
           for kind in ("queued", "blocked", "running", "uncertain", "retried")]
    for name, kw in (("common word", {"q": "true"}), ("no match", {"q": "zebrafish"}),
                     ("word of a few", {"q": "production"}), ("id", {"q": f"#{ids['retried']}"})):
        out.append((f"reads.search_jobs {name}",
                    (lambda kw: lambda conn: reads.search_jobs(conn, limit=50, **kw))(kw)))
    return out


def timed(fn: Callable[[], Any], *, n: int, budget_s: float) -> dict[str, Any]:
    """WARMUP untimed calls of ``fn``, then ``n`` timed ones (fewer, but at least MIN_CALLS,
    once ``budget_s`` seconds have gone): p50 / p95 / max ms. A first call slower than the
    budget is the only one (``calls`` 1): the page is slow, how slow is what it says."""
    t = time.perf_counter()
    fn()
    first_ms = (time.perf_counter() - t) * 1000
    if first_ms > budget_s * 1000:
        return {"p50_ms": first_ms, "p95_ms": first_ms, "max_ms": first_ms, "calls": 1,
                "slow": True}
    for _ in range(WARMUP - 1):
        fn()
    ms: list[float] = []
    started = time.monotonic()
    while len(ms) < n and (len(ms) < MIN_CALLS or time.monotonic() - started < budget_s):
        t = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t) * 1000)
    return {"p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95), "max_ms": max(ms),
            "calls": len(ms), "slow": percentile(ms, 95) >= SLOW_MS}


def attempt(fn: Callable[[], Any], **kw: Any) -> dict[str, Any]:
    """``timed(fn)``, or the error of its first failing call (``error``; the run fails)."""
    try:
        return timed(fn, **kw)
    except Exception as exc:  # noqa: BLE001 - reported with the page; the other pages still run
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "slow": True}


def measure(url: str, *, n: int, budget_s: float, only: str | None,
            progress: Callable[[str], None]) -> dict[str, Any]:
    """Every page and call (see module doc), by name, in order."""
    wanted = re.compile(only) if only else None
    results: dict[str, Any] = {}
    with db.connect(url, application_name="bench-console") as conn:
        ids = sample_ids(conn)
        runners = _runners(conn)
        console = Console(url)
        try:
            for name, path in pages(ids):
                if wanted and not wanted.search(name):
                    continue
                for runner_id in runners.values():
                    transitions.beat_runner(conn, runner_id=runner_id)
                htmx = "htmx" in name
                expect = 302 if path.startswith("/jobs/search?q=%23") else 200

                def get(path=path, htmx=htmx, expect=expect):
                    response = console.client.get(path, headers={"HX-Request": "true"} if htmx else {})
                    if response.status_code != expect:
                        raise RuntimeError(f"GET {path}: {response.status_code}")

                results[name] = {"path": path, **attempt(get, n=n, budget_s=budget_s)}
                progress(_line(name, results[name]))
            for name, fn in calls(ids):
                if wanted and not wanted.search(name):
                    continue
                results[name] = attempt(lambda fn=fn: fn(conn), n=n, budget_s=budget_s)
                progress(_line(name, results[name]))
        finally:
            console.close()
    return {"ids": ids, "pages": results}


def _line(name: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{name:<48} FAILED: {r['error']}"
    mark = "  ** p95 >= 100 ms" if r["slow"] else ""
    return (f"{name:<48} p50 {r['p50_ms']:8.1f}  p95 {r['p95_ms']:8.1f}  max {r['max_ms']:8.1f} ms"
            f"  ({r['calls']} calls){mark}")


def table(pages_: dict[str, Any]) -> str:
    """The figures as a Markdown table, p95 of 100 ms or more in bold."""
    lines = ["| page | request | p50 ms | p95 ms | max ms | calls |", "|---|---|---:|---:|---:|---:|"]
    for name, r in pages_.items():
        request = f"`{r['path']}`" if "path" in r else ""
        if "error" in r:
            lines.append(f"| {name} | {request} | failed: {r['error']} | | | |")
            continue
        p95 = f"**{r['p95_ms']:.1f}**" if r["slow"] else f"{r['p95_ms']:.1f}"
        lines.append(f"| {name} | {request} | {r['p50_ms']:.1f} | {p95} | {r['max_ms']:.1f} | {r['calls']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Build (or reuse) the database, measure every page, print the table (and write JSON)."""
    p = argparse.ArgumentParser(prog="python -m bench console", description=__doc__.split("\n")[0])
    p.add_argument("--queued", type=int, default=1_000_000)
    p.add_argument("--history", type=int, default=10_000_000)
    p.add_argument("--calls", type=int, default=20, help="timed calls per page")
    p.add_argument("--page-seconds", type=float, default=10.0,
                   help="a page's time budget: a slower one stops after %d calls" % MIN_CALLS)
    p.add_argument("--only", help="measure only the pages whose name matches this regex")
    p.add_argument("--keep", action="store_true", help="keep the database (prints its URL)")
    p.add_argument("--reuse", metavar="URL", help="measure this database, built by an earlier --keep")
    p.add_argument("--out", type=Path, help="also write the result (JSON) here")
    opts = p.parse_args(argv)
    progress = lambda m: print(f"   console: {m}", flush=True)  # noqa: E731
    doc: dict[str, Any] = {"params": {k: v for k, v in vars(opts).items() if k != "out"},
                           "commit": git_commit(), "machine": machine(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with bench_server() as (server_url, kind):
        doc["server"], doc["settings"] = kind, server_settings(server_url)
        if opts.reuse:
            url = opts.reuse
        else:
            with template_database(server_url, "pgd_bench_console_template") as template:
                url = create_database(server_url, "pgd_bench_console", template=template)
        try:
            if not opts.reuse:
                doc["build"] = build(url, history=opts.history, queued=opts.queued, progress=progress)
                progress(f"built in {doc['build']['build_seconds']:.0f} s: {doc['build']['jobs']:,} jobs, "
                         f"{doc['build']['database_bytes'] / 2**30:.2f} GiB")
            doc.update(measure(url, n=opts.calls, budget_s=opts.page_seconds, only=opts.only,
                               progress=progress))
        finally:
            if opts.keep or opts.reuse:
                print(f"   console: database kept: {url}", flush=True)
            else:
                from .common import drop_database
                drop_database(server_url, url)
    doc["slow"] = [name for name, r in doc["pages"].items() if r["slow"]]
    doc["errors"] = {name: r["error"] for name, r in doc["pages"].items() if "error" in r}
    print(table(doc["pages"]))
    print(f"p95 >= {SLOW_MS:.0f} ms: {', '.join(doc['slow']) or 'none'}")
    if opts.out:
        opts.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
