-- Capacity: organization and pool slots, the project claim lock, running counts.
--
-- An organization or a pool has pgd_capacity_stripes() (8) rows in capacity_stripes
-- (sql/schema.sql): stripe k has `cap` slots of which `held` are held (0 <= held <= cap, a
-- CHECK). A claim takes a slot from a stripe with room (held < cap) with FOR NO KEY UPDATE
-- SKIP LOCKED and adds it to `held` -- a batch adds once per stripe for all the slots it
-- took there, and takes a further stripe only when one stripe's room is not enough
-- (pgd_take_slots, pgd_hold_slots). Each attempt records the stripes it holds
-- (attempts.organization_stripe, pool_stripe); a completion or an expiry subtracts the
-- job's running attempt's slots from those stripes (pgd_release_slots). Claims start at a
-- stripe chosen by their backend (pgd_stripe_order: pg_backend_pid() modulo 8), so
-- concurrent claims and releases spread over the stripes instead of queueing on one row. A
-- claim never waits for a stripe: one locked by another claim or a release is passed,
-- another one with room is taken, or the candidate is passed over.
--
-- Limits (pgd_split_capacity, from the trigger pgd_sync_stripes on a limit change): every
-- stripe of the owner is locked in stripe order (waiting for the claims and releases in
-- flight there; claims skip them meanwhile), the held slots h are summed, and for a limit n:
--   * h <= n: each stripe's cap becomes its held count plus an even share of n - h (the first
--     (n - h) mod 8 stripes one more), so the caps sum to n and nothing is owed;
--   * h > n: each stripe's cap becomes its held count (no stripe has room), and h - n slots
--     are owed (capacity_debts).
-- A release, in a new statement after its stripe row locks (so that a limit change that
-- committed while it waited is seen), lowers the caps of the stripes it released from by up
-- to what its owner owes, under the debt row's lock. Invariant: sum(cap) - owed = limit, and
-- while anything is owed every stripe is full (held = cap), so no claim is admitted until
-- the running jobs are below the limit, and capacity comes back one slot at a time as jobs
-- end beyond it (tests/sql/test_stripes.py).
--
-- A project's running count is kept the same way, without a cap (a project's bound is
-- enforced under its claim lock, below): up to 8 rows in project_running_stripes
-- (sql/schema.sql), the count their sum (pgd_project_running), read in 8 rows at most however
-- many jobs run. A claim adds its jobs to a stripe row no other transaction holds, taken SKIP
-- LOCKED in its backend's order, or, when every row there is held, to its backend's own
-- stripe, waiting for it (made by the first claim that counts on it); the attempt records
-- the stripe (attempts.project_stripe) and its release subtracts from that one
-- (pgd_count_running, pgd_uncount_running). Nothing else writes it, so the count is exactly
-- the project's jobs in state 'running' in every committed state (tests/faults/consistency.py).
--
-- Lock order (docs/design.md, "Lock order"): job -> target -> attempt -> (dependents) ->
-- project claim lock -> project row (SKIP LOCKED, stamp) -> organization stripes -> pool
-- stripes -> debt rows -> project running stripes (always last: a claim or a release that
-- waits for one holds no lock that anyone waiting for its own rows could hold). Several
-- stripes are always locked by (kind, owner id, stripe number): 'organization' sorts before
-- 'pool'. A limit change takes the owner's row (config
-- apply: organizations, then pools, each by id), then all its stripes in order, then its
-- debt row.

-- The stripes per owner. Changing it needs a migration (stripes are numbered 1..8, a CHECK).
CREATE OR REPLACE FUNCTION pgd_capacity_stripes() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 8 $$;

-- A limit (re)set to p_limit for owner (p_kind, p_owner): creates its stripes if missing,
-- locks all of them in stripe order, sums what they hold, and re-splits the caps and the
-- debt as the header says.
CREATE OR REPLACE FUNCTION pgd_split_capacity(p_kind text, p_owner bigint, p_limit integer)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_n     integer := pgd_capacity_stripes();
    v_held  integer;
    v_spare integer;
BEGIN
    -- a new owner's stripes (its INSERT trigger). Not ON CONFLICT DO NOTHING on every call:
    -- that insert waits for each transaction in flight on a conflicting row before locking
    -- any (found by a helper's run: a limit change waited for claims holding no stripe).
    IF NOT EXISTS (SELECT 1 FROM capacity_stripes s WHERE s.kind = p_kind AND s.owner_id = p_owner) THEN
        INSERT INTO capacity_stripes (kind, owner_id, stripe_no, cap)
        SELECT p_kind, p_owner, g, 0 FROM generate_series(1, v_n) g;
    END IF;
    -- FOR UPDATE returns each row's latest version, after waiting for its holder
    SELECT sum(s.held) INTO v_held
      FROM (SELECT s.held FROM capacity_stripes s
             WHERE s.kind = p_kind AND s.owner_id = p_owner
             ORDER BY s.stripe_no FOR UPDATE) s;
    v_spare := p_limit - v_held;
    UPDATE capacity_stripes s
       SET cap = s.held + CASE WHEN v_spare > 0
                               THEN v_spare / v_n + (s.stripe_no <= v_spare % v_n)::integer
                               ELSE 0 END
     WHERE s.kind = p_kind AND s.owner_id = p_owner;
    IF v_spare < 0 THEN
        INSERT INTO capacity_debts (kind, owner_id, owed) VALUES (p_kind, p_owner, -v_spare)
            ON CONFLICT (kind, owner_id) DO UPDATE SET owed = EXCLUDED.owed;
    ELSE
        DELETE FROM capacity_debts d WHERE d.kind = p_kind AND d.owner_id = p_owner;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION pgd_sync_stripes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'organizations' THEN
        PERFORM pgd_split_capacity('organization', NEW.id, NEW.max_running);
    ELSE
        PERFORM pgd_split_capacity('pool', NEW.id, NEW.slots);
    END IF;
    RETURN NULL;
END;
$$;

-- An upsert that leaves the limit as it was changes no stripe (and locks none).
CREATE OR REPLACE TRIGGER pgd_sync_stripes AFTER INSERT ON organizations
    FOR EACH ROW EXECUTE FUNCTION pgd_sync_stripes();

CREATE OR REPLACE TRIGGER pgd_sync_stripes AFTER INSERT ON pools
    FOR EACH ROW EXECUTE FUNCTION pgd_sync_stripes();

CREATE OR REPLACE TRIGGER pgd_sync_stripes_changed AFTER UPDATE OF max_running ON organizations
    FOR EACH ROW WHEN (OLD.max_running IS DISTINCT FROM NEW.max_running)
    EXECUTE FUNCTION pgd_sync_stripes();

CREATE OR REPLACE TRIGGER pgd_sync_stripes_changed AFTER UPDATE OF slots ON pools
    FOR EACH ROW WHEN (OLD.slots IS DISTINCT FROM NEW.slots)
    EXECUTE FUNCTION pgd_sync_stripes();

-- Running jobs of an organization or a pool: the slots its stripes hold.
CREATE OR REPLACE FUNCTION pgd_organization_running(p_org_id bigint) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(s.held), 0)::integer FROM capacity_stripes s
     WHERE s.kind = 'organization' AND s.owner_id = p_org_id
$$;

CREATE OR REPLACE FUNCTION pgd_pool_running(p_pool_id bigint) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(s.held), 0)::integer FROM capacity_stripes s
     WHERE s.kind = 'pool' AND s.owner_id = p_pool_id
$$;

-- Running jobs of a project: the sum of its running stripes (8 rows at most; the header).
CREATE OR REPLACE FUNCTION pgd_project_running(p_project_id bigint) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(s.running), 0)::integer FROM project_running_stripes s
     WHERE s.project_id = p_project_id
$$;

-- Free slots of an owner: room on its stripes, which is max(limit - held, 0) in every
-- committed state (the invariant in this file's header). Read without locks.
CREATE OR REPLACE FUNCTION pgd_free_slots(p_kind text, p_owner bigint) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(s.cap - s.held), 0)::integer FROM capacity_stripes s
     WHERE s.kind = p_kind AND s.owner_id = p_owner
$$;

-- The most claims that could race for capacity now: the slots of every runner that is
-- neither stopped nor draining. A runner that died without stopping still counts, which
-- only makes the fairness re-check run more often.
CREATE OR REPLACE FUNCTION pgd_racing_claims() RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(r.slots), 0)::integer FROM runners r
     WHERE r.stopped_at IS NULL AND NOT r.draining
$$;

-- Whether capacity is scarce for a claim from organization p_org_id and pool p_pool_id:
-- either has fewer free slots than p_racing claims could take at once. 16 stripe rows,
-- whatever the limits and the running jobs.
CREATE OR REPLACE FUNCTION pgd_capacity_scarce(p_org_id bigint, p_pool_id bigint, p_racing integer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT pgd_free_slots('organization', p_org_id) < p_racing
        OR pgd_free_slots('pool', p_pool_id) < p_racing
$$;

-- The stripe a claim tries first: spread by backend, so that concurrent claimers start on
-- different stripes. Position of stripe p_stripe_no in this backend's order.
CREATE OR REPLACE FUNCTION pgd_stripe_order(p_stripe_no smallint) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT (p_stripe_no + pg_backend_pid()) % pgd_capacity_stripes()
$$;

-- This backend's own stripe: the first in its order (pgd_stripe_order = 0), 1 to 8.
CREATE OR REPLACE FUNCTION pgd_own_stripe() RETURNS smallint
LANGUAGE sql STABLE AS $$
    SELECT (pgd_capacity_stripes() - pg_backend_pid() % pgd_capacity_stripes())::smallint
$$;

-- Count p_n more running jobs of project p_project_id (a claim, after its slots): on a
-- stripe row no other transaction holds, the first in this backend's order (SKIP LOCKED),
-- else on this backend's own stripe, waiting for it and making it when it is missing.
-- Returns the stripe, which the claim's attempts record (attempts.project_stripe).
CREATE OR REPLACE FUNCTION pgd_count_running(p_project_id bigint, p_n integer) RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    v_no smallint;
BEGIN
    UPDATE project_running_stripes s SET running = s.running + p_n
     WHERE (s.project_id, s.stripe_no) = (
           SELECT f.project_id, f.stripe_no FROM project_running_stripes f
            WHERE f.project_id = p_project_id
            ORDER BY pgd_stripe_order(f.stripe_no)
            LIMIT 1 FOR NO KEY UPDATE SKIP LOCKED)
    RETURNING s.stripe_no INTO v_no;
    IF FOUND THEN
        RETURN v_no;
    END IF;
    v_no := pgd_own_stripe();
    INSERT INTO project_running_stripes AS s (project_id, stripe_no, running)
    VALUES (p_project_id, v_no, p_n)
    ON CONFLICT (project_id, stripe_no) DO UPDATE SET running = s.running + EXCLUDED.running;
    RETURN v_no;
END;
$$;

-- Count the jobs p_job_ids as no longer running (their release: pgd_release_slots, last):
-- each job's latest attempt names the stripe it counts on; the units are summed per stripe,
-- the rows locked in (project, stripe) order and decremented in one statement. Attempts
-- without a stripe (ended before the count was kept) count nowhere.
CREATE OR REPLACE FUNCTION pgd_uncount_running(p_job_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_projects bigint[];
    v_stripes  smallint[];
    v_units    integer[];
BEGIN
    SELECT array_agg(g.project_id ORDER BY g.project_id, g.stripe_no),
           array_agg(g.stripe_no ORDER BY g.project_id, g.stripe_no),
           array_agg(g.n ORDER BY g.project_id, g.stripe_no)
      INTO v_projects, v_stripes, v_units
      FROM (SELECT j.project_id, a.project_stripe AS stripe_no, count(*)::integer AS n
              FROM unnest(p_job_ids) u(job_id)
              JOIN jobs j ON j.id = u.job_id
             CROSS JOIN LATERAL (SELECT a.project_stripe FROM attempts a
                                  WHERE a.job_id = u.job_id
                                  ORDER BY a.attempt_no DESC LIMIT 1) a
             WHERE a.project_stripe IS NOT NULL
             GROUP BY j.project_id, a.project_stripe) g;
    IF v_projects IS NULL THEN
        RETURN;
    END IF;
    IF cardinality(v_projects) > 1 THEN
        PERFORM 1 FROM project_running_stripes s
          JOIN unnest(v_projects, v_stripes) u(project_id, stripe_no)
            ON (s.project_id, s.stripe_no) = (u.project_id, u.stripe_no)
         ORDER BY s.project_id, s.stripe_no
           FOR NO KEY UPDATE OF s;
    END IF;
    UPDATE project_running_stripes s SET running = s.running - u.n
      FROM unnest(v_projects, v_stripes, v_units) u(project_id, stripe_no, n)
     WHERE (s.project_id, s.stripe_no) = (u.project_id, u.stripe_no);
END;
$$;

-- Take up to p_want slots of owner (p_kind, p_owner): stripes with room, SKIP LOCKED, one at
-- a time in this backend's order, until p_want are covered or none is left. Returns the
-- stripe of each slot taken (cardinality = the slots taken, possibly 0), and adds them to
-- the stripes' held counts. Never waits.
CREATE OR REPLACE FUNCTION pgd_take_slots(p_kind text, p_owner bigint, p_want integer) RETURNS smallint[]
LANGUAGE plpgsql AS $$
DECLARE
    v_units smallint[] := '{}';
    v_tried smallint[] := '{}';
    v_no    smallint;
    v_room  integer;
    v_take  integer;
BEGIN
    WHILE cardinality(v_units) < p_want LOOP
        SELECT s.stripe_no, s.cap - s.held INTO v_no, v_room
          FROM capacity_stripes s
         WHERE s.kind = p_kind AND s.owner_id = p_owner AND s.held < s.cap
           AND s.stripe_no <> ALL (v_tried)
         ORDER BY pgd_stripe_order(s.stripe_no)
         LIMIT 1
           FOR NO KEY UPDATE SKIP LOCKED;
        EXIT WHEN NOT FOUND;
        v_tried := v_tried || v_no;
        v_take := least(v_room, p_want - cardinality(v_units));
        v_units := v_units || array_fill(v_no, ARRAY[v_take]);
    END LOOP;
    RETURN v_units;
END;
$$;

-- Add the slots in p_units (a stripe per slot, as pgd_take_slots returned, possibly cut
-- short) to the held counts of owner (p_kind, p_owner). The stripes are locked already.
CREATE OR REPLACE FUNCTION pgd_hold_slots(p_kind text, p_owner bigint, p_units smallint[]) RETURNS void
LANGUAGE sql AS $$
    UPDATE capacity_stripes s SET held = s.held + u.n
      FROM (SELECT x.stripe_no, count(*)::integer AS n FROM unnest(p_units) x(stripe_no)
             GROUP BY x.stripe_no) u
     WHERE s.kind = p_kind AND s.owner_id = p_owner AND s.stripe_no = u.stripe_no
$$;

-- Release the slots of finished jobs: p_org_ids, p_pool_ids and p_job_ids are parallel, one
-- entry per job. Each job's latest attempt (the one that held its slots: a release runs in
-- the transaction that ends it) names its stripes; the units are counted per stripe, the
-- stripes locked in (kind, owner, stripe) order and decremented in one statement. Then, for
-- an owner that owes (read in a new statement, after the stripe locks: a limit change that
-- committed meanwhile is seen), up to what it owes of the slots just released are retired:
-- the caps of those stripes are lowered by as much, and the debt decremented under its row
-- lock. Last, the jobs leave their project's running count (pgd_uncount_running). Callers
-- release each attempt once (its transition from 'running', under the job's row lock).
CREATE OR REPLACE FUNCTION pgd_release_slots(p_org_ids bigint[], p_pool_ids bigint[], p_job_ids bigint[])
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_kinds   text[];
    v_owners  bigint[];
    v_stripes smallint[];
    v_units   integer[];
    r         record;
    v_owed    integer;
    v_left    integer;
    v_take    integer;
BEGIN
    SELECT array_agg(g.kind ORDER BY g.kind, g.owner_id, g.stripe_no),
           array_agg(g.owner_id ORDER BY g.kind, g.owner_id, g.stripe_no),
           array_agg(g.stripe_no ORDER BY g.kind, g.owner_id, g.stripe_no),
           array_agg(g.n ORDER BY g.kind, g.owner_id, g.stripe_no)
      INTO v_kinds, v_owners, v_stripes, v_units
      FROM (SELECT h.kind, h.owner_id, h.stripe_no, count(*)::integer AS n
              FROM unnest(p_org_ids, p_pool_ids, p_job_ids) u(org_id, pool_id, job_id)
             CROSS JOIN LATERAL (SELECT a.organization_stripe, a.pool_stripe FROM attempts a
                                  WHERE a.job_id = u.job_id
                                  ORDER BY a.attempt_no DESC LIMIT 1) a
             CROSS JOIN LATERAL (VALUES ('organization', u.org_id, a.organization_stripe),
                                        ('pool', u.pool_id, a.pool_stripe)) h(kind, owner_id, stripe_no)
             WHERE h.stripe_no IS NOT NULL
             GROUP BY h.kind, h.owner_id, h.stripe_no) g;
    IF v_kinds IS NULL THEN
        PERFORM pgd_uncount_running(p_job_ids);
        RETURN;
    END IF;
    -- the stripes in (kind, owner, stripe) order, the order a limit change takes them in,
    -- so that a release never holds a later stripe while waiting for an earlier one
    IF cardinality(v_kinds) > 2 THEN
        PERFORM 1 FROM capacity_stripes s
          JOIN unnest(v_kinds, v_owners, v_stripes) u(kind, owner_id, stripe_no)
            ON (s.kind, s.owner_id, s.stripe_no) = (u.kind, u.owner_id, u.stripe_no)
         ORDER BY s.kind, s.owner_id, s.stripe_no
           FOR NO KEY UPDATE OF s;
        UPDATE capacity_stripes s SET held = s.held - u.n
          FROM unnest(v_kinds, v_owners, v_stripes, v_units) u(kind, owner_id, stripe_no, n)
         WHERE (s.kind, s.owner_id, s.stripe_no) = (u.kind, u.owner_id, u.stripe_no);
    ELSE
        -- one job's two stripes (the usual single completion): a statement each, in order
        FOR i IN 1 .. cardinality(v_kinds) LOOP
            UPDATE capacity_stripes s SET held = s.held - v_units[i]
             WHERE s.kind = v_kinds[i] AND s.owner_id = v_owners[i] AND s.stripe_no = v_stripes[i];
        END LOOP;
    END IF;

    IF NOT EXISTS (SELECT 1 FROM capacity_debts) THEN
        PERFORM pgd_uncount_running(p_job_ids);
        RETURN;  -- the usual case: nothing owed anywhere
    END IF;
    FOR r IN SELECT d.kind, d.owner_id FROM capacity_debts d
               JOIN (SELECT DISTINCT u.kind, u.owner_id FROM unnest(v_kinds, v_owners) u(kind, owner_id)) u
                 ON (d.kind, d.owner_id) = (u.kind, u.owner_id)
              ORDER BY d.kind, d.owner_id
    LOOP
        -- waits for another release or a limit change of this owner; the latest version
        SELECT d.owed INTO v_owed FROM capacity_debts d
         WHERE d.kind = r.kind AND d.owner_id = r.owner_id FOR UPDATE;
        CONTINUE WHEN NOT FOUND;
        v_left := v_owed;
        FOR i IN 1 .. cardinality(v_kinds) LOOP
            CONTINUE WHEN v_kinds[i] <> r.kind OR v_owners[i] <> r.owner_id;
            EXIT WHEN v_left = 0;
            v_take := least(v_left, v_units[i]);
            UPDATE capacity_stripes s SET cap = s.cap - v_take
             WHERE s.kind = r.kind AND s.owner_id = r.owner_id AND s.stripe_no = v_stripes[i];
            v_left := v_left - v_take;
        END LOOP;
        IF v_left = 0 THEN
            DELETE FROM capacity_debts d WHERE d.kind = r.kind AND d.owner_id = r.owner_id;
        ELSE
            UPDATE capacity_debts d SET owed = v_left WHERE d.kind = r.kind AND d.owner_id = r.owner_id;
        END IF;
    END LOOP;
    PERFORM pgd_uncount_running(p_job_ids);
END;
$$;

-- The project claim lock. A claim takes its project's lock after the job and the target
-- and before the stripes; then it reads the project row in a new statement (so that a pause
-- or a bound change that committed while it waited is seen). The lock is
--   * shared while the project has no bound and capacity is not scarce
--     (pgd_capacity_scarce): claims of one project run side by side;
--   * exclusive when the project has a bound (its running count, read under the lock, is
--     exact: every earlier claim of the project has committed) or while capacity is scarce,
--     so that the fairness re-check (pgd_fairer_candidate_exists) reads committed shares and
--     claims of one project take turns.
-- A claim that read "no bound" and finds one under its shared lock passes the project over
-- to its second pass, which takes the exclusive lock (a lock is never upgraded in place).
-- A pause, a resume or a bound change takes the project row, then the exclusive lock
-- (trigger pgd_project_claims_fence below): it waits for the claims in flight, and new ones
-- queue behind it. Claims never wait for the project row (its last_claimed_at stamp is taken
-- SKIP LOCKED), so there is no cycle.

-- The advisory lock class of project claim locks (the first key of the two-key form), and
-- a project's key in it (ids beyond 2^31 - 1 wrap, which can only make two projects share a
-- lock: more waiting, never less exclusion).
CREATE OR REPLACE FUNCTION pgd_claim_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 1885824099 $$;  -- 'pgdc' as four bytes

CREATE OR REPLACE FUNCTION pgd_claim_lock_key(p_project_id bigint) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT (p_project_id % 2147483647)::integer $$;

-- A pause, a resume or a bound change waits for the project's claims in flight and holds
-- new ones off until it commits.
CREATE OR REPLACE FUNCTION pgd_project_claims_fence() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(pgd_claim_lock_class(), pgd_claim_lock_key(NEW.id));
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER pgd_project_claims_fence AFTER UPDATE OF paused_at, max_running ON projects
    FOR EACH ROW
    WHEN (OLD.paused_at IS DISTINCT FROM NEW.paused_at
          OR OLD.max_running IS DISTINCT FROM NEW.max_running)
    EXECUTE FUNCTION pgd_project_claims_fence();
