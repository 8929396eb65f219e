-- Limit changes from the admin area (sql/limits.py): conditional, audited transitions; see
-- sql/functions/limits.sql.

-- name: set_organization_limit$
-- Set an organization's concurrency limit if it is still the one the admin saw; audited.
SELECT pgd_set_organization_limit(:organization, :max_running, :expected_max_running, :reason, :actor);

-- name: set_project_limits$
-- Set a project's running bound and fairness weight if still the ones the admin saw; audited.
SELECT pgd_set_project_limits(:project, :max_running, :weight, :expected_max_running,
                              :expected_weight, :reason, :actor);

-- name: set_pool_slots$
-- Set a pool's slots if still the ones the admin saw; audited.
SELECT pgd_set_pool_slots(:pool, :slots, :expected_slots, :reason, :actor);
