-- Submitting: a job enters the queue, with its idempotency key, dependencies and approval,
-- and wakes the schedulers of its pool. Tables: sql/schema.sql (jobs, job_dependencies,
-- idempotent_requests).

-- A submit's request in the form kept and compared: resolved pool and target ids, the
-- dependencies as a sorted set. Keys are the field names the refusal prints.
CREATE OR REPLACE FUNCTION pgd_submit_request(p_pool_id bigint, p_target_id bigint, p_command text[],
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
CREATE OR REPLACE FUNCTION pgd_submit_differences(p_job_id bigint, p_request jsonb)
RETURNS text[]
LANGUAGE sql STABLE AS $$
    SELECT ARRAY(
        SELECT f.name
          FROM unnest(ARRAY['pool', 'target', 'command', 'priority', 'max attempts', 'timeout',
                            'approval', 'dependencies']) WITH ORDINALITY AS f(name, ord)
         WHERE (k.request -> f.name) IS DISTINCT FROM (p_request -> f.name)
         ORDER BY f.ord)
      FROM idempotent_requests k
     WHERE k.job_id = p_job_id
$$;

-- The job p_job_id found under a repeated key, or PD409 when p_request differs from the
-- request that made it.
CREATE OR REPLACE FUNCTION pgd_submit_repeat(p_job_id bigint, p_request jsonb)
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

-- submit: enqueue one job of project p_project on pool p_pool (to target p_target for a
-- deployment), audited as a 'submit_job' event by p_submitted_by in the same transaction.
-- A job with pending dependencies or that requires approval starts 'blocked', else
-- 'queued' with ready_at = now() + p_delay_seconds. A deployment to a target that
-- requires approval (targets.requires_approval) requires it whatever p_requires_approval says. A repeated p_idempotency_key (per
-- project) returns the first job with is_new false when the request is the same
-- (pgd_submit_request; the delay is not compared) and PD409 naming the fields that differ
-- otherwise; two submits racing with one key make one job (ON CONFLICT on
-- jobs_idempotency_key_idx). Unknown dependencies are named by id. Dependencies are held
-- FOR SHARE until the commit, so that none of them can fail between the check and the
-- insert. Raises PD404 unknown project, pool, target or dependency; PD422 pool not granted,
-- a dependency already failed, cancelled or superseded, a delay outside 0..2592000 seconds; PD409 a key
-- reused by a different request.
-- Supersede: a new deployment to a superseding target (targets.supersede: every project's;
-- project_target_supersede: this project's) ends the older ones in that scope still
-- waiting (pgd_supersede_older), in this transaction. A repeated key supersedes nothing.
CREATE OR REPLACE FUNCTION pgd_submit(p_project text, p_pool text, p_target text, p_command text[],
                                      p_priority integer, p_max_attempts integer, p_timeout_seconds integer,
                                      p_delay_seconds double precision, p_requires_approval boolean,
                                      p_depends_on bigint[], p_idempotency_key text, p_submitted_by text)
RETURNS TABLE (job_id bigint, is_new boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
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
    v_approval boolean := coalesce(p_requires_approval, false);
    v_scope    text;
    v_keep     bigint[] := '{}';
BEGIN
    p_submitted_by := pgd_authorize(p_submitted_by, 'operator');
    -- ready_at is now() plus the delay: at most 30 days (sql.transitions.submit checks the
    -- same bound), so that it stays a time Python can load. Unbounded, 1e12 s stores a
    -- year-33000 ready_at that no read of the job could load, and 1e300 overflows.
    IF p_delay_seconds IS NOT NULL AND NOT p_delay_seconds BETWEEN 0 AND 2592000 THEN  -- NaN too
        RAISE EXCEPTION 'delay must be between 0 and 2592000 seconds, got %', p_delay_seconds
            USING ERRCODE = 'PD422';
    END IF;
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
        -- a protected target's rule, not the submission, decides: the submission may only
        -- add an approval, never remove one
        SELECT id, v_approval OR requires_approval,
               CASE WHEN supersede THEN 'target'
                    WHEN EXISTS (SELECT 1 FROM project_target_supersede s
                                  WHERE s.project_id = v_project.id AND s.target_id = targets.id)
                    THEN 'project' END
          INTO v_target, v_approval, v_scope
          FROM targets WHERE name = p_target;
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
    IF v_scope IS NOT NULL THEN
        -- Serialise the submits that supersede on this target: taken before the job is
        -- inserted (so the ids of those submits follow the order they hold the lock in, and
        -- each sees every older one committed) and before any job row is locked (a submit
        -- waiting here holds no row another one needs). Not the target row: jobs are
        -- locked before targets (docs/design.md, "Lock order"), and a claim holds the
        -- target row while it commits. Pair and target-wide scopes share the key.
        PERFORM pg_advisory_xact_lock(pgd_supersede_lock_class(), pgd_supersede_lock_key(v_target));
        -- The new job's whole upstream chain is kept (it waits for it), and every row the
        -- supersede may touch is locked now, in one pass by id (lock order: jobs by id):
        -- the dependencies and the older deployments in scope, running ones included. A
        -- running one is locked so that a completion re-queueing it (an automatic retry,
        -- a hand-back) commits first and is superseded below, or sees this job and
        -- supersedes itself (pgd_supersede_stale): either way it never waits beside it.
        v_keep := pgd_upstream_jobs(coalesce(p_depends_on, '{}'));
        PERFORM 1 FROM jobs j
         WHERE j.id = ANY (coalesce(p_depends_on, '{}'))
            OR (j.target_id = v_target AND j.state IN ('queued', 'blocked', 'running')
                AND (v_scope = 'target' OR j.project_id = v_project.id)
                AND j.id <> ALL (v_keep))
         ORDER BY j.id
           FOR NO KEY UPDATE;
    END IF;

    FOR v_dep IN
        SELECT j.id, j.state FROM jobs j
         WHERE j.id = ANY (coalesce(p_depends_on, '{}'))
         ORDER BY j.id
           FOR SHARE
    LOOP
        IF v_dep.state IN ('failed', 'cancelled', 'superseded') THEN
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

    v_state := CASE WHEN v_pending > 0 OR v_approval THEN 'blocked' ELSE 'queued' END;
    INSERT INTO jobs (project_id, pool_id, target_id, state, priority, command, timeout_seconds,
                      max_attempts, ready_at, requires_approval, pending_dependencies,
                      idempotency_key, submitted_by)
    VALUES (v_project.id, v_pool_id, v_target, v_state, p_priority, p_command, p_timeout_seconds,
            p_max_attempts, now() + make_interval(secs => coalesce(p_delay_seconds, 0)),
            v_approval, v_pending, p_idempotency_key, p_submitted_by)
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
    PERFORM pgd_audit(p_submitted_by, 'submit_job', 'job:' || v_id, NULL,
                      jsonb_build_object('project', p_project, 'pool', p_pool, 'target', p_target));
    IF v_scope IS NOT NULL THEN
        PERFORM pgd_supersede_older(v_id, v_target, p_target,
                                    CASE WHEN v_scope = 'project' THEN v_project.id END,
                                    v_keep);
    END IF;
    RETURN QUERY SELECT v_id, true;
END;
$$;

-- The advisory lock class of the superseding submits (the first key of the two-key form; the
-- second is the target id), apart from the claim locks' and the claim tokens' classes.
CREATE OR REPLACE FUNCTION pgd_supersede_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 1885828467 $$;  -- 'pgds' as four bytes

-- A target's key in that class (ids beyond 2^31 - 1 wrap, which can only make two targets
-- share a lock: more waiting, never less exclusion).
CREATE OR REPLACE FUNCTION pgd_supersede_lock_key(p_target_id bigint) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT (p_target_id % 2147483647)::integer $$;

-- Supersede: end every deployment to target p_target_id older than job p_new_id (a smaller
-- id) that is still waiting (queued, or blocked on a dependency or an approval), of project
-- p_project_id only when it is given (a project-and-target pair) — except p_keep, the new
-- job's whole upstream chain (pgd_upstream_jobs: it waits for them, directly or through a
-- build between). Each ends 'superseded' (finished_at now,
-- last_error "superseded by job N"), audited as the system's action (actor system, action
-- supersede, details superseded_by and target), and its dependents are cancelled as a
-- cancelled job's are. Running and uncertain deployments are never touched: the rows are
-- locked by id (lock order: jobs by id), and a job a claim took meanwhile is no longer
-- waiting when the lock is granted (READ COMMITTED re-reads it), so it is passed over.
-- The caller holds the target's supersede lock and the rows (pgd_submit). Returns the ids
-- superseded.
CREATE OR REPLACE FUNCTION pgd_supersede_older(p_new_id bigint, p_target_id bigint, p_target text,
                                               p_project_id bigint, p_keep bigint[])
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v_id  bigint;
BEGIN
    v_ids := ARRAY(
        SELECT j.id FROM jobs j
         WHERE j.target_id = p_target_id AND j.state IN ('queued', 'blocked') AND j.id < p_new_id
           AND (p_project_id IS NULL OR j.project_id = p_project_id)
           AND j.id <> ALL (p_keep)
         ORDER BY j.id
           FOR NO KEY UPDATE);
    IF cardinality(v_ids) = 0 THEN
        RETURN v_ids;
    END IF;
    UPDATE jobs j
       SET state = 'superseded', finished_at = now(),
           last_error = format('superseded by job %s', p_new_id)
     WHERE j.id = ANY (v_ids) AND j.state IN ('queued', 'blocked');
    FOREACH v_id IN ARRAY v_ids LOOP
        PERFORM pgd_audit('system', 'supersede', 'job:' || v_id, format('superseded by job %s', p_new_id),
                          jsonb_build_object('superseded_by', p_new_id, 'target', p_target));
        PERFORM pgd_cancel_dependents(v_id, format('dependency %s superseded', v_id));
    END LOOP;
    RETURN v_ids;
END;
$$;

-- The jobs upstream of p_job_ids, p_job_ids included: what they depend on, directly or
-- through other jobs (job_dependencies never changes after a job's insert, so an unlocked
-- read is exact). Returns the ids, unordered.
CREATE OR REPLACE FUNCTION pgd_upstream_jobs(p_job_ids bigint[]) RETURNS bigint[]
LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg(id), '{}') FROM (
        WITH RECURSIVE up(id) AS (
            SELECT unnest(p_job_ids)
            UNION
            SELECT jd.depends_on_job_id FROM job_dependencies jd JOIN up ON jd.job_id = up.id)
        SELECT id FROM up) u
$$;

-- The jobs downstream of p_job_id, p_job_id included (its dependents, level by level).
CREATE OR REPLACE FUNCTION pgd_downstream_jobs(p_job_id bigint) RETURNS bigint[]
LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg(id), '{}') FROM (
        WITH RECURSIVE down(id) AS (
            SELECT p_job_id
            UNION
            SELECT jd.job_id FROM job_dependencies jd JOIN down ON jd.depends_on_job_id = down.id)
        SELECT id FROM down) d
$$;

-- The supersede scope of a deployment of project p_project_id to target p_target_id:
-- 'target' (targets.supersede), 'project' (project_target_supersede) or NULL (none).
CREATE OR REPLACE FUNCTION pgd_supersede_scope(p_project_id bigint, p_target_id bigint) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN t.supersede THEN 'target'
                WHEN EXISTS (SELECT 1 FROM project_target_supersede s
                              WHERE s.project_id = p_project_id AND s.target_id = t.id)
                THEN 'project' END
      FROM targets t WHERE t.id = p_target_id
$$;

-- Take the supersede locks of the targets of jobs p_job_ids that are deployments in a
-- supersede scope (in target id order; none for the others). Taken before any row is
-- locked, as pgd_submit takes its one, by the operator's transitions that put a finished
-- deployment back to waiting (a retry, a bulk retry, a resolution's re-run), so that they
-- and a superseding submit never pass each other (pgd_supersede_stale). A completion that
-- retries or hands back a running deployment needs none: the submit locks running
-- deployments in scope (pgd_submit).
CREATE OR REPLACE FUNCTION pgd_lock_supersede_scopes(p_job_ids bigint[]) RETURNS void
LANGUAGE sql AS $$
    SELECT count(pg_advisory_xact_lock(pgd_supersede_lock_class(), pgd_supersede_lock_key(t.id)))
      FROM (SELECT DISTINCT j.target_id AS id FROM jobs j
             WHERE j.id = ANY (p_job_ids) AND j.target_id IS NOT NULL
               AND pgd_supersede_scope(j.project_id, j.target_id) IS NOT NULL
             ORDER BY 1) t
$$;

-- A deployment going back to waiting (an automatic retry, a hand-back, an operator's retry
-- or a resolution's re-run; the caller has just set it queued or blocked, holding its row,
-- and, for an operator's transition, the supersede lock, pgd_lock_supersede_scopes) on a superseding target must not deploy
-- over a newer one: when a newer deployment in its scope is waiting, running, uncertain or
-- succeeded — and is not downstream of it (waiting for it) — it ends 'superseded' by the
-- newest such one, audited as the system's action like a submit's supersede, and its
-- dependents are cancelled. Returns the newer job's id, or NULL when the job stays waiting.
CREATE OR REPLACE FUNCTION pgd_supersede_stale(p_job_id bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v      jobs%ROWTYPE;
    v_scope text;
    v_newer bigint;
BEGIN
    SELECT * INTO v FROM jobs WHERE id = p_job_id;
    IF v.target_id IS NULL OR v.state NOT IN ('queued', 'blocked') THEN
        RETURN NULL;
    END IF;
    v_scope := pgd_supersede_scope(v.project_id, v.target_id);
    IF v_scope IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT max(j.id) INTO v_newer FROM jobs j
     WHERE j.target_id = v.target_id AND j.id > v.id
       AND j.state IN ('queued', 'blocked', 'running', 'uncertain', 'succeeded')
       AND (v_scope = 'target' OR j.project_id = v.project_id)
       AND j.id <> ALL (pgd_downstream_jobs(v.id));
    IF v_newer IS NULL THEN
        RETURN NULL;
    END IF;
    UPDATE jobs SET state = 'superseded', finished_at = now(),
                    last_error = format('superseded by job %s', v_newer)
     WHERE id = v.id;
    PERFORM pgd_audit('system', 'supersede', 'job:' || v.id, format('superseded by job %s', v_newer),
                      jsonb_build_object('superseded_by', v_newer,
                                         'target', (SELECT name FROM targets WHERE id = v.target_id)));
    PERFORM pgd_cancel_dependents(v.id, format('dependency %s superseded', v.id));
    RETURN v_newer;
END;
$$;

-- Wake-ups: idle schedulers are woken with NOTIFY when a job becomes claimable now, instead
-- of waiting for their next poll (measured in docs/benchmarks.md, "Wake-ups").
--
-- A job becomes claimable when it is inserted as queued and ready, or moves into queued with
-- ready_at already reached: submit, approve, resume... (pgd_release_dependents, hand-back,
-- operator retry). Then the transaction wakes ONE waiter (sql/functions/wakeups.sql,
-- pgd_choose_waiter): NOTIFY on the chosen runner's own channel with the job's pool id as
-- payload; when no idle listening runner of the pool is found, NOTIFY pgdispatch_queued, the
-- pool's broadcast that every listener hears. PostgreSQL delivers at commit and folds
-- identical notifications of one transaction into one (PostgreSQL docs, NOTIFY). A job of a
-- paused project wakes nobody (resuming it does: sql/functions/operator.sql).
-- Claims, completions that succeed, heartbeats and expiry with backoff never match the WHEN
-- clauses: notifying commits take one cluster-wide lock in commit order, which the hot path
-- must not pay. A retry whose backoff has not elapsed is left to the poll, whose idle
-- backoff is capped (docs/operations.md, "Idle schedulers and wake-ups").
--
-- Switch: ALTER DATABASE ... SET pgdispatch.notify = 'off' (or per role / session) stops the
-- notifications; schedulers then find work by polling alone.
CREATE OR REPLACE FUNCTION pgd_notify_queued() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_runner bigint;
BEGIN
    IF coalesce(current_setting('pgdispatch.notify', true), '') = 'off'
       OR EXISTS (SELECT 1 FROM projects p WHERE p.id = NEW.project_id AND p.paused_at IS NOT NULL) THEN
        RETURN NULL;
    END IF;
    v_runner := pgd_choose_waiter(NEW.pool_id);
    IF v_runner IS NULL THEN
        PERFORM pg_notify('pgdispatch_queued', NEW.pool_id::text);
    ELSE
        PERFORM pg_notify(pgd_runner_channel(v_runner), NEW.pool_id::text);
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER jobs_notify_queued_insert
    AFTER INSERT ON jobs FOR EACH ROW
    WHEN (NEW.state = 'queued' AND NEW.ready_at <= now())
    EXECUTE FUNCTION pgd_notify_queued();

CREATE OR REPLACE TRIGGER jobs_notify_queued_update
    AFTER UPDATE OF state ON jobs FOR EACH ROW
    WHEN (NEW.state = 'queued' AND OLD.state <> 'queued' AND NEW.ready_at <= now())
    EXECUTE FUNCTION pgd_notify_queued();
