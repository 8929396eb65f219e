-- Limit changes from the admin area (sql/limits.py): conditional transitions that lock one
-- row (organization, project or pool), compare it with what the admin saw, change it, and
-- audit the change in the same transaction.

-- name: lock_organization^
-- Lock an organization's row before changing its limit (first in the lock order), with its
-- running count: its held slots.
SELECT id, name, max_running, pgd_organization_running(id) AS running
  FROM organizations WHERE name = :name FOR UPDATE;

-- name: set_organization_limit!
-- Set an organization's concurrency limit; below the running count it only stops new claims.
UPDATE organizations SET max_running = :max_running WHERE id = :organization_id;

-- name: lock_project^
-- Lock a project's row before changing its bound and weight.
SELECT id, name, max_running, weight, pgd_project_running(id) AS running FROM projects WHERE name = :name FOR UPDATE;

-- name: set_project_limits!
-- Set a project's running bound (NULL: none) and fairness weight.
UPDATE projects SET max_running = :max_running, weight = :weight WHERE id = :project_id;

-- name: lock_pool^
-- Lock a pool's row before changing its slots, with its running count: its held slots.
SELECT id, name, slots, pgd_pool_running(id) AS running FROM pools WHERE name = :name FOR UPDATE;

-- name: set_pool_slots!
-- Set a pool's slots; below the running count it only stops new claims.
UPDATE pools SET slots = :slots WHERE id = :pool_id;
