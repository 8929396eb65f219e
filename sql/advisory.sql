-- pgdispatch's transitions serialise some steps with advisory locks (a project's claims, a
-- claim token's tombstone, a username's sign-in limit, an upgrade: sql/functions/*.sql,
-- sql/migrate.py). PostgreSQL lets every role take any advisory lock, so a runner host or a
-- dashboard's login could hold one of those keys and stall other people's claims, pauses or
-- sign-ins. In this database only the owner (inside the transitions) and the migrator (an
-- upgrade's lock, taken before it becomes the owner) may. The functions belong to the
-- bootstrap superuser: this file needs a superuser, and `db upgrade` and `db roles` run it when
-- their login is one (docs/operations.md, "Database roles", for a managed server).
REVOKE EXECUTE ON FUNCTION
    pg_advisory_lock(bigint), pg_advisory_lock(integer, integer),
    pg_advisory_lock_shared(bigint), pg_advisory_lock_shared(integer, integer),
    pg_try_advisory_lock(bigint), pg_try_advisory_lock(integer, integer),
    pg_try_advisory_lock_shared(bigint), pg_try_advisory_lock_shared(integer, integer),
    pg_advisory_xact_lock(bigint), pg_advisory_xact_lock(integer, integer),
    pg_advisory_xact_lock_shared(bigint), pg_advisory_xact_lock_shared(integer, integer),
    pg_try_advisory_xact_lock(bigint), pg_try_advisory_xact_lock(integer, integer),
    pg_try_advisory_xact_lock_shared(bigint), pg_try_advisory_xact_lock_shared(integer, integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    pg_advisory_lock(bigint), pg_advisory_lock(integer, integer),
    pg_advisory_lock_shared(bigint), pg_advisory_lock_shared(integer, integer),
    pg_try_advisory_lock(bigint), pg_try_advisory_lock(integer, integer),
    pg_try_advisory_lock_shared(bigint), pg_try_advisory_lock_shared(integer, integer),
    pg_advisory_xact_lock(bigint), pg_advisory_xact_lock(integer, integer),
    pg_advisory_xact_lock_shared(bigint), pg_advisory_xact_lock_shared(integer, integer),
    pg_try_advisory_xact_lock(bigint), pg_try_advisory_xact_lock(integer, integer),
    pg_try_advisory_xact_lock_shared(bigint), pg_try_advisory_xact_lock_shared(integer, integer)
    TO pgdispatch_owner, pgdispatch_migrator;
