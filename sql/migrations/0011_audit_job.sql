-- 0011_audit_job: each audit event names the job it is about (audit_events.job_id), so that a
-- job has an audit trail of its own: the events whose subject is job:N (submit, approve,
-- cancel, retry) and the target resolutions that decided it (resolve_target, late_report:
-- details.job_id). A stored generated column, so that the events written before it are
-- linked as well, and no transition can write an event about a job without the link.
-- Do not edit: the current schema is sql/schema.sql.

ALTER TABLE audit_events ADD COLUMN job_id bigint GENERATED ALWAYS AS (
    CASE WHEN subject ~ '^job:[0-9]{1,18}$' THEN substr(subject, 5)::bigint
         WHEN details ->> 'job_id' ~ '^[0-9]{1,18}$' THEN (details ->> 'job_id')::bigint
    END) STORED;
CREATE INDEX audit_events_job_idx ON audit_events (job_id, id) WHERE job_id IS NOT NULL;
