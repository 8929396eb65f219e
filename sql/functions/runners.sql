-- What a scheduler process does besides claiming and reporting: its runner row
-- (registration, keep-alive, stop), the pools it was registered for, and the heartbeat of
-- each attempt it runs. Entry points of pgdispatch_scheduler (sql/grants.sql): a runner
-- host's login has no privilege on any table, so every statement it sends is one of these
-- or a transition of sql/functions/claim.sql, complete.sql, expire.sql, summaries.sql.
-- The election of the duties rides on the keep-alive (pgd_beat_runner); the cleanup duty is
-- here too. Tables: sql/schema.sql (runners, duty_leases, attempts, jobs, pools).

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

-- The keep-alive, which also carries the election of the duties (duty_leases,
-- sql/schema.sql): it marks the runner row alive (the explain "no live runner" check reads
-- last_heartbeat_at) with its draining flag and its beat interval (p_beat_seconds, what the
-- cleanup duty's "not beaten for a while" counts in); then a live runner that is not
-- draining renews the duties it holds and takes over every duty whose lease lapsed
-- (expires_at <= now()), each for p_duty_lease_seconds from now, the database's clock; a
-- takeover bumps the duty's term (the fence its duty runs carry). Rows another beat is
-- taking at this instant are skipped (SKIP LOCKED), so that of runners beating at once
-- exactly one takes a lapsed duty. A draining runner takes none and releases its own
-- (expires_at = now(): the next beat of another takes it over). A runner the cleanup duty
-- marked lost is alive again by its beat; a stopped one stays stopped (and takes nothing).
-- Only the runner's own login (or an unbound one) may; a revoked host still beats (the
-- console shows it live, asking for pools it is not granted) but holds no duty: it takes
-- none and releases its own. Returns every duty: its holder (id and name, NULL when never
-- held), term, held_since, expires_at, last_done_at, whether this runner holds it now
-- (is_mine), the database's now() (db_now), by which the caller times its next beat, and
-- leases_overdue (the same on every row): a running attempt of this runner's pools whose
-- lease lapsed more than p_duty_lease_seconds ago, when the scheduler expires its own pools
-- itself whoever holds the expiry duty; and next_lease_expiry, the first lease of a running
-- attempt to lapse (NULL: none running), when the expiry holder's next pass is due. The
-- holder's beat stamps the expiry duty done while no lease has lapsed (nothing was left to
-- do). Raises PD422 for a beat or lease outside (0, 300].
CREATE OR REPLACE FUNCTION pgd_beat_runner(p_runner_id bigint, p_draining boolean,
                                           p_beat_seconds double precision,
                                           p_duty_lease_seconds double precision)
RETURNS TABLE (duty text, runner_id bigint, runner_name text, term bigint,
               held_since timestamptz, expires_at timestamptz, last_done_at timestamptz,
               is_mine boolean, db_now timestamptz, leases_overdue boolean,
               next_lease_expiry timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_alive   boolean;
    v_may     boolean := false;
    v_pools   bigint[];
    v_overdue boolean := false;
    v_next    timestamptz;
BEGIN
    -- bounded here, not only in the caller's settings: a host may not hold a duty (and
    -- so the summaries and the cleanup) for longer than an operator can wait for
    IF p_beat_seconds IS NULL OR NOT (p_beat_seconds > 0 AND p_beat_seconds <= 300) THEN
        RAISE EXCEPTION 'beat seconds must be in (0, 300], got %', p_beat_seconds
            USING ERRCODE = 'PD422';
    END IF;
    IF p_duty_lease_seconds IS NULL
       OR NOT (p_duty_lease_seconds > 0 AND p_duty_lease_seconds <= 300) THEN
        RAISE EXCEPTION 'duty lease seconds must be in (0, 300], got %', p_duty_lease_seconds
            USING ERRCODE = 'PD422';
    END IF;
    UPDATE runners r
       SET last_heartbeat_at = now(), draining = p_draining, beat_seconds = p_beat_seconds,
           stopped_at = NULL, stop_reason = NULL
     WHERE r.id = p_runner_id AND (r.stopped_at IS NULL OR r.stop_reason = 'lost')
       AND (r.login = session_user OR pgd_login_is_unbound(session_user));
    v_alive := FOUND;
    IF v_alive THEN
        -- a host whose login was revoked, or no longer granted any of its pools, holds no
        -- duty: it gives up what it holds, as a draining one does
        SELECT r.pool_ids, pgd_login_may_run(r.login) AND r.pool_ids && pgd_runner_login_pools(r.login)
          INTO v_pools, v_may
          FROM runners r WHERE r.id = p_runner_id;
        -- whether a lease of this runner's pools lapsed more than a duty lease ago: the
        -- expiry fallback goes by this, read from the attempts themselves, so that a holder
        -- that stamps its duty without doing it cannot stop the fallback
        -- (attempts_lease_idx: only the running attempts whose lease has lapsed are read)
        v_overdue := EXISTS (
            SELECT 1 FROM attempts a JOIN jobs j ON j.id = a.job_id
             WHERE a.state = 'running'
               AND a.lease_expires_at < now() - make_interval(secs => p_duty_lease_seconds)
               AND j.pool_id = ANY (v_pools));
    END IF;
    IF v_alive AND v_may AND NOT p_draining THEN
        UPDATE duty_leases d
           SET runner_id = p_runner_id,
               term = CASE WHEN d.runner_id = p_runner_id AND d.expires_at > now()
                           THEN d.term ELSE d.term + 1 END,
               held_since = CASE WHEN d.runner_id = p_runner_id AND d.expires_at > now()
                                 THEN d.held_since ELSE now() END,
               expires_at = now() + make_interval(secs => p_duty_lease_seconds)
          FROM (SELECT c.duty FROM duty_leases c
                 WHERE c.runner_id = p_runner_id OR c.expires_at <= now()
                 ORDER BY c.duty
                   FOR UPDATE SKIP LOCKED) c
         WHERE d.duty = c.duty;
    ELSIF v_alive THEN
        UPDATE duty_leases d SET expires_at = now()
         WHERE d.runner_id = p_runner_id AND d.expires_at > now();
    END IF;
    -- the first lease of any running attempt to lapse (attempts_lease_idx: one index entry):
    -- the expiry holder passes only once it is reached, so an idle fleet sends no expiry
    -- pass. Up to now no lease has lapsed unseen, which is the expiry duty done: stamped here
    v_next := (SELECT min(a.lease_expires_at) FROM attempts a WHERE a.state = 'running');
    IF v_alive AND v_may AND NOT p_draining AND (v_next IS NULL OR v_next > now()) THEN
        UPDATE duty_leases d SET last_done_at = now(), done_count = d.done_count + 1
         WHERE d.duty = 'expiry' AND d.runner_id = p_runner_id AND d.expires_at > now();
    END IF;
    RETURN QUERY
    SELECT d.duty, d.runner_id, r.name, d.term, d.held_since, d.expires_at, d.last_done_at,
           coalesce(v_alive AND v_may AND NOT p_draining
                    AND d.runner_id = p_runner_id AND d.expires_at > now(), false),
           now(), v_overdue, v_next
      FROM duty_leases d LEFT JOIN runners r ON r.id = d.runner_id
     ORDER BY d.duty;
END;
$$;

-- Mark a runner stopped at shutdown (its own login, or an unbound one, only), and release
-- the duties it holds (expires_at = now()), so that the next beat of another runner takes
-- each over at once instead of a lease later.
CREATE OR REPLACE FUNCTION pgd_stop_runner(p_runner_id bigint)
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    WITH stopped AS (
        UPDATE runners SET stopped_at = now(), draining = true, stop_reason = 'stopped'
         WHERE id = p_runner_id AND (stopped_at IS NULL OR stop_reason = 'lost')
           AND (login = session_user OR pgd_login_is_unbound(session_user))
        RETURNING id
    )
    UPDATE duty_leases d SET expires_at = now()
      FROM stopped s
     WHERE d.runner_id = s.id AND d.expires_at > now()
$$;

-- Whether the session may act for the runner: session_user is the login that registered
-- it, or an unbound one (sql/functions/claim.sql). The one check of every duty entry point
-- (pgd_holds_duty, pgd_stamp_duty): a runner id and a term are small numbers any runner
-- login can guess. Internal.
CREATE OR REPLACE FUNCTION pgd_session_is_runner(p_runner_id bigint)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM runners r WHERE r.id = p_runner_id
                      AND (r.login = session_user OR pgd_login_is_unbound(session_user)))
$$;

-- Whether the runner holds the duty in this term now, asked by its own login
-- (pgd_session_is_runner; read only, no lock): the cheap check a duty run makes before its
-- work, and the fence of the duty's reads. Internal.
CREATE OR REPLACE FUNCTION pgd_holds_duty(p_runner_id bigint, p_term bigint, p_duty text)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM duty_leases d
                    WHERE d.duty = p_duty AND d.runner_id = p_runner_id AND d.term = p_term
                      AND d.expires_at > now())
           AND pgd_session_is_runner(p_runner_id)
$$;

-- The fence of a duty run: stamp last_done_at (and count the run) only when the runner
-- still holds the duty in the term the run was started under, and the session is the
-- runner's login (or an unbound one: pgd_session_is_runner). The row stays locked until the caller's transaction
-- ends, so a takeover waits for the stamp's commit or rollback, never overlaps it. Called
-- last in a duty's transaction (the lock is then held for an instant). Internal.
CREATE OR REPLACE FUNCTION pgd_stamp_duty(p_runner_id bigint, p_term bigint, p_duty text)
RETURNS boolean
LANGUAGE sql AS $$
    WITH s AS (
        UPDATE duty_leases d SET last_done_at = now(), done_count = d.done_count + 1
         WHERE d.duty = p_duty AND d.runner_id = p_runner_id AND d.term = p_term
           AND d.expires_at > now() AND pgd_session_is_runner(p_runner_id)
        RETURNING 1
    )
    SELECT count(*) = 1 FROM s
$$;

-- The cleanup duty, one bounded batch in one transaction, for its holder only (fenced by
-- runner and term: pgd_stamp_duty): runners not beaten for four of their beat intervals
-- (beat_seconds, 15 when never recorded) are marked stopped with stop_reason 'lost', at
-- most p_batch of them, the longest silent first (their running attempts are still ended
-- by lease expiry, which does not look at runners); and at most 10 * p_batch rows each of
-- queue_history and queue_reason_history older than 7 days are deleted (pruned: both).
-- Returns {"lost": [runner ids], "pruned": n}, or NULL
-- when the caller does not hold the duty in that term (then nothing is changed). Raises
-- PD422 for a batch outside 1..10000.
CREATE OR REPLACE FUNCTION pgd_run_cleanup(p_runner_id bigint, p_term bigint, p_batch integer)
RETURNS jsonb
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_lost   jsonb;
    v_pruned integer;
BEGIN
    IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'batch must be in 1..10000, got %', p_batch USING ERRCODE = 'PD422';
    END IF;
    IF NOT pgd_holds_duty(p_runner_id, p_term, 'cleanup') THEN
        RETURN NULL;
    END IF;
    BEGIN
        WITH lost AS (
            UPDATE runners r SET stopped_at = now(), draining = true, stop_reason = 'lost'
              FROM (SELECT s.id FROM runners s
                     WHERE s.stopped_at IS NULL
                       AND s.last_heartbeat_at
                           < now() - make_interval(secs => 4 * coalesce(s.beat_seconds, 15))
                     ORDER BY s.last_heartbeat_at
                     LIMIT p_batch
                       FOR UPDATE SKIP LOCKED) s
             WHERE r.id = s.id
            RETURNING r.id
        )
        SELECT coalesce(jsonb_agg(id ORDER BY id), '[]') INTO v_lost FROM lost;
        WITH old AS (
            DELETE FROM queue_history h
             WHERE (h.at, h.pool_id) IN (SELECT o.at, o.pool_id FROM queue_history o
                                          WHERE o.at < now() - interval '7 days'
                                          ORDER BY o.at LIMIT 10 * p_batch)
            RETURNING 1
        ), old_reasons AS (
            DELETE FROM queue_reason_history h
             WHERE (h.at, h.reason) IN (SELECT o.at, o.reason FROM queue_reason_history o
                                         WHERE o.at < now() - interval '7 days'
                                         ORDER BY o.at LIMIT 10 * p_batch)
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM old) + (SELECT count(*) FROM old_reasons) INTO v_pruned;
        IF NOT pgd_stamp_duty(p_runner_id, p_term, 'cleanup') THEN
            RAISE EXCEPTION USING ERRCODE = 'PDFNC';  -- lost the duty meanwhile: undo
        END IF;
    EXCEPTION WHEN SQLSTATE 'PDFNC' THEN
        RETURN NULL;
    END;
    RETURN jsonb_build_object('lost', v_lost, 'pruned', v_pruned);
END;
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
-- a lease outside (0, 86400] (pgd_check_lease_seconds), as a claim does: no host may hold
-- work past what an operator can wait for.
CREATE OR REPLACE FUNCTION pgd_heartbeat(p_attempt_id bigint, p_generation bigint,
                                         p_lease_seconds double precision, p_output_tail text)
RETURNS TABLE (lease_expires_at timestamptz, is_cancel_requested boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM pgd_check_lease_seconds(p_lease_seconds);
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

-- Heartbeat of several attempts in one transaction (a scheduler's beats that fall due
-- together): each attempt's lease extended on exactly pgd_heartbeat's conditions (still
-- running with its generation, for its runner's own login, still granted the job's pool);
-- one row for each attempt renewed, none for one fenced out. The attempts are locked first,
-- in id order (attempts are last in the lock order; pgd_complete_batch takes several of them
-- by id too, so two batches never wait on each other in a cycle). p_output_tails holds, for
-- each attempt, its output so far or NULL (unchanged). Raises PD422 for a lease outside
-- (0, 86400], arrays of unequal lengths, or more than 1000 attempts.
CREATE OR REPLACE FUNCTION pgd_heartbeat_batch(p_attempt_ids bigint[], p_generations bigint[],
                                               p_lease_seconds double precision,
                                               p_output_tails text[])
RETURNS TABLE (attempt_id bigint, lease_expires_at timestamptz, is_cancel_requested boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM pgd_check_lease_seconds(p_lease_seconds);
    IF p_attempt_ids IS NULL OR p_generations IS NULL OR p_output_tails IS NULL
       OR cardinality(p_attempt_ids) <> cardinality(p_generations)
       OR cardinality(p_attempt_ids) <> cardinality(p_output_tails)
       OR cardinality(p_attempt_ids) > 1000 THEN
        RAISE EXCEPTION 'a heartbeat batch names 0 to 1000 attempts, each with its generation '
                        'and output tail' USING ERRCODE = 'PD422';
    END IF;
    PERFORM 1 FROM attempts a WHERE a.id = ANY (p_attempt_ids) ORDER BY a.id FOR NO KEY UPDATE;
    RETURN QUERY
    UPDATE attempts a
       SET lease_expires_at = clock_timestamp() + make_interval(secs => p_lease_seconds),
           last_heartbeat_at = now(),
           output_tail = coalesce(right(b.output_tail, 65536), a.output_tail)
      FROM unnest(p_attempt_ids, p_generations, p_output_tails) AS b(id, generation, output_tail),
           jobs j
     WHERE a.id = b.id AND a.generation = b.generation AND a.state = 'running'
       AND j.id = a.job_id
       AND pgd_runner_holds_grant(a.runner_id, j.pool_id)
    RETURNING a.id, a.lease_expires_at, j.cancel_requested_at IS NOT NULL;
END;
$$;


-- Whether a runner is live: not stopped, and its last keep-alive newer than ``live_seconds``
-- (the reader's bound: the console's is the lease) or two of the runner's own beats
-- (beat_seconds, which pgd_beat_runner records), whichever is longer: a runner that beats
-- every 15 s under a 12 s lease is not shown gone between two beats (found by a fresh-user
-- run: the overview's live runners went 2 → 1 → 2 with every beat). The cleanup duty calls
-- it lost after 4 silent beats (pgd_run_cleanup). A plain read helper.
CREATE OR REPLACE FUNCTION pgd_runner_is_live(p_stopped_at timestamptz,
                                              p_last_heartbeat_at timestamptz,
                                              p_beat_seconds double precision,
                                              p_live_seconds double precision)
RETURNS boolean
LANGUAGE sql STABLE SET search_path = public, pg_temp AS $$
    SELECT p_stopped_at IS NULL
       AND p_last_heartbeat_at > now() - make_interval(
               secs => greatest(p_live_seconds, 2 * coalesce(p_beat_seconds, 0)))
$$;

-- Pools served by at least one live runner, neither draining nor drained by an operator, whose login is granted the pool
-- now, with those runners' ids and slots and how many of the slots are free (slots minus
-- running attempts, per runner; a runner serving several pools counts its free slots for
-- each), and the logins of live runners that ask for the pool without its grant
-- (ungranted_logins). A pool only such runners ask for has runner_slots 0. Live:
-- pgd_runner_is_live with ``live_seconds``. One definition for the console's
-- reads (live_runner_pools, sql/runners.sql) and the summaries duty's inputs
-- (pgd_read_summary_inputs, sql/functions/summaries.sql). A plain read helper: it runs as
-- its caller.
CREATE OR REPLACE FUNCTION pgd_live_runner_pools(p_live_seconds double precision)
RETURNS TABLE (pool_id bigint, runner_ids bigint[], runner_slots integer,
               free_runner_slots integer, ungranted_logins text[])
LANGUAGE sql STABLE SET search_path = public, pg_temp AS $$
    SELECT p.pool_id,
           coalesce(array_agg(r.id ORDER BY r.id) FILTER (WHERE g.is_granted), '{}'),
           coalesce(sum(r.slots) FILTER (WHERE g.is_granted), 0)::integer,
           coalesce(sum(greatest(r.slots - a.n, 0)) FILTER (WHERE g.is_granted), 0)::integer,
           ARRAY(SELECT DISTINCT u FROM unnest(array_agg(r.login) FILTER (WHERE NOT g.is_granted)) u
                  ORDER BY 1)
      FROM runners r
     CROSS JOIN LATERAL unnest(r.pool_ids) p(pool_id)
     CROSS JOIN LATERAL (SELECT p.pool_id = ANY (pgd_runner_login_pools(r.login)) AS is_granted) g
     CROSS JOIN LATERAL (SELECT count(*)::integer AS n FROM attempts a
                          WHERE a.runner_id = r.id AND a.state = 'running') a
     WHERE NOT r.draining AND r.drain_requested_at IS NULL
       AND pgd_runner_is_live(r.stopped_at, r.last_heartbeat_at, r.beat_seconds, p_live_seconds)
     GROUP BY p.pool_id
$$;

-- An operator's drain of runner p_runner_id as its scheduler reads it with each beat
-- (beat_runner, sql/runners.sql): when it was asked for (NULL: not drained), by whom, why,
-- and the deadline after which the scheduler hands its builds back (NULL: none). One row
-- for the runner's own login (or an unbound one: pgd_session_is_runner), none otherwise.
CREATE OR REPLACE FUNCTION pgd_runner_drain(p_runner_id bigint)
RETURNS TABLE (drain_requested_at timestamptz, drain_requested_by text, drain_reason text,
               drain_deadline timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT r.drain_requested_at, r.drain_requested_by, r.drain_reason, r.drain_deadline
      FROM runners r
     WHERE r.id = p_runner_id AND pgd_session_is_runner(p_runner_id)
$$;
