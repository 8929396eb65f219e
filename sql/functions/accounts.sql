-- Console accounts and API tokens: every write, and every use of a secret, is one of these
-- functions, so the console's login never reads users.password_hash or api_tokens.token_hash
-- (sql/grants.sql grants it EXECUTE, and SELECT on neither column).
--
-- * Sign-in without reading the hash: pgd_sign_in_parameters gives the argon2 parameters and
--   salt of a username (for an unknown one, the newest account's parameters and a salt
--   derived from a secret only the database holds, the same on every ask: the answer does
--   not say who exists); the web computes the encoded argon2 hash of the typed password
--   with them, and pgd_sign_in compares it with the stored one (sha256 of both, so the
--   comparison's time says nothing of a prefix), counts the failure against the login limit
--   and audits, all in one transaction.
-- * The login limit: at most 10 failed sign-ins per username, and 10 per client address, in
--   any 60 seconds (sign_in_failures); a sign-in past it is refused before any comparison
--   and audited as sign_in_refused. An advisory lock per username and per address (taken in
--   that order) makes the count and the insert of concurrent sign-ins, from any worker or
--   host, one after the other.
-- * Sessions: users.session_generation is carried in the signed console session and checked
--   on every request (pgd_session_user); sign-out, a new password, disabling and a
--   demotion bump it, which ends every session of the user at its next request.
-- * Tokens: stored as sha256; an expiry (optional); disabling a user revokes its live tokens,
--   so enabling it again revives none.
--
-- Admin changes begin with `p_actor := pgd_authorize(p_actor, 'admin')` (who acts:
-- sql/functions/audit.sql) and are conditional on what the admin saw, as the operator actions
-- are (sql/functions/operator.sql): PD404 unknown, PD409 state, PD422 input, PDALR another
-- admin moved it first ("... (last change by bob at ...); reload and try again").

-- The login limit: failures counted per username and per client address within the window.
CREATE OR REPLACE FUNCTION pgd_sign_in_limit_reached(p_username text, p_address text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT (SELECT count(*) FROM sign_in_failures f
             WHERE f.username = p_username AND f.at > now() - interval '60 seconds') >= 10
        OR (p_address IS NOT NULL
            AND (SELECT count(*) FROM sign_in_failures f
                  WHERE f.address = p_address AND f.at > now() - interval '60 seconds') >= 10)
$$;

-- Who last changed an account, and when, for "already ... (last change by bob at ...)":
-- the account's own sign-ins and sign-outs are not changes.
CREATE OR REPLACE FUNCTION pgd_last_account_change(p_username text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT format('%s at %s', e.actor, pgd_utc_text(e.at))
                       FROM audit_events e
                      WHERE e.subject = 'user:' || p_username
                        AND e.action NOT IN ('sign_in', 'sign_in_failed', 'sign_in_refused',
                                             'sign_out', 'rehash_password')
                      ORDER BY e.id DESC LIMIT 1),
                    'another actor')
$$;

-- viewer < operator < admin, for "is this a demotion".
CREATE OR REPLACE FUNCTION pgd_role_rank(p_role text) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT array_position(ARRAY['viewer', 'operator', 'admin'], p_role)
$$;

-- The database's own secret for unknown usernames' salts, made on first use.
CREATE OR REPLACE FUNCTION pgd_sign_in_secret() RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_secret text;
BEGIN
    SELECT s.secret INTO v_secret FROM sign_in_secret s;
    IF v_secret IS NULL THEN
        INSERT INTO sign_in_secret (secret) VALUES (gen_random_uuid()::text || gen_random_uuid()::text)
        ON CONFLICT (id) DO NOTHING;
        SELECT s.secret INTO v_secret FROM sign_in_secret s;
    END IF;
    RETURN v_secret;
END;
$$;

-- Refuses what is not an encoded argon2 hash (a password in the clear, a truncated hash).
CREATE OR REPLACE FUNCTION pgd_check_password_hash(p_hash text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF p_hash IS NULL OR p_hash !~ '^\$argon2(id|i|d)\$v=19\$m=[0-9]+,t=[0-9]+,p=[0-9]+\$[A-Za-z0-9+/]{11,}\$[A-Za-z0-9+/]{16,}$' THEN
        RAISE EXCEPTION 'not an encoded argon2 password hash' USING ERRCODE = 'PD422';
    END IF;
END;
$$;

-- The argon2 parameters and salt to hash a typed password with, for a username; never the
-- hash. {type, version, memory_cost (KiB), time_cost, parallelism, salt (base64, no padding),
-- hash_len (bytes), is_limited (the login limit is reached: pgd_sign_in will refuse)}.
CREATE OR REPLACE FUNCTION pgd_sign_in_parameters(p_username text, p_address text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_hash   text;
    v_salt   bytea;
    v_params text;
BEGIN
    SELECT u.password_hash INTO v_hash FROM users u WHERE u.username = p_username;
    IF v_hash IS NULL THEN
        SELECT u.password_hash INTO v_hash FROM users u ORDER BY u.id DESC LIMIT 1;
        -- argon2-cffi's defaults (RFC 9106's second profile) when there is no account at all
        v_hash := coalesce(v_hash, '$argon2id$v=19$m=65536,t=3,p=4$AAAAAAAAAAAAAAAAAAAAAA$'
                                   || repeat('A', 43));
        v_salt := substring(sha256(convert_to(pgd_sign_in_secret() || ':' || coalesce(p_username, ''), 'UTF8'))
                            FROM 1 FOR least(32, length(split_part(v_hash, '$', 5)) * 3 / 4));
        v_hash := format('$%s$%s$%s$%s$%s', split_part(v_hash, '$', 2), split_part(v_hash, '$', 3),
                         split_part(v_hash, '$', 4), rtrim(encode(v_salt, 'base64'), '='),
                         split_part(v_hash, '$', 6));
    END IF;
    v_params := split_part(v_hash, '$', 4);
    RETURN jsonb_build_object(
        'type', split_part(v_hash, '$', 2),
        'version', substring(split_part(v_hash, '$', 3) FROM 'v=([0-9]+)')::int,
        'memory_cost', substring(v_params FROM 'm=([0-9]+)')::int,
        'time_cost', substring(v_params FROM 't=([0-9]+)')::int,
        'parallelism', substring(v_params FROM 'p=([0-9]+)')::int,
        'salt', split_part(v_hash, '$', 5),
        'hash_len', length(split_part(v_hash, '$', 6)) * 3 / 4,
        'is_limited', pgd_sign_in_limit_reached(p_username, p_address));
END;
$$;

-- Sign in: p_encoded_hash is the typed password hashed with pgd_sign_in_parameters' answer
-- (NULL: the caller did not hash it, the limit being reached). Returns {outcome: signed_in |
-- failed | limited} and, when signed in, user_id, username, role, session_generation.
-- Every outcome is audited (sign_in, sign_in_failed, sign_in_refused; actor: the username
-- tried; details: the client address).
CREATE OR REPLACE FUNCTION pgd_sign_in(p_username text, p_encoded_hash text, p_address text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v users%ROWTYPE;
    v_details jsonb := jsonb_build_object('address', p_address);
BEGIN
    IF p_username IS NULL OR p_username = '' OR length(p_username) > 63 THEN
        RAISE EXCEPTION 'a username of 1 to 63 characters is required' USING ERRCODE = 'PD422';
    END IF;
    -- one sign-in at a time per username, then per address (always this order: no deadlock),
    -- so that concurrent attempts cannot all count the same failures and all pass
    PERFORM pg_advisory_xact_lock(hashtext('pgd_sign_in:username'), hashtext(p_username));
    IF p_address IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtext('pgd_sign_in:address'), hashtext(p_address));
    END IF;
    -- statement_timestamp, not now(): a sign-in that waited on the locks counts from its turn
    DELETE FROM sign_in_failures f
     WHERE f.at < statement_timestamp() - interval '60 seconds'
       AND (f.username = p_username OR f.address = p_address);
    IF pgd_sign_in_limit_reached(p_username, p_address) THEN
        PERFORM pgd_audit(p_username, 'sign_in_refused', 'user:' || p_username,
                          'too many failed sign-ins; wait a minute', v_details);
        RETURN jsonb_build_object('outcome', 'limited');
    END IF;
    SELECT * INTO v FROM users u WHERE u.username = p_username;
    IF NOT FOUND OR v.disabled_at IS NOT NULL OR p_encoded_hash IS NULL
       OR sha256(convert_to(v.password_hash, 'UTF8')) <> sha256(convert_to(p_encoded_hash, 'UTF8')) THEN
        INSERT INTO sign_in_failures (username, address, at)
        VALUES (p_username, p_address, statement_timestamp());
        PERFORM pgd_audit(p_username, 'sign_in_failed', 'user:' || p_username, NULL, v_details);
        RETURN jsonb_build_object('outcome', 'failed');
    END IF;
    PERFORM pgd_audit(v.username, 'sign_in', 'user:' || v.username, NULL, v_details);
    RETURN jsonb_build_object('outcome', 'signed_in', 'user_id', v.id, 'username', v.username,
                              'role', v.role, 'session_generation', v.session_generation);
END;
$$;

-- The account a console session belongs to, if it is enabled and the session's generation
-- is still the account's (no sign-out, new password, disable or role change since).
CREATE OR REPLACE FUNCTION pgd_session_user(p_user_id bigint, p_session_generation bigint)
RETURNS TABLE (id bigint, username text, role text, session_generation bigint)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT u.id, u.username, u.role, u.session_generation
      FROM users u
     WHERE u.id = p_user_id AND u.session_generation = p_session_generation
       AND u.disabled_at IS NULL
$$;

-- Sign out: every session of the user ends (the generation moves on); audited. False when
-- the session had already ended (nothing written).
CREATE OR REPLACE FUNCTION pgd_sign_out(p_user_id bigint, p_session_generation bigint, p_address text)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_username text;
BEGIN
    UPDATE users u SET session_generation = u.session_generation + 1
     WHERE u.id = p_user_id AND u.session_generation = p_session_generation
    RETURNING u.username INTO v_username;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pgd_audit(v_username, 'sign_out', 'user:' || v_username, NULL,
                      jsonb_build_object('address', p_address));
    RETURN true;
END;
$$;

-- After a sign-in with a hash made under older argon2 parameters: store the same password
-- hashed under the current ones. Proof of the password is the old encoded hash itself
-- (what only the typed password gives); sessions go on. Audited. False when the stored hash
-- is no longer p_encoded_hash (changed meanwhile: nothing written).
CREATE OR REPLACE FUNCTION pgd_rehash_password(p_username text, p_encoded_hash text, p_new_hash text)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    PERFORM pgd_check_password_hash(p_new_hash);
    UPDATE users u SET password_hash = p_new_hash
     WHERE u.username = p_username AND u.disabled_at IS NULL
       AND sha256(convert_to(u.password_hash, 'UTF8')) = sha256(convert_to(p_encoded_hash, 'UTF8'));
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pgd_audit(p_username, 'rehash_password', 'user:' || p_username, NULL, '{}');
    RETURN true;
END;
$$;

-- Declare an account (config apply; the apply's own event audits it). p_candidate_hash: the
-- declared password hashed with the account's sign-in parameters, to tell whether it is
-- still the stored one without reading the hash out. Returns unchanged, updated (role),
-- changed (password set or account created: p_new_hash stored), or needs_hash (the
-- password differs and p_new_hash is NULL: nothing written; call again with one).
CREATE OR REPLACE FUNCTION pgd_declare_user(p_username text, p_role text, p_candidate_hash text,
                                            p_new_hash text)
RETURNS text LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v users%ROWTYPE;
BEGIN
    PERFORM pgd_authorize(NULL, 'admin');
    IF p_role IS NULL OR p_role NOT IN ('viewer', 'operator', 'admin') THEN
        RAISE EXCEPTION 'role must be one of viewer, operator, admin, got %', p_role USING ERRCODE = 'PD422';
    END IF;
    SELECT * INTO v FROM users u WHERE u.username = p_username FOR UPDATE;
    IF FOUND AND p_candidate_hash IS NOT NULL
       AND sha256(convert_to(v.password_hash, 'UTF8')) = sha256(convert_to(p_candidate_hash, 'UTF8')) THEN
        IF v.role = p_role THEN
            RETURN 'unchanged';
        END IF;
        UPDATE users u SET role = p_role,
                           session_generation = u.session_generation
                                                + CASE WHEN pgd_role_rank(p_role) < pgd_role_rank(v.role) THEN 1 ELSE 0 END
         WHERE u.id = v.id;
        RETURN 'updated';
    END IF;
    IF p_new_hash IS NULL THEN
        RETURN 'needs_hash';
    END IF;
    PERFORM pgd_check_password_hash(p_new_hash);
    INSERT INTO users AS u (username, password_hash, role) VALUES (p_username, p_new_hash, p_role)
    ON CONFLICT (username) DO UPDATE
       SET password_hash = excluded.password_hash, role = excluded.role,
           session_generation = u.session_generation + 1;
    RETURN 'changed';
END;
$$;

-- An admin creates an account with a password they chose (p_password_hash: argon2, encoded).
CREATE OR REPLACE FUNCTION pgd_create_user(p_username text, p_password_hash text, p_role text,
                                           p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_id bigint;
BEGIN
    p_actor := pgd_authorize(p_actor, 'admin');
    IF p_role IS NULL OR p_role NOT IN ('viewer', 'operator', 'admin') THEN
        RAISE EXCEPTION 'role must be one of viewer, operator, admin' USING ERRCODE = 'PD422';
    END IF;
    PERFORM pgd_check_password_hash(p_password_hash);
    INSERT INTO users (username, password_hash, role) VALUES (p_username, p_password_hash, p_role)
    ON CONFLICT (username) DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        RAISE EXCEPTION 'user % already exists', p_username USING ERRCODE = 'PD409';
    END IF;
    PERFORM pgd_audit(p_actor, 'create_user', 'user:' || p_username, p_reason,
                      jsonb_build_object('role', p_role));
    RETURN jsonb_build_object('user_id', v_id, 'username', p_username, 'role', p_role);
END;
$$;

-- Lock every active admin's row in id order, before the account's own row: the one order
-- every change that can remove an admin takes, so two admins demoting or disabling each
-- other at once cannot deadlock, and the second sees the first's result before its "last
-- admin" check (Read Committed: the caller's next statement sees what the first committed).
-- True when p_username is the only active admin.
CREATE OR REPLACE FUNCTION pgd_lock_active_admins(p_username text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_admins text[];
BEGIN
    SELECT array_agg(a.username ORDER BY a.id) INTO v_admins
      FROM (SELECT u.id, u.username FROM users u
             WHERE u.role = 'admin' AND u.disabled_at IS NULL ORDER BY u.id FOR UPDATE) a;
    RETURN coalesce(v_admins = ARRAY[p_username], false);
END;
$$;

-- Change a role, if it is still p_expected_role; a demotion ends the user's sessions.
-- Refuses an admin demoting themself and the last active admin.
CREATE OR REPLACE FUNCTION pgd_set_user_role(p_username text, p_role text, p_expected_role text,
                                             p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v users%ROWTYPE;
    v_last boolean;
BEGIN
    p_actor := pgd_authorize(p_actor, 'admin');
    IF p_role IS NULL OR p_role NOT IN ('viewer', 'operator', 'admin')
       OR p_expected_role IS NULL OR p_expected_role NOT IN ('viewer', 'operator', 'admin') THEN
        RAISE EXCEPTION 'role must be one of viewer, operator, admin' USING ERRCODE = 'PD422';
    END IF;
    v_last := pgd_lock_active_admins(p_username);
    SELECT * INTO v FROM users u WHERE u.username = p_username FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown user %', p_username USING ERRCODE = 'PD404';
    END IF;
    IF v.role <> p_expected_role THEN
        RAISE EXCEPTION '% is already % (last change by %); reload and try again', p_username,
            v.role, pgd_last_account_change(p_username) USING ERRCODE = 'PDALR';
    END IF;
    IF v.role = p_role THEN
        RAISE EXCEPTION '% is already %', p_username, p_role USING ERRCODE = 'PD409';
    END IF;
    IF v.role = 'admin' THEN
        IF p_username = p_actor THEN
            RAISE EXCEPTION 'you cannot demote yourself; ask another admin' USING ERRCODE = 'PD422';
        END IF;
        IF v.disabled_at IS NULL AND v_last THEN
            RAISE EXCEPTION '% is the last active admin; make another admin first', p_username
                USING ERRCODE = 'PD409';
        END IF;
    END IF;
    -- a demotion ends the user's sessions (a page open with the old role's buttons must
    -- not keep them); a promotion takes effect at the next request, sessions go on
    UPDATE users u SET role = p_role,
                       session_generation = u.session_generation
                                            + CASE WHEN pgd_role_rank(p_role) < pgd_role_rank(v.role) THEN 1 ELSE 0 END
     WHERE u.id = v.id;
    PERFORM pgd_audit(p_actor, 'set_user_role', 'user:' || p_username, p_reason,
                      jsonb_build_object('from', v.role, 'to', p_role));
    RETURN jsonb_build_object('username', p_username, 'role', p_role);
END;
$$;

-- Disable an active account (its sessions end, its live tokens are revoked: enabling it
-- again revives none) or enable a disabled one. Refuses an admin disabling themself and the
-- last active admin.
CREATE OR REPLACE FUNCTION pgd_set_user_disabled(p_username text, p_is_disabled boolean,
                                                 p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v users%ROWTYPE;
    v_last boolean;
    v_revoked bigint[];
BEGIN
    p_actor := pgd_authorize(p_actor, 'admin');
    IF p_is_disabled IS NULL THEN
        RAISE EXCEPTION 'disable or enable?' USING ERRCODE = 'PD422';
    END IF;
    v_last := pgd_lock_active_admins(p_username);
    SELECT * INTO v FROM users u WHERE u.username = p_username FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown user %', p_username USING ERRCODE = 'PD404';
    END IF;
    IF (v.disabled_at IS NOT NULL) = p_is_disabled THEN
        RAISE EXCEPTION '% is already % (last change by %); reload and try again', p_username,
            CASE WHEN p_is_disabled THEN 'disabled' ELSE 'enabled' END,
            pgd_last_account_change(p_username) USING ERRCODE = 'PDALR';
    END IF;
    IF p_is_disabled THEN
        IF p_username = p_actor THEN
            RAISE EXCEPTION 'you cannot disable your own account' USING ERRCODE = 'PD422';
        END IF;
        IF v.role = 'admin' AND v_last THEN
            RAISE EXCEPTION '% is the last active admin; make another admin first', p_username
                USING ERRCODE = 'PD409';
        END IF;
        UPDATE users u SET disabled_at = now(), session_generation = u.session_generation + 1
         WHERE u.id = v.id RETURNING * INTO v;
        WITH revoked AS (
            UPDATE api_tokens t SET revoked_at = now()
             WHERE t.user_id = v.id AND t.revoked_at IS NULL
            RETURNING t.id)
        SELECT coalesce(array_agg(r.id ORDER BY r.id), '{}') INTO v_revoked FROM revoked r;
        PERFORM pgd_audit(p_actor, 'disable_user', 'user:' || p_username, p_reason,
                          jsonb_build_object('revoked_token_ids', to_jsonb(v_revoked)));
    ELSE
        UPDATE users u SET disabled_at = NULL WHERE u.id = v.id RETURNING * INTO v;
        PERFORM pgd_audit(p_actor, 'enable_user', 'user:' || p_username, p_reason, '{}');
    END IF;
    RETURN jsonb_build_object('username', p_username, 'disabled_at', v.disabled_at,
                              'revoked_token_ids', to_jsonb(coalesce(v_revoked, '{}')));
END;
$$;

-- An admin sets an account's password (p_password_hash: argon2, encoded); its sessions end.
-- Audited without the hash.
CREATE OR REPLACE FUNCTION pgd_set_user_password(p_username text, p_password_hash text,
                                                 p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    p_actor := pgd_authorize(p_actor, 'admin');
    PERFORM pgd_check_password_hash(p_password_hash);
    UPDATE users u SET password_hash = p_password_hash, session_generation = u.session_generation + 1
     WHERE u.username = p_username;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown user %', p_username USING ERRCODE = 'PD404';
    END IF;
    PERFORM pgd_audit(p_actor, 'set_user_password', 'user:' || p_username, p_reason, '{}');
    RETURN jsonb_build_object('username', p_username);
END;
$$;

-- An admin creates a bearer token for an enabled account: only its sha256 (hex) is stored;
-- p_expires_at NULL: until revoked. Audited with its id, label and expiry.
CREATE OR REPLACE FUNCTION pgd_create_api_token(p_username text, p_name text, p_token_hash text,
                                                p_expires_at timestamptz, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v users%ROWTYPE;
    v_id bigint;
BEGIN
    p_actor := pgd_authorize(p_actor, 'admin');
    IF p_token_hash IS NULL OR p_token_hash !~ '^[0-9a-f]{64}$' THEN
        RAISE EXCEPTION 'a token is stored as its sha256, in hex' USING ERRCODE = 'PD422';
    END IF;
    IF p_name IS NULL OR btrim(p_name) = '' OR length(p_name) > 100 THEN
        RAISE EXCEPTION 'a token name of 1 to 100 characters is required' USING ERRCODE = 'PD422';
    END IF;
    IF p_expires_at IS NOT NULL AND p_expires_at <= now() THEN
        RAISE EXCEPTION 'the expiry % is not in the future', pgd_utc_text(p_expires_at)
            USING ERRCODE = 'PD422';
    END IF;
    SELECT * INTO v FROM users u WHERE u.username = p_username FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown user %', p_username USING ERRCODE = 'PD404';
    END IF;
    IF v.disabled_at IS NOT NULL THEN
        RAISE EXCEPTION '% is disabled; enable the account first', p_username USING ERRCODE = 'PD409';
    END IF;
    INSERT INTO api_tokens (user_id, name, token_hash, expires_at)
    VALUES (v.id, p_name, p_token_hash, p_expires_at)
    RETURNING id INTO v_id;
    PERFORM pgd_audit(p_actor, 'create_api_token', 'user:' || p_username, p_reason,
                      jsonb_build_object('token_id', v_id, 'name', p_name, 'expires_at', p_expires_at));
    RETURN jsonb_build_object('token_id', v_id, 'username', p_username, 'name', p_name,
                              'expires_at', p_expires_at);
END;
$$;

-- An admin revokes a token: from the next request on it authenticates nothing. Audited.
CREATE OR REPLACE FUNCTION pgd_revoke_api_token(p_token_id bigint, p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_name text;
    v_revoked_at timestamptz;
    v_username text;
BEGIN
    p_actor := pgd_authorize(p_actor, 'admin');
    SELECT t.name, t.revoked_at, u.username INTO v_name, v_revoked_at, v_username
      FROM api_tokens t JOIN users u ON u.id = t.user_id
     WHERE t.id = p_token_id
       FOR UPDATE OF t;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown token %', p_token_id USING ERRCODE = 'PD404';
    END IF;
    IF v_revoked_at IS NOT NULL THEN
        RAISE EXCEPTION 'token % of % is already revoked (last change by %); reload and try again',
            v_name, v_username, pgd_last_account_change(v_username) USING ERRCODE = 'PDALR';
    END IF;
    UPDATE api_tokens t SET revoked_at = now() WHERE t.id = p_token_id RETURNING t.revoked_at INTO v_revoked_at;
    PERFORM pgd_audit(p_actor, 'revoke_api_token', 'user:' || v_username, p_reason,
                      jsonb_build_object('token_id', p_token_id, 'name', v_name));
    RETURN jsonb_build_object('token_id', p_token_id, 'username', v_username, 'revoked_at', v_revoked_at);
END;
$$;

-- The enabled account behind a bearer token's sha256, if the token is neither revoked nor
-- expired; marks it used now. No row: the token authenticates nothing.
CREATE OR REPLACE FUNCTION pgd_authenticate_token(p_token_hash text)
RETURNS TABLE (id bigint, username text, role text)
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    UPDATE api_tokens t SET last_used_at = now()
      FROM users u
     WHERE t.token_hash = p_token_hash AND t.revoked_at IS NULL
       AND (t.expires_at IS NULL OR t.expires_at > now())
       AND u.id = t.user_id AND u.disabled_at IS NULL
    RETURNING u.id, u.username, u.role
$$;
