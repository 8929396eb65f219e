-- name: resolve_target$
-- Resolve an uncertain target (succeeded | failed | retry, note required; conditional, audited).
SELECT pgd_resolve_target(:target, :outcome, :note, :actor);

-- name: list_targets
-- Targets, uncertain first, with the holding job, its project, for how long it is held
-- (seconds, by the database clock), and the evidence of its last attempt.
SELECT t.id, t.name, t.state, t.holder_job_id, t.held_since, p.name AS holder_project,
       extract(epoch FROM now() - t.held_since)::float8 AS held_seconds,
       t.requires_approval, t.approver_role, t.supersede, t.deploy_order,
       ARRAY(SELECT x.name FROM project_target_supersede s JOIN projects x ON x.id = s.project_id
              WHERE s.target_id = t.id ORDER BY x.name) AS supersede_projects,
       a.id AS attempt_id, a.state AS attempt_state, a.last_heartbeat_at, a.lease_expires_at,
       r.name AS runner_name, r.hostname AS runner_hostname,
       right(a.output_tail, 4096) AS output_tail
  FROM targets t
  LEFT JOIN jobs j ON j.id = t.holder_job_id
  LEFT JOIN projects p ON p.id = j.project_id
  LEFT JOIN LATERAL (SELECT * FROM attempts x WHERE x.job_id = j.id
                      ORDER BY x.attempt_no DESC LIMIT 1) a ON true
  LEFT JOIN runners r ON r.id = a.runner_id
 ORDER BY (t.state = 'uncertain') DESC, (t.state = 'held') DESC, t.name;

-- name: list_target_heads
-- Each target's head (its next deployment: pgd_target_head, sql/functions/claim.sql) and how
-- many ready deployments wait for it, for the targets that have one. Read-only; a probe of
-- jobs_target_queue_idx per target.
SELECT t.id AS target_id, h.head_job_id
  FROM targets t
 CROSS JOIN LATERAL (SELECT pgd_target_head(t.id) AS head_job_id) h
 WHERE h.head_job_id IS NOT NULL;

-- name: list_target_waiting
-- The deployments to target :target_id still waiting (queued or blocked), what runs next
-- first: the ready ones (queued, ready_at reached, project not paused: pgd_target_head's
-- ready) in the target's order, as claims take them (priority DESC, then id in the target's
-- direction), then the others in the same order; at most :limit, each with its project and
-- pool and whether it is ready. Read-only.
SELECT j.*, p.name AS project, q.name AS pool,
       (j.state = 'queued' AND j.ready_at <= now() AND p.paused_at IS NULL) AS is_ready
  FROM jobs j
  JOIN projects p ON p.id = j.project_id
  JOIN pools q ON q.id = j.pool_id
 WHERE j.target_id = :target_id AND j.state IN ('queued', 'blocked')
 ORDER BY (j.state = 'queued' AND j.ready_at <= now() AND p.paused_at IS NULL) DESC,
          j.priority DESC,
          CASE WHEN :newest_first THEN -j.id ELSE j.id END
 LIMIT :limit;

-- name: count_target_waiting$
-- How many deployments to target :target_id wait (queued or blocked). Read-only.
SELECT count(*) FROM jobs WHERE target_id = :target_id AND state IN ('queued', 'blocked');

-- name: list_target_superseded
-- The latest deployments to target :target_id that ended superseded, newest first, with the
-- job that superseded each (from its audit event), at most :limit (jobs_target_superseded_idx).
-- Read-only.
SELECT j.id, p.name AS project, j.finished_at, (e.details ->> 'superseded_by')::bigint AS superseded_by
  FROM jobs j
  JOIN projects p ON p.id = j.project_id
  LEFT JOIN LATERAL (SELECT a.details FROM audit_events a
                      WHERE a.job_id = j.id AND a.action = 'supersede'
                      ORDER BY a.id DESC LIMIT 1) e ON true
 WHERE j.target_id = :target_id AND j.state = 'superseded'
 ORDER BY j.id DESC
 LIMIT :limit;

-- name: count_target_superseded$
-- How many deployments to target :target_id ended superseded, ever, and in the last hour
-- (jobs_target_superseded_idx: an index-only count). Read-only.
SELECT jsonb_build_object('total', count(*),
                          'last_hour', count(*) FILTER (WHERE finished_at > now() - interval '1 hour'))
  FROM jobs WHERE target_id = :target_id AND state = 'superseded';

-- name: recent_target_resolution^
-- The latest operator resolution of a target within the last :within_seconds, with its age by
-- the database clock (the demo's chaos runner holds off after one); the time index bounds it.
SELECT subject, actor, at, extract(epoch FROM now() - at)::float8 AS age_seconds
  FROM audit_events
 WHERE at > now() - make_interval(secs => :within_seconds) AND action = 'resolve_target'
 ORDER BY at DESC
 LIMIT 1;
