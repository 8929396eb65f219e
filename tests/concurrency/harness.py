"""Race harness: real connections in real threads, started together by a barrier.

Three instruments:

* ``run_together`` runs one callable per thread, each on its own connection, all released
  at once by a ``threading.Barrier``, and returns every result or exception.
* ``Watcher`` samples, in one snapshot per sample, every organization's and pool's held
  slots (the sum of its stripes' held counts, sql/functions/capacity.sql) and every project's
  running jobs beside its limit and beside the running attempts that should back them (and every
  target beside the jobs holding it), and the stripes' caps and debt beside the limit; it
  records each sample where the capacity in use is over its limit, disagrees with the attempts,
  or the caps no longer split the limit.
* ``max_overlaps`` sweeps the attempts' ``[claimed_at, finished_at)`` intervals for the
  most attempts that held one organization, project, pool or target at once. That sweep is
  exact because pgd_claim and pgd_claim_batch stamp claimed_at with ``clock_timestamp()``
  *after* taking the job's organization and pool slots from a stripe with room (held + 1
  under the stripe row's lock, held to commit), and pgd_complete and pgd_expire_one stamp
  finished_at in the transaction that gives them back (held - 1 on the stripes the attempt
  recorded, under the same row locks). A stripe's claims and releases are serialized by its
  row lock, and a claim passes a stripe another transaction has locked (SKIP LOCKED): a slot
  freed by one attempt is taken by the next only after that release committed, after its
  finished_at. So attempts of one stripe that overlap in the sweep were all held at one
  moment of that row's history, at most its cap (a CHECK), and an owner's caps sum to its
  limit while nothing is owed (sql/functions/capacity.sql; the slot rows before the stripes, and
  the counters before them, were locked the same way). A claim of a project with a bound counts
  the project's running jobs under its exclusive claim lock and stamps after it
  (sql/functions/claim.sql), so a job whose completion it did not see committed is still counted
  and its interval ends before the new one starts. (Stamped with ``now()``, the start of the
  transaction, they were not: a claim that began before a completion and then waited for its
  lock looked as if it overlapped it, and a correct run of test_claim_races showed "pool linux:
  12 of 8".)

The ``BROKEN_*`` functions are deliberately wrong copies of the transitions, installed in a
test's database only to show that these instruments catch what they are meant to catch.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from typing import Any, Callable

from pgdispatch.sql import db, transitions

BARRIER_TIMEOUT_S = 30.0


@dataclasses.dataclass
class Outcome:
    """What one racer's callable returned or raised."""

    value: Any = None
    error: BaseException | None = None


def run_together(db_url: str, fns: list[Callable[[Any], Any]], *,
                 timeout_s: float = 60.0) -> list[Outcome]:
    """Run ``fns[i](conn_i)`` in thread i on its own connection; all start at one barrier.

    Connections are opened before the barrier so that only the racing work races.
    """
    barrier = threading.Barrier(len(fns), timeout=BARRIER_TIMEOUT_S)
    outcomes = [Outcome() for _ in fns]

    def body(i: int) -> None:
        started = False
        try:
            with db.connect(db_url, application_name=f"racer-{i}") as conn:
                barrier.wait()
                started = True
                outcomes[i].value = fns[i](conn)
        except BaseException as exc:  # noqa: BLE001 - reported to the test, not swallowed
            outcomes[i].error = exc
            if not started:
                barrier.abort()  # the others must not wait for a racer that never came

    threads = [threading.Thread(target=body, args=(i,), name=f"racer-{i}") for i in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"racers still running after {timeout_s} s (a deadlock or a lost wakeup?): {alive}"
    return outcomes


def transaction_retries() -> float:
    """How many transactions this process has retried after 40P01 / 40001 (sql.metrics)."""
    from pgdispatch.sql import metrics

    return sum(s.value for m in metrics.TRANSACTION_RETRIES.collect() for s in m.samples
               if s.name.endswith("_total"))


def raise_first_error(outcomes: list[Outcome]) -> None:
    """Re-raise the first exception a racer hit, so a test fails with its real cause."""
    for o in outcomes:
        if o.error is not None:
            raise o.error


# One snapshot: the capacity in use (held slots of each organization and pool, summed over its
# stripes; the running jobs of each project), its limit, and what actually backs it. An
# organization's or a pool's held slots agree with the attempts when there are as many as
# running attempts and each stripe holds as many as the running attempts recording it
# (attempts.organization_stripe, pool_stripe). ``caps_ok`` (organizations and pools only):
# the owner has its 8 stripes, their caps less what it owes are its limit, and while it owes
# every stripe is full (sql/functions/capacity.sql; tests/sql/test_stripes.py,
# stripe_violations).
SAMPLE_SQL = """
WITH live AS (
    SELECT p.organization_id AS org_id, j.project_id, j.pool_id, j.target_id, j.id AS job_id,
           a.organization_stripe, a.pool_stripe
      FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
     WHERE a.state = 'running'
), live_stripes AS (
    SELECT 'organization' AS kind, org_id AS owner_id, organization_stripe AS stripe_no, count(*) AS n
      FROM live GROUP BY 1, 2, 3
    UNION ALL
    SELECT 'pool', pool_id, pool_stripe, count(*) FROM live GROUP BY 1, 2, 3
), owners AS (
    SELECT s.kind, s.owner_id, sum(s.held)::integer AS held, sum(s.cap)::integer AS caps,
           count(*)::integer AS stripes, bool_and(s.held = s.cap) AS full,
           bool_and(s.held = coalesce(h.n, 0)) AS backed
      FROM capacity_stripes s
      LEFT JOIN live_stripes h ON (h.kind, h.owner_id, h.stripe_no) = (s.kind, s.owner_id, s.stripe_no)
     GROUP BY s.kind, s.owner_id
), holders AS (
    SELECT j.target_id, count(*) AS n, min(j.id) AS job_id
      FROM jobs j WHERE j.state IN ('running', 'uncertain') AND j.target_id IS NOT NULL
     GROUP BY j.target_id
)
SELECT 'organization' AS kind, o.name, 'held-slot count' AS what, coalesce(s.held, 0) AS running,
       o.max_running AS lim,
       coalesce(s.held, 0) = (SELECT count(*) FROM live WHERE live.org_id = o.id)
       AND coalesce(s.backed, true) AS ok,
       coalesce(s.stripes, 0) = 8 AND s.caps - coalesce(d.owed, 0) = o.max_running
       AND (d.owed IS NULL OR s.full) AS caps_ok,
       s.caps, coalesce(d.owed, 0) AS owed, coalesce(s.stripes, 0) AS stripes, s.full
  FROM organizations o
  LEFT JOIN owners s ON s.kind = 'organization' AND s.owner_id = o.id
  LEFT JOIN capacity_debts d ON d.kind = 'organization' AND d.owner_id = o.id
UNION ALL
SELECT 'project', p.name, 'running jobs', r.n, p.max_running,
       r.n = (SELECT count(*) FROM live WHERE live.project_id = p.id), NULL, NULL, NULL, NULL, NULL
  FROM projects p
 CROSS JOIN LATERAL (SELECT pgd_project_running(p.id) AS n) r
UNION ALL
SELECT 'pool', q.name, 'held-slot count', coalesce(s.held, 0), q.slots,
       coalesce(s.held, 0) = (SELECT count(*) FROM live WHERE live.pool_id = q.id)
       AND coalesce(s.backed, true),
       coalesce(s.stripes, 0) = 8 AND s.caps - coalesce(d.owed, 0) = q.slots
       AND (d.owed IS NULL OR s.full),
       s.caps, coalesce(d.owed, 0), coalesce(s.stripes, 0), s.full
  FROM pools q
  LEFT JOIN owners s ON s.kind = 'pool' AND s.owner_id = q.id
  LEFT JOIN capacity_debts d ON d.kind = 'pool' AND d.owner_id = q.id
UNION ALL
SELECT 'target', t.name, 'holder count', coalesce(h.n, 0)::integer, 1,
       (t.state = 'free') = (h.n IS NULL)
       AND (h.n IS NULL OR (h.n = 1 AND t.holder_job_id = h.job_id)),
       NULL, NULL, NULL, NULL, NULL
  FROM targets t LEFT JOIN holders h ON h.target_id = t.id
"""


class Watcher:
    """A thread on its own connection sampling the capacity in use and the limits until
    stopped.

    ``violations`` lists samples where an organization's or a pool's held slots or a
    project's counter exceeded its limit or disagreed with the running attempts, or an
    organization's or a pool's stripe caps did not split its limit (for a target: more than
    one holder, or a holder the row does not name).
    """

    def __init__(self, db_url: str, *, interval_s: float = 0.002):
        self.db_url = db_url
        self.interval_s = interval_s
        self.samples = 0
        self.max_seen: dict[tuple[str, str], int] = defaultdict(int)
        self.violations: list[str] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watcher")

    def _run(self) -> None:
        try:
            with db.connect(self.db_url, application_name="watcher") as conn:
                while not self._stop.is_set():
                    self.check(conn.execute(SAMPLE_SQL).fetchall())
                    time.sleep(self.interval_s)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def check(self, rows: list[dict[str, Any]]) -> None:
        self.samples += 1
        for r in rows:
            key = (r["kind"], r["name"])
            self.max_seen[key] = max(self.max_seen[key], r["running"])
        self.violations += violations_in(rows)

    def __enter__(self) -> "Watcher":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(30)
        if self.error is not None:
            raise self.error


def violations_in(rows: list[dict[str, Any]]) -> list[str]:
    """What is wrong in one SAMPLE_SQL snapshot: held slots or counters over their limits,
    or disagreeing with the attempts; stripe caps that do not split the limit."""
    out = []
    for r in rows:
        if r["lim"] is not None and r["running"] > r["lim"]:
            out.append(f"{r['kind']} {r['name']}: {r['running']} running, limit {r['lim']}")
        if not r["ok"]:
            out.append(f"{r['kind']} {r['name']}: {r['what']} {r['running']} disagrees "
                       f"with the attempts or holders backing it")
        if r["caps_ok"] is False:
            room = " (a stripe has room while slots are owed)" if r["owed"] and not r["full"] else ""
            out.append(f"{r['kind']} {r['name']}: {r['stripes']} stripes with caps {r['caps']} "
                       f"and {r['owed']} owed do not split the limit {r['lim']}{room}")
    return out


def check_now(conn) -> list[str]:
    """The watcher's check on one snapshot, now; returns the violations."""
    return violations_in(conn.execute(SAMPLE_SQL).fetchall())


def max_overlaps(conn) -> dict[tuple[str, str], int]:
    """The most attempts that held each organization, project, pool and target at once,
    by a sweep over ``[claimed_at, finished_at)`` (a running attempt's interval never ends)."""
    events: dict[tuple[str, str], list[tuple[Any, int]]] = defaultdict(list)
    rows = conn.execute("""
        SELECT a.claimed_at, a.finished_at, o.name AS organization, p.name AS project,
               q.name AS pool, t.name AS target
          FROM attempts a JOIN jobs j ON j.id = a.job_id
          JOIN projects p ON p.id = j.project_id JOIN organizations o ON o.id = p.organization_id
          JOIN pools q ON q.id = j.pool_id LEFT JOIN targets t ON t.id = j.target_id""").fetchall()
    for r in rows:
        keys = [("organization", r["organization"]), ("project", r["project"]), ("pool", r["pool"])]
        if r["target"] is not None:
            keys.append(("target", r["target"]))
        for key in keys:
            events[key].append((r["claimed_at"], +1))
            if r["finished_at"] is not None:
                events[key].append((r["finished_at"], -1))
    out = {}
    for key, evs in events.items():
        evs.sort(key=lambda e: (e[0], e[1]))  # at a tie an end comes before a start
        n = best = 0
        for _, delta in evs:
            n += delta
            best = max(best, n)
        out[key] = best
    return out


def limits(conn) -> dict[tuple[str, str], int]:
    """Every organization's, bounded project's and pool's limit, and 1 for every target."""
    rows = conn.execute("""
        SELECT 'organization' AS kind, name, max_running AS lim FROM organizations
        UNION ALL SELECT 'project', name, max_running FROM projects WHERE max_running IS NOT NULL
        UNION ALL SELECT 'pool', name, slots FROM pools
        UNION ALL SELECT 'target', name, 1 FROM targets""").fetchall()
    return {(r["kind"], r["name"]): r["lim"] for r in rows}


def attempt_shapes(conn) -> list[dict[str, Any]]:
    """How many jobs had each history of attempts, as rows {"states": "failed:1,succeeded:2",
    "n": ...} (each attempt's state and fence generation, in attempt order), sorted."""
    return conn.execute("""
        SELECT states, count(*) AS n FROM (
            SELECT string_agg(state || ':' || generation, ',' ORDER BY attempt_no) AS states
              FROM attempts GROUP BY job_id) s
         GROUP BY 1 ORDER BY 1""").fetchall()


# A deliberately broken claim. It judges eligibility, capacity and the target on a plain
# read, widens the window with pg_sleep, then takes every reservation unconditionally: no
# project claim lock (so nothing holds the project's bound), and an organization slot and a
# pool slot whether or not one is free within the limit (from a stripe with room if one is
# unlocked, else from any unlocked stripe, its cap raised past the limit to make room: so the
# held slots still count every claim and go over the limit, as the slot rows and the
# counters before them did). With p_skip_locked it first takes a job of the chosen project
# and pool with FOR UPDATE SKIP LOCKED, as pgd_claim does (so racers get different jobs and
# only the stale capacity and target checks are wrong), and the rest in the lock order of
# sql/functions/capacity.sql: job, target, project row, organization stripe, pool stripe (a
# stripe is only ever waited for when another transaction holds every stripe of the owner: then
# stripe 1). Without, it runs the job it read, never locked and never re-checked: the job row is
# first locked by the final UPDATE, after the stripes. The attempt records its stripes, so a
# completion gives the slots back. Same result columns as pgd_claim.
# Its reservation: an organization slot and a pool slot for v_job whatever the limit (cap
# raised to held + 1 where the stripe is full). PL/pgSQL; needs v_org and v_job in scope,
# and sets v_org_stripe, v_pool_stripe and v_proj_stripe (smallint) for the attempt to record
# (the project's running count taken as pgd_claim takes it: pgd_count_running).
UNCONDITIONAL_SLOTS_SQL = """
        UPDATE capacity_stripes s SET held = s.held + 1, cap = greatest(s.cap, s.held + 1)
         WHERE (s.kind, s.owner_id, s.stripe_no) = (
               SELECT f.kind, f.owner_id, f.stripe_no FROM capacity_stripes f
                WHERE f.kind = 'organization' AND f.owner_id = v_org
                ORDER BY f.held >= f.cap, f.stripe_no
                LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED)
        RETURNING s.stripe_no INTO v_org_stripe;
        IF NOT FOUND THEN  -- every stripe locked by another transaction: wait for the first
            UPDATE capacity_stripes s SET held = s.held + 1, cap = greatest(s.cap, s.held + 1)
             WHERE s.kind = 'organization' AND s.owner_id = v_org AND s.stripe_no = 1
            RETURNING s.stripe_no INTO v_org_stripe;
        END IF;
        UPDATE capacity_stripes s SET held = s.held + 1, cap = greatest(s.cap, s.held + 1)
         WHERE (s.kind, s.owner_id, s.stripe_no) = (
               SELECT f.kind, f.owner_id, f.stripe_no FROM capacity_stripes f
                WHERE f.kind = 'pool' AND f.owner_id = v_job.pool_id
                ORDER BY f.held >= f.cap, f.stripe_no
                LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED)
        RETURNING s.stripe_no INTO v_pool_stripe;
        IF NOT FOUND THEN
            UPDATE capacity_stripes s SET held = s.held + 1, cap = greatest(s.cap, s.held + 1)
             WHERE s.kind = 'pool' AND s.owner_id = v_job.pool_id AND s.stripe_no = 1
            RETURNING s.stripe_no INTO v_pool_stripe;
        END IF;
        v_proj_stripe := pgd_count_running(v_job.project_id, 1);
"""


BROKEN_CLAIM_SQL = """
CREATE FUNCTION pgd_claim_broken(p_runner_id bigint, p_pool_ids bigint[], p_claim_token uuid,
                                 p_lease_seconds double precision,
                                 p_sleep_seconds double precision, p_skip_locked boolean)
RETURNS TABLE (job_id bigint, attempt_id bigint, attempt_no integer, generation bigint,
               lease_expires_at timestamptz, project_id bigint, pool_id bigint,
               target_id bigint, command text[], timeout_seconds integer,
               more_waiting boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_job     jobs%ROWTYPE;
    v_org     bigint;
    v_attempt bigint;
    v_lease   timestamptz;
    v_org_stripe  smallint;
    v_pool_stripe smallint;
    v_proj_stripe smallint;
BEGIN
    SELECT j.* INTO v_job
      FROM jobs j
      JOIN projects p ON p.id = j.project_id
      JOIN organizations o ON o.id = p.organization_id
      JOIN pools q ON q.id = j.pool_id
      LEFT JOIN targets t ON t.id = j.target_id
     WHERE j.pool_id = ANY (p_pool_ids) AND j.state = 'queued' AND j.ready_at <= now()
       AND p.paused_at IS NULL
       AND EXISTS (SELECT 1 FROM capacity_stripes s
                    WHERE s.kind = 'organization' AND s.owner_id = o.id AND s.held < s.cap)
       AND (p.max_running IS NULL OR pgd_project_running(p.id) < p.max_running)
       AND EXISTS (SELECT 1 FROM capacity_stripes s
                    WHERE s.kind = 'pool' AND s.owner_id = q.id AND s.held < s.cap)
       AND (j.target_id IS NULL OR t.state = 'free')
     ORDER BY j.priority DESC, j.id
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT p.organization_id INTO v_org FROM projects p WHERE p.id = v_job.project_id;
    PERFORM pg_sleep(p_sleep_seconds);  -- widen the window between the check and the act
    BEGIN
        IF p_skip_locked THEN
            SELECT j.* INTO v_job
              FROM jobs j
             WHERE j.project_id = v_job.project_id AND j.pool_id = v_job.pool_id
               AND j.state = 'queued' AND j.ready_at <= now()
             ORDER BY j.priority DESC, j.id
             LIMIT 1
               FOR UPDATE OF j SKIP LOCKED;
            IF NOT FOUND THEN
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
        END IF;
        IF v_job.target_id IS NOT NULL THEN
            UPDATE targets t SET state = 'held', holder_job_id = v_job.id, held_since = now()
             WHERE t.id = v_job.target_id;
        END IF;
        UPDATE projects p SET last_claimed_at = now() WHERE p.id = v_job.project_id;
        -- a slot whatever the limit: from a stripe with room, else one past the limit
{slots}        UPDATE jobs j
           SET state = 'running', generation = j.generation + 1,
               attempts_made = j.attempts_made + 1, started_at = coalesce(j.started_at, now())
         WHERE j.id = v_job.id
        RETURNING * INTO v_job;
        v_lease := clock_timestamp() + make_interval(secs => p_lease_seconds);
        INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                              claimed_at, lease_expires_at, last_heartbeat_at,
                              organization_stripe, pool_stripe, project_stripe)
        VALUES (v_job.id, v_job.attempts_made, v_job.generation, p_runner_id, p_claim_token,
                'running', clock_timestamp(), v_lease, now(), v_org_stripe, v_pool_stripe,
                v_proj_stripe)
        RETURNING id INTO v_attempt;
        RETURN QUERY SELECT v_job.id, v_attempt, v_job.attempts_made, v_job.generation, v_lease,
                            v_job.project_id, v_job.pool_id, v_job.target_id, v_job.command,
                            v_job.timeout_seconds, false;
    EXCEPTION WHEN SQLSTATE 'PDSKP' THEN
        RETURN;
    END;
END;
$$;
""".replace("{slots}", UNCONDITIONAL_SLOTS_SQL)


def install_broken_claim(conn) -> None:
    conn.execute(BROKEN_CLAIM_SQL)


def broken_claim(conn, *, runner_id: int, pools: list[int], sleep_s: float, skip_locked: bool,
                 lease_seconds: float = 30.0) -> transitions.Claim | None:
    """Call pgd_claim_broken in one retried transaction, as sql.transitions.claim calls pgd_claim."""
    token = transitions.new_claim_token()

    def tx(c):
        return c.execute("SELECT * FROM pgd_claim_broken(%s, %s, %s, %s, %s, %s)",
                         (runner_id, pools, token, lease_seconds, sleep_s, skip_locked)).fetchone()

    row = db.in_transaction(conn, tx, tx_name="claim_broken")
    return None if row is None else transitions.Claim(**row, claim_token=token)


# A deliberately broken expiry: the lapsed lease is found by a plain read, the window is
# widened, then the attempt is ended and its capacity released without any lock or re-check
# (no SKIP LOCKED, no "is it still running with a lapsed lease?"). The writes follow the
# lock order (job, target, attempt, organization stripe, pool stripe) and release as
# pgd_expire_one does (pgd_release_slots: the slots on the stripes the job's latest attempt
# recorded), then take those stripes off that attempt, as slot rows freed by job id were
# left naming no job: what a release gives back, a second release finds given back already.
# So a second pass over the same attempt counts the job's failure again, while its slots are
# not given back twice (unless the job was claimed again since: then it gives back the new
# attempt's slots, which then records none).
BROKEN_EXPIRE_SQL = """
CREATE FUNCTION pgd_expire_one_broken(p_sleep_seconds double precision) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    c record;
BEGIN
    SELECT a.id AS attempt_id, a.job_id, j.project_id, j.pool_id, j.target_id,
           p.organization_id AS org_id
      INTO c
      FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
     WHERE a.state = 'running' AND a.lease_expires_at < clock_timestamp()
     ORDER BY a.lease_expires_at, a.id
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM pg_sleep(p_sleep_seconds);
    UPDATE jobs SET state = CASE WHEN c.target_id IS NULL THEN 'queued' ELSE 'uncertain' END,
                    failures = failures + 1
     WHERE id = c.job_id;
    IF c.target_id IS NOT NULL THEN
        UPDATE targets SET state = 'uncertain' WHERE id = c.target_id;
    END IF;
    UPDATE attempts
       SET state = CASE WHEN c.target_id IS NULL THEN 'expired' ELSE 'lost' END,
           finished_at = now(), error = 'lease expired'
     WHERE id = c.attempt_id;
    PERFORM pgd_release_slots(ARRAY[c.org_id], ARRAY[c.pool_id], ARRAY[c.job_id]);
    UPDATE attempts SET organization_stripe = NULL, pool_stripe = NULL, project_stripe = NULL
     WHERE id = (SELECT a.id FROM attempts a WHERE a.job_id = c.job_id
                  ORDER BY a.attempt_no DESC LIMIT 1);
    RETURN jsonb_build_object('attempt_id', c.attempt_id, 'job_id', c.job_id,
                              'is_deployment', c.target_id IS NOT NULL);
END;
$$;
"""


def install_broken_expire(conn) -> None:
    conn.execute(BROKEN_EXPIRE_SQL)


def broken_expire_one(conn, *, sleep_s: float) -> dict[str, Any] | None:
    """Call pgd_expire_one_broken in one retried transaction."""
    def tx(c):
        return c.execute("SELECT pgd_expire_one_broken(%s) AS r", (sleep_s,)).fetchone()["r"]

    return db.in_transaction(conn, tx, tx_name="expire_broken")


@dataclasses.dataclass
class LoadReport:
    """What a claim -> complete load saw."""

    completed: int
    per_loop: list[int]
    errors: list[BaseException]
    watcher: Watcher
    overlaps: dict[tuple[str, str], int]
    limits: dict[tuple[str, str], int]
    retries: int  # transactions retried after a deadlock or serialization failure

    def over_limit(self) -> dict[tuple[str, str], tuple[int, int]]:
        """Entities whose sweep overlap exceeded their limit: {key: (overlap, limit)}."""
        return {k: (v, self.limits[k]) for k, v in self.overlaps.items()
                if k in self.limits and v > self.limits[k]}


def run_load(db_url: str, *, claim: Callable[[Any], transitions.Claim | None], loops: int,
             total_jobs: int, hold_s: tuple[float, float] = (0.001, 0.005),
             timeout_s: float = 60.0) -> LoadReport:
    """``loops`` threads, each on its own connection, claim -> hold -> complete until
    ``total_jobs`` completions, while a Watcher samples; then sweep the attempts' intervals.
    A loop that raises stops every loop."""
    import random

    lock = threading.Lock()
    done = [0]
    stop = threading.Event()
    deadline = time.monotonic() + timeout_s

    def loop(conn) -> int:
        rng = random.Random()
        mine = 0
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                with lock:
                    if done[0] >= total_jobs:
                        break
                c = claim(conn)
                if c is None:
                    time.sleep(0.001)
                    continue
                time.sleep(rng.uniform(*hold_s))
                transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                     outcome="succeeded", exit_code=0, receipt_key=c.receipt_key)
                mine += 1
                with lock:
                    done[0] += 1
        except BaseException:
            stop.set()
            raise
        return mine

    retries_before = transaction_retries()
    with Watcher(db_url) as watcher:
        outcomes = run_together(db_url, [loop] * loops, timeout_s=timeout_s + 30)
    retries = transaction_retries() - retries_before
    with db.connect(db_url) as conn:
        overlaps = max_overlaps(conn)
        lims = limits(conn)
    return LoadReport(completed=done[0], per_loop=[o.value or 0 for o in outcomes],
                      errors=[o.error for o in outcomes if o.error is not None],
                      watcher=watcher, overlaps=overlaps, limits=lims, retries=int(retries))
