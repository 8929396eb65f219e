"""Is the stored state whole? One snapshot, every cross-table fact the transitions keep.

``violations(conn)`` reads one statement (so one snapshot, even under load) and returns a
line for each fact that does not hold:

* every project's running count (its running jobs, migration 0011), and the held slots of
  every organization and pool (migration 0008), equal the running attempts of its jobs;
* every running job holds exactly one slot of its project's organization and one slot of its
  pool, and no slot is held by a job that is not running (or by one of another organization
  or pool);
* a job is ``running`` exactly when it has a running attempt, and that attempt carries the
  job's generation; a running attempt's job is running;
* ``jobs.attempts_made`` equals its attempts, ``jobs.generation`` the newest attempt's;
* a target is ``held`` exactly when a running deployment holds it, ``uncertain`` exactly
  when an uncertain deployment holds it, and ``free`` when neither does.

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
           j.project_id, j.pool_id
      FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
     WHERE a.state = 'running'
), per_job AS (
    SELECT a.job_id, count(*) AS n, max(a.generation) AS top_generation
      FROM attempts a GROUP BY a.job_id
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
SELECT format('job %s is running but holds %s slots of its organization %s',
              j.id, (SELECT count(*) FROM organization_slots s
                      WHERE s.organization_id = p.organization_id AND s.job_id = j.id), o.name)
  FROM jobs j JOIN projects p ON p.id = j.project_id JOIN organizations o ON o.id = p.organization_id
 WHERE j.state = 'running'
   AND (SELECT count(*) FROM organization_slots s
         WHERE s.organization_id = p.organization_id AND s.job_id = j.id) <> 1
UNION ALL
SELECT format('job %s is running but holds %s slots of its pool %s',
              j.id, (SELECT count(*) FROM pool_slots s WHERE s.pool_id = j.pool_id AND s.job_id = j.id),
              q.name)
  FROM jobs j JOIN pools q ON q.id = j.pool_id
 WHERE j.state = 'running'
   AND (SELECT count(*) FROM pool_slots s WHERE s.pool_id = j.pool_id AND s.job_id = j.id) <> 1
UNION ALL
SELECT format('organization %s: slot %s is held by job %s, which is %s, of organization %s',
              o.name, s.slot_no, s.job_id, coalesce(j.state, 'missing'), coalesce(jo.name, '?'))
  FROM organization_slots s JOIN organizations o ON o.id = s.organization_id
  LEFT JOIN jobs j ON j.id = s.job_id
  LEFT JOIN projects p ON p.id = j.project_id LEFT JOIN organizations jo ON jo.id = p.organization_id
 WHERE s.job_id IS NOT NULL
   AND (j.id IS NULL OR j.state <> 'running' OR p.organization_id <> s.organization_id)
UNION ALL
SELECT format('pool %s: slot %s is held by job %s, which is %s, of pool %s',
              q.name, s.slot_no, s.job_id, coalesce(j.state, 'missing'), coalesce(jq.name, '?'))
  FROM pool_slots s JOIN pools q ON q.id = s.pool_id
  LEFT JOIN jobs j ON j.id = s.job_id LEFT JOIN pools jq ON jq.id = j.pool_id
 WHERE s.job_id IS NOT NULL AND (j.id IS NULL OR j.state <> 'running' OR j.pool_id <> s.pool_id)
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
        # the held slots, by holder (which free slot a claim takes is not part of the state)
        "organization_slots": rows("SELECT organization_id, job_id FROM organization_slots "
                                   "WHERE job_id IS NOT NULL ORDER BY organization_id, job_id"),
        "pool_slots": rows("SELECT pool_id, job_id FROM pool_slots "
                           "WHERE job_id IS NOT NULL ORDER BY pool_id, job_id"),
        "targets": rows("SELECT id, state, holder_job_id, held_since FROM targets ORDER BY id"),
        "jobs": rows("SELECT id, state, generation, attempts_made, failures, ready_at, "
                     "finished_at, last_error, pending_dependencies FROM jobs ORDER BY id"),
        "attempts": rows("SELECT id, job_id, generation, state, lease_expires_at, finished_at, "
                         "exit_code FROM attempts ORDER BY id"),
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
 WHERE j.state IN ('succeeded', 'failed', 'cancelled')
   AND (coalesce(pj.running, 0) <> 0
        OR coalesce(pj.successes, 0) > CASE j.state WHEN 'succeeded' THEN 1 ELSE 0 END
        -- a success with no successful attempt only by an operator's word on a lost one
        OR (j.state = 'succeeded' AND coalesce(pj.successes, 0) = 0 AND coalesce(pj.lost, 0) = 0))
"""


def history_violations(conn) -> list[str]:
    """What is wrong in the attempt history: a job whose attempts share a generation or an
    attempt number, two attempts of one job whose ``[claimed_at, finished_at)`` overlap (a
    running attempt's interval never ends), or an ended job with an attempt still running,
    with a successful attempt when it did not succeed, or with other than one when it did
    (none is right only after an operator resolved a lost deployment as succeeded)."""
    return [r["what"] for r in conn.execute(HISTORY_SQL).fetchall()]
