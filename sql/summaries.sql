-- name: summarize_queue!
-- Refresh the per-(project, pool) waiting counts the overview reads; see pgd_summarize_queue
-- (sql/functions/summaries.sql).
SELECT pgd_summarize_queue();

-- name: run_summaries$
-- The summaries duty (queue_summaries and queue_history), if the caller holds it in that
-- term; see pgd_run_summaries (sql/functions/summaries.sql).
SELECT pgd_run_summaries(:runner_id, :term);

-- name: read_summary_inputs$
-- The summary rows and the world the reason counts need, for the summaries duty's holder
-- only (NULL otherwise); see pgd_read_summary_inputs. Read-only.
SELECT pgd_read_summary_inputs(:runner_id, :term, :live_seconds);

-- name: record_reason_counts$
-- The current minute of queue_reason_history, fenced by the summaries duty; see
-- pgd_record_reason_counts (sql/functions/summaries.sql).
SELECT pgd_record_reason_counts(:runner_id, :term, CAST(:counts AS jsonb));

-- name: read_queue_summaries
-- The summary rows with names, and how old they are in seconds. Read-only.
SELECT s.project_id, p.name AS project, p.organization_id, s.pool_id, q.name AS pool,
       s.queued_ready, s.target_held, s.target_uncertain, s.queued_delayed,
       s.blocked_dependency, s.blocked_approval, s.oldest_ready_at, s.refreshed_at,
       s.any_approval, s.any_target_held, s.any_target_uncertain, s.oldest_dependency_at,
       s.oldest_approval_at, s.oldest_target_held_at, s.oldest_target_uncertain_at,
       s.oldest_free_at, s.target_order, s.oldest_target_order_at,
       extract(epoch FROM now() - s.refreshed_at)::float8 AS age_seconds
  FROM queue_summaries s
  JOIN projects p ON p.id = s.project_id
  JOIN pools q ON q.id = s.pool_id
 ORDER BY p.name, q.name;
