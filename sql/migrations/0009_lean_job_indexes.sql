-- 0009_lean_job_indexes: two indexes on `jobs` that every claim and every completion paid
-- for and no read needs (docs/benchmarks.md, "Migration 0009").
--
-- A job row is updated twice in its life (claim: queued -> running; completion: running ->
-- succeeded), and neither update can be HOT: `state` is in the predicates of the partial
-- indexes (jobs_claim_idx, jobs_active_idx, ...). So each update adds an entry to every
-- index that covers the new row version. Two of those indexes had no reader on the hot path:
--
-- * jobs_created_idx (created_at): no query filters or orders jobs by created_at. The job
--   pages page by id (ids are given out in insertion order), history reads
--   jobs_finished_idx, the state pages jobs_state_idx. Dropped.
-- * UNIQUE (project_id, idempotency_key): a unique constraint indexes NULL keys too, so
--   every job without a key (the usual case) had an entry, rewritten at each update.
--   Replaced by a partial unique index over the jobs that have a key. Uniqueness is the
--   same (NULLs never conflicted), and the submit's lookup `idempotency_key = $1` implies
--   the predicate, so it reads the partial index. pgd_submit is restated below only so that
--   its ON CONFLICT names the partial index's predicate (an arbiter must match it).
--
-- Measured: alternated A/B against 0008, `python -m bench claim --series
-- pgdispatch-batch50,pgdispatch --clients 2,8 --repeats 1 --jobs 8000`, five rounds; the
-- median of the paired ratios: batches of 50 1.11 at N = 2 and 1.04 at N = 8; single claims
-- 0.99 and 1.01 (no change: they wait on the project row, not on index work). A small gain
-- inside the machine's spread; kept because neither index had a reader.
--
-- Cost: DROP INDEX takes an ACCESS EXCLUSIVE lock on `jobs`, so reads and writes of jobs wait
-- for the whole migration, which builds the partial index by reading `jobs` once (0.8 s with
-- 300,000 jobs, measured); the index is small: only jobs with a key enter it. A submit already
-- inside the old pgd_submit when this commits fails its INSERT with 42P10 (its arbiter is
-- gone) and is retried on the new body (sql/db.py, RETRYABLE).

DROP INDEX jobs_created_idx;

CREATE UNIQUE INDEX jobs_idempotency_key_idx ON jobs (project_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
ALTER TABLE jobs DROP CONSTRAINT jobs_project_id_idempotency_key_key;

-- submit: as in 0002, with the partial index as the ON CONFLICT arbiter.
CREATE OR REPLACE FUNCTION pgd_submit(p_project text, p_pool text, p_target text, p_command text[],
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
    ON CONFLICT (project_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
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
