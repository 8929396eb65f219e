-- Wake-ups: one waiter chosen per claimable job. A listening scheduler registers its
-- listener session on its runner row (pgd_listen_runner); when a job becomes claimable the
-- trigger in sql/functions/submit.sql asks pgd_choose_waiter for one live listening runner
-- of the job's pool with a free slot and notifies only it, on the runner's own channel
-- (pgd_runner_channel). Only when none is found does it notify the pool's broadcast channel,
-- which every listener hears (the busy ones then claim when a slot frees: scheduler/
-- claiming.py). Table: runners (listen_pid, woken_at) in sql/schema.sql.

-- The channel a runner's listener hears its own wake-ups on: 'pgdispatch_runner_<id>'
-- (sql/scheduling.py runner_channel says the same).
CREATE OR REPLACE FUNCTION pgd_runner_channel(p_runner_id bigint) RETURNS text
LANGUAGE sql IMMUTABLE AS $$ SELECT 'pgdispatch_runner_' || p_runner_id $$;

-- listen_runner: called by a runner's wake-up listener on its own session, right after its
-- LISTEN on pgd_runner_channel(p_runner_id): records pg_backend_pid() as the runner's
-- listen_pid, so that wake-ups may choose it (and see when that session is gone). Only the
-- runner's own login may (pgd_require_runner_login: PD404 unknown runner, PD403 another
-- login's). Returns the channel.
CREATE OR REPLACE FUNCTION pgd_listen_runner(p_runner_id bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    PERFORM pgd_require_runner_login(p_runner_id);
    UPDATE runners r SET listen_pid = pg_backend_pid() WHERE r.id = p_runner_id;
    RETURN pgd_runner_channel(p_runner_id);
END;
$$;

-- The runner to wake for a job of pool p_pool_id that just became claimable, or NULL: a
-- runner serving the pool that is neither stopped nor draining (nor drained by an operator), whose login may still take
-- the pool (a revoked one is never chosen: pgd_runner_login_pools), with a free slot (its
-- running attempts, attempts_runner_idx, fewer than its slots), whose registered listener
-- session is alive (pg_stat_get_activity(listen_pid) is a session of this database named
-- pgdispatch-listener: a dead listener's pid has no row, and a pid reused by another process
-- is not one); the one woken least recently first. Its woken_at is stamped, so that the next
-- job of the same transaction (a bulk submit) or of the next one chooses another waiter:
-- n jobs wake min(n, waiters) runners. The row is taken FOR NO KEY UPDATE SKIP LOCKED: a
-- runner another transaction is waking (or whose keep-alive is being written) is passed
-- over, never waited for, so that a submit never waits here. The stamp is the only write
-- (one heap-only update of a small row; docs/operations.md, "Idle schedulers and wake-ups",
-- has its WAL per submit).
CREATE OR REPLACE FUNCTION pgd_choose_waiter(p_pool_id bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    v bigint;
BEGIN
    FOR r IN SELECT w.id, w.listen_pid, w.slots, w.login FROM runners w
              WHERE w.listen_pid IS NOT NULL AND w.stopped_at IS NULL AND NOT w.draining
                AND w.drain_requested_at IS NULL
                AND p_pool_id = ANY (w.pool_ids)
              ORDER BY w.woken_at NULLS FIRST, w.id
    LOOP
        CONTINUE WHEN (SELECT count(*) FROM attempts a
                        WHERE a.runner_id = r.id AND a.state = 'running') >= r.slots;
        CONTINUE WHEN NOT EXISTS (
            SELECT 1 FROM pg_stat_get_activity(r.listen_pid) s
             WHERE s.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
               AND s.application_name = 'pgdispatch-listener');
        CONTINUE WHEN NOT p_pool_id = ANY (pgd_runner_login_pools(r.login));
        UPDATE runners w SET woken_at = clock_timestamp()
         WHERE w.id = (SELECT x.id FROM runners x WHERE x.id = r.id
                          AND x.stopped_at IS NULL AND NOT x.draining
                          AND x.drain_requested_at IS NULL
                          FOR NO KEY UPDATE SKIP LOCKED)
        RETURNING w.id INTO v;
        IF v IS NOT NULL THEN
            RETURN v;
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$;
