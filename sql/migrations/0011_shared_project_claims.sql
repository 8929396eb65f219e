-- 0011_shared_project_claims: claims of one project no longer queue behind each other, and
-- completions no longer write the project row (issue 5; docs/benchmarks.md, "Migration 0011").
--
-- Before: every claim locked its project's row (FOR NO KEY UPDATE) to check the pause, the
-- bound and fairness and to add to `running`, and held it until its commit flush; every
-- completion and expiry took the same row to subtract. With 4 projects and 8 claimers each
-- project's claims ran one at a time (docs/benchmarks.md, "Single-job claims at 8
-- claimers").
--
-- Now:
-- * `projects.running` is gone. A project's running count is its jobs in state 'running'
--   (a count of jobs_active_idx: pgd_project_running for readers; written inline in the
--   candidate read and the fairness re-check, see there). A running job holds exactly one
--   running attempt, and that attempt holds the job's capacity (tests/faults/consistency.py),
--   so this is what the counter said. Completions and expiries release only the job's
--   organization and pool slots.
-- * A claim takes its project's claim lock (pg_advisory_xact_lock on class
--   pgd_claim_lock_class(), key pgd_claim_lock_key(project id)), after the job and the target
--   and before the slots, where it took the project row; then it reads the project row in a
--   new statement. The lock is:
--   - shared while the project has no bound and capacity is not scarce
--     (pgd_capacity_scarce): claims of the project run side by side;
--   - exclusive when the project has a bound (its running count is read under the lock, and
--     every earlier claim of the project has committed, so the count is exact) or while
--     capacity is scarce, on either pass: the first pass re-checks fairness under it (as in
--     0007: claims of the project queued ahead have committed when it reads the shares), and
--     claims of one project keep taking turns, as they did on the project row.
--   A claim that read "no bound" and finds one under its shared lock passes the project over
--   for the next pass, which takes the exclusive lock (a lock is never upgraded in place).
-- * A pause, resume or bound change waits for the claims in flight (trigger
--   pgd_project_claims_fence: the exclusive claim lock, after the row lock its UPDATE
--   took), and claims queue behind it (a lock request that conflicts with a waiting one
--   waits too). A claim's check of the pause runs after its lock is granted, so no claim
--   that commits after a pause committed started a job of the paused project.
-- * `last_claimed_at`, the fairness tie-break, is stamped by the claim with SKIP LOCKED on
--   the project row: when another claim of the project holds the row it is stamping the
--   same clock; a claim never waits for the row.
--
-- Lock order (docs/design.md): job -> target -> attempt -> (dependents) -> project claim lock
-- -> project row (SKIP LOCKED, stamp) -> organization slot -> pool slot -> retirement rows.
-- A pause or bound change takes the project row, then the exclusive claim lock; claims never
-- wait for the project row, so there is no cycle.
--
-- A project bound still serializes that project's claims (exclusive lock); organization
-- and pool limits never do (slot rows, 0008).
--
-- Measured: alternated A/B against 0010, six rounds of `python -m bench claim --series
-- pgdispatch,pgdispatch-batch50 --clients 2,8 --repeats 1 --jobs 8000 --no-latency`, projects
-- without a bound: single claims faster in every round, median paired ratio 1.12 at N = 8
-- and 1.33 at N = 2; batches of 50 between -11 % and +43 %, inside the rounds' spread
-- (docs/benchmarks.md, "Migration 0011").
--
-- Cost: DROP COLUMN takes an ACCESS EXCLUSIVE lock on `projects` for the migration's short
-- transaction (no rewrite). A call already running an old function body that reads
-- `projects.running` after this commits fails with 42703 and is retried on the new body
-- (sql/db.py, RETRYABLE); the 0007 signature of pgd_fairer_candidate_exists stays (below)
-- so that an old pgd_claim body gets that far.

-- The advisory lock class of project claim locks (the first key of the two-key form), and
-- a project's key in it (ids beyond 2^31 - 1 wrap, which can only make two projects share a
-- lock: more waiting, never less exclusion).
CREATE FUNCTION pgd_claim_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 1885824099 $$;  -- 'pgdc' as four bytes
CREATE FUNCTION pgd_claim_lock_key(p_project_id bigint) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT (p_project_id % 2147483647)::integer $$;

-- Running jobs of a project: what `projects.running` counted. Reads jobs_active_idx.
CREATE FUNCTION pgd_project_running(p_project_id bigint) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT count(*)::integer FROM jobs j WHERE j.project_id = p_project_id AND j.state = 'running'
$$;

ALTER TABLE projects DROP COLUMN running;

-- A pause, a resume or a bound change waits for the project's claims in flight and holds
-- new ones off until it commits.
CREATE FUNCTION pgd_project_claims_fence() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(pgd_claim_lock_class(), pgd_claim_lock_key(NEW.id));
    RETURN NULL;
END;
$$;
CREATE TRIGGER pgd_project_claims_fence AFTER UPDATE OF paused_at, max_running ON projects
    FOR EACH ROW
    WHEN (OLD.paused_at IS DISTINCT FROM NEW.paused_at
          OR OLD.max_running IS DISTINCT FROM NEW.max_running)
    EXECUTE FUNCTION pgd_project_claims_fence();

-- Whether a fresh read of this organization's candidates puts another project ahead of
-- p_project, whose running count is p_running, in pgd_claim_candidates' order: as in 0007,
-- with running counts read from the jobs (inline, as there). The caller holds p_project's
-- exclusive claim lock.
CREATE FUNCTION pgd_fairer_candidate_exists(p_pool_ids bigint[], p_org_id bigint, p_project projects,
                                            p_running integer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1
          FROM pgd_claim_candidates(p_pool_ids, p_org_id) f
          JOIN projects p ON p.id = f.project_id
         CROSS JOIN LATERAL (SELECT count(*)::integer AS running FROM jobs j
                              WHERE j.project_id = p.id AND j.state = 'running') r
         WHERE p.id <> p_project.id
           AND (r.running::float8 / p.weight < p_running::float8 / p_project.weight
                OR (r.running::float8 / p.weight = p_running::float8 / p_project.weight
                    AND ((p.last_claimed_at IS NULL AND p_project.last_claimed_at IS NOT NULL)
                         OR p.last_claimed_at < p_project.last_claimed_at
                         OR (p.last_claimed_at IS NOT DISTINCT FROM p_project.last_claimed_at
                             AND p.id < p_project.id)))))
$$;

-- The 0007 signature, kept for a pgd_claim already running its 0010 body when this commits
-- (a scheduler's session has that body's plans cached): without it the call fails with
-- 42883, which is not retried; with it the old body goes on to its `running` update, fails
-- with 42703 and is retried on the new body (found by an adversarial run of the upgrade).
CREATE OR REPLACE FUNCTION pgd_fairer_candidate_exists(p_pool_ids bigint[], p_org_id bigint,
                                                       p_project projects)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT pgd_fairer_candidate_exists(p_pool_ids, p_org_id, p_project,
                                       pgd_project_running(p_project.id))
$$;

-- Release the capacity of finished attempts: each job's organization and pool slots
-- (pgd_release_slots). p_project_ids is no longer read (a project's running count is its
-- running jobs); it stays so that pgd_complete_batch (0008) calls this unchanged.
CREATE OR REPLACE FUNCTION pgd_release_capacity(p_job_ids bigint[], p_project_ids bigint[],
                                                p_org_ids bigint[], p_pool_ids bigint[])
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pgd_release_slots(p_org_ids, p_pool_ids, p_job_ids);
END;
$$;

-- The functions below are 0008's with the project counter replaced as above. Applied
-- migrations stay as they are, so each is restated in full.

-- claim_candidates: as in 0008, with running counts read from the jobs. The count is written
-- inline, not as pgd_project_running(p.id): a SQL function whose body has a FROM clause is
-- not inlined, so it ran as a query of its own for every candidate, and with it the
-- concurrent 3:1 fairness check under scarcity fell from 2.88 to 2.56 (medians of 8 runs;
-- 0010: 2.94; docs/fairness.md, "The project's claim lock").
CREATE OR REPLACE FUNCTION pgd_claim_candidates(p_pool_ids bigint[], p_org_id bigint)
RETURNS TABLE (org_id bigint, project_id bigint, pool_id bigint)
LANGUAGE sql STABLE AS $$
    SELECT p.organization_id AS org_id, pp.project_id, pp.pool_id
      FROM project_pools pp
      JOIN projects p ON p.id = pp.project_id
      JOIN organizations o ON o.id = p.organization_id
      JOIN pools q ON q.id = pp.pool_id
     CROSS JOIN LATERAL (SELECT count(*)::integer AS running FROM jobs j
                          WHERE j.project_id = p.id AND j.state = 'running') r
     WHERE pp.pool_id = ANY (p_pool_ids)
       AND p.paused_at IS NULL
       AND CASE WHEN p_org_id IS NULL
                THEN EXISTS (SELECT 1 FROM organization_slots s
                              WHERE s.organization_id = o.id AND s.job_id IS NULL
                              ORDER BY s.slot_no LIMIT 1 OFFSET 0)
                ELSE o.id = p_org_id END
       AND (p.max_running IS NULL OR r.running < p.max_running)
       AND EXISTS (SELECT 1 FROM pool_slots s
                    WHERE s.pool_id = q.id AND s.job_id IS NULL
                    ORDER BY s.slot_no LIMIT 1 OFFSET 0)
       AND EXISTS (SELECT 1
                     FROM jobs j
                    WHERE j.project_id = p.id AND j.pool_id = pp.pool_id
                      AND j.state = 'queued' AND j.ready_at <= now()
                      AND (j.target_id IS NULL
                           OR EXISTS (SELECT 1 FROM targets t
                                       WHERE t.id = j.target_id AND t.state = 'free'))
                    ORDER BY j.priority DESC, j.id
                    LIMIT 1 OFFSET 0)
     ORDER BY r.running::float8 / p.weight, p.last_claimed_at NULLS FIRST, p.id, pp.pool_id
     LIMIT 16
$$;

-- claim: as in 0008, with the project's claim lock in place of its row lock (header).
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
    v_scarce  boolean;
    v_excl    boolean;
    v_running integer;
    v_job     jobs%ROWTYPE;
    v_attempt bigint;
    v_claimed timestamptz;
    v_lease   timestamptz;
    v_racing  integer;
BEGIN
    v_pools := pgd_runner_pools(p_runner_id, p_pool_ids, p_lease_seconds);
    IF v_pools IS NULL THEN
        RETURN;  -- the runner is draining or stopped
    END IF;
    v_racing := pgd_racing_claims();

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

            -- the project's claim lock: shared, unless the project has a bound or the
            -- fairness re-check runs (header); a new statement after it sees any pause or
            -- bound committed before it was granted
            v_scarce := pgd_capacity_scarce(c.org_id, c.pool_id, v_racing);
            v_excl := v_scarce OR EXISTS (SELECT 1 FROM projects p
                                           WHERE p.id = c.project_id AND p.max_running IS NOT NULL);
            IF v_excl THEN
                PERFORM pg_advisory_xact_lock(pgd_claim_lock_class(), pgd_claim_lock_key(c.project_id));
            ELSE
                PERFORM pg_advisory_xact_lock_shared(pgd_claim_lock_class(), pgd_claim_lock_key(c.project_id));
            END IF;
            SELECT * INTO v_proj FROM projects p WHERE p.id = c.project_id;
            IF v_proj.paused_at IS NOT NULL THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            v_running := NULL;
            IF v_proj.max_running IS NOT NULL THEN
                IF NOT v_excl THEN
                    -- bounded since the read above: the next pass takes the exclusive lock
                    v_retry := true;
                    RAISE EXCEPTION USING ERRCODE = 'PDSKP';
                END IF;
                v_running := pgd_project_running(v_proj.id);
                IF v_running >= v_proj.max_running THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            END IF;
            IF v_pass = 1 AND v_scarce AND pgd_fairer_candidate_exists(
                   v_pools, c.org_id, v_proj, coalesce(v_running, pgd_project_running(v_proj.id))) THEN
                v_retry := true;
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
            -- the fairness tie-break: stamped unless another claim of the project is stamping
            -- it now (it sets the same clock, give or take its commit); never waited for
            UPDATE projects p SET last_claimed_at = clock_timestamp()
             WHERE p.id = (SELECT x.id FROM projects x WHERE x.id = v_proj.id
                             FOR NO KEY UPDATE SKIP LOCKED);

            -- a free organization slot and a free pool slot, SKIP LOCKED
            UPDATE organization_slots s SET job_id = v_job.id
             WHERE (s.organization_id, s.slot_no) = (
                   SELECT f.organization_id, f.slot_no FROM organization_slots f
                    WHERE f.organization_id = c.org_id AND f.job_id IS NULL
                    ORDER BY f.slot_no
                    LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED);
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

            UPDATE pool_slots s SET job_id = v_job.id
             WHERE (s.pool_id, s.slot_no) = (
                   SELECT f.pool_id, f.slot_no FROM pool_slots f
                    WHERE f.pool_id = c.pool_id AND f.job_id IS NULL
                    ORDER BY f.slot_no
                    LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED);
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

            UPDATE jobs j
               SET state = 'running', generation = j.generation + 1,
                   attempts_made = j.attempts_made + 1,
                   started_at = coalesce(j.started_at, now())
             WHERE j.id = v_job.id
            RETURNING * INTO v_job;

            -- claimed_at is the clock now, after every reservation, not now() (the
            -- transaction's start, which may precede the wait for the project row).
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

-- claim_batch: as in 0008, with the project's claim lock in place of its row lock.
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
    v_scarce  boolean;
    v_excl    boolean;
    v_running integer;
    v_free    integer;
    v_ids     bigint[];
    v_racing  integer;
    v_org_slots  integer[];
    v_pool_slots integer[];
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
    v_racing := pgd_racing_claims();

    FOR v_pass IN 1..2 LOOP
        v_retry := false;
        FOR c IN SELECT * FROM pgd_claim_candidates(v_pools, NULL) LOOP
        BEGIN
            -- the free capacity as read without locks sizes the jobs locked below
            SELECT least(CASE WHEN p.max_running IS NULL THEN v_want
                              ELSE p.max_running - pgd_project_running(p.id) END,
                         (SELECT count(*) FROM (SELECT 1 FROM organization_slots f
                                                 WHERE f.organization_id = c.org_id AND f.job_id IS NULL
                                                 LIMIT v_want) s),
                         (SELECT count(*) FROM (SELECT 1 FROM pool_slots f
                                                 WHERE f.pool_id = c.pool_id AND f.job_id IS NULL
                                                 LIMIT v_want) s))
              INTO v_free
              FROM projects p
             WHERE p.id = c.project_id;
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

            -- the project's claim lock, as in pgd_claim
            v_scarce := pgd_capacity_scarce(c.org_id, c.pool_id, v_racing);
            v_excl := v_scarce OR EXISTS (SELECT 1 FROM projects p
                                           WHERE p.id = c.project_id AND p.max_running IS NOT NULL);
            IF v_excl THEN
                PERFORM pg_advisory_xact_lock(pgd_claim_lock_class(), pgd_claim_lock_key(c.project_id));
            ELSE
                PERFORM pg_advisory_xact_lock_shared(pgd_claim_lock_class(), pgd_claim_lock_key(c.project_id));
            END IF;
            SELECT * INTO v_proj FROM projects p WHERE p.id = c.project_id;
            IF v_proj.paused_at IS NOT NULL THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            v_running := NULL;
            IF v_proj.max_running IS NOT NULL THEN
                IF NOT v_excl THEN
                    v_retry := true;  -- bounded since the read above: the next pass locks it
                    RAISE EXCEPTION USING ERRCODE = 'PDSKP';
                END IF;
                v_running := pgd_project_running(v_proj.id);
            END IF;
            IF v_pass = 1 AND v_scarce AND pgd_fairer_candidate_exists(
                   v_pools, c.org_id, v_proj, coalesce(v_running, pgd_project_running(v_proj.id))) THEN
                v_retry := true;
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
            v_n := least(cardinality(v_ids), coalesce(v_proj.max_running - v_running, v_want));
            IF v_n < 1 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            -- up to v_n free organization slots, then as many free pool slots, SKIP LOCKED;
            -- the count taken is what both give (organization slots
            -- locked beyond it stay free, locked until the commit, and are skipped meanwhile)
            v_org_slots := ARRAY(
                SELECT f.slot_no FROM organization_slots f
                 WHERE f.organization_id = c.org_id AND f.job_id IS NULL
                 ORDER BY f.slot_no
                 LIMIT v_n FOR NO KEY UPDATE OF f SKIP LOCKED);
            v_pool_slots := ARRAY(
                SELECT f.slot_no FROM pool_slots f
                 WHERE f.pool_id = c.pool_id AND f.job_id IS NULL
                 ORDER BY f.slot_no
                 LIMIT cardinality(v_org_slots) FOR NO KEY UPDATE OF f SKIP LOCKED);
            v_n := cardinality(v_pool_slots);
            IF v_n < 1 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            v_ids := v_ids[1:v_n];

            UPDATE projects p SET last_claimed_at = clock_timestamp()
             WHERE p.id = (SELECT x.id FROM projects x WHERE x.id = v_proj.id
                             FOR NO KEY UPDATE SKIP LOCKED);
            UPDATE organization_slots s SET job_id = u.job_id
              FROM unnest(v_org_slots[1:v_n], v_ids) u(slot_no, job_id)
             WHERE s.organization_id = c.org_id AND s.slot_no = u.slot_no;
            UPDATE pool_slots s SET job_id = u.job_id
              FROM unnest(v_pool_slots, v_ids) u(slot_no, job_id)
             WHERE s.pool_id = c.pool_id AND s.slot_no = u.slot_no;

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

-- complete_attempt: as in 0008; the release frees the job's slots only.
CREATE OR REPLACE FUNCTION pgd_complete_attempt(p_attempt_id bigint, p_generation bigint, p_outcome text,
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

-- expire: as in 0008; the release frees the job's slots only.
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

            PERFORM pgd_release_slots(ARRAY[c.org_id], ARRAY[c.pool_id], ARRAY[c.job_id]);

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
