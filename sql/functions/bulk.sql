-- Bulk actions: cancel, retry, approve or reprioritize the jobs an operator previewed
-- (sql/bulk.py: preview_bulk, apply_bulk; docs/design.md, "Bulk actions").
--
-- A bulk action is one audit event (pgd_bulk_begin: action bulk_cancel etc., subject "jobs",
-- the filter, how many jobs were previewed and matched, the reason), written before any job
-- changes, then batches of at most BULK_MAX_BATCH jobs, each its own short transaction
-- (pgd_bulk_apply). Each job of a batch is locked in id order (the lock order among jobs:
-- a job's dependents have larger ids, and every other transaction that locks several jobs
-- takes them upwards too) and changed only when it is still in the state the action
-- expects, and still the attempt generation the preview saw (a claim bumps it: a job claimed
-- since, even one back in the queue after a failure, is skipped). A job that is not is
-- skipped with why, never an error; a job that is changes exactly as the single action
-- changes it (the *_locked helpers of sql/functions/operator.sql) and writes the single
-- action's own audit event, whose details name the bulk event (bulk_event_id).
--
-- Lock waits: the batch waits for a job a claim has locked (FOR NO KEY UPDATE, not SKIP
-- LOCKED), so that it sees the claim's outcome and skips a job that is now running rather
-- than cancelling it as queued. It holds only job rows (and, through pgd_cancel_dependents,
-- the dependents' rows, larger ids again), which no claim waits for: claims skip locked jobs.
--
-- SQLSTATEs: PD404 unknown bulk event, PD403 another actor's bulk event, PD422 bad input.

-- The actions a bulk event may name, and the job states each expects (its skip otherwise).
CREATE OR REPLACE FUNCTION pgd_bulk_actions() RETURNS text[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT ARRAY['cancel', 'retry', 'approve', 'reprioritize']
$$;

-- Why job v cannot take bulk action p_action now (a sentence for the report), or NULL when
-- it can. p_generation: the attempt generation the preview saw (NULL: not checked). The same
-- conditions as the single actions' refusals (pgd_cancel_job's waiting branch,
-- pgd_retry_job, pgd_approve_job, pgd_set_priority).
CREATE OR REPLACE FUNCTION pgd_bulk_refusal(p_action text, v jobs, p_generation bigint,
                                            p_priority integer, p_actor text)
RETURNS text LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_generation IS NOT NULL AND v.generation <> p_generation THEN
        RETURN format('claimed since the preview (%s now: %s)', v.state, pgd_job_state_note(v));
    END IF;
    IF p_action IN ('cancel', 'reprioritize') AND v.state NOT IN ('blocked', 'queued') THEN
        RETURN format('%s: %s', v.state, pgd_job_state_note(v));
    ELSIF p_action = 'reprioritize' AND v.priority = p_priority THEN
        RETURN format('already has priority %s', p_priority);
    ELSIF p_action = 'retry' THEN
        IF v.state NOT IN ('failed', 'cancelled') THEN
            RETURN format('%s: %s', v.state, pgd_job_state_note(v));
        ELSIF v.pending_dependencies > 0 OR (v.requires_approval AND v.approved_at IS NULL) THEN
            RETURN 'still waits on a dependency or an approval';
        END IF;
    ELSIF p_action = 'approve' THEN
        IF NOT v.requires_approval THEN
            RETURN 'does not require approval';
        ELSIF v.approved_at IS NOT NULL OR v.state <> 'blocked' THEN
            RETURN format('already approved or ended (%s, by %s%s)', v.state,
                          coalesce(v.approved_by, pgd_last_actor('job:' || v.id)),
                          CASE WHEN v.state NOT IN ('blocked', 'queued', 'running')
                               THEN '; ' || pgd_job_state_note(v) ELSE '' END);
        END IF;
        RETURN pgd_approver_refusal(v, p_actor);
    END IF;
    RETURN NULL;
END;
$$;

-- Begin a bulk action: its one audit event (action 'bulk_' || p_action, subject 'jobs';
-- details: filter, requested (the jobs previewed and confirmed), truncated (the filter
-- matched more than the preview's bound: these are its first by id), priority for
-- reprioritize). Returns the event's id, which pgd_bulk_apply takes.
CREATE OR REPLACE FUNCTION pgd_bulk_begin(p_action text, p_filter jsonb, p_requested integer,
                                          p_truncated boolean, p_priority integer, p_reason text,
                                          p_actor text)
RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    IF p_action IS NULL OR NOT p_action = ANY (pgd_bulk_actions()) THEN
        RAISE EXCEPTION 'unknown bulk action % (one of %)', p_action,
            array_to_string(pgd_bulk_actions(), ', ') USING ERRCODE = 'PD422';
    END IF;
    IF p_action = 'reprioritize' AND (p_priority IS NULL OR p_priority NOT BETWEEN -1000 AND 1000) THEN
        RAISE EXCEPTION 'reprioritize needs a priority between -1000 and 1000' USING ERRCODE = 'PD422';
    END IF;
    IF p_requested IS NULL OR p_requested NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'a bulk action covers 1 to 10000 jobs' USING ERRCODE = 'PD422';
    END IF;
    IF p_filter IS NULL OR jsonb_typeof(p_filter) <> 'object' THEN
        RAISE EXCEPTION 'the filter must be a JSON object' USING ERRCODE = 'PD422';
    END IF;
    RETURN pgd_audit(p_actor, 'bulk_' || p_action, 'jobs', p_reason,
                     jsonb_build_object('filter', p_filter, 'requested', p_requested,
                                        'truncated', coalesce(p_truncated, false))
                     || CASE WHEN p_action = 'reprioritize'
                             THEN jsonb_build_object('priority', p_priority) ELSE '{}' END);
END;
$$;

-- One batch of bulk action p_bulk_event_id (pgd_bulk_begin's answer, by the same actor): jobs
-- p_job_ids (at most 500; BULK_BATCH in sql/bulk.py is smaller), with the attempt generation
-- the preview saw for each (p_generations, same length; NULL or a NULL element: not
-- checked). Locks each in id order and changes it when it is still in the state the action
-- expects, with its own audit event (details.bulk_event_id), or skips it. One row per
-- distinct job id, in id order: done, the state it is in now, and why when skipped.
CREATE OR REPLACE FUNCTION pgd_bulk_apply(p_bulk_event_id bigint, p_job_ids bigint[],
                                          p_generations bigint[], p_actor text)
RETURNS TABLE (job_id bigint, done boolean, state text, note text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    e audit_events%ROWTYPE;
    v_action text;
    v_priority integer;
    v jobs%ROWTYPE;
    v_from integer;
    v_item record;
    v_refusal text;
BEGIN
    p_actor := pgd_authorize(p_actor, 'operator');
    IF cardinality(p_job_ids) IS NULL OR cardinality(p_job_ids) > 500 THEN
        RAISE EXCEPTION 'a batch holds 1 to 500 jobs' USING ERRCODE = 'PD422';
    END IF;
    IF p_generations IS NOT NULL AND cardinality(p_generations) <> cardinality(p_job_ids) THEN
        RAISE EXCEPTION 'one generation per job, or none' USING ERRCODE = 'PD422';
    END IF;
    SELECT * INTO e FROM audit_events a WHERE a.id = p_bulk_event_id AND a.subject = 'jobs'
       AND a.action LIKE 'bulk\_%';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown bulk action %', p_bulk_event_id USING ERRCODE = 'PD404';
    END IF;
    IF e.actor <> p_actor THEN
        RAISE EXCEPTION 'bulk action % is %''s, not %''s', p_bulk_event_id, e.actor, p_actor
            USING ERRCODE = 'PD403';
    END IF;
    v_action := substr(e.action, 6);
    v_priority := (e.details ->> 'priority')::integer;
    -- a retry may supersede a deployment: the supersede locks before any row (pgd_retry_locked)
    IF v_action = 'retry' THEN
        PERFORM pgd_lock_supersede_scopes(p_job_ids);
    END IF;
    -- id order is lock order; a job named twice is taken once (its first generation)
    FOR v_item IN
        SELECT DISTINCT ON (u.id) u.id, u.generation
          FROM unnest(p_job_ids, coalesce(p_generations, ARRAY[]::bigint[]))
               WITH ORDINALITY AS u(id, generation, ord)
         WHERE u.id IS NOT NULL
         ORDER BY u.id, u.ord
    LOOP
        SELECT * INTO v FROM jobs j WHERE j.id = v_item.id FOR NO KEY UPDATE;
        IF NOT FOUND THEN
            job_id := v_item.id; done := false; state := NULL; note := 'unknown job';
            RETURN NEXT;
            CONTINUE;
        END IF;
        v_refusal := pgd_bulk_refusal(v_action, v, v_item.generation, v_priority, p_actor);
        IF v_refusal IS NOT NULL THEN
            job_id := v.id; done := false; state := v.state; note := v_refusal;
            RETURN NEXT;
            CONTINUE;
        END IF;
        v_from := v.priority;
        IF v_action = 'cancel' THEN
            v := pgd_cancel_waiting(v.id, p_actor);
            PERFORM pgd_audit(p_actor, 'cancel_job', 'job:' || v.id, e.reason,
                              jsonb_build_object('bulk_event_id', e.id));
        ELSIF v_action = 'retry' THEN
            v := pgd_retry_locked(v.id);
            PERFORM pgd_audit(p_actor, 'retry_job', 'job:' || v.id, e.reason,
                              jsonb_build_object('bulk_event_id', e.id));
        ELSIF v_action = 'approve' THEN
            v := pgd_approve_locked(v.id, p_actor);
            PERFORM pgd_audit(p_actor, 'approve_job', 'job:' || v.id, e.reason,
                              jsonb_build_object('bulk_event_id', e.id));
        ELSE
            v := pgd_set_priority_locked(v.id, v_priority);
            PERFORM pgd_audit(p_actor, 'set_priority', 'job:' || v.id, e.reason,
                              jsonb_build_object('bulk_event_id', e.id, 'from', v_from,
                                                 'to', v_priority));
        END IF;
        job_id := v.id; done := true; state := v.state; note := NULL;
        RETURN NEXT;
    END LOOP;
    RETURN;
END;
$$;
