-- name: submit_job^
-- Enqueue one job after validating project, pool grant, target and dependencies; see pgd_submit.
SELECT * FROM pgd_submit(:project, :pool, :target, CAST(:command AS text[]), :priority,
                         :max_attempts, :timeout_seconds, :delay_seconds, :requires_approval,
                         CAST(:depends_on AS bigint[]), :idempotency_key, :submitted_by);

-- name: get_job^
-- One job with the names of its project, organization, pool and target. Read-only.
SELECT j.*, p.name AS project, o.id AS organization_id, o.name AS organization,
       q.name AS pool, t.name AS target,
       ARRAY(SELECT d.depends_on_job_id FROM job_dependencies d
              WHERE d.job_id = j.id ORDER BY 1) AS depends_on
  FROM jobs j
  JOIN projects p ON p.id = j.project_id
  JOIN organizations o ON o.id = p.organization_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 WHERE j.id = :job_id;

-- name: list_pending_dependencies
-- The dependencies of a job that have not succeeded yet. Read-only.
SELECT u.id, u.state, p.name AS project
  FROM job_dependencies d JOIN jobs u ON u.id = d.depends_on_job_id
  JOIN projects p ON p.id = u.project_id
 WHERE d.job_id = :job_id AND u.state <> 'succeeded'
 ORDER BY u.id;

-- name: approve_job$
-- Approve a job that requires approval (conditional, audited); see pgd_approve_job.
SELECT pgd_approve_job(:job_id, :reason, :actor);

-- name: cancel_job$
-- Cancel a waiting job, or ask the runner of a running one to stop (conditional, audited).
SELECT pgd_cancel_job(:job_id, :reason, :actor);

-- name: retry_job$
-- Queue a failed or cancelled job again (conditional, audited); see pgd_retry_job.
SELECT pgd_retry_job(:job_id, :reason, :actor);

-- name: list_waiting_jobs
-- Jobs not running and not finished, oldest first, keyset-paginated by id, with optional filters.
SELECT j.id, j.state, j.priority, j.ready_at, j.created_at, j.requires_approval, j.approved_at,
       j.pending_dependencies, j.failures, j.max_attempts, j.target_id, j.pool_id, j.project_id,
       j.command, p.name AS project, o.id AS organization_id, o.name AS organization,
       q.name AS pool, t.name AS target
  FROM jobs j
  JOIN projects p ON p.id = j.project_id
  JOIN organizations o ON o.id = p.organization_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 WHERE j.state IN ('blocked', 'queued', 'uncertain')
   AND j.id > :after_id
   AND (CAST(:organization AS text) IS NULL OR o.name = :organization)
   AND (CAST(:project AS text) IS NULL OR p.name = :project)
   AND (CAST(:pool AS text) IS NULL OR q.name = :pool)
 ORDER BY j.id
 LIMIT :limit;

-- name: list_recent_jobs
-- The most recently created jobs of any state (or one), newest first, keyset-paginated by id.
SELECT j.id, j.state, j.priority, j.created_at, j.started_at, j.finished_at, j.last_error,
       j.command, p.name AS project, q.name AS pool, t.name AS target
  FROM jobs j
  JOIN projects p ON p.id = j.project_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 WHERE (CAST(:state AS text) IS NULL OR j.state = :state)
   AND j.id < :before_id
 ORDER BY j.id DESC
 LIMIT :limit;

-- name: count_jobs_by_state
-- Jobs in each active state, and jobs finished in the last hour by state (overview, metrics);
-- each count goes through a partial or range index, so history size does not matter.
SELECT s.state, (SELECT count(*) FROM jobs j WHERE j.state = s.state) AS n
  FROM unnest(ARRAY['blocked', 'queued', 'running', 'uncertain']) AS s(state)
UNION ALL
SELECT s.state, (SELECT count(*) FROM jobs j
                  WHERE j.finished_at > now() - interval '1 hour' AND j.state = s.state) AS n
  FROM unnest(ARRAY['succeeded', 'failed', 'cancelled']) AS s(state);
