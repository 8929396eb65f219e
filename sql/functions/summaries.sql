-- The per-(project, pool) waiting counts the overview reads (queue_summaries, sql/schema.sql),
-- refreshed by every scheduler's summary job (scheduler/summaries.py); an entry point of
-- pgdispatch_scheduler (sql/grants.sql).

-- Refresh the summary rows; touches no job row. It only counts, compares and takes the
-- least ready_at of job rows, which no value of theirs can make fail (times at both ends of
-- the range: tests/sql/test_sweeps.py); one statement.
CREATE OR REPLACE FUNCTION pgd_summarize_queue()
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    WITH counts AS (
        SELECT j.project_id, j.pool_id,
               count(*) FILTER (WHERE j.state = 'queued' AND j.ready_at <= now()) AS queued_ready,
               count(*) FILTER (WHERE j.state = 'queued' AND j.ready_at <= now()
                                  AND t.state = 'held') AS target_held,
               count(*) FILTER (WHERE j.state = 'queued' AND j.ready_at <= now()
                                  AND t.state = 'uncertain') AS target_uncertain,
               count(*) FILTER (WHERE j.state = 'queued' AND j.ready_at > now()) AS queued_delayed,
               count(*) FILTER (WHERE j.state = 'blocked' AND j.pending_dependencies > 0) AS blocked_dependency,
               count(*) FILTER (WHERE j.state = 'blocked' AND j.pending_dependencies = 0) AS blocked_approval,
               min(j.ready_at) FILTER (WHERE j.state = 'queued' AND j.ready_at <= now()) AS oldest_ready_at
          FROM jobs j
          LEFT JOIN targets t ON t.id = j.target_id
         WHERE j.state IN ('queued', 'blocked')
         GROUP BY j.project_id, j.pool_id
    ), upserted AS (
        INSERT INTO queue_summaries AS s (project_id, pool_id, queued_ready, target_held,
                                          target_uncertain, queued_delayed, blocked_dependency,
                                          blocked_approval, oldest_ready_at, refreshed_at)
        SELECT project_id, pool_id, queued_ready, target_held, target_uncertain, queued_delayed,
               blocked_dependency, blocked_approval, oldest_ready_at, now()
          FROM counts
        ON CONFLICT (project_id, pool_id) DO UPDATE
           SET queued_ready = excluded.queued_ready, target_held = excluded.target_held,
               target_uncertain = excluded.target_uncertain, queued_delayed = excluded.queued_delayed,
               blocked_dependency = excluded.blocked_dependency,
               blocked_approval = excluded.blocked_approval,
               oldest_ready_at = excluded.oldest_ready_at, refreshed_at = excluded.refreshed_at
        RETURNING s.project_id, s.pool_id
    )
    UPDATE queue_summaries s
       SET queued_ready = 0, target_held = 0, target_uncertain = 0, queued_delayed = 0,
           blocked_dependency = 0, blocked_approval = 0, oldest_ready_at = NULL, refreshed_at = now()
     WHERE NOT EXISTS (SELECT 1 FROM counts c WHERE c.project_id = s.project_id AND c.pool_id = s.pool_id)
$$;
