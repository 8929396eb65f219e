-- Make pgdispatch_owner (sql/roles.sql) own every table, view, sequence, type and function
-- of the schema that another role owns: a database upgraded before the roles existed, or
-- an object made by hand. Run by `pgdispatch db roles` and by `db upgrade` before it
-- becomes the owner (sql/migrate.py), as a login that owns them or a superuser; the
-- owner, which never logs in, is then the only role that may alter a table or its
-- triggers (the audit log's immutability: sql/functions/audit.sql).
DO $$
DECLARE
    v record;
BEGIN
    -- The owner creates the tables of new migrations; since PostgreSQL 15 only the
    -- database's owner may create in schema public unless granted. Granted by the login
    -- that owns the database (the managed set-up: CREATE DATABASE ... OWNER) or a superuser.
    IF NOT has_schema_privilege('pgdispatch_owner', 'public', 'CREATE') THEN
        GRANT USAGE, CREATE ON SCHEMA public TO pgdispatch_owner;
    END IF;
    -- Creating a trusted extension (pg_trgm: sql/schema.sql) and its schema needs CREATE on
    -- the database. Granted by the same logins, when one runs this; a migrator that is
    -- neither finds it granted by the first upgrade (or, on a database set up before, is told
    -- by the migration's CREATE EXTENSION what is missing).
    IF NOT has_database_privilege('pgdispatch_owner', current_database(), 'CREATE')
       AND EXISTS (SELECT 1 FROM pg_database d, pg_roles r
                    WHERE d.datname = current_database() AND r.rolname = current_user
                      AND (r.rolsuper OR pg_has_role(current_user, d.datdba, 'MEMBER'))) THEN
        EXECUTE format('GRANT CREATE ON DATABASE %I TO pgdispatch_owner', current_database());
    END IF;
    FOR v IN
        SELECT format('ALTER %s %s OWNER TO pgdispatch_owner',
                      CASE c.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                                     WHEN 'm' THEN 'MATERIALIZED VIEW' WHEN 'c' THEN 'TYPE'
                                     ELSE 'TABLE' END,
                      c.oid::regclass) AS stmt
          FROM pg_class c
         WHERE c.relnamespace = 'public'::regnamespace
           AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S', 'c')
           AND c.relowner <> 'pgdispatch_owner'::regrole
           -- an identity or serial sequence follows its table
           AND NOT (c.relkind = 'S' AND EXISTS (SELECT 1 FROM pg_depend d
                                                 WHERE d.classid = 'pg_class'::regclass
                                                   AND d.objid = c.oid AND d.deptype IN ('a', 'i')))
        UNION ALL
        SELECT format('ALTER ROUTINE %s OWNER TO pgdispatch_owner', p.oid::regprocedure)
          FROM pg_proc p
         WHERE p.pronamespace = 'public'::regnamespace AND p.proowner <> 'pgdispatch_owner'::regrole
        UNION ALL
        SELECT format('ALTER TYPE %s OWNER TO pgdispatch_owner', t.oid::regtype)
          FROM pg_type t
         WHERE t.typnamespace = 'public'::regnamespace AND t.typtype IN ('e', 'd', 'r')
           AND t.typowner <> 'pgdispatch_owner'::regrole
    LOOP
        EXECUTE v.stmt;
    END LOOP;
END;
$$;
