"""Costs of the pieces of a claim -> complete cycle, in pgbench custom scripts.

Each piece (fence, delivery receipt, capacity, audit) is measured by adding it to the raw SQL
cycle of ``bench/ceiling.py``, one at a time, beside the product's own functions.

Run it from the repository root::

    python -m bench costs [--quick] [--clients 1,4,8] [--repeats 3] [--jobs 2000]
                          [--variants a,b,...] [--history 100000] [--slots 10000]
                          [--synchronous-commit on|off] [--no-checkpoint]
    python -m bench costs --print-scripts        # the pgbench scripts, without running them

Method. One PostgreSQL serves the invocation (the embedded one, started in a temporary
directory and stopped at the end, or ``DATABASE_URL``'s). Every run gets a new database, a
copy of a migrated template (``bench.common.make_template``), with one organization, one pool
and 4 projects (limits 100,000: checked, never binding) and ``jobs`` queued no-op jobs spread
round-robin over the projects (``bench.common.prepare``); then one pgbench run of the variant's
script, ``-n -M simple -c N -j min(N, 2) -t T``, with ``T`` = ``--jobs`` / N rounded up to a
multiple of 4 and exactly ``N * T`` jobs queued, so that every claim finds a job. A raw
script's client takes the projects in turn (client ``i``'s cycle ``k`` claims from project
``(i + k) mod 4``). Afterwards the database is checked: every job succeeded, with one
succeeded attempt, with the generation its variant gives, with a delivery receipt if the
variant writes them, two audit events per job if it writes them, every capacity counter back
to 0 (the variant's own counter rows, and no project running a job) and every slot free (the
variant's own slot rows, and no slot held on the product's ``capacity_stripes``). A run
whose pgbench fails or whose check fails is reported as an error; the others go on. For each
repeat and each N every variant runs once, the first variant rotating with the repeat, so
that drift of the machine falls on all of them alike.

Each raw transaction is one round trip: its statements are joined with pgbench's ``\\;`` into
one simple-protocol message, which the server runs as one implicit transaction (no
BEGIN/COMMIT), so no row lock is held across a round trip to the client, which is how the
product calls ``pgd_claim`` and ``pgd_complete`` (one statement each). The ``*-rt`` variants
run the same statements with ``BEGIN``/``COMMIT`` and one round trip per statement, as
``bench/ceiling.py``'s ``RAW_CLAIM_SCRIPT`` does. The scripts do not branch on row counts: the
limits never bind, so every conditional UPDATE finds its row, and the check afterwards would
see one that did not.

Variants (``all_variants``; the ratio of each is taken against the one named in brackets):

* ``a`` raw cycle: claim = SKIP LOCKED select of the head queued job of the (project, pool)
  in the claim index's order + UPDATE to running + attempt INSERT; complete = attempt and job
  UPDATE to succeeded. The statements of ``RAW_CLAIM_SCRIPT``, without its generation bump.
* ``b`` [a] + fence: the claim bumps ``jobs.generation`` and the attempt takes it; the
  completion's UPDATEs add ``AND generation = :generation``.
* ``c`` [b] + delivery receipt: the completion looks the receipt key up and inserts the
  receipt (key, attempt, outcome, a jsonb response like pgd_complete's).
* ``d`` [c] + capacity as counter rows: conditional ``UPDATE ... SET running = running + 1
  WHERE running < limit`` of the organization, the project, the pool (that lock order) before
  the job is taken; ``running - 1`` of the same rows first thing in the completion. Each row
  lock is held to the end of its transaction, commit (and its disk flush) included. The
  product keeps no counter rows (its organization and pool capacity is
  ``capacity_stripes``, a project's running count is its running jobs), so the counter rows
  are scratch tables of the run's database, ``bench_organization_counters``,
  ``bench_project_counters`` and ``bench_pool_counters`` (id, limit, running; fillfactor 50,
  as the tables that held such counters were), one row per organization, project and pool,
  with their limits: the design the product measured and left, kept to repeat the
  comparison with ``e``.
* ``e`` [c] capacity as slot rows instead: a scratch table ``bench_capacity_slots`` (only in
  the run's database) with ``--slots`` rows for the organization and as many for the pool; the
  claim takes the lowest free slot of each with ``FOR UPDATE SKIP LOCKED``, in the statement
  that takes the job, and marks both with the job id; the completion frees them by key. No
  project accounting. The table is the bench's own, not the product's former slot rows
  (``organization_slots`` / ``pool_slots``, since replaced by ``capacity_stripes``):
  its ``job_id`` is not indexed, so taking and freeing a slot are HOT updates, and the claim
  takes both slots in one statement; what ``product`` pays for the product's capacity is in
  its own ratio.
* ``e-proj`` [e] ``e`` + the project's counter row, taken and released as in ``d`` (a
  per-project limit and the fairness order need the project's running count): the same three
  levels as ``d``, with the organization and pool rows, which every transaction touches, as
  slot rows instead of counters. ``e-proj`` / ``d`` is the comparison of the two
  representations.
* ``f`` [d] + audit: one ``audit_events`` row per transition (claim and completion).
* ``product`` [f] ``SELECT ... FROM pgd_claim(...)`` then ``SELECT pgd_complete(...)``, each
  its own implicit transaction: what remains is the functions' own work (fairness reads of
  the candidates, PL/pgSQL, subtransactions, locking reads before the updates, validation).
* ``a-rt`` [a], ``d-rt`` [d]: ``a`` and ``d`` with BEGIN/COMMIT, one round trip per statement.
* ``d-ff100`` [d]: ``d`` with its three counter tables rewritten at fillfactor 100 (else 50).
* ``idx-partial``, ``idx-full`` [idx-partial]: ``a`` on a table that also holds ``--history``
  finished jobs (succeeded, inserted before the queued ones, no attempts), with the claim index
  ``jobs_claim_idx`` dropped and recreated after the load either partial (``WHERE state =
  'queued'``, as migrated) or full (same columns, no predicate). The claim's plan is saved:
  with the full index the planner may prefer another partial index (``jobs_waiting_idx``) and
  a sort, so ``idx-full-forced`` [idx-partial] also sets ``enable_sort = off`` on the run's
  database, which leaves the full claim index as the only ordered path.

Units: cycles/s = pgbench's ``tps`` "without initial connection time", one script run being
one claim -> complete cycle (two transactions, two commits); the median over the repeats.
A ratio is a variant's median divided by its reference's at the same N: 0.90 means the piece
costs 10 % of throughput. With the embedded server, also the server's CPU time per cycle, ms
(every server process, read from /proc before and after the run: backends, WAL writer,
checkpointer, I/O workers, autovacuum), and its difference to the reference's: what a piece
costs in work, which other load on the machine disturbs much less than throughput, and which
says nothing of lock waits. Results: Markdown tables on stdout and
``bench/results/costs-<UTC timestamp>.json`` (parameters, server settings, the rendered
scripts, every run, the medians, the ratios, the claim plans, the errors).

``--synchronous-commit off`` (set on every run's database only) takes the wait for the disk
out of each commit: what is left is the pieces' own work and their lock waits, which is
steadier on a shared machine; the default (on) is how the product runs.

Full defaults: N = 1, 4, 8; 3 repeats; 2,000 jobs per run; a CHECKPOINT before each run (so
that none falls inside a run by chance). ``--quick`` (N = 1, 4; 1 repeat; 400 jobs per run; no
CHECKPOINT) takes about a minute; its figures only show that everything runs and checks out.
Everything a run creates lives in its scratch database, dropped afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import re
import resource
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pgdispatch.sql import db, transitions

from .common import (POOL, RESULTS_DIR, bench_server, create_database, database_name, drop_database,
                     git_commit, limits, machine, make_template, parse_tps, pgbench, pgbench_version,
                     prepare, scratch_database, server_settings, with_database)

PROJECTS = 4
FULL = {"clients": "1,4,8", "repeats": 3, "jobs": 2000}
QUICK = {"clients": "1,4", "repeats": 1, "jobs": 400}


# --- the variants -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """One pgbench script and the database it runs on.

    ``pieces`` (of fence, receipt, counters, slots, project_counter, audit) say what the raw
    cycle adds; ``versus`` names the variant the ratio is taken against; ``round_trips`` is
    "transaction" (one per transaction, implicit) or "statement" (BEGIN/COMMIT, one per
    statement); ``history`` finished jobs are loaded first; ``claim_index`` ("partial" or
    "full") recreates jobs_claim_idx after the load; ``fillfactor`` rewrites the counter
    tables; ``planner`` settings (name, value) are set on the run's database."""

    name: str
    label: str
    versus: str | None = None
    pieces: frozenset[str] = frozenset()
    round_trips: str = "transaction"
    is_product: bool = False
    history: int = 0
    claim_index: str | None = None
    fillfactor: int | None = None
    planner: tuple[tuple[str, str], ...] = ()


def all_variants(history: int) -> dict[str, Variant]:
    """Every variant by name, in report order; ``history``: finished jobs of the index ones."""
    fence, receipt = {"fence"}, {"fence", "receipt"}
    counters = frozenset(receipt | {"counters"})
    return {v.name: v for v in (
        Variant("a", "raw cycle (SKIP LOCKED claim, attempt; completion)"),
        Variant("b", "+ fence (generation bump, checked on completion)", "a", frozenset(fence)),
        Variant("c", "+ delivery receipt (lookup + insert)", "b", frozenset(receipt)),
        Variant("d", "+ capacity as counter rows (org, project, pool)", "c", counters),
        Variant("e", "instead of d: org + pool capacity as slot rows (SKIP LOCKED)", "c",
                frozenset(receipt | {"slots"})),
        Variant("e-proj", "e + the project's counter row (as in d)", "e",
                frozenset(receipt | {"slots", "project_counter"})),
        Variant("f", "+ audit event per transition (on d)", "d", frozenset(counters | {"audit"})),
        Variant("product", "pgd_claim + pgd_complete (one statement each)", "f", is_product=True),
        Variant("a-rt", "a with BEGIN/COMMIT, a round trip per statement", "a",
                round_trips="statement"),
        Variant("d-rt", "d with BEGIN/COMMIT, a round trip per statement", "d", counters,
                round_trips="statement"),
        Variant("d-ff100", "d with counter tables at fillfactor 100 (else 50)", "d", counters,
                fillfactor=100),
        Variant("idx-partial", f"a, {history:,} finished jobs, partial claim index (as migrated)",
                history=history, claim_index="partial"),
        Variant("idx-full", f"a, {history:,} finished jobs, full claim index", "idx-partial",
                history=history, claim_index="full"),
        Variant("idx-full-forced", "idx-full, enable_sort off: the claim must walk the full index",
                "idx-partial", history=history, claim_index="full",
                planner=(("enable_sort", "off"),)),
    )}


# --- the scripts ---------------------------------------------------------------------------------
#
# pgbench substitutes :name with the client's variable of that name, inside quotes too, and
# leaves names it does not know alone (':complete' stays as written). Set with -D: runner_id,
# org_id, pool_id, project_first (the projects' ids are consecutive), projects, cycle (0).

# Each client takes the projects in turn; its variables persist from one script run to the next.
ROTATE_PROJECT = r"""\set cycle :cycle + 1
\set project_id :project_first + (:client_id + :cycle) % :projects
"""

# The counter rows of variants d and e-proj: scratch tables shaped like the `running`
# columns organizations, projects and pools once had (the product counts capacity on
# capacity_stripes and a project's running jobs instead), one row per owner with its limit, at
# the fillfactor those tables had.
CREATE_COUNTERS = """
CREATE TABLE bench_organization_counters (
    id          bigint  PRIMARY KEY,
    max_running integer NOT NULL,
    running     integer NOT NULL DEFAULT 0 CHECK (running >= 0)
) WITH (fillfactor = 50);
CREATE TABLE bench_project_counters (
    id          bigint  PRIMARY KEY,
    max_running integer,
    running     integer NOT NULL DEFAULT 0 CHECK (running >= 0)
) WITH (fillfactor = 50);
CREATE TABLE bench_pool_counters (
    id      bigint  PRIMARY KEY,
    slots   integer NOT NULL,
    running integer NOT NULL DEFAULT 0 CHECK (running >= 0)
) WITH (fillfactor = 50);
INSERT INTO bench_organization_counters (id, max_running) SELECT id, max_running FROM organizations;
INSERT INTO bench_project_counters (id, max_running) SELECT id, max_running FROM projects;
INSERT INTO bench_pool_counters (id, slots) SELECT id, slots FROM pools;
"""
COUNTER_TABLES = ("bench_organization_counters", "bench_project_counters", "bench_pool_counters")

# lock order: organization -> project -> pool -> job (DESIGN.md); the limits never bind
TAKE_COUNTERS = (
    "UPDATE bench_organization_counters SET running = running + 1\n"
    " WHERE id = :org_id AND running < max_running",
    "UPDATE bench_project_counters SET running = running + 1\n"
    " WHERE id = :project_id AND (max_running IS NULL OR running < max_running)",
    "UPDATE bench_pool_counters SET running = running + 1 WHERE id = :pool_id AND running < slots",
)
RELEASE_COUNTERS = (
    "UPDATE bench_organization_counters SET running = running - 1 WHERE id = :org_id",
    "UPDATE bench_project_counters SET running = running - 1 WHERE id = :project_id",
    "UPDATE bench_pool_counters SET running = running - 1 WHERE id = :pool_id",
)

# The scratch table of variant e: one row per unit of capacity. job_id is not indexed, so
# taking and freeing a slot are HOT updates; fillfactor 50 as the migrated counter tables.
CREATE_SLOTS = """
CREATE TABLE bench_capacity_slots (
    kind     text    NOT NULL CHECK (kind IN ('organization', 'pool')),
    owner_id bigint  NOT NULL,
    slot     integer NOT NULL,
    job_id   bigint,
    PRIMARY KEY (kind, owner_id, slot)
) WITH (fillfactor = 50)
"""
INSERT_SLOTS = """
INSERT INTO bench_capacity_slots (kind, owner_id, slot)
SELECT 'organization', %(org_id)s, g FROM generate_series(1, %(slots)s) g
UNION ALL
SELECT 'pool', %(pool_id)s, g FROM generate_series(1, %(slots)s) g
"""

# The lowest free slot of one owner; a slot another claim is taking (locked) is passed over.
FREE_SLOT = """{name} AS MATERIALIZED (
    SELECT kind, owner_id, slot FROM bench_capacity_slots
     WHERE kind = '{kind}' AND owner_id = {owner} AND job_id IS NULL
     ORDER BY slot
     LIMIT 1
       FOR UPDATE SKIP LOCKED
)"""

FREE_SLOTS = (
    "UPDATE bench_capacity_slots SET job_id = NULL\n"
    " WHERE kind = 'organization' AND owner_id = :org_id AND slot = :org_slot AND job_id = :job_id",
    "UPDATE bench_capacity_slots SET job_id = NULL\n"
    " WHERE kind = 'pool' AND owner_id = :pool_id AND slot = :pool_slot AND job_id = :job_id",
)

LOOK_UP_RECEIPT = "SELECT attempt_id, response FROM delivery_receipts WHERE key = ':receipt_key'"

# the response pgd_complete stores, with the same keys
INSERT_RECEIPT = """INSERT INTO delivery_receipts (key, attempt_id, outcome, response)
VALUES (':receipt_key', :attempt_id, 'succeeded',
        jsonb_build_object('status', 'recorded', 'job_id', :job_id, 'attempt_id', :attempt_id,
                           'job_state', 'succeeded', 'attempt_state', 'succeeded',
                           'is_late_report', false, 'ready_at', now(), 'repeated', false))"""

AUDIT_COMPLETION = """INSERT INTO audit_events (actor, action, subject, details)
VALUES ('runner:bench', 'complete_attempt', 'job:' || :job_id,
        jsonb_build_object('attempt_id', :attempt_id, 'outcome', 'succeeded'))"""

# The product path: a claim token per claim (the receipt key is derived from it, as
# sql.transitions.Claim.receipt_key does), then the completion with that key.
PRODUCT_SCRIPT = r"""SELECT c.job_id, c.attempt_id, c.generation,
       t.token::text || ':complete' AS receipt_key
  FROM (SELECT gen_random_uuid() AS token) t,
       pgd_claim(:runner_id, ARRAY[:pool_id]::bigint[], t.token, 3600) c \gset
SELECT pgd_complete(:attempt_id, :generation, 'succeeded', 0, NULL, NULL, ':receipt_key',
                    2.0, 300.0);
"""


def _take_job(v: Variant) -> str:
    """The claim's statement that takes the job: head of the (project, pool) queue in the
    claim index's order, SKIP LOCKED; bumps the generation with the fence; with slots, takes a
    free organization and pool slot first and marks them; with audit, writes the event."""
    pieces = v.pieces
    ctes = []
    gate = ""
    if "slots" in pieces:
        ctes += [FREE_SLOT.format(name="org_slot", kind="organization", owner=":org_id"),
                 FREE_SLOT.format(name="pool_slot", kind="pool", owner=":pool_id")]
        # no free slot, no claim; evaluated once, before any job row is locked
        gate = "\n       AND EXISTS (SELECT FROM org_slot) AND EXISTS (SELECT FROM pool_slot)"
    ctes.append(f"""next AS (
    SELECT id FROM jobs
     WHERE project_id = :project_id AND pool_id = :pool_id
       AND state = 'queued' AND ready_at <= now(){gate}
     ORDER BY priority DESC, id
     LIMIT 1
       FOR UPDATE SKIP LOCKED
)""")
    bump = "generation = j.generation + 1,\n           " if "fence" in pieces else ""
    ctes.append(f"""claimed AS (
    UPDATE jobs j
       SET state = 'running', {bump}attempts_made = j.attempts_made + 1,
           started_at = coalesce(j.started_at, now())
      FROM next
     WHERE j.id = next.id
    RETURNING j.id, j.generation, j.attempts_made
)""")
    if "slots" in pieces:
        ctes.append("""take_slots AS (
    UPDATE bench_capacity_slots s SET job_id = c.id
      FROM claimed c
     WHERE (s.kind, s.owner_id, s.slot) IN (SELECT kind, owner_id, slot FROM org_slot
                                            UNION ALL
                                            SELECT kind, owner_id, slot FROM pool_slot)
)""")
    if "audit" in pieces:
        ctes.append("""audit AS (
    INSERT INTO audit_events (actor, action, subject, details)
    SELECT 'runner:bench', 'claim_job', 'job:' || c.id,
           jsonb_build_object('generation', c.generation, 'runner_id', :runner_id)
      FROM claimed c
)""")
    generation = "generation" if "fence" in pieces else "attempts_made"
    returning = ["id AS attempt_id", "job_id"]
    if "fence" in pieces:
        returning.append("generation")
    if "receipt" in pieces:
        returning.append("claim_token::text || ':complete' AS receipt_key")
    if "slots" in pieces:
        returning += ["(SELECT slot FROM org_slot) AS org_slot",
                      "(SELECT slot FROM pool_slot) AS pool_slot"]
    return ("WITH " + ",\n".join(ctes) + f"""
INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                      claimed_at, lease_expires_at, last_heartbeat_at)
SELECT id, attempts_made, {generation}, :runner_id, gen_random_uuid(), 'running',
       clock_timestamp(), clock_timestamp() + interval '1 hour', now()
  FROM claimed
RETURNING """ + ",\n          ".join(returning))


def claim_statements(v: Variant) -> list[str]:
    """The claim transaction's statements, in order; the last returns the row to \\gset."""
    out: list[str] = []
    if "counters" in v.pieces:
        out += TAKE_COUNTERS
    if "project_counter" in v.pieces:
        out.append(TAKE_COUNTERS[1])
    out.append(_take_job(v))
    return out


def complete_statements(v: Variant) -> list[str]:
    """The completion transaction's statements, in order (lock order: capacity, then the
    attempt and the job, which no other client touches)."""
    fenced = " AND generation = :generation" if "fence" in v.pieces else ""
    out: list[str] = []
    if "counters" in v.pieces:
        out += RELEASE_COUNTERS
    if "slots" in v.pieces:
        out.append(FREE_SLOTS[0])
        if "project_counter" in v.pieces:
            out.append(RELEASE_COUNTERS[1])
        out.append(FREE_SLOTS[1])
    if "receipt" in v.pieces:
        out.append(LOOK_UP_RECEIPT)
    out.append("UPDATE attempts SET state = 'succeeded', finished_at = now(), exit_code = 0\n"
               f" WHERE id = :attempt_id AND state = 'running'{fenced}")
    out.append("UPDATE jobs SET state = 'succeeded', finished_at = now()\n"
               f" WHERE id = :job_id AND state = 'running'{fenced}")
    if "receipt" in v.pieces:
        out.append(INSERT_RECEIPT)
    if "audit" in v.pieces:
        out.append(AUDIT_COMPLETION)
    return out


def script(v: Variant) -> str:
    """The pgbench script of a variant: one claim -> complete cycle."""
    if v.is_product:
        return PRODUCT_SCRIPT
    claim, complete = claim_statements(v), complete_statements(v)
    if v.round_trips == "statement":
        return (ROTATE_PROJECT + "BEGIN;\n" + "".join(s + ";\n" for s in claim[:-1])
                + claim[-1] + " \\gset\nCOMMIT;\nBEGIN;\n"
                + "".join(s + ";\n" for s in complete) + "COMMIT;\n")
    # one message per transaction: \; joins the statements into one implicit transaction
    return (ROTATE_PROJECT + " \\;\n".join(claim) + " \\gset\n" + " \\;\n".join(complete) + ";\n")


# --- set-up and checks ----------------------------------------------------------------------------

# Finished history for the index variants: succeeded no-op jobs, claimed once, over 30 days.
INSERT_HISTORY = """
INSERT INTO jobs (project_id, pool_id, state, command, submitted_by, attempts_made, generation,
                  created_at, started_at, finished_at)
SELECT (%(project_ids)s::bigint[])[1 + g %% cardinality(%(project_ids)s::bigint[])], %(pool_id)s,
       'succeeded', ARRAY['true'], 'bench', 1, 1,
       t, t + interval '1 second', t + interval '2 seconds'
  FROM generate_series(0, %(history)s::bigint - 1) AS g,
       LATERAL (SELECT now() - interval '30 days' * (1 - g::float8 / %(history)s)) AS h(t)
"""

CLAIM_INDEX = "CREATE INDEX jobs_claim_idx ON jobs (project_id, pool_id, priority DESC, id)"

EXPLAIN_CLAIM = """
EXPLAIN (COSTS OFF)
SELECT id FROM jobs
 WHERE project_id = %(project_id)s::bigint AND pool_id = %(pool_id)s::bigint
   AND state = 'queued' AND ready_at <= now()
 ORDER BY priority DESC, id LIMIT 1 FOR UPDATE SKIP LOCKED
"""

FACTS = """
SELECT (SELECT count(*) FROM jobs) AS jobs,
       (SELECT count(*) FROM jobs WHERE state <> 'succeeded') AS not_succeeded,
       (SELECT count(*) FROM attempts) AS attempts,
       (SELECT count(*) FROM attempts WHERE state = 'succeeded') AS attempts_succeeded,
       (SELECT count(*) FROM attempts a JOIN jobs j ON j.id = a.job_id
         WHERE j.generation = 1 AND a.generation = 1) AS fenced,
       (SELECT count(*) FROM delivery_receipts) AS receipts,
       (SELECT count(*) FROM audit_events) AS audit_events,
       (SELECT coalesce(sum(pgd_project_running(id)), 0) FROM projects) AS running,
       (SELECT coalesce(sum(held), 0) FROM capacity_stripes) AS product_slots_held
"""

# what only some variants' databases have: the counter rows of d and e-proj, the slot rows of e
COUNTERS_RUNNING = """
SELECT (SELECT coalesce(sum(running), 0) FROM bench_organization_counters)
     + (SELECT coalesce(sum(running), 0) FROM bench_project_counters)
     + (SELECT coalesce(sum(running), 0) FROM bench_pool_counters) AS n
"""
SLOTS_HELD = "SELECT count(*) AS n FROM bench_capacity_slots WHERE job_id IS NOT NULL"


def facts(url: str) -> dict[str, int]:
    """Counts that a run's check compares (jobs, attempts, receipts, audit events, capacity
    held: ``running`` sums the projects' running jobs and, when the variant has them, its own
    counter rows; ``slots_held`` counts the variant's own held slots; ``product_slots_held``
    the product's, held on its stripes)."""
    with db.connect(url, application_name="bench-costs-check") as conn:
        out = {k: int(v) for k, v in conn.execute(FACTS).fetchone().items()}

        def has(table: str) -> bool:
            return conn.execute("SELECT to_regclass(%s) AS t", (table,)).fetchone()["t"] is not None

        if has("bench_organization_counters"):
            out["running"] += int(conn.execute(COUNTERS_RUNNING).fetchone()["n"])
        out["slots_held"] = conn.execute(SLOTS_HELD).fetchone()["n"] if has("bench_capacity_slots") else 0
    return out


def expected_facts(v: Variant, jobs: int, before: dict[str, int]) -> dict[str, int]:
    """What ``facts`` must say after ``jobs`` cycles of ``v`` on a database that said ``before``."""
    writes_receipts = v.is_product or "receipt" in v.pieces
    fenced = v.is_product or "fence" in v.pieces
    audit = 2 * jobs if "audit" in v.pieces else 0
    return {"jobs": before["jobs"], "not_succeeded": 0, "attempts": jobs,
            "attempts_succeeded": jobs, "fenced": jobs if fenced else 0,
            "receipts": jobs if writes_receipts else 0,
            "audit_events": before["audit_events"] + audit, "running": 0, "slots_held": 0,
            "product_slots_held": 0}


# --- server CPU ---------------------------------------------------------------------------------
#
# Throughput on a shared machine moves with everyone else's load; the CPU time the server
# spends per cycle moves far less. Read from /proc, so only for a server on this host (the
# embedded one): the postmaster's own time, the time of its children it has reaped (every
# pgbench backend, once it has exited) and the time of those still alive (checkpointer,
# WAL writer, I/O workers, autovacuum). Clock ticks, converted to seconds.

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0], ppid [1], utime
    [11], stime [12], cutime [13], cstime [14]); None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def postmaster_pid(url: str) -> int | None:
    """The pid of the server's postmaster when it runs on this host, else None."""
    with db.connect(url, application_name="bench-costs-cpu") as conn:
        backend = conn.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"]
    fields = _proc_stat(backend)
    if fields is None:
        return None
    parent = int(fields[1])
    try:
        comm = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        return None
    return parent if comm.startswith("postgres") else None


def _is_client_backend(pid: int) -> bool:
    # a backend's title is "postgres: USER DB HOST ...", HOST "[local]" or "ADDRESS(PORT)"
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return "[local]" in title or bool(re.search(r"\(\d+\)", title))


def _server_ticks(postmaster: int) -> tuple[int, int]:
    """Clock ticks used so far by the postmaster and all its children, and how many client
    backends are alive."""
    own = _proc_stat(postmaster)
    if own is None:
        raise RuntimeError(f"postmaster {postmaster} is gone")
    ticks = sum(int(x) for x in own[11:15])
    backends = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _proc_stat(int(entry.name))
            if fields is not None and int(fields[1]) == postmaster:
                ticks += sum(int(x) for x in fields[11:15])
                backends += _is_client_backend(int(entry.name))
    return ticks, backends


def server_cpu_seconds(postmaster: int, timeout_seconds: float = 5.0) -> float:
    """CPU seconds used so far by the server (see above), read once no client backend is
    alive (every one that ran has been reaped, its time added to the postmaster's) and two
    readings 30 ms apart agree within a tick (no reaping was under way between reading the
    postmaster and its children); after ``timeout_seconds``, the last reading."""
    deadline = time.monotonic() + timeout_seconds
    previous = None
    while True:
        ticks, backends = _server_ticks(postmaster)
        if backends == 0 and previous is not None and abs(ticks - previous) <= 1:
            return ticks / _TICK
        if time.monotonic() > deadline:
            return ticks / _TICK
        previous = ticks if backends == 0 else None
        time.sleep(0.03)


@dataclasses.dataclass
class Context:
    """One invocation: the server, its templates (made lazily), the options."""

    server_url: str
    template: str
    opts: argparse.Namespace
    postmaster: int | None = None
    history_template: str | None = None

    def template_for(self, v: Variant) -> str:
        """The database to copy for ``v``: the migrated template, or one with history."""
        if not v.history:
            return self.template
        if self.history_template is None:
            url = create_database(self.server_url, "pgd_bench_costs_hist", template=self.template)
            self.history_template = database_name(url)
            started = time.monotonic()
            prepare(url, jobs=0, projects=PROJECTS, limit=limits(1, binding=False))
            with db.connect(url, application_name="bench-costs-setup") as conn:
                ids = [r["id"] for r in conn.execute("SELECT id FROM projects ORDER BY id")]
                pool_id = conn.execute("SELECT id FROM pools").fetchone()["id"]
                conn.execute(INSERT_HISTORY, {"project_ids": ids, "pool_id": pool_id,
                                              "history": v.history})
                conn.execute("VACUUM ANALYZE jobs")
            print(f"   history template: {v.history:,} finished jobs in "
                  f"{time.monotonic() - started:.1f} s", flush=True)
        return self.history_template

    def close(self) -> None:
        """Drop the templates."""
        for name in (self.history_template, self.template):
            if name:
                drop_database(self.server_url, with_database(self.server_url, name))


def set_up(url: str, v: Variant, jobs: int, opts: argparse.Namespace) -> dict[str, Any]:
    """Queue ``jobs`` jobs and build what ``v`` needs in the run's database; returns the
    pgbench variables (-D) and, for the index variants, the claim's plan."""
    pool_id = prepare(url, jobs=jobs, projects=PROJECTS, limit=limits(1, binding=False))[0]
    out: dict[str, Any] = {}
    with db.connect(url, application_name="bench-costs-setup") as conn:
        runner_id = transitions.register_runner(conn, name="bench-costs", pools=[POOL], slots=1,
                                                hostname="bench")
        project_ids = [r["id"] for r in conn.execute("SELECT id FROM projects ORDER BY id")]
        if project_ids != list(range(project_ids[0], project_ids[0] + PROJECTS)):
            raise AssertionError(f"project ids are not consecutive: {project_ids}")
        org_id = conn.execute("SELECT id FROM organizations").fetchone()["id"]
        if v.pieces & {"counters", "project_counter"}:
            conn.execute(CREATE_COUNTERS)
            conn.execute(f"VACUUM ANALYZE {', '.join(COUNTER_TABLES)}")
        if "slots" in v.pieces:
            conn.execute(CREATE_SLOTS)
            conn.execute(INSERT_SLOTS, {"org_id": org_id, "pool_id": pool_id, "slots": opts.slots})
            conn.execute("VACUUM ANALYZE bench_capacity_slots")
        if v.fillfactor is not None:
            for table in COUNTER_TABLES:
                conn.execute(f"ALTER TABLE {table} SET (fillfactor = {int(v.fillfactor)})")
                conn.execute(f"VACUUM FULL {table}")
        settings = list(v.planner)
        if opts.synchronous_commit != "on":
            settings.append(("synchronous_commit", opts.synchronous_commit))
        for name, value in settings:
            # for pgbench's sessions (they connect later) and for the EXPLAIN below
            conn.execute(f"ALTER DATABASE {database_name(url)} SET {name} = {value}")
            conn.execute(f"SET {name} = {value}")
        if v.claim_index is not None:
            conn.execute("DROP INDEX jobs_claim_idx")
            partial = " WHERE state = 'queued'" if v.claim_index == "partial" else ""
            conn.execute(CLAIM_INDEX + partial)
            conn.execute("ANALYZE jobs")
            plan = conn.execute(EXPLAIN_CLAIM, {"project_id": project_ids[0], "pool_id": pool_id})
            out["claim_plan"] = [r["QUERY PLAN"] for r in plan]
        if opts.checkpoint:
            try:  # every run starts from a checkpoint: none falls inside a short run by chance
                conn.execute("CHECKPOINT")
            except Exception:  # noqa: BLE001 - needs superuser or pg_checkpoint (DATABASE_URL)
                pass
    out["variables"] = {"runner_id": runner_id, "org_id": org_id, "pool_id": pool_id,
                        "project_first": project_ids[0], "projects": PROJECTS, "cycle": 0}
    return out


def run_one(ctx: Context, v: Variant, clients: int) -> dict[str, Any]:
    """One pgbench run of ``v`` at ``clients`` clients on a fresh database, checked."""
    per_client = math.ceil(ctx.opts.jobs / clients / PROJECTS) * PROJECTS
    jobs = per_client * clients
    setup_started = time.monotonic()
    with scratch_database(ctx.server_url, "pgd_bench_costs", template=ctx.template_for(v)) as url:
        setup = set_up(url, v, jobs, ctx.opts)
        before = facts(url)
        with tempfile.TemporaryDirectory(prefix="pgd-bench-costs-") as tmp:
            path = Path(tmp) / f"{v.name}.sql"
            path.write_text(script(v))
            defines = [a for k, val in setup["variables"].items() for a in ("-D", f"{k}={val}")]
            if ctx.postmaster:
                cpu_before = server_cpu_seconds(ctx.postmaster)
            client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.monotonic()
            setup_seconds = started - setup_started
            out = pgbench(url, "-n", "-M", "simple", "-c", str(clients), "-j", str(min(clients, 2)),
                          "-t", str(per_client), "-f", str(path), *defines,
                          timeout_seconds=ctx.opts.timeout_seconds)
            wall = time.monotonic() - started
            client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if ctx.postmaster:
                server_cpu = server_cpu_seconds(ctx.postmaster) - cpu_before
        after = facts(url)
        want = expected_facts(v, jobs, before)
        if after != want:
            wrong = {k: (after[k], want[k]) for k in want if after[k] != want[k]}
            raise AssertionError(f"{v.name} at N={clients} did not end clean: {wrong} "
                                 "(got, expected)")
    tps = parse_tps(out)
    result = {"variant": v.name, "clients": clients, "threads": min(clients, 2),
              "transactions_per_client": per_client, "jobs": jobs, "cycles_per_s": tps,
              "ms_per_cycle": 1000.0 / tps, "wall_seconds": wall, "setup_seconds": setup_seconds,
              "client_cpu_ms_per_cycle": 1000.0 * (
                  client_after.ru_utime + client_after.ru_stime
                  - client_before.ru_utime - client_before.ru_stime) / jobs}
    if ctx.postmaster:
        result["server_cpu_ms_per_cycle"] = 1000.0 * server_cpu / jobs
    if "claim_plan" in setup:
        result["claim_plan"] = setup["claim_plan"]
    return result


# --- report ---------------------------------------------------------------------------------------


def summarize(runs: Sequence[dict[str, Any]], variants: dict[str, Variant],
              clients: Sequence[int]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per variant and N: median cycles/s, min, max, the ratio to the reference's median;
    and, when measured, the median server CPU ms per cycle and its difference to the
    reference's."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for name in variants:
        for n in clients:
            mine = [r for r in runs if r["variant"] == name and r["clients"] == n]
            if not mine:
                continue
            xs = [r["cycles_per_s"] for r in mine]
            cpu = [r["server_cpu_ms_per_cycle"] for r in mine if "server_cpu_ms_per_cycle" in r]
            out.setdefault(name, {})[str(n)] = {
                "median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": len(xs),
                "cpu_ms": statistics.median(cpu) if cpu else None}
    for name, by_n in out.items():
        ref = out.get(variants[name].versus or "", {})
        for n, cell in by_n.items():
            base = ref.get(n)
            cell["ratio"] = cell["median"] / base["median"] if base else None
            cell["cpu_delta_ms"] = (cell["cpu_ms"] - base["cpu_ms"]
                                    if base and cell["cpu_ms"] is not None
                                    and base["cpu_ms"] is not None else None)
    return out


# Ratios worth reading beside each variant's own (numerator, denominator, what it says).
COMPARISONS = (
    ("e-proj", "d", "slot rows / counter rows for organization and pool (project counter in both)"),
    ("e", "d", "slot rows, no project accounting / counter rows at three levels"),
    ("f", "a", "every raw piece together (fence, receipt, counters, audit) / raw cycle"),
    ("product", "a", "pgd_claim + pgd_complete / raw cycle"),
    ("d-rt", "a-rt", "fence + receipt + counters / raw cycle, a round trip per statement in both"),
)


def comparisons(summary: dict[str, Any], clients: Sequence[int]) -> list[dict[str, Any]]:
    """``COMPARISONS`` whose two variants ran: the ratio of their medians at each N."""
    out = []
    for num, den, meaning in COMPARISONS:
        if num in summary and den in summary:
            ratios = {str(n): summary[num][str(n)]["median"] / summary[den][str(n)]["median"]
                      for n in clients if str(n) in summary[num] and str(n) in summary[den]}
            out.append({"numerator": num, "denominator": den, "meaning": meaning, "ratio": ratios})
    return out


def markdown(rows: list[list[str]]) -> str:
    """Rows (the first is the header) as a Markdown table with aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def table(summary: dict[str, Any], variants: dict[str, Variant], clients: Sequence[int]) -> str:
    """The Markdown table: cycles/s per variant and N (min–max of the repeats beside the
    median), and the ratio to its reference's median."""
    head = ["variant", "what it is", "vs"]
    for n in clients:
        head += [f"N={n} cycles/s", f"N={n} ratio"]
    rows = [head]
    for name, v in variants.items():
        row = [name, v.label, v.versus or ""]
        for n in clients:
            cell = summary.get(name, {}).get(str(n))
            if cell is None:
                row += ["failed", ""]
                continue
            spread = (f" ({cell['min']:,.0f}–{cell['max']:,.0f})" if cell["runs"] > 1 else "")
            row += [f"{cell['median']:,.0f}{spread}",
                    f"{cell['ratio']:.2f}" if cell["ratio"] is not None else ""]
        rows.append(row)
    return markdown(rows)


def cpu_table(summary: dict[str, Any], variants: dict[str, Variant], clients: Sequence[int]) -> str:
    """The Markdown table of server CPU ms per cycle (median) and its difference to the
    reference's, per variant and N."""
    head = ["variant", "vs"]
    for n in clients:
        head += [f"N={n} CPU ms", f"N={n} Δ ms"]
    rows = [head]
    for name, v in variants.items():
        row = [name, v.versus or ""]
        for n in clients:
            cell = summary.get(name, {}).get(str(n)) or {}
            cpu, delta = cell.get("cpu_ms"), cell.get("cpu_delta_ms")
            row += [f"{cpu:.2f}" if cpu is not None else "",
                    f"{delta:+.2f}" if delta is not None else ""]
        rows.append(row)
    return markdown(rows)


def comparison_table(items: list[dict[str, Any]], clients: Sequence[int]) -> str:
    """The ``comparisons`` as a Markdown table."""
    rows = [["ratio", "what it says", *[f"N={n}" for n in clients]]]
    for c in items:
        rows.append([f"{c['numerator']} / {c['denominator']}", c["meaning"],
                     *[f"{c['ratio'][str(n)]:.2f}" if str(n) in c["ratio"] else ""
                       for n in clients]])
    return markdown(rows)


# --- command line ---------------------------------------------------------------------------------


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Options; ``--quick`` changes the defaults of those not given."""
    p = argparse.ArgumentParser(prog="python -m bench costs", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: N = 1,4; 1 repeat; 400 jobs")
    p.add_argument("--clients", help=f"comma-separated client counts (default {FULL['clients']})")
    p.add_argument("--repeats", type=int,
                   help=f"runs per variant and N (default {FULL['repeats']})")
    p.add_argument("--jobs", type=int,
                   help=f"jobs (cycles) per run, rounded up (default {FULL['jobs']})")
    p.add_argument("--variants", help="comma-separated variants (default: all)")
    p.add_argument("--history", type=int, default=100_000, help="finished jobs, index variants")
    p.add_argument("--slots", type=int, default=10_000, help="slot rows per owner, variant e")
    p.add_argument("--timeout-seconds", type=float, default=600.0, help="per pgbench run")
    p.add_argument("--out", help="JSON file (default bench/results/costs-<UTC timestamp>.json)")
    p.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=None,
                   help="CHECKPOINT before each run (default: yes, but not with --quick)")
    p.add_argument("--synchronous-commit", choices=("on", "off"), default="on",
                   help="set on every run's database; off takes the disk flush out of the commit "
                        "and leaves the pieces' own work (default: on, the server's setting)")
    p.add_argument("--print-scripts", action="store_true", help="print the scripts and exit")
    opts = p.parse_args(list(argv))
    defaults = QUICK if opts.quick else FULL
    clients = str(opts.clients or defaults["clients"])
    opts.clients = [int(x) for x in clients.split(",") if x.strip()]
    opts.repeats = opts.repeats or defaults["repeats"]
    opts.jobs = opts.jobs or defaults["jobs"]
    if opts.checkpoint is None:
        opts.checkpoint = not opts.quick
    known = all_variants(opts.history)
    names = opts.variants.split(",") if opts.variants else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(known)}")
    opts.variant_names = names
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench costs``: run the variants, print the table, save the JSON. Returns 0,
    or 1 when a run failed (the others still ran and are reported)."""
    opts = parse(argv or [])
    variants = {n: all_variants(opts.history)[n] for n in opts.variant_names}
    if opts.print_scripts:
        for v in variants.values():
            print(f"-- {v.name}: {v.label}\n{script(v)}")
        return 0
    started_at = dt.datetime.now(dt.timezone.utc)
    doc: dict[str, Any] = {
        "benchmark": "costs", "created_at": started_at.isoformat(timespec="seconds"),
        "command": ["python -m bench costs", *(argv or [])], "quick": opts.quick,
        "machine": machine(), "pgdispatch": git_commit(),
        "pgbench": pgbench_version(),
        "params": {"clients": opts.clients, "repeats": opts.repeats, "jobs": opts.jobs,
                   "projects": PROJECTS, "history": opts.history, "slots": opts.slots,
                   "checkpoint": opts.checkpoint, "timeout_seconds": opts.timeout_seconds,
                   "synchronous_commit": opts.synchronous_commit},
        "variants": {n: {**dataclasses.asdict(v), "pieces": sorted(v.pieces), "script": script(v)}
                     for n, v in variants.items()},
        "runs": [], "errors": [],
    }
    t0 = time.monotonic()
    with bench_server() as (url, kind):
        doc["server"] = {"kind": kind, "settings": server_settings(url)}
        ctx = Context(server_url=url, template=make_template(url), opts=opts,
                      postmaster=postmaster_pid(url) if kind == "embedded" else None)
        try:
            order = list(variants.values())
            for repeat in range(opts.repeats):
                k = repeat % len(order)
                for n in opts.clients:
                    for v in order[k:] + order[:k]:
                        try:
                            r = run_one(ctx, v, n)
                        except Exception as exc:  # noqa: BLE001 - reported; the other runs go on
                            doc["errors"].append({"variant": v.name, "clients": n, "repeat": repeat,
                                                  "error": f"{type(exc).__name__}: {exc}"})
                            print(f"!! {v.name} N={n}: {type(exc).__name__}: {exc}", flush=True)
                            continue
                        r["repeat"] = repeat
                        doc["runs"].append(r)
                        print(f"   {v.name:<15} N={n:<3} {r['cycles_per_s']:>8,.0f} cycles/s "
                              f"({r['jobs']} jobs, {r['wall_seconds']:.1f} s)", flush=True)
        finally:
            ctx.close()
    doc["seconds"] = time.monotonic() - t0
    doc["summary"] = summarize(doc["runs"], variants, opts.clients)
    # the distinct plans of each index variant's claim, with the N of the runs that had it
    plans: dict[str, dict[str, list[int]]] = {}
    for r in doc["runs"]:
        if "claim_plan" in r:
            text = " / ".join(line.strip() for line in r["claim_plan"])
            plans.setdefault(r["variant"], {}).setdefault(text, []).append(r["clients"])
    doc["claim_plans"] = plans
    doc["comparisons"] = comparisons(doc["summary"], opts.clients)
    sync = "" if opts.synchronous_commit == "on" else ", synchronous_commit off"
    print(f"\nClaim -> complete cycles/s (pgbench tps, median of {opts.repeats}{sync}; "
          f"ratio = median / median of the 'vs' variant at the same N)\n")
    print(table(doc["summary"], variants, opts.clients))
    if doc["comparisons"]:
        print()
        print(comparison_table(doc["comparisons"], opts.clients))
    if any("server_cpu_ms_per_cycle" in r for r in doc["runs"]):
        print("\nServer CPU per cycle, ms (all server processes, from /proc; median; "
              "Δ = minus the 'vs' variant's)\n")
        print(cpu_table(doc["summary"], variants, opts.clients))
    for name, by_plan in plans.items():
        for text, ns in by_plan.items():
            print(f"\nclaim plan, {name} (N = {', '.join(map(str, sorted(set(ns))))}): {text}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = Path(opts.out) if opts.out else RESULTS_DIR / f"costs-{started_at:%Y%m%dT%H%M%SZ}.json"
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"\n{len(doc['runs'])} runs in {doc['seconds']:.0f} s; saved {out}")
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
