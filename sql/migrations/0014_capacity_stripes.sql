-- 0014_capacity_stripes: organization and pool capacity as a few stripes per owner, each
-- holding a share of the limit with a count of slots held, in place of one row per slot
-- (issue 5; docs/benchmarks.md, "Migration 0014: capacity stripes").
--
-- Before (0008): a limit of n was n slot rows. A claim updated one organization slot row and
-- one pool slot row per job, and a completion updated them back: a batch of 50 jobs wrote
-- 100 slot rows to claim and 100 to release. That was the largest cost left per job
-- (upper bound +21 % for batches, measured by a copy without slot rows; docs/benchmarks.md,
-- "The PGQueuer gap, taken apart").
--
-- Now an organization or a pool has pgd_capacity_stripes() (8) rows in capacity_stripes:
-- stripe k has `cap` slots of which `held` are held (0 <= held <= cap, a CHECK). A claim
-- takes slots from one stripe with room (held < cap) with FOR NO KEY UPDATE SKIP LOCKED and
-- adds what it took to `held`, once per stripe however many jobs the batch took there; a
-- batch that needs more than one stripe's room takes further stripes the same way. Each
-- attempt records the stripes it holds (attempts.organization_stripe, pool_stripe); a
-- completion or an expiry subtracts the job's running attempt's units from those stripes,
-- counted per stripe (pgd_release_slots). Claims start at a stripe chosen by their backend
-- (pg_backend_pid() modulo 8), so concurrent claims and releases spread over the stripes
-- instead of queueing on one row. A claim never waits for a stripe: one locked by another
-- claim or a release is passed, another one with room is taken, or the candidate is passed
-- over, as with slot rows.
--
-- Limits (pgd_split_capacity, from the trigger pgd_sync_stripes on a limit change): every
-- stripe of the owner is locked in stripe order (waiting for the claims and releases in
-- flight there; claims skip them meanwhile), the held slots h are summed, and for a limit n:
--   * h <= n: each stripe's cap becomes its held count plus an even share of n - h (the first
--     (n - h) mod 8 stripes one more), so the caps sum to n and nothing is owed;
--   * h > n: each stripe's cap becomes its held count (no stripe has room), and h - n slots
--     are owed (capacity_debts, 0008's slot_retirements renamed).
-- A release, in a new statement after its stripe row locks (so a limit change that committed
-- while it waited is seen), lowers the caps of the stripes it released from by up to what
-- its owner owes, under the debt row's lock. Invariant: sum(cap) - owed = limit, and while
-- anything is owed every stripe is full (held = cap), so no claim is admitted until the
-- running jobs are below the limit, and capacity comes back one slot at a time as jobs end
-- beyond it, as with slot rows (tests/sql/test_stripes.py).
--
-- Lock order (docs/design.md): job -> target -> attempt -> (dependents) -> project claim lock
-- -> project row (SKIP LOCKED, stamp) -> organization stripes -> pool stripes -> debt rows.
-- Several stripes are always locked by (kind, owner id, stripe number): 'organization' sorts
-- before 'pool'. A limit change takes the owner's row (config apply: organizations, then
-- pools, each by id), then all its stripes in order, then its debt row.
--
-- The running count of an organization or a pool (pgd_organization_running,
-- pgd_pool_running) is the sum of its stripes' held slots: 8 rows, whatever the number of
-- jobs running.
--
-- Measured: six alternated rounds against 0013 of `python -m bench claim --series
-- pgdispatch-batch50,pgdispatch --clients 2,8 --repeats 1 --jobs 8000 --no-latency`, median
-- paired ratios: batches of 50 1.16 at N = 2 and 1.04 at N = 8, single claims 1.15 and 1.21;
-- with limits that bind, single claims 0.95 (few stripes have room, and a claim passes the
-- ones held). Against PGQueuer, batches of 50 best against best 1.07-1.11 (0.83-0.93
-- before). docs/benchmarks.md, "Migration 0014: capacity stripes".

-- What this migration changes, locked first, in the order a claim first touches it (the
-- owners in its candidate read, the slot rows, then the attempt it inserts), so that a claim
-- in flight cannot be half-way between two of them; a completion touches the attempt
-- before the slots and can still deadlock with it, and a long transaction on one of them
-- would hold every claim behind this one's queued lock: the lock timeout gives up after 5 s
-- instead. Either rolls the migration back, and `db upgrade` tries it again (sql/migrate.py,
-- found by an adversarial run: under live claims the upgrade failed in 3 of 8 runs).
SET LOCAL lock_timeout = '5s';
LOCK TABLE organizations, pools, organization_slots, pool_slots, slot_retirements, attempts
    IN ACCESS EXCLUSIVE MODE;

-- The stripes per owner. Changing it needs a migration (stripes are numbered 1..8, a CHECK).
CREATE FUNCTION pgd_capacity_stripes() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 8 $$;

-- Organizations and pools are never deleted (config apply only upserts), so owner_id has no
-- foreign key: one table for both kinds lets a release lock and update all its stripes in
-- one ordered statement. fillfactor 20 leaves room on each page for the row's next version
-- (a HOT update, no index entry): the rows are few and updated on every claim and release.
CREATE TABLE capacity_stripes (
    kind      text NOT NULL CHECK (kind IN ('organization', 'pool')),
    owner_id  bigint NOT NULL,
    stripe_no smallint NOT NULL CHECK (stripe_no BETWEEN 1 AND 8),
    cap       integer NOT NULL,
    held      integer NOT NULL DEFAULT 0,
    CHECK (held >= 0 AND held <= cap),
    PRIMARY KEY (kind, owner_id, stripe_no)
) WITH (fillfactor = 20);

-- The stripes an attempt holds slots in while it runs (NULL for attempts finished before
-- this migration).
ALTER TABLE attempts ADD COLUMN organization_stripe smallint, ADD COLUMN pool_stripe smallint;

-- What is owed, as before: no row while nothing is (a release probes for any row first).
ALTER TABLE slot_retirements RENAME TO capacity_debts;
ALTER TABLE capacity_debts RENAME CONSTRAINT slot_retirements_pkey TO capacity_debts_pkey;

-- A limit (re)set to p_limit for owner (p_kind, p_owner): creates its stripes if missing,
-- locks all of them in stripe order, sums what they hold, and re-splits the caps and the
-- debt as the header says.
CREATE FUNCTION pgd_split_capacity(p_kind text, p_owner bigint, p_limit integer)
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

CREATE FUNCTION pgd_sync_stripes() RETURNS trigger
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

-- The held slots move to stripes: each running attempt that holds a slot row is given a
-- stripe, round robin within its owner; the stripes start full (cap = held), then are split
-- against the limit like any limit change (which also sets what is owed).
UPDATE attempts a
   SET organization_stripe = h.stripe_no
  FROM (SELECT s.job_id, ((row_number() OVER (PARTITION BY s.organization_id ORDER BY s.slot_no) - 1)
                          % pgd_capacity_stripes() + 1)::smallint AS stripe_no
          FROM organization_slots s WHERE s.job_id IS NOT NULL) h
 WHERE a.job_id = h.job_id AND a.state = 'running';
UPDATE attempts a
   SET pool_stripe = h.stripe_no
  FROM (SELECT s.job_id, ((row_number() OVER (PARTITION BY s.pool_id ORDER BY s.slot_no) - 1)
                          % pgd_capacity_stripes() + 1)::smallint AS stripe_no
          FROM pool_slots s WHERE s.job_id IS NOT NULL) h
 WHERE a.job_id = h.job_id AND a.state = 'running';
INSERT INTO capacity_stripes (kind, owner_id, stripe_no, cap, held)
SELECT 'organization', o.id, g, h.n, h.n
  FROM organizations o
 CROSS JOIN generate_series(1, pgd_capacity_stripes()) g
 CROSS JOIN LATERAL (SELECT count(*)::integer AS n FROM attempts a JOIN jobs j ON j.id = a.job_id
                       JOIN projects p ON p.id = j.project_id
                      WHERE a.state = 'running' AND p.organization_id = o.id
                        AND a.organization_stripe = g) h
UNION ALL
SELECT 'pool', q.id, g, h.n, h.n
  FROM pools q
 CROSS JOIN generate_series(1, pgd_capacity_stripes()) g
 CROSS JOIN LATERAL (SELECT count(*)::integer AS n FROM attempts a JOIN jobs j ON j.id = a.job_id
                      WHERE a.state = 'running' AND j.pool_id = q.id AND a.pool_stripe = g) h;
DO $$
BEGIN
    PERFORM pgd_split_capacity('organization', o.id, o.max_running) FROM organizations o ORDER BY o.id;
    PERFORM pgd_split_capacity('pool', q.id, q.slots) FROM pools q ORDER BY q.id;
END;
$$;

DROP TRIGGER pgd_sync_slots ON organizations;
DROP TRIGGER pgd_sync_slots_changed ON organizations;
DROP TRIGGER pgd_sync_slots ON pools;
DROP TRIGGER pgd_sync_slots_changed ON pools;
DROP FUNCTION pgd_sync_slots();
DROP TABLE organization_slots;
DROP TABLE pool_slots;

-- An upsert that leaves the limit as it was changes no stripe (and locks none).
CREATE TRIGGER pgd_sync_stripes AFTER INSERT ON organizations
    FOR EACH ROW EXECUTE FUNCTION pgd_sync_stripes();
CREATE TRIGGER pgd_sync_stripes_changed AFTER UPDATE OF max_running ON organizations
    FOR EACH ROW WHEN (OLD.max_running IS DISTINCT FROM NEW.max_running)
    EXECUTE FUNCTION pgd_sync_stripes();
CREATE TRIGGER pgd_sync_stripes AFTER INSERT ON pools
    FOR EACH ROW EXECUTE FUNCTION pgd_sync_stripes();
CREATE TRIGGER pgd_sync_stripes_changed AFTER UPDATE OF slots ON pools
    FOR EACH ROW WHEN (OLD.slots IS DISTINCT FROM NEW.slots)
    EXECUTE FUNCTION pgd_sync_stripes();

-- Release the slots of finished jobs: p_org_ids, p_pool_ids and p_job_ids are parallel, one
-- entry per job. Each job's latest attempt (the one that held its slots: a release runs in
-- the transaction that ends it) names its stripes; the units are counted per stripe, the
-- stripes locked in (kind, owner, stripe) order and decremented in one statement. Then, for
-- an owner that owes (read in a new statement, after the stripe locks: a limit change that
-- committed meanwhile is seen), up to what it owes of the slots just released are retired:
-- the caps of those stripes are lowered by as much, and the debt decremented under its row
-- lock. Callers release each attempt once (its transition from 'running', under the job's
-- row lock), as they did with slot rows.
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
END;
$$;

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

-- Free slots of an owner: room on its stripes, which is max(limit - held, 0) in every
-- committed state (the header's invariant). Read without locks.
CREATE FUNCTION pgd_free_slots(p_kind text, p_owner bigint) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(s.cap - s.held), 0)::integer FROM capacity_stripes s
     WHERE s.kind = p_kind AND s.owner_id = p_owner
$$;

-- Whether capacity is scarce for a claim from organization p_org_id and pool p_pool_id:
-- either has fewer free slots than p_racing claims (0008's rule). 16 stripe rows, whatever
-- the limits and the running jobs.
CREATE OR REPLACE FUNCTION pgd_capacity_scarce(p_org_id bigint, p_pool_id bigint, p_racing integer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT pgd_free_slots('organization', p_org_id) < p_racing
        OR pgd_free_slots('pool', p_pool_id) < p_racing
$$;

-- The stripe a claim tries first: spread by backend, so that concurrent claimers start on
-- different stripes. Position of stripe p_stripe_no in this backend's order.
CREATE FUNCTION pgd_stripe_order(p_stripe_no smallint) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT (p_stripe_no + pg_backend_pid()) % pgd_capacity_stripes()
$$;

-- Take up to p_want slots of owner (p_kind, p_owner): stripes with room, SKIP LOCKED, one at
-- a time in this backend's order, until p_want are covered or none is left. Returns the
-- stripe of each slot taken (cardinality = the slots taken, possibly 0), and adds them to
-- the stripes' held counts. Never waits.
CREATE FUNCTION pgd_take_slots(p_kind text, p_owner bigint, p_want integer) RETURNS smallint[]
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
CREATE FUNCTION pgd_hold_slots(p_kind text, p_owner bigint, p_units smallint[]) RETURNS void
LANGUAGE sql AS $$
    UPDATE capacity_stripes s SET held = s.held + u.n
      FROM (SELECT x.stripe_no, count(*)::integer AS n FROM unnest(p_units) x(stripe_no)
             GROUP BY x.stripe_no) u
     WHERE s.kind = p_kind AND s.owner_id = p_owner AND s.stripe_no = u.stripe_no
$$;

-- The functions below are 0011's with slot rows replaced by stripes. Applied migrations
-- stay as they are, so each is restated in full.

-- claim_candidates: as in 0011; an organization or a pool has room when one of its stripes
-- has (a probe, written like the job probe so that it stays one: see 0008).
CREATE OR REPLACE FUNCTION pgd_claim_candidates(p_pool_ids bigint[], p_org_id bigint)
RETURNS TABLE (org_id bigint, project_id bigint, pool_id bigint)
LANGUAGE sql STABLE AS $$
    SELECT p.organization_id AS org_id, pp.project_id, pp.pool_id
      FROM project_pools pp
      JOIN projects p ON p.id = pp.project_id
      JOIN organizations o ON o.id = p.organization_id
      JOIN pools q ON q.id = pp.pool_id
     CROSS JOIN LATERAL (SELECT count(*)::integer AS running FROM jobs j
                          WHERE j.project_id = p.id AND j.state = 'running') r
     WHERE pp.pool_id = ANY (p_pool_ids)
       AND p.paused_at IS NULL
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
                           OR EXISTS (SELECT 1 FROM targets t
                                       WHERE t.id = j.target_id AND t.state = 'free'))
                    ORDER BY j.priority DESC, j.id
                    LIMIT 1 OFFSET 0)
     ORDER BY r.running::float8 / p.weight, p.last_claimed_at NULLS FIRST, p.id, pp.pool_id
     LIMIT 16
$$;

-- claim: as in 0011, taking one slot of the organization and one of the pool from their
-- stripes (pgd_take_slots) where it took slot rows; the attempt records both stripes.
CREATE OR REPLACE FUNCTION pgd_claim(p_runner_id bigint, p_pool_ids bigint[], p_claim_token uuid,
                                     p_lease_seconds double precision)
RETURNS TABLE (job_id bigint, attempt_id bigint, attempt_no integer, generation bigint,
               lease_expires_at timestamptz, project_id bigint, pool_id bigint,
               target_id bigint, command text[], timeout_seconds integer)
LANGUAGE plpgsql AS $$
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
BEGIN
    v_pools := pgd_runner_pools(p_runner_id, p_pool_ids, p_lease_seconds);
    IF v_pools IS NULL THEN
        RETURN;  -- the runner is draining or stopped
    END IF;
    v_racing := pgd_racing_claims();

    FOR v_pass IN 1..2 LOOP
        v_retry := false;
        FOR c IN SELECT * FROM pgd_claim_candidates(v_pools, NULL) LOOP
        BEGIN
            -- SKIP LOCKED: a job another claimer is taking is not waited for, just passed.
            SELECT j.* INTO v_job
              FROM jobs j
             WHERE j.project_id = c.project_id AND j.pool_id = c.pool_id
               AND j.state = 'queued' AND j.ready_at <= now()
               AND (j.target_id IS NULL
                    OR EXISTS (SELECT 1 FROM targets t WHERE t.id = j.target_id AND t.state = 'free'))
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

            -- the project's claim lock (0011)
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

            UPDATE jobs j
               SET state = 'running', generation = j.generation + 1,
                   attempts_made = j.attempts_made + 1,
                   started_at = coalesce(j.started_at, now())
             WHERE j.id = v_job.id
            RETURNING * INTO v_job;

            -- claimed_at is the clock now, after every reservation (see 0007)
            v_claimed := clock_timestamp();
            v_lease := v_claimed + make_interval(secs => p_lease_seconds);
            INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                                  claimed_at, lease_expires_at, last_heartbeat_at,
                                  organization_stripe, pool_stripe)
            VALUES (v_job.id, v_job.attempts_made, v_job.generation, p_runner_id, p_claim_token,
                    'running', v_claimed, v_lease, now(), v_org_stripe, v_pool_stripe)
            RETURNING id INTO v_attempt;

            RETURN QUERY SELECT v_job.id, v_attempt, v_job.attempts_made, v_job.generation, v_lease,
                                v_job.project_id, v_job.pool_id, v_job.target_id, v_job.command,
                                v_job.timeout_seconds;
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

-- claim_batch: as in 0011; the free capacity read without locks is the stripes' room, and
-- under the project's claim lock up to n slots of the organization, then as many of the
-- pool, are taken from stripes with room (pgd_take_slots): the batch takes as many jobs as
-- both gave, and each attempt records the stripes of its two slots.
CREATE OR REPLACE FUNCTION pgd_claim_batch(p_runner_id bigint, p_pool_ids bigint[], p_claim_tokens uuid[],
                                           p_lease_seconds double precision)
RETURNS TABLE (job_id bigint, attempt_id bigint, attempt_no integer, generation bigint,
               lease_expires_at timestamptz, project_id bigint, pool_id bigint,
               target_id bigint, command text[], timeout_seconds integer, claim_token uuid)
LANGUAGE plpgsql AS $$
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
BEGIN
    IF v_want < 1 OR v_want > 1000 THEN
        RAISE EXCEPTION 'a batch claims 1 to 1000 jobs, got %', v_want USING ERRCODE = 'PD422';
    END IF;
    v_pools := pgd_runner_pools(p_runner_id, p_pool_ids, p_lease_seconds);
    IF v_pools IS NULL THEN
        RETURN;  -- the runner is draining or stopped
    END IF;
    v_racing := pgd_racing_claims();

    FOR v_pass IN 1..2 LOOP
        v_retry := false;
        FOR c IN SELECT * FROM pgd_claim_candidates(v_pools, NULL) LOOP
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
            v_org_units := v_org_units[1:v_n];
            v_ids := v_ids[1:v_n];
            PERFORM pgd_hold_slots('organization', c.org_id, v_org_units);
            PERFORM pgd_hold_slots('pool', c.pool_id, v_pool_units);

            UPDATE projects p SET last_claimed_at = clock_timestamp()
             WHERE p.id = (SELECT x.id FROM projects x WHERE x.id = v_proj.id
                             FOR NO KEY UPDATE SKIP LOCKED);

            v_claimed := clock_timestamp();
            v_lease := v_claimed + make_interval(secs => p_lease_seconds);
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
                                      organization_stripe, pool_stripe)
                SELECT n.id, n.attempts_made, n.generation, p_runner_id, p_claim_tokens[n.n],
                       'running', v_claimed, v_lease, now(), v_org_units[n.n], v_pool_units[n.n]
                  FROM numbered n
                RETURNING attempts.id, attempts.job_id, attempts.claim_token
            )
            SELECT n.id, i.id, n.attempts_made, n.generation, v_lease, n.project_id, n.pool_id,
                   n.target_id, n.command, n.timeout_seconds, i.claim_token
              FROM numbered n JOIN inserted i ON i.job_id = n.id
             ORDER BY n.n;
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
