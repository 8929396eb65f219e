-- 0008_claim_wakeups: a listening scheduler registers its listener session on its runner row
-- (listen_pid), so that a job that becomes claimable wakes one chosen runner (woken_at: the
-- least recently woken goes first) instead of every listener; pgd_claim and pgd_claim_batch
-- gain a more_waiting column, which changes their result type.
-- Do not edit: the current definitions are in sql/schema.sql and sql/functions/.

ALTER TABLE runners ADD COLUMN listen_pid integer, ADD COLUMN woken_at timestamptz;

DROP FUNCTION IF EXISTS pgd_claim(bigint, bigint[], uuid, double precision);
DROP FUNCTION IF EXISTS pgd_claim_batch(bigint, bigint[], uuid[], double precision);
