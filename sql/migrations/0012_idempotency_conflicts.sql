-- 0012_idempotency_conflicts: a submit that repeats an idempotency key with a different
-- request is refused (PD409), and an unknown dependency is named by its id.
--
-- Before: a second submit with a project's key returned the job of the first whatever it
-- asked for, so a client that reused a key for another build was told its build was queued
-- while the first one ran instead. Now the repeat must ask for the same job: the same pool,
-- target, command, priority, attempts, timeout, approval and dependencies (as a set). The
-- delay is not compared: each request's delay runs from its own arrival, so a retried
-- request cannot repeat it exactly. A differing repeat raises
--   idempotency key already used for job 41 with a different request (command, priority differ)
-- and writes nothing, like the other refusals (docs/operations.md, "Idempotency keys").
--
-- "unknown dependency in {7,999999}" (PostgreSQL's array text, naming the known id too)
-- becomes "unknown dependency 999999" ("unknown dependencies 5, 6" for several).
--
-- pgd_submit is restated in full (as in 0009) with these two changes; its ON CONFLICT and
-- its key lookup are as they were.

-- The fields of job p_job_id that differ from a submit's request, in a fixed order; empty
-- when the request asks for that job. p_target_id and p_pool_id are resolved ids.
CREATE FUNCTION pgd_submit_differences(p_job_id bigint, p_pool_id bigint, p_target_id bigint,
                                       p_command text[], p_priority integer,
                                       p_max_attempts integer, p_timeout_seconds integer,
                                       p_requires_approval boolean, p_depends_on bigint[])
RETURNS text[]
LANGUAGE sql STABLE AS $$
    SELECT array_remove(ARRAY[
               CASE WHEN j.pool_id IS DISTINCT FROM p_pool_id THEN 'pool' END,
               CASE WHEN j.target_id IS DISTINCT FROM p_target_id THEN 'target' END,
               CASE WHEN j.command IS DISTINCT FROM p_command THEN 'command' END,
               CASE WHEN j.priority IS DISTINCT FROM p_priority THEN 'priority' END,
               CASE WHEN j.max_attempts IS DISTINCT FROM p_max_attempts THEN 'max attempts' END,
               CASE WHEN j.timeout_seconds IS DISTINCT FROM p_timeout_seconds THEN 'timeout' END,
               CASE WHEN j.requires_approval IS DISTINCT FROM p_requires_approval
                    THEN 'approval' END,
               CASE WHEN ARRAY(SELECT d.depends_on_job_id FROM job_dependencies d
                                WHERE d.job_id = j.id ORDER BY 1)
                         IS DISTINCT FROM
                         ARRAY(SELECT DISTINCT u FROM unnest(coalesce(p_depends_on, '{}')) u
                                ORDER BY 1)
                    THEN 'dependencies' END], NULL)
      FROM jobs j
     WHERE j.id = p_job_id
$$;

-- The job p_job_id found under a repeated key, or PD409 when the request differs from it.
CREATE FUNCTION pgd_submit_repeat(p_job_id bigint, p_pool_id bigint, p_target_id bigint,
                                  p_command text[], p_priority integer, p_max_attempts integer,
                                  p_timeout_seconds integer, p_requires_approval boolean,
                                  p_depends_on bigint[])
RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_diff text[];
BEGIN
    v_diff := pgd_submit_differences(p_job_id, p_pool_id, p_target_id, p_command, p_priority,
                                     p_max_attempts, p_timeout_seconds, p_requires_approval,
                                     p_depends_on);
    IF cardinality(v_diff) > 0 THEN
        RAISE EXCEPTION 'idempotency key already used for job % with a different request (% differ%)',
            p_job_id, array_to_string(v_diff, ', '), CASE WHEN cardinality(v_diff) = 1 THEN 's' ELSE '' END
            USING ERRCODE = 'PD409';
    END IF;
    RETURN p_job_id;
END;
$$;

-- submit: as in 0009, with a repeated key checked against its job, and unknown dependencies
-- named by id.
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
    v_unknown  bigint[];
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
            RETURN QUERY SELECT pgd_submit_repeat(v_id, v_pool_id, v_target, p_command, p_priority,
                                                  p_max_attempts, p_timeout_seconds,
                                                  p_requires_approval, p_depends_on), false;
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
    IF cardinality(p_depends_on) > 0 THEN
        v_unknown := ARRAY(SELECT DISTINCT u FROM unnest(p_depends_on) u
                            WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = u)
                            ORDER BY 1);
        IF cardinality(v_unknown) > 0 THEN
            RAISE EXCEPTION 'unknown %', CASE WHEN cardinality(v_unknown) = 1 THEN 'dependency '
                                              ELSE 'dependencies ' END
                                         || array_to_string(v_unknown, ', ')
                USING ERRCODE = 'PD404';
        END IF;
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
        RETURN QUERY SELECT pgd_submit_repeat(v_id, v_pool_id, v_target, p_command, p_priority,
                                              p_max_attempts, p_timeout_seconds,
                                              p_requires_approval, p_depends_on), false;
        RETURN;
    END IF;
    INSERT INTO job_dependencies (job_id, depends_on_job_id)
    SELECT v_id, d FROM (SELECT DISTINCT unnest(coalesce(p_depends_on, '{}')) AS d) s;
    RETURN QUERY SELECT v_id, true;
END;
$$;
