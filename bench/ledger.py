"""What each guarantee costs: pgdispatch's batched cycle with one guarantee taken out at a time.

Run it from the repository root (``python -m bench all --series ...`` runs these series
alternated with the others; see docs/benchmarks.md, "What each guarantee costs")::

    python -m bench ledger [--clients 2] [--repeats 3] [--jobs 4000] [--quick]

Each series ``ledger-<variant>-batch<B>`` is the ``pgdispatch-batch<B>`` series of
``bench/claim.py`` — the same workers, the same scratch database, the same check — run after
VARIANTS[variant] has been applied to that scratch database only: functions of the product
redefined to skip one guarantee, or indexes dropped. **They are measurements, never
product code**: each variant breaks what it names (the safety suite would fail on it), and
exists to put a figure beside "this guarantee costs that much". The difference between a
variant and ``pgdispatch-batch<B>`` in the same alternated run is what that guarantee costs
at that batch size; ``without-all`` takes every one out together, to set beside the raw
cycle (``raw-claim-batch<B>``, bench/ceiling.py) and PGQueuer.

The variants (what is taken out, and what it stands for):

* ``without-capacity`` — the organization and pool stripes and the project running count:
  ``pgd_take_slots`` hands out stripe 1 without a lock, ``pgd_hold_slots``,
  ``pgd_count_running`` and ``pgd_release_slots`` write nothing, ``pgd_free_slots`` and
  ``pgd_capacity_scarce`` say "plenty". The guarantee: no limit exceeded.
* ``without-receipts`` — the delivery receipt of a successful build completed in a batch
  (``pgd_complete_batch``'s fast path neither looks the key up nor inserts it). The
  guarantee: a report repeated after a lost answer gets the first answer, never a second
  outcome.
* ``without-grants`` — the runner's login and pool grant checks of the claim and the
  completion (``pgd_require_runner_grant``, ``pgd_runner_holds_grant``). The guarantee: a
  runner host claims and reports only in the pools granted to its login.
* ``without-more-waiting`` — the read that tells a claim whether more work waits
  (``pgd_more_waiting``), which lets the scheduler batch and sleep safely.
* ``without-search`` — the three search indexes on jobs (trigram, project, submitter:
  sql/schema.sql) dropped: what finding a job costs every job's writes.
* ``without-console`` — the two full indexes of the console's jobs list on jobs
  (``jobs_pool_idx``, ``jobs_created_idx``: its pool and age filters at 10M jobs) dropped:
  what those filters cost every job's writes.
* ``without-all`` — all of the above.

The substitutions check that each text they replace is in the function exactly once, so a
change of the product's SQL that they no longer fit fails the series loudly (the smoke run
runs one).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pgdispatch.sql import db

from . import claim
from .common import Bench, Series, limits, prepare, run_costs, run_processes, scratch_database, throughput

# --- the variants (bench only: each breaks the guarantee it names) ---------------------------

CAPACITY_OFF = [
    """CREATE OR REPLACE FUNCTION pgd_take_slots(p_kind text, p_owner bigint, p_want integer)
       RETURNS smallint[] LANGUAGE sql AS $$ SELECT array_fill(1::smallint, ARRAY[p_want]) $$""",
    """CREATE OR REPLACE FUNCTION pgd_hold_slots(p_kind text, p_owner bigint, p_units smallint[])
       RETURNS void LANGUAGE sql AS $$ SELECT NULL::void $$""",
    """CREATE OR REPLACE FUNCTION pgd_count_running(p_project_id bigint, p_n integer)
       RETURNS smallint LANGUAGE sql AS $$ SELECT 1::smallint $$""",
    """CREATE OR REPLACE FUNCTION pgd_release_slots(p_org_ids bigint[], p_pool_ids bigint[],
                                                    p_job_ids bigint[])
       RETURNS void LANGUAGE sql AS $$ SELECT NULL::void $$""",
    """CREATE OR REPLACE FUNCTION pgd_free_slots(p_kind text, p_owner bigint)
       RETURNS integer LANGUAGE sql STABLE AS $$ SELECT 100000 $$""",
    """CREATE OR REPLACE FUNCTION pgd_capacity_scarce(p_org_id bigint, p_pool_id bigint,
                                                      p_racing integer)
       RETURNS boolean LANGUAGE sql STABLE AS $$ SELECT false $$""",
]

GRANTS_OFF = [
    """CREATE OR REPLACE FUNCTION pgd_require_runner_grant(p_runner_id bigint, p_pool_ids bigint[])
       RETURNS void LANGUAGE sql STABLE AS $$ SELECT NULL::void $$""",
    """CREATE OR REPLACE FUNCTION pgd_runner_holds_grant(p_runner_id bigint, p_pool_id bigint)
       RETURNS boolean LANGUAGE sql STABLE AS $$ SELECT true $$""",
]

MORE_WAITING_OFF = [
    """CREATE OR REPLACE FUNCTION pgd_more_waiting(p_later_candidates boolean, p_project_id bigint,
                                                   p_pool_id bigint, p_taken bigint[] DEFAULT '{}')
       RETURNS boolean LANGUAGE sql STABLE AS $$ SELECT false $$""",
]

SEARCH_OFF = ["DROP INDEX jobs_command_trgm_idx", "DROP INDEX jobs_project_idx",
              "DROP INDEX jobs_submitter_idx"]

CONSOLE_OFF = ["DROP INDEX jobs_pool_idx", "DROP INDEX jobs_created_idx"]

# pgd_complete_batch's fast path without its receipts: (text, replacement), each text found
# exactly once in the function's definition (pg_get_functiondef)
RECEIPTS_OFF = [
    ("AND NOT EXISTS (SELECT 1 FROM delivery_receipts r WHERE r.key = x.receipt_key)", ""),
    ("INSERT INTO delivery_receipts (key, attempt_id, outcome, response)\n"
     "            SELECT f.receipt_key, f.attempt_id, 'succeeded',\n",
     "SELECT f.attempt_id,\n"),
    ("'ready_at', f.ready_at, 'repeated', false)\n",
     "'ready_at', f.ready_at, 'repeated', false) AS response\n"),
    ("              FROM unnest(v_rows) f\n            RETURNING attempt_id, response\n",
     "              FROM unnest(v_rows) f\n"),
]


def _receipts_off(conn) -> None:
    body = conn.execute("SELECT pg_get_functiondef('pgd_complete_batch'::regproc) AS d").fetchone()["d"]
    for old, new in RECEIPTS_OFF:
        if body.count(old) != 1:
            raise RuntimeError(f"bench ledger: pgd_complete_batch no longer has {old!r} once; "
                               "update bench/ledger.py RECEIPTS_OFF")
        body = body.replace(old, new)
    conn.execute(body)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A guarantee taken out: SQL run on the scratch database, and whether a receipt is
    still written per job (the run's check)."""

    statements: tuple[str, ...] = ()
    receipts_off: bool = False

    @property
    def receipts(self) -> bool:
        return not self.receipts_off


VARIANTS: dict[str, Variant] = {
    "without-capacity": Variant(tuple(CAPACITY_OFF)),
    "without-receipts": Variant(receipts_off=True),
    "without-grants": Variant(tuple(GRANTS_OFF)),
    "without-more-waiting": Variant(tuple(MORE_WAITING_OFF)),
    "without-search": Variant(tuple(SEARCH_OFF)),
    "without-console": Variant(tuple(CONSOLE_OFF)),
    "without-all": Variant(tuple(CAPACITY_OFF + GRANTS_OFF + MORE_WAITING_OFF + SEARCH_OFF
                                 + CONSOLE_OFF), receipts_off=True),
}


def apply_variant(url: str, name: str) -> None:
    """Apply VARIANTS[name] to the database at ``url`` (a scratch copy), as its owner."""
    variant = VARIANTS[name]
    with db.connect(url, application_name="bench-ledger") as conn:
        for statement in variant.statements:
            conn.execute(statement)
        if variant.receipts_off:
            _receipts_off(conn)
        conn.commit()


CHECK_NO_RECEIPTS = """
SELECT (SELECT count(*) FROM jobs WHERE state = 'succeeded') AS succeeded,
       (SELECT count(*) FROM jobs) AS jobs,
       (SELECT count(*) FROM attempts WHERE state = 'succeeded') AS attempts
"""


def run_ledger(bench: Bench, clients: int, *, variant: str, batch: int, series: str) -> dict[str, Any]:
    """One timed run of ``pgdispatch-batch<batch>`` with ``variant`` applied, on a fresh
    database, limits free. Raises AssertionError when the run did not end with every job
    succeeded once (and, where the variant keeps them, one receipt each)."""
    limit = limits(clients, binding=False)
    with scratch_database(bench.server_url, "pgd_bench_ledger", template=bench.template) as url:
        pool_ids = prepare(url, jobs=bench.jobs, projects=bench.projects, limit=limit,
                           warmup=bench.warmup)
        apply_variant(url, variant)
        with run_costs(bench.server_url, bench.jobs) as costs:
            workers = run_processes(
                claim.pgdispatch_worker,
                [(url, i, f"pgdispatch-batch{batch}", pool_ids, bench.lease_seconds,
                  bench.idle_seconds) for i in range(clients)],
                timeout_seconds=bench.timeout_seconds)
        total = bench.jobs + bench.warmup
        if VARIANTS[variant].receipts:
            claim.check_done(url, total)
        else:
            with db.connect(url, application_name="bench-check") as conn:
                row = dict(conn.execute(CHECK_NO_RECEIPTS).fetchone())
            if row != {"succeeded": total, "jobs": total, "attempts": total}:
                raise AssertionError(f"run did not end clean: {row}")
    return throughput(series, clients, bench.jobs, workers, limits=limit,
                      empty_claims=sum(w["empty_claims"] for w in workers), **costs)


SERIES: dict[str, Series] = {
    f"ledger-{v}-batch{b}": Series(
        name=f"ledger-{v}-batch{b}", label=f"pgdispatch {b} jobs/txn, {v.replace('-', ' ')}",
        kind="ledger", system=f"pgdispatch-{v}", batch=b,
        run=lambda bench, clients, _v=v, _b=b: run_ledger(
            bench, clients, variant=_v, batch=_b, series=f"ledger-{_v}-batch{_b}"))
    for v in VARIANTS for b in claim.BATCHES
}
