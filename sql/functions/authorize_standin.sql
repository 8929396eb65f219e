-- TEMPORARY STAND-IN, branch i17-accounts only: the lead deletes this file (and its entry in
-- sql/migrate.py FUNCTION_FILES) at the merge, where helper "roles" brings the real
-- pgd_authorize in sql/functions/audit.sql. Same signature; a simplified rule: a superuser
-- or a caller naming an actor is believed, any other login acts as itself and must be a
-- member of pgdispatch_<required>.
CREATE OR REPLACE FUNCTION pgd_authorize(p_actor text, p_required text) RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
    p_actor := nullif(btrim(p_actor), '');
    IF p_actor IS NOT NULL OR (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = session_user) THEN
        RETURN coalesce(p_actor, session_user);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles r WHERE r.rolname = 'pgdispatch_' || p_required
                                             AND pg_has_role(session_user, r.oid, 'MEMBER')) THEN
        RAISE EXCEPTION 'login % is not in pgdispatch_%: this needs an %', session_user,
            p_required, p_required USING ERRCODE = 'PD403';
    END IF;
    RETURN session_user;
END;
$$;
