-- name: list_filter_choices^
-- The names the console's filter menus offer (organizations, projects, pools), sorted. Read-only.
SELECT ARRAY(SELECT name FROM organizations ORDER BY name) AS organizations,
       ARRAY(SELECT name FROM projects ORDER BY name) AS projects,
       ARRAY(SELECT name FROM pools ORDER BY name) AS pools;

-- ---------------------------------------------------------------------------------------
-- Admin area: accounts, API tokens and limits. Each change is a conditional transition:
-- the row is locked first, compared with what the admin saw, changed, and audited in the
-- same transaction (sql/console.py). Each locks one row of one table (plus, for changes
-- that could remove the last admin, every active admin's row, in id order).

-- name: list_users
-- Every account with its role, state and how many live API tokens it has. Read-only.
SELECT u.id, u.username, u.role, u.created_at, u.disabled_at,
       (SELECT count(*) FROM api_tokens t WHERE t.user_id = u.id AND t.revoked_at IS NULL) AS live_tokens
  FROM users u
 ORDER BY u.username;

-- name: list_api_tokens
-- Every API token's label and use (never its hash), newest first. Read-only.
SELECT t.id, u.username, t.name, t.created_at, t.last_used_at, t.revoked_at
  FROM api_tokens t JOIN users u ON u.id = t.user_id
 ORDER BY t.revoked_at IS NOT NULL, t.id DESC;

-- name: insert_user$
-- Create an account; NULL when the username is taken (the caller says so, nothing written).
INSERT INTO users (username, password_hash, role) VALUES (:username, :password_hash, :role)
ON CONFLICT (username) DO NOTHING
RETURNING id;

-- name: lock_user^
-- Lock one account's row for a conditional change (the admin compares it with what they saw).
SELECT id, username, role, disabled_at FROM users WHERE username = :username FOR UPDATE;

-- name: lock_active_admins
-- Lock every active admin's row in id order, so two admins demoting or disabling each other
-- at once cannot both pass the "another active admin remains" check (the second waits, then
-- re-reads). Read Committed: the next statement sees what the first committed.
SELECT id, username FROM users WHERE role = 'admin' AND disabled_at IS NULL ORDER BY id FOR UPDATE;

-- name: update_user_role!
-- Change an account's role (the row is locked by lock_user in this transaction).
UPDATE users SET role = :role WHERE id = :user_id;

-- name: update_user_disabled_at$
-- Disable (now()) or enable (NULL) an account; returns the new disabled_at.
UPDATE users SET disabled_at = CASE WHEN :is_disabled THEN now() END WHERE id = :user_id
RETURNING disabled_at;

-- name: update_user_password!
-- Store a new argon2 hash for an account (its sessions end: they carry the old hash's fingerprint).
UPDATE users SET password_hash = :password_hash WHERE id = :user_id;

-- name: lock_api_token^
-- Lock one API token's row (with its owner's name) for revocation.
SELECT t.id, t.name, t.revoked_at, u.username
  FROM api_tokens t JOIN users u ON u.id = t.user_id
 WHERE t.id = :token_id
   FOR UPDATE OF t;

-- name: revoke_api_token$
-- Revoke a token now; from the next request on it authenticates nothing.
UPDATE api_tokens SET revoked_at = now() WHERE id = :token_id RETURNING revoked_at;

-- name: lock_organization^
-- Lock an organization's row before changing its limit (first in the lock order), with its
-- running count: its held slots (migration 0008).
SELECT id, name, max_running, pgd_organization_running(id) AS running
  FROM organizations WHERE name = :name FOR UPDATE;

-- name: update_organization_limit!
-- Set an organization's concurrency limit; below the running count it only stops new claims.
UPDATE organizations SET max_running = :max_running WHERE id = :organization_id;

-- name: lock_project^
-- Lock a project's row before changing its bound and weight.
SELECT id, name, max_running, weight, pgd_project_running(id) AS running FROM projects WHERE name = :name FOR UPDATE;

-- name: update_project_limits!
-- Set a project's running bound (NULL: none) and fairness weight.
UPDATE projects SET max_running = :max_running, weight = :weight WHERE id = :project_id;

-- name: lock_pool^
-- Lock a pool's row before changing its slots, with its running count: its held slots
-- (migration 0008).
SELECT id, name, slots, pgd_pool_running(id) AS running FROM pools WHERE name = :name FOR UPDATE;

-- name: update_pool_slots!
-- Set a pool's slots; below the running count it only stops new claims.
UPDATE pools SET slots = :slots WHERE id = :pool_id;

-- name: last_actor$
-- Who last acted on a subject, and when ("alice at 2025-01-31 14:02:03 UTC"), for conflicts.
SELECT pgd_last_actor(:subject);
