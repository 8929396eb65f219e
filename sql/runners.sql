-- name: transaction_isolation$
-- The isolation level this session's transactions run in (default_transaction_isolation of
-- the server, database or role). Read-only.
SELECT current_setting('transaction_isolation');

-- name: register_runner$
-- One row per scheduler process; its pools and slots; see pgd_register_runner
-- (sql/functions/runners.sql).
SELECT pgd_register_runner(:name, :hostname, :pid, CAST(:pools AS text[]), :slots);

-- name: beat_runner
-- Keep a runner row alive, renew and take over duties; every duty row; see pgd_beat_runner
-- (sql/functions/runners.sql).
SELECT * FROM pgd_beat_runner(:runner_id, :draining, :beat_seconds, :duty_lease_seconds);

-- name: stop_runner!
-- Mark a runner stopped at shutdown, releasing its duties.
SELECT pgd_stop_runner(:runner_id);

-- name: run_cleanup$
-- One batch of the cleanup duty, if the caller holds it in that term; see pgd_run_cleanup.
SELECT pgd_run_cleanup(:runner_id, :term, :batch);

-- name: get_runner^
-- One runner of any age (stopped long ago included), with the columns of list_runners.
-- Read-only.
SELECT r.id, r.name, r.hostname, r.pid, r.slots, r.started_at, r.last_heartbeat_at, r.draining,
       r.stopped_at, r.stop_reason, r.login, pgd_login_is_unbound(r.login) AS is_unbound,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (r.pool_ids) ORDER BY q.name) AS pools,
       ARRAY(SELECT q.name FROM pools q
              WHERE q.id = ANY (pgd_runner_login_pools(r.login)) ORDER BY q.name) AS granted_pools,
       (r.stopped_at IS NULL AND r.last_heartbeat_at > now() - make_interval(secs => :live_seconds)) AS is_live,
       (SELECT count(*) FROM attempts a WHERE a.runner_id = r.id AND a.state = 'running') AS slots_used
  FROM runners r
 WHERE r.id = :runner_id;

-- name: list_duties
-- The elected duties with their holders (names), how long since each was done and how long
-- its lease has left (seconds, negative when lapsed). Read-only.
SELECT d.duty, d.runner_id, r.name AS runner_name, d.term, d.held_since, d.expires_at,
       d.last_done_at, d.expires_at > now() AS is_held,
       extract(epoch FROM now() - d.last_done_at)::float8 AS done_seconds_ago,
       extract(epoch FROM d.expires_at - now())::float8 AS expires_in_seconds
  FROM duty_leases d LEFT JOIN runners r ON r.id = d.runner_id
 ORDER BY d.duty;

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

-- name: list_runners_page
-- The runners page: every runner not stopped and seen within the hour, and the last
-- :stopped_limit stopped or lost ones (newest first), with the same columns as
-- list_runners, and stopped_total: how many runners stopped within the hour (so that
-- stopped rows never pile up on the page). Read-only.
WITH shown AS (
    SELECT r.id FROM runners r
     WHERE r.stopped_at IS NULL AND r.last_heartbeat_at > now() - interval '1 hour'
    UNION ALL
    (SELECT r.id FROM runners r WHERE r.stopped_at IS NOT NULL
      ORDER BY r.stopped_at DESC LIMIT :stopped_limit)
)
SELECT r.id, r.name, r.hostname, r.pid, r.slots, r.started_at, r.last_heartbeat_at, r.draining,
       r.stopped_at, r.stop_reason, r.login, pgd_login_is_unbound(r.login) AS is_unbound,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (r.pool_ids) ORDER BY q.name) AS pools,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (g.pool_ids) ORDER BY q.name) AS granted_pools,
       ARRAY(SELECT q.name FROM pools q
              WHERE q.id = ANY (r.pool_ids) AND NOT q.id = ANY (g.pool_ids) ORDER BY q.name) AS ungranted_pools,
       (r.stopped_at IS NULL AND r.last_heartbeat_at > now() - make_interval(secs => :live_seconds)) AS is_live,
       (SELECT count(*) FROM attempts a WHERE a.runner_id = r.id AND a.state = 'running') AS slots_used,
       (SELECT count(*) FROM runners s WHERE s.stopped_at > now() - interval '1 hour') AS stopped_total
  FROM shown
  JOIN runners r ON r.id = shown.id
 CROSS JOIN LATERAL (SELECT pgd_runner_login_pools(r.login) AS pool_ids) g
 ORDER BY r.stopped_at IS NOT NULL, r.stopped_at DESC NULLS FIRST, r.name, r.id;
