-- What a scheduler process does besides claiming and reporting: its runner row
-- (registration, keep-alive, stop), the pools it was registered for, and the heartbeat of
-- each attempt it runs. Entry points of pgdispatch_scheduler (sql/grants.sql): a runner
-- host's login has no privilege on any table, so every statement it sends is one of these
-- or a transition of sql/functions/claim.sql, complete.sql, expire.sql, summaries.sql.
-- Tables: sql/schema.sql (runners, attempts, jobs, pools).

-- One row per scheduler process, with its pools (by name) and slots, and the login that
-- registered it (runners.login DEFAULT session_user); its id, or NULL when a pool name is
-- unknown (HAVING runs before the grant check). PD403 when the login is not granted every
-- pool (pgd_require_pool_grants, sql/functions/claim.sql).
CREATE OR REPLACE FUNCTION pgd_register_runner(p_name text, p_hostname text, p_pid integer,
                                               p_pools text[], p_slots integer)
RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    INSERT INTO runners (name, hostname, pid, pool_ids, slots)
    SELECT p_name, p_hostname, p_pid, pgd_require_pool_grants(array_agg(q.id ORDER BY q.id)), p_slots
      FROM pools q WHERE q.name = ANY (p_pools)
    HAVING count(*) = cardinality(p_pools)
    RETURNING id
$$;

-- Keep a runner row alive (the explain "no live runner" check reads last_heartbeat_at); only
-- the runner's own login (or an unbound one) may. A revoked host still beats: the console
-- shows it live, asking for pools it is not granted.
CREATE OR REPLACE FUNCTION pgd_beat_runner(p_runner_id bigint, p_draining boolean)
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    UPDATE runners SET last_heartbeat_at = now(), draining = p_draining
     WHERE id = p_runner_id AND stopped_at IS NULL
       AND (login = session_user OR pgd_login_is_unbound(session_user))
$$;

-- Mark a runner stopped at shutdown (its own login, or an unbound one, only).
CREATE OR REPLACE FUNCTION pgd_stop_runner(p_runner_id bigint)
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    UPDATE runners SET stopped_at = now(), draining = true
     WHERE id = p_runner_id AND stopped_at IS NULL
       AND (login = session_user OR pgd_login_is_unbound(session_user))
$$;

-- The pool ids a runner was registered for (fixed at registration), passed to its claims;
-- NULL for an unknown runner. Read-only.
CREATE OR REPLACE FUNCTION pgd_get_runner_pool_ids(p_runner_id bigint)
RETURNS bigint[]
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT pool_ids FROM runners WHERE id = p_runner_id
$$;

-- Heartbeat: extend the lease only if the attempt still runs with this generation, for its
-- runner's own login, still granted the job's pool (pgd_runner_holds_grant); no row = fenced
-- out. Locks only the attempt row (last in lock order). p_output_tail, when not NULL,
-- replaces the attempt's stored output so far (its last 65,536 characters). Raises PD422 for
-- a lease outside (0, 86400], as a claim does: no host may hold work past what an operator
-- can wait for.
CREATE OR REPLACE FUNCTION pgd_heartbeat(p_attempt_id bigint, p_generation bigint,
                                         p_lease_seconds double precision, p_output_tail text)
RETURNS TABLE (lease_expires_at timestamptz, is_cancel_requested boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF p_lease_seconds IS NULL OR NOT (p_lease_seconds > 0 AND p_lease_seconds <= 86400) THEN
        RAISE EXCEPTION 'lease seconds must be in (0, 86400], got %', p_lease_seconds
            USING ERRCODE = 'PD422';
    END IF;
    RETURN QUERY
    UPDATE attempts a
       SET lease_expires_at = clock_timestamp() + make_interval(secs => p_lease_seconds),
           last_heartbeat_at = now(),
           output_tail = coalesce(right(p_output_tail, 65536), a.output_tail)
      FROM jobs j
     WHERE a.id = p_attempt_id AND a.generation = p_generation AND a.state = 'running'
       AND j.id = a.job_id
       AND pgd_runner_holds_grant(a.runner_id, j.pool_id)
    RETURNING a.lease_expires_at, j.cancel_requested_at IS NOT NULL;
END;
$$;
