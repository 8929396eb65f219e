-- 0002_transitions: the state transitions as PL/pgSQL functions, one round trip each.
--
-- Every function runs inside the caller's transaction (Read Committed) and takes row locks
-- in the one documented order: organization -> project -> pool -> job -> target -> attempt.
-- Row locks are FOR NO KEY UPDATE, the lock an UPDATE of non-key columns takes: none of these
-- transitions deletes a row or changes a key, and a FOR UPDATE lock would also block the
-- foreign-key checks (FOR KEY SHARE) of an INSERT referencing the row. pgd_submit holds its
-- dependencies FOR SHARE and then inserts a job referencing its project and pool: against a
-- completion holding those FOR UPDATE and waiting for the dependency, that was a deadlock.
-- Times come from the database clock (now(), clock_timestamp()), never from the caller.
--
-- SQLSTATEs raised, translated to Python exceptions in sql/errors.py:
--   PD404 unknown entity          PD409 state is not the one the action expects
--   PD422 invalid input           PDF01 fenced out (stale attempt or generation)
--   PDALR another actor already moved it on (the message says who, from the audit log)
--   PDSKP private to pgd_claim: "this candidate lost a race, try the next one"

-- "Equal jitter" backoff (AWS Architecture Blog, "Exponential Backoff And Jitter", 2015):
-- keep half of the capped exponential delay and randomise the other half, so that jobs
-- failing together do not retry together. Returns seconds.
CREATE FUNCTION pgd_backoff_seconds(p_failures integer, p_base_seconds double precision,
                                    p_cap_seconds double precision)
RETURNS double precision LANGUAGE sql VOLATILE AS $$
    SELECT least(p_cap_seconds, p_base_seconds * power(2, greatest(p_failures - 1, 0)))
           * (0.5 + random() / 2)
$$;

-- Dependents of a job that succeeded lose one pending dependency; those with none left (and
-- approval given or not required) become queued. Dependents are blocked jobs that no claim
-- can touch, so locking them after the finished job's own locks cannot form a cycle.
CREATE FUNCTION pgd_release_dependents(p_job_id bigint) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    UPDATE jobs d
       SET pending_dependencies = d.pending_dependencies - 1,
           state = CASE WHEN d.pending_dependencies = 1
                             AND (NOT d.requires_approval OR d.approved_at IS NOT NULL)
                        THEN 'queued' ELSE 'blocked' END,
           ready_at = CASE WHEN d.pending_dependencies = 1 THEN now() ELSE d.ready_at END
      FROM job_dependencies jd
     WHERE jd.depends_on_job_id = p_job_id
       AND d.id = jd.job_id
       AND d.state = 'blocked';
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END;
$$;

-- Everything downstream of a job that ended without success can never run: cancel it,
-- transitively, saying why (GitLab calls these "skipped").
-- Level by level, one statement per level rather than one recursive CTE: a statement's
-- snapshot is taken when it starts, so a dependent whose edge was committed while this
-- transaction waited for a row lock (pgd_submit holds its dependencies FOR SHARE) would be
-- missed by a CTE computed up front and stay blocked forever. Each level's UPDATE starts
-- after the previous level's locks were granted, so it sees every edge committed before.
CREATE FUNCTION pgd_cancel_dependents(p_job_id bigint, p_why text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    frontier bigint[] := ARRAY[p_job_id];
    n        integer := 0;
BEGIN
    LOOP
        WITH cancelled AS (
            UPDATE jobs j
               SET state = 'cancelled', finished_at = now(), last_error = p_why
              FROM job_dependencies jd
             WHERE jd.depends_on_job_id = ANY (frontier)
               AND j.id = jd.job_id AND j.state = 'blocked'
            RETURNING j.id
        )
        SELECT array_agg(DISTINCT id) INTO frontier FROM cancelled;
        EXIT WHEN frontier IS NULL;
        n := n + cardinality(frontier);
    END LOOP;
    RETURN n;
END;
$$;

-- The claim's candidates: (project, pool) pairs of these pools whose project may start one
-- more job now and has a ready job there, fairest first: by weighted running share (fewest
-- running per unit of weight), then least recently claimed (round robin between equals), then
-- id. With p_org_id, only that organization's pairs, and its capacity is not checked: the
-- caller holds (and has already counted) its reservation. Read without locks.
CREATE FUNCTION pgd_claim_candidates(p_pool_ids bigint[], p_org_id bigint)
RETURNS TABLE (org_id bigint, project_id bigint, pool_id bigint)
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        SELECT p.organization_id AS org_id, pp.project_id, pp.pool_id
          FROM project_pools pp
          JOIN projects p ON p.id = pp.project_id
          JOIN organizations o ON o.id = p.organization_id
          JOIN pools q ON q.id = pp.pool_id
         WHERE pp.pool_id = ANY (p_pool_ids)
           AND p.paused_at IS NULL
           AND CASE WHEN p_org_id IS NULL THEN o.running < o.max_running ELSE o.id = p_org_id END
           AND (p.max_running IS NULL OR p.running < p.max_running)
           AND q.running < q.slots
           AND EXISTS (SELECT 1
                         FROM jobs j
                         LEFT JOIN targets t ON t.id = j.target_id
                        WHERE j.project_id = pp.project_id AND j.pool_id = pp.pool_id
                          AND j.state = 'queued' AND j.ready_at <= now()
                          AND (j.target_id IS NULL OR t.state = 'free'))
         ORDER BY p.running::float8 / p.weight, p.last_claimed_at NULLS FIRST, p.id, pp.pool_id
         LIMIT 16;
END;
$$;

-- claim: pick the next eligible job for a runner under the fairness policy and reserve,
-- in lock order, the organization slot, the project bound, the pool slot, the job
-- (FOR NO KEY UPDATE SKIP LOCKED) and, for a deployment, the free target; bump the job's
-- generation (the fence token) and insert the attempt with its lease. Returns one row, or
-- none when nothing is eligible.
--
-- Candidates come from pgd_claim_candidates (fairest first). The first, lock-free read only
-- picks which organization to try; the project is chosen by a second read made after the
-- organization row is locked. Every claim and completion in an organization takes that row
-- first and keeps it to commit, so by then each one before us has committed and the second
-- read sees its counts: concurrent claimers cannot all pile onto the project that looked
-- least served in a read taken before the others committed (measured: tests/fairness,
-- docs/fairness.md). Each reservation is a conditional UPDATE that re-checks the limit on
-- the latest row version after waiting for the row lock (Read Committed re-evaluation,
-- PostgreSQL docs 13.2.1), so a stale read can only make a candidate fail, never
-- over-admit. A failed candidate raises PDSKP inside its own subtransaction, which releases
-- the row locks it took (PostgreSQL docs, SAVEPOINT / 41.6.8) before the next candidate is
-- tried, so no lock is ever held out of order.
CREATE FUNCTION pgd_claim(p_runner_id bigint, p_pool_ids bigint[], p_claim_token uuid,
                          p_lease_seconds double precision)
RETURNS TABLE (job_id bigint, attempt_id bigint, attempt_no integer, generation bigint,
               lease_expires_at timestamptz, project_id bigint, pool_id bigint,
               target_id bigint, command text[], timeout_seconds integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_runner  runners%ROWTYPE;
    v_pools   bigint[];
    o_c       record;
    c         record;
    v_tried   bigint[] := '{}';
    v_job     jobs%ROWTYPE;
    v_attempt bigint;
    v_claimed timestamptz;
    v_lease   timestamptz;
BEGIN
    IF p_lease_seconds IS NULL OR p_lease_seconds <= 0 OR p_lease_seconds > 86400 THEN
        RAISE EXCEPTION 'lease seconds must be in (0, 86400], got %', p_lease_seconds
            USING ERRCODE = 'PD422';
    END IF;
    SELECT * INTO v_runner FROM runners r WHERE r.id = p_runner_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown runner %', p_runner_id USING ERRCODE = 'PD404';
    END IF;
    IF v_runner.draining OR v_runner.stopped_at IS NOT NULL THEN
        RETURN;
    END IF;
    v_pools := ARRAY(SELECT unnest(p_pool_ids) INTERSECT SELECT unnest(v_runner.pool_ids));

    FOR o_c IN SELECT * FROM pgd_claim_candidates(v_pools, NULL) LOOP
        CONTINUE WHEN o_c.org_id = ANY (v_tried);
        v_tried := v_tried || o_c.org_id;
        BEGIN
            UPDATE organizations o SET running = o.running + 1
             WHERE o.id = o_c.org_id AND o.running < o.max_running;
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

            -- a fresh read, under the organization row lock: choose the project now
            FOR c IN SELECT * FROM pgd_claim_candidates(v_pools, o_c.org_id) LOOP
            BEGIN
                UPDATE projects p SET running = p.running + 1, last_claimed_at = clock_timestamp()
                 WHERE p.id = c.project_id AND p.paused_at IS NULL
                   AND (p.max_running IS NULL OR p.running < p.max_running);
                IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

                UPDATE pools q SET running = q.running + 1
                 WHERE q.id = c.pool_id AND q.running < q.slots;
                IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

                -- SKIP LOCKED: a job another claimer is taking is not waited for, just passed.
                SELECT j.* INTO v_job
                  FROM jobs j
                 WHERE j.project_id = c.project_id AND j.pool_id = c.pool_id
                   AND j.state = 'queued' AND j.ready_at <= now()
                   AND (j.target_id IS NULL
                        OR EXISTS (SELECT 1 FROM targets t WHERE t.id = j.target_id AND t.state = 'free'))
                 ORDER BY j.priority DESC, j.id
                 LIMIT 1
                   FOR NO KEY UPDATE OF j SKIP LOCKED;
                IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

                IF v_job.target_id IS NOT NULL THEN
                    -- Waits if another claimer is taking this target, then re-checks 'free'.
                    UPDATE targets t SET state = 'held', holder_job_id = v_job.id, held_since = now()
                     WHERE t.id = v_job.target_id AND t.state = 'free';
                    IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
                END IF;

                UPDATE jobs j
                   SET state = 'running', generation = j.generation + 1,
                       attempts_made = j.attempts_made + 1,
                       started_at = coalesce(j.started_at, now())
                 WHERE j.id = v_job.id
                RETURNING * INTO v_job;

                -- claimed_at is the clock now, under every lock this claim holds, not now() (the
                -- transaction's start, which may precede the wait for the organization row): so
                -- [claimed_at, finished_at) is exactly when the attempt held its capacity.
                v_claimed := clock_timestamp();
                v_lease := v_claimed + make_interval(secs => p_lease_seconds);
                INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                                      claimed_at, lease_expires_at, last_heartbeat_at)
                VALUES (v_job.id, v_job.attempts_made, v_job.generation, p_runner_id, p_claim_token,
                        'running', v_claimed, v_lease, now())
                RETURNING id INTO v_attempt;

                RETURN QUERY SELECT v_job.id, v_attempt, v_job.attempts_made, v_job.generation, v_lease,
                                    v_job.project_id, v_job.pool_id, v_job.target_id, v_job.command,
                                    v_job.timeout_seconds;
                RETURN;
            EXCEPTION WHEN SQLSTATE 'PDSKP' THEN
                NULL;  -- lost a race for this candidate; its locks went with the subtransaction
            END;
            END LOOP;
            -- nothing this organization could start: give its slot back (rolls back the block)
            RAISE EXCEPTION USING ERRCODE = 'PDSKP';
        EXCEPTION WHEN SQLSTATE 'PDSKP' THEN
            NULL;  -- the organization is full or has nothing to start; try the next one
        END;
    END LOOP;
    RETURN;
END;
$$;

-- complete: record an attempt's outcome once. A repeated receipt key returns the first
-- answer; otherwise, in lock order, release every reservation the attempt holds, end the
-- attempt, and retry (with backoff), end or hand back the job; unblock or cancel dependents.
-- Outcomes: succeeded | failed | cancelled | handed_back (graceful shutdown, not a failure)
-- | lost (a deployment killed mid-way: job and target become uncertain).
-- A late report from a deployment's lost attempt (job uncertain, same generation) is
-- accepted and frees the target: DESIGN.md, "Target states".
-- Raises PDF01 when the attempt is no longer the job's current running attempt.
CREATE FUNCTION pgd_complete(p_attempt_id bigint, p_generation bigint, p_outcome text,
                             p_exit_code integer, p_error text, p_output_tail text,
                             p_receipt_key text, p_backoff_base_seconds double precision,
                             p_backoff_cap_seconds double precision)
RETURNS jsonb
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_receipt   delivery_receipts%ROWTYPE;
    v_ids       record;
    v_job       jobs%ROWTYPE;
    v_attempt   attempts%ROWTYPE;
    v_is_late   boolean;
    v_job_state text;
    v_att_state text;
    v_ready_at  timestamptz;
    v_failures  integer;
    v_response  jsonb;
BEGIN
    IF p_outcome NOT IN ('succeeded', 'failed', 'cancelled', 'handed_back', 'lost') THEN
        RAISE EXCEPTION 'unknown outcome %', p_outcome USING ERRCODE = 'PD422';
    END IF;
    IF p_receipt_key IS NULL OR length(p_receipt_key) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'receipt key must be 1 to 200 characters' USING ERRCODE = 'PD422';
    END IF;

    SELECT a.job_id, j.project_id, j.pool_id, j.target_id, p.organization_id AS org_id
      INTO v_ids
      FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
     WHERE a.id = p_attempt_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown attempt %', p_attempt_id USING ERRCODE = 'PD404';
    END IF;

    -- Lock order. These ids never change after insert, so reading them unlocked is safe.
    PERFORM 1 FROM organizations WHERE id = v_ids.org_id FOR NO KEY UPDATE;
    PERFORM 1 FROM projects WHERE id = v_ids.project_id FOR NO KEY UPDATE;
    PERFORM 1 FROM pools WHERE id = v_ids.pool_id FOR NO KEY UPDATE;
    SELECT * INTO v_job FROM jobs WHERE id = v_ids.job_id FOR NO KEY UPDATE;
    IF v_ids.target_id IS NOT NULL THEN
        PERFORM 1 FROM targets WHERE id = v_ids.target_id FOR NO KEY UPDATE;
    END IF;
    SELECT * INTO v_attempt FROM attempts WHERE id = p_attempt_id FOR NO KEY UPDATE;

    -- Checked under the locks, so a concurrent first delivery of the same key is seen here.
    SELECT * INTO v_receipt FROM delivery_receipts WHERE key = p_receipt_key;
    IF FOUND THEN
        IF v_receipt.attempt_id <> p_attempt_id THEN
            RAISE EXCEPTION 'receipt key % belongs to attempt %', p_receipt_key, v_receipt.attempt_id
                USING ERRCODE = 'PD409';
        END IF;
        RETURN v_receipt.response || jsonb_build_object('repeated', true);
    END IF;

    IF v_attempt.generation <> p_generation OR v_job.generation <> p_generation THEN
        RAISE EXCEPTION 'attempt % generation % is fenced out (job % is at generation %)',
            p_attempt_id, p_generation, v_job.id, v_job.generation USING ERRCODE = 'PDF01';
    END IF;
    IF v_attempt.state = 'running' AND v_job.state = 'running' THEN
        v_is_late := false;
    ELSIF v_attempt.state = 'lost' AND v_job.state = 'uncertain' AND p_outcome IN ('succeeded', 'failed') THEN
        v_is_late := true;
    ELSIF v_attempt.state = 'expired' AND p_outcome IN ('succeeded', 'failed')
          AND (v_job.state = 'queued'
               OR (v_job.state = 'failed'
                   AND NOT EXISTS (SELECT 1 FROM job_dependencies WHERE depends_on_job_id = v_job.id))) THEN
        -- A build whose report arrives after its lease lapsed (say, the database was down for
        -- longer than the lease) while nobody has claimed the job since (same generation):
        -- its result is real, so it counts. Its slots were released at expiry, which also
        -- counted the failure; a late failure therefore changes only the attempt. A job that
        -- already failed for good is only revived when no dependent was cancelled for it.
        IF p_outcome = 'failed' THEN
            UPDATE attempts SET state = 'failed', exit_code = p_exit_code, error = p_error,
                                output_tail = coalesce(p_output_tail, output_tail)
             WHERE id = p_attempt_id;
            v_response := jsonb_build_object(
                'status', 'recorded', 'job_id', v_job.id, 'attempt_id', p_attempt_id,
                'job_state', v_job.state, 'attempt_state', 'failed', 'is_late_report', true,
                'ready_at', v_job.ready_at, 'repeated', false);
            INSERT INTO delivery_receipts (key, attempt_id, outcome, response)
            VALUES (p_receipt_key, p_attempt_id, p_outcome, v_response);
            RETURN v_response;
        END IF;
        v_is_late := true;
    ELSE
        RAISE EXCEPTION 'attempt % is % and job % is %: fenced out',
            p_attempt_id, v_attempt.state, v_job.id, v_job.state USING ERRCODE = 'PDF01';
    END IF;

    IF NOT v_is_late THEN
        UPDATE organizations SET running = running - 1 WHERE id = v_ids.org_id;
        UPDATE projects SET running = running - 1 WHERE id = v_ids.project_id;
        UPDATE pools SET running = running - 1 WHERE id = v_ids.pool_id;
    END IF;

    v_failures := v_job.failures;
    v_ready_at := v_job.ready_at;
    IF p_outcome = 'succeeded' THEN
        v_att_state := 'succeeded';
        v_job_state := 'succeeded';
    ELSIF p_outcome = 'lost' THEN
        IF v_ids.target_id IS NULL THEN
            RAISE EXCEPTION 'outcome lost is only for deployments' USING ERRCODE = 'PD422';
        END IF;
        v_att_state := 'lost';
        v_job_state := 'uncertain';
    ELSIF p_outcome = 'handed_back' AND v_job.cancel_requested_at IS NULL THEN
        v_att_state := 'cancelled';
        v_job_state := 'queued';
        v_ready_at := now();
    ELSIF p_outcome IN ('cancelled', 'handed_back') OR v_job.cancel_requested_at IS NOT NULL THEN
        v_att_state := CASE WHEN p_outcome = 'failed' THEN 'failed' ELSE 'cancelled' END;
        v_job_state := 'cancelled';
    ELSE
        v_att_state := 'failed';
        -- a late report's failure was already counted when its lease expired
        v_failures := v_failures + CASE WHEN v_is_late THEN 0 ELSE 1 END;
        IF v_failures < v_job.max_attempts THEN
            v_job_state := 'queued';
            v_ready_at := now() + make_interval(
                secs => pgd_backoff_seconds(v_failures, p_backoff_base_seconds, p_backoff_cap_seconds));
        ELSE
            v_job_state := 'failed';
        END IF;
    END IF;

    UPDATE jobs
       SET state = v_job_state,
           failures = v_failures,
           ready_at = v_ready_at,
           finished_at = CASE WHEN v_job_state IN ('succeeded', 'failed', 'cancelled') THEN now() END,
           last_error = CASE WHEN v_att_state = 'succeeded' THEN NULL
                             ELSE coalesce(p_error, 'exit code ' || p_exit_code::text, p_outcome) END
     WHERE id = v_job.id;

    IF v_ids.target_id IS NOT NULL THEN
        IF v_job_state = 'uncertain' THEN
            UPDATE targets SET state = 'uncertain' WHERE id = v_ids.target_id;
        ELSE
            UPDATE targets SET state = 'free', holder_job_id = NULL, held_since = NULL
             WHERE id = v_ids.target_id AND holder_job_id = v_job.id;
        END IF;
    END IF;

    UPDATE attempts
       SET state = v_att_state,
           -- under every lock, like claimed_at (see pgd_claim); a late report keeps the time
           -- the lease lapsed, when the attempt's slots were really released
           finished_at = CASE WHEN v_is_late THEN finished_at ELSE clock_timestamp() END,
           exit_code = p_exit_code,
           error = p_error,
           output_tail = coalesce(p_output_tail, output_tail)
     WHERE id = p_attempt_id;

    IF v_job_state = 'succeeded' THEN
        PERFORM pgd_release_dependents(v_job.id);
    ELSIF v_job_state IN ('failed', 'cancelled') THEN
        PERFORM pgd_cancel_dependents(v_job.id, format('dependency %s %s', v_job.id, v_job_state));
    END IF;

    IF v_is_late AND v_ids.target_id IS NOT NULL THEN
        -- the uncertain target is freed by the runner, not an operator: say so in the audit
        -- log, so the next operator hears who resolved it
        PERFORM pgd_audit('runner:' || r.name, 'late_report', 'target:' || t.name,
                          format('attempt %s of job %s reported %s after its lease lapsed',
                                 p_attempt_id, v_job.id, p_outcome),
                          jsonb_build_object('job_id', v_job.id, 'attempt_id', p_attempt_id,
                                             'outcome', p_outcome))
          FROM runners r, targets t
         WHERE r.id = v_attempt.runner_id AND t.id = v_ids.target_id;
    END IF;

    v_response := jsonb_build_object(
        'status', 'recorded', 'job_id', v_job.id, 'attempt_id', p_attempt_id,
        'job_state', v_job_state, 'attempt_state', v_att_state, 'is_late_report', v_is_late,
        'ready_at', v_ready_at, 'repeated', false);
    INSERT INTO delivery_receipts (key, attempt_id, outcome, response)
    VALUES (p_receipt_key, p_attempt_id, p_outcome, v_response);
    RETURN v_response;
END;
$$;

-- expire: end one lapsed lease. The attempt becomes expired (a build: slots released, job
-- re-queued with backoff or failed when out of attempts) or lost (a deployment: slots
-- released, job and target uncertain, target still reserved). Candidates are read without
-- locks; each is re-checked under locks taken in lock order inside its own subtransaction,
-- and a job that another transaction holds (SKIP LOCKED) is left for the next pass, so
-- every scheduler may run this at once. Returns what it did, or NULL when nothing lapsed.
CREATE FUNCTION pgd_expire_one(p_backoff_base_seconds double precision,
                               p_backoff_cap_seconds double precision)
RETURNS jsonb
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c          record;
    v_job      jobs%ROWTYPE;
    v_attempt  attempts%ROWTYPE;
    v_failures integer;
    v_state    text;
    v_ready_at timestamptz;
BEGIN
    FOR c IN
        SELECT a.id AS attempt_id, a.job_id, j.project_id, j.pool_id, j.target_id,
               p.organization_id AS org_id
          FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
         WHERE a.state = 'running' AND a.lease_expires_at < clock_timestamp()
         ORDER BY a.lease_expires_at
         LIMIT 16
    LOOP
        BEGIN
            PERFORM 1 FROM organizations WHERE id = c.org_id FOR NO KEY UPDATE;
            PERFORM 1 FROM projects WHERE id = c.project_id FOR NO KEY UPDATE;
            PERFORM 1 FROM pools WHERE id = c.pool_id FOR NO KEY UPDATE;
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

            UPDATE organizations SET running = running - 1 WHERE id = c.org_id;
            UPDATE projects SET running = running - 1 WHERE id = c.project_id;
            UPDATE pools SET running = running - 1 WHERE id = c.pool_id;

            v_failures := v_job.failures + 1;
            v_ready_at := v_job.ready_at;
            IF c.target_id IS NOT NULL THEN
                v_state := 'uncertain';
                UPDATE targets SET state = 'uncertain' WHERE id = c.target_id;
            ELSIF v_job.cancel_requested_at IS NOT NULL THEN
                v_state := 'cancelled';
            ELSIF v_failures < v_job.max_attempts THEN
                v_state := 'queued';
                v_ready_at := now() + make_interval(
                    secs => pgd_backoff_seconds(v_failures, p_backoff_base_seconds, p_backoff_cap_seconds));
            ELSE
                v_state := 'failed';
            END IF;

            UPDATE jobs
               SET state = v_state, failures = v_failures, ready_at = v_ready_at,
                   finished_at = CASE WHEN v_state IN ('failed', 'cancelled') THEN now() END,
                   last_error = format('lease of attempt %s expired', c.attempt_id)
             WHERE id = c.job_id;
            UPDATE attempts
               SET state = CASE WHEN c.target_id IS NOT NULL THEN 'lost' ELSE 'expired' END,
                   finished_at = clock_timestamp(), error = 'lease expired'
             WHERE id = c.attempt_id;
            IF v_state IN ('failed', 'cancelled') THEN
                PERFORM pgd_cancel_dependents(c.job_id, format('dependency %s %s', c.job_id, v_state));
            END IF;
            RETURN jsonb_build_object('attempt_id', c.attempt_id, 'job_id', c.job_id,
                                      'job_state', v_state, 'is_deployment', c.target_id IS NOT NULL);
        EXCEPTION WHEN SQLSTATE 'PDSKP' THEN
            NULL;
        END;
    END LOOP;
    RETURN NULL;
END;
$$;

-- submit: enqueue one job. Validates the project, the pool grant, the target and the
-- dependencies; an idempotency key already used in the project returns the existing job.
-- Dependencies are locked FOR SHARE so that one finishing concurrently either sees this
-- job's edge or is seen here as finished: no job waits forever on a dependency that ended.
CREATE FUNCTION pgd_submit(p_project text, p_pool text, p_target text, p_command text[],
                           p_priority integer, p_max_attempts integer, p_timeout_seconds integer,
                           p_delay_seconds double precision, p_requires_approval boolean,
                           p_depends_on bigint[], p_idempotency_key text, p_submitted_by text)
RETURNS TABLE (job_id bigint, is_new boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_project  projects%ROWTYPE;
    v_pool_id  bigint;
    v_target   bigint;
    v_pending  integer := 0;
    v_dep      record;
    v_id       bigint;
    v_state    text;
BEGIN
    SELECT * INTO v_project FROM projects WHERE name = p_project;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown project %', p_project USING ERRCODE = 'PD404';
    END IF;
    SELECT id INTO v_pool_id FROM pools WHERE name = p_pool;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown pool %', p_pool USING ERRCODE = 'PD404';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM project_pools WHERE project_id = v_project.id AND pool_id = v_pool_id) THEN
        RAISE EXCEPTION 'project % is not granted pool %', p_project, p_pool USING ERRCODE = 'PD422';
    END IF;
    IF p_target IS NOT NULL THEN
        SELECT id INTO v_target FROM targets WHERE name = p_target;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'unknown target %', p_target USING ERRCODE = 'PD404';
        END IF;
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        SELECT id INTO v_id FROM jobs WHERE project_id = v_project.id AND idempotency_key = p_idempotency_key;
        IF FOUND THEN
            RETURN QUERY SELECT v_id, false;
            RETURN;
        END IF;
    END IF;

    FOR v_dep IN
        SELECT j.id, j.state FROM jobs j
         WHERE j.id = ANY (coalesce(p_depends_on, '{}'))
         ORDER BY j.id
           FOR SHARE
    LOOP
        IF v_dep.state IN ('failed', 'cancelled') THEN
            RAISE EXCEPTION 'dependency % is %', v_dep.id, v_dep.state USING ERRCODE = 'PD422';
        ELSIF v_dep.state <> 'succeeded' THEN
            v_pending := v_pending + 1;
        END IF;
    END LOOP;
    -- only when there are dependencies: each id is a primary-key probe
    IF cardinality(p_depends_on) > 0
       AND (SELECT count(*) FROM jobs WHERE id = ANY (p_depends_on))
           <> cardinality(ARRAY(SELECT DISTINCT unnest(p_depends_on))) THEN
        RAISE EXCEPTION 'unknown dependency in %', p_depends_on USING ERRCODE = 'PD404';
    END IF;

    v_state := CASE WHEN v_pending > 0 OR p_requires_approval THEN 'blocked' ELSE 'queued' END;
    INSERT INTO jobs (project_id, pool_id, target_id, state, priority, command, timeout_seconds,
                      max_attempts, ready_at, requires_approval, pending_dependencies,
                      idempotency_key, submitted_by)
    VALUES (v_project.id, v_pool_id, v_target, v_state, p_priority, p_command, p_timeout_seconds,
            p_max_attempts, now() + make_interval(secs => coalesce(p_delay_seconds, 0)),
            p_requires_approval, v_pending, p_idempotency_key, p_submitted_by)
    ON CONFLICT (project_id, idempotency_key) DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        -- a concurrent submit with the same key won
        SELECT id INTO v_id FROM jobs WHERE project_id = v_project.id AND idempotency_key = p_idempotency_key;
        RETURN QUERY SELECT v_id, false;
        RETURN;
    END IF;
    INSERT INTO job_dependencies (job_id, depends_on_job_id)
    SELECT v_id, d FROM (SELECT DISTINCT unnest(coalesce(p_depends_on, '{}')) AS d) s;
    RETURN QUERY SELECT v_id, true;
END;
$$;

-- The last audit event about a subject, for "already resolved by alice at 14:02".
CREATE FUNCTION pgd_last_actor(p_subject text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT format('%s at %s', actor, to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                       FROM audit_events WHERE subject = p_subject ORDER BY id DESC LIMIT 1),
                    'another actor')
$$;

CREATE FUNCTION pgd_audit(p_actor text, p_action text, p_subject text, p_reason text,
                          p_details jsonb DEFAULT '{}')
RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO audit_events (actor, action, subject, reason, details)
    VALUES (p_actor, p_action, p_subject, p_reason, coalesce(p_details, '{}'))
    RETURNING id
$$;

-- pause / resume a project: conditional on the state the operator saw, audited.
CREATE FUNCTION pgd_pause_project(p_project text, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v projects%ROWTYPE;
BEGIN
    IF p_reason IS NULL OR btrim(p_reason) = '' THEN
        RAISE EXCEPTION 'a reason is required to pause a project' USING ERRCODE = 'PD422';
    END IF;
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

CREATE FUNCTION pgd_resume_project(p_project text, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM projects WHERE name = p_project) THEN
        RAISE EXCEPTION 'unknown project %', p_project USING ERRCODE = 'PD404';
    END IF;
    UPDATE projects SET paused_at = NULL, pause_reason = NULL, paused_by = NULL
     WHERE name = p_project AND paused_at IS NOT NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'project % is already running (resumed by %)', p_project, pgd_last_actor('project:' || p_project)
            USING ERRCODE = 'PDALR';
    END IF;
    PERFORM pgd_audit(p_actor, 'resume_project', 'project:' || p_project, p_reason);
    RETURN jsonb_build_object('project', p_project, 'paused_at', NULL);
END;
$$;

-- approve a job that requires approval; it becomes queued if no dependency is pending.
CREATE FUNCTION pgd_approve_job(p_job_id bigint, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v jobs%ROWTYPE;
BEGIN
    SELECT * INTO v FROM jobs WHERE id = p_job_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown job %', p_job_id USING ERRCODE = 'PD404';
    END IF;
    IF NOT v.requires_approval THEN
        RAISE EXCEPTION 'job % does not require approval', p_job_id USING ERRCODE = 'PD409';
    END IF;
    IF v.approved_at IS NOT NULL OR v.state <> 'blocked' THEN
        RAISE EXCEPTION 'job % is already approved or ended (%, by %)', p_job_id, v.state,
            coalesce(v.approved_by, pgd_last_actor('job:' || p_job_id)) USING ERRCODE = 'PDALR';
    END IF;
    UPDATE jobs
       SET approved_at = now(), approved_by = p_actor,
           state = CASE WHEN pending_dependencies = 0 THEN 'queued' ELSE 'blocked' END,
           ready_at = CASE WHEN pending_dependencies = 0 THEN now() ELSE ready_at END
     WHERE id = p_job_id
    RETURNING * INTO v;
    PERFORM pgd_audit(p_actor, 'approve_job', 'job:' || p_job_id, p_reason);
    RETURN jsonb_build_object('job_id', p_job_id, 'state', v.state);
END;
$$;

-- cancel: a blocked or queued job ends now (and its dependents with it); a running job gets
-- a cancel request that its runner sees on the next heartbeat, stops the command and reports
-- (so a deployment's target is never freed while its command may still be running).
CREATE FUNCTION pgd_cancel_job(p_job_id bigint, p_reason text, p_actor text)
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
        RAISE EXCEPTION 'job % is % and cannot be cancelled (last action by %)', p_job_id, v.state,
            pgd_last_actor('job:' || p_job_id) USING ERRCODE = 'PDALR';
    END IF;
    PERFORM pgd_audit(p_actor, 'cancel_job', 'job:' || p_job_id, p_reason);
    RETURN jsonb_build_object('job_id', p_job_id, 'state', v.state,
                              'cancel_requested', v.state = 'running');
END;
$$;

-- retry: a failed or cancelled job is queued again now with one more attempt allowed.
-- Dependents cancelled by its failure stay cancelled (they were reported as such).
CREATE FUNCTION pgd_retry_job(p_job_id bigint, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v jobs%ROWTYPE;
BEGIN
    SELECT * INTO v FROM jobs WHERE id = p_job_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown job %', p_job_id USING ERRCODE = 'PD404';
    END IF;
    IF v.state NOT IN ('failed', 'cancelled') THEN
        RAISE EXCEPTION 'job % is % and cannot be retried (last action by %)', p_job_id, v.state,
            pgd_last_actor('job:' || p_job_id) USING ERRCODE = 'PDALR';
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

-- resolve an uncertain target: the operator says whether the lost deployment happened
-- (succeeded), did not (failed), or should run again (retry). Conditional on the target still
-- being uncertain, so of two operators one wins and the other hears who did it. Audited.
CREATE FUNCTION pgd_resolve_target(p_target text, p_outcome text, p_note text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_target targets%ROWTYPE;
    v_job    jobs%ROWTYPE;
    v_state  text;
BEGIN
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
    -- lock order: job before target
    SELECT * INTO v_job FROM jobs WHERE id = v_target.holder_job_id FOR NO KEY UPDATE;
    SELECT * INTO v_target FROM targets WHERE id = v_target.id FOR NO KEY UPDATE;
    IF v_target.state <> 'uncertain' OR v_job.state <> 'uncertain' THEN
        RAISE EXCEPTION 'target % is % (already resolved by %)', p_target, v_target.state,
            pgd_last_actor('target:' || p_target) USING ERRCODE = 'PDALR';
    END IF;
    v_state := CASE p_outcome WHEN 'retry' THEN 'queued' ELSE p_outcome END;
    UPDATE jobs
       SET state = v_state,
           ready_at = CASE WHEN v_state = 'queued' THEN now() ELSE ready_at END,
           finished_at = CASE WHEN v_state = 'queued' THEN NULL ELSE now() END,
           max_attempts = CASE WHEN v_state = 'queued'
                               THEN least(100, greatest(max_attempts, failures + 1)) ELSE max_attempts END,
           last_error = format('resolved %s by %s: %s', p_outcome, p_actor, p_note)
     WHERE id = v_job.id;
    UPDATE targets SET state = 'free', holder_job_id = NULL, held_since = NULL WHERE id = v_target.id;
    IF v_state = 'succeeded' THEN
        PERFORM pgd_release_dependents(v_job.id);
    ELSIF v_state = 'failed' THEN
        PERFORM pgd_cancel_dependents(v_job.id, format('dependency %s failed', v_job.id));
    END IF;
    PERFORM pgd_audit(p_actor, 'resolve_target', 'target:' || p_target, p_note,
                      jsonb_build_object('outcome', p_outcome, 'job_id', v_job.id));
    RETURN jsonb_build_object('target', p_target, 'outcome', p_outcome, 'job_id', v_job.id,
                              'job_state', v_state);
END;
$$;
