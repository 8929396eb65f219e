-- The pgdispatch schema as it is now: every table, column, constraint, index and type.
-- This is the file to read, and to edit together with a new migration (docs/contributing.md);
-- the functions and triggers that use these tables are in sql/functions/*.sql.
--
-- The CHECK constraints are the invariants the database enforces by itself (DESIGN.md,
-- "Invariants"): states, non-negative limits and counters, one running attempt per job and
-- one holder per target (unique indexes), unique (job, attempt number), (job, generation)
-- and claim token. "Running <= limit under concurrency" is what the transitions guarantee
-- (sql/functions/claim.sql and capacity.sql) and tests/concurrency proves.
--
-- tests/sql/test_schema.py fails when a database built by `pgdispatch db upgrade` (the
-- migrations in sql/migrations/, then the function files) differs from this file.

-- pg_trgm (trigram indexes: the job search's) in a schema of its own, so that public holds
-- only what sql/ defines. A trusted extension: the owner creates it with CREATE on the
-- database (sql/owner.sql grants it).
CREATE SCHEMA IF NOT EXISTS pgdispatch_ext;
CREATE EXTENSION IF NOT EXISTS pg_trgm WITH SCHEMA pgdispatch_ext;

CREATE TABLE organizations (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name        text NOT NULL UNIQUE CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'),
    max_running integer NOT NULL CHECK (max_running >= 0),
    created_at  timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 50);

CREATE TABLE pools (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name       text NOT NULL UNIQUE CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'),
    slots      integer NOT NULL CHECK (slots >= 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    -- paused by an operator (pgd_pause_pool, sql/functions/operator.sql): no claim takes
    -- from the pool; its jobs wait with reason pool_paused, saying who, when and why
    paused_at    timestamptz,
    pause_reason text,
    paused_by    text,
    CONSTRAINT pools_pause_check CHECK ((paused_at IS NULL) = (pause_reason IS NULL)
                                        AND (paused_at IS NULL) = (paused_by IS NULL))
) WITH (fillfactor = 50);

CREATE TABLE projects (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    organization_id bigint NOT NULL REFERENCES organizations (id),
    name            text NOT NULL UNIQUE CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'),
    weight          integer NOT NULL DEFAULT 1 CHECK (weight BETWEEN 1 AND 1000),
    max_running     integer CHECK (max_running >= 0),
    paused_at       timestamptz,
    pause_reason    text,
    paused_by       text,
    -- round-robin tie-break between projects with the same weighted running share
    last_claimed_at timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CHECK ((paused_at IS NULL) = (pause_reason IS NULL))
) WITH (fillfactor = 50);
CREATE INDEX projects_organization_idx ON projects (organization_id);

CREATE TABLE project_pools (
    project_id bigint NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    pool_id    bigint NOT NULL REFERENCES pools (id),
    PRIMARY KEY (project_id, pool_id)
);
CREATE INDEX project_pools_pool_idx ON project_pools (pool_id);

CREATE TABLE runners (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name              text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    hostname          text NOT NULL DEFAULT '',
    pid               integer,
    pool_ids          bigint[] NOT NULL CHECK (cardinality(pool_ids) >= 1),
    slots             integer NOT NULL CHECK (slots >= 1),
    started_at        timestamptz NOT NULL DEFAULT now(),
    last_heartbeat_at timestamptz NOT NULL DEFAULT now(),
    draining          boolean NOT NULL DEFAULT false,
    stopped_at        timestamptz,
    -- the database login that registered it: only that login may claim, heartbeat and
    -- report as this runner, and only from the pools runner_grants gives it
    -- (sql/functions/claim.sql, "Runner grants")
    login             text NOT NULL DEFAULT session_user,
    -- the longest a live runner goes between keep-alives (its runner_beat_seconds, recorded
    -- by each beat): the cleanup duty marks a runner not beaten for a few of them lost
    beat_seconds      double precision CHECK (beat_seconds > 0),
    -- why stopped_at is set: 'stopped' (a clean stop) or 'lost' (the cleanup duty found it
    -- silent; a later beat of it clears both, sql/functions/runners.sql)
    stop_reason       text CHECK (stop_reason IN ('stopped', 'lost')),
    -- the server process id of this runner's wake-up listener session, set by that session
    -- right after its LISTEN (pgd_listen_runner), and when a wake-up last chose this runner
    -- (sql/functions/wakeups.sql)
    listen_pid        integer,
    woken_at          timestamptz,
    -- an operator's drain (pgd_drain_runner, sql/functions/operator.sql), apart from
    -- `draining` (the scheduler's own shutdown flag, written by every beat): while set, the
    -- runner's claims take nothing; past drain_deadline (NULL: none) the scheduler hands its
    -- running builds back. Cleared only by pgd_resume_runner.
    drain_requested_at timestamptz,
    drain_requested_by text,
    drain_reason       text,
    drain_deadline     timestamptz,
    CHECK (stop_reason IS NULL OR stopped_at IS NOT NULL),
    CONSTRAINT runners_drain_check CHECK (
        (drain_requested_at IS NULL) = (drain_requested_by IS NULL)
        AND (drain_requested_at IS NULL) = (drain_reason IS NULL)
        AND (drain_deadline IS NULL OR drain_requested_at IS NOT NULL))
);
CREATE INDEX runners_live_idx ON runners (last_heartbeat_at) WHERE stopped_at IS NULL;
CREATE INDEX runners_login_idx ON runners (login) WHERE stopped_at IS NULL;

-- The pools each runner host's login may register for and claim from, as `apply` declares
-- them ([[runners]]); a login with no row may take nothing (unless it is a superuser or a
-- member of pgdispatch_owner: sql/functions/claim.sql). No foreign key to pg_roles: a grant
-- may be declared before its login is created.
CREATE TABLE runner_grants (
    login   text NOT NULL CHECK (length(login) BETWEEN 1 AND 63),
    pool_id bigint NOT NULL REFERENCES pools (id),
    PRIMARY KEY (login, pool_id)
);
CREATE INDEX runner_grants_pool_idx ON runner_grants (pool_id);

CREATE TABLE users (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    username      text NOT NULL UNIQUE CHECK (username ~ '^[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}$'),
    password_hash text NOT NULL,
    role          text NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
    created_at    timestamptz NOT NULL DEFAULT now(),
    disabled_at   timestamptz,
    -- carried in every console session; bumping it (sign-out, a new password, disable, a
    -- role change) ends every session of the user at its next request
    session_generation bigint NOT NULL DEFAULT 1
);

CREATE TABLE api_tokens (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id      bigint NOT NULL REFERENCES users (id),
    name         text NOT NULL,
    -- sha256 of the bearer token; the token itself is shown once and never stored
    token_hash   text NOT NULL UNIQUE,
    created_at   timestamptz NOT NULL DEFAULT now(),
    last_used_at timestamptz,
    revoked_at   timestamptz,
    -- NULL: until revoked; past it the token authenticates nothing
    expires_at   timestamptz
);
CREATE INDEX api_tokens_user_idx ON api_tokens (user_id) WHERE revoked_at IS NULL;

-- Failed console sign-ins inside the login limit's window (sql/functions/accounts.sql,
-- pgd_sign_in): counted per username and per client address, so the limit holds across
-- web workers and hosts. Rows older than the window are deleted as sign-ins meet them.
CREATE TABLE sign_in_failures (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    username text NOT NULL,
    address  text,
    at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX sign_in_failures_username_idx ON sign_in_failures (username, at);
CREATE INDEX sign_in_failures_address_idx ON sign_in_failures (address, at);

-- One random secret, made on first use, from which the sign-in parameters of an unknown
-- username derive a stable salt (pgd_sign_in_parameters): the answer looks the same for
-- every name, existing or not.
CREATE TABLE sign_in_secret (
    id     boolean PRIMARY KEY DEFAULT true CHECK (id),
    secret text NOT NULL
);

CREATE TABLE targets (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name          text NOT NULL UNIQUE CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'),
    state         text NOT NULL DEFAULT 'free' CHECK (state IN ('free', 'held', 'uncertain')),
    -- a single column: a target has at most one holder by construction
    holder_job_id bigint,
    held_since    timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- a protected target: every deployment to it waits for an approval, by a user (or a
    -- database login) of at least approver_role who did not submit it (pgd_approve_job)
    requires_approval boolean NOT NULL DEFAULT false,
    approver_role text NOT NULL DEFAULT 'operator' CHECK (approver_role IN ('operator', 'admin')),
    -- a newer deployment to this target supersedes every older one still waiting, of any
    -- project (pgd_submit, sql/functions/submit.sql); project_target_supersede says the same
    -- for one project's deployments only
    supersede     boolean NOT NULL DEFAULT false,
    -- which ready deployment to this target is claimed first (pgd_target_head,
    -- sql/functions/claim.sql): oldest_first (priority, then the oldest id) or
    -- newest_ready_first (priority, then the newest id)
    deploy_order  text NOT NULL DEFAULT 'oldest_first'
        CHECK (deploy_order IN ('oldest_first', 'newest_ready_first')),
    CHECK ((state = 'free') = (holder_job_id IS NULL)),
    CHECK ((state = 'free') = (held_since IS NULL))
) WITH (fillfactor = 50);

CREATE TABLE jobs (
    id                   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    project_id           bigint NOT NULL REFERENCES projects (id),
    pool_id              bigint NOT NULL REFERENCES pools (id),
    target_id            bigint REFERENCES targets (id),
    state                text NOT NULL CHECK (state IN ('blocked', 'queued', 'running', 'succeeded',
                                                        'failed', 'cancelled', 'uncertain',
                                                        'superseded')),
    priority             integer NOT NULL DEFAULT 0 CHECK (priority BETWEEN -1000 AND 1000),
    command              text[] NOT NULL CHECK (cardinality(command) BETWEEN 1 AND 256),
    timeout_seconds      integer NOT NULL DEFAULT 3600 CHECK (timeout_seconds BETWEEN 1 AND 604800),
    max_attempts         integer NOT NULL DEFAULT 1 CHECK (max_attempts BETWEEN 1 AND 100),
    -- claims so far (numbers the attempts) and failed or expired attempts (the retry budget)
    attempts_made        integer NOT NULL DEFAULT 0 CHECK (attempts_made >= 0),
    failures             integer NOT NULL DEFAULT 0 CHECK (failures >= 0),
    ready_at             timestamptz NOT NULL DEFAULT now(),
    -- the fence token: bumped by every claim; attempts carry the value they were claimed with
    generation           bigint NOT NULL DEFAULT 0 CHECK (generation >= 0),
    requires_approval    boolean NOT NULL DEFAULT false,
    approved_at          timestamptz,
    approved_by          text,
    pending_dependencies integer NOT NULL DEFAULT 0 CHECK (pending_dependencies >= 0),
    cancel_requested_at  timestamptz,
    cancel_requested_by  text,
    idempotency_key      text CHECK (length(idempotency_key) BETWEEN 1 AND 200),
    submitted_by         text NOT NULL DEFAULT 'cli',
    last_error           text,
    created_at           timestamptz NOT NULL DEFAULT now(),
    started_at           timestamptz,
    finished_at          timestamptz,
    CHECK (state <> 'blocked'
           OR pending_dependencies > 0
           OR (requires_approval AND approved_at IS NULL)),
    CHECK ((state IN ('succeeded', 'failed', 'cancelled', 'superseded')) = (finished_at IS NOT NULL)),
    CHECK (state <> 'uncertain' OR target_id IS NOT NULL)
);

-- The claim's filter-and-order: queued jobs of one (project, pool) by priority then age.
-- Partial, so finished history never enters the hot index.
CREATE INDEX jobs_claim_idx ON jobs (project_id, pool_id, priority DESC, id) WHERE state = 'queued';
CREATE INDEX jobs_blocked_idx ON jobs (project_id, pool_id) WHERE state = 'blocked';
-- The target's head probe (pgd_target_head): queued deployments of one target by priority,
-- then id either way (a fixed priority's ids scan both directions).
CREATE INDEX jobs_target_queue_idx ON jobs (target_id, priority DESC, id)
    WHERE state = 'queued' AND target_id IS NOT NULL;
-- A target's superseded deployments, newest first, and their count (the target page).
CREATE INDEX jobs_target_superseded_idx ON jobs (target_id, id) INCLUDE (finished_at)
    WHERE state = 'superseded';
-- Every job that is not running and not finished, by id: the queue page (keyset by id) and
-- the queue summary read only these, however much finished history the table holds.
CREATE INDEX jobs_waiting_idx ON jobs (id) INCLUDE (project_id, pool_id)
    WHERE state IN ('blocked', 'queued', 'uncertain');
-- The waiting jobs of one (project, pool) by id: the queue's organization, project and pool
-- filters and its reasons that hold for a whole (project, pool) read one range per pair that
-- can match (reads.list_waiting), not every waiting job.
CREATE INDEX jobs_waiting_pair_idx ON jobs (project_id, pool_id, id)
    WHERE state IN ('blocked', 'queued', 'uncertain');
-- The waiting jobs of one (project, pool) by how long they have waited (pgd_waiting_since,
-- sql/functions/summaries.sql, written out: an index expression must not change under its
-- entries), then id: the queue longest waiting first reads one range per pair
-- (list_waiting_jobs_of_pairs_by_age) instead of sorting every waiting job.
CREATE INDEX jobs_waiting_age_idx ON jobs
    (project_id, pool_id, (CASE WHEN state = 'blocked' THEN created_at ELSE ready_at END), id)
    WHERE state IN ('blocked', 'queued', 'uncertain');
-- The waiting jobs that can have a reason of their own (blocked, uncertain, a deployment,
-- delayed: ready later than created), by id: the queue's dependency, approval, delay and
-- target reasons and its target filter read these only. A plain ready build has no entry.
CREATE INDEX jobs_waiting_special_idx ON jobs (id)
    WHERE state IN ('blocked', 'queued', 'uncertain')
      AND (state <> 'queued' OR target_id IS NOT NULL OR ready_at > created_at
           OR pending_dependencies > 0 OR requires_approval);
CREATE INDEX jobs_active_idx ON jobs (project_id) WHERE state IN ('running', 'uncertain');
CREATE INDEX jobs_finished_idx ON jobs (finished_at) WHERE finished_at IS NOT NULL;
-- The jobs list's target filter: one target's jobs by id (deployments only).
CREATE INDEX jobs_target_idx ON jobs (target_id, id) WHERE target_id IS NOT NULL;
-- The jobs list's pool filter: one pool's jobs by id. A full index (a rare pool's jobs are
-- otherwise found by walking jobs_pkey through the whole history: 4.7 s at 11M jobs); its
-- write cost per job is in docs/benchmarks.md, "Console at scale".
CREATE INDEX jobs_pool_idx ON jobs (pool_id, id);
-- The jobs list's age filter: jobs by creation time, then id. With `older_than` the list is in
-- this order (list_jobs), read from the age bound down, instead of walking every newer job
-- by id (1.33M rows for a day at 11M jobs). A full index; its write cost per job is in
-- docs/benchmarks.md, "Console at scale".
CREATE INDEX jobs_created_idx ON jobs (created_at, id);
-- The Jobs page and `jobs list`: newest first within a state, keyset by id.
CREATE INDEX jobs_state_idx ON jobs (state, id);
-- One job per (project, idempotency key); partial, so unkeyed jobs add no entry. pgd_submit's
-- INSERT ... ON CONFLICT names this index's columns and predicate.
CREATE UNIQUE INDEX jobs_idempotency_key_idx ON jobs (project_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- Never two deployments on one target, enforced by the database itself.
CREATE UNIQUE INDEX jobs_one_holder_per_target ON jobs (target_id)
    WHERE state IN ('running', 'uncertain') AND target_id IS NOT NULL;
-- The job search (search_jobs, sql/jobs.sql): `pgd_command_text(command) ILIKE '%word%'` is a
-- trigram search of this index. The command as one text, its words joined by spaces; an
-- IMMUTABLE wrapper because array_to_string is only STABLE. It belongs to the schema, not to
-- sql/functions/ (whose files are reloaded by every upgrade): a body replaced under the index
-- would leave entries that no longer match it, so a change is a migration that rebuilds it.
-- An expression index, not a generated column: the text is kept in the index only
-- (docs/benchmarks.md, "Finding a job").
CREATE FUNCTION pgd_command_text(p_command text[]) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN array_to_string(p_command, ' ');
CREATE INDEX jobs_command_trgm_idx ON jobs
    USING gin (pgd_command_text(command) pgdispatch_ext.gin_trgm_ops);
-- Its statistics from a 300,000-row sample (ANALYZE's default is 30,000): the planner's guess
-- of a word's matches, which decides whether the search ANDs this index's bitmap with a
-- jobs_pkey range (its window: search_jobs), is then steady instead of off by 100 times.
ALTER INDEX jobs_command_trgm_idx ALTER COLUMN 1 SET STATISTICS 1000;
-- A search narrowed to one project or one submitter reads that one's jobs newest first (or
-- ANDs their bitmap with the trigram one) instead of every job whose command has the word
-- (docs/benchmarks.md, "Finding a job": without them a rare submitter with a common word
-- read the whole history).
CREATE INDEX jobs_project_idx ON jobs (project_id, id);
CREATE INDEX jobs_submitter_idx ON jobs (submitted_by, id);

ALTER TABLE targets ADD CONSTRAINT targets_holder_job_fk
    FOREIGN KEY (holder_job_id) REFERENCES jobs (id);
CREATE UNIQUE INDEX targets_holder_idx ON targets (holder_job_id) WHERE holder_job_id IS NOT NULL;

-- A project-and-target pair that supersedes: a newer deployment of the project to the target
-- supersedes that project's older waiting ones to it (`apply`: [[projects]]
-- supersede_targets; pgd_submit).
CREATE TABLE project_target_supersede (
    project_id bigint NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    target_id  bigint NOT NULL REFERENCES targets (id),
    PRIMARY KEY (project_id, target_id)
);
CREATE INDEX project_target_supersede_target_idx ON project_target_supersede (target_id);

CREATE TABLE job_dependencies (
    job_id            bigint NOT NULL REFERENCES jobs (id),
    depends_on_job_id bigint NOT NULL REFERENCES jobs (id),
    PRIMARY KEY (job_id, depends_on_job_id),
    CHECK (job_id <> depends_on_job_id)
);
CREATE INDEX job_dependencies_upstream_idx ON job_dependencies (depends_on_job_id);

CREATE TABLE attempts (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id            bigint NOT NULL REFERENCES jobs (id),
    attempt_no        integer NOT NULL CHECK (attempt_no >= 1),
    generation        bigint NOT NULL CHECK (generation >= 1),
    runner_id         bigint NOT NULL REFERENCES runners (id),
    -- supplied by the claimer, so that after a lost connection it can ask whether its claim committed
    claim_token       uuid NOT NULL UNIQUE,
    state             text NOT NULL CHECK (state IN ('running', 'succeeded', 'failed', 'expired',
                                                     'cancelled', 'lost')),
    claimed_at        timestamptz NOT NULL DEFAULT now(),
    lease_expires_at  timestamptz NOT NULL,
    last_heartbeat_at timestamptz,
    finished_at       timestamptz,
    exit_code         integer,
    error             text,
    output_tail       text,
    -- the stripes (capacity_stripes.stripe_no) of the organization slot and the pool slot
    -- the attempt holds while it runs: a release subtracts from these
    organization_stripe smallint,
    pool_stripe         smallint,
    -- the job's ready_at when this attempt claimed it: its wait is claimed_at - ready_at
    -- (the overview's wait chart, queue_history); NULL for attempts claimed before 0010
    ready_at            timestamptz,
    -- the stripe (project_running_stripes.stripe_no) of its project's running count it
    -- counts on while it runs; NULL for attempts claimed before 0017 that had ended by then
    project_stripe      smallint,
    UNIQUE (job_id, attempt_no),
    UNIQUE (job_id, generation),
    CHECK ((state = 'running') = (finished_at IS NULL))
);
-- At most one running attempt per job, enforced by the database.
CREATE UNIQUE INDEX attempts_one_running_per_job ON attempts (job_id) WHERE state = 'running';
-- The expiry pass scans only running attempts by lease.
CREATE INDEX attempts_lease_idx ON attempts (lease_expires_at) WHERE state = 'running';
CREATE INDEX attempts_runner_idx ON attempts (runner_id) WHERE state = 'running';
-- A runner's ended attempts by job: the jobs list's runner filter (list_jobs; its running
-- ones are attempts_runner_idx's). Partial: an entry when an attempt ends, none for its
-- claim or its heartbeats (each a new row version of a running attempt).
CREATE INDEX attempts_runner_done_idx ON attempts (runner_id, job_id) WHERE state <> 'running';

-- Claim tokens voided by a recovery (pgd_recover_claims, sql/functions/claim.sql): a claim
-- that carries one of them fails at its last step, so nothing of it commits. Written only
-- after a claim's answer was lost; a claim only reads it. Kept a day (why: claim.sql).
CREATE TABLE claim_tombstones (
    claim_token uuid PRIMARY KEY,
    runner_id   bigint,
    voided_at   timestamptz NOT NULL DEFAULT now()
);

-- The first answer to each completion's receipt key; append-only (sql/functions/audit.sql).
CREATE TABLE delivery_receipts (
    key        text PRIMARY KEY CHECK (length(key) BETWEEN 1 AND 200),
    attempt_id bigint NOT NULL REFERENCES attempts (id),
    outcome    text NOT NULL,
    response   jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Append-only (triggers in sql/functions/audit.sql); the actor is the authenticated identity
-- (pgd_authorize), the login the database login that wrote the event (a SECURITY DEFINER
-- transition keeps session_user).
CREATE TABLE audit_events (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    actor   text NOT NULL,
    action  text NOT NULL,
    subject text NOT NULL,
    reason  text,
    details jsonb NOT NULL DEFAULT '{}',
    login   text NOT NULL DEFAULT session_user,
    -- the job the event is about, for the job's own audit trail: its subject job:N (submit,
    -- approve, cancel, retry), or the job a target resolution decided (details.job_id:
    -- resolve_target, late_report). Generated, so that no transition can forget it.
    job_id  bigint GENERATED ALWAYS AS (
        CASE WHEN subject ~ '^job:[0-9]{1,18}$' THEN substr(subject, 5)::bigint
             WHEN details ->> 'job_id' ~ '^[0-9]{1,18}$' THEN (details ->> 'job_id')::bigint
        END) STORED
);
CREATE INDEX audit_events_subject_idx ON audit_events (subject, id DESC);
CREATE INDEX audit_events_at_idx ON audit_events (at DESC);
CREATE INDEX audit_events_job_idx ON audit_events (job_id, id) WHERE job_id IS NOT NULL;

-- Refreshed every few seconds by a scheduler job (summarize_queue); the overview reads it
-- instead of counting job rows.
CREATE TABLE queue_summaries (
    project_id      bigint NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    pool_id         bigint NOT NULL REFERENCES pools (id),
    -- queued and ready, of which target_held / target_uncertain wait on their target
    queued_ready    integer NOT NULL,
    target_held     integer NOT NULL,
    target_uncertain integer NOT NULL,
    queued_delayed  integer NOT NULL,
    -- blocked jobs by their durable blocker (dependency first, as in explain's precedence)
    blocked_dependency integer NOT NULL,
    blocked_approval integer NOT NULL,
    oldest_ready_at timestamptz,
    refreshed_at    timestamptz NOT NULL,
    -- for counting every reason of a job (sql/explain.py summary_any_reason_counts): waiting
    -- jobs (blocked or queued, delayed too) awaiting approval, also behind a dependency;
    -- whose target is held by another deployment; whose target is uncertain
    any_approval    integer NOT NULL DEFAULT 0,
    any_target_held integer NOT NULL DEFAULT 0,
    any_target_uncertain integer NOT NULL DEFAULT 0,
    -- the oldest "waiting since" of each class of jobs sharing a primary reason (created_at of
    -- a blocked job, ready_at of a queued ready one; delayed jobs are not waiting yet):
    -- blocked_dependency, blocked_approval, the queued ready ones whose target is held, is
    -- uncertain, or neither (oldest_free_at)
    oldest_dependency_at timestamptz,
    oldest_approval_at timestamptz,
    oldest_target_held_at timestamptz,
    oldest_target_uncertain_at timestamptz,
    oldest_free_at  timestamptz,
    -- queued ready deployments that are not their target's head (reason target_order, which
    -- comes before target_held: those are not counted in target_held / target_uncertain /
    -- oldest_free_at), and the oldest ready_at among them
    target_order    integer NOT NULL DEFAULT 0,
    oldest_target_order_at timestamptz,
    PRIMARY KEY (project_id, pool_id)
);

-- Rolled-up history of each pool's queue for the console's charts: one row per pool per
-- minute (the summaries duty upserts the current minute, sql/functions/summaries.sql); the
-- cleanup duty deletes rows older than 7 days.
CREATE TABLE queue_history (
    at                  timestamptz NOT NULL,  -- the minute (date_trunc('minute', ...))
    pool_id             bigint NOT NULL REFERENCES pools (id),
    waiting             integer NOT NULL,      -- queued and ready
    running             integer NOT NULL,      -- running attempts
    oldest_wait_seconds double precision,      -- of the oldest ready job; NULL when none waits
    -- attempts of the pool claimed in that minute, and their wait (claimed_at - ready_at)
    claimed             integer NOT NULL DEFAULT 0 CHECK (claimed >= 0),
    wait_p50_seconds    double precision,      -- NULL when nothing was claimed
    wait_p95_seconds    double precision,
    PRIMARY KEY (at, pool_id)
);

-- Waiting jobs by primary reason (sql/explain.py, summary_reason_counts), one row per reason
-- per minute: one snapshot, the minute's pass that counted the most. Written by the summaries duty
-- (pgd_record_reason_counts, sql/functions/summaries.sql); pruned with queue_history.
CREATE TABLE queue_reason_history (
    at      timestamptz NOT NULL,                -- the minute
    reason  text NOT NULL CHECK (reason ~ '^[a-z_]{1,40}$'),
    waiting integer NOT NULL CHECK (waiting >= 0),
    PRIMARY KEY (at, reason)
);

-- The elected duties, one row each: what one scheduler suffices for (summaries, expiry,
-- cleanup). A runner's keep-alive renews the duties it holds and takes over a lapsed one
-- (pgd_beat_runner, sql/functions/runners.sql); term is the fence of a holding: bumped on
-- every takeover, carried by each duty run, which stamps last_done_at only while it holds.
CREATE TABLE duty_leases (
    duty         text PRIMARY KEY CHECK (duty IN ('summaries', 'expiry', 'cleanup')),
    runner_id    bigint REFERENCES runners (id),
    term         bigint NOT NULL DEFAULT 0 CHECK (term >= 0),
    held_since   timestamptz,
    expires_at   timestamptz NOT NULL DEFAULT '-infinity',
    last_done_at timestamptz,
    done_count   bigint NOT NULL DEFAULT 0  -- duty runs stamped, ever (tests count them)
);
INSERT INTO duty_leases (duty) VALUES ('summaries'), ('expiry'), ('cleanup');

-- Organization and pool capacity, as pgd_capacity_stripes() (8) stripes per owner: stripe k
-- holds `held` of its `cap` slots. How claims, releases and limit changes use them, and the
-- invariant sum(cap) - owed = limit: sql/functions/capacity.sql. Organizations and pools are
-- never deleted (config apply only upserts), so owner_id has no foreign key: one table for
-- both kinds lets a release lock and update all its stripes in one ordered statement.
-- fillfactor 20 leaves room on each page for the row's next version (a HOT update, no index
-- entry): the rows are few and updated on every claim and release.
CREATE TABLE capacity_stripes (
    kind      text NOT NULL CHECK (kind IN ('organization', 'pool')),
    owner_id  bigint NOT NULL,
    stripe_no smallint NOT NULL CHECK (stripe_no BETWEEN 1 AND 8),
    cap       integer NOT NULL,
    held      integer NOT NULL DEFAULT 0,
    CHECK (held >= 0 AND held <= cap),
    PRIMARY KEY (kind, owner_id, stripe_no)
) WITH (fillfactor = 20);

-- A project's running jobs, counted on up to pgd_capacity_stripes() (8) stripes: stripe k
-- counts `running` of them; the project's running count is the sum (pgd_project_running).
-- A stripe row is made by the first claim that counts on it. How claims and releases keep
-- it: sql/functions/capacity.sql. fillfactor 20, as capacity_stripes: few rows, updated by
-- every claim and release (HOT updates).
CREATE TABLE project_running_stripes (
    project_id bigint NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    stripe_no  smallint NOT NULL CHECK (stripe_no BETWEEN 1 AND 8),
    running    integer NOT NULL DEFAULT 0 CHECK (running >= 0),
    PRIMARY KEY (project_id, stripe_no)
) WITH (fillfactor = 20);

-- Slots owed: a limit lowered below the slots held is paid back as jobs end. No row while
-- nothing is owed (the usual case: a release probes for any row first).
CREATE TABLE capacity_debts (
    kind     text NOT NULL CHECK (kind IN ('organization', 'pool')),
    owner_id bigint NOT NULL,
    owed     integer NOT NULL CHECK (owed > 0),
    PRIMARY KEY (kind, owner_id)
);

-- What a keyed submit asked for, as pgd_submit_request built it (sql/functions/submit.sql).
-- Written once, with the job; a repeated key is compared with it.
CREATE TABLE idempotent_requests (
    job_id  bigint PRIMARY KEY REFERENCES jobs (id),
    request jsonb NOT NULL
);

-- One item of pgd_complete_batch's fast path, as read under the batch's locks.
CREATE TYPE pgd_fast_completion AS (
    ord bigint, attempt_id bigint, job_id bigint, org_id bigint, project_id bigint, pool_id bigint,
    receipt_key text, exit_code integer, error text, output_tail text, ready_at timestamptz
);
