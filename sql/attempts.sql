-- name: claim^
-- Take the next eligible job (SKIP LOCKED) and reserve its capacity in lock order; see pgd_claim (sql/functions/claim.sql).
SELECT * FROM pgd_claim(:runner_id, CAST(:pool_ids AS bigint[]), CAST(:claim_token AS uuid), :lease_seconds);

-- name: find_claim^
-- After a lost connection: did the claim with this token commit? Read-only.
SELECT a.id AS attempt_id, a.job_id, a.attempt_no, a.generation, a.lease_expires_at, a.state,
       j.project_id, j.pool_id, j.target_id, j.command, j.timeout_seconds
  FROM attempts a JOIN jobs j ON j.id = a.job_id
 WHERE a.claim_token = CAST(:claim_token AS uuid);

-- name: heartbeat^
-- Heartbeat: extend the lease only if the attempt still runs with this generation; no row = fenced out.
-- Locks only the attempt row (last in lock order).
UPDATE attempts a
   SET lease_expires_at = clock_timestamp() + make_interval(secs => :lease_seconds),
       last_heartbeat_at = now(),
       output_tail = coalesce(CAST(:output_tail AS text), a.output_tail)
  FROM jobs j
 WHERE a.id = :attempt_id AND a.generation = :generation AND a.state = 'running'
   AND j.id = a.job_id
RETURNING a.lease_expires_at, j.cancel_requested_at IS NOT NULL AS is_cancel_requested;

-- name: complete$
-- Record an outcome once (receipt key), release every reservation, retry or end the job; see pgd_complete (sql/functions/complete.sql).
SELECT pgd_complete(:attempt_id, :generation, :outcome, :exit_code, :error, :output_tail,
                    :receipt_key, :backoff_base_seconds, :backoff_cap_seconds);

-- name: expire_one$
-- End one lapsed lease in lock order (SKIP LOCKED on the job); NULL when none; see pgd_expire_one (sql/functions/expire.sql).
SELECT pgd_expire_one(:backoff_base_seconds, :backoff_cap_seconds);

-- name: list_attempts
-- A job's attempts, oldest first, with the runner's name. Read-only.
SELECT a.id, a.job_id, a.attempt_no, a.generation, a.runner_id, r.name AS runner_name,
       r.hostname AS runner_hostname, a.state, a.claimed_at, a.lease_expires_at,
       a.last_heartbeat_at, a.finished_at, a.exit_code, a.error,
       right(a.output_tail, :tail_chars) AS output_tail
  FROM attempts a JOIN runners r ON r.id = a.runner_id
 WHERE a.job_id = :job_id
 ORDER BY a.attempt_no;

-- name: end_backend$
-- After a lost connection, make sure its server session is gone so its last transaction is settled.
SELECT pg_terminate_backend(:pid) WHERE EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = :pid);

-- name: is_backend_alive$
-- Whether a server session (by pid) still exists. Read-only.
SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = :pid);

-- name: claim_batch
-- Up to len(claim_tokens) build jobs of one (project, pool) in one transaction; see pgd_claim_batch.
SELECT * FROM pgd_claim_batch(:runner_id, CAST(:pool_ids AS bigint[]),
                              CAST(:claim_tokens AS uuid[]), :lease_seconds);

-- name: complete_batch
-- Several outcomes in one transaction, in the global lock order (the slots last); see pgd_complete_batch.
SELECT pgd_complete_batch(CAST(:items AS jsonb), :backoff_base_seconds,
                          :backoff_cap_seconds) AS answer;
