-- 0007_hot_rows_last: a new lock order that takes the shared counter rows last (issue 5).
--
-- Old order: organization -> project -> pool -> job -> target -> attempt.
-- New order: job -> target -> attempt -> (dependents: blocked jobs, by id)
--            -> project -> organization -> pool.
--
-- Why: a row lock is held until the transaction ends, and the end includes the commit's WAL
-- flush. Every claim and completion of an organization updates that organization's row and
-- its pool's row, so whoever holds them makes all the others wait; taken first, they were held
-- across the whole transaction and its flush, and the transitions of one organization ran one
-- at a time (measured with 8 claimers: 5.3 of 7.5 active sessions waiting on a row lock, the
-- CPU half idle; docs/benchmarks.md, "Lock order: the hot rows last"). Taken last, they are
-- held only from the counter update to the end of the commit. This is the usual remedy for a
-- hot counter row (TPC-C implementations update the district row late for the same reason).
--
-- Safety is unchanged: every reservation is still a conditional UPDATE re-checked on the
-- latest row version after the row lock is granted (Read Committed re-evaluation, PostgreSQL
-- docs 13.2.1), so no limit can be exceeded; a claim that fails any reservation raises PDSKP
-- inside its own subtransaction, which releases every lock it took (PostgreSQL docs 41.6.8).
-- Jobs are taken FOR NO KEY UPDATE SKIP LOCKED and never waited for by a claim or an expiry;
-- every transaction that waits for rows takes them in the new order, so there is no cycle.
--
-- Fairness (docs/fairness.md): the claim used to choose its project from a second candidate
-- read under the organization row lock. It now makes that check under the project row lock:
-- once the project row is locked, every claim and completion of that project queued ahead
-- has committed, and a fresh read (a new snapshot per statement) says whether another project
-- of the organization is now less served; if one is, this candidate is passed over. So
-- concurrent claimers still cannot pile onto the project that looked least served in a read
-- taken before the others committed.
--
-- Timestamps: a claim stamps claimed_at after its last reservation; a completion stamps
-- finished_at after releasing its counters: [claimed_at, finished_at) stays inside the time
-- the attempt held its capacity.

-- Whether a fresh read of this organization's candidates puts another project ahead of
-- p_project, in pgd_claim_candidates' order: a smaller weighted running share, or the same
-- share and claimed less recently (never first), or the same share and time and a smaller id.
-- Read without locks; the caller holds p_project's row.
CREATE FUNCTION pgd_fairer_candidate_exists(p_pool_ids bigint[], p_org_id bigint, p_project projects)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1
          FROM pgd_claim_candidates(p_pool_ids, p_org_id) f
          JOIN projects p ON p.id = f.project_id
         WHERE p.id <> p_project.id
           AND (p.running::float8 / p.weight < p_project.running::float8 / p_project.weight
                OR (p.running::float8 / p.weight = p_project.running::float8 / p_project.weight
                    AND ((p.last_claimed_at IS NULL AND p_project.last_claimed_at IS NOT NULL)
                         OR p.last_claimed_at < p_project.last_claimed_at
                         OR (p.last_claimed_at IS NOT DISTINCT FROM p_project.last_claimed_at
                             AND p.id < p_project.id)))))
$$;

-- Lock every blocked job downstream of p_job_ids (transitively), by id: the "dependents" step
-- of the lock order, taken before any of them is updated. Completions of one organization
-- used to run one at a time behind its organization row; now they run side by side up to the
-- counter rows, and two of them releasing or cancelling overlapping dependents in different
-- orders deadlocked (found by a stress run: two batches cancelling D1 and D2 in opposite
-- orders). An edge committed after this read is still followed by the level-by-level walk
-- of pgd_cancel_dependents; only its lock is then taken out of order.
CREATE FUNCTION pgd_lock_dependents(p_job_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1
       FROM jobs j
      WHERE j.id IN (WITH RECURSIVE downstream(id) AS (
                         SELECT jd.job_id FROM job_dependencies jd
                          WHERE jd.depends_on_job_id = ANY (p_job_ids)
                         UNION
                         SELECT jd.job_id FROM job_dependencies jd
                           JOIN downstream d ON jd.depends_on_job_id = d.id)
                     SELECT id FROM downstream)
        AND j.state = 'blocked'
      ORDER BY j.id
        FOR NO KEY UPDATE;
END;
$$;

-- pgd_release_dependents and pgd_cancel_dependents as in 0002, with their dependents locked
-- by id first (pgd_lock_dependents).
CREATE OR REPLACE FUNCTION pgd_release_dependents(p_job_id bigint) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    PERFORM pgd_lock_dependents(ARRAY[p_job_id]);
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

CREATE OR REPLACE FUNCTION pgd_cancel_dependents(p_job_id bigint, p_why text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    frontier bigint[] := ARRAY[p_job_id];
    n        integer := 0;
BEGIN
    PERFORM pgd_lock_dependents(ARRAY[p_job_id]);
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

-- The pools a claim by p_runner_id may take from: p_pool_ids that the runner serves; NULL
-- when the runner is draining or stopped (it claims nothing). Checks the lease (seconds).
-- Raises PD422 for a lease outside (0, 86400], PD404 for an unknown runner.
CREATE FUNCTION pgd_runner_pools(p_runner_id bigint, p_pool_ids bigint[], p_lease_seconds double precision)
RETURNS bigint[]
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_runner runners%ROWTYPE;
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
        RETURN NULL;
    END IF;
    RETURN ARRAY(SELECT unnest(p_pool_ids) INTERSECT SELECT unnest(v_runner.pool_ids));
END;
$$;

-- claim: as in 0002, in the new lock order. For each candidate (fairest first, read without
-- locks): the job (SKIP LOCKED), for a deployment its target, then the project row (waits for
-- the claims and completions of that project ahead of this one; checks pause, bound and, on
-- the first pass, that no other project now comes before it in the fairness order), the organization and the pool (each a conditional UPDATE), then
-- the job's generation bump and the attempt. When every candidate of the first pass was
-- either taken by others or passed over as no longer the fairest, a second pass over a fresh
-- read takes the first it can, so the fairness check never leaves a runner idle.
CREATE OR REPLACE FUNCTION pgd_claim(p_runner_id bigint, p_pool_ids bigint[], p_claim_token uuid,
                                     p_lease_seconds double precision)
RETURNS TABLE (job_id bigint, attempt_id bigint, attempt_no integer, generation bigint,
               lease_expires_at timestamptz, project_id bigint, pool_id bigint,
               target_id bigint, command text[], timeout_seconds integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_pools   bigint[];
    c         record;
    v_pass    integer;
    v_retry   boolean;
    v_proj    projects%ROWTYPE;
    v_job     jobs%ROWTYPE;
    v_attempt bigint;
    v_claimed timestamptz;
    v_lease   timestamptz;
BEGIN
    v_pools := pgd_runner_pools(p_runner_id, p_pool_ids, p_lease_seconds);
    IF v_pools IS NULL THEN
        RETURN;  -- the runner is draining or stopped
    END IF;

    FOR v_pass IN 1..2 LOOP
        v_retry := false;
        FOR c IN SELECT * FROM pgd_claim_candidates(v_pools, NULL) LOOP
        BEGIN
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

            SELECT * INTO v_proj FROM projects p WHERE p.id = c.project_id FOR NO KEY UPDATE;
            IF v_proj.paused_at IS NOT NULL
               OR (v_proj.max_running IS NOT NULL AND v_proj.running >= v_proj.max_running) THEN
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
            IF v_pass = 1 AND pgd_fairer_candidate_exists(v_pools, c.org_id, v_proj) THEN
                v_retry := true;
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
            UPDATE projects p SET running = p.running + 1, last_claimed_at = clock_timestamp()
             WHERE p.id = v_proj.id;

            UPDATE organizations o SET running = o.running + 1
             WHERE o.id = c.org_id AND o.running < o.max_running;
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

            UPDATE pools q SET running = q.running + 1
             WHERE q.id = c.pool_id AND q.running < q.slots;
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

            UPDATE jobs j
               SET state = 'running', generation = j.generation + 1,
                   attempts_made = j.attempts_made + 1,
                   started_at = coalesce(j.started_at, now())
             WHERE j.id = v_job.id
            RETURNING * INTO v_job;

            -- claimed_at is the clock now, after every reservation, not now() (the
            -- transaction's start, which may precede the waits for the counter rows).
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
        EXIT WHEN NOT v_retry;
    END LOOP;
    RETURN;
END;
$$;

-- claim_batch: as in 0003, in the new lock order: up to cardinality(p_claim_tokens) build
-- jobs of one (project, pool) candidate, SKIP LOCKED, as many as the free capacity read
-- without locks allows; then the project (pause, bound, fairness on the first pass), the
-- organization and the pool, each locked and read; the count taken is bounded by what those
-- locked reads leave free. Jobs locked beyond that count stay queued (their locks end with
-- the transaction).
CREATE OR REPLACE FUNCTION pgd_claim_batch(p_runner_id bigint, p_pool_ids bigint[], p_claim_tokens uuid[],
                                           p_lease_seconds double precision)
RETURNS TABLE (job_id bigint, attempt_id bigint, attempt_no integer, generation bigint,
               lease_expires_at timestamptz, project_id bigint, pool_id bigint,
               target_id bigint, command text[], timeout_seconds integer, claim_token uuid)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_pools   bigint[];
    v_want    integer := coalesce(cardinality(p_claim_tokens), 0);
    c         record;
    v_pass    integer;
    v_retry   boolean;
    v_proj    projects%ROWTYPE;
    v_free    integer;
    v_ids     bigint[];
    v_n       integer;
    v_claimed timestamptz;
    v_lease   timestamptz;
BEGIN
    IF v_want < 1 OR v_want > 1000 THEN
        RAISE EXCEPTION 'a batch claims 1 to 1000 jobs, got %', v_want USING ERRCODE = 'PD422';
    END IF;
    v_pools := pgd_runner_pools(p_runner_id, p_pool_ids, p_lease_seconds);
    IF v_pools IS NULL THEN
        RETURN;  -- the runner is draining or stopped
    END IF;

    FOR v_pass IN 1..2 LOOP
        v_retry := false;
        FOR c IN SELECT * FROM pgd_claim_candidates(v_pools, NULL) LOOP
        BEGIN
            -- the free capacity as read without locks sizes the jobs locked below
            SELECT least(v_want, o.max_running - o.running, q.slots - q.running,
                         coalesce(p.max_running - p.running, v_want))
              INTO v_free
              FROM organizations o, projects p, pools q
             WHERE o.id = c.org_id AND p.id = c.project_id AND q.id = c.pool_id;
            IF v_free < 1 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            -- SKIP LOCKED: jobs other claimers are taking are passed over, not waited for
            v_ids := ARRAY(
                SELECT j.id FROM jobs j
                 WHERE j.project_id = c.project_id AND j.pool_id = c.pool_id
                   AND j.state = 'queued' AND j.ready_at <= now() AND j.target_id IS NULL
                 ORDER BY j.priority DESC, j.id
                 LIMIT v_free
                   FOR NO KEY UPDATE OF j SKIP LOCKED);
            IF cardinality(v_ids) = 0 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

            SELECT * INTO v_proj FROM projects p WHERE p.id = c.project_id FOR NO KEY UPDATE;
            IF v_proj.paused_at IS NOT NULL THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            IF v_pass = 1 AND pgd_fairer_candidate_exists(v_pools, c.org_id, v_proj) THEN
                v_retry := true;
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
            v_n := least(cardinality(v_ids), coalesce(v_proj.max_running - v_proj.running, v_want));
            SELECT least(v_n, o.max_running - o.running) INTO v_n
              FROM organizations o WHERE o.id = c.org_id FOR NO KEY UPDATE;
            SELECT least(v_n, q.slots - q.running) INTO v_n
              FROM pools q WHERE q.id = c.pool_id FOR NO KEY UPDATE;
            IF v_n < 1 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            v_ids := v_ids[1:v_n];

            UPDATE projects SET running = running + v_n, last_claimed_at = clock_timestamp()
             WHERE id = v_proj.id;
            UPDATE organizations SET running = running + v_n WHERE id = c.org_id;
            UPDATE pools SET running = running + v_n WHERE id = c.pool_id;

            v_claimed := clock_timestamp();
            v_lease := v_claimed + make_interval(secs => p_lease_seconds);
            RETURN QUERY
            WITH taken AS (
                UPDATE jobs j
                   SET state = 'running', generation = j.generation + 1,
                       attempts_made = j.attempts_made + 1,
                       started_at = coalesce(j.started_at, now())
                 WHERE j.id = ANY (v_ids)
                RETURNING j.*
            ), numbered AS (
                SELECT t.*, row_number() OVER (ORDER BY t.priority DESC, t.id) AS n FROM taken t
            ), inserted AS (
                INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token,
                                      state, claimed_at, lease_expires_at, last_heartbeat_at)
                SELECT n.id, n.attempts_made, n.generation, p_runner_id, p_claim_tokens[n.n],
                       'running', v_claimed, v_lease, now()
                  FROM numbered n
                RETURNING attempts.id, attempts.job_id, attempts.claim_token
            )
            SELECT n.id, i.id, n.attempts_made, n.generation, v_lease, n.project_id, n.pool_id,
                   n.target_id, n.command, n.timeout_seconds, i.claim_token
              FROM numbered n JOIN inserted i ON i.job_id = n.id
             ORDER BY n.n;
            RETURN;
        EXCEPTION WHEN SQLSTATE 'PDSKP' THEN
            NULL;  -- nothing to take here; this candidate's locks went with its subtransaction
        END;
        END LOOP;
        EXIT WHEN NOT v_retry;
    END LOOP;
    RETURN;
END;
$$;

-- Release the capacity of finished attempts: p_org_ids, p_project_ids and p_pool_ids hold
-- one entry per attempt (repeats count). Each kind is locked by id, in the lock order
-- (projects, organizations, pools), then decremented by its count.
CREATE FUNCTION pgd_release_capacity(p_org_ids bigint[], p_project_ids bigint[], p_pool_ids bigint[])
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM projects p WHERE p.id = ANY (p_project_ids) ORDER BY p.id FOR NO KEY UPDATE;
    UPDATE projects p SET running = p.running - f.n
      FROM (SELECT id, count(*) AS n FROM unnest(p_project_ids) id GROUP BY id) f
     WHERE p.id = f.id;
    PERFORM 1 FROM organizations o WHERE o.id = ANY (p_org_ids) ORDER BY o.id FOR NO KEY UPDATE;
    UPDATE organizations o SET running = o.running - f.n
      FROM (SELECT id, count(*) AS n FROM unnest(p_org_ids) id GROUP BY id) f
     WHERE o.id = f.id;
    PERFORM 1 FROM pools q WHERE q.id = ANY (p_pool_ids) ORDER BY q.id FOR NO KEY UPDATE;
    UPDATE pools q SET running = q.running - f.n
      FROM (SELECT id, count(*) AS n FROM unnest(p_pool_ids) id GROUP BY id) f
     WHERE q.id = f.id;
END;
$$;

-- complete_attempt: pgd_complete's work, in the new lock order (job, target, attempt, then
-- dependents, then the counters). With p_release the attempt's project, organization and
-- pool slots are released here, before the attempt is stamped finished; without it (a batch)
-- the caller releases them after every item, and the answer tells it whether to: the report
-- released capacity when it is neither repeated nor late.
CREATE FUNCTION pgd_complete_attempt(p_attempt_id bigint, p_generation bigint, p_outcome text,
                                     p_exit_code integer, p_error text, p_output_tail text,
                                     p_receipt_key text, p_backoff_base_seconds double precision,
                                     p_backoff_cap_seconds double precision, p_release boolean)
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
    IF p_generation IS NULL THEN
        RAISE EXCEPTION 'a completion names the generation it holds' USING ERRCODE = 'PD422';
    END IF;

    SELECT a.job_id, j.project_id, j.pool_id, j.target_id, p.organization_id AS org_id
      INTO v_ids
      FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
     WHERE a.id = p_attempt_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown attempt %', p_attempt_id USING ERRCODE = 'PD404';
    END IF;

    -- Lock order. These ids never change after insert, so reading them unlocked is safe.
    SELECT * INTO v_job FROM jobs WHERE id = v_ids.job_id FOR NO KEY UPDATE;
    IF v_ids.target_id IS NOT NULL THEN
        PERFORM 1 FROM targets WHERE id = v_ids.target_id FOR NO KEY UPDATE;
    END IF;
    SELECT * INTO v_attempt FROM attempts WHERE id = p_attempt_id FOR NO KEY UPDATE;

    -- Checked under the attempt's lock, so a concurrent first delivery of the same key for
    -- this attempt is seen here.
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
        -- A build whose report arrives after its lease lapsed while nobody has claimed the job
        -- since (same generation): its result is real, so it counts. Its slots were released
        -- at expiry, which also counted the failure; a late failure changes only the attempt.
        -- A job that already failed for good is only revived when no dependent was cancelled.
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

    -- the shared counter rows last: held only from here to the end of the commit
    IF p_release AND NOT v_is_late THEN
        UPDATE projects SET running = running - 1 WHERE id = v_ids.project_id;
        UPDATE organizations SET running = running - 1 WHERE id = v_ids.org_id;
        UPDATE pools SET running = running - 1 WHERE id = v_ids.pool_id;
    END IF;

    UPDATE attempts
       SET state = v_att_state,
           -- after the release, like claimed_at after the reservations (see pgd_claim); a
           -- late report keeps the time the lease lapsed, when its slots were released
           finished_at = CASE WHEN v_is_late THEN finished_at ELSE clock_timestamp() END,
           exit_code = p_exit_code,
           error = p_error,
           output_tail = coalesce(p_output_tail, output_tail)
     WHERE id = p_attempt_id;
    RETURN v_response;
END;
$$;

-- complete: one report, its capacity released in the same transaction (see
-- pgd_complete_attempt). Signature and answers as in 0002.
CREATE OR REPLACE FUNCTION pgd_complete(p_attempt_id bigint, p_generation bigint, p_outcome text,
                                        p_exit_code integer, p_error text, p_output_tail text,
                                        p_receipt_key text, p_backoff_base_seconds double precision,
                                        p_backoff_cap_seconds double precision)
RETURNS jsonb
LANGUAGE sql AS $$
    SELECT pgd_complete_attempt(p_attempt_id, p_generation, p_outcome, p_exit_code, p_error,
                                p_output_tail, p_receipt_key, p_backoff_base_seconds,
                                p_backoff_cap_seconds, true)
$$;

-- complete_batch: as in 0004, in the new lock order. Jobs, targets and attempts are locked
-- first (each kind by id); then the fast path (successful builds, set-based) and its
-- dependents; then every other item through pgd_complete_attempt without release; then the
-- capacity of every item that released some, in one pgd_release_capacity (projects,
-- organizations, pools, each by id); then the fast path's attempts are stamped finished.
-- Answers are returned in item order, as before.
CREATE OR REPLACE FUNCTION pgd_complete_batch(p_items jsonb, p_backoff_base_seconds double precision,
                                              p_backoff_cap_seconds double precision)
RETURNS SETOF jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_targets  bigint[];
    v_attempts bigint[];
    v_rows pgd_fast_completion[];
    v_jobs bigint[];
    v_done bigint[];
    v_answers jsonb[];
    v_answer  jsonb;
    v_fast_ords    bigint[];
    v_fast_answers jsonb[];
    v_orgs     bigint[] := '{}';
    v_projects bigint[] := '{}';
    v_pools    bigint[] := '{}';
    v_released bigint[] := '{}';
    v_ids  record;
    it     record;
BEGIN
    IF p_items IS NULL OR jsonb_typeof(p_items) <> 'array' OR jsonb_array_length(p_items) > 1000 THEN
        RAISE EXCEPTION 'items must be an array of at most 1000 completions' USING ERRCODE = 'PD422';
    END IF;
    -- the same checks pgd_complete makes, before anything is written: a bad item fails the batch
    PERFORM 1 FROM jsonb_to_recordset(p_items) AS x(outcome text, receipt_key text)
     WHERE x.outcome IS NULL
        OR x.outcome NOT IN ('succeeded', 'failed', 'cancelled', 'handed_back', 'lost');
    IF FOUND THEN
        RAISE EXCEPTION 'unknown outcome in batch' USING ERRCODE = 'PD422';
    END IF;
    PERFORM 1 FROM jsonb_to_recordset(p_items) AS x(receipt_key text)
     WHERE x.receipt_key IS NULL OR length(x.receipt_key) NOT BETWEEN 1 AND 200;
    IF FOUND THEN
        RAISE EXCEPTION 'receipt key must be 1 to 200 characters' USING ERRCODE = 'PD422';
    END IF;
    PERFORM 1 FROM jsonb_to_recordset(p_items) AS x(attempt_id bigint, generation bigint)
     WHERE x.attempt_id IS NULL OR x.generation IS NULL;
    IF FOUND THEN
        RAISE EXCEPTION 'every item needs an attempt id and a generation' USING ERRCODE = 'PD422';
    END IF;
    v_answers := array_fill(NULL::jsonb, ARRAY[jsonb_array_length(p_items)]);

    -- The ids of every row to lock, read without locks (they never change after insert), one
    -- primary-key probe per item (OFFSET 0 keeps each probe a probe), then the locks in the
    -- lock order: jobs, targets, attempts, each by id.
    SELECT array_agg(DISTINCT a.job_id ORDER BY a.job_id),
           array_agg(DISTINCT j.target_id ORDER BY j.target_id) FILTER (WHERE j.target_id IS NOT NULL),
           array_agg(DISTINCT a.id ORDER BY a.id)
      INTO v_jobs, v_targets, v_attempts
      FROM (SELECT DISTINCT (e ->> 'attempt_id')::bigint AS id FROM jsonb_array_elements(p_items) e) u
      CROSS JOIN LATERAL (SELECT a.id, a.job_id FROM attempts a WHERE a.id = u.id OFFSET 0) a
      CROSS JOIN LATERAL (SELECT j.target_id FROM jobs j WHERE j.id = a.job_id OFFSET 0) j;
    PERFORM 1 FROM unnest(v_jobs) u(id)
      CROSS JOIN LATERAL (SELECT 1 FROM jobs j WHERE j.id = u.id FOR NO KEY UPDATE OFFSET 0) l;
    PERFORM 1 FROM targets t WHERE t.id = ANY (v_targets) ORDER BY t.id FOR NO KEY UPDATE;
    PERFORM 1 FROM unnest(v_attempts) u(id)
      CROSS JOIN LATERAL (SELECT 1 FROM attempts a WHERE a.id = u.id FOR NO KEY UPDATE OFFSET 0) l;
    -- every item's dependents at once, by id, before any item releases or cancels some
    PERFORM pgd_lock_dependents(v_jobs);

    -- The fast path, read under those locks: a build's success, reported by its current
    -- running attempt (generation matches job and attempt), with a receipt key not yet used,
    -- and neither the attempt nor the key named twice in this batch.
    v_rows := ARRAY(
        SELECT ROW(x.ord, x.attempt_id, w.job_id, w.org_id, w.project_id, w.pool_id,
                   x.receipt_key, x.exit_code, x.error, x.output_tail, w.ready_at)::pgd_fast_completion
          FROM (SELECT e.ord, i.*, count(*) OVER (PARTITION BY i.attempt_id) AS same_attempt,
                       count(*) OVER (PARTITION BY i.receipt_key) AS same_key
                  FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e(item, ord),
                       jsonb_to_record(e.item)
                       AS i(attempt_id bigint, generation bigint, outcome text, receipt_key text,
                            exit_code integer, error text, output_tail text)) x
          CROSS JOIN LATERAL (
                SELECT a.job_id FROM attempts a
                 WHERE a.id = x.attempt_id AND a.state = 'running' AND a.generation = x.generation
                OFFSET 0) a
          CROSS JOIN LATERAL (
                SELECT j.id AS job_id, p.organization_id AS org_id, j.project_id, j.pool_id, j.ready_at
                  FROM jobs j JOIN projects p ON p.id = j.project_id
                 WHERE j.id = a.job_id
                   AND j.state = 'running' AND j.target_id IS NULL AND j.generation = x.generation
                OFFSET 0) w
         WHERE x.outcome = 'succeeded' AND x.same_attempt = 1 AND x.same_key = 1
           AND NOT EXISTS (SELECT 1 FROM delivery_receipts r WHERE r.key = x.receipt_key));

    IF cardinality(v_rows) > 0 THEN
        UPDATE jobs j SET state = 'succeeded', finished_at = now(), last_error = NULL
          FROM unnest(v_rows) f WHERE j.id = f.job_id;

        -- Dependents (pgd_release_dependents for each finished job, at once): a dependent
        -- waiting on k of this batch's jobs loses k pending dependencies (already locked, by
        -- id, with every item's dependents above).
        v_done := ARRAY(SELECT f.job_id FROM unnest(v_rows) f);
        UPDATE jobs d
           SET pending_dependencies = d.pending_dependencies - k.n,
               state = CASE WHEN d.pending_dependencies = k.n
                                 AND (NOT d.requires_approval OR d.approved_at IS NOT NULL)
                            THEN 'queued' ELSE 'blocked' END,
               ready_at = CASE WHEN d.pending_dependencies = k.n THEN now() ELSE d.ready_at END
          FROM (SELECT jd.job_id, count(*) AS n FROM job_dependencies jd
                 WHERE jd.depends_on_job_id = ANY (v_done) GROUP BY jd.job_id) k
         WHERE d.id = k.job_id AND d.state = 'blocked';

        WITH answered AS (
            INSERT INTO delivery_receipts (key, attempt_id, outcome, response)
            SELECT f.receipt_key, f.attempt_id, 'succeeded',
                   jsonb_build_object('status', 'recorded', 'job_id', f.job_id,
                                      'attempt_id', f.attempt_id, 'job_state', 'succeeded',
                                      'attempt_state', 'succeeded', 'is_late_report', false,
                                      'ready_at', f.ready_at, 'repeated', false)
              FROM unnest(v_rows) f
            RETURNING attempt_id, response
        )
        SELECT array_agg(f.ord ORDER BY f.ord), array_agg(a.response ORDER BY f.ord)
          INTO v_fast_ords, v_fast_answers
          FROM answered a JOIN unnest(v_rows) f ON f.attempt_id = a.attempt_id;
        FOR i IN 1 .. cardinality(v_fast_ords) LOOP
            v_answers[v_fast_ords[i]] := v_fast_answers[i];
        END LOOP;
        v_orgs := ARRAY(SELECT f.org_id FROM unnest(v_rows) f);
        v_projects := ARRAY(SELECT f.project_id FROM unnest(v_rows) f);
        v_pools := ARRAY(SELECT f.pool_id FROM unnest(v_rows) f);
    END IF;

    FOR it IN
        SELECT e.ord, x.*
          FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e(item, ord),
               jsonb_to_record(e.item)
               AS x(attempt_id bigint, generation bigint, outcome text, receipt_key text,
                    exit_code integer, error text, output_tail text)
         ORDER BY e.ord
    LOOP
        CONTINUE WHEN v_answers[it.ord] IS NOT NULL;
        BEGIN
            v_answer := pgd_complete_attempt(it.attempt_id, it.generation, it.outcome, it.exit_code,
                                             it.error, it.output_tail, it.receipt_key,
                                             p_backoff_base_seconds, p_backoff_cap_seconds, false);
            IF NOT (v_answer ->> 'repeated')::boolean AND NOT (v_answer ->> 'is_late_report')::boolean THEN
                SELECT p.organization_id AS org_id, j.project_id, j.pool_id INTO v_ids
                  FROM jobs j JOIN projects p ON p.id = j.project_id
                 WHERE j.id = (v_answer ->> 'job_id')::bigint;
                v_orgs := v_orgs || v_ids.org_id;
                v_projects := v_projects || v_ids.project_id;
                v_pools := v_pools || v_ids.pool_id;
                v_released := v_released || it.attempt_id;
            END IF;
        EXCEPTION WHEN SQLSTATE 'PDF01' THEN
            v_answer := jsonb_build_object('status', 'fenced', 'attempt_id', it.attempt_id,
                                           'error', SQLERRM);
        END;
        v_answers[it.ord] := v_answer;
    END LOOP;

    -- the shared counter rows last
    IF cardinality(v_orgs) > 0 THEN
        PERFORM pgd_release_capacity(v_orgs, v_projects, v_pools);
    END IF;
    -- the items completed one by one were stamped before the release: stamp them again after
    -- it, so that [claimed_at, finished_at) covers the time they held capacity
    UPDATE attempts SET finished_at = clock_timestamp() WHERE id = ANY (v_released);
    IF cardinality(v_rows) > 0 THEN
        UPDATE attempts a
           SET state = 'succeeded', finished_at = clock_timestamp(), exit_code = f.exit_code,
               error = f.error, output_tail = coalesce(f.output_tail, a.output_tail)
          FROM unnest(v_rows) f WHERE a.id = f.attempt_id;
    END IF;
    RETURN QUERY SELECT a FROM unnest(v_answers) a;
END;
$$;

-- expire: as in 0002, in the new lock order: the job (SKIP LOCKED: one another transaction
-- holds is left for the next pass), its target, the attempt; re-checked under those locks;
-- then dependents, then the project, organization and pool slots released, then the attempt
-- stamped.
CREATE OR REPLACE FUNCTION pgd_expire_one(p_backoff_base_seconds double precision,
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
            IF v_state IN ('failed', 'cancelled') THEN
                PERFORM pgd_cancel_dependents(c.job_id, format('dependency %s %s', c.job_id, v_state));
            END IF;

            UPDATE projects SET running = running - 1 WHERE id = c.project_id;
            UPDATE organizations SET running = running - 1 WHERE id = c.org_id;
            UPDATE pools SET running = running - 1 WHERE id = c.pool_id;

            UPDATE attempts
               SET state = CASE WHEN c.target_id IS NOT NULL THEN 'lost' ELSE 'expired' END,
                   finished_at = clock_timestamp(), error = 'lease expired'
             WHERE id = c.attempt_id;
            RETURN jsonb_build_object('attempt_id', c.attempt_id, 'job_id', c.job_id,
                                      'job_state', v_state, 'is_deployment', c.target_id IS NOT NULL);
        EXCEPTION WHEN SQLSTATE 'PDSKP' THEN
            NULL;
        END;
    END LOOP;
    RETURN NULL;
END;
$$;
