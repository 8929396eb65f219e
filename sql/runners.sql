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
-- With the runner's login, the pools granted to that login now (every pool for an unbound
-- login: is_unbound) and the pools it asked for that are not granted (a revoked grant).
SELECT r.id, r.name, r.hostname, r.pid, r.slots, r.started_at, r.last_heartbeat_at, r.draining,
       r.stopped_at, r.login, pgd_login_is_unbound(r.login) AS is_unbound,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (r.pool_ids) ORDER BY q.name) AS pools,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (g.pool_ids) ORDER BY q.name) AS granted_pools,
       ARRAY(SELECT q.name FROM pools q
              WHERE q.id = ANY (r.pool_ids) AND NOT q.id = ANY (g.pool_ids) ORDER BY q.name) AS ungranted_pools,
       (r.stopped_at IS NULL AND r.last_heartbeat_at > now() - make_interval(secs => :live_seconds)) AS is_live,
       (SELECT count(*) FROM attempts a WHERE a.runner_id = r.id AND a.state = 'running') AS slots_used
  FROM runners r
 CROSS JOIN LATERAL (SELECT pgd_runner_login_pools(r.login) AS pool_ids) g
 WHERE (r.stopped_at IS NULL AND r.last_heartbeat_at > now() - interval '1 hour')
    OR r.stopped_at > now() - interval '1 hour'
 ORDER BY r.stopped_at IS NOT NULL, r.name, r.id;

-- name: live_runner_pools
-- Pools served by at least one live, non-draining runner whose login is granted the pool
-- now, with those runners' slots and how many of them are free (slots minus running
-- attempts, per runner; a runner serving several pools counts its free slots for each), and
-- the logins of live runners that ask for the pool without its grant (ungranted_logins).
-- A pool only such runners ask for has runner_slots 0. Read-only.
SELECT p.pool_id,
       coalesce(sum(r.slots) FILTER (WHERE g.is_granted), 0)::integer AS runner_slots,
       coalesce(sum(greatest(r.slots - a.n, 0)) FILTER (WHERE g.is_granted), 0)::integer AS free_runner_slots,
       ARRAY(SELECT DISTINCT u FROM unnest(array_agg(r.login) FILTER (WHERE NOT g.is_granted)) u
              ORDER BY 1) AS ungranted_logins
  FROM runners r
 CROSS JOIN LATERAL unnest(r.pool_ids) p(pool_id)
 CROSS JOIN LATERAL (SELECT p.pool_id = ANY (pgd_runner_login_pools(r.login)) AS is_granted) g
 CROSS JOIN LATERAL (SELECT count(*)::integer AS n FROM attempts a
                      WHERE a.runner_id = r.id AND a.state = 'running') a
 WHERE r.stopped_at IS NULL AND NOT r.draining
   AND r.last_heartbeat_at > now() - make_interval(secs => :live_seconds)
 GROUP BY p.pool_id;
