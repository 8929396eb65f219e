-- The audit log: every operator action, and what the system does on an operator's behalf
-- (a late report that frees an uncertain target, a submit), written by the transitions in
-- the transaction that makes the change. Audit events and delivery receipts are
-- append-only: the triggers below refuse UPDATE, DELETE and TRUNCATE (SQLSTATE PDIMM), and
-- only their owner, pgdispatch_owner, may alter or disable them: a role nobody logs in as
-- (sql/roles.sql). Each event records the database login that made it (audit_events.login,
-- session_user) beside the actor the transition authorized (pgd_authorize).
-- Tables: sql/schema.sql (audit_events, delivery_receipts).

-- Refuses the change: the rows of the table it guards are immutable.
CREATE OR REPLACE FUNCTION pgd_forbid_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% rows are immutable', TG_TABLE_NAME USING ERRCODE = 'PDIMM';
END;
$$;

CREATE OR REPLACE TRIGGER delivery_receipts_immutable BEFORE UPDATE OR DELETE ON delivery_receipts
    FOR EACH ROW EXECUTE FUNCTION pgd_forbid_change();

CREATE OR REPLACE TRIGGER delivery_receipts_no_truncate BEFORE TRUNCATE ON delivery_receipts
    FOR EACH STATEMENT EXECUTE FUNCTION pgd_forbid_change();

CREATE OR REPLACE TRIGGER audit_events_immutable BEFORE UPDATE OR DELETE ON audit_events
    FOR EACH ROW EXECUTE FUNCTION pgd_forbid_change();

CREATE OR REPLACE TRIGGER audit_events_no_truncate BEFORE TRUNCATE ON audit_events
    FOR EACH STATEMENT EXECUTE FUNCTION pgd_forbid_change();

-- Record one audit event; returns its id. p_actor is the authenticated identity.
CREATE OR REPLACE FUNCTION pgd_audit(p_actor text, p_action text, p_subject text, p_reason text,
                                     p_details jsonb DEFAULT '{}')
RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO audit_events (actor, action, subject, reason, details)
    VALUES (p_actor, p_action, p_subject, p_reason, coalesce(p_details, '{}'))
    RETURNING id
$$;

-- The last audit event about a subject, for "already resolved by alice at 14:02".
CREATE OR REPLACE FUNCTION pgd_last_actor(p_subject text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT format('%s at %s', actor, to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                       FROM audit_events WHERE subject = p_subject ORDER BY id DESC LIMIT 1),
                    'another actor')
$$;

-- Who acts, for an operator or admin transition: its first statement is
-- `p_actor := pgd_authorize(p_actor, 'operator' | 'admin')`. The database login decides
-- (session_user: the login, whatever role a SECURITY DEFINER function runs as):
-- * a login in pgdispatch_web (the console) authenticated its user itself, so the actor it
--   names is believed, but checked: an enabled user whose role allows the action;
-- * a superuser, who can write the audit log directly anyway, is believed too (the tests,
--   and an operator at a psql prompt); without an actor it acts as itself;
-- * any other login (a person's CLI login, a migrator) acts as itself: the actor is
--   session_user, p_actor must be NULL or the same, and the login must be a member of the
--   group role the action needs (pgdispatch_operator, pgdispatch_admin) or of the owner.
-- Returns the actor to record. Raises PD403 when the login may not act, PD422 for an
-- unknown p_required.
CREATE OR REPLACE FUNCTION pgd_authorize(p_actor text, p_required text) RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_login text := session_user;
    v_role  text;
BEGIN
    IF p_required IS NULL OR p_required NOT IN ('operator', 'admin') THEN
        RAISE EXCEPTION 'unknown required role %', p_required USING ERRCODE = 'PD422';
    END IF;
    p_actor := nullif(btrim(p_actor), '');
    IF (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = v_login) THEN
        RETURN coalesce(p_actor, v_login);
    END IF;
    IF pg_has_role(v_login, 'pgdispatch_web', 'MEMBER') THEN
        IF p_actor IS NULL THEN
            RAISE EXCEPTION 'the console must name the user who acts' USING ERRCODE = 'PD403';
        END IF;
        SELECT u.role INTO v_role FROM users u WHERE u.username = p_actor AND u.disabled_at IS NULL;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'user % is unknown or disabled and may not act', p_actor
                USING ERRCODE = 'PD403';
        END IF;
        IF v_role <> 'admin' AND (p_required = 'admin' OR v_role <> 'operator') THEN
            RAISE EXCEPTION 'user % is a %: this needs an %', p_actor, v_role, p_required
                USING ERRCODE = 'PD403';
        END IF;
        RETURN p_actor;
    END IF;
    IF p_actor IS NOT NULL AND p_actor <> v_login THEN
        RAISE EXCEPTION 'login % cannot act as %: its actions are its own', v_login, p_actor
            USING ERRCODE = 'PD403';
    END IF;
    IF NOT (pg_has_role(v_login, 'pgdispatch_' || p_required, 'MEMBER')
            OR pg_has_role(v_login, 'pgdispatch_owner', 'MEMBER')) THEN
        RAISE EXCEPTION 'login % is not in pgdispatch_%: this needs an %', v_login, p_required,
            p_required USING ERRCODE = 'PD403';
    END IF;
    RETURN v_login;
END;
$$;
