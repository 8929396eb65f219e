-- Operator actions: pause and resume a project or a pool, drain and resume a runner,
-- approve, cancel and retry a job, resolve an uncertain target. Each is one short transaction, conditional on the state the operator
-- saw, so that of two operators acting at once one wins and the other is told why the
-- subject is where it is (PDALR "already ... by alice at ...", or PD409 with the job's
-- state note: "job 107 is cancelled and cannot be cancelled (dependency 102 cancelled, at
-- ...)"). Every action is audited (pgd_audit, sql/functions/audit.sql) with the actor the
-- caller authenticated. A pause or a bound change waits for the project's claims in flight
-- (trigger pgd_project_claims_fence, sql/functions/capacity.sql).
--
-- SQLSTATEs raised, translated to Python exceptions in sql/errors.py:
--   PD404 unknown entity          PD409 state is not the one the action expects
--   PD422 invalid input           PDALR another actor already moved it on
--   PD403 an approver the target's rule does not allow (pgd_check_approver)

-- A time as the refusals print it (UTC, to the second, as pgd_last_actor does).
CREATE OR REPLACE FUNCTION pgd_utc_text(p_at timestamptz) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT to_char(p_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"')
$$;

-- Raises PD422 "a reason is required to <p_to>" when p_reason is NULL or blank: the check
-- of every action whose reason is mandatory (pause a project or a pool, drain a runner).
CREATE OR REPLACE FUNCTION pgd_require_reason(p_reason text, p_to text) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_reason IS NULL OR btrim(p_reason) = '' THEN
        RAISE EXCEPTION 'a reason is required to %', p_to USING ERRCODE = 'PD422';
    END IF;
END;
$$;

-- Why p_subject ('project:web', 'pool:linux', 'runner:7') is not paused now, for a
-- resume's refusal: ' (resumed by alice at 2026-03-01 14:02:00 UTC)' when the last of its
-- p_pause and p_resume audit events (actions such as 'pause_pool', 'resume_pool') is a
-- resume, else '' (never paused, or paused and resumed with no event on record). One read
-- of audit_events_subject_idx.
CREATE OR REPLACE FUNCTION pgd_resumed_note(p_subject text, p_pause text, p_resume text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT CASE WHEN e.action = p_resume
                                 THEN format(' (resumed by %s at %s)', e.actor, pgd_utc_text(e.at)) END
                       FROM audit_events e
                      WHERE e.subject = p_subject AND e.action IN (p_pause, p_resume)
                      ORDER BY e.id DESC LIMIT 1), '')
$$;

-- Why a job is in its state, for a refusal: its end (with the recorded reason and time), a
-- cancel already asked for, or what it waits on.
CREATE OR REPLACE FUNCTION pgd_job_state_note(v jobs) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN v.state = 'succeeded' THEN format('succeeded at %s', pgd_utc_text(v.finished_at))
        WHEN v.state IN ('failed', 'cancelled', 'superseded') THEN
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

-- pause / resume a project: conditional on the state the operator saw, audited.
CREATE OR REPLACE FUNCTION pgd_pause_project(p_project text, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v projects%ROWTYPE;
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    PERFORM pgd_require_reason(p_reason, 'pause a project');
    SELECT * INTO v FROM projects WHERE name = p_project;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown project %', p_project USING ERRCODE = 'PD404';
    END IF;
    UPDATE projects SET paused_at = now(), pause_reason = p_reason, paused_by = p_actor
     WHERE id = v.id AND paused_at IS NULL
    RETURNING * INTO v;
    IF NOT FOUND THEN
        SELECT * INTO v FROM projects WHERE name = p_project;
        RAISE EXCEPTION 'project % is already paused by %', p_project, pgd_last_actor('project:' || p_project)
            USING ERRCODE = 'PDALR';
    END IF;
    PERFORM pgd_audit(p_actor, 'pause_project', 'project:' || p_project, p_reason);
    RETURN jsonb_build_object('project', p_project, 'paused_at', v.paused_at, 'paused_by', p_actor);
END;
$$;

CREATE OR REPLACE FUNCTION pgd_resume_project(p_project text, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    IF NOT EXISTS (SELECT 1 FROM projects WHERE name = p_project) THEN
        RAISE EXCEPTION 'unknown project %', p_project USING ERRCODE = 'PD404';
    END IF;
    UPDATE projects SET paused_at = NULL, pause_reason = NULL, paused_by = NULL
     WHERE name = p_project AND paused_at IS NOT NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'project % is not paused%', p_project,
            pgd_resumed_note('project:' || p_project, 'pause_project', 'resume_project')
            USING ERRCODE = 'PDALR';
    END IF;
    PERFORM pgd_audit(p_actor, 'resume_project', 'project:' || p_project, p_reason);
    -- its queued jobs are claimable again without changing state, so no trigger wakes anyone:
    -- the pools' broadcast does (sql/functions/submit.sql, "Wake-ups"); a resume is rare
    IF coalesce(current_setting('pgdispatch.notify', true), '') <> 'off' THEN
        PERFORM pg_notify('pgdispatch_queued', pp.pool_id::text)
           FROM project_pools pp JOIN projects p ON p.id = pp.project_id
          WHERE p.name = p_project;
    END IF;
    RETURN jsonb_build_object('project', p_project, 'paused_at', NULL);
END;
$$;

-- The role p_actor acts with, for a rule that names one ('viewer' | 'operator' | 'admin'),
-- or NULL when it has none. The actor is who pgd_authorize (sql/functions/audit.sql)
-- decided acts: a database login acting as itself (p_actor = session_user) has the role of
-- its group (pgdispatch_admin, pgdispatch_operator; a superuser or a member of
-- pgdispatch_owner counts as admin); a console user named by the web login has the role of
-- its enabled users row.
CREATE OR REPLACE FUNCTION pgd_actor_role(p_actor text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN p_actor = session_user THEN
            CASE WHEN pgd_login_is_unbound(p_actor) THEN 'admin'
                 WHEN pg_has_role(session_user, 'pgdispatch_admin', 'MEMBER') THEN 'admin'
                 WHEN pg_has_role(session_user, 'pgdispatch_operator', 'MEMBER') THEN 'operator'
            END
        ELSE (SELECT u.role FROM users u WHERE u.username = p_actor AND u.disabled_at IS NULL)
    END
$$;

-- A protected target's rule for approving job v (sql/schema.sql, targets.requires_approval):
-- nobody approves a deployment they submitted, and the approver of a deployment to a
-- protected target holds its approver_role. The rule p_actor breaks, as a sentence, or NULL
-- when it may approve (a bulk approve skips the job with it: sql/functions/bulk.sql).
CREATE OR REPLACE FUNCTION pgd_approver_refusal(v jobs, p_actor text) RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t targets%ROWTYPE;
    v_role text;
BEGIN
    IF v.target_id IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT * INTO t FROM targets WHERE id = v.target_id;
    IF v.submitted_by = p_actor THEN
        RETURN format('%s submitted job %s (a deployment to target %s) and cannot approve it; another %s must',
            p_actor, v.id, t.name, CASE WHEN t.requires_approval THEN t.approver_role ELSE 'operator' END);
    END IF;
    IF t.requires_approval THEN
        v_role := pgd_actor_role(p_actor);
        IF coalesce(array_position(ARRAY['viewer', 'operator', 'admin'], v_role), 0)
           < array_position(ARRAY['viewer', 'operator', 'admin'], t.approver_role) THEN
            RETURN format('target %s requires approval by %s; %s %s',
                t.name, CASE t.approver_role WHEN 'admin' THEN 'an admin' ELSE 'an operator' END,
                p_actor, CASE v_role WHEN 'admin' THEN 'is an admin' WHEN 'operator' THEN 'is an operator'
                                     WHEN 'viewer' THEN 'is a viewer' ELSE 'has no role' END);
        END IF;
    END IF;
    RETURN NULL;
END;
$$;

-- Raises PD403 with the rule pgd_approver_refusal names, when p_actor may not approve v.
CREATE OR REPLACE FUNCTION pgd_check_approver(v jobs, p_actor text) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_refusal text := pgd_approver_refusal(v, p_actor);
BEGIN
    IF v_refusal IS NOT NULL THEN
        RAISE EXCEPTION '%', v_refusal USING ERRCODE = 'PD403';
    END IF;
END;
$$;

-- The change an approval makes to job p_job_id, which the caller has locked and checked
-- (pgd_approve_job; the bulk approve, sql/functions/bulk.sql): queued unless a dependency is
-- pending. Returns the row as it is now.
CREATE OR REPLACE FUNCTION pgd_approve_locked(p_job_id bigint, p_actor text) RETURNS jobs
LANGUAGE sql AS $$
    UPDATE jobs
       SET approved_at = now(), approved_by = p_actor,
           state = CASE WHEN pending_dependencies = 0 THEN 'queued' ELSE 'blocked' END,
           ready_at = CASE WHEN pending_dependencies = 0 THEN now() ELSE ready_at END
     WHERE id = p_job_id
    RETURNING *
$$;

-- approve a job that requires approval; it becomes queued if no dependency is pending.
-- A deployment's submitter cannot approve it, and a protected target's approver must hold
-- its approver_role (pgd_check_approver: PD403).
CREATE OR REPLACE FUNCTION pgd_approve_job(p_job_id bigint, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v jobs%ROWTYPE;
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    SELECT * INTO v FROM jobs WHERE id = p_job_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown job %', p_job_id USING ERRCODE = 'PD404';
    END IF;
    IF NOT v.requires_approval THEN
        RAISE EXCEPTION 'job % does not require approval', p_job_id USING ERRCODE = 'PD409';
    END IF;
    IF v.approved_at IS NOT NULL OR v.state <> 'blocked' THEN
        -- an ended job also says why it ended (superseded by which job, cancelled why)
        RAISE EXCEPTION 'job % is already approved or ended (%, by %)', p_job_id, v.state,
            coalesce(v.approved_by, pgd_last_actor('job:' || p_job_id))
            || CASE WHEN v.state NOT IN ('blocked', 'queued', 'running')
                 THEN '; ' || pgd_job_state_note(v) ELSE '' END USING ERRCODE = 'PDALR';
    END IF;
    PERFORM pgd_check_approver(v, p_actor);
    v := pgd_approve_locked(p_job_id, p_actor);
    PERFORM pgd_audit(p_actor, 'approve_job', 'job:' || p_job_id, p_reason);
    RETURN jsonb_build_object('job_id', p_job_id, 'state', v.state);
END;
$$;

-- The change a cancel makes to waiting job p_job_id (blocked or queued), which the caller
-- has locked and checked (pgd_cancel_job; the bulk cancel, sql/functions/bulk.sql): it ends
-- cancelled, and its waiting dependents with it. Returns the row as it is now.
CREATE OR REPLACE FUNCTION pgd_cancel_waiting(p_job_id bigint, p_actor text) RETURNS jobs
LANGUAGE plpgsql AS $$
DECLARE
    v jobs%ROWTYPE;
BEGIN
    UPDATE jobs SET state = 'cancelled', finished_at = now(),
                    cancel_requested_at = now(), cancel_requested_by = p_actor,
                    last_error = 'cancelled by ' || p_actor
     WHERE id = p_job_id RETURNING * INTO v;
    PERFORM pgd_cancel_dependents(p_job_id, format('dependency %s cancelled', p_job_id));
    RETURN v;
END;
$$;

CREATE OR REPLACE FUNCTION pgd_cancel_job(p_job_id bigint, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v jobs%ROWTYPE;
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    SELECT * INTO v FROM jobs WHERE id = p_job_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown job %', p_job_id USING ERRCODE = 'PD404';
    END IF;
    IF v.state IN ('blocked', 'queued') THEN
        v := pgd_cancel_waiting(p_job_id, p_actor);
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

-- The change an operator's retry makes to failed or cancelled job p_job_id, which the
-- caller has locked and checked (pgd_retry_job; the bulk retry, sql/functions/bulk.sql).
-- An approval covers a submission and its automatic retries; an operator's re-run of a
-- deployment to a protected target is a new deployment and waits for a new approval.
-- On a superseding target the retried deployment is a deployment like a new one: it ends
-- superseded when a newer one exists (pgd_supersede_stale), else it supersedes the older
-- ones still waiting in its scope (pgd_supersede_older, keeping what it waits for), as a
-- submit would. The caller holds the target's supersede lock (pgd_lock_supersede_scopes).
-- The older rows are locked after this one, against the jobs-by-id lock order: a bulk
-- action holding one of them meanwhile makes a deadlock that PostgreSQL detects and the
-- transaction's retry runs again (sql/db.py, RETRYABLE).
-- Returns the row as it is now.
CREATE OR REPLACE FUNCTION pgd_retry_locked(p_job_id bigint) RETURNS jobs
LANGUAGE plpgsql AS $$
DECLARE
    v jobs%ROWTYPE;
    v_protected boolean;
    v_scope text;
BEGIN
    SELECT coalesce(t.requires_approval, false) INTO v_protected
      FROM jobs j LEFT JOIN targets t ON t.id = j.target_id WHERE j.id = p_job_id;
    UPDATE jobs SET state = CASE WHEN v_protected THEN 'blocked' ELSE 'queued' END,
                    ready_at = now(), finished_at = NULL,
                    max_attempts = least(100, greatest(max_attempts, failures + 1)),
                    cancel_requested_at = NULL, cancel_requested_by = NULL,
                    requires_approval = requires_approval OR v_protected,
                    approved_at = CASE WHEN v_protected THEN NULL ELSE approved_at END,
                    approved_by = CASE WHEN v_protected THEN NULL ELSE approved_by END
     WHERE id = p_job_id RETURNING * INTO v;
    -- a deployment older than a newer one to its superseding target ends superseded instead
    IF pgd_supersede_stale(p_job_id) IS NOT NULL THEN
        SELECT * INTO v FROM jobs WHERE id = p_job_id;
    ELSIF v.target_id IS NOT NULL THEN
        -- else the older ones waiting in its scope end superseded by it
        v_scope := pgd_supersede_scope(v.project_id, v.target_id);
        IF v_scope IS NOT NULL THEN
            PERFORM pgd_supersede_older(p_job_id, v.target_id,
                                        (SELECT t.name FROM targets t WHERE t.id = v.target_id),
                                        CASE WHEN v_scope = 'project' THEN v.project_id END,
                                        pgd_upstream_jobs(ARRAY[p_job_id]));
        END IF;
    END IF;
    RETURN v;
END;
$$;

CREATE OR REPLACE FUNCTION pgd_retry_job(p_job_id bigint, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v jobs%ROWTYPE;
    v_winner text;
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    PERFORM pgd_lock_supersede_scopes(ARRAY[p_job_id]);
    SELECT * INTO v FROM jobs WHERE id = p_job_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown job %', p_job_id USING ERRCODE = 'PD404';
    END IF;
    IF v.state NOT IN ('failed', 'cancelled') THEN
        -- of two operators retrying at once, the loser hears who won and when: the last
        -- retry of this job (an operator's, or a resolution's "run it again") since its
        -- last attempt ended, if any (audit_events_job_idx; the winner committed before
        -- this transaction got the job's lock, and this statement sees what committed)
        SELECT format('already retried by %s at %s; ', e.actor, pgd_utc_text(e.at)) INTO v_winner
          FROM audit_events e
         WHERE e.job_id = p_job_id
           AND (e.action = 'retry_job'
                OR (e.action = 'resolve_target' AND e.details ->> 'outcome' = 'retry'))
           AND e.at >= coalesce((SELECT max(a.finished_at) FROM attempts a WHERE a.job_id = p_job_id),
                                '-infinity')
         ORDER BY e.id DESC LIMIT 1;
        RAISE EXCEPTION 'job % is % and cannot be retried (%)', p_job_id, v.state,
            coalesce(v_winner, '') || pgd_job_state_note(v) USING ERRCODE = 'PDALR';
    END IF;
    IF v.pending_dependencies > 0 OR (v.requires_approval AND v.approved_at IS NULL) THEN
        RAISE EXCEPTION 'job % still waits on a dependency or an approval', p_job_id USING ERRCODE = 'PD409';
    END IF;
    v := pgd_retry_locked(p_job_id);
    PERFORM pgd_audit(p_actor, 'retry_job', 'job:' || p_job_id, p_reason);
    RETURN jsonb_build_object('job_id', p_job_id, 'state', v.state);
END;
$$;

-- set the priority of a waiting job (blocked or queued): conditional on it still waiting
-- and on the priority being another, audited with the old and the new one. The claim orders
-- a project's queued jobs by priority, then id (jobs_claim_idx), so a queued job's new
-- priority counts from the next claim on; a running or ended job keeps the one it had.
CREATE OR REPLACE FUNCTION pgd_set_priority(p_job_id bigint, p_priority integer, p_reason text,
                                            p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v jobs%ROWTYPE;
    v_from integer;
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    IF p_priority IS NULL OR p_priority NOT BETWEEN -1000 AND 1000 THEN
        RAISE EXCEPTION 'priority must be a whole number between -1000 and 1000' USING ERRCODE = 'PD422';
    END IF;
    SELECT * INTO v FROM jobs WHERE id = p_job_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown job %', p_job_id USING ERRCODE = 'PD404';
    END IF;
    IF v.state NOT IN ('blocked', 'queued') THEN
        RAISE EXCEPTION 'job % is % and its priority cannot change (%)', p_job_id, v.state,
            pgd_job_state_note(v) USING ERRCODE = 'PDALR';
    END IF;
    IF v.priority = p_priority THEN
        RAISE EXCEPTION 'job % already has priority % (set by %)', p_job_id, p_priority,
            pgd_last_actor('job:' || p_job_id) USING ERRCODE = 'PDALR';
    END IF;
    v_from := v.priority;
    v := pgd_set_priority_locked(p_job_id, p_priority);
    PERFORM pgd_audit(p_actor, 'set_priority', 'job:' || p_job_id, p_reason,
                      jsonb_build_object('from', v_from, 'to', p_priority));
    RETURN jsonb_build_object('job_id', p_job_id, 'state', v.state, 'priority', v.priority,
                              'previous_priority', v_from);
END;
$$;

-- The change pgd_set_priority makes to job p_job_id, which the caller has locked and checked
-- (also the bulk reprioritize, sql/functions/bulk.sql). Returns the row as it is now.
CREATE OR REPLACE FUNCTION pgd_set_priority_locked(p_job_id bigint, p_priority integer) RETURNS jobs
LANGUAGE sql AS $$
    UPDATE jobs SET priority = p_priority WHERE id = p_job_id RETURNING *
$$;

-- resolve an uncertain target: the operator says whether the lost deployment happened
-- (succeeded), did not (failed), or should run again (retry). Conditional on the target still
-- being uncertain, so of two operators one wins and the other hears who did it. Audited.
CREATE OR REPLACE FUNCTION pgd_resolve_target(p_target text, p_outcome text, p_note text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_target targets%ROWTYPE;
    v_job    jobs%ROWTYPE;
    v_state  text;
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    IF p_outcome NOT IN ('succeeded', 'failed', 'retry') THEN
        RAISE EXCEPTION 'outcome must be succeeded, failed or retry, got %', p_outcome USING ERRCODE = 'PD422';
    END IF;
    IF p_note IS NULL OR btrim(p_note) = '' THEN
        RAISE EXCEPTION 'a note is required to resolve a target' USING ERRCODE = 'PD422';
    END IF;
    SELECT * INTO v_target FROM targets WHERE name = p_target;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown target %', p_target USING ERRCODE = 'PD404';
    END IF;
    IF v_target.state <> 'uncertain' THEN
        IF NOT EXISTS (SELECT 1 FROM audit_events WHERE subject = 'target:' || p_target) THEN
            RAISE EXCEPTION 'target % is %: it is not uncertain, there is nothing to resolve',
                p_target, v_target.state USING ERRCODE = 'PD409';
        END IF;
        RAISE EXCEPTION 'target % is % (already resolved by %)', p_target, v_target.state,
            pgd_last_actor('target:' || p_target) USING ERRCODE = 'PDALR';
    END IF;
    -- lock order: the supersede lock, then job before target
    IF p_outcome = 'retry' THEN
        PERFORM pgd_lock_supersede_scopes(ARRAY[v_target.holder_job_id]);
    END IF;
    SELECT * INTO v_job FROM jobs WHERE id = v_target.holder_job_id FOR NO KEY UPDATE;
    SELECT * INTO v_target FROM targets WHERE id = v_target.id FOR NO KEY UPDATE;
    IF v_target.state <> 'uncertain' OR v_job.state <> 'uncertain' THEN
        RAISE EXCEPTION 'target % is % (already resolved by %)', p_target, v_target.state,
            pgd_last_actor('target:' || p_target) USING ERRCODE = 'PDALR';
    END IF;
    -- a re-run on a protected target waits for a new approval, as an operator's retry does
    v_state := CASE WHEN p_outcome <> 'retry' THEN p_outcome
                    WHEN v_target.requires_approval THEN 'blocked' ELSE 'queued' END;
    UPDATE jobs
       SET state = v_state,
           ready_at = CASE WHEN v_state IN ('queued', 'blocked') THEN now() ELSE ready_at END,
           finished_at = CASE WHEN v_state IN ('queued', 'blocked') THEN NULL ELSE now() END,
           max_attempts = CASE WHEN v_state IN ('queued', 'blocked')
                               THEN least(100, greatest(max_attempts, failures + 1)) ELSE max_attempts END,
           requires_approval = requires_approval OR v_state = 'blocked',
           approved_at = CASE WHEN v_state = 'blocked' THEN NULL ELSE approved_at END,
           approved_by = CASE WHEN v_state = 'blocked' THEN NULL ELSE approved_by END,
           -- the operator's word is the outcome, not an error: "it succeeded" undoes the
           -- failure the lost attempt was counted as, and clears the lease's error. The
           -- resolution itself (who, when, the note) is the audit event below, which names
           -- the job (audit_events.job_id): the job's page shows it from there.
           failures = CASE WHEN v_state = 'succeeded' THEN greatest(failures - 1, 0) ELSE failures END,
           last_error = CASE WHEN v_state = 'succeeded' THEN NULL ELSE last_error END
     WHERE id = v_job.id;
    UPDATE targets SET state = 'free', holder_job_id = NULL, held_since = NULL WHERE id = v_target.id;
    IF v_state = 'succeeded' THEN
        PERFORM pgd_release_dependents(v_job.id);
    ELSIF v_state = 'failed' THEN
        PERFORM pgd_cancel_dependents(v_job.id, format('dependency %s failed', v_job.id));
    END IF;
    PERFORM pgd_audit(p_actor, 'resolve_target', 'target:' || p_target, p_note,
                      jsonb_build_object('outcome', p_outcome, 'job_id', v_job.id));
    -- a re-run older than a newer deployment to a superseding target ends superseded
    IF v_state IN ('queued', 'blocked') AND pgd_supersede_stale(v_job.id) IS NOT NULL THEN
        v_state := 'superseded';
    END IF;
    RETURN jsonb_build_object('target', p_target, 'outcome', p_outcome, 'job_id', v_job.id,
                              'job_state', v_state);
END;
$$;

-- Steering the fleet (issue 20): pause / resume a pool, drain / resume a runner. Each is
-- conditional on the state the operator saw (PDALR says who moved it and when), audited,
-- and fenced against the claims in flight so that its effect starts at the time it
-- records: paused_at and drain_requested_at are the clock after the fence, and no claim
-- that did not see the pause or the drain has an attempt claimed after that time
-- (tests/faults/consistency.py checks it by these times). docs/operations.md, "Steering
-- the fleet", is the operator's page.

-- pause a pool: no claim takes from it until it is resumed; its waiting jobs explain
-- pool_paused with who, when and why; running jobs go on, approvals still work (the job
-- then waits on the pause). Lock order: the pool row (FOR NO KEY UPDATE: a job's or a
-- runner's foreign key check takes only KEY SHARE, so submits and claims never wait for it),
-- then every stripe of the pool FOR UPDATE in stripe order, as a limit change takes them
-- (sql/functions/capacity.sql): that waits for each claim holding one of the pool's slots
-- and makes the others skip the stripes until the commit; a claim re-reads the pause after
-- taking its stripe (pgd_pool_is_paused, sql/functions/claim.sql, says why that is safe).
-- Raises PD422 without a reason, PD404 for an unknown pool, PDALR when already paused.
CREATE OR REPLACE FUNCTION pgd_pause_pool(p_pool text, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v  pools%ROWTYPE;
    v_at timestamptz;
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    PERFORM pgd_require_reason(p_reason, 'pause a pool');
    SELECT * INTO v FROM pools WHERE name = p_pool FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown pool %', p_pool USING ERRCODE = 'PD404';
    END IF;
    IF v.paused_at IS NOT NULL THEN
        RAISE EXCEPTION 'pool % is already paused by % at %: %', p_pool, v.paused_by,
            pgd_utc_text(v.paused_at), v.pause_reason USING ERRCODE = 'PDALR';
    END IF;
    -- the fence: every slot of the pool, in stripe order (waits for the claims holding one)
    PERFORM s.stripe_no FROM capacity_stripes s
      WHERE s.kind = 'pool' AND s.owner_id = v.id ORDER BY s.stripe_no FOR UPDATE;
    v_at := clock_timestamp();
    UPDATE pools SET paused_at = v_at, pause_reason = p_reason, paused_by = p_actor
     WHERE id = v.id;
    PERFORM pgd_audit(p_actor, 'pause_pool', 'pool:' || p_pool, p_reason,
                      jsonb_build_object('paused_at', v_at));
    RETURN jsonb_build_object('pool', p_pool, 'paused_at', v_at, 'paused_by', p_actor,
                              'pause_reason', p_reason);
END;
$$;

-- resume a paused pool; NOTIFYs the pool's broadcast channel, so that its listening
-- schedulers claim at once (as pgd_resume_project does). Raises PD404 for an unknown
-- pool, PDALR when it is not paused (saying who resumed it and when, if someone did).
CREATE OR REPLACE FUNCTION pgd_resume_pool(p_pool text, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v pools%ROWTYPE;
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    SELECT * INTO v FROM pools WHERE name = p_pool FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown pool %', p_pool USING ERRCODE = 'PD404';
    END IF;
    IF v.paused_at IS NULL THEN
        RAISE EXCEPTION 'pool % is not paused%', p_pool,
            pgd_resumed_note('pool:' || p_pool, 'pause_pool', 'resume_pool') USING ERRCODE = 'PDALR';
    END IF;
    UPDATE pools SET paused_at = NULL, pause_reason = NULL, paused_by = NULL WHERE id = v.id;
    PERFORM pgd_audit(p_actor, 'resume_pool', 'pool:' || p_pool, p_reason,
                      jsonb_build_object('paused_at', v.paused_at, 'paused_by', v.paused_by));
    IF coalesce(current_setting('pgdispatch.notify', true), '') <> 'off' THEN
        PERFORM pg_notify('pgdispatch_queued', v.id::text);
    END IF;
    RETURN jsonb_build_object('pool', p_pool, 'paused_at', NULL);
END;
$$;

-- drain a runner: its claims take nothing from now on (pgd_runner_pools), it finishes what
-- it runs, and it shows drained once it runs nothing. p_deadline_seconds (NULL: none; 0 to
-- 604800): after that long, its scheduler hands its running builds back (outcome
-- handed_back: re-queued, no failure counted); deployments are never cut by a drain. The
-- scheduler learns all of it from its next beat (sql/runners.sql, beat_runner), no signal.
-- Kept apart from runners.draining (the scheduler's own shutdown flag, written by every
-- beat). Lock order: the runner row (FOR NO KEY UPDATE: an attempt's foreign key check
-- takes only KEY SHARE), then the runner claim lock EXCLUSIVELY (waits for this runner's
-- claims in flight: pgd_runner_lock_class, sql/functions/claim.sql, says why that is safe),
-- then drain_requested_at is the clock. Raises PD422 for no reason or a deadline out of
-- range, PD404 for an unknown runner, PD409 for a stopped one, PDALR when already draining.
CREATE OR REPLACE FUNCTION pgd_drain_runner(p_runner_id bigint, p_deadline_seconds double precision,
                                            p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v runners%ROWTYPE;
    v_at timestamptz;
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    PERFORM pgd_require_reason(p_reason, 'drain a runner');
    IF p_deadline_seconds IS NOT NULL
       AND NOT (p_deadline_seconds >= 0 AND p_deadline_seconds <= 604800) THEN
        RAISE EXCEPTION 'deadline seconds must be in [0, 604800], got %', p_deadline_seconds
            USING ERRCODE = 'PD422';
    END IF;
    SELECT * INTO v FROM runners WHERE id = p_runner_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown runner %', p_runner_id USING ERRCODE = 'PD404';
    END IF;
    IF v.drain_requested_at IS NOT NULL THEN
        RAISE EXCEPTION 'runner % is already draining (drain asked by % at %: %)', p_runner_id,
            v.drain_requested_by, pgd_utc_text(v.drain_requested_at), v.drain_reason
            USING ERRCODE = 'PDALR';
    END IF;
    IF v.stopped_at IS NOT NULL THEN
        RAISE EXCEPTION 'runner % is % (since %): there is nothing to drain', p_runner_id,
            coalesce(v.stop_reason, 'stopped'), pgd_utc_text(v.stopped_at) USING ERRCODE = 'PD409';
    END IF;
    -- the fence: this runner's claims in flight commit first; later ones wait, then see it
    PERFORM pg_advisory_xact_lock(pgd_runner_lock_class(), pgd_runner_lock_key(v.id));
    v_at := clock_timestamp();
    UPDATE runners
       SET drain_requested_at = v_at, drain_requested_by = p_actor, drain_reason = p_reason,
           drain_deadline = v_at + make_interval(secs => p_deadline_seconds)
     WHERE id = v.id
    RETURNING * INTO v;
    PERFORM pgd_audit(p_actor, 'drain_runner', 'runner:' || v.id, p_reason,
                      jsonb_build_object('drain_requested_at', v_at,
                                         'deadline_seconds', p_deadline_seconds,
                                         'drain_deadline', v.drain_deadline));
    RETURN jsonb_build_object('runner_id', v.id, 'name', v.name, 'drain_requested_at', v_at,
                              'drain_requested_by', p_actor, 'drain_reason', p_reason,
                              'drain_deadline', v.drain_deadline);
END;
$$;

-- resume a drained runner: it claims again. NOTIFYs the runner's own wake-up channel
-- (pgd_runner_channel, sql/functions/wakeups.sql), on which its scheduler beats at once and
-- learns it; else its next beat does. Raises PD404 for an unknown runner, PDALR when it is
-- not drained (saying who resumed it and when, if someone did).
CREATE OR REPLACE FUNCTION pgd_resume_runner(p_runner_id bigint, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v runners%ROWTYPE;
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    SELECT * INTO v FROM runners WHERE id = p_runner_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown runner %', p_runner_id USING ERRCODE = 'PD404';
    END IF;
    IF v.drain_requested_at IS NULL THEN
        RAISE EXCEPTION 'runner % is not drained%', p_runner_id,
            pgd_resumed_note('runner:' || p_runner_id, 'drain_runner', 'resume_runner')
            USING ERRCODE = 'PDALR';
    END IF;
    UPDATE runners
       SET drain_requested_at = NULL, drain_requested_by = NULL, drain_reason = NULL,
           drain_deadline = NULL
     WHERE id = v.id;
    PERFORM pgd_audit(p_actor, 'resume_runner', 'runner:' || v.id, p_reason,
                      jsonb_build_object('drain_requested_at', v.drain_requested_at,
                                         'drain_requested_by', v.drain_requested_by));
    IF coalesce(current_setting('pgdispatch.notify', true), '') <> 'off' THEN
        PERFORM pg_notify(pgd_runner_channel(v.id), 'resume');
    END IF;
    RETURN jsonb_build_object('runner_id', v.id, 'name', v.name, 'drain_requested_at', NULL);
END;
$$;
