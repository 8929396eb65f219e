-- What each group role of sql/roles.sql may do, applied by every `db upgrade` after the
-- function files load (sql/migrate.py), and by `pgdispatch db roles`. The owner
-- (pgdispatch_owner) owns every table, sequence and function; nobody else may change
-- anything except through the SECURITY DEFINER entry points granted here. Everything is
-- revoked first, so that running this file again also takes back a grant made by hand.
-- A table or a function added later gets no privilege until it is named here.

REVOKE ALL ON ALL TABLES IN SCHEMA public
    FROM PUBLIC, pgdispatch_migrator, pgdispatch_scheduler, pgdispatch_web, pgdispatch_reader,
         pgdispatch_operator, pgdispatch_admin;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public
    FROM PUBLIC, pgdispatch_migrator, pgdispatch_scheduler, pgdispatch_web, pgdispatch_reader,
         pgdispatch_operator, pgdispatch_admin;
-- PostgreSQL grants EXECUTE on every new function to PUBLIC; internal helpers (no SECURITY
-- DEFINER) stay executable by the owner alone, who runs them inside the entry points.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA public
    FROM PUBLIC, pgdispatch_migrator, pgdispatch_scheduler, pgdispatch_web, pgdispatch_reader,
         pgdispatch_operator, pgdispatch_admin;

-- Scheduler (a runner host's login): no table privilege at all; its transitions only.
GRANT EXECUTE ON FUNCTION pgd_register_runner, pgd_beat_runner, pgd_stop_runner,
                          pgd_get_runner_pool_ids, pgd_claim, pgd_claim_batch, pgd_recover_claims,
                          pgd_heartbeat, pgd_heartbeat_batch, pgd_complete, pgd_complete_batch,
                          pgd_expire_one
    TO pgdispatch_scheduler;
-- The elected duties (sql/functions/runners.sql): each run is fenced by the holder's term;
-- the summary's unfenced form (pgd_summarize_queue) is the owner's alone.
GRANT EXECUTE ON FUNCTION pgd_run_summaries, pgd_expiry_done, pgd_run_cleanup,
                          pgd_read_summary_inputs, pgd_record_reason_counts
    TO pgdispatch_scheduler;
-- the wake-up listener's registration (sql/functions/wakeups.sql)
GRANT EXECUTE ON FUNCTION pgd_listen_runner TO pgdispatch_scheduler;
-- an operator's drain of the runner, read with each beat (sql/functions/runners.sql)
GRANT EXECUTE ON FUNCTION pgd_runner_drain TO pgdispatch_scheduler;
-- after an empty claim while it runs jobs: does work wait for capacity it may free?
-- (sql/functions/claim.sql)
GRANT EXECUTE ON FUNCTION pgd_capacity_waiting TO pgdispatch_scheduler;

-- Reader (dashboards, metrics; and the base of a person's CLI login): what the console
-- shows, never a secret: users without password_hash, api_tokens without token_hash.
GRANT SELECT ON organizations, pools, projects, project_pools, runners, targets, jobs,
                job_dependencies, attempts, audit_events, queue_summaries, capacity_stripes,
                capacity_debts, runner_grants, duty_leases, queue_history, queue_reason_history,
                project_target_supersede, project_running_stripes
    TO pgdispatch_reader, pgdispatch_web;
GRANT SELECT (id, username, role, created_at, disabled_at) ON users
    TO pgdispatch_reader, pgdispatch_web;
GRANT SELECT (id, user_id, name, created_at, last_used_at, revoked_at, expires_at) ON api_tokens
    TO pgdispatch_reader, pgdispatch_web;
-- the running counts the lists show (plain SQL functions over capacity_stripes and
-- project_running_stripes, inlined into the reads)
GRANT EXECUTE ON FUNCTION pgd_organization_running, pgd_pool_running, pgd_project_running,
                          pgd_waiting_since, pgd_job_list_match
    TO pgdispatch_reader, pgdispatch_web;
-- the command as one text, the expression of the job search's index (sql/schema.sql): whoever
-- writes a job row evaluates it to maintain the index, and a search rechecks rows with it; a
-- pure function of its argument that reveals nothing
GRANT EXECUTE ON FUNCTION pgd_command_text TO PUBLIC;

-- a target's head (its next deployment, sql/functions/claim.sql: a plain read of jobs,
-- projects and targets) for jobs explain and the target page's "what runs next"
GRANT EXECUTE ON FUNCTION pgd_target_head TO pgdispatch_reader, pgdispatch_web;
-- which pools a runner host's login is granted, for the runners page and jobs explain (plain
-- SQL functions over runner_grants and pg_roles: they reveal no secret)
GRANT EXECUTE ON FUNCTION pgd_runner_login_pools, pgd_login_is_unbound, pgd_login_may_run,
                          pgd_live_runner_pools, pgd_runner_is_live
    TO pgdispatch_reader, pgdispatch_web;

-- Operator (a person's CLI login; pgdispatch_admin is a member): submit, the operator
-- actions, an expiry pass. pgd_authorize makes the login the actor.
GRANT EXECUTE ON FUNCTION pgd_submit, pgd_pause_project, pgd_resume_project, pgd_approve_job,
                          pgd_cancel_job, pgd_retry_job, pgd_set_priority, pgd_resolve_target,
                          pgd_bulk_begin, pgd_bulk_apply,
                          pgd_pause_pool, pgd_resume_pool, pgd_drain_runner, pgd_resume_runner
    TO pgdispatch_operator, pgdispatch_web;
GRANT EXECUTE ON FUNCTION pgd_expire_one TO pgdispatch_operator;

-- Admin: limits, accounts and tokens (sql/functions/limits.sql, accounts.sql). pgd_authorize
-- checks the console's user is an admin, or that a CLI login is in pgdispatch_admin.
GRANT EXECUTE ON FUNCTION pgd_set_organization_limit, pgd_set_project_limits, pgd_set_pool_slots,
                          pgd_create_user, pgd_set_user_role, pgd_set_user_disabled,
                          pgd_set_user_password, pgd_create_api_token, pgd_revoke_api_token
    TO pgdispatch_admin, pgdispatch_web;

-- The console's sign-in, sessions and bearer tokens (sql/functions/accounts.sql): the hash is
-- compared in the database and never leaves it; sign_in_failures and sign_in_secret are
-- nobody's to read.
GRANT EXECUTE ON FUNCTION pgd_sign_in_parameters, pgd_sign_in, pgd_session_user, pgd_sign_out,
                          pgd_rehash_password, pgd_authenticate_token
    TO pgdispatch_web;

-- The database's health (sql/functions/health.sql): who holds the xmin horizon, without any
-- session's query text; for the console's Database page and /metrics, and dashboards.
GRANT EXECUTE ON FUNCTION pgd_read_horizon_holders, pgd_reads_all_stats
    TO pgdispatch_reader, pgdispatch_web;
