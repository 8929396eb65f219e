-- The per-(project, pool) waiting counts the overview reads (queue_summaries, sql/schema.sql)
-- and the per-pool, per-minute history the console charts (queue_history), refreshed by the
-- holder of the summaries duty (scheduler/summaries.py, pgd_run_summaries: an entry point
-- of pgdispatch_scheduler, sql/grants.sql).

-- Refresh the summary rows; touches no job row. It only counts, compares and takes the
-- least timestamps of job rows, which no value of theirs can make fail (times at both ends of
-- the range: tests/sql/test_sweeps.py); one statement. The columns are what sql/explain.py
-- needs to count waiting jobs under their primary reason and under every reason, and the
-- oldest "waiting since" per primary reason, without reading job rows (docs/design.md,
-- "Why is this job waiting?"): the per-job reasons (dependency, approval, delay, target)
-- are counted here, the per-(project, pool) ones (paused, runners, capacity) are judged at
-- read time from the small tables. A target "held" counts only when held by another job,
-- as explain's target_held.
CREATE OR REPLACE FUNCTION pgd_summarize_queue()
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    WITH flagged AS (
        SELECT j.project_id, j.pool_id, j.state, j.ready_at, j.created_at,
               j.state = 'queued' AND j.ready_at <= now() AS is_ready,
               j.state = 'blocked' AND j.pending_dependencies > 0 AS is_dependency,
               j.requires_approval AND j.approved_at IS NULL AS is_approval,
               coalesce(t.state = 'held' AND t.holder_job_id IS DISTINCT FROM j.id, false) AS is_held,
               coalesce(t.state = 'uncertain', false) AS is_uncertain
          FROM jobs j
          LEFT JOIN targets t ON t.id = j.target_id
         WHERE j.state IN ('queued', 'blocked')
    ), counts AS (
        SELECT project_id, pool_id,
               count(*) FILTER (WHERE is_ready) AS queued_ready,
               count(*) FILTER (WHERE is_ready AND is_held) AS target_held,
               count(*) FILTER (WHERE is_ready AND is_uncertain) AS target_uncertain,
               count(*) FILTER (WHERE state = 'queued' AND NOT is_ready) AS queued_delayed,
               count(*) FILTER (WHERE is_dependency) AS blocked_dependency,
               count(*) FILTER (WHERE state = 'blocked' AND NOT is_dependency) AS blocked_approval,
               min(ready_at) FILTER (WHERE is_ready) AS oldest_ready_at,
               count(*) FILTER (WHERE is_approval) AS any_approval,
               count(*) FILTER (WHERE is_held) AS any_target_held,
               count(*) FILTER (WHERE is_uncertain) AS any_target_uncertain,
               min(created_at) FILTER (WHERE is_dependency) AS oldest_dependency_at,
               min(created_at) FILTER (WHERE state = 'blocked' AND NOT is_dependency) AS oldest_approval_at,
               min(ready_at) FILTER (WHERE is_ready AND is_held) AS oldest_target_held_at,
               min(ready_at) FILTER (WHERE is_ready AND is_uncertain) AS oldest_target_uncertain_at,
               min(ready_at) FILTER (WHERE is_ready AND NOT is_held AND NOT is_uncertain) AS oldest_free_at
          FROM flagged
         GROUP BY project_id, pool_id
    ), upserted AS (
        INSERT INTO queue_summaries AS s (project_id, pool_id, queued_ready, target_held,
                                          target_uncertain, queued_delayed, blocked_dependency,
                                          blocked_approval, oldest_ready_at, refreshed_at,
                                          any_approval, any_target_held, any_target_uncertain,
                                          oldest_dependency_at, oldest_approval_at,
                                          oldest_target_held_at, oldest_target_uncertain_at,
                                          oldest_free_at)
        SELECT project_id, pool_id, queued_ready, target_held, target_uncertain, queued_delayed,
               blocked_dependency, blocked_approval, oldest_ready_at, now(),
               any_approval, any_target_held, any_target_uncertain, oldest_dependency_at,
               oldest_approval_at, oldest_target_held_at, oldest_target_uncertain_at, oldest_free_at
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
               oldest_free_at = excluded.oldest_free_at
        RETURNING s.project_id, s.pool_id
    )
    UPDATE queue_summaries s
       SET queued_ready = 0, target_held = 0, target_uncertain = 0, queued_delayed = 0,
           blocked_dependency = 0, blocked_approval = 0, oldest_ready_at = NULL, refreshed_at = now(),
           any_approval = 0, any_target_held = 0, any_target_uncertain = 0,
           oldest_dependency_at = NULL, oldest_approval_at = NULL, oldest_target_held_at = NULL,
           oldest_target_uncertain_at = NULL, oldest_free_at = NULL
     WHERE NOT EXISTS (SELECT 1 FROM counts c WHERE c.project_id = s.project_id AND c.pool_id = s.pool_id)
$$;

-- Record the current minute of queue_history from the summary rows and the running
-- attempts: per pool, the most waiting (queued and ready), the most running and the longest
-- wait (seconds) seen in that minute. Internal; one statement.
CREATE OR REPLACE FUNCTION pgd_record_queue_history()
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO queue_history AS h (at, pool_id, waiting, running, oldest_wait_seconds)
    SELECT date_trunc('minute', now()), q.id, coalesce(s.waiting, 0), coalesce(r.running, 0),
           s.oldest_wait_seconds
      FROM pools q
      LEFT JOIN (SELECT pool_id, sum(queued_ready)::integer AS waiting,
                        extract(epoch FROM now() - min(oldest_ready_at))::float8 AS oldest_wait_seconds
                   FROM queue_summaries GROUP BY pool_id) s ON s.pool_id = q.id
      LEFT JOIN (SELECT j.pool_id, count(*)::integer AS running
                   FROM attempts a JOIN jobs j ON j.id = a.job_id
                  WHERE a.state = 'running' GROUP BY j.pool_id) r ON r.pool_id = q.id
    ON CONFLICT (at, pool_id) DO UPDATE
       SET waiting = greatest(h.waiting, excluded.waiting),
           running = greatest(h.running, excluded.running),
           oldest_wait_seconds = CASE WHEN h.oldest_wait_seconds IS NULL
                                      THEN excluded.oldest_wait_seconds
                                      ELSE greatest(h.oldest_wait_seconds,
                                                    excluded.oldest_wait_seconds) END
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
