"""Finding a job at scale: the job search (``reads.search_jobs``, the read behind ``jobs
search``, GET /api/v1/jobs/search and the console's box) over a large history, the size of its
trigram index, and what the index adds to every submit's WAL.

Run it from the repository root::

    python -m bench search [--jobs 1000000] [--runs 40] [--submits 2000] [--out FILE]

Method. One server (the embedded one in a temporary directory, or ``DATABASE_URL``'s).

*Search.* A new database copied from a migrated template; 20 projects; ``--jobs`` jobs
inserted in one statement (bench set-up, not production code) with the search index dropped
first and built again afterwards, as the migration would on a live table (the build's
seconds are reported): 99 % finished, the rest queued; commands such as ``make build
--branch=feature-1234 --sha=3f2a…`` from a few tools (``make`` in 40 % of them, ``pytest``
in 20 %), 50 subcommands, 5,000 branches and a hash per job; a rare word (``zebrafish``) in
one job of 100,000; submitters ``ci`` (half the jobs), ``user0`` … ``user199`` and
``rare-bot`` (20 jobs). Then ``VACUUM`` and ``ANALYZE`` (its seconds reported: the index's
statistics target, sql/schema.sql, sets its sample), and each query shape ``--runs`` times through
``reads.search_jobs`` on one connection (first page, 50 rows), with a varied word where the
shape has one; the wall time of each call as the caller sees it, p50 / p95 / max.

*Submit WAL.* For each variant — no search index (``none``), the trigram index alone
(``trigram_only``), the schema's three (``schema``: the trigram index on the expression
pgd_command_text(command) and the (project_id, id) and (submitted_by, id) b-trees), the
schema's with the text kept in a stored generated column that the trigram index is on
(``generated_column``), and the schema's with the trigram index's pending list off
(``schema_fastupdate_off``: every insert goes into the index's tree at once) — a new database, ``--submits``
single submits through ``transitions.submit`` (one transaction each, as the CLI and the API
send them) with commands of the same shape, then the GIN pending list merged into the index
(``gin_clean_pending_list``: what a later insert or vacuum would write anyway), bytes of WAL
from ``pg_current_wal_insert_lsn`` before and after, divided by the submits; the extra per
job is the difference from the run without the index. Median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pgdispatch.sql import config, db, reads, transitions

from .common import (POOL, bench_server, config_text, limits, machine, percentile,
                     scratch_database, server_settings, template_database)

PROJECTS = 20
INDEX = "jobs_command_trgm_idx"
# The index as the schema (sql/schema.sql) defines it, read from the migrated database before
# the fill drops it: its definition and its column's statistics target
INDEX_AS_MIGRATED = f"""SELECT pg_get_indexdef('{INDEX}'::regclass) AS definition,
                               a.attstattarget AS statistics
                          FROM pg_attribute a
                         WHERE a.attrelid = '{INDEX}'::regclass AND a.attnum = 1"""

# bench set-up: a history of finished jobs with commands of a realistic shape
INSERT_HISTORY = """
INSERT INTO jobs (project_id, pool_id, state, command, submitted_by, created_at, started_at,
                  finished_at)
SELECT (%(project_ids)s::bigint[])[1 + g %% cardinality(%(project_ids)s::bigint[])], %(pool_id)s,
       CASE WHEN g %% 100 = 99 THEN 'queued' ELSE 'succeeded' END,
       ARRAY[CASE WHEN h %% 10 < 4 THEN 'make' WHEN h %% 10 < 6 THEN 'pytest'
                  WHEN h %% 10 < 8 THEN './deploy.sh' ELSE 'cargo' END,
             'step' || (g * 7 %% 50),
             '--branch=feature-' || (g * 13 %% 5000),
             '--sha=' || substr(md5(g::text), 1, 12)]
         || CASE WHEN g %% 100000 = 4242 THEN ARRAY['--tag=zebrafish'] ELSE ARRAY[]::text[] END,
       CASE WHEN g %% 2 = 0 THEN 'ci' WHEN g %% 50000 = 1 THEN 'rare-bot'
            ELSE 'user' || (g / 2 * 31 %% 200) END,
       now() - make_interval(secs => %(jobs)s - g), now() - make_interval(secs => %(jobs)s - g),
       CASE WHEN g %% 100 = 99 THEN NULL ELSE now() - make_interval(secs => %(jobs)s - g) END
  FROM generate_series(0, %(jobs)s::bigint - 1) AS g, abs(hashint8(g)) AS h
"""


def shapes(rng: random.Random, jobs: int) -> dict[str, Any]:
    """Query shape -> a function giving one call's arguments to reads.search_jobs."""
    def sha() -> str:
        return hashlib.md5(str(rng.randrange(jobs)).encode()).hexdigest()[:8]
    return {
        "rare_word": lambda: {"q": "zebrafish"},
        "common_word": lambda: {"q": rng.choice(["make", "pytest", "deploy"])},
        "branch": lambda: {"q": f"feature-{rng.randrange(5000)} "},
        "hash_prefix": lambda: {"q": sha()},
        "no_match": lambda: {"q": f"nomatch{rng.randrange(10**6)}"},
        "project_and_word": lambda: {"q": rng.choice(["make", "step7 ", "cargo"]),
                                     "project": f"p{rng.randrange(PROJECTS)}"},
        "project_and_rare_word": lambda: {"q": "zebrafish", "project": f"p{rng.randrange(PROJECTS)}"},
        "submitter_and_word": lambda: {"q": rng.choice(["make", "deploy", "step3 "]),
                                       "submitter": f"user{rng.randrange(200)}"},
        "rare_submitter_and_common_word": lambda: {"q": "make", "submitter": "rare-bot"},
        "state_and_word": lambda: {"q": rng.choice(["make", "pytest"]), "state": "queued"},
        "id": lambda: {"q": f"#{rng.randrange(1, jobs)}"},
        "digits": lambda: {"q": str(rng.randrange(1000, jobs))},
    }


def fill(url: str, *, jobs: int) -> dict[str, Any]:
    """The history of ``jobs`` jobs, the index built after it; sizes and build time."""
    with db.connect(url, application_name="bench-search-setup", statement_deadline_seconds=None) as conn:
        config.apply_config(conn, config_text(limits(1, binding=False), PROJECTS), actor="bench", env={})
        project_ids = [r["id"] for r in conn.execute("SELECT id FROM projects ORDER BY id")]
        pool_id = conn.execute("SELECT id FROM pools WHERE name = %s", (POOL,)).fetchone()["id"]
        index = conn.execute(INDEX_AS_MIGRATED).fetchone()
        conn.execute(f"DROP INDEX {INDEX}")
        started = time.monotonic()
        conn.execute(INSERT_HISTORY, {"project_ids": project_ids, "pool_id": pool_id, "jobs": jobs})
        inserted = time.monotonic()
        conn.execute(index["definition"])
        built = time.monotonic()
        if index["statistics"] is not None:
            conn.execute(f"ALTER INDEX {INDEX} ALTER COLUMN 1 SET STATISTICS {int(index['statistics'])}")
        conn.execute("VACUUM jobs")
        vacuumed = time.monotonic()
        conn.execute("ANALYZE jobs")  # what autovacuum's analyze of jobs costs at this size
        analyzed = time.monotonic()
        sizes = conn.execute(f"""SELECT pg_relation_size('{INDEX}') AS index_bytes,
                                        pg_table_size('jobs') AS jobs_table_bytes,
                                        pg_indexes_size('jobs') AS jobs_indexes_bytes,
                                        count(*) AS jobs FROM jobs""").fetchone()
    return {**sizes, "insert_seconds": inserted - started, "index_build_seconds": built - inserted,
            "analyze_seconds": analyzed - vacuumed}


def time_searches(url: str, *, jobs: int, runs: int, seed: int = 20) -> dict[str, Any]:
    """Each shape ``runs`` times; per shape p50/p95/max milliseconds and rows returned."""
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    with db.connect(url, application_name="bench-search") as conn:
        for name, args_of in shapes(rng, jobs).items():
            times, rows = [], []
            for i in range(runs + 2):
                args = args_of()
                started = time.perf_counter()
                page = reads.search_jobs(conn, limit=50, **args)
                elapsed = time.perf_counter() - started
                if i >= 2:  # the first two warm the caches and the session's plans
                    times.append(elapsed * 1000)
                    rows.append(len(page["jobs"]))
            out[name] = {"p50_ms": percentile(times, 50), "p95_ms": percentile(times, 95),
                         "max_ms": max(times), "rows_median": statistics.median(rows),
                         "example": args}
    return out


SEARCH_INDEXES = (INDEX, "jobs_project_idx", "jobs_submitter_idx")
VARIANTS = {
    "none": [f"DROP INDEX {i}" for i in SEARCH_INDEXES],
    "trigram_only": ["DROP INDEX jobs_project_idx", "DROP INDEX jobs_submitter_idx"],
    "schema": [],
    "schema_fastupdate_off": [f"ALTER INDEX {INDEX} SET (fastupdate = off)"],
    "generated_column": [
        f"DROP INDEX {INDEX}",
        "ALTER TABLE jobs ADD COLUMN command_text text GENERATED ALWAYS AS (pgd_command_text(command)) STORED",
        "CREATE INDEX jobs_command_text_trgm_idx ON jobs USING gin (command_text pgdispatch_ext.gin_trgm_ops)"],
}


def submit_wal(url: str, *, variant: str, submits: int) -> float:
    """Bytes of WAL per submit with the text kept as ``variant`` says."""
    with db.connect(url, application_name="bench-search-wal") as conn:
        config.apply_config(conn, config_text(limits(1, binding=False), 1), actor="bench", env={})
        for stmt in VARIANTS[variant]:
            conn.execute(stmt)
        indexes = [r["i"] for r in conn.execute(
            "SELECT indexrelid::regclass::text AS i FROM pg_index WHERE indrelid = 'jobs'::regclass "
            "AND indexrelid::regclass::text LIKE '%%trgm%%'")]
        conn.execute("CHECKPOINT")
        before = conn.execute("SELECT pg_current_wal_insert_lsn() AS l").fetchone()["l"]
        for g in range(submits):
            transitions.submit(conn, project="p0", pool=POOL, submitted_by="bench", command=[
                "make", f"step{g * 7 % 50}", f"--branch=feature-{g * 13 % 5000}",
                f"--sha={g * 2654435761 % 16**12:012x}"])
        for index in indexes:
            conn.execute("SELECT gin_clean_pending_list(%s::regclass)", (index,))
        return float(conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s) AS d",
                                  (before,)).fetchone()["d"]) / submits


def main(argv: list[str]) -> int:
    """Fill, time the shapes, measure the submit WAL; print (and write) the result."""
    parser = argparse.ArgumentParser(prog="python -m bench search")
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--submits", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the result (JSON) here")
    args = parser.parse_args(argv)
    with bench_server() as (server_url, kind), template_database(server_url) as template:
        with scratch_database(server_url, "pgd_bench_search", template=template) as url:
            history = fill(url, jobs=args.jobs)
            searches = time_searches(url, jobs=args.jobs, runs=args.runs)
        wal: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                with scratch_database(server_url, "pgd_bench_search_wal", template=template) as url:
                    wal[variant].append(submit_wal(url, variant=variant, submits=args.submits))
        settings = server_settings(server_url)
    per_submit = {v: statistics.median(w) for v, w in wal.items()}
    result = {"server": kind, "settings": settings, "machine": machine(), "jobs": args.jobs,
              "runs": args.runs, "history": history, "searches": searches,
              "worst_p95_ms": max(s["p95_ms"] for s in searches.values()),
              "submits": args.submits, "wal_bytes_per_submit": per_submit, "wal_runs": wal,
              "extra_wal_bytes_per_submit": {v: per_submit[v] - per_submit["none"]
                                             for v in VARIANTS if v != "none"}}
    print(json.dumps(result, indent=2, default=str))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
