-- The group roles of pgdispatch (docs/operations.md, "Database roles"). Roles are
-- cluster-wide: every database of the server that pgdispatch uses shares them. Idempotent:
-- each role is created only when missing, and a membership granted again is a notice, not
-- an error. Run by `pgdispatch db roles` and by the first `db upgrade` of a login that may
-- create roles (sql/migrate.py); needs CREATEROLE (or superuser). No role here may log in:
-- logins are made members of them (`pgdispatch db login`). What each may do: sql/grants.sql.
DO $$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['pgdispatch_owner', 'pgdispatch_migrator', 'pgdispatch_scheduler',
                                  'pgdispatch_web', 'pgdispatch_reader', 'pgdispatch_operator',
                                  'pgdispatch_admin'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = v_role) THEN
            -- a concurrent `db roles` on another database may create it first
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', v_role);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;
            END;
        END IF;
    END LOOP;
    -- The owner owns the schema's objects and nothing else: it never logs in, so that no
    -- session can ALTER or DISABLE the audit log's triggers except through a migration.
    ALTER ROLE pgdispatch_owner NOLOGIN;
    -- A migrator may become the owner (SET ROLE), which `db upgrade` and `apply` do.
    IF NOT pg_has_role('pgdispatch_migrator', 'pgdispatch_owner', 'MEMBER') THEN
        GRANT pgdispatch_owner TO pgdispatch_migrator;
    END IF;
    -- A person's CLI login reads what a dashboard reads.
    IF NOT pg_has_role('pgdispatch_operator', 'pgdispatch_reader', 'MEMBER') THEN
        GRANT pgdispatch_reader TO pgdispatch_operator;
    END IF;
    -- An admin may do all an operator may.
    IF NOT pg_has_role('pgdispatch_admin', 'pgdispatch_operator', 'MEMBER') THEN
        GRANT pgdispatch_operator TO pgdispatch_admin;
    END IF;
    -- The owner reads other sessions' xmin horizons for the console's Database page, through
    -- definer functions that return no query text (sql/functions/health.sql). Granting a
    -- predefined role needs a superuser or ADMIN OPTION on it, which a managed server's
    -- CREATEROLE login usually lacks: then its operator runs the GRANT below once
    -- (docs/operations.md, "The database's health"), and the page says it is missing.
    IF NOT pg_has_role('pgdispatch_owner', 'pg_read_all_stats', 'USAGE') THEN
        IF (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
           OR pg_has_role(current_user, 'pg_read_all_stats', 'USAGE WITH ADMIN OPTION') THEN
            GRANT pg_read_all_stats TO pgdispatch_owner WITH INHERIT TRUE;
        ELSE
            RAISE NOTICE 'pgdispatch_owner lacks pg_read_all_stats: run GRANT pg_read_all_stats TO pgdispatch_owner as a superuser';
        END IF;
    END IF;
END;
$$;
