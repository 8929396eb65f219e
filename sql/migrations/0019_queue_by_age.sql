-- 0019_queue_by_age: the queue longest waiting first at 1M waiting jobs (issue 21, item 5;
-- docs/benchmarks.md, "Console at scale").
--
-- jobs_waiting_age_idx: the waiting jobs of one (project, pool) by waiting since (the
-- expression of pgd_waiting_since), then id. The queue's `?sort=oldest` read every waiting
-- job and sorted them (2.0-2.4 s at 1M); it now reads one range per (project, pool) pair
-- (list_waiting_jobs_of_pairs_by_age). Partial: one entry per job while it waits, none for
-- the claim's or the completion's row versions.
-- Built under the upgrade's locks; on a large live table create it beforehand with CREATE
-- INDEX CONCURRENTLY under the same name and definition (IF NOT EXISTS keeps it).
-- Do not edit: the current schema is sql/schema.sql.

CREATE INDEX IF NOT EXISTS jobs_waiting_age_idx ON jobs
    (project_id, pool_id, (CASE WHEN state = 'blocked' THEN created_at ELSE ready_at END), id)
    WHERE state IN ('blocked', 'queued', 'uncertain');
