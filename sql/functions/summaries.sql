-- The per-(project, pool) waiting counts the overview reads (queue_summaries, sql/schema.sql)
-- and the per-minute history the console charts (queue_history per pool, queue_reason_history
-- per primary reason), refreshed by the holder of the summaries duty (scheduler/summaries.py:
-- pgd_run_summaries, then pgd_read_summary_inputs and pgd_record_reason_counts in the same
-- transaction; entry points of pgdispatch_scheduler, sql/grants.sql).

-- Refresh the summary rows; touches no job row. It only counts, compares and takes the
-- least timestamps of job rows, which no value of theirs can make fail (times at both ends of
-- the range: tests/sql/test_sweeps.py); one statement. The columns are what sql/explain.py
-- needs to count waiting jobs under their primary reason and under every reason, and the
-- oldest "waiting since" per primary reason, without reading job rows (docs/design.md,
-- "Why is this job waiting?"): the per-job reasons (dependency, approval, delay, target)
-- are counted here, the per-(project, pool) ones (paused, runners, capacity) are judged at
-- read time from the small tables. A target "held" counts only when held by another job,
-- as explain's target_held. A ready deployment of a project not paused that is not its
-- target's head (pgd_target_head, one probe per target) is target_order, which comes before
-- target_held and target_uncertain: those and oldest_free_at count only the others.
CREATE OR REPLACE FUNCTION pgd_summarize_queue()
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    WITH heads AS MATERIALIZED (
        SELECT t.id, t.state, t.holder_job_id, pgd_target_head(t.id) AS head_job_id FROM targets t
    ), flagged AS (
        SELECT j.project_id, j.pool_id, j.state, j.ready_at, j.created_at,
               j.state = 'queued' AND j.ready_at <= now() AS is_ready,
               j.state = 'blocked' AND j.pending_dependencies > 0 AS is_dependency,
               j.requires_approval AND j.approved_at IS NULL AS is_approval,
               coalesce(t.state = 'held' AND t.holder_job_id IS DISTINCT FROM j.id, false) AS is_held,
               coalesce(t.state = 'uncertain', false) AS is_uncertain,
               coalesce(j.state = 'queued' AND j.ready_at <= now() AND p.paused_at IS NULL
                        AND t.head_job_id IS NOT NULL AND t.head_job_id <> j.id, false) AS is_order
          FROM jobs j
          JOIN projects p ON p.id = j.project_id
          LEFT JOIN heads t ON t.id = j.target_id
         WHERE j.state IN ('queued', 'blocked')
    ), counts AS (
        SELECT project_id, pool_id,
               count(*) FILTER (WHERE is_ready) AS queued_ready,
               count(*) FILTER (WHERE is_order) AS target_order,
               min(ready_at) FILTER (WHERE is_order) AS oldest_target_order_at,
               count(*) FILTER (WHERE is_ready AND is_held AND NOT is_order) AS target_held,
               count(*) FILTER (WHERE is_ready AND is_uncertain AND NOT is_order) AS target_uncertain,
               count(*) FILTER (WHERE state = 'queued' AND NOT is_ready) AS queued_delayed,
               count(*) FILTER (WHERE is_dependency) AS blocked_dependency,
               count(*) FILTER (WHERE state = 'blocked' AND NOT is_dependency) AS blocked_approval,
               min(ready_at) FILTER (WHERE is_ready) AS oldest_ready_at,
               count(*) FILTER (WHERE is_approval) AS any_approval,
               count(*) FILTER (WHERE is_held) AS any_target_held,
               count(*) FILTER (WHERE is_uncertain) AS any_target_uncertain,
               min(created_at) FILTER (WHERE is_dependency) AS oldest_dependency_at,
               min(created_at) FILTER (WHERE state = 'blocked' AND NOT is_dependency) AS oldest_approval_at,
               min(ready_at) FILTER (WHERE is_ready AND is_held AND NOT is_order) AS oldest_target_held_at,
               min(ready_at) FILTER (WHERE is_ready AND is_uncertain AND NOT is_order) AS oldest_target_uncertain_at,
               min(ready_at) FILTER (WHERE is_ready AND NOT is_held AND NOT is_uncertain
                                           AND NOT is_order) AS oldest_free_at
          FROM flagged
         GROUP BY project_id, pool_id
    ), upserted AS (
        INSERT INTO queue_summaries AS s (project_id, pool_id, queued_ready, target_held,
                                          target_uncertain, queued_delayed, blocked_dependency,
                                          blocked_approval, oldest_ready_at, refreshed_at,
                                          any_approval, any_target_held, any_target_uncertain,
                                          oldest_dependency_at, oldest_approval_at,
                                          oldest_target_held_at, oldest_target_uncertain_at,
                                          oldest_free_at, target_order, oldest_target_order_at)
        SELECT project_id, pool_id, queued_ready, target_held, target_uncertain, queued_delayed,
               blocked_dependency, blocked_approval, oldest_ready_at, now(),
               any_approval, any_target_held, any_target_uncertain, oldest_dependency_at,
               oldest_approval_at, oldest_target_held_at, oldest_target_uncertain_at, oldest_free_at,
               target_order, oldest_target_order_at
          FROM counts
        ON CONFLICT (project_id, pool_id) DO UPDATE
           SET queued_ready = excluded.queued_ready, target_held = excluded.target_held,
               target_uncertain = excluded.target_uncertain, queued_delayed = excluded.queued_delayed,
               blocked_dependency = excluded.blocked_dependency,
               blocked_approval = excluded.blocked_approval,
               oldest_ready_at = excluded.oldest_ready_at, refreshed_at = excluded.refreshed_at,
               any_approval = excluded.any_approval, any_target_held = excluded.any_target_held,
               any_target_uncertain = excluded.any_target_uncertain,
               oldest_dependency_at = excluded.oldest_dependency_at,
               oldest_approval_at = excluded.oldest_approval_at,
               oldest_target_held_at = excluded.oldest_target_held_at,
               oldest_target_uncertain_at = excluded.oldest_target_uncertain_at,
               oldest_free_at = excluded.oldest_free_at,
               target_order = excluded.target_order,
               oldest_target_order_at = excluded.oldest_target_order_at
        RETURNING s.project_id, s.pool_id
    )
    UPDATE queue_summaries s
       SET queued_ready = 0, target_held = 0, target_uncertain = 0, queued_delayed = 0,
           blocked_dependency = 0, blocked_approval = 0, oldest_ready_at = NULL, refreshed_at = now(),
           any_approval = 0, any_target_held = 0, any_target_uncertain = 0,
           oldest_dependency_at = NULL, oldest_approval_at = NULL, oldest_target_held_at = NULL,
           oldest_target_uncertain_at = NULL, oldest_free_at = NULL, target_order = 0,
           oldest_target_order_at = NULL
     WHERE NOT EXISTS (SELECT 1 FROM counts c WHERE c.project_id = s.project_id AND c.pool_id = s.pool_id)
$$;

-- When a waiting job's wait began (the queue's "waiting since" and its oldest-first order):
-- a blocked job waits since it was created, a queued or uncertain one since its ready_at
-- (set at submit, unblock, approval and retry scheduling; a delayed retry's lies ahead: it
-- does not wait before). Plain SQL, inlined into the reads.
CREATE OR REPLACE FUNCTION pgd_waiting_since(p_state text, p_ready_at timestamptz,
                                             p_created_at timestamptz)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_state = 'blocked' THEN p_created_at ELSE p_ready_at END
$$;

-- Attempts claimed in [p_from, p_to), per pool: how many, and the p50 / p95 of their wait
-- (claimed_at - ready_at, seconds; the ready_at each claim recorded, so a later retry that
-- moves the job's ready_at changes nothing). Without an index on attempts.claimed_at (it
-- would cost every claim and heartbeat an index entry), it finds them through their jobs: a
-- job claimed since p_from is now waiting again or running (the small set of unfinished jobs
-- that have ever been claimed) or has finished since p_from (a range of jobs_finished_idx),
-- and its attempts are read by (job_id, attempt_no). Internal; read-only.
CREATE OR REPLACE FUNCTION pgd_claim_waits(p_from timestamptz, p_to timestamptz)
RETURNS TABLE (pool_id bigint, claimed integer, wait_p50_seconds double precision,
               wait_p95_seconds double precision)
LANGUAGE sql STABLE AS $$
    SELECT j.pool_id, count(*)::integer,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY w.seconds),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY w.seconds)
      FROM (SELECT id, pool_id FROM jobs
             WHERE state IN ('blocked', 'queued', 'running', 'uncertain') AND attempts_made > 0
            UNION ALL
            SELECT id, pool_id FROM jobs WHERE finished_at >= p_from) j
      JOIN attempts a ON a.job_id = j.id
     CROSS JOIN LATERAL (SELECT greatest(extract(epoch FROM a.claimed_at - a.ready_at)::float8,
                                         0) AS seconds) w
     WHERE a.claimed_at >= p_from AND a.claimed_at < p_to AND a.ready_at IS NOT NULL
     GROUP BY j.pool_id
$$;

-- Record the current minute of queue_history from the summary rows, the running attempts
-- and the minute's claims: per pool, the most waiting (queued and ready), the most running
-- and the longest wait (seconds) seen in that minute, the wait being the oldest ready job's
-- (queued, its ready_at passed, whatever holds it: blocked jobs and delayed retries are not
-- counted; oldest_ready_at of queue_summaries), and the minute's claims so far with
-- their wait p50 / p95 (recounted whole on every pass). In the first 30 seconds of a minute
-- the previous minute's claims are recounted too, so that a claim committed after that
-- minute's last pass is still counted. Internal.
CREATE OR REPLACE FUNCTION pgd_record_queue_history()
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_minute timestamptz := date_trunc('minute', now());
BEGIN
    INSERT INTO queue_history AS h (at, pool_id, waiting, running, oldest_wait_seconds,
                                    claimed, wait_p50_seconds, wait_p95_seconds)
    SELECT v_minute, q.id, coalesce(s.waiting, 0), coalesce(r.running, 0),
           s.oldest_wait_seconds, coalesce(c.claimed, 0), c.wait_p50_seconds, c.wait_p95_seconds
      FROM pools q
      LEFT JOIN (SELECT pool_id, sum(queued_ready)::integer AS waiting,
                        extract(epoch FROM now() - min(oldest_ready_at))::float8 AS oldest_wait_seconds
                   FROM queue_summaries GROUP BY pool_id) s ON s.pool_id = q.id
      LEFT JOIN (SELECT j.pool_id, count(*)::integer AS running
                   FROM attempts a JOIN jobs j ON j.id = a.job_id
                  WHERE a.state = 'running' GROUP BY j.pool_id) r ON r.pool_id = q.id
      LEFT JOIN pgd_claim_waits(v_minute, 'infinity') c ON c.pool_id = q.id
    ON CONFLICT (at, pool_id) DO UPDATE
       SET waiting = greatest(h.waiting, excluded.waiting),
           running = greatest(h.running, excluded.running),
           oldest_wait_seconds = CASE WHEN h.oldest_wait_seconds IS NULL
                                      THEN excluded.oldest_wait_seconds
                                      ELSE greatest(h.oldest_wait_seconds,
                                                    excluded.oldest_wait_seconds) END,
           claimed = excluded.claimed, wait_p50_seconds = excluded.wait_p50_seconds,
           wait_p95_seconds = excluded.wait_p95_seconds;
    IF now() < v_minute + interval '30 seconds' THEN
        UPDATE queue_history h
           SET claimed = c.claimed, wait_p50_seconds = c.wait_p50_seconds,
               wait_p95_seconds = c.wait_p95_seconds
          FROM pgd_claim_waits(v_minute - interval '1 minute', v_minute) c
         WHERE h.at = v_minute - interval '1 minute' AND h.pool_id = c.pool_id;
    END IF;
END;
$$;

-- What the summaries duty's holder needs to count the waiting jobs by primary reason in
-- Python (sql/explain.py, summary_reason_counts): the summary rows and the world of
-- read_world, as one jsonb {"now", "summaries", "organizations", "projects", "pools",
-- "grants", "live"} whose rows have the columns of the named statements read_world uses
-- (list_organizations, list_projects, list_pools, list_grants: sql/projects.sql; live:
-- pgd_live_runner_pools, sql/functions/runners.sql; tests/sql/test_history.py checks they
-- agree), for a scheduler login, which may read no table. NULL when the runner does not
-- hold the duty in that term, or the session is not the runner's login (pgd_holds_duty:
-- another host's login learns nothing by guessing a runner id and a term). Read-only.
CREATE OR REPLACE FUNCTION pgd_read_summary_inputs(p_runner_id bigint, p_term bigint,
                                                   p_live_seconds double precision)
RETURNS jsonb
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT CASE WHEN pgd_holds_duty(p_runner_id, p_term, 'summaries') THEN jsonb_build_object(
        'now', now(),
        'summaries', (SELECT coalesce(jsonb_agg(to_jsonb(s)), '[]') FROM queue_summaries s),
        'organizations', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                'id', id, 'name', name, 'max_running', max_running,
                'running', pgd_organization_running(id))), '[]') FROM organizations),
        'projects', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                'id', p.id, 'name', p.name, 'organization_id', p.organization_id,
                'organization', o.name, 'weight', p.weight, 'max_running', p.max_running,
                'running', pgd_project_running(p.id), 'paused_at', p.paused_at,
                'pause_reason', p.pause_reason, 'paused_by', p.paused_by,
                'last_claimed_at', p.last_claimed_at,
                'pools', ARRAY(SELECT q.name FROM project_pools pp JOIN pools q ON q.id = pp.pool_id
                                WHERE pp.project_id = p.id ORDER BY q.name))), '[]')
                       FROM projects p JOIN organizations o ON o.id = p.organization_id),
        'pools', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                'id', id, 'name', name, 'slots', slots, 'running', pgd_pool_running(id),
                'paused_at', paused_at, 'pause_reason', pause_reason, 'paused_by', paused_by)), '[]')
                    FROM pools),
        'grants', (SELECT coalesce(jsonb_agg(jsonb_build_array(project_id, pool_id)), '[]')
                     FROM project_pools),
        'live', (SELECT coalesce(jsonb_agg(to_jsonb(l)), '[]')
                   FROM pgd_live_runner_pools(p_live_seconds) l))
    END
$$;

-- The reason codes, in their order of precedence: a copy of REASON_CODES of sql/explain.py
-- (where they are defined), which tests/sql/test_history.py compares with this one. What
-- pgd_record_reason_counts accepts. Internal.
CREATE OR REPLACE FUNCTION pgd_reason_codes()
RETURNS text[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT ARRAY['dependency_pending', 'approval_required', 'project_paused', 'pool_paused',
                 'retry_delayed',
                 'no_authorized_runner', 'capacity_organization', 'capacity_project',
                 'capacity_pool', 'target_order', 'target_held', 'target_uncertain',
                 'runners_busy', 'ready']
$$;

-- Record the waiting jobs by primary reason for the current minute of queue_reason_history:
-- p_counts ({"code": n, ...}) counted by the duty's holder from the summary rows
-- (pgd_read_summary_inputs, explain.summary_reason_counts), plus the jobs whose deployment
-- is uncertain, counted here under target_uncertain (they are not in the summary; the
-- overview counts them so too: reads.overview). One row per reason code, zeros included.
-- One snapshot per minute: a record whose total is at least the minute's recorded total
-- replaces the minute's rows together, a smaller one is dropped; so the minute holds the
-- counts of one moment (the one with the most waiting jobs, the latest of equals), whose sum
-- is a number of jobs that were waiting at once, never one job under two reasons.
-- Fenced: false, and nothing written, when the runner does not hold the summaries duty in
-- that term or the session is not its login (pgd_holds_duty). Raises PD422, writing
-- nothing, when p_counts is not an object of reason codes (pgd_reason_codes) to whole
-- numbers >= 0, or when the counts sum to more than the waiting jobs of the summary rows
-- (blocked, delayed and ready; what summary_reason_counts splits).
CREATE OR REPLACE FUNCTION pgd_record_reason_counts(p_runner_id bigint, p_term bigint,
                                                    p_counts jsonb)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_codes     text[] := pgd_reason_codes();
    v_minute    timestamptz := date_trunc('minute', now());
    v_bad       text;
    v_given     bigint;
    v_waiting   bigint;
    v_uncertain bigint;
    v_recorded  bigint;
BEGIN
    IF jsonb_typeof(p_counts) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'reason counts must be an object of reason codes to counts'
            USING ERRCODE = 'PD422';
    END IF;
    SELECT k INTO v_bad FROM jsonb_object_keys(p_counts) k WHERE k <> ALL (v_codes) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'unknown reason code % in the reason counts (one of: %)',
            quote_literal(left(v_bad, 40)), array_to_string(v_codes, ', ')
            USING ERRCODE = 'PD422';
    END IF;
    IF EXISTS (SELECT 1 FROM jsonb_each(p_counts) e
                WHERE CASE WHEN jsonb_typeof(e.value) <> 'number' THEN true
                           ELSE e.value::numeric NOT BETWEEN 0 AND 2147483647
                                OR e.value::numeric <> trunc(e.value::numeric) END) THEN
        RAISE EXCEPTION 'reason counts must be whole numbers >= 0' USING ERRCODE = 'PD422';
    END IF;
    IF NOT pgd_holds_duty(p_runner_id, p_term, 'summaries') THEN
        RETURN false;
    END IF;
    SELECT coalesce(sum((e.value::numeric)::bigint), 0) INTO v_given FROM jsonb_each(p_counts) e;
    SELECT coalesce(sum(blocked_dependency + blocked_approval + queued_ready + queued_delayed), 0)
      INTO v_waiting FROM queue_summaries;
    IF v_given > v_waiting THEN
        RAISE EXCEPTION 'reason counts sum to %, more than the % waiting jobs of the summary',
            v_given, v_waiting USING ERRCODE = 'PD422';
    END IF;
    SELECT count(*) INTO v_uncertain FROM jobs WHERE state = 'uncertain';
    SELECT sum(waiting) INTO v_recorded FROM queue_reason_history WHERE at = v_minute;
    IF v_recorded IS NULL OR v_given + v_uncertain >= v_recorded THEN
        DELETE FROM queue_reason_history WHERE at = v_minute;
        INSERT INTO queue_reason_history (at, reason, waiting)
        SELECT v_minute, c, (coalesce((p_counts ->> c)::numeric, 0)
                             + CASE WHEN c = 'target_uncertain' THEN v_uncertain ELSE 0 END)::integer
          FROM unnest(v_codes) c;
    END IF;
    RETURN true;
END;
$$;

-- The summaries duty, in one transaction, for its holder only: refresh queue_summaries and
-- the current minute of queue_history, then stamp the duty done (pgd_stamp_duty,
-- sql/functions/runners.sql, fenced by runner and term). Returns true when done; false when
-- the caller does not hold the duty in that term (checked first, without a lock, and again
-- by the stamp: a run that lost the duty meanwhile is undone whole).
CREATE OR REPLACE FUNCTION pgd_run_summaries(p_runner_id bigint, p_term bigint)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NOT pgd_holds_duty(p_runner_id, p_term, 'summaries') THEN
        RETURN false;
    END IF;
    BEGIN
        PERFORM pgd_summarize_queue();
        PERFORM pgd_record_queue_history();
        IF NOT pgd_stamp_duty(p_runner_id, p_term, 'summaries') THEN
            RAISE EXCEPTION USING ERRCODE = 'PDFNC';
        END IF;
    EXCEPTION WHEN SQLSTATE 'PDFNC' THEN
        RETURN false;
    END;
    RETURN true;
END;
$$;
