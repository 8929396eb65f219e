-- name: transaction_isolation$
-- The isolation level this session's transactions run in (default_transaction_isolation of
-- the server, database or role). Read-only.
SELECT current_setting('transaction_isolation');

-- name: register_runner$
-- One row per scheduler process; its pools and slots; see pgd_register_runner
-- (sql/functions/runners.sql).
SELECT pgd_register_runner(:name, :hostname, :pid, CAST(:pools AS text[]), :slots);

-- name: beat_runner!
-- Keep a runner row alive (the explain "no live runner" check reads last_heartbeat_at).
SELECT pgd_beat_runner(:runner_id, :draining);

-- name: stop_runner!
-- Mark a runner stopped at shutdown.
SELECT pgd_stop_runner(:runner_id);

-- name: list_runners
-- Runners seen or stopped within the hour (older dead ones drop off), with live flag and slots used.
SELECT r.id, r.name, r.hostname, r.pid, r.slots, r.started_at, r.last_heartbeat_at, r.draining,
       r.stopped_at,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (r.pool_ids) ORDER BY q.name) AS pools,
       (r.stopped_at IS NULL AND r.last_heartbeat_at > now() - make_interval(secs => :live_seconds)) AS is_live,
       (SELECT count(*) FROM attempts a WHERE a.runner_id = r.id AND a.state = 'running') AS slots_used
  FROM runners r
 WHERE (r.stopped_at IS NULL AND r.last_heartbeat_at > now() - interval '1 hour')
    OR r.stopped_at > now() - interval '1 hour'
 ORDER BY r.stopped_at IS NOT NULL, r.name, r.id;

-- name: live_runner_pools
-- Pools served by at least one live, non-draining runner, with those runners' slots and how
-- many of them are free (slots minus running attempts, per runner; a runner serving several
-- pools counts its free slots for each). Read-only.
SELECT p.pool_id, sum(r.slots)::integer AS runner_slots,
       sum(greatest(r.slots - a.n, 0))::integer AS free_runner_slots
  FROM runners r
 CROSS JOIN LATERAL unnest(r.pool_ids) p(pool_id)
 CROSS JOIN LATERAL (SELECT count(*)::integer AS n FROM attempts a
                      WHERE a.runner_id = r.id AND a.state = 'running') a
 WHERE r.stopped_at IS NULL AND NOT r.draining
   AND r.last_heartbeat_at > now() - make_interval(secs => :live_seconds)
 GROUP BY p.pool_id;
