-- name: claim^
-- Take the next eligible job (SKIP LOCKED) and reserve its capacity in lock order; see pgd_claim (sql/functions/claim.sql).
SELECT * FROM pgd_claim(:runner_id, CAST(:pool_ids AS bigint[]), CAST(:claim_token AS uuid), :lease_seconds);

-- name: capacity_waiting$
-- Whether work for the runner waits for capacity that running jobs hold; see pgd_capacity_waiting.
SELECT pgd_capacity_waiting(:runner_id, CAST(:pool_ids AS bigint[]));

-- name: recover_claims
-- After a lost answer: tombstone one claim's tokens, wait out a claim about to commit, return what committed; see pgd_recover_claims.
SELECT * FROM pgd_recover_claims(CAST(:claim_tokens AS uuid[]), :runner_id);

-- name: heartbeat^
-- Extend the lease only if the attempt still runs with this generation; no row = fenced
-- out; see pgd_heartbeat (sql/functions/runners.sql).
SELECT * FROM pgd_heartbeat(:attempt_id, :generation, :lease_seconds, CAST(:output_tail AS text));

-- name: heartbeat_batch
-- Extend the leases of several attempts at once, each only if it still runs with its
-- generation; a missing row = that one fenced out; see pgd_heartbeat_batch.
SELECT * FROM pgd_heartbeat_batch(CAST(:attempt_ids AS bigint[]), CAST(:generations AS bigint[]),
                                  :lease_seconds, CAST(:output_tails AS text[]));

-- name: complete$
-- Record an outcome once (receipt key), release every reservation, retry or end the job; see pgd_complete (sql/functions/complete.sql).
SELECT pgd_complete(:attempt_id, :generation, :outcome, :exit_code, :error, :output_tail,
                    :receipt_key, :backoff_base_seconds, :backoff_cap_seconds);

-- name: expire_one$
-- End one lapsed lease in lock order (SKIP LOCKED on the job); NULL when none; see pgd_expire_one (sql/functions/expire.sql).
-- pool_ids: only those pools' jobs; NULL: every pool.
SELECT pgd_expire_one(:backoff_base_seconds, :backoff_cap_seconds, CAST(:pool_ids AS bigint[]));

-- name: expiry_done$
-- Stamp the expiry duty done, if the caller holds it in that term; see pgd_expiry_done.
SELECT pgd_expiry_done(:runner_id, :term);

-- name: list_attempts
-- A job's attempts, oldest first, with the runner's name and how long each ran in seconds
-- (claimed to finished, or to now while it runs). Read-only.
SELECT a.id, a.job_id, a.attempt_no, a.generation, a.runner_id, r.name AS runner_name,
       r.hostname AS runner_hostname, a.state, a.claimed_at, a.lease_expires_at,
       a.last_heartbeat_at, a.finished_at, a.exit_code, a.error,
       extract(epoch FROM coalesce(a.finished_at, now()) - a.claimed_at)::float8 AS duration_seconds,
       right(a.output_tail, :tail_chars) AS output_tail
  FROM attempts a JOIN runners r ON r.id = a.runner_id
 WHERE a.job_id = :job_id
 ORDER BY a.attempt_no;

-- name: claim_batch
-- Up to len(claim_tokens) build jobs of one (project, pool) in one transaction; see pgd_claim_batch.
SELECT * FROM pgd_claim_batch(:runner_id, CAST(:pool_ids AS bigint[]),
                              CAST(:claim_tokens AS uuid[]), :lease_seconds);

-- name: complete_batch
-- Several outcomes in one transaction, in the global lock order (the slots last); see pgd_complete_batch.
SELECT pgd_complete_batch(CAST(:items AS jsonb), :backoff_base_seconds,
                          :backoff_cap_seconds) AS answer;
