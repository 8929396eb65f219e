-- Plain read helpers of the job lists (list_jobs, sql/jobs.sql): they run as their caller
-- (the console, the API, the CLI), read only, and are inlined into the statement.

-- Whether job row ``p_job`` passes the job list's filters, each NULL when not asked for:
-- project ids (one project, an organization's projects, or what both leave; '{}' matches
-- nothing), pool and target ids, and its age (now - created_at, seconds) above
-- ``p_older_than_seconds`` / at most ``p_younger_than_seconds``. The runner of a job's
-- latest attempt is the statements' own condition (sql/jobs.sql): one expression without a
-- subquery, so that PostgreSQL inlines it (docs: "Inlining of SQL Functions"; a body with a
-- sub-SELECT is never inlined, and was called once per row with no index in reach: a rare
-- project's jobs read every job of the history, docs/benchmarks.md, "Console at scale")
-- and a custom plan drops the filters that are NULL and reads jobs_project_idx or
-- jobs_target_idx for the ones that are set.
CREATE OR REPLACE FUNCTION pgd_job_list_match(p_job jobs, p_project_ids bigint[],
                                              p_pool_id bigint, p_target_id bigint,
                                              p_older_than_seconds double precision,
                                              p_younger_than_seconds double precision)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT (p_project_ids IS NULL OR p_job.project_id = ANY (p_project_ids))
       AND (p_pool_id IS NULL OR p_job.pool_id = p_pool_id)
       AND (p_target_id IS NULL OR p_job.target_id = p_target_id)
       AND (p_older_than_seconds IS NULL
            OR p_job.created_at <= now() - make_interval(secs => p_older_than_seconds))
       AND (p_younger_than_seconds IS NULL
            OR p_job.created_at > now() - make_interval(secs => p_younger_than_seconds))
$$;
