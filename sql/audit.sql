-- name: record_event$
-- Append one audit event (who, what, about what, why); the table refuses UPDATE and DELETE.
SELECT pgd_audit(:actor, :action, :subject, :reason, CAST(:details AS jsonb));

-- name: list_audit_events
-- Audit events newest first, keyset-paginated by id, optionally filtered by actor, action, subject prefix.
SELECT id, at, actor, action, subject, reason, details
  FROM audit_events
 WHERE id < :before_id
   AND (CAST(:actor AS text) IS NULL OR actor = :actor)
   AND (CAST(:action AS text) IS NULL OR action = :action)
   AND (CAST(:subject AS text) IS NULL OR starts_with(subject, :subject))
 ORDER BY id DESC
 LIMIT :limit;

-- name: last_actor$
-- Who last acted on a subject, and when ("alice at 2025-01-31 14:02:03 UTC"), for conflicts.
SELECT pgd_last_actor(:subject);

-- name: list_job_audit
-- A job's own audit trail, oldest first: every event whose subject is the job and every
-- target resolution that decided it (audit_events.job_id, one range of
-- audit_events_job_idx), at most :limit. Read-only.
SELECT id, at, actor, action, subject, reason, details
  FROM audit_events
 WHERE job_id = :job_id
 ORDER BY id
 LIMIT :limit;

-- name: list_job_audit_events
-- The audit log of one job, newest first, keyset-paginated by id, optionally filtered by
-- actor, action, subject prefix: one backward range of audit_events_job_idx, however long
-- the log (the page's job filter). Read-only.
SELECT id, at, actor, action, subject, reason, details
  FROM audit_events
 WHERE job_id = :job_id AND id < :before_id
   AND (CAST(:actor AS text) IS NULL OR actor = :actor)
   AND (CAST(:action AS text) IS NULL OR action = :action)
   AND (CAST(:subject AS text) IS NULL OR starts_with(subject, :subject))
 ORDER BY job_id DESC, id DESC
 LIMIT :limit;

-- name: last_job_resolution^
-- How an operator (resolve_target) or the lost attempt's own late report (late_report)
-- last decided a job whose deployment was lost: outcome, who, when, the note. Read-only.
SELECT e.id, e.at, e.actor, e.action, e.subject, e.reason AS note,
       e.details ->> 'outcome' AS outcome
  FROM audit_events e
 WHERE e.job_id = :job_id AND e.action IN ('resolve_target', 'late_report')
 ORDER BY e.id DESC
 LIMIT 1;

-- name: list_subject_audit_events
-- One subject's audit events, newest first, at most :limit: the subject matched exactly
-- ("project:web" is not "project:web-legacy"), one range of audit_events_subject_idx.
-- Read-only.
SELECT id, at, actor, action, subject, reason, details
  FROM audit_events
 WHERE subject = :subject
 ORDER BY subject, id DESC
 LIMIT :limit;

-- name: job_exists$
-- Whether job :job_id exists (the audit list's job filter names an unknown one). Read-only.
SELECT EXISTS (SELECT 1 FROM jobs WHERE id = :job_id);
