-- Operator accounts and API tokens (sql/accounts.py). Every write, and every use of a
-- password or token hash, is a function in sql/functions/accounts.sql; what is left here are
-- calls of those and the admin area's plain reads, which never name a hash column.

-- name: sign_in_parameters$
-- The argon2 parameters and salt for a username (never the hash) and whether the login limit is reached.
SELECT pgd_sign_in_parameters(:username, :address);

-- name: sign_in$
-- Compare the typed password's hash with the stored one, count a failure against the login limit, audit.
SELECT pgd_sign_in(:username, :encoded_hash, :address);

-- name: session_user^
-- The enabled account of a console session whose generation is still current. Read-only.
SELECT id, username, role, session_generation FROM pgd_session_user(:user_id, :session_generation);

-- name: sign_out$
-- End every session of the user (its session generation moves on); audited.
SELECT pgd_sign_out(:user_id, :session_generation, :address);

-- name: rehash_password$
-- Store the same password under the current argon2 parameters, proven by its old hash.
SELECT pgd_rehash_password(:username, :encoded_hash, :new_hash);

-- name: authenticate_token^
-- The enabled account behind a live, unexpired bearer token's sha256; marks the token used.
SELECT id, username, role FROM pgd_authenticate_token(:token_hash);

-- name: declare_user$
-- Declare an account from an apply file (unchanged, updated, changed or needs_hash).
SELECT pgd_declare_user(:username, :role, :candidate_hash, :new_hash);

-- name: acting_login$
-- Who the database says acts for this connection when no actor is named (pgd_authorize).
SELECT pgd_authorize(NULL, :required);

-- name: list_users
-- Every account with its role, state and how many live API tokens it has. Read-only.
SELECT u.id, u.username, u.role, u.created_at, u.disabled_at,
       (SELECT count(*) FROM api_tokens t
         WHERE t.user_id = u.id AND t.revoked_at IS NULL
           AND (t.expires_at IS NULL OR t.expires_at > now())) AS live_tokens
  FROM users u
 ORDER BY u.username;

-- name: list_api_tokens
-- Every API token's label, use and expiry (never its hash), live ones first, newest first. Read-only.
SELECT t.id, u.username, t.name, t.created_at, t.last_used_at, t.revoked_at, t.expires_at,
       (t.revoked_at IS NULL AND (t.expires_at IS NULL OR t.expires_at > now())) AS is_live
  FROM api_tokens t JOIN users u ON u.id = t.user_id
 ORDER BY t.revoked_at IS NOT NULL, t.id DESC;

-- name: create_user$
-- Create an account (audited); PD409 when the username is taken.
SELECT pgd_create_user(:username, :password_hash, :role, :reason, :actor);

-- name: set_user_role$
-- Change a role if it is still the one the admin saw; the user's sessions end. Audited.
SELECT pgd_set_user_role(:username, :role, :expected_role, :reason, :actor);

-- name: set_user_disabled$
-- Disable (sessions end, live tokens revoked) or enable an account. Audited.
SELECT pgd_set_user_disabled(:username, :is_disabled, :reason, :actor);

-- name: set_user_password$
-- Store a new argon2 hash for an account; its sessions end. Audited without the hash.
SELECT pgd_set_user_password(:username, :password_hash, :reason, :actor);

-- name: create_api_token$
-- Store a new bearer token's sha256 for an enabled account, with an optional expiry. Audited.
SELECT pgd_create_api_token(:username, :name, :token_hash, :expires_at, :reason, :actor);

-- name: revoke_api_token$
-- Revoke a token now; from the next request on it authenticates nothing. Audited.
SELECT pgd_revoke_api_token(:token_id, :reason, :actor);
