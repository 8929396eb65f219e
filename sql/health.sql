-- name: read_table_health
-- Vacuum's view of the hot tables (the queue's churn: claims, completions, receipts, the
-- capacity stripes, the audit log): live and dead tuples, the last (auto)vacuum and
-- (auto)analyze, and their sizes in bytes. Takes no lock on any table: a page or a scrape
-- never waits behind a VACUUM FULL or an ALTER TABLE (pg_total_relation_size and its kin
-- take an AccessShareLock each), so the sizes are the catalog's page counts (pg_class.relpages
-- of the table, its TOAST table and its indexes, times the block size), as of the last
-- VACUUM, ANALYZE or CREATE INDEX of each; the tuple counters lag a live transaction by up
-- to a second (statistics are flushed at transaction end). Read-only.
SELECT t.relname::text AS table_name, s.n_live_tup AS live_tuples, s.n_dead_tup AS dead_tuples,
       s.last_vacuum, s.last_autovacuum, s.last_analyze, s.last_autoanalyze,
       s.vacuum_count + s.autovacuum_count AS vacuums,
       (c.relpages + coalesce(x.relpages, 0) + i.pages) * b.size AS total_bytes,
       (c.relpages + coalesce(x.relpages, 0)) * b.size AS table_bytes,
       i.pages * b.size AS index_bytes
  FROM unnest(ARRAY['jobs', 'attempts', 'delivery_receipts', 'claim_tombstones',
                    'capacity_stripes', 'project_running_stripes', 'capacity_debts',
                    'job_dependencies', 'audit_events', 'queue_summaries', 'runners',
                    'duty_leases']) WITH ORDINALITY AS t (relname, ord)
  JOIN pg_stat_user_tables s ON s.relname = t.relname AND s.schemaname = 'public'
  JOIN pg_class c ON c.oid = s.relid
  LEFT JOIN pg_class x ON x.oid = c.reltoastrelid
  CROSS JOIN LATERAL (SELECT coalesce(sum(ic.relpages), 0)::bigint AS pages
                        FROM pg_index ix JOIN pg_class ic ON ic.oid = ix.indexrelid
                       WHERE ix.indrelid = c.oid) i
  CROSS JOIN (SELECT current_setting('block_size')::bigint AS size) b
 ORDER BY t.ord;

-- name: read_horizon_holders
-- The oldest holders of the xmin horizon (pgd_read_horizon_holders, sql/functions/health.sql:
-- no query text). Read-only.
SELECT h.*
  FROM pgd_read_horizon_holders(:limit) h;

-- name: reads_all_stats$
-- Whether the horizon read sees other roles' sessions (its owner has pg_read_all_stats).
SELECT pgd_reads_all_stats() AS reads_all_stats;

-- name: read_claim_function_stats
-- The claim's time inside the database, from PostgreSQL's own function statistics
-- (pg_stat_user_functions): calls and total milliseconds of pgd_claim and pgd_claim_batch
-- since the statistics were last reset. Counted by the server only when track_functions is
-- 'pl' or 'all' (docs/operations.md, "The claim's latency"); no row is written per claim.
-- Read-only.
SELECT f.funcname::text AS function_name, f.calls, f.total_time AS total_ms,
       f.self_time AS self_ms
  FROM pg_stat_user_functions f
 WHERE f.schemaname = 'public' AND f.funcname IN ('pgd_claim', 'pgd_claim_batch')
 ORDER BY f.funcname;

-- name: read_track_functions$
-- The server's track_functions setting: whether the claim's function statistics are kept.
SELECT current_setting('track_functions') AS track_functions;
