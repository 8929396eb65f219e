-- Plain read helpers of the job lists (list_jobs, sql/jobs.sql): they run as their caller
-- (the console, the API, the CLI), read only, and are inlined into the statement.

-- Whether job row ``p_job`` passes the job list's filters, each NULL when not asked for:
-- project, organization, pool and target ids, the runner of its latest attempt (for a
-- running job, the one running it), and its age (now - created_at, seconds) above
-- ``p_older_than_seconds`` / at most ``p_younger_than_seconds``. One expression, so that
-- PostgreSQL inlines it (docs: "Inlining of SQL Functions") and a custom plan drops the
-- filters that are NULL.
CREATE OR REPLACE FUNCTION pgd_job_list_match(p_job jobs, p_project_id bigint,
                                              p_organization_id bigint, p_pool_id bigint,
                                              p_target_id bigint, p_runner_id bigint,
                                              p_older_than_seconds double precision,
                                              p_younger_than_seconds double precision)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT (p_project_id IS NULL OR p_job.project_id = p_project_id)
       AND (p_organization_id IS NULL
            OR p_job.project_id IN (SELECT p.id FROM projects p
                                     WHERE p.organization_id = p_organization_id))
       AND (p_pool_id IS NULL OR p_job.pool_id = p_pool_id)
       AND (p_target_id IS NULL OR p_job.target_id = p_target_id)
       AND (p_runner_id IS NULL
            OR (SELECT a.runner_id FROM attempts a WHERE a.job_id = p_job.id
                 ORDER BY a.attempt_no DESC LIMIT 1) = p_runner_id)
       AND (p_older_than_seconds IS NULL
            OR p_job.created_at <= now() - make_interval(secs => p_older_than_seconds))
       AND (p_younger_than_seconds IS NULL
            OR p_job.created_at > now() - make_interval(secs => p_younger_than_seconds))
$$;
