-- What a scheduler process does besides claiming and reporting: its runner row
-- (registration, keep-alive, stop), the pools it was registered for, and the heartbeat of
-- each attempt it runs. Entry points of pgdispatch_scheduler (sql/grants.sql): a runner
-- host's login has no privilege on any table, so every statement it sends is one of these
-- or a transition of sql/functions/claim.sql, complete.sql, expire.sql, summaries.sql.
-- Tables: sql/schema.sql (runners, attempts, jobs, pools).

-- One row per scheduler process, with its pools (by name) and slots; its id, or NULL when
-- a pool name is unknown.
CREATE OR REPLACE FUNCTION pgd_register_runner(p_name text, p_hostname text, p_pid integer,
                                               p_pools text[], p_slots integer)
RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    INSERT INTO runners (name, hostname, pid, pool_ids, slots)
    SELECT p_name, p_hostname, p_pid, array_agg(q.id ORDER BY q.id), p_slots
      FROM pools q WHERE q.name = ANY (p_pools)
    HAVING count(*) = cardinality(p_pools)
    RETURNING id
$$;

-- Keep a runner row alive (the explain "no live runner" check reads last_heartbeat_at).
CREATE OR REPLACE FUNCTION pgd_beat_runner(p_runner_id bigint, p_draining boolean)
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    UPDATE runners SET last_heartbeat_at = now(), draining = p_draining
     WHERE id = p_runner_id AND stopped_at IS NULL
$$;

-- Mark a runner stopped at shutdown.
CREATE OR REPLACE FUNCTION pgd_stop_runner(p_runner_id bigint)
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    UPDATE runners SET stopped_at = now(), draining = true
     WHERE id = p_runner_id AND stopped_at IS NULL
$$;

-- The pool ids a runner was registered for (fixed at registration), passed to its claims;
-- NULL for an unknown runner. Read-only.
CREATE OR REPLACE FUNCTION pgd_get_runner_pool_ids(p_runner_id bigint)
RETURNS bigint[]
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT pool_ids FROM runners WHERE id = p_runner_id
$$;

-- Heartbeat: extend the lease only if the attempt still runs with this generation; no row
-- = fenced out. Locks only the attempt row (last in lock order). p_output_tail, when not
-- NULL, replaces the attempt's stored output so far.
CREATE OR REPLACE FUNCTION pgd_heartbeat(p_attempt_id bigint, p_generation bigint,
                                         p_lease_seconds double precision, p_output_tail text)
RETURNS TABLE (lease_expires_at timestamptz, is_cancel_requested boolean)
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    UPDATE attempts a
       SET lease_expires_at = clock_timestamp() + make_interval(secs => p_lease_seconds),
           last_heartbeat_at = now(),
           output_tail = coalesce(p_output_tail, a.output_tail)
      FROM jobs j
     WHERE a.id = p_attempt_id AND a.generation = p_generation AND a.state = 'running'
       AND j.id = a.job_id
    RETURNING a.lease_expires_at, j.cancel_requested_at IS NOT NULL
$$;
