-- The database's health as the console's Database page and /metrics show it (sql/health.py,
-- docs/operations.md, "The database's health"): who holds back the xmin horizon, the one
-- thing that makes a queue's dead rows pile up faster than vacuum can remove them.
--
-- Another role's backend_xmin, backend_xid, xact_start, state and client_addr in
-- pg_stat_activity are NULL unless the reader has the privileges of pg_read_all_stats
-- (PostgreSQL's predefined role). The console's logins are not given it: it would also show
-- them every other session's query text. Instead the owner holds it (sql/roles.sql, when the
-- login running that file may grant it) and these definer functions return only the columns
-- the page needs, never a query.

-- The sessions, prepared transactions and replication slots that hold the xmin horizon back,
-- oldest xmin first, at most p_limit rows; the calling session itself is left out. Sessions
-- and prepared transactions of this database only (vacuum of this database's tables ignores
-- other databases' snapshots), sessions of no database too (a walsender's hot standby
-- feedback holds every database), and every slot (a slot's xmin holds the whole cluster).
-- Ages: xact_age_seconds by the statement's clock (a slot has none), xmin_age in
-- transactions (age() of the older of the xid and the snapshot's xmin). Read-only.
CREATE OR REPLACE FUNCTION pgd_read_horizon_holders(p_limit integer DEFAULT 20)
RETURNS TABLE (kind text, pid integer, name text, usename text, application_name text,
               client_addr text, state text, backend_type text, xact_age_seconds float8,
               xmin_age integer, is_active boolean)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT * FROM (
        SELECT 'session'::text, a.pid, NULL::text, a.usename::text, a.application_name,
               host(a.client_addr), a.state, a.backend_type,
               extract(epoch FROM statement_timestamp() - a.xact_start)::float8,
               greatest(age(a.backend_xmin), age(a.backend_xid)), true
          FROM pg_stat_activity a
         WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
           AND a.pid <> pg_backend_pid()
           AND (a.datid IS NULL OR a.datid = (SELECT oid FROM pg_database
                                               WHERE datname = current_database()))
        UNION ALL
        SELECT 'prepared', NULL, p.gid, p.owner::text, NULL, NULL, 'prepared', NULL,
               extract(epoch FROM statement_timestamp() - p.prepared)::float8,
               age(p.transaction), false
          FROM pg_prepared_xacts p
         WHERE p.database = current_database()
        UNION ALL
        SELECT 'slot', s.active_pid, s.slot_name::text, NULL, NULL, NULL,
               CASE WHEN s.active THEN 'active' ELSE 'inactive' END, s.slot_type, NULL,
               greatest(age(s.xmin), age(s.catalog_xmin)), s.active
          FROM pg_replication_slots s
         WHERE s.xmin IS NOT NULL OR s.catalog_xmin IS NOT NULL
    ) h (kind, pid, name, usename, application_name, client_addr, state, backend_type,
         xact_age_seconds, xmin_age, is_active)
     ORDER BY h.xmin_age DESC NULLS LAST, h.xact_age_seconds DESC NULLS LAST
     LIMIT p_limit;
$$;

-- Whether pgd_read_horizon_holders sees other roles' sessions: its owner has the privileges
-- of pg_read_all_stats. False: the page says so and names the one GRANT that fixes it.
CREATE OR REPLACE FUNCTION pgd_reads_all_stats()
RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT pg_has_role(current_user, 'pg_read_all_stats', 'USAGE');
$$;
