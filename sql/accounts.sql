-- Operator accounts and API tokens (sql/accounts.py). Sign-in reads; config apply declares
-- accounts unaudited (upsert_user); the admin area's changes are conditional transitions:
-- the row is locked first, compared with what the admin saw, changed, and audited in the
-- same transaction. Each locks one row of one table (plus, for changes that could remove
-- the last admin, every active admin's row, in id order).

-- name: get_user^
-- One operator account by username. Read-only.
SELECT id, username, password_hash, role, disabled_at FROM users WHERE username = :username;

-- name: get_user_by_id^
-- One operator account by id. Read-only.
SELECT id, username, password_hash, role, disabled_at FROM users WHERE id = :user_id;

-- name: find_api_token^
-- The user behind a bearer token's sha256, if the token and the user are active.
UPDATE api_tokens t SET last_used_at = now()
  FROM users u
 WHERE t.token_hash = :token_hash AND t.revoked_at IS NULL
   AND u.id = t.user_id AND u.disabled_at IS NULL
RETURNING u.id, u.username, u.role;

-- name: upsert_user!
-- Declare an operator account with its role and password hash.
INSERT INTO users (username, password_hash, role) VALUES (:username, :password_hash, :role)
ON CONFLICT (username) DO UPDATE SET password_hash = excluded.password_hash, role = excluded.role;

-- name: create_api_token$
-- Store a new bearer token's sha256 for a user; the token itself is never stored.
INSERT INTO api_tokens (user_id, name, token_hash)
SELECT u.id, :name, :token_hash FROM users u WHERE u.username = :username
RETURNING id;

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

-- name: create_user$
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

-- name: set_user_role!
-- Change an account's role (the row is locked by lock_user in this transaction).
UPDATE users SET role = :role WHERE id = :user_id;

-- name: set_user_disabled$
-- Disable (now()) or enable (NULL) an account; returns the new disabled_at.
UPDATE users SET disabled_at = CASE WHEN :is_disabled THEN now() END WHERE id = :user_id
RETURNING disabled_at;

-- name: set_user_password!
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
