-- 0003_batches: claim and complete several jobs in one transaction (one round trip each).
-- DESIGN.md, "Transitions"; issue 5: a scheduler with several free slots, or a batch of
-- finished attempts, pays one transaction instead of one per job, with every capacity and
-- fencing guarantee of pgd_claim / pgd_complete intact.

-- claim_batch: up to cardinality(p_claim_tokens) build jobs (no deployments: a target is
-- taken one claim at a time by pgd_claim) from ONE (project, pool) candidate, chosen as
-- pgd_claim chooses: the organization by a lock-free read, then the fairest project under the
-- organization row lock. Every row it locks belongs to that one organization, project and
-- pool, taken in lock order, so a batch is as deadlock-free as a single claim. The count is
-- bounded by the free organization, project and pool capacity read under those row locks.
CREATE FUNCTION pgd_claim_batch(p_runner_id bigint, p_pool_ids bigint[], p_claim_tokens uuid[],
                                p_lease_seconds double precision)
RETURNS TABLE (job_id bigint, attempt_id bigint, attempt_no integer, generation bigint,
               lease_expires_at timestamptz, project_id bigint, pool_id bigint,
               target_id bigint, command text[], timeout_seconds integer, claim_token uuid)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_runner  runners%ROWTYPE;
    v_pools   bigint[];
    v_want    integer := coalesce(cardinality(p_claim_tokens), 0);
    o_c       record;
    c         record;
    v_tried   bigint[] := '{}';
    v_org     organizations%ROWTYPE;
    v_proj    projects%ROWTYPE;
    v_pool    pools%ROWTYPE;
    v_free    integer;
    v_ids     bigint[];
    v_n       integer;
    v_claimed timestamptz;
    v_lease   timestamptz;
BEGIN
    IF p_lease_seconds IS NULL OR p_lease_seconds <= 0 OR p_lease_seconds > 86400 THEN
        RAISE EXCEPTION 'lease seconds must be in (0, 86400], got %', p_lease_seconds
            USING ERRCODE = 'PD422';
    END IF;
    IF v_want < 1 OR v_want > 1000 THEN
        RAISE EXCEPTION 'a batch claims 1 to 1000 jobs, got %', v_want USING ERRCODE = 'PD422';
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
            SELECT * INTO v_org FROM organizations o WHERE o.id = o_c.org_id FOR NO KEY UPDATE;
            IF v_org.running >= v_org.max_running THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            FOR c IN SELECT * FROM pgd_claim_candidates(v_pools, o_c.org_id) LOOP
            BEGIN
                SELECT * INTO v_proj FROM projects p WHERE p.id = c.project_id FOR NO KEY UPDATE;
                SELECT * INTO v_pool FROM pools q WHERE q.id = c.pool_id FOR NO KEY UPDATE;
                v_free := least(v_want, v_org.max_running - v_org.running, v_pool.slots - v_pool.running,
                                coalesce(v_proj.max_running - v_proj.running, v_want));
                IF v_proj.paused_at IS NOT NULL OR v_free < 1 THEN
                    RAISE EXCEPTION USING ERRCODE = 'PDSKP';
                END IF;
                -- SKIP LOCKED: jobs other claimers are taking are passed over, not waited for
                v_ids := ARRAY(
                    SELECT j.id FROM jobs j
                     WHERE j.project_id = c.project_id AND j.pool_id = c.pool_id
                       AND j.state = 'queued' AND j.ready_at <= now() AND j.target_id IS NULL
                     ORDER BY j.priority DESC, j.id
                     LIMIT v_free
                       FOR NO KEY UPDATE OF j SKIP LOCKED);
                v_n := cardinality(v_ids);
                IF v_n = 0 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

                UPDATE organizations SET running = running + v_n WHERE id = v_org.id;
                UPDATE projects SET running = running + v_n, last_claimed_at = clock_timestamp()
                 WHERE id = v_proj.id;
                UPDATE pools SET running = running + v_n WHERE id = v_pool.id;

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
            RAISE EXCEPTION USING ERRCODE = 'PDSKP';
        EXCEPTION WHEN SQLSTATE 'PDSKP' THEN
            NULL;  -- the organization is full or has nothing to start; try the next one
        END;
    END LOOP;
    RETURN;
END;
$$;

-- complete_batch: record several outcomes in one transaction. First every row the batch will
-- touch is locked in the global lock order — all organizations, then all projects, pools,
-- jobs, targets, attempts, each kind sorted by id (FOR ... after ORDER BY locks in that
-- order) — so a batch spanning organizations cannot deadlock against claims; then each item
-- goes through pgd_complete (re-locking held rows is free). A fenced item answers
-- {"status": "fenced"} without undoing the others. p_items: a JSON array of objects with
-- attempt_id, generation, outcome, receipt_key and optionally exit_code, error, output_tail.
CREATE FUNCTION pgd_complete_batch(p_items jsonb, p_backoff_base_seconds double precision,
                                   p_backoff_cap_seconds double precision)
RETURNS SETOF jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    it    record;
BEGIN
    IF jsonb_typeof(p_items) <> 'array' OR jsonb_array_length(p_items) > 1000 THEN
        RAISE EXCEPTION 'items must be an array of at most 1000 completions' USING ERRCODE = 'PD422';
    END IF;
    v_ids := ARRAY(SELECT (e ->> 'attempt_id')::bigint FROM jsonb_array_elements(p_items) e);
    PERFORM 1 FROM organizations o
     WHERE o.id IN (SELECT p.organization_id FROM attempts a JOIN jobs j ON j.id = a.job_id
                      JOIN projects p ON p.id = j.project_id WHERE a.id = ANY (v_ids))
     ORDER BY o.id FOR NO KEY UPDATE;
    PERFORM 1 FROM projects p
     WHERE p.id IN (SELECT j.project_id FROM attempts a JOIN jobs j ON j.id = a.job_id
                     WHERE a.id = ANY (v_ids))
     ORDER BY p.id FOR NO KEY UPDATE;
    PERFORM 1 FROM pools q
     WHERE q.id IN (SELECT j.pool_id FROM attempts a JOIN jobs j ON j.id = a.job_id
                     WHERE a.id = ANY (v_ids))
     ORDER BY q.id FOR NO KEY UPDATE;
    PERFORM 1 FROM jobs j
     WHERE j.id IN (SELECT a.job_id FROM attempts a WHERE a.id = ANY (v_ids))
     ORDER BY j.id FOR NO KEY UPDATE;
    PERFORM 1 FROM targets t
     WHERE t.id IN (SELECT j.target_id FROM attempts a JOIN jobs j ON j.id = a.job_id
                     WHERE a.id = ANY (v_ids))
     ORDER BY t.id FOR NO KEY UPDATE;
    PERFORM 1 FROM attempts a WHERE a.id = ANY (v_ids) ORDER BY a.id FOR NO KEY UPDATE;

    FOR it IN
        SELECT * FROM jsonb_to_recordset(p_items)
            AS x(attempt_id bigint, generation bigint, outcome text, receipt_key text,
                 exit_code integer, error text, output_tail text)
    LOOP
        BEGIN
            RETURN NEXT pgd_complete(it.attempt_id, it.generation, it.outcome, it.exit_code,
                                     it.error, it.output_tail, it.receipt_key,
                                     p_backoff_base_seconds, p_backoff_cap_seconds);
        EXCEPTION WHEN SQLSTATE 'PDF01' THEN
            RETURN NEXT jsonb_build_object('status', 'fenced', 'attempt_id', it.attempt_id,
                                           'error', SQLERRM);
        END;
    END LOOP;
    RETURN;
END;
$$;
