-- 0020_jobs_by_pool: the jobs list's pool filter at 10M finished jobs (issue 21, item 5;
-- docs/benchmarks.md, "Console at scale").
--
-- jobs_pool_idx (pool_id, id): the jobs list with `?pool=` read jobs_pkey newest first
-- through every job until 50 of the pool's matched (4.7 s for a pool of 21 jobs among 11M);
-- it now reads that pool's range of this index. A full index: an entry for every row
-- version of a job (submit, claim, completion); its measured write cost is in
-- docs/benchmarks.md.
-- Built under the upgrade's locks; on a large live table create it beforehand with CREATE
-- INDEX CONCURRENTLY under the same name and definition (IF NOT EXISTS keeps it).
-- Do not edit: the current schema is sql/schema.sql.

CREATE INDEX IF NOT EXISTS jobs_pool_idx ON jobs (pool_id, id);
