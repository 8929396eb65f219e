-- Lease expiry: the sweep the holder of the expiry duty runs over every pool, and every
-- scheduler over its own pools when that duty is overdue (scheduler/expiry.py;
-- sql/transitions.py, expire_one).

-- expire_one: end one attempt whose lease lapsed (the database clock decides), or return
-- NULL when there is none. Of the 16 oldest lapsed leases, the first whose job is not
-- locked by another transaction (SKIP LOCKED: every scheduler runs this at once) is taken
-- in lock order job -> target -> attempt and re-checked (a heartbeat or a completion may
-- have won since the read). A build's attempt becomes 'expired': its failure is counted,
-- and the job is queued again with backoff or fails (or is cancelled when a cancel was
-- asked for); its slots are released last. A deployment's attempt becomes 'lost' and the
-- job 'uncertain': its target stays reserved (state 'uncertain') until an operator resolves
-- it (pgd_resolve_target, sql/functions/operator.sql) or the attempt reports late
-- (pgd_complete). One job per transaction, so that a sweep never holds two jobs' locks.
-- Returns {attempt_id, job_id, job_state, is_deployment}, with "failed" added when a lease
-- before it could not be ended (each {attempt_id, job_id, sqlstate, error}; the job's
-- last_error says so too), or only {"failed": [...]} when none could, or NULL when no lease
-- has lapsed. p_pool_ids, when not NULL, limits the sweep to the jobs of those pools (a
-- scheduler's own, in the fallback). A deadlock or serialization failure is raised, for the
-- caller's retry.
CREATE OR REPLACE FUNCTION pgd_expire_one(p_backoff_base_seconds double precision,
                                          p_backoff_cap_seconds double precision,
                                          p_pool_ids bigint[] DEFAULT NULL)
RETURNS jsonb
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    c          record;
    v_job      jobs%ROWTYPE;
    v_attempt  attempts%ROWTYPE;
    v_failures integer;
    v_state    text;
    v_ready_at timestamptz;
    v_failed   jsonb := '[]';
BEGIN
    FOR c IN
        SELECT a.id AS attempt_id, a.job_id, j.project_id, j.pool_id, j.target_id,
               p.organization_id AS org_id
          FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
         WHERE a.state = 'running' AND a.lease_expires_at < clock_timestamp()
           AND (p_pool_ids IS NULL OR j.pool_id = ANY (p_pool_ids))
         ORDER BY a.lease_expires_at
         LIMIT 16
    LOOP
        BEGIN
            SELECT * INTO v_job FROM jobs WHERE id = c.job_id FOR NO KEY UPDATE SKIP LOCKED;
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            IF c.target_id IS NOT NULL THEN
                PERFORM 1 FROM targets WHERE id = c.target_id FOR NO KEY UPDATE;
            END IF;
            SELECT * INTO v_attempt FROM attempts WHERE id = c.attempt_id FOR NO KEY UPDATE;
            -- a heartbeat or a completion may have won the race since the candidate read
            IF v_attempt.state <> 'running' OR v_attempt.lease_expires_at >= clock_timestamp()
               OR v_job.generation <> v_attempt.generation THEN
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;

            v_failures := v_job.failures + 1;
            v_ready_at := v_job.ready_at;
            IF c.target_id IS NOT NULL THEN
                v_state := 'uncertain';
                UPDATE targets SET state = 'uncertain' WHERE id = c.target_id;
            ELSIF v_job.cancel_requested_at IS NOT NULL THEN
                v_state := 'cancelled';
            ELSIF v_failures < v_job.max_attempts THEN
                v_state := 'queued';
                -- at most 30 days from now whatever the settings (pgd_backoff_seconds' clamp).
                -- The caller's backoff settings apply to the jobs of pools its login may take
                -- (every pool for an unbound one); any other job expired by this sweep gets
                -- the defaults (2 s doubling, 300 s cap, as sql/settings.py's), so that one
                -- runner host cannot push back the retries of pools it does not serve.
                v_ready_at := now() + make_interval(secs => CASE
                    WHEN c.pool_id = ANY (pgd_runner_login_pools(session_user))
                    THEN pgd_backoff_seconds(v_failures, p_backoff_base_seconds, p_backoff_cap_seconds)
                    ELSE pgd_backoff_seconds(v_failures, 2, 300) END);
            ELSE
                v_state := 'failed';
            END IF;

            UPDATE jobs
               SET state = v_state, failures = v_failures, ready_at = v_ready_at,
                   finished_at = CASE WHEN v_state IN ('failed', 'cancelled') THEN now() END,
                   last_error = format('lease of attempt %s expired', c.attempt_id)
             WHERE id = c.job_id;
            IF v_state IN ('failed', 'cancelled') THEN
                PERFORM pgd_cancel_dependents(c.job_id, format('dependency %s %s', c.job_id, v_state));
            END IF;

            PERFORM pgd_release_slots(ARRAY[c.org_id], ARRAY[c.pool_id], ARRAY[c.job_id]);

            UPDATE attempts
               SET state = CASE WHEN c.target_id IS NOT NULL THEN 'lost' ELSE 'expired' END,
                   finished_at = clock_timestamp(), error = 'lease expired'
             WHERE id = c.attempt_id;
            RETURN jsonb_build_object('attempt_id', c.attempt_id, 'job_id', c.job_id,
                                      'job_state', v_state, 'is_deployment', c.target_id IS NOT NULL)
                   || CASE WHEN jsonb_array_length(v_failed) > 0
                           THEN jsonb_build_object('failed', v_failed) ELSE '{}' END;
        EXCEPTION
            WHEN SQLSTATE 'PDSKP' THEN
                NULL;
            WHEN deadlock_detected OR serialization_failure THEN
                RAISE;  -- the whole transaction is retried (sql/db.py)
            WHEN OTHERS THEN
                -- One lease that cannot be ended must not stop the sweep: its subtransaction
                -- is undone, the job says why (SKIP LOCKED: never wait for it), the caller
                -- hears of it (log, metric), and the next lapsed lease is tried.
                v_failed := v_failed || jsonb_build_object(
                    'attempt_id', c.attempt_id, 'job_id', c.job_id, 'sqlstate', SQLSTATE,
                    'error', SQLERRM);
                BEGIN
                    UPDATE jobs SET last_error = left('lease expiry failed: ' || SQLERRM, 1000)
                     WHERE id = (SELECT j.id FROM jobs j WHERE j.id = c.job_id
                                   FOR NO KEY UPDATE SKIP LOCKED);
                EXCEPTION WHEN OTHERS THEN
                    NULL;  -- the failure is still reported to the caller
                END;
        END;
    END LOOP;
    RETURN CASE WHEN jsonb_array_length(v_failed) > 0 THEN jsonb_build_object('failed', v_failed) END;
END;
$$;

-- The expiry duty's stamp, in its own transaction after a pass over every pool: last_done_at
-- = now() only while the caller holds the duty in that term (pgd_stamp_duty,
-- sql/functions/runners.sql). Returns whether it did. Every scheduler reads last_done_at in
-- its beat, and expires its own pools itself when the stamp is older than a lease.
CREATE OR REPLACE FUNCTION pgd_expiry_done(p_runner_id bigint, p_term bigint)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    -- plpgsql: pgd_stamp_duty is defined in a file loaded after this one
    RETURN pgd_stamp_duty(p_runner_id, p_term, 'expiry');
END;
$$;
