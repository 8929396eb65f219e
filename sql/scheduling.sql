-- name: get_runner_pool_ids$
-- The pool ids a runner was registered for (fixed at registration), passed to its claims;
-- see pgd_get_runner_pool_ids (sql/functions/runners.sql). Read-only.
SELECT pgd_get_runner_pool_ids(:runner_id);

-- name: listen_runner$
-- Register this session as the runner's wake-up listener (listen_pid = its backend pid), after
-- its LISTEN; see pgd_listen_runner (sql/functions/wakeups.sql). Writes only the runner row.
SELECT pgd_listen_runner(:runner_id);
