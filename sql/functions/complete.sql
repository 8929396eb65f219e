-- Completion: a runner reports an attempt's outcome; the outcome is recorded once, every
-- reservation is released in the same transaction, dependents are released or cancelled,
-- and the job ends or is queued again with backoff.
--
-- Lock order (docs/design.md, "Lock order"): job -> target -> attempt -> dependents (by id)
-- -> organization stripes -> pool stripes -> debt rows (pgd_release_slots, sql/functions/
-- capacity.sql). Row locks are FOR NO KEY UPDATE, the lock an UPDATE of non-key columns
-- takes: no transition deletes a row or changes a key, and FOR UPDATE would also block the
-- foreign-key checks (FOR KEY SHARE) of an INSERT referencing the row (pgd_submit holds its
-- dependencies FOR SHARE and inserts a job referencing its project and pool).
-- A delivery receipt (delivery_receipts, immutable) keeps the first answer per key.
--
-- SQLSTATEs raised, translated to Python exceptions in sql/errors.py:
--   PD404 unknown attempt         PD409 receipt key already used by another attempt
--   PD422 invalid input           PDF01 fenced out (stale attempt or generation)

-- "Equal jitter" backoff (AWS Architecture Blog, "Exponential Backoff And Jitter", 2015):
-- keep half of the capped exponential delay and randomise the other half, so that jobs
-- failing together do not retry together. Returns seconds, never more than 30 days
-- (sql/settings.py, MAX_BACKOFF_SECONDS) whatever the caller passes: now() plus it must stay
-- a time PostgreSQL and Python both hold, or the transition that computes a ready_at fails
-- (an expiry pass would then stop at that row). The exponent is bounded for the same reason.
CREATE OR REPLACE FUNCTION pgd_backoff_seconds(p_failures integer, p_base_seconds double precision,
                                               p_cap_seconds double precision)
RETURNS double precision LANGUAGE sql VOLATILE AS $$
    SELECT greatest(0, least(2592000, p_cap_seconds,
                             least(p_base_seconds, 2592000)
                             * power(2, least(greatest(p_failures - 1, 0), 62))))
           * (0.5 + random() / 2)
$$;

-- Lock every blocked job downstream of p_job_ids (transitively), by id: the "dependents" step
-- of the lock order, taken before any of them is updated. Completions of one organization
-- run side by side, and two of them releasing or cancelling overlapping dependents in
-- different orders would deadlock (found by a stress run: two batches cancelling D1 and D2
-- in opposite orders). An edge committed after this read is still followed by the level-by-level walk
-- of pgd_cancel_dependents; only its lock is then taken out of order.
CREATE OR REPLACE FUNCTION pgd_lock_dependents(p_job_ids bigint[]) RETURNS void
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

-- A finished job's dependents: on success each blocked dependent loses one pending
-- dependency and is queued when none is left (and it needs no approval, or has it); on
-- failure or cancellation every blocked job downstream is cancelled, level by level. Both
-- lock the dependents by id first (pgd_lock_dependents).
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

-- complete: record the outcome of attempt p_attempt_id at generation p_generation, once per
-- receipt key (a repeated key returns the first answer, with "repeated": true). Locks job ->
-- target -> attempt, checks the fence (the generation and a running attempt; or a late
-- report the outcome of which still counts, see below), ends the attempt, ends the job or
-- queues its retry with backoff (pgd_backoff_seconds), frees or marks the target, releases
-- or cancels the dependents, and releases the job's slots last (unless p_release is false:
-- pgd_complete_batch releases every item's slots in one call). p_outcome: succeeded |
-- failed | cancelled | handed_back (the runner gives the job back unstarted) | lost (a
-- deployment whose outcome the runner cannot know). Returns the answer as jsonb (status,
-- job_id, attempt_id, job_state, attempt_state, is_late_report, ready_at, repeated).
-- Raises PD422 bad input, PD404 unknown attempt, PD409 receipt key of another attempt,
-- PDF01 fenced out. The texts are bounded here, whoever calls: the error to 2,000
-- characters, the output tail to its last 65,536.
-- Internal: its entry point is pgd_complete (below), which always releases; a runner host
-- may not skip the release.
CREATE OR REPLACE FUNCTION pgd_complete_attempt(p_attempt_id bigint, p_generation bigint, p_outcome text,
                                                p_exit_code integer, p_error text, p_output_tail text,
                                                p_receipt_key text, p_backoff_base_seconds double precision,
                                                p_backoff_cap_seconds double precision,
                                                p_release boolean)
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
    p_error := left(p_error, 2000);
    p_output_tail := right(p_output_tail, 65536);
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
    -- a host whose grant or login was revoked is a lost runner: its reports are not believed
    -- (sql/functions/claim.sql, "Runner grants"); the lease expiry ends the attempt
    IF NOT pgd_runner_holds_grant(v_attempt.runner_id, v_ids.pool_id) THEN
        RAISE EXCEPTION 'attempt % is fenced out: runner % is not login %''s, or its login is no longer granted pool %',
            p_attempt_id, v_attempt.runner_id, session_user, pgd_pool_names(ARRAY[v_ids.pool_id])
            USING ERRCODE = 'PDF01';
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
            -- at most 30 days from now whatever the settings (pgd_backoff_seconds' clamp)
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
    -- a deployment back in the queue beside a newer one to its superseding target ends
    -- superseded (pgd_supersede_stale; the submit of the newer one locked it while it ran)
    IF v_job_state = 'queued' AND v_ids.target_id IS NOT NULL
       AND pgd_supersede_stale(v_job.id) IS NOT NULL THEN
        v_job_state := 'superseded';
    END IF;

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

    -- the job's slots last
    IF p_release AND NOT v_is_late THEN
        PERFORM pgd_release_slots(ARRAY[v_ids.org_id], ARRAY[v_ids.pool_id], ARRAY[v_job.id]);
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

-- complete (the entry point a scheduler calls): pgd_complete_attempt, releasing the slots.
CREATE OR REPLACE FUNCTION pgd_complete(p_attempt_id bigint, p_generation bigint, p_outcome text,
                                        p_exit_code integer, p_error text, p_output_tail text,
                                        p_receipt_key text, p_backoff_base_seconds double precision,
                                        p_backoff_cap_seconds double precision)
RETURNS jsonb
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT pgd_complete_attempt(p_attempt_id, p_generation, p_outcome, p_exit_code, p_error,
                                p_output_tail, p_receipt_key, p_backoff_base_seconds,
                                p_backoff_cap_seconds, true)
$$;

-- complete_batch: up to 1000 completions (p_items: a jsonb array of objects with
-- attempt_id, generation, outcome, receipt_key, exit_code, error, output_tail) in one
-- transaction, one answer per item in order (an item fenced out answers status "fenced";
-- a bad item fails the whole batch before anything is written). Every row is locked up
-- front in the lock order (jobs, targets, attempts, dependents, each by id); a build's
-- plain success takes a set-based fast path, every other item goes through pgd_complete
-- without its release; then the slots of every item are released in one call, last.
CREATE OR REPLACE FUNCTION pgd_complete_batch(p_items jsonb, p_backoff_base_seconds double precision,
                                              p_backoff_cap_seconds double precision)
RETURNS SETOF jsonb
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
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
    v_pools    bigint[] := '{}';
    v_holders  bigint[] := '{}';
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
    -- and neither the attempt nor the key named twice in this batch. The grant is asked once
    -- per (runner, pool) of the batch (a batch is one runner's, almost always of one pool),
    -- not once per item: it reads the catalog (pgd_runner_holds_grant). Each item's attempt
    -- and job are probes by primary key (the OFFSET 0 subqueries take no condition but the
    -- id, and the state and generation are checked outside them): with its conditions
    -- inside, the cached plan read the partial indexes of running rows whenever the
    -- statistics said few run (attempts_runner_idx, jobs_active_idx) and walked every running
    -- row once per item — 70 µs per item at 100 running (bench/ledger.py's profile).
    v_rows := ARRAY(
        WITH items AS MATERIALIZED (
            SELECT x.ord, x.attempt_id, x.receipt_key, x.exit_code, x.error, x.output_tail,
                   a.runner_id, w.job_id, p.organization_id AS org_id, w.project_id, w.pool_id,
                   w.ready_at
              FROM (SELECT e.ord, i.*, count(*) OVER (PARTITION BY i.attempt_id) AS same_attempt,
                           count(*) OVER (PARTITION BY i.receipt_key) AS same_key
                      FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e(item, ord),
                           jsonb_to_record(e.item)
                           AS i(attempt_id bigint, generation bigint, outcome text, receipt_key text,
                                exit_code integer, error text, output_tail text)) x
              CROSS JOIN LATERAL (
                    SELECT a.job_id, a.runner_id, a.state, a.generation FROM attempts a
                     WHERE a.id = x.attempt_id OFFSET 0) a
              CROSS JOIN LATERAL (
                    SELECT j.id AS job_id, j.project_id, j.pool_id, j.ready_at, j.state, j.target_id,
                           j.generation
                      FROM jobs j WHERE j.id = a.job_id OFFSET 0) w
              JOIN projects p ON p.id = w.project_id
             WHERE x.outcome = 'succeeded' AND x.same_attempt = 1 AND x.same_key = 1
               AND a.state = 'running' AND a.generation = x.generation
               AND w.state = 'running' AND w.target_id IS NULL AND w.generation = x.generation
               AND NOT EXISTS (SELECT 1 FROM delivery_receipts r WHERE r.key = x.receipt_key)
        ), granted AS MATERIALIZED (
            -- a revoked host's item takes the one-by-one path, which fences it
            -- (OFFSET 0: the check is not pushed below the DISTINCT, where it ran once per item)
            SELECT g.runner_id, g.pool_id
              FROM (SELECT DISTINCT i.runner_id, i.pool_id FROM items i OFFSET 0) g
             WHERE pgd_runner_holds_grant(g.runner_id, g.pool_id)
        )
        SELECT ROW(i.ord, i.attempt_id, i.job_id, i.org_id, i.project_id, i.pool_id,
                   i.receipt_key, i.exit_code, left(i.error, 2000), right(i.output_tail, 65536),
                   i.ready_at)::pgd_fast_completion
          FROM items i JOIN granted g ON (g.runner_id, g.pool_id) = (i.runner_id, i.pool_id));

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
        v_pools := ARRAY(SELECT f.pool_id FROM unnest(v_rows) f);
        v_holders := v_done;
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
                SELECT p.organization_id AS org_id, j.pool_id, j.id AS job_id INTO v_ids
                  FROM jobs j JOIN projects p ON p.id = j.project_id
                 WHERE j.id = (v_answer ->> 'job_id')::bigint;
                v_orgs := v_orgs || v_ids.org_id;
                v_pools := v_pools || v_ids.pool_id;
                v_holders := v_holders || v_ids.job_id;
                v_released := v_released || it.attempt_id;
            END IF;
        EXCEPTION WHEN SQLSTATE 'PDF01' THEN
            v_answer := jsonb_build_object('status', 'fenced', 'attempt_id', it.attempt_id,
                                           'error', SQLERRM);
        END;
        v_answers[it.ord] := v_answer;
    END LOOP;

    -- the slots last
    IF cardinality(v_orgs) > 0 THEN
        PERFORM pgd_release_slots(v_orgs, v_pools, v_holders);
    END IF;
    -- the items completed one by one were stamped before the release: stamp them again after
    -- it, so that [claimed_at, finished_at) covers the time they held capacity (none, when
    -- every item took the fast path: then no statement, which would be planned anew each time)
    IF cardinality(v_released) > 0 THEN
        UPDATE attempts SET finished_at = clock_timestamp() WHERE id = ANY (v_released);
    END IF;
    IF cardinality(v_rows) > 0 THEN
        UPDATE attempts a
           SET state = 'succeeded', finished_at = clock_timestamp(), exit_code = f.exit_code,
               error = f.error, output_tail = coalesce(f.output_tail, a.output_tail)
          FROM unnest(v_rows) f WHERE a.id = f.attempt_id;
    END IF;
    RETURN QUERY SELECT a FROM unnest(v_answers) a;
END;
$$;
