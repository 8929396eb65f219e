-- 0018_console_at_scale: the console's filters at 1M waiting and 10M finished jobs (issue
-- 21, item 5; docs/benchmarks.md, "Console at scale").
--
-- pgd_job_list_match takes the project ids the organization and project filters leave
-- instead of the organization id, and no runner: its body had sub-SELECTs, so it was never
-- inlined and each job list with a project, pool, target or organization filter called it
-- once per job, newest first through the whole history. The old signature goes here; the
-- new one is in sql/functions/lists.sql.
--
-- Three partial indexes:
-- * jobs_waiting_pair_idx: the waiting jobs of one (project, pool) by id. The queue page's
--   organization, project and pool filters, and its reasons that hold for a whole (project,
--   pool) (paused, no runner, capacity, runners busy, ready), read one range per pair that
--   can match instead of every waiting job.
-- * jobs_waiting_special_idx: the waiting jobs that can have a reason of their own (blocked,
--   uncertain, a deployment, delayed: ready later than created), by id. A plain ready build
--   has no entry, so the queue's dependency, approval, delay and target reasons and its
--   target filter read these only.
-- * jobs_target_idx: the jobs of one target by id (deployments only), for the jobs list's
--   target filter.
-- Each is built under the upgrade's locks; on a large live table create them beforehand
-- with CREATE INDEX CONCURRENTLY under the same names and definitions (IF NOT EXISTS keeps
-- them).
-- Do not edit: the current schema is sql/schema.sql.

DROP FUNCTION IF EXISTS pgd_job_list_match(jobs, bigint, bigint, bigint, bigint, bigint,
                                           double precision, double precision);

CREATE INDEX IF NOT EXISTS jobs_waiting_pair_idx ON jobs (project_id, pool_id, id)
    WHERE state IN ('blocked', 'queued', 'uncertain');
CREATE INDEX IF NOT EXISTS jobs_waiting_special_idx ON jobs (id)
    WHERE state IN ('blocked', 'queued', 'uncertain')
      AND (state <> 'queued' OR target_id IS NOT NULL OR ready_at > created_at
           OR pending_dependencies > 0 OR requires_approval);
CREATE INDEX IF NOT EXISTS jobs_target_idx ON jobs (target_id, id) WHERE target_id IS NOT NULL;
