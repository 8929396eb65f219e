-- 0022_jobs_by_age: the jobs list's age filter at 1M queued + 10M finished jobs
-- (docs/benchmarks.md, "Console at scale").
--
-- jobs_created_idx (created_at, id): the jobs list with `?older_than=` read jobs_pkey newest
-- first (or jobs_state_idx, jobs_project_idx) through every job newer than the age bound
-- before the first match (671 ms p95 for `?older_than=86400`, 1,240 ms with a state and a
-- project: 1.33M rows walked for a day); with an age filter the list is now in creation
-- order and reads this index from the bound down (list_jobs). A full index: an entry for
-- every row version of a job that is not a HOT update (submit, claim, completion); its
-- measured write cost is in docs/benchmarks.md.
-- Built under the upgrade's locks; on a large live table create it beforehand with CREATE
-- INDEX CONCURRENTLY under the same name and definition (IF NOT EXISTS keeps it).
-- Do not edit: the current schema is sql/schema.sql.

CREATE INDEX IF NOT EXISTS jobs_created_idx ON jobs (created_at, id);
