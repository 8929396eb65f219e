-- name: pause_pool$
-- Pause a pool with a reason (conditional on it not being paused, fenced against the
-- claims in flight, audited); see pgd_pause_pool (sql/functions/operator.sql).
SELECT pgd_pause_pool(:pool, :reason, :actor);

-- name: resume_pool$
-- Resume a paused pool (conditional, audited, NOTIFYs its schedulers); see pgd_resume_pool.
SELECT pgd_resume_pool(:pool, :reason, :actor);
