"""Is the stored state whole? One snapshot, every cross-table fact the transitions keep.

``violations(conn)`` reads one statement (so one snapshot, even under load) and returns a
line for each fact that does not hold:

* every project's running count (its running jobs), and the held slots of every
  organization and pool (the sum of its stripes' held counts), equal the running attempts
  of its jobs (both counts: sql/functions/capacity.sql);
* every running attempt holds one slot of its job's organization and one of its pool: it
  records a stripe of each (``attempts.organization_stripe``, ``pool_stripe``) that exists;
  and each stripe's held count is the number of running attempts recording it, so no slot
  is held without a running attempt behind it; likewise each project running stripe counts
  the running attempts that record it (``attempts.project_stripe``);
* the stripes themselves (sql/functions/capacity.sql): every organization and pool has exactly
  ``pgd_capacity_stripes()`` (8) of them, each holding between 0 and its cap; the caps minus
  what is owed (``capacity_debts``, a row only while something is) equal the limit; while
  anything is owed every stripe is full (held = cap), so that no claim finds room; and no stripe
  or debt belongs to an owner that does not exist;
* a job is ``running`` exactly when it has a running attempt, and that attempt carries the
  job's generation; a running attempt's job is running;
* ``jobs.attempts_made`` equals its attempts, ``jobs.generation`` the newest attempt's;
* a target is ``held`` exactly when a running deployment holds it, ``uncertain`` exactly
  when an uncertain deployment holds it, and ``free`` when neither does.

``steering_violations(conn)``: no attempt claimed in a pool while it was paused, nor by a
runner after its drain (by the times the audit log records).

``snapshot(conn)`` returns every row these facts are about, to compare a state before a
fault with the state after it ("nothing was half-applied").

Tests that use these checks show them catching a broken transition
(tests/faults/test_backend_termination.py).
"""

from __future__ import annotations

from typing import Any

VIOLATIONS_SQL = """
WITH live AS (
    SELECT a.id AS attempt_id, a.job_id, a.generation, p.organization_id AS org_id,
           j.project_id, j.pool_id, a.organization_stripe AS org_stripe, a.pool_stripe,
           a.project_stripe
      FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
     WHERE a.state = 'running'
), per_job AS (
    SELECT a.job_id, count(*) AS n, max(a.generation) AS top_generation
      FROM attempts a GROUP BY a.job_id
), owners AS (
    SELECT 'organization' AS kind, o.id, o.name, o.max_running AS lim FROM organizations o
    UNION ALL
    SELECT 'pool', q.id, q.name, q.slots FROM pools q
), live_slots AS (
    -- the slots the running attempts hold: one of the organization, one of the pool each
    SELECT 'organization' AS kind, live.org_id AS owner_id, live.org_stripe AS stripe_no,
           live.job_id, live.attempt_id
      FROM live
    UNION ALL
    SELECT 'pool', live.pool_id, live.pool_stripe, live.job_id, live.attempt_id FROM live
), behind AS (
    SELECT ls.kind, ls.owner_id, ls.stripe_no, count(*) AS n
      FROM live_slots ls WHERE ls.stripe_no IS NOT NULL GROUP BY 1, 2, 3
), per_owner AS (
    SELECT o.kind, o.id, o.name, o.lim, count(s.stripe_no) AS stripes,
           coalesce(sum(s.cap), 0) AS caps, coalesce(max(d.owed), 0) AS owed
      FROM owners o
      LEFT JOIN capacity_stripes s ON (s.kind, s.owner_id) = (o.kind, o.id)
      LEFT JOIN capacity_debts d ON (d.kind, d.owner_id) = (o.kind, o.id)
     GROUP BY o.kind, o.id, o.name, o.lim
)
SELECT format('organization %s: held slots %s, running attempts %s',
              o.name, pgd_organization_running(o.id),
              (SELECT count(*) FROM live WHERE live.org_id = o.id)) AS what
  FROM organizations o
 WHERE pgd_organization_running(o.id) <> (SELECT count(*) FROM live WHERE live.org_id = o.id)
UNION ALL
SELECT format('project %s: running jobs %s, running attempts %s',
              p.name, pgd_project_running(p.id), (SELECT count(*) FROM live WHERE live.project_id = p.id))
  FROM projects p
 WHERE pgd_project_running(p.id) <> (SELECT count(*) FROM live WHERE live.project_id = p.id)
UNION ALL
SELECT format('pool %s: held slots %s, running attempts %s',
              q.name, pgd_pool_running(q.id), (SELECT count(*) FROM live WHERE live.pool_id = q.id))
  FROM pools q
 WHERE pgd_pool_running(q.id) <> (SELECT count(*) FROM live WHERE live.pool_id = q.id)
UNION ALL
SELECT format('job %s is running but its attempt %s holds no slot of its %s %s (stripe %s)',
              ls.job_id, ls.attempt_id, ls.kind, o.name, coalesce(ls.stripe_no::text, 'none'))
  FROM live_slots ls JOIN owners o ON (o.kind, o.id) = (ls.kind, ls.owner_id)
 WHERE NOT EXISTS (SELECT 1 FROM capacity_stripes s
                    WHERE (s.kind, s.owner_id, s.stripe_no)
                          = (ls.kind, ls.owner_id, ls.stripe_no))
UNION ALL
SELECT format('%s %s: stripe %s holds %s slots, running attempts on it %s',
              s.kind, o.name, s.stripe_no, s.held, coalesce(b.n, 0))
  FROM capacity_stripes s JOIN owners o ON (o.kind, o.id) = (s.kind, s.owner_id)
  LEFT JOIN behind b ON (b.kind, b.owner_id, b.stripe_no) = (s.kind, s.owner_id, s.stripe_no)
 WHERE s.held <> coalesce(b.n, 0)
UNION ALL
SELECT format('project %s: running stripe %s counts %s, running attempts on it %s', p.name,
              coalesce(s.stripe_no, c.project_stripe), coalesce(s.running, 0), coalesce(c.n, 0))
  FROM project_running_stripes s
  FULL JOIN (SELECT live.project_id, live.project_stripe, count(*) AS n FROM live
              GROUP BY 1, 2) c ON (c.project_id, c.project_stripe) = (s.project_id, s.stripe_no)
  JOIN projects p ON p.id = coalesce(s.project_id, c.project_id)
 WHERE coalesce(s.running, 0) <> coalesce(c.n, 0)
UNION ALL
SELECT format('%s %s: stripe %s holds %s slots of its cap %s', s.kind, o.name, s.stripe_no,
              s.held, s.cap)
  FROM capacity_stripes s JOIN owners o ON (o.kind, o.id) = (s.kind, s.owner_id)
 WHERE s.held < 0 OR s.held > s.cap
UNION ALL
SELECT format('%s %s has %s stripes, not %s', po.kind, po.name, po.stripes,
              pgd_capacity_stripes())
  FROM per_owner po
 WHERE po.stripes <> pgd_capacity_stripes()
UNION ALL
SELECT format('%s %s: stripe caps %s minus %s owed, limit %s', po.kind, po.name, po.caps,
              po.owed, po.lim)
  FROM per_owner po
 WHERE po.caps - po.owed <> po.lim
UNION ALL
SELECT format('%s %s owes %s slots but stripe %s has room (held %s of cap %s)', po.kind,
              po.name, po.owed, s.stripe_no, s.held, s.cap)
  FROM per_owner po JOIN capacity_stripes s ON (s.kind, s.owner_id) = (po.kind, po.id)
 WHERE po.owed <> 0 AND s.held < s.cap
UNION ALL
SELECT format('%s %s: a debt of %s slots', d.kind, o.name, d.owed)
  FROM capacity_debts d JOIN owners o ON (o.kind, o.id) = (d.kind, d.owner_id)
 WHERE d.owed <= 0
UNION ALL
SELECT format('%s of %s %s, which does not exist', x.what, x.kind, x.owner_id)
  FROM (SELECT DISTINCT 'stripes' AS what, s.kind, s.owner_id FROM capacity_stripes s
        UNION ALL
        SELECT 'a debt', d.kind, d.owner_id FROM capacity_debts d) x
 WHERE NOT EXISTS (SELECT 1 FROM owners o WHERE (o.kind, o.id) = (x.kind, x.owner_id))
UNION ALL
SELECT format('job %s is running without a running attempt of generation %s', j.id, j.generation)
  FROM jobs j
 WHERE j.state = 'running'
   AND NOT EXISTS (SELECT 1 FROM live WHERE live.job_id = j.id AND live.generation = j.generation)
UNION ALL
SELECT format('attempt %s (generation %s) is running but job %s is %s at generation %s',
              live.attempt_id, live.generation, j.id, j.state, j.generation)
  FROM live JOIN jobs j ON j.id = live.job_id
 WHERE j.state <> 'running' OR j.generation <> live.generation
UNION ALL
SELECT format('job %s: attempts_made %s, generation %s, but %s attempts up to generation %s',
              j.id, j.attempts_made, j.generation, coalesce(pj.n, 0),
              coalesce(pj.top_generation, 0))
  FROM jobs j LEFT JOIN per_job pj ON pj.job_id = j.id
 WHERE j.attempts_made <> coalesce(pj.n, 0) OR j.generation <> coalesce(pj.top_generation, 0)
UNION ALL
SELECT format('target %s is %s (holder %s) but job %s is %s', t.name, t.state,
              t.holder_job_id, j.id, coalesce(j.state, 'missing'))
  FROM targets t LEFT JOIN jobs j ON j.id = t.holder_job_id
 WHERE t.state <> 'free'
   AND (j.id IS NULL OR j.target_id IS DISTINCT FROM t.id
        OR j.state <> CASE t.state WHEN 'held' THEN 'running' ELSE 'uncertain' END)
UNION ALL
SELECT format('deployment job %s is %s but target %s is %s (holder %s)', j.id, j.state, t.name,
              t.state, t.holder_job_id)
  FROM jobs j JOIN targets t ON t.id = j.target_id
 WHERE j.state IN ('running', 'uncertain')
   AND (t.holder_job_id IS DISTINCT FROM j.id
        OR t.state <> CASE j.state WHEN 'running' THEN 'held' ELSE 'uncertain' END)
"""


def violations(conn) -> list[str]:
    """Every cross-table fact that does not hold now (one snapshot); [] when whole."""
    return [r["what"] for r in conn.execute(VIOLATIONS_SQL).fetchall()]


def snapshot(conn) -> dict[str, Any]:
    """The rows a transition changes, as plain data to compare before and after a fault."""
    def rows(sql: str) -> list[dict[str, Any]]:
        return [dict(r) for r in conn.execute(sql).fetchall()]

    return {
        "organizations": rows("SELECT id, pgd_organization_running(id) AS running "
                              "FROM organizations ORDER BY id"),
        "projects": rows("SELECT id, pgd_project_running(id) AS running, last_claimed_at "
                         "FROM projects ORDER BY id"),
        "pools": rows("SELECT id, pgd_pool_running(id) AS running FROM pools ORDER BY id"),
        # the slots held, per stripe, with each stripe's cap, and what is owed (which stripe
        # a running attempt holds its slots in is in its row below)
        "stripes": rows("SELECT kind, owner_id, stripe_no, cap, held FROM capacity_stripes "
                        "ORDER BY kind, owner_id, stripe_no"),
        "debts": rows("SELECT kind, owner_id, owed FROM capacity_debts ORDER BY kind, owner_id"),
        "project_stripes": rows("SELECT project_id, stripe_no, running FROM project_running_stripes "
                                "ORDER BY project_id, stripe_no"),
        "targets": rows("SELECT id, state, holder_job_id, held_since FROM targets ORDER BY id"),
        "jobs": rows("SELECT id, state, generation, attempts_made, failures, ready_at, "
                     "finished_at, last_error, pending_dependencies FROM jobs ORDER BY id"),
        "attempts": rows("SELECT id, job_id, generation, state, lease_expires_at, finished_at, "
                         "exit_code, organization_stripe, pool_stripe, project_stripe "
                         "FROM attempts ORDER BY id"),
        "receipts": rows("SELECT key, attempt_id, outcome FROM delivery_receipts ORDER BY key"),
    }


HISTORY_SQL = """
WITH ordered AS (
    SELECT a.*, lag(a.finished_at) OVER w AS prev_finished_at, lag(a.id) OVER w AS prev_id,
           lag(a.state) OVER w AS prev_state
      FROM attempts a
    WINDOW w AS (PARTITION BY a.job_id ORDER BY a.claimed_at, a.id)
), per_job AS (
    SELECT job_id, count(*) AS n, count(DISTINCT generation) AS generations,
           count(DISTINCT attempt_no) AS attempt_nos,
           count(*) FILTER (WHERE state = 'succeeded') AS successes,
           count(*) FILTER (WHERE state = 'running') AS running,
           count(*) FILTER (WHERE state = 'lost') AS lost
      FROM attempts GROUP BY job_id
)
SELECT format('job %s: %s attempts share %s generations', job_id, n, generations) AS what
  FROM per_job WHERE generations <> n
UNION ALL
SELECT format('job %s: %s attempts share %s attempt numbers', job_id, n, attempt_nos)
  FROM per_job WHERE attempt_nos <> n
UNION ALL
SELECT format('job %s: attempt %s (%s) and attempt %s overlap in time', job_id, prev_id,
              prev_state, id)
  FROM ordered
 WHERE prev_id IS NOT NULL AND (prev_finished_at IS NULL OR prev_finished_at > claimed_at)
UNION ALL
SELECT format('job %s ended %s with %s succeeded and %s running attempts', j.id, j.state,
              coalesce(pj.successes, 0), coalesce(pj.running, 0))
  FROM jobs j LEFT JOIN per_job pj ON pj.job_id = j.id
 WHERE j.state IN ('succeeded', 'failed', 'cancelled', 'superseded')
   AND (coalesce(pj.running, 0) <> 0
        OR coalesce(pj.successes, 0) > CASE j.state WHEN 'succeeded' THEN 1 ELSE 0 END
        -- a success with no successful attempt only by an operator's word on a lost one
        OR (j.state = 'succeeded' AND coalesce(pj.successes, 0) = 0 AND coalesce(pj.lost, 0) = 0))
UNION ALL
SELECT format('job %s was superseded at %s but attempt %s (%s) was claimed at %s', j.id, e.at,
              a.id, a.state, a.claimed_at)
  FROM jobs j
  JOIN audit_events e ON e.job_id = j.id AND e.action = 'supersede'
  JOIN attempts a ON a.job_id = j.id
 WHERE a.claimed_at >= e.at OR a.state = 'running'
"""


def history_violations(conn) -> list[str]:
    """What is wrong in the attempt history: a job whose attempts share a generation or an
    attempt number, two attempts of one job whose ``[claimed_at, finished_at)`` overlap (a
    running attempt's interval never ends), or an ended job with an attempt still running,
    with a successful attempt when it did not succeed, or with other than one when it did
    (none is right only after an operator resolved a lost deployment as succeeded), or a
    superseded job with an attempt claimed after it was superseded, or still running."""
    return [r["what"] for r in conn.execute(HISTORY_SQL).fetchall()]


# The operators' steering (issue 20): the windows in which a pool was paused or a runner
# drained, from the audit log -- from the time the transition stamped after its fence
# (details.paused_at, details.drain_requested_at: sql/functions/operator.sql) to the `at` of
# the resume that followed (none: still on) -- and the attempts claimed inside one.
STEERING_SQL = """
WITH pauses AS (
    SELECT e.id, substr(e.subject, 6) AS pool, (e.details ->> 'paused_at')::timestamptz AS since,
           (SELECT min(r.at) FROM audit_events r
             WHERE r.subject = e.subject AND r.action = 'resume_pool' AND r.id > e.id) AS until
      FROM audit_events e WHERE e.action = 'pause_pool'
), drains AS (
    SELECT e.id, substr(e.subject, 8)::bigint AS runner_id,
           (e.details ->> 'drain_requested_at')::timestamptz AS since,
           (SELECT min(r.at) FROM audit_events r
             WHERE r.subject = e.subject AND r.action = 'resume_runner' AND r.id > e.id) AS until
      FROM audit_events e WHERE e.action = 'drain_runner'
)
SELECT format('attempt %s (job %s) claimed in pool %s at %s, while paused since %s',
              a.id, a.job_id, p.pool, a.claimed_at, p.since) AS what
  FROM pauses p
  JOIN pools q ON q.name = p.pool
  JOIN jobs j ON j.pool_id = q.id
  JOIN attempts a ON a.job_id = j.id
 WHERE a.claimed_at >= p.since AND (p.until IS NULL OR a.claimed_at < p.until)
UNION ALL
SELECT format('attempt %s (job %s) claimed by runner %s at %s, after its drain at %s',
              a.id, a.job_id, d.runner_id, a.claimed_at, d.since)
  FROM drains d
  JOIN attempts a ON a.runner_id = d.runner_id
 WHERE a.claimed_at >= d.since AND (d.until IS NULL OR a.claimed_at < d.until)
"""


def steering_violations(conn) -> list[str]:
    """Attempts claimed in a pool while it was paused, or by a runner after an operator's
    drain of it committed (until the resume), by the times the audit log records: [] when
    none. The pause and the drain stamp their time after waiting for the claims in flight,
    so a claim that did not see one has an earlier claimed_at (docs/design.md, "Pausing a
    pool, draining a runner")."""
    return [r["what"] for r in conn.execute(STEERING_SQL).fetchall()]
