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
