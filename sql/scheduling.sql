-- name: get_runner_pool_ids$
-- The pool ids a runner was registered for (fixed at registration), passed to its claims. Read-only.
SELECT pool_ids FROM runners WHERE id = :runner_id;
