-- 0004_hot_path: the claim -> complete path made cheaper, same semantics (issue 5).
-- 1. pgd_complete_batch completes the batch's successful builds with one statement per
--    table instead of one pgd_complete (and one subtransaction) per item.
-- 2. pgd_claim_candidates becomes a plain SQL function the planner can inline.
--
-- Issue 5, measured in docs/benchmarks.md ("Batched completion, set-based"): pgd_complete_batch
-- of 0003 spent about 0.35 ms per item, most of it in the per-item subtransaction and in
-- statements repeated per item while the batch held its organization row. The common case —
-- a build that succeeded, reported once by the attempt that holds the job — needs none of
-- pgd_complete's branches, so it is done for all such items at once; every other item (a
-- failure, a cancellation, a hand-back, a deployment, a repeated or foreign receipt key, a
-- fenced or late report, an attempt or key named twice in the batch) still goes through
-- pgd_complete, one at a time, exactly as before. Answers are identical in shape and order.
--
-- Lock order is unchanged: every row the batch touches is locked first, in the global order
-- (organizations, projects, pools, jobs, targets, attempts, each sorted by id); the
-- dependents released by the fast path (blocked jobs, which no claim touches) are locked
-- after that, sorted by id, before they are updated, so two batches releasing overlapping
-- dependents wait for each other instead of deadlocking.
-- One item of the fast path, as read under the batch's locks.
CREATE TYPE pgd_fast_completion AS (
    ord bigint, attempt_id bigint, job_id bigint, org_id bigint, project_id bigint, pool_id bigint,
    receipt_key text, exit_code integer, error text, output_tail text, ready_at timestamptz
);

CREATE OR REPLACE FUNCTION pgd_complete_batch(p_items jsonb, p_backoff_base_seconds double precision,
                                              p_backoff_cap_seconds double precision)
RETURNS SETOF jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_orgs     bigint[];
    v_projects bigint[];
    v_pools    bigint[];
    v_targets  bigint[];
    v_attempts bigint[];
    v_rows pgd_fast_completion[];
    v_fast jsonb := '{}';
    v_jobs bigint[];
    v_done bigint[];
    it     record;
BEGIN
    IF jsonb_typeof(p_items) <> 'array' OR jsonb_array_length(p_items) > 1000 THEN
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

    -- The ids of every row to lock, read without locks (they never change after insert),
    -- one primary-key probe per item (OFFSET 0 keeps each probe a probe, whatever the
    -- planner's statistics say about a fast-growing table), then the locks in the global
    -- order, each kind sorted by id; jobs and attempts probed one by one in that order.
    SELECT array_agg(DISTINCT p.org_id ORDER BY p.org_id),
           array_agg(DISTINCT j.project_id ORDER BY j.project_id),
           array_agg(DISTINCT j.pool_id ORDER BY j.pool_id),
           array_agg(DISTINCT a.job_id ORDER BY a.job_id),
           array_agg(DISTINCT j.target_id ORDER BY j.target_id) FILTER (WHERE j.target_id IS NOT NULL),
           array_agg(DISTINCT a.id ORDER BY a.id)
      INTO v_orgs, v_projects, v_pools, v_jobs, v_targets, v_attempts
      FROM (SELECT DISTINCT (e ->> 'attempt_id')::bigint AS id FROM jsonb_array_elements(p_items) e) u
      CROSS JOIN LATERAL (SELECT a.id, a.job_id FROM attempts a WHERE a.id = u.id OFFSET 0) a
      CROSS JOIN LATERAL (SELECT j.project_id, j.pool_id, j.target_id FROM jobs j
                           WHERE j.id = a.job_id OFFSET 0) j
      CROSS JOIN LATERAL (SELECT p.organization_id AS org_id FROM projects p
                           WHERE p.id = j.project_id OFFSET 0) p;
    PERFORM 1 FROM organizations o WHERE o.id = ANY (v_orgs) ORDER BY o.id FOR NO KEY UPDATE;
    PERFORM 1 FROM projects p WHERE p.id = ANY (v_projects) ORDER BY p.id FOR NO KEY UPDATE;
    PERFORM 1 FROM pools q WHERE q.id = ANY (v_pools) ORDER BY q.id FOR NO KEY UPDATE;
    PERFORM 1 FROM unnest(v_jobs) u(id)
      CROSS JOIN LATERAL (SELECT 1 FROM jobs j WHERE j.id = u.id FOR NO KEY UPDATE OFFSET 0) l;
    PERFORM 1 FROM targets t WHERE t.id = ANY (v_targets) ORDER BY t.id FOR NO KEY UPDATE;
    PERFORM 1 FROM unnest(v_attempts) u(id)
      CROSS JOIN LATERAL (SELECT 1 FROM attempts a WHERE a.id = u.id FOR NO KEY UPDATE OFFSET 0) l;

    -- The fast path, read under those locks: a build's success, reported by its current
    -- running attempt (generation matches job and attempt), with a receipt key not yet used,
    -- and neither the attempt nor the key named twice in this batch.
    -- (Driven by the items, one primary-key probe each: OFFSET 0 keeps the planner from
    -- starting at the jobs table, whose statistics lag behind a busy queue.)
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
        UPDATE organizations o SET running = o.running - f.n
          FROM (SELECT org_id, count(*) AS n FROM unnest(v_rows) GROUP BY org_id) f
         WHERE o.id = f.org_id;
        UPDATE projects p SET running = p.running - f.n
          FROM (SELECT project_id, count(*) AS n FROM unnest(v_rows) GROUP BY project_id) f
         WHERE p.id = f.project_id;
        UPDATE pools q SET running = q.running - f.n
          FROM (SELECT pool_id, count(*) AS n FROM unnest(v_rows) GROUP BY pool_id) f
         WHERE q.id = f.pool_id;
        UPDATE jobs j SET state = 'succeeded', finished_at = now(), last_error = NULL
          FROM unnest(v_rows) f WHERE j.id = f.job_id;
        UPDATE attempts a
           SET state = 'succeeded', finished_at = clock_timestamp(), exit_code = f.exit_code,
               error = f.error, output_tail = coalesce(f.output_tail, a.output_tail)
          FROM unnest(v_rows) f WHERE a.id = f.attempt_id;

        -- Dependents (pgd_release_dependents for each finished job, at once): a dependent
        -- waiting on k of this batch's jobs loses k pending dependencies.
        v_done := ARRAY(SELECT f.job_id FROM unnest(v_rows) f);
        PERFORM 1 FROM jobs d
         WHERE d.id IN (SELECT jd.job_id FROM job_dependencies jd WHERE jd.depends_on_job_id = ANY (v_done))
           AND d.state = 'blocked'
         ORDER BY d.id FOR NO KEY UPDATE;
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
        SELECT jsonb_object_agg(f.ord::text, a.response) INTO v_fast
          FROM answered a JOIN unnest(v_rows) f ON f.attempt_id = a.attempt_id;
    END IF;

    FOR it IN
        SELECT e.ord, x.*
          FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e(item, ord),
               jsonb_to_record(e.item)
               AS x(attempt_id bigint, generation bigint, outcome text, receipt_key text,
                    exit_code integer, error text, output_tail text)
         ORDER BY e.ord
    LOOP
        IF v_fast ? it.ord::text THEN
            RETURN NEXT v_fast -> it.ord::text;
            CONTINUE;
        END IF;
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

-- pgd_claim_candidates as a plain SQL function (same signature, same rows, same order): the
-- planner inlines it into the claim's query instead of running PL/pgSQL's RETURN QUERY into
-- a tuplestore twice per claim, and a deployment's target is probed by primary key instead
-- of hashing the targets table for every candidate. The EXISTS is written as the claim's
-- own selection (ORDER BY the claim index's order, LIMIT 1) and kept from being flattened
-- (OFFSET 0), so that it stays a probe of jobs_claim_idx per (project, pool), evaluated once
-- per candidate (it names p.id, so it runs after the join): flattened into a semi-join, the
-- planner built bitmaps over every index entry of the project, finished history included
-- (2.5-68x slower claims with 10,000,000 finished jobs); kept as a plain subplan without the
-- ORDER BY, it chose a sequential scan of jobs, expecting a queued row within the first few
-- (140 claims/s instead of 520 behind 2,000 finished jobs). docs/benchmarks.md, "Latency at
-- size".
CREATE OR REPLACE FUNCTION pgd_claim_candidates(p_pool_ids bigint[], p_org_id bigint)
RETURNS TABLE (org_id bigint, project_id bigint, pool_id bigint)
LANGUAGE sql STABLE AS $$
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
                    WHERE j.project_id = p.id AND j.pool_id = pp.pool_id
                      AND j.state = 'queued' AND j.ready_at <= now()
                      AND (j.target_id IS NULL
                           OR EXISTS (SELECT 1 FROM targets t
                                       WHERE t.id = j.target_id AND t.state = 'free'))
                    ORDER BY j.priority DESC, j.id
                    LIMIT 1 OFFSET 0)
     ORDER BY p.running::float8 / p.weight, p.last_claimed_at NULLS FIRST, p.id, pp.pool_id
     LIMIT 16
$$;
