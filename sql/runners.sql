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
-- With the operator's drain of the runner on every row (pgd_runner_drain; NULLs when not
-- drained): the scheduler learns a drain, its deadline and a resume from its beat.
SELECT b.*, d.drain_requested_at, d.drain_requested_by, d.drain_reason, d.drain_deadline
  FROM pgd_beat_runner(:runner_id, :draining, :beat_seconds, :duty_lease_seconds) b
  LEFT JOIN LATERAL pgd_runner_drain(:runner_id) d ON true;

-- name: drain_runner$
-- Drain a runner with a reason and an optional deadline (seconds; conditional, fenced
-- against its claims in flight, audited); see pgd_drain_runner (sql/functions/operator.sql).
SELECT pgd_drain_runner(:runner_id, :deadline_seconds, :reason, :actor);

-- name: resume_runner$
-- Resume a drained runner (conditional, audited, NOTIFYs it); see pgd_resume_runner.
SELECT pgd_resume_runner(:runner_id, :reason, :actor);

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
       r.drain_requested_at, r.drain_requested_by, r.drain_reason, r.drain_deadline,
       -- an operator's drain: draining while it still runs a job, drained once it runs none
       CASE WHEN r.drain_requested_at IS NULL THEN NULL
            WHEN EXISTS (SELECT 1 FROM attempts a WHERE a.runner_id = r.id AND a.state = 'running')
            THEN 'draining' ELSE 'drained' END AS drain_state,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (r.pool_ids) ORDER BY q.name) AS pools,
       ARRAY(SELECT q.name FROM pools q
              WHERE q.id = ANY (pgd_runner_login_pools(r.login)) ORDER BY q.name) AS granted_pools,
       pgd_runner_is_live(r.stopped_at, r.last_heartbeat_at, r.beat_seconds, :live_seconds) AS is_live,
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
-- Runners seen or stopped within the hour (older dead ones drop off), with live flag and slots used;
-- stop_reason: how a stopped one ended (stopped, or lost: marked by the cleanup duty).
-- With the runner's login, the pools granted to that login now (every pool for an unbound
-- login: is_unbound) and the pools it asked for that are not granted (a revoked grant).
SELECT r.id, r.name, r.hostname, r.pid, r.slots, r.started_at, r.last_heartbeat_at, r.draining,
       r.stopped_at, r.stop_reason, r.login, pgd_login_is_unbound(r.login) AS is_unbound,
       r.drain_requested_at, r.drain_requested_by, r.drain_reason, r.drain_deadline,
       -- an operator's drain: draining while it still runs a job, drained once it runs none
       CASE WHEN r.drain_requested_at IS NULL THEN NULL
            WHEN EXISTS (SELECT 1 FROM attempts a WHERE a.runner_id = r.id AND a.state = 'running')
            THEN 'draining' ELSE 'drained' END AS drain_state,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (r.pool_ids) ORDER BY q.name) AS pools,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (g.pool_ids) ORDER BY q.name) AS granted_pools,
       ARRAY(SELECT q.name FROM pools q
              WHERE q.id = ANY (r.pool_ids) AND NOT q.id = ANY (g.pool_ids) ORDER BY q.name) AS ungranted_pools,
       pgd_runner_is_live(r.stopped_at, r.last_heartbeat_at, r.beat_seconds, :live_seconds) AS is_live,
       (SELECT count(*) FROM attempts a WHERE a.runner_id = r.id AND a.state = 'running') AS slots_used
  FROM runners r
 CROSS JOIN LATERAL (SELECT pgd_runner_login_pools(r.login) AS pool_ids) g
 WHERE (r.stopped_at IS NULL AND r.last_heartbeat_at > now() - interval '1 hour')
    OR r.stopped_at > now() - interval '1 hour'
 ORDER BY r.stopped_at IS NOT NULL, r.name, r.id;

-- name: live_runner_pools
-- The pools live runners serve, with their runner ids, runner slots (free ones too) and the
-- logins that ask for a pool without its grant: pgd_live_runner_pools
-- (sql/functions/runners.sql). Read-only.
SELECT pool_id, runner_ids, runner_slots, free_runner_slots, ungranted_logins
  FROM pgd_live_runner_pools(:live_seconds);

-- name: list_runners_page
-- The runners page: every runner not stopped and seen within the hour, and the runners
-- stopped or lost within the last :fold_seconds (at most :stopped_limit, newest first); the
-- older stopped ones are folded away (list_stopped_runners shows them). With the same
-- columns as list_runners, and stopped_total: every stopped or lost runner on record, so
-- that the page says how many it folds. Read-only.
WITH shown AS (
    SELECT r.id FROM runners r
     WHERE r.stopped_at IS NULL AND r.last_heartbeat_at > now() - interval '1 hour'
    UNION ALL
    (SELECT r.id FROM runners r
      WHERE r.stopped_at > now() - make_interval(secs => :fold_seconds)
      ORDER BY r.stopped_at DESC LIMIT :stopped_limit)
)
SELECT r.id, r.name, r.hostname, r.pid, r.slots, r.started_at, r.last_heartbeat_at, r.draining,
       r.stopped_at, r.stop_reason, r.login, pgd_login_is_unbound(r.login) AS is_unbound,
       r.drain_requested_at, r.drain_requested_by, r.drain_reason, r.drain_deadline,
       -- an operator's drain: draining while it still runs a job, drained once it runs none
       CASE WHEN r.drain_requested_at IS NULL THEN NULL
            WHEN EXISTS (SELECT 1 FROM attempts a WHERE a.runner_id = r.id AND a.state = 'running')
            THEN 'draining' ELSE 'drained' END AS drain_state,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (r.pool_ids) ORDER BY q.name) AS pools,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (g.pool_ids) ORDER BY q.name) AS granted_pools,
       ARRAY(SELECT q.name FROM pools q
              WHERE q.id = ANY (r.pool_ids) AND NOT q.id = ANY (g.pool_ids) ORDER BY q.name) AS ungranted_pools,
       pgd_runner_is_live(r.stopped_at, r.last_heartbeat_at, r.beat_seconds, :live_seconds) AS is_live,
       (SELECT count(*) FROM attempts a WHERE a.runner_id = r.id AND a.state = 'running') AS slots_used
  FROM shown
  JOIN runners r ON r.id = shown.id
 CROSS JOIN LATERAL (SELECT pgd_runner_login_pools(r.login) AS pool_ids) g
 ORDER BY r.stopped_at IS NOT NULL, r.stopped_at DESC NULLS FIRST, r.name, r.id;

-- name: count_stopped_runners$
-- Every stopped or lost runner on record (rows are kept: the history of the fleet).
-- Read-only.
SELECT count(*) FROM runners WHERE stopped_at IS NOT NULL;

-- name: list_stopped_runners
-- Stopped and lost runners, newest first (by id: the order they registered in), keyset-
-- paginated by id, with the same columns as list_runners. Read-only.
SELECT r.id, r.name, r.hostname, r.pid, r.slots, r.started_at, r.last_heartbeat_at, r.draining,
       r.stopped_at, r.stop_reason, r.login, pgd_login_is_unbound(r.login) AS is_unbound,
       r.drain_requested_at, r.drain_requested_by, r.drain_reason, r.drain_deadline,
       -- an operator's drain: draining while it still runs a job, drained once it runs none
       CASE WHEN r.drain_requested_at IS NULL THEN NULL
            WHEN EXISTS (SELECT 1 FROM attempts a WHERE a.runner_id = r.id AND a.state = 'running')
            THEN 'draining' ELSE 'drained' END AS drain_state,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (r.pool_ids) ORDER BY q.name) AS pools,
       ARRAY(SELECT q.name FROM pools q WHERE q.id = ANY (g.pool_ids) ORDER BY q.name) AS granted_pools,
       ARRAY(SELECT q.name FROM pools q
              WHERE q.id = ANY (r.pool_ids) AND NOT q.id = ANY (g.pool_ids) ORDER BY q.name) AS ungranted_pools,
       false AS is_live,
       (SELECT count(*) FROM attempts a WHERE a.runner_id = r.id AND a.state = 'running') AS slots_used
  FROM runners r
 CROSS JOIN LATERAL (SELECT pgd_runner_login_pools(r.login) AS pool_ids) g
 WHERE r.stopped_at IS NOT NULL AND r.id < :before_id
 ORDER BY r.id DESC
 LIMIT :limit;
