-- Claiming: the one transaction that selects eligible work, takes it, reserves its capacity
-- and starts an attempt -- or does nothing. Nothing is held open while the work runs.
--
-- pgd_claim (one job) and pgd_claim_batch (up to 1000 builds of one project and pool) walk
-- pgd_claim_candidates in fairness order. Locks are taken in the documented order (docs/
-- design.md, "Lock order"): the runner claim lock (shared: an operator's drain waits for the
-- claims in flight, pgd_runner_lock_class below) -> job (FOR NO KEY UPDATE SKIP LOCKED: a job another claimer is
-- taking is passed, never waited for) -> target (a deployment's, only while free) -> the
-- project claim lock -> the project row (SKIP LOCKED, for the last_claimed_at stamp) ->
-- organization stripes -> pool stripes (SKIP LOCKED; sql/functions/capacity.sql; then the
-- pool's pause is re-read: pgd_pool_is_paused) -> the attempt rows -> the claim token lock (below). The shared rows come last, so that they are
-- held only from their update to the commit. Times come from the database clock, never the
-- caller's.
--
-- Lost claims. A claim whose answer was lost may still be running on the server and commit
-- later: a claim blocked on a lock goes on after its client is gone, and behind a pooler the
-- client cannot even name the server session (PgBouncer makes up the backend pid, and one
-- server session serves many clients), let alone end it. pgd_recover_claims lets the
-- database decide instead, once and for good, for every token of that claim: it committed,
-- or it is void forever. Both sides use the claim token lock, an advisory lock keyed by the
-- claim's first token (pgd_claim_token_lock_class, hashtext):
--   * a claim, as its very last step (pgd_check_tombstones, after its attempts are
--     inserted), takes the lock SHARED and then reads claim_tombstones for any of its
--     tokens; a tombstone aborts the whole statement (PD409): nothing of the claim commits;
--   * a recovery inserts a tombstone for each token, takes the lock EXCLUSIVELY, then reads
--     the attempts that carry the tokens.
-- Why exactly one of "committed" and "void" can hold. Each side reads with a new snapshot,
-- taken after its lock was granted (READ COMMITTED, which both require; a REPEATABLE READ
-- snapshot would be older than the lock, and they refuse to run under one). If the claim
-- got the lock first, the recovery's exclusive lock waits until the claim's transaction has
-- ended, so its read of the attempts sees the claim if it committed; the tombstones, not yet
-- committed, did not stop the claim, and need not. If the recovery got the lock first, the
-- claim waits until the recovery has committed its tombstones, then sees them and aborts;
-- the recovery read before the claim could commit, and rightly saw no attempt. A claim
-- holds the token lock only from its last step to its commit, so a recovery never waits for
-- a claim blocked earlier (behind a project claim lock, a target): it answers "void" at
-- once, and the claim fails when it gets there. A batch locks only its first token's key (not one per token:
-- the shared lock table is small), so the tokens of one recovery are exactly one claim's,
-- first token first. Nothing here writes on the claim's path: reading an empty table and an
-- advisory lock write no WAL (bench/claim_wal.py).
-- Tombstones are kept a day (pgd_tombstone_retention) and pruned by the recoveries. A claim
-- refuses to commit once its statement has run for an hour (pgd_claim_max_age): a claim
-- that could still commit after its tombstone is pruned must then have reached the server
-- 23 hours after its recovery began, although its client sent it before its connection was
-- lost and the recovery runs at the client's next claim round -- longer than any TCP
-- retransmission, pooler queue or keepalive lets a request wait.
--
-- SQLSTATEs raised: PD403 a pool not granted to the runner's login, a runner of another
-- login, a login that may no longer run (below, "Runner grants"), PD404 unknown runner, PD422 bad lease, batch size or tokens, PD409 a
-- claim token voided by a recovery (or a claim past its age), 0A000 a claim or a recovery
-- outside READ COMMITTED. PDSKP is private: "this candidate lost a race, try the next one".

-- The advisory lock class of claim token locks (the first key of the two-key form, apart
-- from the project claim locks' class), how long tombstones are kept, and how long a claim
-- statement may run and still commit (the header says how the two bound each other).
CREATE OR REPLACE FUNCTION pgd_claim_token_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 1885824116 $$;  -- 'pgdt' as four bytes

CREATE OR REPLACE FUNCTION pgd_tombstone_retention() RETURNS interval
LANGUAGE sql IMMUTABLE AS $$ SELECT interval '1 day' $$;

CREATE OR REPLACE FUNCTION pgd_claim_max_age() RETURNS interval
LANGUAGE sql IMMUTABLE AS $$ SELECT interval '1 hour' $$;

-- Claims and recoveries read under a new snapshot after each lock (the header): refuse a
-- transaction whose snapshot is older than its statements (REPEATABLE READ, SERIALIZABLE).
CREATE OR REPLACE FUNCTION pgd_require_read_committed() RETURNS void
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'claims and their recovery run in READ COMMITTED, not %',
            upper(current_setting('transaction_isolation')) USING ERRCODE = '0A000';
    END IF;
END;
$$;

-- The last step of a claim that took something, after its attempts are inserted: the claim
-- token lock (shared) on the first of p_claim_tokens, then no tombstone for any of them, and
-- a statement younger than pgd_claim_max_age. Raises PD409 otherwise, which aborts the whole
-- claim. Taken last so that it is held only until the commit (the header says why).
CREATE OR REPLACE FUNCTION pgd_check_tombstones(p_claim_tokens uuid[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pgd_require_read_committed();
    PERFORM pg_advisory_xact_lock_shared(pgd_claim_token_lock_class(),
                                         hashtext(p_claim_tokens[1]::text));
    -- a statement of its own, so a snapshot taken after the lock was granted
    IF EXISTS (SELECT 1 FROM claim_tombstones t WHERE t.claim_token = ANY (p_claim_tokens)) THEN
        RAISE EXCEPTION 'claim token % was voided by a recovery; nothing of this claim was committed',
            (SELECT t.claim_token FROM claim_tombstones t
              WHERE t.claim_token = ANY (p_claim_tokens) LIMIT 1)
            USING ERRCODE = 'PD409';
    END IF;
    IF clock_timestamp() - statement_timestamp() > pgd_claim_max_age() THEN
        RAISE EXCEPTION 'claim ran for % (more than %); nothing of it was committed',
            clock_timestamp() - statement_timestamp(), pgd_claim_max_age() USING ERRCODE = 'PD409';
    END IF;
END;
$$;

-- Runner grants. A runner host is a database login: the server, not the command line,
-- decides which pools it may take. `apply` declares them ([[runners]] login = ..., pools =
-- [...]) into runner_grants; a runner row records the login that registered it
-- (runners.login, DEFAULT session_user: the login of the connection, which SECURITY DEFINER
-- does not change). A bound login may register only for pools granted to it, and only that
-- login may claim, heartbeat, report or recover as the runner; a claim, a heartbeat and a
-- report check the grant again, so that revoking it (an `apply` without it, ALTER ROLE ...
-- NOLOGIN, or dropping the login from pgdispatch_scheduler) stops the host at once: its
-- claims are refused (PD403), its heartbeats answer "fenced" and its reports are fenced
-- (PDF01), so its running attempts end as a lost runner's do, by lease expiry.
-- Unbound: a superuser or a member of pgdispatch_owner (tests, maintenance, the embedded
-- demo); it may take every pool, and act for any runner (with that runner's grants).

-- Whether p_login is unbound (a superuser or a member of pgdispatch_owner). False for a
-- role that does not exist. The group roles exist wherever the schema does: `db upgrade`
-- creates them or refuses to run (sql/migrate.py).
CREATE OR REPLACE FUNCTION pgd_login_is_unbound(p_login text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT r.rolsuper OR pg_has_role(r.oid, 'pgdispatch_owner', 'MEMBER')
                       FROM pg_roles r WHERE r.rolname = p_login), false)
$$;

-- Whether p_login may act as a runner host now: it exists, may log in, and is a member of
-- pgdispatch_scheduler (or is unbound). Read on every claim, heartbeat and report (one
-- catalog probe), so that a revoked login stops at once although its open sessions live on.
CREATE OR REPLACE FUNCTION pgd_login_may_run(p_login text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT r.rolcanlogin
                            AND (r.rolsuper
                                 OR pg_has_role(r.oid, 'pgdispatch_scheduler', 'MEMBER')
                                 OR pg_has_role(r.oid, 'pgdispatch_owner', 'MEMBER'))
                       FROM pg_roles r WHERE r.rolname = p_login), false)
$$;

-- The pools p_login may register for and claim from, by id: every pool for an unbound
-- login, its runner_grants for a bound one, none for a login that may not run
-- (pgd_login_may_run).
CREATE OR REPLACE FUNCTION pgd_runner_login_pools(p_login text) RETURNS bigint[]
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN NOT pgd_login_may_run(p_login) THEN '{}'::bigint[]
        WHEN pgd_login_is_unbound(p_login) THEN ARRAY(SELECT q.id FROM pools q ORDER BY q.id)
        ELSE ARRAY(SELECT g.pool_id FROM runner_grants g WHERE g.login = p_login ORDER BY g.pool_id)
    END
$$;

-- The names of pools among p_pool_ids, for a refusal ("linux, macos").
CREATE OR REPLACE FUNCTION pgd_pool_names(p_pool_ids bigint[]) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce(nullif(string_agg(q.name, ', ' ORDER BY q.name), ''), 'none')
      FROM pools q WHERE q.id = ANY (p_pool_ids)
$$;

-- A registration's check: session_user may take every pool of p_pool_ids. Returns
-- p_pool_ids. Raises PD403 naming the login and the first pool not granted (and what is
-- granted), or that the login may not run at all.
CREATE OR REPLACE FUNCTION pgd_require_pool_grants(p_pool_ids bigint[]) RETURNS bigint[]
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_granted bigint[] := pgd_runner_login_pools(session_user);
    v_missing bigint[];
BEGIN
    IF NOT pgd_login_may_run(session_user) THEN
        RAISE EXCEPTION 'login % may not run a scheduler (it cannot log in, or is not in pgdispatch_scheduler)',
            session_user USING ERRCODE = 'PD403';
    END IF;
    v_missing := ARRAY(SELECT unnest(p_pool_ids) EXCEPT SELECT unnest(v_granted));
    IF cardinality(v_missing) > 0 THEN
        RAISE EXCEPTION 'login % is not granted pool % (granted: %); an apply file''s [[runners]] grants it',
            session_user, pgd_pool_names(v_missing), pgd_pool_names(v_granted)
            USING ERRCODE = 'PD403';
    END IF;
    RETURN p_pool_ids;
END;
$$;

-- A runner's check, before a claim, a batch claim or a recovery acts for p_runner_id: the
-- runner exists (PD404) and belongs to session_user unless that login is unbound (PD403:
-- no host claims with another host's runner id). Returns the runner row.
CREATE OR REPLACE FUNCTION pgd_require_runner_login(p_runner_id bigint) RETURNS runners
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v runners%ROWTYPE;
BEGIN
    SELECT * INTO v FROM runners r WHERE r.id = p_runner_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown runner %', p_runner_id USING ERRCODE = 'PD404';
    END IF;
    IF v.login <> session_user AND NOT pgd_login_is_unbound(session_user) THEN
        RAISE EXCEPTION 'runner % belongs to login %; login % cannot act for it',
            p_runner_id, v.login, session_user USING ERRCODE = 'PD403';
    END IF;
    RETURN v;
END;
$$;

-- A claim's check: pgd_require_runner_login, then every pool of p_pool_ids granted to the
-- runner's login now. Raises PD403 naming the login and the pool otherwise (a revoked
-- grant or login stops the claims at once).
CREATE OR REPLACE FUNCTION pgd_require_runner_grant(p_runner_id bigint, p_pool_ids bigint[])
RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v runners%ROWTYPE := pgd_require_runner_login(p_runner_id);
    v_missing bigint[];
BEGIN
    IF NOT pgd_login_may_run(v.login) THEN
        RAISE EXCEPTION 'login % of runner % may no longer run a scheduler (it cannot log in, or is not in pgdispatch_scheduler)',
            v.login, p_runner_id USING ERRCODE = 'PD403';
    END IF;
    v_missing := ARRAY(SELECT unnest(p_pool_ids) EXCEPT SELECT unnest(pgd_runner_login_pools(v.login)));
    IF cardinality(v_missing) > 0 THEN
        RAISE EXCEPTION 'login % of runner % is not granted pool %',
            v.login, p_runner_id, pgd_pool_names(v_missing) USING ERRCODE = 'PD403';
    END IF;
END;
$$;

-- Whether runner p_runner_id may still serve an attempt in pool p_pool_id, asked by
-- session_user: the runner is session_user's (or session_user is unbound), its login may
-- run, and the pool is granted to it. A heartbeat or a report that fails this is fenced out,
-- as the attempt of a lost runner.
CREATE OR REPLACE FUNCTION pgd_runner_holds_grant(p_runner_id bigint, p_pool_id bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT (r.login = session_user OR pgd_login_is_unbound(session_user))
                            AND p_pool_id = ANY (pgd_runner_login_pools(r.login))
                       FROM runners r WHERE r.id = p_runner_id), false)
$$;

-- The runner claim lock: an operator's drain and the runner's claims in flight. A claim
-- takes its runner's lock SHARED before it reads the runner row (pgd_runner_pools, a new
-- statement, so a snapshot taken after the lock was granted); a drain (pgd_drain_runner,
-- sql/functions/operator.sql) takes it EXCLUSIVELY after locking the runner row, before it
-- stamps drain_requested_at with the clock. So a claim that read "not drained" holds the
-- lock until it commits, and the drain waits for it: every attempt of a claim that did not
-- see the drain was claimed (claimed_at) before drain_requested_at, and committed before
-- the drain did; a claim that starts later waits for the drain's commit, then reads it and
-- takes nothing (tests/concurrency/test_steer_races.py). Claims of one runner share the
-- lock; a drain is rare and short. No cycle: a drain holds only the runner row while it
-- waits, and a claim never waits for a runner row. Class 'pgdr' as four bytes; a runner's
-- key wraps as a project's does (pgd_claim_lock_key).
CREATE OR REPLACE FUNCTION pgd_runner_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 1885824114 $$;

CREATE OR REPLACE FUNCTION pgd_runner_lock_key(p_runner_id bigint) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT (p_runner_id % 2147483647)::integer $$;

-- A lease in seconds as every claim and heartbeat accepts it: in (0, 86400], else PD422 (one
-- day at most: a host that holds work longer must beat; an unbounded lease could end past
-- what PostgreSQL or Python can hold and would never be expired). NaN is above every number
-- in PostgreSQL, so it is refused too. pgdispatch/sql/validate.py check_lease_seconds says
-- the same to the Python caller before the round trip.
CREATE OR REPLACE FUNCTION pgd_check_lease_seconds(p_lease_seconds double precision) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_lease_seconds IS NULL OR NOT (p_lease_seconds > 0 AND p_lease_seconds <= 86400) THEN
        RAISE EXCEPTION 'lease seconds must be in (0, 86400], got %', p_lease_seconds
            USING ERRCODE = 'PD422';
    END IF;
END;
$$;

-- The pools a claim by p_runner_id may take from: p_pool_ids that the runner serves; NULL
-- when the runner is draining (its own shutdown, or an operator's drain) or stopped (it
-- claims nothing). Checks the lease (pgd_check_lease_seconds). The caller holds the runner
-- claim lock (above). Raises PD422 for a bad lease, PD404 for an unknown runner.
CREATE OR REPLACE FUNCTION pgd_runner_pools(p_runner_id bigint, p_pool_ids bigint[], p_lease_seconds double precision)
RETURNS bigint[]
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_runner runners%ROWTYPE;
BEGIN
    PERFORM pgd_check_lease_seconds(p_lease_seconds);
    SELECT * INTO v_runner FROM runners r WHERE r.id = p_runner_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown runner %', p_runner_id USING ERRCODE = 'PD404';
    END IF;
    IF v_runner.draining OR v_runner.drain_requested_at IS NOT NULL OR v_runner.stopped_at IS NOT NULL THEN
        RETURN NULL;
    END IF;
    RETURN ARRAY(SELECT unnest(p_pool_ids) INTERSECT SELECT unnest(v_runner.pool_ids));
END;
$$;

-- Whether pool p_pool_id is paused, read by a claim after it took a slot of the pool (a
-- pool stripe, FOR NO KEY UPDATE), in a statement of its own (a snapshot taken after that
-- lock). A pause (pgd_pause_pool, sql/functions/operator.sql) locks every stripe of the
-- pool FOR UPDATE, in stripe order, before it stamps paused_at with the clock: it waits
-- for every claim holding one of them, and claims skip the stripes it holds (SKIP LOCKED)
-- until it commits. So a claim that read "not paused" here holds a stripe the pause must
-- still lock, and commits before the pause does, with claimed_at before paused_at; a claim
-- that takes a stripe after the pause committed reads the pause here and passes the pool
-- over (tests/concurrency/test_steer_races.py). The candidates' filter (q.paused_at IS
-- NULL, below) only saves the work. Mirrors the project pause (the project claim lock,
-- sql/functions/capacity.sql) without a lock of its own: the stripe is one the claim takes
-- anyway.
CREATE OR REPLACE FUNCTION pgd_pool_is_paused(p_pool_id bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT q.paused_at IS NOT NULL FROM pools q WHERE q.id = p_pool_id), true)
$$;

-- Deployment order. Deployments to one target are claimed in the target's order
-- (targets.deploy_order) among its deployments that are ready: queued, ready_at reached,
-- project and pool not paused. The first of them is
-- the target's head, and a claim takes a deployment only when it is its target's head: a
-- ready deployment that is not waits with reason target_order (sql/explain.py). Ready is
-- what decides, so no order can leave a target idle while a deployment to it is ready: a
-- delayed retry, a deployment blocked on an approval or a dependency is not ready, and the
-- next ready one runs (GitLab's "newest first" deployed nothing while newer deployments
-- kept arriving unready). A retry keeps its id, so it keeps its place in either order.
-- Otherwise the head is strict: a head waiting for capacity or for a live runner of its
-- pool keeps the rest behind it (docs/design.md, "Deployment order", says why).

-- The head of target p_target_id: its first ready deployment in its order, oldest_first
-- (priority DESC, then id) or newest_ready_first (priority DESC, then id DESC); NULL when
-- none is ready. Two probes of jobs_target_queue_idx for newest_ready_first: the highest
-- ready priority, then the newest id at it (one index order cannot serve priority DESC with
-- id DESC, and a fixed priority's ids scan both ways). Read without locks: a claim locks the
-- job it takes (SKIP LOCKED) and its target; a head another claimer is taking is locked, so
-- every other deployment to the target is passed over meanwhile, as it should be.
CREATE OR REPLACE FUNCTION pgd_target_head(p_target_id bigint) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_priority integer;
    v_id       bigint;
BEGIN
    SELECT j.priority, j.id INTO v_priority, v_id
      FROM jobs j
     WHERE j.target_id = p_target_id AND j.state = 'queued' AND j.ready_at <= now()
       AND NOT EXISTS (SELECT 1 FROM projects p WHERE p.id = j.project_id AND p.paused_at IS NOT NULL)
       AND NOT EXISTS (SELECT 1 FROM pools q WHERE q.id = j.pool_id AND q.paused_at IS NOT NULL)
     ORDER BY j.priority DESC, j.id
     LIMIT 1;
    IF v_id IS NULL
       OR (SELECT t.deploy_order FROM targets t WHERE t.id = p_target_id) = 'oldest_first' THEN
        RETURN v_id;
    END IF;
    RETURN (SELECT j.id
              FROM jobs j
             WHERE j.target_id = p_target_id AND j.state = 'queued' AND j.priority = v_priority
               AND j.ready_at <= now()
               AND NOT EXISTS (SELECT 1 FROM projects p
                                WHERE p.id = j.project_id AND p.paused_at IS NOT NULL)
               AND NOT EXISTS (SELECT 1 FROM pools q
                                WHERE q.id = j.pool_id AND q.paused_at IS NOT NULL)
             ORDER BY j.id DESC
             LIMIT 1);
END;
$$;

-- The next (organization, project, pool) combinations to try, best first under the fairness
-- policy (docs/fairness.md): fewest running jobs per unit of weight, then the project
-- claimed least recently, then by id. A combination qualifies when its project and its
-- pool are not paused, its project is under its bound, its organization (unless p_org_id names one) and its pool
-- have a stripe with room, and it has a job that is queued, ready and, for a deployment,
-- whose target is free and whose target's head it is (pgd_target_head). Read without locks: the claim re-checks each under its locks.
-- Every EXISTS is written `LIMIT 1 OFFSET 0` so that the planner keeps it a probe of one
-- index entry instead of a join over all the rows (tests/sql/test_query_plan.py).
CREATE OR REPLACE FUNCTION pgd_claim_candidates(p_pool_ids bigint[], p_org_id bigint)
RETURNS TABLE (org_id bigint, project_id bigint, pool_id bigint)
LANGUAGE sql STABLE AS $$
    SELECT p.organization_id AS org_id, pp.project_id, pp.pool_id
      FROM project_pools pp
      JOIN projects p ON p.id = pp.project_id
      JOIN organizations o ON o.id = p.organization_id
      JOIN pools q ON q.id = pp.pool_id
     -- the project's running count (pgd_project_running, written out: a SQL function with a
     -- FROM is not inlined and ran as a query of its own per candidate, docs/fairness.md)
     CROSS JOIN LATERAL (SELECT coalesce(sum(s.running), 0)::integer AS running
                           FROM project_running_stripes s WHERE s.project_id = p.id) r
     WHERE pp.pool_id = ANY (p_pool_ids)
       AND p.paused_at IS NULL
       AND q.paused_at IS NULL
       AND CASE WHEN p_org_id IS NULL
                THEN EXISTS (SELECT 1 FROM capacity_stripes s
                              WHERE s.kind = 'organization' AND s.owner_id = o.id
                                AND s.held < s.cap
                              LIMIT 1 OFFSET 0)
                ELSE o.id = p_org_id END
       AND (p.max_running IS NULL OR r.running < p.max_running)
       AND EXISTS (SELECT 1 FROM capacity_stripes s
                    WHERE s.kind = 'pool' AND s.owner_id = q.id AND s.held < s.cap
                    LIMIT 1 OFFSET 0)
       AND EXISTS (SELECT 1
                     FROM jobs j
                    WHERE j.project_id = p.id AND j.pool_id = pp.pool_id
                      AND j.state = 'queued' AND j.ready_at <= now()
                      AND (j.target_id IS NULL
                           OR (EXISTS (SELECT 1 FROM targets t
                                        WHERE t.id = j.target_id AND t.state = 'free')
                               AND j.id = pgd_target_head(j.target_id)))
                    ORDER BY j.priority DESC, j.id
                    LIMIT 1 OFFSET 0)
     ORDER BY r.running::float8 / p.weight, p.last_claimed_at NULLS FIRST, p.id, pp.pool_id
     LIMIT 16
$$;

-- Whether a fresh read of this organization's candidates puts another project ahead of
-- p_project, whose running count is p_running, in pgd_claim_candidates' order, with running
-- counts read as there (the project's running stripes, inline). The caller holds
-- p_project's exclusive claim lock, so that the claims of p_project queued ahead of it have
-- committed when it reads the shares.
CREATE OR REPLACE FUNCTION pgd_fairer_candidate_exists(p_pool_ids bigint[], p_org_id bigint, p_project projects,
                                                       p_running integer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1
          FROM pgd_claim_candidates(p_pool_ids, p_org_id) f
          JOIN projects p ON p.id = f.project_id
         CROSS JOIN LATERAL (SELECT coalesce(sum(s.running), 0)::integer AS running
                               FROM project_running_stripes s WHERE s.project_id = p.id) r
         WHERE p.id <> p_project.id
           AND (r.running::float8 / p.weight < p_running::float8 / p_project.weight
                OR (r.running::float8 / p.weight = p_running::float8 / p_project.weight
                    AND ((p.last_claimed_at IS NULL AND p_project.last_claimed_at IS NOT NULL)
                         OR p.last_claimed_at < p_project.last_claimed_at
                         OR (p.last_claimed_at IS NOT DISTINCT FROM p_project.last_claimed_at
                             AND p.id < p_project.id)))))
$$;

-- A claim's answer to "is more work waiting for this runner?" (the more_waiting column of
-- pgd_claim and pgd_claim_batch), from what the claim already read: p_later_candidates
-- (candidates followed the one taken in pgd_claim_candidates' list), else one more queued,
-- ready job of the project and pool just claimed from (a probe of jobs_claim_idx; a
-- deployment only while its target is free and it is the target's head), other than p_taken:
-- the jobs this claim took, still queued in its snapshot (locked by it, so every one of them
-- is among the rows probed), which is why more than cardinality(p_taken) rows mean another
-- (counting up to one past them reads n + 1 index entries; "id <> ALL (p_taken)" compared
-- each with all n: 11 µs per job at batch 100). Its plan is the generic one, always: with
-- the limit a parameter, the plan cache would otherwise plan it anew at every call (0.7 ms
-- a batch). A hint, never a promise:
-- true may meet a job another claimer takes first (one empty claim), and false is corrected
-- by the next poll or wake-up (scheduler/claiming.py).
CREATE OR REPLACE FUNCTION pgd_more_waiting(p_later_candidates boolean, p_project_id bigint,
                                            p_pool_id bigint, p_taken bigint[] DEFAULT '{}')
RETURNS boolean
LANGUAGE sql STABLE SET plan_cache_mode = force_generic_plan AS $$
    SELECT p_later_candidates
        OR (SELECT count(*) FROM (
                SELECT 1 FROM jobs j
                 WHERE j.project_id = p_project_id AND j.pool_id = p_pool_id
                   AND j.state = 'queued' AND j.ready_at <= now()
                   AND (j.target_id IS NULL
                        OR (EXISTS (SELECT 1 FROM targets t
                                     WHERE t.id = j.target_id AND t.state = 'free')
                            AND j.id = pgd_target_head(j.target_id)))
                 LIMIT coalesce(cardinality(p_taken), 0) + 1 OFFSET 0) x)
           > coalesce(cardinality(p_taken), 0)
$$;

-- Whether work for runner p_runner_id in p_pool_ids waits for capacity that running jobs
-- hold: a queued, ready job whose project (not paused) is at its bound, or whose
-- organization or pool has no free slot. A scheduler asks after a claim found nothing while
-- it runs jobs of its own (scheduler/claiming.py): when true, the completion of one of its
-- jobs claims at once instead of waiting for the poll (a completion does not NOTIFY, and the
-- job freed by it would otherwise wait up to the idle cap: bench/e2e.py, "project bound
-- freed"). A hint, as pgd_more_waiting: true may end in one empty claim. Only the runner's
-- own login (or an unbound one) may ask, and only of the runner's pools.
CREATE OR REPLACE FUNCTION pgd_capacity_waiting(p_runner_id bigint, p_pool_ids bigint[])
RETURNS boolean
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_runner runners;
BEGIN
    v_runner := pgd_require_runner_login(p_runner_id);
    RETURN EXISTS (
        SELECT 1
          FROM project_pools pp
          JOIN projects p ON p.id = pp.project_id
         WHERE pp.pool_id = ANY (p_pool_ids) AND pp.pool_id = ANY (v_runner.pool_ids)
           AND p.paused_at IS NULL
           AND ((p.max_running IS NOT NULL AND pgd_project_running(p.id) >= p.max_running)
                OR pgd_free_slots('organization', p.organization_id) < 1
                OR pgd_free_slots('pool', pp.pool_id) < 1)
           AND EXISTS (SELECT 1 FROM jobs j
                        WHERE j.project_id = p.id AND j.pool_id = pp.pool_id
                          AND j.state = 'queued' AND j.ready_at <= now()
                        LIMIT 1 OFFSET 0));
END;
$$;

-- claim: take the next eligible job for runner p_runner_id from p_pool_ids, or nothing.
-- For each candidate in fairness order, in a subtransaction (so that a lost race undoes
-- only that candidate's locks, SQLSTATE PDSKP): the job (SKIP LOCKED), a deployment's free
-- target, the project claim lock (sql/functions/capacity.sql), the pause and bound checks
-- under it, the fairness re-check while capacity is scarce, a slot of the organization and
-- one of the pool from stripes with room (SKIP LOCKED); then the job's generation (the
-- fence) is bumped and the attempt inserted with its lease of p_lease_seconds and the
-- caller's claim token; last, the token is checked against the tombstones under its lock
-- (so that a caller that lost the answer can settle whether it committed: the header).
-- more_waiting: whether more work looked waiting for this runner (pgd_more_waiting); pool:
-- the pool's name; wait_seconds: ready_at to claimed_at (the job's wait, seconds).
-- A second pass runs only when the first passed a project over for a reason the second can
-- settle (a bound met under the shared lock, or a fairer project found).
CREATE OR REPLACE FUNCTION pgd_claim(p_runner_id bigint, p_pool_ids bigint[], p_claim_token uuid,
                                     p_lease_seconds double precision)
RETURNS TABLE (job_id bigint, attempt_id bigint, attempt_no integer, generation bigint,
               lease_expires_at timestamptz, project_id bigint, pool_id bigint,
               target_id bigint, command text[], timeout_seconds integer,
               more_waiting boolean, pool text, wait_seconds double precision)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_pools   bigint[];
    c         record;
    v_pass    integer;
    v_retry   boolean;
    v_proj    projects%ROWTYPE;
    v_scarce  boolean;
    v_excl    boolean;
    v_running integer;
    v_job     jobs%ROWTYPE;
    v_attempt bigint;
    v_claimed timestamptz;
    v_lease   timestamptz;
    v_racing  integer;
    v_org_stripe  smallint;
    v_pool_stripe smallint;
    v_proj_stripe smallint;
BEGIN
    PERFORM pgd_require_runner_grant(p_runner_id, p_pool_ids);
    -- the runner claim lock, shared, then the runner row in a new statement (above)
    PERFORM pg_advisory_xact_lock_shared(pgd_runner_lock_class(), pgd_runner_lock_key(p_runner_id));
    v_pools := pgd_runner_pools(p_runner_id, p_pool_ids, p_lease_seconds);
    IF v_pools IS NULL THEN
        RETURN;  -- the runner is draining or stopped
    END IF;
    v_racing := pgd_racing_claims();

    FOR v_pass IN 1..2 LOOP
        v_retry := false;
        -- numbered, and counted, so that a claim can tell whether candidates follow the one it
        -- took (more_waiting)
        -- (window functions over the inlined, ordered list: they keep its order and its plan)
        FOR c IN SELECT x.*, row_number() OVER () AS k, count(*) OVER () AS n
                   FROM pgd_claim_candidates(v_pools, NULL) x LOOP
        BEGIN
            -- SKIP LOCKED: a job another claimer is taking is not waited for, just passed.
            SELECT j.* INTO v_job
              FROM jobs j
             WHERE j.project_id = c.project_id AND j.pool_id = c.pool_id
               AND j.state = 'queued' AND j.ready_at <= now()
               AND (j.target_id IS NULL
                    OR (EXISTS (SELECT 1 FROM targets t WHERE t.id = j.target_id AND t.state = 'free')
                        -- only its target's head (the deployment order, above)
                        AND j.id = pgd_target_head(j.target_id)))
             ORDER BY j.priority DESC, j.id
             LIMIT 1
               FOR NO KEY UPDATE OF j SKIP LOCKED;
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

            IF v_job.target_id IS NOT NULL THEN
                -- Waits if another claimer is taking this target, then re-checks 'free'.
                UPDATE targets t SET state = 'held', holder_job_id = v_job.id, held_since = now()
                 WHERE t.id = v_job.target_id AND t.state = 'free';
                IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            END IF;

            -- the project's claim lock (sql/functions/capacity.sql)
            v_scarce := pgd_capacity_scarce(c.org_id, c.pool_id, v_racing);
            v_excl := v_scarce OR EXISTS (SELECT 1 FROM projects p
                                           WHERE p.id = c.project_id AND p.max_running IS NOT NULL);
            IF v_excl THEN
                PERFORM pg_advisory_xact_lock(pgd_claim_lock_class(), pgd_claim_lock_key(c.project_id));
            ELSE
                PERFORM pg_advisory_xact_lock_shared(pgd_claim_lock_class(), pgd_claim_lock_key(c.project_id));
            END IF;
            SELECT * INTO v_proj FROM projects p WHERE p.id = c.project_id;
            IF v_proj.paused_at IS NOT NULL THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            v_running := NULL;
            IF v_proj.max_running IS NOT NULL THEN
                IF NOT v_excl THEN
                    -- bounded since the read above: the next pass takes the exclusive lock
                    v_retry := true;
                    RAISE EXCEPTION USING ERRCODE = 'PDSKP';
                END IF;
                v_running := pgd_project_running(v_proj.id);
                IF v_running >= v_proj.max_running THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            END IF;
            IF v_pass = 1 AND v_scarce AND pgd_fairer_candidate_exists(
                   v_pools, c.org_id, v_proj, coalesce(v_running, pgd_project_running(v_proj.id))) THEN
                v_retry := true;
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
            UPDATE projects p SET last_claimed_at = clock_timestamp()
             WHERE p.id = (SELECT x.id FROM projects x WHERE x.id = v_proj.id
                             FOR NO KEY UPDATE SKIP LOCKED);

            -- a slot of the organization and one of the pool, each from a stripe with room
            -- taken SKIP LOCKED in this backend's order (pgd_take_slots for one slot, written
            -- out: two statements instead of four calls on the single-claim path)
            UPDATE capacity_stripes s SET held = s.held + 1
             WHERE (s.kind, s.owner_id, s.stripe_no) = (
                   SELECT f.kind, f.owner_id, f.stripe_no FROM capacity_stripes f
                    WHERE f.kind = 'organization' AND f.owner_id = c.org_id AND f.held < f.cap
                    ORDER BY pgd_stripe_order(f.stripe_no)
                    LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED)
            RETURNING s.stripe_no INTO v_org_stripe;
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            UPDATE capacity_stripes s SET held = s.held + 1
             WHERE (s.kind, s.owner_id, s.stripe_no) = (
                   SELECT f.kind, f.owner_id, f.stripe_no FROM capacity_stripes f
                    WHERE f.kind = 'pool' AND f.owner_id = c.pool_id AND f.held < f.cap
                    ORDER BY pgd_stripe_order(f.stripe_no)
                    LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED)
            RETURNING s.stripe_no INTO v_pool_stripe;
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            -- the pool's pause, re-read in a new statement now that a pool stripe is held
            -- (pgd_pool_is_paused says why that is safe)
            IF pgd_pool_is_paused(c.pool_id) THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            -- the project's running count, last (sql/functions/capacity.sql)
            v_proj_stripe := pgd_count_running(c.project_id, 1);

            UPDATE jobs j
               SET state = 'running', generation = j.generation + 1,
                   attempts_made = j.attempts_made + 1,
                   started_at = coalesce(j.started_at, now())
             WHERE j.id = v_job.id
            RETURNING * INTO v_job;

            -- claimed_at is the clock now, after every reservation: [claimed_at,
            -- finished_at) of an attempt lies inside the time its slots are held
            v_claimed := clock_timestamp();
            v_lease := v_claimed + make_interval(secs => p_lease_seconds);
            INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                                  claimed_at, lease_expires_at, last_heartbeat_at,
                                  organization_stripe, pool_stripe, project_stripe, ready_at)
            VALUES (v_job.id, v_job.attempts_made, v_job.generation, p_runner_id, p_claim_token,
                    'running', v_claimed, v_lease, now(), v_org_stripe, v_pool_stripe,
                    v_proj_stripe, v_job.ready_at)
            RETURNING id INTO v_attempt;
            -- the claim token lock and the tombstone check: last, held only until the commit
            PERFORM pgd_check_tombstones(ARRAY[p_claim_token]);

            -- the pool's name and how long the job waited (ready_at to claimed_at, seconds),
            -- for the scheduler's wait-time histogram (scheduler/metrics.py)
            RETURN QUERY SELECT v_job.id, v_attempt, v_job.attempts_made, v_job.generation, v_lease,
                                v_job.project_id, v_job.pool_id, v_job.target_id, v_job.command,
                                v_job.timeout_seconds, pgd_more_waiting(c.k < c.n, c.project_id, c.pool_id),
                                (SELECT q.name FROM pools q WHERE q.id = v_job.pool_id),
                                extract(epoch FROM v_claimed - v_job.ready_at)::float8;
            RETURN;
        EXCEPTION WHEN SQLSTATE 'PDSKP' THEN
            NULL;  -- lost a race for this candidate; its locks went with the subtransaction
        END;
        END LOOP;
        EXIT WHEN NOT v_retry;
    END LOOP;
    RETURN;
END;
$$;

-- claim_batch: up to cardinality(p_claim_tokens) builds (no deployments) of one candidate
-- in one transaction, as pgd_claim takes one. The free capacity read without locks (the
-- stripes' room, the project's bound) sizes the jobs locked; under the project's claim lock
-- up to n slots of the organization, then as many of the pool, are taken from stripes with
-- room (pgd_take_slots): the batch takes as many jobs as both gave, and each attempt records
-- the stripes of its two slots. Returns one row per job taken, with its claim token, each
-- with the same more_waiting (pgd_more_waiting).
CREATE OR REPLACE FUNCTION pgd_claim_batch(p_runner_id bigint, p_pool_ids bigint[], p_claim_tokens uuid[],
                                           p_lease_seconds double precision)
RETURNS TABLE (job_id bigint, attempt_id bigint, attempt_no integer, generation bigint,
               lease_expires_at timestamptz, project_id bigint, pool_id bigint,
               target_id bigint, command text[], timeout_seconds integer, claim_token uuid,
               more_waiting boolean, pool text, wait_seconds double precision)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_pools   bigint[];
    v_want    integer := coalesce(cardinality(p_claim_tokens), 0);
    c         record;
    v_pass    integer;
    v_retry   boolean;
    v_proj    projects%ROWTYPE;
    v_scarce  boolean;
    v_excl    boolean;
    v_running integer;
    v_free    integer;
    v_ids     bigint[];
    v_racing  integer;
    v_org_units  smallint[];
    v_pool_units smallint[];
    v_n       integer;
    v_claimed timestamptz;
    v_lease   timestamptz;
    v_more    boolean;
    v_proj_stripe smallint;
BEGIN
    IF v_want < 1 OR v_want > 1000 THEN
        RAISE EXCEPTION 'a batch claims 1 to 1000 jobs, got %', v_want USING ERRCODE = 'PD422';
    END IF;
    PERFORM pgd_require_runner_grant(p_runner_id, p_pool_ids);
    -- the runner claim lock, shared, then the runner row in a new statement (above)
    PERFORM pg_advisory_xact_lock_shared(pgd_runner_lock_class(), pgd_runner_lock_key(p_runner_id));
    v_pools := pgd_runner_pools(p_runner_id, p_pool_ids, p_lease_seconds);
    IF v_pools IS NULL THEN
        RETURN;  -- the runner is draining or stopped
    END IF;
    v_racing := pgd_racing_claims();

    FOR v_pass IN 1..2 LOOP
        v_retry := false;
        -- numbered, and counted, so that a claim can tell whether candidates follow the one it
        -- took (more_waiting)
        -- (window functions over the inlined, ordered list: they keep its order and its plan)
        FOR c IN SELECT x.*, row_number() OVER () AS k, count(*) OVER () AS n
                   FROM pgd_claim_candidates(v_pools, NULL) x LOOP
        BEGIN
            -- the free capacity as read without locks sizes the jobs locked below
            SELECT least(CASE WHEN p.max_running IS NULL THEN v_want
                              ELSE p.max_running - pgd_project_running(p.id) END,
                         v_want,
                         pgd_free_slots('organization', c.org_id),
                         pgd_free_slots('pool', c.pool_id))
              INTO v_free
              FROM projects p
             WHERE p.id = c.project_id;
            IF v_free < 1 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            -- SKIP LOCKED: jobs other claimers are taking are passed over, not waited for
            v_ids := ARRAY(
                SELECT j.id FROM jobs j
                 WHERE j.project_id = c.project_id AND j.pool_id = c.pool_id
                   AND j.state = 'queued' AND j.ready_at <= now() AND j.target_id IS NULL
                 ORDER BY j.priority DESC, j.id
                 LIMIT v_free
                   FOR NO KEY UPDATE OF j SKIP LOCKED);
            IF cardinality(v_ids) = 0 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

            -- the project's claim lock, as in pgd_claim
            v_scarce := pgd_capacity_scarce(c.org_id, c.pool_id, v_racing);
            v_excl := v_scarce OR EXISTS (SELECT 1 FROM projects p
                                           WHERE p.id = c.project_id AND p.max_running IS NOT NULL);
            IF v_excl THEN
                PERFORM pg_advisory_xact_lock(pgd_claim_lock_class(), pgd_claim_lock_key(c.project_id));
            ELSE
                PERFORM pg_advisory_xact_lock_shared(pgd_claim_lock_class(), pgd_claim_lock_key(c.project_id));
            END IF;
            SELECT * INTO v_proj FROM projects p WHERE p.id = c.project_id;
            IF v_proj.paused_at IS NOT NULL THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            v_running := NULL;
            IF v_proj.max_running IS NOT NULL THEN
                IF NOT v_excl THEN
                    v_retry := true;  -- bounded since the read above: the next pass locks it
                    RAISE EXCEPTION USING ERRCODE = 'PDSKP';
                END IF;
                v_running := pgd_project_running(v_proj.id);
            END IF;
            IF v_pass = 1 AND v_scarce AND pgd_fairer_candidate_exists(
                   v_pools, c.org_id, v_proj, coalesce(v_running, pgd_project_running(v_proj.id))) THEN
                v_retry := true;
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
            v_n := least(cardinality(v_ids), coalesce(v_proj.max_running - v_running, v_want));
            IF v_n < 1 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            -- up to v_n slots of the organization, then as many of the pool; the count taken
            -- is what both gave (stripes locked beyond it keep their room, locked until the
            -- commit, and are skipped meanwhile)
            v_org_units := pgd_take_slots('organization', c.org_id, v_n);
            v_pool_units := pgd_take_slots('pool', c.pool_id, cardinality(v_org_units));
            v_n := cardinality(v_pool_units);
            IF v_n < 1 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            -- the pool's pause, re-read now that its stripes are held (pgd_pool_is_paused)
            IF pgd_pool_is_paused(c.pool_id) THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            v_org_units := v_org_units[1:v_n];
            v_ids := v_ids[1:v_n];
            PERFORM pgd_hold_slots('organization', c.org_id, v_org_units);
            PERFORM pgd_hold_slots('pool', c.pool_id, v_pool_units);
            -- the project's running count, last (sql/functions/capacity.sql)
            v_proj_stripe := pgd_count_running(c.project_id, v_n);

            UPDATE projects p SET last_claimed_at = clock_timestamp()
             WHERE p.id = (SELECT x.id FROM projects x WHERE x.id = v_proj.id
                             FOR NO KEY UPDATE SKIP LOCKED);

            v_claimed := clock_timestamp();
            v_lease := v_claimed + make_interval(secs => p_lease_seconds);
            -- read before the jobs taken leave 'queued': pgd_more_waiting counts past them
            v_more := pgd_more_waiting(c.k < c.n, c.project_id, c.pool_id, v_ids);
            RETURN QUERY
            WITH taken AS (
                UPDATE jobs j
                   SET state = 'running', generation = j.generation + 1,
                       attempts_made = j.attempts_made + 1,
                       started_at = coalesce(j.started_at, now())
                 WHERE j.id = ANY (v_ids)
                RETURNING j.*
            ), numbered AS (
                SELECT t.*, row_number() OVER (ORDER BY t.priority DESC, t.id) AS n FROM taken t
            ), inserted AS (
                INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token,
                                      state, claimed_at, lease_expires_at, last_heartbeat_at,
                                      organization_stripe, pool_stripe, project_stripe, ready_at)
                SELECT n.id, n.attempts_made, n.generation, p_runner_id, p_claim_tokens[n.n],
                       'running', v_claimed, v_lease, now(), v_org_units[n.n], v_pool_units[n.n],
                       v_proj_stripe, n.ready_at
                  FROM numbered n
                RETURNING attempts.id, attempts.job_id, attempts.claim_token
            )
            SELECT n.id, i.id, n.attempts_made, n.generation, v_lease, n.project_id, n.pool_id,
                   n.target_id, n.command, n.timeout_seconds, i.claim_token, v_more,
                   (SELECT q.name FROM pools q WHERE q.id = c.pool_id),
                   extract(epoch FROM v_claimed - n.ready_at)::float8
              FROM numbered n JOIN inserted i ON i.job_id = n.id
             ORDER BY n.n;
            -- as in pgd_claim; every token passed, the first one's lock (the header)
            PERFORM pgd_check_tombstones(p_claim_tokens);
            RETURN;
        EXCEPTION WHEN SQLSTATE 'PDSKP' THEN
            NULL;  -- nothing to take here; this candidate's locks went with its subtransaction
        END;
        END LOOP;
        EXIT WHEN NOT v_retry;
    END LOOP;
    RETURN;
END;
$$;

-- recover_claims: after the answer to a claim was lost, settle for good whether it committed.
-- p_claim_tokens are exactly one claim's tokens (one token, or one batch's, in the order the
-- batch was sent: its first token keys the lock). One statement: the tombstones of every
-- token, in token order (two recoveries of one batch never wait for each other in a cycle),
-- then the claim token lock, exclusively (it waits only for a claim past its tombstone check,
-- that is, about to commit), then the attempts that carry the tokens, in token order, with
-- the attempt's state. When it returns, each token is final: its attempt is here, or no
-- claim with it can ever commit (the header). Asking again gives the same answer.
-- Tombstones older than pgd_tombstone_retention are deleted on the way, skipping any another
-- recovery is deleting. p_runner_id is recorded with the tombstones (who voided them).
-- Lock order: tombstone rows -> claim token lock; no other transaction waits for either
-- while holding one (claims only read the tombstones), so no cycle.
-- Raises PD422 for no tokens, more than 1000, or a NULL token.
CREATE OR REPLACE FUNCTION pgd_recover_claims(p_claim_tokens uuid[], p_runner_id bigint)
RETURNS TABLE (claim_token uuid, job_id bigint, attempt_id bigint, attempt_no integer,
               generation bigint, lease_expires_at timestamptz, project_id bigint,
               pool_id bigint, target_id bigint, command text[], timeout_seconds integer,
               state text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF coalesce(cardinality(p_claim_tokens), 0) NOT BETWEEN 1 AND 1000
       OR array_position(p_claim_tokens, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'a recovery names 1 to 1000 claim tokens, none NULL, got %',
            coalesce(cardinality(p_claim_tokens), 0) USING ERRCODE = 'PD422';
    END IF;
    PERFORM pgd_require_read_committed();
    -- only the runner's own login settles its claims (no grant needed: the claims it
    -- finds committed are fenced at their first heartbeat if the grant is gone)
    PERFORM pgd_require_runner_login(p_runner_id);
    -- No claim with a token voided more than a day ago can still commit (the header: a
    -- claim statement commits within pgd_claim_max_age of reaching the server).
    DELETE FROM claim_tombstones t
     WHERE t.claim_token IN (SELECT o.claim_token FROM claim_tombstones o
                              WHERE o.voided_at < now() - pgd_tombstone_retention()
                                FOR UPDATE SKIP LOCKED);
    INSERT INTO claim_tombstones (claim_token, runner_id)
    SELECT DISTINCT u.token, p_runner_id FROM unnest(p_claim_tokens) AS u(token)
     ORDER BY u.token
    ON CONFLICT DO NOTHING;
    PERFORM pg_advisory_xact_lock(pgd_claim_token_lock_class(), hashtext(p_claim_tokens[1]::text));
    -- a statement of its own, so a snapshot taken after the lock was granted
    RETURN QUERY
    SELECT a.claim_token, a.job_id, a.id, a.attempt_no, a.generation, a.lease_expires_at,
           j.project_id, j.pool_id, j.target_id, j.command, j.timeout_seconds, a.state
      FROM attempts a JOIN jobs j ON j.id = a.job_id
     WHERE a.claim_token = ANY (p_claim_tokens)
     ORDER BY array_position(p_claim_tokens, a.claim_token);
END;
$$;
