-- pgdispatch's transitions serialise some steps with advisory locks (a project's claims, a
-- claim token's tombstone, a username's sign-in limit, an upgrade: sql/functions/*.sql,
-- sql/migrate.py). PostgreSQL lets every role take any advisory lock, so a runner host or a
-- dashboard's login could hold one of those keys and stall other people's claims, pauses or
-- sign-ins. In this database only the owner (inside the transitions) and the migrator (an
-- upgrade's lock, taken before it becomes the owner) may. The functions belong to the
-- bootstrap superuser: this file needs a superuser, and `db upgrade` and `db roles` run it when
-- their login is one (docs/operations.md, "Database roles", for a managed server).
DO $$
DECLARE
    f regprocedure;
BEGIN
    -- every lock-taking form (session and transaction, exclusive and shared, blocking and
    -- try); the unlock functions stay PUBLIC's: they release only the caller's own locks
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
              WHERE p.pronamespace = 'pg_catalog'::regnamespace
                AND p.proname ~ '^pg_(try_)?advisory_(xact_)?lock(_shared)?$'
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO pgdispatch_owner, pgdispatch_migrator', f);
    END LOOP;
END
$$;
