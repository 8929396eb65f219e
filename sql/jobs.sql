-- name: submit^
-- Enqueue one job (audited) after validating project, pool grant, target and dependencies; see pgd_submit (sql/functions/submit.sql).
SELECT * FROM pgd_submit(:project, :pool, :target, CAST(:command AS text[]), :priority,
                         :max_attempts, :timeout_seconds, :delay_seconds, :requires_approval,
                         CAST(:depends_on AS bigint[]), :idempotency_key, :submitted_by);

-- name: get_job^
-- One job with the names of its project, organization, pool and target, and its times in
-- seconds by the database clock: age (now - created_at), duration (created to finished,
-- once it ended), waiting since (ready_at of a queued job whose ready_at has passed,
-- created_at of a blocked one; none otherwise) and for how long, running for (now - the
-- running attempt's claimed_at). Read-only.
SELECT j.*, p.name AS project, o.id AS organization_id, o.name AS organization,
       q.name AS pool, t.name AS target,
       ARRAY(SELECT d.depends_on_job_id FROM job_dependencies d
              WHERE d.job_id = j.id ORDER BY 1) AS depends_on,
       extract(epoch FROM now() - j.created_at)::float8 AS age_seconds,
       extract(epoch FROM j.finished_at - j.created_at)::float8 AS duration_seconds,
       w.waiting_since,
       extract(epoch FROM now() - w.waiting_since)::float8 AS waiting_seconds,
       extract(epoch FROM now() - (SELECT a.claimed_at FROM attempts a
                                    WHERE a.job_id = j.id AND a.state = 'running'))::float8
           AS running_seconds
  FROM jobs j
  JOIN projects p ON p.id = j.project_id
  JOIN organizations o ON o.id = p.organization_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 CROSS JOIN LATERAL (SELECT CASE WHEN j.state = 'queued' AND j.ready_at <= now() THEN j.ready_at
                                 WHEN j.state = 'blocked' THEN j.created_at END AS waiting_since) w
 WHERE j.id = :job_id;

-- name: list_pending_dependencies
-- The dependencies of a job that have not succeeded yet. Read-only.
SELECT u.id, u.state, p.name AS project
  FROM job_dependencies d JOIN jobs u ON u.id = d.depends_on_job_id
  JOIN projects p ON p.id = u.project_id
 WHERE d.job_id = :job_id AND u.state <> 'succeeded'
 ORDER BY u.id;

-- name: approve_job$
-- Approve a job that requires approval (conditional, audited); see pgd_approve_job.
SELECT pgd_approve_job(:job_id, :reason, :actor);

-- name: cancel_job$
-- Cancel a waiting job, or ask the runner of a running one to stop (conditional, audited).
SELECT pgd_cancel_job(:job_id, :reason, :actor);

-- name: retry_job$
-- Queue a failed or cancelled job again (conditional, audited); see pgd_retry_job.
SELECT pgd_retry_job(:job_id, :reason, :actor);

-- name: set_priority$
-- Set the priority of a waiting job (conditional, audited); see pgd_set_priority.
SELECT pgd_set_priority(:job_id, :priority, :reason, :actor);

-- name: bulk_begin$
-- Write a bulk action's one audit event before any job changes; see pgd_bulk_begin (sql/functions/bulk.sql).
SELECT pgd_bulk_begin(:action, CAST(:filter AS jsonb), :requested, :truncated, :priority, :reason, :actor);

-- name: bulk_apply
-- One batch of a bulk action: each job locked in id order, changed if still as previewed, else skipped; see pgd_bulk_apply.
SELECT * FROM pgd_bulk_apply(:bulk_event_id, CAST(:job_ids AS bigint[]),
                             CAST(:generations AS bigint[]), :actor);

-- name: list_bulk_candidates
-- The jobs in :states (ids and what a bulk preview shows of them) matching the job list's
-- filters (pgd_job_list_match) and among :job_ids (NULL: any), by id from :after_id, at
-- most :limit: one forward range of
-- jobs_state_idx per state (the state matched as a range, as list_jobs explains). Read-only.
SELECT j.id, j.state, j.generation, j.priority, j.command, j.project_id, j.pool_id, j.target_id,
       j.ready_at, j.created_at, j.requires_approval, j.approved_at, j.submitted_by,
       j.pending_dependencies, j.failures, j.max_attempts, j.last_error,
       p.name AS project, o.id AS organization_id, o.name AS organization,
       q.name AS pool, t.name AS target
  FROM unnest(CAST(:states AS text[])) AS s(state)
 CROSS JOIN LATERAL (
       SELECT x.* FROM jobs x
        WHERE x.state >= s.state AND x.state <= s.state AND x.id > :after_id
          AND (CAST(:job_ids AS bigint[]) IS NULL OR x.id = ANY (CAST(:job_ids AS bigint[])))
          AND pgd_job_list_match(x, :project_ids, :pool_id, :target_id, :older_than_seconds,
                                 :younger_than_seconds)
          AND (CAST(:runner_id AS bigint) IS NULL
               OR (SELECT a.runner_id FROM attempts a WHERE a.job_id = x.id
                    ORDER BY a.attempt_no DESC LIMIT 1) = :runner_id)
        ORDER BY x.state, x.id LIMIT :limit) j
  JOIN projects p ON p.id = j.project_id
  JOIN organizations o ON o.id = p.organization_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 ORDER BY j.id
 LIMIT :limit;

-- name: list_waiting_jobs
-- Jobs not running and not finished, oldest first, keyset-paginated by id, with optional filters
-- (organization, project, pool, target names).
SELECT pgd_waiting_since(j.state, j.ready_at, j.created_at) AS waiting_since,
       j.id, j.state, j.priority, j.ready_at, j.created_at, j.requires_approval, j.approved_at, j.submitted_by,
       j.pending_dependencies, j.failures, j.max_attempts, j.target_id, j.pool_id, j.project_id,
       j.command, p.name AS project, o.id AS organization_id, o.name AS organization,
       q.name AS pool, t.name AS target
  FROM jobs j
  JOIN projects p ON p.id = j.project_id
  JOIN organizations o ON o.id = p.organization_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 WHERE j.state IN ('blocked', 'queued', 'uncertain')
   AND j.id > :after_id
   AND (CAST(:organization AS text) IS NULL OR o.name = :organization)
   AND (CAST(:project AS text) IS NULL OR p.name = :project)
   AND (CAST(:pool AS text) IS NULL OR q.name = :pool)
   AND (CAST(:target AS text) IS NULL OR t.name = :target)
 ORDER BY j.id
 LIMIT :limit;

-- name: list_waiting_jobs_of_pairs
-- As list_waiting_jobs, of the (project, pool) pairs :project_ids[i], :pool_ids[i] only
-- (the pairs a filter or a reason can match, reads.list_waiting), by id after :after_id:
-- one range of jobs_waiting_pair_idx per pair, each cut at :limit, then the first :limit of
-- them all. Read-only.
SELECT pgd_waiting_since(j.state, j.ready_at, j.created_at) AS waiting_since,
       j.id, j.state, j.priority, j.ready_at, j.created_at, j.requires_approval, j.approved_at, j.submitted_by,
       j.pending_dependencies, j.failures, j.max_attempts, j.target_id, j.pool_id, j.project_id,
       j.command, p.name AS project, o.id AS organization_id, o.name AS organization,
       q.name AS pool, t.name AS target
  FROM unnest(CAST(:project_ids AS bigint[]), CAST(:pool_ids AS bigint[])) AS u (project_id, pool_id)
 CROSS JOIN LATERAL (
       SELECT x.id FROM jobs x
        WHERE x.state IN ('blocked', 'queued', 'uncertain')
          AND x.project_id = u.project_id AND x.pool_id = u.pool_id
          AND x.id > CAST(:after_id AS bigint)
        -- the pair index's own order (by id, the pair being fixed): ordered by id alone,
        -- the planner may walk jobs_waiting_idx through every waiting job instead
        ORDER BY x.project_id, x.pool_id, x.id LIMIT :limit) page
  JOIN jobs j ON j.id = page.id
  JOIN projects p ON p.id = j.project_id
  JOIN organizations o ON o.id = p.organization_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 ORDER BY j.id
 LIMIT :limit;

-- name: list_waiting_special_jobs
-- As list_waiting_jobs, of the waiting jobs that can have a reason of their own (blocked,
-- uncertain, a deployment, delayed; the predicate of jobs_waiting_special_idx, which the
-- scan reads by id) after :after_id, with the optional ids of the filters: :project_ids
-- (any of them), :pool_id, :target_id. Read-only.
SELECT pgd_waiting_since(j.state, j.ready_at, j.created_at) AS waiting_since,
       j.id, j.state, j.priority, j.ready_at, j.created_at, j.requires_approval, j.approved_at, j.submitted_by,
       j.pending_dependencies, j.failures, j.max_attempts, j.target_id, j.pool_id, j.project_id,
       j.command, p.name AS project, o.id AS organization_id, o.name AS organization,
       q.name AS pool, t.name AS target
  FROM jobs j
  JOIN projects p ON p.id = j.project_id
  JOIN organizations o ON o.id = p.organization_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 WHERE j.state IN ('blocked', 'queued', 'uncertain')
   AND (j.state <> 'queued' OR j.target_id IS NOT NULL OR j.ready_at > j.created_at
        OR j.pending_dependencies > 0 OR j.requires_approval)
   AND j.id > :after_id
   AND (CAST(:project_ids AS bigint[]) IS NULL OR j.project_id = ANY (CAST(:project_ids AS bigint[])))
   AND (CAST(:pool_id AS bigint) IS NULL OR j.pool_id = :pool_id)
   AND (CAST(:target_id AS bigint) IS NULL OR j.target_id = :target_id)
 ORDER BY j.id
 LIMIT :limit;

-- name: list_waiting_jobs_of_pairs_by_age
-- As list_waiting_jobs_of_pairs, longest waiting first: by waiting since (pgd_waiting_since),
-- then id, keyset-paginated after (:after_since, :after_id) (:after_since NULL: from the
-- start). One range of jobs_waiting_age_idx (project_id, pool_id, waiting since, id) per
-- pair, each cut at :limit, then the first :limit of them all: a page costs pairs x :limit
-- index entries, not a sort of every waiting job. pgd_waiting_since is inlined to the
-- index's expression. Read-only.
SELECT pgd_waiting_since(j.state, j.ready_at, j.created_at) AS waiting_since,
       j.id, j.state, j.priority, j.ready_at, j.created_at, j.requires_approval, j.approved_at, j.submitted_by,
       j.pending_dependencies, j.failures, j.max_attempts, j.target_id, j.pool_id, j.project_id,
       j.command, p.name AS project, o.id AS organization_id, o.name AS organization,
       q.name AS pool, t.name AS target
  FROM unnest(CAST(:project_ids AS bigint[]), CAST(:pool_ids AS bigint[])) AS u (project_id, pool_id)
 CROSS JOIN LATERAL (
       SELECT x.id, pgd_waiting_since(x.state, x.ready_at, x.created_at) AS waiting_since
         FROM jobs x
        WHERE x.state IN ('blocked', 'queued', 'uncertain')
          AND x.project_id = u.project_id AND x.pool_id = u.pool_id
          -- from the start when no cursor: every waiting since is after -infinity
          AND (pgd_waiting_since(x.state, x.ready_at, x.created_at), x.id)
              > (coalesce(CAST(:after_since AS timestamptz), '-infinity'),
                 coalesce(CAST(:after_id AS bigint), 0))
        ORDER BY pgd_waiting_since(x.state, x.ready_at, x.created_at), x.id LIMIT :limit) page
  JOIN jobs j ON j.id = page.id
  JOIN projects p ON p.id = j.project_id
  JOIN organizations o ON o.id = p.organization_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 ORDER BY page.waiting_since, j.id
 LIMIT :limit;

-- name: list_waiting_special_jobs_by_age
-- As list_waiting_special_jobs, longest waiting first, keyset-paginated after
-- (:after_since, :after_id) as list_waiting_jobs_of_pairs_by_age: the jobs of
-- jobs_waiting_special_idx (few: a plain ready build has no entry) that pass the filters,
-- sorted. Read-only.
SELECT pgd_waiting_since(j.state, j.ready_at, j.created_at) AS waiting_since,
       j.id, j.state, j.priority, j.ready_at, j.created_at, j.requires_approval, j.approved_at, j.submitted_by,
       j.pending_dependencies, j.failures, j.max_attempts, j.target_id, j.pool_id, j.project_id,
       j.command, p.name AS project, o.id AS organization_id, o.name AS organization,
       q.name AS pool, t.name AS target
  FROM jobs j
  JOIN projects p ON p.id = j.project_id
  JOIN organizations o ON o.id = p.organization_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 WHERE j.state IN ('blocked', 'queued', 'uncertain')
   AND (j.state <> 'queued' OR j.target_id IS NOT NULL OR j.ready_at > j.created_at
        OR j.pending_dependencies > 0 OR j.requires_approval)
   AND (pgd_waiting_since(j.state, j.ready_at, j.created_at), j.id)
       > (coalesce(CAST(:after_since AS timestamptz), '-infinity'),
          coalesce(CAST(:after_id AS bigint), 0))
   AND (CAST(:project_ids AS bigint[]) IS NULL OR j.project_id = ANY (CAST(:project_ids AS bigint[])))
   AND (CAST(:pool_id AS bigint) IS NULL OR j.pool_id = :pool_id)
   AND (CAST(:target_id AS bigint) IS NULL OR j.target_id = :target_id)
 ORDER BY 1, j.id
 LIMIT :limit;

-- name: list_recent_jobs
-- The most recently created jobs of every state, newest first, keyset-paginated by id. Read-only.
SELECT j.id, j.state, j.priority, j.created_at, j.started_at, j.finished_at, j.last_error,
       j.command, p.name AS project, q.name AS pool, t.name AS target
  FROM jobs j
  JOIN projects p ON p.id = j.project_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 WHERE j.id < :before_id
 ORDER BY j.id DESC
 LIMIT :limit;

-- name: list_recent_jobs_in_state
-- The most recently created jobs of one state, newest first, keyset-paginated by id: one
-- backward range of jobs_state_idx (state, id) from (:state, :before_id), however many newer
-- jobs of other states (the queue, the history) lie between them. The state is matched as a
-- range (>= and <=), not with "=": with an equality the planner treats the state as a
-- constant, jobs_pkey yields the same order, and a generic plan (a connection's prepared
-- statement after a few calls) walks jobs_pkey back through every newer job filtering on
-- state. Only jobs_state_idx yields (state DESC, id DESC). (A row comparison (state, id) <
-- (:state, :before_id) also positions the scan, but its estimate of about one row made the
-- planner fetch every job of a rare state and sort them.) Read-only.
SELECT j.id, j.state, j.priority, j.created_at, j.started_at, j.finished_at, j.last_error,
       j.command, p.name AS project, q.name AS pool, t.name AS target
  FROM jobs j
  JOIN projects p ON p.id = j.project_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
 WHERE j.state >= :state AND j.state <= :state
   AND j.id < :before_id
 ORDER BY j.state DESC, j.id DESC
 LIMIT :limit;

-- name: count_jobs_by_state
-- Exact jobs in each active state, and jobs finished in the last hour by state (the demo's
-- throttle). Each state is a literal, so that each count reads only its own partial index
-- (a state passed as a parameter, as in unnest(ARRAY[...]), gets one plan for every state:
-- a scan of the whole table, history included). Queued and blocked cost O(waiting jobs):
-- the console reads those from the queue summary instead (count_recent_jobs_by_state).
SELECT 'blocked' AS state, (SELECT count(*) FROM jobs WHERE state = 'blocked') AS n
UNION ALL
SELECT 'queued', (SELECT count(*) FROM jobs WHERE state = 'queued')
UNION ALL
SELECT 'running', (SELECT count(*) FROM jobs WHERE state = 'running')
UNION ALL
SELECT 'uncertain', (SELECT count(*) FROM jobs WHERE state = 'uncertain')
UNION ALL
SELECT s.state, count(j.state)
  FROM unnest(ARRAY['succeeded', 'failed', 'cancelled', 'superseded']) AS s(state)
  LEFT JOIN jobs j ON j.state = s.state AND j.finished_at > now() - interval '1 hour'
 GROUP BY s.state;

-- name: count_recent_jobs_by_state
-- Jobs running or uncertain now, and jobs finished in the last hour by state: the overview's
-- exact counts, whose cost is bounded by capacity and by one hour of completions however
-- long the queue and the history (jobs_active_idx; one range scan of jobs_finished_idx).
-- Read-only.
SELECT 'running' AS state, (SELECT count(*) FROM jobs WHERE state = 'running') AS n
UNION ALL
SELECT 'uncertain', (SELECT count(*) FROM jobs WHERE state = 'uncertain')
UNION ALL
SELECT s.state, count(j.state)
  FROM unnest(ARRAY['succeeded', 'failed', 'cancelled', 'superseded']) AS s(state)
  LEFT JOIN jobs j ON j.state = s.state AND j.finished_at > now() - interval '1 hour'
 GROUP BY s.state;

-- name: find_job_filters^
-- The ids of the names a job list filters by (NULL for a name given that does not exist,
-- and for one not given), the runner id when that runner exists, and the project ids the
-- organization and project filters leave (NULL when neither is given; reads.list_jobs).
-- Read-only.
SELECT (SELECT id FROM organizations WHERE name = :organization) AS organization_id,
       (SELECT id FROM projects WHERE name = :project) AS project_id,
       CASE WHEN CAST(:organization AS text) IS NOT NULL OR CAST(:project AS text) IS NOT NULL
            THEN ARRAY(SELECT p.id FROM projects p
                        WHERE (CAST(:project AS text) IS NULL OR p.name = :project)
                          AND (CAST(:organization AS text) IS NULL
                               OR p.organization_id = (SELECT o.id FROM organizations o
                                                        WHERE o.name = :organization))
                        ORDER BY p.id) END AS project_ids,
       (SELECT id FROM pools WHERE name = :pool) AS pool_id,
       (SELECT id FROM targets WHERE name = :target) AS target_id,
       (SELECT id FROM runners WHERE id = :runner_id) AS runner_id;

-- name: begin_job_list^
-- The database's time for a job list's ages, and this transaction's statements planned with
-- their values (SET LOCAL plan_cache_mode), prepared or not: the job lists' filters are
-- optional, and a generic plan, which cannot know which are unset, guesses them all
-- selective and reads a whole state's range to sort it (list_jobs). Read-only.
SELECT now() AS now, set_config('plan_cache_mode', 'force_custom_plan', true) AS plan_cache_mode;

-- name: find_job_list_bounds^
-- The two ends of a job list's range in creation order (list_jobs with an age bound), each
-- a (created_at, id) to compare a row with: above, the nearer of the cursor :before_id and
-- the age bound (older than :older_than_seconds), as (upper_at, upper_id) with the row
-- below it; beneath, the nearer of the cursor :after_id and the bound younger than
-- :younger_than_seconds, as (lower_at, lower_id) with the row above it. Given both a cursor
-- and an age bound, a b-tree cannot tell which of a row comparison and a plain bound is
-- nearer (PostgreSQL 18 started from the age bound and walked down to a cursor deep in the
-- history, or went on past a before_id up to the age bound), so each end is one row
-- comparison: created_at <= T is (created_at, id) < (T + 1 microsecond, 0) (times are in
-- microseconds, ids from 1), created_at > Y is (created_at, id) > (Y, the largest id). A
-- cursor stands at its job's created_at, found by a probe of jobs_pkey, or when that id is
-- no job's (a job deleted, an id never given) at the next job's above it by id (before_id)
-- or below it (after_id), and bounds nothing when there is none; where creation follows the
-- ids, such a cursor then cuts the list where it cuts the id order. Values, not
-- subqueries of list_jobs: its plan then sees how much of jobs_created_idx lies between
-- them. Read-only.
SELECT least(c.before_at, now() - make_interval(secs => :older_than_seconds)
                          + interval '1 microsecond') AS upper_at,
       CASE WHEN c.before_at <= now() - make_interval(secs => :older_than_seconds)
            THEN CAST(:before_id AS bigint) ELSE 0 END AS upper_id,
       coalesce(greatest(c.after_at, now() - make_interval(secs => :younger_than_seconds)),
                '-infinity') AS lower_at,
       CASE WHEN c.after_at > coalesce(now() - make_interval(secs => :younger_than_seconds), '-infinity')
            THEN CAST(:after_id AS bigint) ELSE 9223372036854775807 END AS lower_id
  FROM (SELECT (SELECT b.created_at FROM jobs b WHERE b.id >= :before_id ORDER BY b.id LIMIT 1) AS before_at,
               (SELECT a.created_at FROM jobs a WHERE a.id <= :after_id ORDER BY a.id DESC LIMIT 1) AS after_at) c;

-- name: list_jobs
-- Jobs filtered (pgd_job_list_match, sql/functions/lists.sql), keyset-paginated: with
-- :after_id NULL the newest below the cursor :before_id, newest first; else the oldest above
-- :after_id (and below :before_id), oldest first. Newest by id, or with an age bound
-- (:older_than_seconds, and no :runner_id) by creation, (created_at, id), the cursors at
-- their places in the range (:upper_at, :upper_id) .. (:lower_at, :lower_id)
-- (find_job_list_bounds): "older than a day" is then
-- one range of jobs_created_idx from the bound down, where the id order walked every job
-- newer than the bound (the queue, a day of history) before the first match.
-- :younger_than_seconds alone keeps the id order, which finds recent jobs first. In the id
-- order, of every state (:state NULL: jobs_pkey in the page's order) or of one (one range of
-- jobs_state_idx (state, id), backward for the newest, forward after :after_id; the state
-- is matched as a range for the reason list_recent_jobs_in_state gives: only then is
-- jobs_state_idx the index that yields the order). Each branch stops at :limit matches and
-- one-time filters on the parameters skip the others; the holders of a capacity (state
-- running and an organization, project, pool or target) are one range as long as the
-- running jobs. With :runner_id, the branches of that runner's attempts instead (by id,
-- newest or oldest first, and its running ones). The page's ids first, then their names,
-- latest attempt and runner for those rows only, in the page's order. Planned with its
-- values (begin_job_list). Read-only.
WITH page AS (
    (SELECT j.id FROM jobs j
      WHERE CAST(:state AS text) IS NULL AND CAST(:after_id AS bigint) IS NULL
        AND j.id < :before_id
        AND CAST(:older_than_seconds AS double precision) IS NULL
        AND pgd_job_list_match(j, :project_ids, :pool_id, :target_id, :older_than_seconds,
                               :younger_than_seconds)
        AND CAST(:runner_id AS bigint) IS NULL
      ORDER BY j.id DESC LIMIT :limit)
    UNION ALL
    (SELECT j.id FROM jobs j
      WHERE CAST(:state AS text) IS NULL AND j.id > :after_id AND j.id < :before_id
        AND CAST(:older_than_seconds AS double precision) IS NULL
        AND pgd_job_list_match(j, :project_ids, :pool_id, :target_id, :older_than_seconds,
                               :younger_than_seconds)
        AND CAST(:runner_id AS bigint) IS NULL
      ORDER BY j.id LIMIT :limit)
    UNION ALL
    (SELECT j.id FROM jobs j
      WHERE CAST(:after_id AS bigint) IS NULL
        AND j.state >= :state AND j.state <= :state AND j.id < :before_id
        AND CAST(:older_than_seconds AS double precision) IS NULL
        AND pgd_job_list_match(j, :project_ids, :pool_id, :target_id, :older_than_seconds,
                               :younger_than_seconds)
        AND CAST(:runner_id AS bigint) IS NULL
      ORDER BY j.state DESC, j.id DESC LIMIT :limit)
    UNION ALL
    (SELECT j.id FROM jobs j
      WHERE j.state >= :state AND j.state <= :state
        AND j.id > :after_id AND j.id < :before_id
        AND CAST(:older_than_seconds AS double precision) IS NULL
        AND pgd_job_list_match(j, :project_ids, :pool_id, :target_id, :older_than_seconds,
                               :younger_than_seconds)
        AND CAST(:runner_id AS bigint) IS NULL
      ORDER BY j.state, j.id LIMIT :limit)
    UNION ALL
    -- with an age bound (older than), in creation order: one range of jobs_created_idx
    -- (created_at, id), from below its upper end down (newest created first), or from above
    -- its lower end up (after_id, oldest first), a state a filter on it. Each end is one row
    -- comparison with a value of find_job_list_bounds (the nearer of a cursor and an age
    -- bound, and why one comparison: there), so pgd_job_list_match is not given those bounds
    -- again.
    (SELECT j.id FROM jobs j
      WHERE CAST(:older_than_seconds AS double precision) IS NOT NULL
        AND CAST(:runner_id AS bigint) IS NULL AND CAST(:after_id AS bigint) IS NULL
        AND (CAST(:state AS text) IS NULL OR j.state = :state)
        AND (j.created_at, j.id) < (CAST(:upper_at AS timestamptz), CAST(:upper_id AS bigint))
        AND pgd_job_list_match(j, :project_ids, :pool_id, :target_id, CAST(NULL AS double precision),
                               :younger_than_seconds)
      ORDER BY j.created_at DESC, j.id DESC LIMIT :limit)
    UNION ALL
    (SELECT j.id FROM jobs j
      WHERE CAST(:older_than_seconds AS double precision) IS NOT NULL
        AND CAST(:runner_id AS bigint) IS NULL AND CAST(:after_id AS bigint) IS NOT NULL
        AND (CAST(:state AS text) IS NULL OR j.state = :state)
        AND (j.created_at, j.id) > (CAST(:lower_at AS timestamptz), CAST(:lower_id AS bigint))
        AND (j.created_at, j.id) < (CAST(:upper_at AS timestamptz), CAST(:upper_id AS bigint))
        AND pgd_job_list_match(j, :project_ids, :pool_id, :target_id, CAST(NULL AS double precision),
                               CAST(NULL AS double precision))
      ORDER BY j.created_at, j.id LIMIT :limit)
    UNION ALL
    -- a runner's jobs (the runner of their latest attempt) are read from its attempts: the
    -- finished ones by job id (attempts_runner_done_idx), the latest attempt of their job
    -- only (no later one), and a running job's latest attempt is the running one
    -- (attempts_runner_idx: as many as its slots). The running ones never match a finished
    -- attempt, so a runner's running jobs do not walk its history.
    (SELECT a.job_id FROM attempts a JOIN jobs j ON j.id = a.job_id
      WHERE CAST(:after_id AS bigint) IS NULL AND CAST(:state AS text) IS DISTINCT FROM 'running'
        AND a.runner_id = :runner_id AND a.state <> 'running' AND a.job_id < :before_id
        AND NOT EXISTS (SELECT 1 FROM attempts b WHERE b.job_id = a.job_id AND b.attempt_no > a.attempt_no)
        AND (CAST(:state AS text) IS NULL OR j.state = :state)
        AND pgd_job_list_match(j, :project_ids, :pool_id, :target_id, :older_than_seconds,
                               :younger_than_seconds)
      ORDER BY a.job_id DESC LIMIT :limit)
    UNION ALL
    (SELECT a.job_id FROM attempts a JOIN jobs j ON j.id = a.job_id
      WHERE CAST(:state AS text) IS DISTINCT FROM 'running'
        AND a.runner_id = :runner_id AND a.state <> 'running'
        AND a.job_id > :after_id AND a.job_id < :before_id
        AND NOT EXISTS (SELECT 1 FROM attempts b WHERE b.job_id = a.job_id AND b.attempt_no > a.attempt_no)
        AND (CAST(:state AS text) IS NULL OR j.state = :state)
        AND pgd_job_list_match(j, :project_ids, :pool_id, :target_id, :older_than_seconds,
                               :younger_than_seconds)
      ORDER BY a.job_id LIMIT :limit)
    UNION ALL
    (SELECT a.job_id FROM attempts a JOIN jobs j ON j.id = a.job_id
      WHERE a.runner_id = :runner_id AND a.state = 'running'
        AND a.job_id > coalesce(CAST(:after_id AS bigint), 0) AND a.job_id < :before_id
        AND (CAST(:state AS text) IS NULL OR j.state = :state)
        AND pgd_job_list_match(j, :project_ids, :pool_id, :target_id, :older_than_seconds,
                               :younger_than_seconds))
)
SELECT j.id, j.state, j.priority, j.command, j.project_id, j.pool_id, j.target_id,
       p.name AS project, o.name AS organization, q.name AS pool, t.name AS target,
       j.created_at, j.ready_at, j.started_at, j.finished_at, j.last_error, j.submitted_by,
       j.requires_approval, j.approved_at, j.max_attempts,
       a.attempt_no, a.runner_id, r.name AS runner, a.claimed_at,
       -- never negative: a read inside the transaction that made the row has an older now()
       greatest(extract(epoch FROM now() - j.created_at), 0)::float8 AS age_seconds,
       CASE WHEN j.state = 'running'
            THEN greatest(extract(epoch FROM now() - a.claimed_at), 0)::float8 END AS running_seconds,
       extract(epoch FROM j.finished_at - j.started_at)::float8 AS duration_seconds
  FROM page
  JOIN jobs j ON j.id = page.id
  JOIN projects p ON p.id = j.project_id
  JOIN organizations o ON o.id = p.organization_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
  -- the latest attempt: the running one of a running job (attempt numbers only grow)
  LEFT JOIN LATERAL (SELECT x.attempt_no, x.runner_id, x.claimed_at FROM attempts x
                      WHERE x.job_id = j.id ORDER BY x.attempt_no DESC LIMIT 1) a ON true
  LEFT JOIN runners r ON r.id = a.runner_id
 -- the page's order: with an age bound (and no runner) by (created_at, id), else by id
 ORDER BY CASE WHEN CAST(:older_than_seconds AS double precision) IS NOT NULL
                AND CAST(:runner_id AS bigint) IS NULL AND CAST(:after_id AS bigint) IS NULL
               THEN j.created_at END DESC,
          CASE WHEN CAST(:older_than_seconds AS double precision) IS NOT NULL
                AND CAST(:runner_id AS bigint) IS NULL AND CAST(:after_id AS bigint) IS NOT NULL
               THEN j.created_at END,
          CASE WHEN CAST(:after_id AS bigint) IS NULL THEN -j.id ELSE j.id END
 -- a runner's page: its finished jobs' branch and its running jobs' branch together
 LIMIT :limit;

-- name: probe_recent_jobs^
-- The job search's first step (reads.search_jobs): of the newest :probe jobs below :before_id
-- that pass the filters (project, submitter, state; each NULL when not asked for), the ids of
-- those whose command text contains :pattern (an ILIKE pattern, matched as ILIKE matches it
-- in a multibyte encoding, lower() of both sides, each side lowered once: PostgreSQL docs
-- 9.7.1), newest first, how many were examined and the lowest and highest id examined (the
-- span the matches were found in, from which the second step sizes its window), and for
-- each pattern of :words (the text's words, in order) how many of them contain it
-- (word_hits: the sample the second step picks its index word by). Bounded whatever the
-- word: a word most commands contain is answered here, from jobs_pkey, jobs_project_idx or
-- jobs_submitter_idx read backwards. Read-only.
WITH c AS (
    SELECT j.id, lower(pgd_command_text(j.command)) AS text FROM jobs j
     WHERE j.id < coalesce(CAST(:before_id AS bigint), 9223372036854775807)
       AND j.id IS DISTINCT FROM CAST(:job_id AS bigint)
       AND (CAST(:project_id AS bigint) IS NULL OR j.project_id = :project_id)
       AND (CAST(:submitter AS text) IS NULL OR j.submitted_by = :submitter)
       AND (CAST(:state AS text) IS NULL OR j.state = :state)
     ORDER BY j.id DESC LIMIT :probe)
SELECT coalesce(array_agg(c.id ORDER BY c.id DESC) FILTER (WHERE c.text LIKE lower(:pattern)), '{}') AS ids,
       count(*) AS examined, min(c.id) AS lowest_id, max(c.id) AS highest_id,
       ARRAY(SELECT (SELECT count(*) FROM c WHERE c.text LIKE lower(w.p))
               FROM unnest(CAST(:words AS text[])) WITH ORDINALITY AS w (p, n)
              ORDER BY w.n) AS word_hits
  FROM c;

-- name: begin_job_search^
-- The job search's second step is planned with bitmap scans only (SET LOCAL, until
-- end_job_search puts the settings back): the trigram index, ANDed with the project's or
-- the submitter's b-tree, costs what the matches cost. An ordered scan of jobs_pkey or
-- jobs_project_idx that filters each row, which the planner prefers when it guesses the
-- word common, reads a whole history when the guess is wrong (a word common elsewhere and
-- absent from the project: 50,000 rows, 0.8 s at 1M jobs; docs/benchmarks.md). The probe
-- has already answered the words that are common among the newest jobs. Read-only.
SELECT current_setting('enable_indexscan') AS indexscan,
       current_setting('enable_seqscan') AS seqscan,
       set_config('enable_indexscan', 'off', true) AS indexscan_now,
       set_config('enable_seqscan', 'off', true) AS seqscan_now;

-- name: end_job_search^
-- The settings begin_job_search changed, back as they were in this transaction. Read-only.
SELECT set_config('enable_indexscan', :indexscan, true) AS indexscan,
       set_config('enable_seqscan', :seqscan, true) AS seqscan;

-- name: search_jobs
-- The job search's page (reads.search_jobs): job :job_id itself when asked for (first page
-- only: :before_id NULL), then the jobs :ids (the probe's matches) or, with :ids NULL, the
-- jobs whose command, as one text (pgd_command_text, the expression of
-- jobs_command_trgm_idx), matches the ILIKE :pattern, newest first below :before_id and from
-- :floor_id up (NULL: no floor), at most :limit, with the filters project, submitter
-- (submitted_by) and state, each NULL when not asked for. The trigram index is asked for
-- :narrow, a pattern every match of :pattern also matches (one of its words, or :pattern
-- itself), and :pattern is checked on the rows it finds as lower() LIKE lower(), which the
-- index does not serve (ILIKE's own comparison, each side lowered once: PostgreSQL docs
-- 9.7.1): GIN reads the whole posting list of every trigram it is asked for, so a word most
-- commands share ("feature" in "feature-1234") costs the search its whole history when it is
-- asked too. The floor is a jobs_pkey range the planner ANDs with the trigram bitmap, so
-- that only the window's rows are read from the heap (a word in a few thousand commands
-- costs what its matches among the newest cost, not all of them). Planned with its values
-- (begin_job_list) and bitmap scans only (begin_job_search). The same row as list_jobs
-- gives, and "match": id or command. Read-only.
-- The row is spelled out again, as aiosql shares no fragment between statements;
-- tests/sql/test_job_search.py checks that the two agree.
WITH page AS (
    (SELECT j.id, 'id' AS match FROM jobs j
      WHERE j.id = :job_id AND CAST(:before_id AS bigint) IS NULL
        AND (CAST(:project_id AS bigint) IS NULL OR j.project_id = :project_id)
        AND (CAST(:submitter AS text) IS NULL OR j.submitted_by = :submitter)
        AND (CAST(:state AS text) IS NULL OR j.state = :state))
    UNION ALL
    (SELECT x.id, 'command' FROM unnest(CAST(:ids AS bigint[])) AS x (id)
      WHERE CAST(:ids AS bigint[]) IS NOT NULL)
    UNION ALL
    (SELECT j.id, 'command' FROM jobs j
      WHERE CAST(:pattern AS text) IS NOT NULL AND CAST(:ids AS bigint[]) IS NULL
        AND pgd_command_text(j.command) ILIKE :narrow
        AND lower(pgd_command_text(j.command)) LIKE lower(:pattern)
        AND j.id < coalesce(CAST(:before_id AS bigint), 9223372036854775807)
        AND j.id >= coalesce(CAST(:floor_id AS bigint), 0)
        AND j.id IS DISTINCT FROM CAST(:job_id AS bigint)
        AND (CAST(:project_id AS bigint) IS NULL OR j.project_id = :project_id)
        AND (CAST(:submitter AS text) IS NULL OR j.submitted_by = :submitter)
        AND (CAST(:state AS text) IS NULL OR j.state = :state)
      ORDER BY j.id DESC LIMIT :limit)
)
SELECT page.match, j.id, j.state, j.priority, j.command, j.project_id, j.pool_id, j.target_id,
       p.name AS project, o.name AS organization, q.name AS pool, t.name AS target,
       j.created_at, j.ready_at, j.started_at, j.finished_at, j.last_error, j.submitted_by,
       j.requires_approval, j.approved_at, j.max_attempts,
       a.attempt_no, a.runner_id, r.name AS runner, a.claimed_at,
       greatest(extract(epoch FROM now() - j.created_at), 0)::float8 AS age_seconds,
       CASE WHEN j.state = 'running'
            THEN greatest(extract(epoch FROM now() - a.claimed_at), 0)::float8 END AS running_seconds,
       extract(epoch FROM j.finished_at - j.started_at)::float8 AS duration_seconds
  FROM page
  JOIN jobs j ON j.id = page.id
  JOIN projects p ON p.id = j.project_id
  JOIN organizations o ON o.id = p.organization_id
  JOIN pools q ON q.id = j.pool_id
  LEFT JOIN targets t ON t.id = j.target_id
  LEFT JOIN LATERAL (SELECT x.attempt_no, x.runner_id, x.claimed_at FROM attempts x
                      WHERE x.job_id = j.id ORDER BY x.attempt_no DESC LIMIT 1) a ON true
  LEFT JOIN runners r ON r.id = a.runner_id
 ORDER BY page.match = 'command', j.id DESC;

-- name: list_pending_dependencies_of_jobs
-- The dependencies that have not succeeded yet of each of the jobs :job_ids (one read for a
-- queue page: reads.list_waiting names them), by job then dependency id. Read-only.
SELECT d.job_id, u.id, u.state, p.name AS project
  FROM job_dependencies d JOIN jobs u ON u.id = d.depends_on_job_id
  JOIN projects p ON p.id = u.project_id
 WHERE d.job_id = ANY(CAST(:job_ids AS bigint[])) AND u.state <> 'succeeded'
 ORDER BY d.job_id, u.id;
