-- 0012_idempotency_conflicts: a submit that repeats an idempotency key with a different
-- request is refused (PD409), and an unknown dependency is named by its id.
--
-- Before: a second submit with a project's key returned the job of the first whatever it
-- asked for, so a client that reused a key for another build was told its build was queued
-- while the first one ran instead. Now the repeat must ask for the same job: the same pool,
-- target, command, priority, attempts, timeout, approval and dependencies (as a set). The
-- delay is not compared: each request's delay runs from its own arrival, so a retried
-- request cannot repeat it exactly. A differing repeat raises
--   idempotency key already used for job 41 by a request that differs in command, priority
-- and writes nothing, like the other refusals (docs/operations.md, "Idempotency keys").
--
-- The request is compared with what the first submit asked for, kept in
-- `idempotent_requests` for keyed jobs only, not with the job as it is now: an operator's
-- retry raises a job's max_attempts, and the identical request must still find its job.
-- Jobs keyed before 0012 have no kept request; they are compared with their columns, all
-- but max_attempts.
--
-- "unknown dependency in {7,999999}" (PostgreSQL's array text, naming the known id too)
-- becomes "unknown dependency 999999" ("unknown dependencies 5, 6" for several; the first
-- five and the count past that).
--
-- pgd_submit is restated in full (as in 0009) with these changes; its ON CONFLICT and its
-- key lookup are as they were.

-- What a keyed submit asked for, as pgd_submit_request built it. Written once, with the job.
CREATE TABLE idempotent_requests (
    job_id  bigint PRIMARY KEY REFERENCES jobs (id),
    request jsonb NOT NULL
);

-- A submit's request in the form kept and compared: resolved pool and target ids, the
-- dependencies as a sorted set. Keys are the field names the refusal prints.
CREATE FUNCTION pgd_submit_request(p_pool_id bigint, p_target_id bigint, p_command text[],
                                   p_priority integer, p_max_attempts integer,
                                   p_timeout_seconds integer, p_requires_approval boolean,
                                   p_depends_on bigint[])
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object(
        'pool', p_pool_id, 'target', p_target_id, 'command', to_jsonb(p_command),
        'priority', p_priority, 'max attempts', p_max_attempts, 'timeout', p_timeout_seconds,
        'approval', p_requires_approval,
        'dependencies', to_jsonb(ARRAY(SELECT DISTINCT u FROM unnest(coalesce(p_depends_on, '{}')) u
                                        ORDER BY 1)))
$$;

-- The fields in which p_request differs from what job p_job_id's submit asked for, in the
-- order pool, target, command, priority, max attempts, timeout, approval, dependencies;
-- empty when it asks for the same job.
CREATE FUNCTION pgd_submit_differences(p_job_id bigint, p_request jsonb)
RETURNS text[]
LANGUAGE sql STABLE AS $$
    SELECT ARRAY(
        SELECT f.name
          FROM unnest(ARRAY['pool', 'target', 'command', 'priority', 'max attempts', 'timeout',
                            'approval', 'dependencies']) WITH ORDINALITY AS f(name, ord)
         WHERE (k.request -> f.name) IS DISTINCT FROM (p_request -> f.name)
         ORDER BY f.ord)
      FROM (SELECT coalesce(
                (SELECT r.request FROM idempotent_requests r WHERE r.job_id = j.id),
                -- keyed before 0012: the job's columns; max_attempts is left out, since a
                -- retry may have raised it
                pgd_submit_request(j.pool_id, j.target_id, j.command, j.priority,
                                   (p_request ->> 'max attempts')::integer, j.timeout_seconds,
                                   j.requires_approval,
                                   ARRAY(SELECT d.depends_on_job_id FROM job_dependencies d
                                          WHERE d.job_id = j.id))) AS request
              FROM jobs j
             WHERE j.id = p_job_id) k
$$;

-- The job p_job_id found under a repeated key, or PD409 when p_request differs from the
-- request that made it.
CREATE FUNCTION pgd_submit_repeat(p_job_id bigint, p_request jsonb)
RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_diff text[];
BEGIN
    v_diff := pgd_submit_differences(p_job_id, p_request);
    IF cardinality(v_diff) > 0 THEN
        RAISE EXCEPTION 'idempotency key already used for job % by a request that differs in %',
            p_job_id, array_to_string(v_diff, ', ')
            USING ERRCODE = 'PD409';
    END IF;
    RETURN p_job_id;
END;
$$;

-- submit: as in 0009, with a repeated key checked against the request that made its job
-- (kept with a keyed job), and unknown dependencies named by id.
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
    v_request  jsonb;
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
        v_request := pgd_submit_request(v_pool_id, v_target, p_command, p_priority, p_max_attempts,
                                        p_timeout_seconds, p_requires_approval, p_depends_on);
        SELECT id INTO v_id FROM jobs WHERE project_id = v_project.id AND idempotency_key = p_idempotency_key;
        IF FOUND THEN
            RETURN QUERY SELECT pgd_submit_repeat(v_id, v_request), false;
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
                                         || array_to_string(v_unknown[1:5], ', ')
                                         || CASE WHEN cardinality(v_unknown) > 5
                                                 THEN format(' … (%s in all)', cardinality(v_unknown))
                                                 ELSE '' END
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
        RETURN QUERY SELECT pgd_submit_repeat(v_id, v_request), false;
        RETURN;
    END IF;
    INSERT INTO job_dependencies (job_id, depends_on_job_id)
    SELECT v_id, d FROM (SELECT DISTINCT unnest(coalesce(p_depends_on, '{}')) AS d) s;
    IF v_request IS NOT NULL THEN
        INSERT INTO idempotent_requests (job_id, request) VALUES (v_id, v_request);
    END IF;
    RETURN QUERY SELECT v_id, true;
END;
$$;
