-- name: resolve_target$
-- Resolve an uncertain target (succeeded | failed | retry, note required; conditional, audited).
SELECT pgd_resolve_target(:target, :outcome, :note, :actor);

-- name: list_targets
-- Targets, uncertain first, with the holding job, its project, for how long it is held
-- (seconds, by the database clock), and the evidence of its last attempt.
SELECT t.id, t.name, t.state, t.holder_job_id, t.held_since, p.name AS holder_project,
       extract(epoch FROM now() - t.held_since)::float8 AS held_seconds,
       t.requires_approval, t.approver_role,
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

-- name: recent_target_resolution^
-- The latest operator resolution of a target within the last :within_seconds, with its age by
-- the database clock (the demo's chaos runner holds off after one); the time index bounds it.
SELECT subject, actor, at, extract(epoch FROM now() - at)::float8 AS age_seconds
  FROM audit_events
 WHERE at > now() - make_interval(secs => :within_seconds) AND action = 'resolve_target'
 ORDER BY at DESC
 LIMIT 1;
