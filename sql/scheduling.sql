-- name: get_runner_pool_ids$
-- The pool ids a runner was registered for (fixed at registration), passed to its claims;
-- see pgd_get_runner_pool_ids (sql/functions/runners.sql). Read-only.
SELECT pgd_get_runner_pool_ids(:runner_id);
