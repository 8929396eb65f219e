-- 0009_reason_summaries: queue_summaries gains what counting every reason of a waiting job
-- needs without reading job rows (approvals behind a dependency, targets held or uncertain
-- for jobs of any waiting state) and the oldest "waiting since" of each group of jobs that
-- share a primary reason; pgd_claim and pgd_claim_batch gain pool and wait_seconds columns
-- (the scheduler's wait-time histogram), which changes their result type.
-- Do not edit: the current definitions are in sql/schema.sql and sql/functions/.

ALTER TABLE queue_summaries
    ADD COLUMN any_approval integer NOT NULL DEFAULT 0,
    ADD COLUMN any_target_held integer NOT NULL DEFAULT 0,
    ADD COLUMN any_target_uncertain integer NOT NULL DEFAULT 0,
    ADD COLUMN oldest_dependency_at timestamptz,
    ADD COLUMN oldest_approval_at timestamptz,
    ADD COLUMN oldest_target_held_at timestamptz,
    ADD COLUMN oldest_target_uncertain_at timestamptz,
    ADD COLUMN oldest_free_at timestamptz;

DROP FUNCTION IF EXISTS pgd_claim(bigint, bigint[], uuid, double precision);
DROP FUNCTION IF EXISTS pgd_claim_batch(bigint, bigint[], uuid[], double precision);
