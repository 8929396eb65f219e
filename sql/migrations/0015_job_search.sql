-- 0015_job_search: find a job by its command (issue 20, item 5). A GIN trigram index
-- (pg_trgm, a trusted extension, in a schema of its own so that its functions are not in
-- public beside ours) on the command as one text, so that `command ILIKE '%word%'` is an
-- index search at any table size. The text is pgd_command_text(command): an IMMUTABLE
-- wrapper of array_to_string (which is only STABLE) — an expression index rather than a
-- generated column, which would store every command twice (docs/benchmarks.md, "Finding a
-- job"). The wrapper is part of the schema, not of sql/functions/: a body replaced under
-- the index would leave entries that no longer match it.
--
-- The index build reads every job under the upgrade's locks (claims wait: docs/operations.md,
-- "Finding a job", says how long at 1M jobs); on a large live table create it beforehand
-- with CREATE INDEX CONCURRENTLY under the same name and definition, and IF NOT EXISTS
-- below keeps it.
-- Do not edit: the current schema is sql/schema.sql.

CREATE SCHEMA IF NOT EXISTS pgdispatch_ext;
CREATE EXTENSION IF NOT EXISTS pg_trgm WITH SCHEMA pgdispatch_ext;

CREATE OR REPLACE FUNCTION pgd_command_text(p_command text[]) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN array_to_string(p_command, ' ');

CREATE INDEX IF NOT EXISTS jobs_command_trgm_idx ON jobs
    USING gin (pgd_command_text(command) pgdispatch_ext.gin_trgm_ops);
-- A search narrowed to one project or one submitter reads that one's jobs newest first (or
-- ANDs their bitmap with the trigram one) instead of every job whose command has the word.
CREATE INDEX IF NOT EXISTS jobs_project_idx ON jobs (project_id, id);
CREATE INDEX IF NOT EXISTS jobs_submitter_idx ON jobs (submitted_by, id);
