-- 0021_jobs_by_runner: the jobs list's runner filter at 10M finished jobs (issue 21, item 5;
-- docs/benchmarks.md, "Console at scale").
--
-- attempts_runner_done_idx (runner_id, job_id) WHERE state <> 'running': the jobs list with
-- `?runner=` read jobs_pkey newest first through every job, asking each for its latest
-- attempt's runner (3.5 s for the runner of the whole history, past the web app's 30 s
-- deadline for a live runner of 4 jobs); it now reads that runner's ended attempts by job
-- (list_jobs), and its running ones from attempts_runner_idx. Partial: an entry when an
-- attempt ends, none for its claim or its heartbeats.
-- Built under the upgrade's locks; on a large live table create it beforehand with CREATE
-- INDEX CONCURRENTLY under the same name and definition (IF NOT EXISTS keeps it).
-- Do not edit: the current schema is sql/schema.sql.

CREATE INDEX IF NOT EXISTS attempts_runner_done_idx ON attempts (runner_id, job_id)
    WHERE state <> 'running';
