-- 0004_sessions_and_tokens: console sessions that end server-side (a per-user session
-- generation), API tokens that expire, and the login limit kept in the database.
-- Do not edit: the current schema is sql/schema.sql; the functions are in
-- sql/functions/accounts.sql, the operator's view in docs/operations.md, "Console sign-in,
-- sessions and tokens".

ALTER TABLE users ADD COLUMN session_generation bigint NOT NULL DEFAULT 1;

ALTER TABLE api_tokens ADD COLUMN expires_at timestamptz;
CREATE INDEX api_tokens_user_idx ON api_tokens (user_id) WHERE revoked_at IS NULL;

CREATE TABLE sign_in_failures (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    username text NOT NULL,
    address  text,
    at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX sign_in_failures_username_idx ON sign_in_failures (username, at);
CREATE INDEX sign_in_failures_address_idx ON sign_in_failures (address, at);

CREATE TABLE sign_in_secret (
    id     boolean PRIMARY KEY DEFAULT true CHECK (id),
    secret text NOT NULL
);
