-- 0010_refusals_say_why: an operator action refused because the job or project is not in a
-- state it applies to says why the thing is where it is, not "last action by" whoever wrote
-- the last audit event about it.
--
-- Before: the refusals of cancel, retry and resume named the subject's last audit event.
-- Nothing audits what the system does by itself (a dependency's cancellation cascading, a
-- runner's report, an expiry), so a job cancelled because its dependency was cancelled was
-- refused with "last action by cli:root at <its submit time>", and resuming a project that
-- was never paused said "already running (resumed by another actor)". Now:
--   job 107 is cancelled and cannot be cancelled (dependency 102 cancelled, at 2026-...)
--   job 91 is succeeded and cannot be retried (succeeded at 2026-...)
--   project web is not paused
--   project web is not paused (resumed by alice at 2026-...)
-- The transitions are restated in full (as in 0002) with only their refusal texts changed.

-- A time as the refusals print it (UTC, to the second, as pgd_last_actor does).
CREATE FUNCTION pgd_utc_text(p_at timestamptz) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT to_char(p_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"')
$$;

-- Why a job is in its state, for a refusal: its end (with the recorded reason and time), a
-- cancel already asked for, or what it waits on.
CREATE FUNCTION pgd_job_state_note(v jobs) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN v.state = 'succeeded' THEN format('succeeded at %s', pgd_utc_text(v.finished_at))
        WHEN v.state IN ('failed', 'cancelled') THEN
            format('%s, at %s', coalesce(regexp_replace(left(v.last_error, 200), '\s+', ' ', 'g'), v.state),
                   pgd_utc_text(v.finished_at))
        WHEN v.state = 'running' AND v.cancel_requested_at IS NOT NULL THEN
            format('cancel already requested by %s at %s', v.cancel_requested_by,
                   pgd_utc_text(v.cancel_requested_at))
        WHEN v.state = 'running' THEN 'it is running'
        WHEN v.state = 'uncertain' THEN 'its deployment was lost; its target awaits an operator''s resolution'
        ELSE 'it is waiting to run; jobs explain says on what'
    END
$$;

CREATE OR REPLACE FUNCTION pgd_resume_project(p_project text, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_note text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM projects WHERE name = p_project) THEN
        RAISE EXCEPTION 'unknown project %', p_project USING ERRCODE = 'PD404';
    END IF;
    UPDATE projects SET paused_at = NULL, pause_reason = NULL, paused_by = NULL
     WHERE name = p_project AND paused_at IS NOT NULL;
    IF NOT FOUND THEN
        -- who resumed it, when the last pause or resume on record was a resume
        SELECT CASE WHEN e.action = 'resume_project'
                    THEN format(' (resumed by %s at %s)', e.actor, pgd_utc_text(e.at)) END
          INTO v_note
          FROM audit_events e
         WHERE e.subject = 'project:' || p_project AND e.action IN ('pause_project', 'resume_project')
         ORDER BY e.id DESC LIMIT 1;
        RAISE EXCEPTION 'project % is not paused%', p_project, coalesce(v_note, '')
            USING ERRCODE = 'PDALR';
    END IF;
    PERFORM pgd_audit(p_actor, 'resume_project', 'project:' || p_project, p_reason);
    RETURN jsonb_build_object('project', p_project, 'paused_at', NULL);
END;
$$;

CREATE OR REPLACE FUNCTION pgd_cancel_job(p_job_id bigint, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v jobs%ROWTYPE;
BEGIN
    SELECT * INTO v FROM jobs WHERE id = p_job_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown job %', p_job_id USING ERRCODE = 'PD404';
    END IF;
    IF v.state IN ('blocked', 'queued') THEN
        UPDATE jobs SET state = 'cancelled', finished_at = now(),
                        cancel_requested_at = now(), cancel_requested_by = p_actor,
                        last_error = 'cancelled by ' || p_actor
         WHERE id = p_job_id RETURNING * INTO v;
        PERFORM pgd_cancel_dependents(p_job_id, format('dependency %s cancelled', p_job_id));
    ELSIF v.state = 'running' AND v.cancel_requested_at IS NULL THEN
        UPDATE jobs SET cancel_requested_at = now(), cancel_requested_by = p_actor
         WHERE id = p_job_id RETURNING * INTO v;
    ELSE
        RAISE EXCEPTION 'job % is % and cannot be cancelled (%)', p_job_id, v.state,
            pgd_job_state_note(v) USING ERRCODE = 'PDALR';
    END IF;
    PERFORM pgd_audit(p_actor, 'cancel_job', 'job:' || p_job_id, p_reason);
    RETURN jsonb_build_object('job_id', p_job_id, 'state', v.state,
                              'cancel_requested', v.state = 'running');
END;
$$;

CREATE OR REPLACE FUNCTION pgd_retry_job(p_job_id bigint, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v jobs%ROWTYPE;
BEGIN
    SELECT * INTO v FROM jobs WHERE id = p_job_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown job %', p_job_id USING ERRCODE = 'PD404';
    END IF;
    IF v.state NOT IN ('failed', 'cancelled') THEN
        RAISE EXCEPTION 'job % is % and cannot be retried (%)', p_job_id, v.state,
            pgd_job_state_note(v) USING ERRCODE = 'PDALR';
    END IF;
    IF v.pending_dependencies > 0 OR (v.requires_approval AND v.approved_at IS NULL) THEN
        RAISE EXCEPTION 'job % still waits on a dependency or an approval', p_job_id USING ERRCODE = 'PD409';
    END IF;
    UPDATE jobs SET state = 'queued', ready_at = now(), finished_at = NULL,
                    max_attempts = least(100, greatest(max_attempts, failures + 1)),
                    cancel_requested_at = NULL, cancel_requested_by = NULL
     WHERE id = p_job_id RETURNING * INTO v;
    PERFORM pgd_audit(p_actor, 'retry_job', 'job:' || p_job_id, p_reason);
    RETURN jsonb_build_object('job_id', p_job_id, 'state', v.state);
END;
$$;
