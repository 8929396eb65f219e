-- 0008_slot_rows: organization and pool capacity as slot rows taken with SKIP LOCKED, and the
-- fairness re-check only while capacity is scarce (issue 5).
--
-- Before: every claim and every completion of an organization updated that organization's
-- row and its pool's row (`running`), so all of them queued on two rows; with 8 claimers the
-- backends spent ~2.8 ms of server CPU per job, mostly waking and re-checking lock waiters
-- (docs/benchmarks.md, "Single-job claims at 8 claimers").
--
-- Now a limit of n is n slot rows (see Limits). A claim takes a free one with FOR NO KEY UPDATE SKIP
-- LOCKED (never waits: a slot another claimer is taking is passed, another free one is
-- taken); a completion or an expiry frees its job's slot. `running` of an organization or a
-- pool is the number of its held slots (pgd_organization_running, pgd_pool_running). The
-- project keeps its counter row: the claim locks that row anyway (pause, bound, fairness).
--
-- Limits: an organization or pool with limit n and h jobs holding slots has max(n - h, 0)
-- free slot rows, and owes max(h - n, 0) retirements (slot_retirements). A claim takes a free
-- slot or nothing, so held slots never exceed n through a claim. A limit change
-- (trigger pgd_sync_slots) first locks every slot row of its owner, waiting for the claims and
-- releases in flight there, then counts, then adds or deletes free rows and sets what is
-- owed; claims meanwhile find every slot locked and take none. A release frees its slot, then
-- (a new statement, so it sees any limit change that committed while it waited for its slot
-- row) deletes it instead while retirements are owed. So lowering a limit below the running
-- jobs stops new claims only, and the slots come back one by one as jobs end beyond the
-- limit. A job holds at most one slot of an organization and one of a pool (unique indexes
-- on the held slots): a second claim of one job fails there even before the attempts index.
--
-- Lock order (docs/design.md): job -> target -> attempt -> (dependents) -> project ->
-- organization slot -> pool slot -> retirement rows. Slot rows are taken SKIP LOCKED, so a
-- claim never waits for one, and waits for nothing after its slots; a release may wait for
-- a limit change holding its slot row. A limit change takes the organization or pool row
-- (config apply: after the projects it names, owners by id), then every slot row of it in
-- slot order, then its retirement row: the same order, and it never waits for a job. A
-- release of several slots locks them by owner id and slot number first (pgd_release_slots).
--
-- Fairness (docs/fairness.md): the re-check under the project row lock (0007) now runs
-- while capacity is scarce: when the free slots of the candidate's organization or pool are
-- fewer than the slots of every runner that is neither stopped nor draining, the most claims
-- that could race for them. With more free slots than that no claim can be refused capacity
-- because another project's claim took it, and the claim decides from its lock-free read.

CREATE TABLE organization_slots (
    organization_id bigint NOT NULL REFERENCES organizations (id) ON DELETE CASCADE,
    slot_no         integer NOT NULL CHECK (slot_no >= 1),
    job_id          bigint,
    PRIMARY KEY (organization_id, slot_no)
);
-- free slots, in slot order: what a claim probes
CREATE INDEX organization_slots_free_idx ON organization_slots (organization_id, slot_no)
    WHERE job_id IS NULL;
-- held slots: a release finds its job's slot, a reader counts them; one slot per job
CREATE UNIQUE INDEX organization_slots_held_idx ON organization_slots (organization_id, job_id)
    WHERE job_id IS NOT NULL;

CREATE TABLE pool_slots (
    pool_id bigint NOT NULL REFERENCES pools (id) ON DELETE CASCADE,
    slot_no integer NOT NULL CHECK (slot_no >= 1),
    job_id  bigint,
    PRIMARY KEY (pool_id, slot_no)
);
CREATE INDEX pool_slots_free_idx ON pool_slots (pool_id, slot_no) WHERE job_id IS NULL;
CREATE UNIQUE INDEX pool_slots_held_idx ON pool_slots (pool_id, job_id) WHERE job_id IS NOT NULL;

-- Retirements owed: slots to delete as they are freed, because a limit was lowered below
-- the running jobs. No row while nothing is owed (the usual case: a release probes one index
-- entry and finds none).
CREATE TABLE slot_retirements (
    kind     text NOT NULL CHECK (kind IN ('organization', 'pool')),
    owner_id bigint NOT NULL,
    owed     integer NOT NULL CHECK (owed > 0),
    PRIMARY KEY (kind, owner_id)
);

-- The slots held now: running jobs (a running job has exactly one running attempt, which
-- holds its capacity; tests/faults/consistency.py), numbered from 1 within each organization
-- and pool; then max(limit - held, 0) free slots after them; then what is owed.
INSERT INTO organization_slots (organization_id, slot_no, job_id)
SELECT p.organization_id, row_number() OVER (PARTITION BY p.organization_id ORDER BY j.id), j.id
  FROM jobs j JOIN projects p ON p.id = j.project_id
 WHERE j.state = 'running';
INSERT INTO pool_slots (pool_id, slot_no, job_id)
SELECT j.pool_id, row_number() OVER (PARTITION BY j.pool_id ORDER BY j.id), j.id
  FROM jobs j
 WHERE j.state = 'running';
INSERT INTO organization_slots (organization_id, slot_no)
SELECT o.id, h.n + g
  FROM organizations o
 CROSS JOIN LATERAL (SELECT count(*)::integer AS n FROM organization_slots s
                      WHERE s.organization_id = o.id) h
 CROSS JOIN LATERAL generate_series(1, o.max_running - h.n) g;
INSERT INTO pool_slots (pool_id, slot_no)
SELECT q.id, h.n + g
  FROM pools q
 CROSS JOIN LATERAL (SELECT count(*)::integer AS n FROM pool_slots s WHERE s.pool_id = q.id) h
 CROSS JOIN LATERAL generate_series(1, q.slots - h.n) g;
INSERT INTO slot_retirements (kind, owner_id, owed)
SELECT 'organization', o.id, h.n - o.max_running
  FROM organizations o
 CROSS JOIN LATERAL (SELECT count(*)::integer AS n FROM organization_slots s
                      WHERE s.organization_id = o.id) h
 WHERE h.n > o.max_running
UNION ALL
SELECT 'pool', q.id, h.n - q.slots
  FROM pools q
 CROSS JOIN LATERAL (SELECT count(*)::integer AS n FROM pool_slots s WHERE s.pool_id = q.id) h
 WHERE h.n > q.slots;

ALTER TABLE organizations DROP COLUMN running;
ALTER TABLE pools DROP COLUMN running;

-- A limit (re)set to n: lock every slot row of the owner (waits for the claims and releases
-- in flight there; claims skip them meanwhile), count the held ones (h) and the free ones,
-- then keep max(n - h, 0) free rows (deleting the highest-numbered free ones, or adding rows
-- after the highest number) and owe max(h - n, 0) retirements.
CREATE FUNCTION pgd_sync_slots() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_limit integer;
    v_held  integer;
    v_free  integer;
    v_top   integer;
    v_want  integer;
BEGIN
    IF TG_TABLE_NAME = 'organizations' THEN
        v_limit := NEW.max_running;
        PERFORM 1 FROM organization_slots s WHERE s.organization_id = NEW.id
          ORDER BY s.slot_no FOR UPDATE;
        SELECT count(s.job_id), count(*) - count(s.job_id), coalesce(max(s.slot_no), 0)
          INTO v_held, v_free, v_top
          FROM organization_slots s WHERE s.organization_id = NEW.id;
        v_want := greatest(v_limit - v_held, 0);
        DELETE FROM organization_slots s
         WHERE s.organization_id = NEW.id
           AND s.slot_no IN (SELECT f.slot_no FROM organization_slots f
                              WHERE f.organization_id = NEW.id AND f.job_id IS NULL
                              ORDER BY f.slot_no DESC LIMIT greatest(v_free - v_want, 0));
        INSERT INTO organization_slots (organization_id, slot_no)
        SELECT NEW.id, v_top + g FROM generate_series(1, v_want - v_free) g;
    ELSE
        v_limit := NEW.slots;
        PERFORM 1 FROM pool_slots s WHERE s.pool_id = NEW.id ORDER BY s.slot_no FOR UPDATE;
        SELECT count(s.job_id), count(*) - count(s.job_id), coalesce(max(s.slot_no), 0)
          INTO v_held, v_free, v_top
          FROM pool_slots s WHERE s.pool_id = NEW.id;
        v_want := greatest(v_limit - v_held, 0);
        DELETE FROM pool_slots s
         WHERE s.pool_id = NEW.id
           AND s.slot_no IN (SELECT f.slot_no FROM pool_slots f
                              WHERE f.pool_id = NEW.id AND f.job_id IS NULL
                              ORDER BY f.slot_no DESC LIMIT greatest(v_free - v_want, 0));
        INSERT INTO pool_slots (pool_id, slot_no)
        SELECT NEW.id, v_top + g FROM generate_series(1, v_want - v_free) g;
    END IF;
    IF v_held > v_limit THEN
        INSERT INTO slot_retirements (kind, owner_id, owed)
        VALUES (rtrim(TG_TABLE_NAME, 's'), NEW.id, v_held - v_limit)
            ON CONFLICT (kind, owner_id) DO UPDATE SET owed = EXCLUDED.owed;
    ELSE
        DELETE FROM slot_retirements WHERE kind = rtrim(TG_TABLE_NAME, 's') AND owner_id = NEW.id;
    END IF;
    RETURN NULL;
END;
$$;
-- An upsert that leaves the limit as it was changes no slot (and locks none).
CREATE TRIGGER pgd_sync_slots AFTER INSERT ON organizations
    FOR EACH ROW EXECUTE FUNCTION pgd_sync_slots();
CREATE TRIGGER pgd_sync_slots_changed AFTER UPDATE OF max_running ON organizations
    FOR EACH ROW WHEN (OLD.max_running IS DISTINCT FROM NEW.max_running)
    EXECUTE FUNCTION pgd_sync_slots();
CREATE TRIGGER pgd_sync_slots AFTER INSERT ON pools
    FOR EACH ROW EXECUTE FUNCTION pgd_sync_slots();
CREATE TRIGGER pgd_sync_slots_changed AFTER UPDATE OF slots ON pools
    FOR EACH ROW WHEN (OLD.slots IS DISTINCT FROM NEW.slots)
    EXECUTE FUNCTION pgd_sync_slots();

-- Release the slots of finished jobs: p_org_ids, p_pool_ids and p_job_ids are parallel, one
-- entry per job (the holder). Each job's organization slot and pool slot are freed; then, for
-- an owner that owes retirements (read in a new statement, after the slot row locks: a limit
-- change that committed meanwhile is seen), up to what it owes of the slots just freed are
-- deleted instead and the debt is decremented under its row lock.
CREATE FUNCTION pgd_release_slots(p_org_ids bigint[], p_pool_ids bigint[], p_job_ids bigint[])
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_org_freed  bigint[];  -- organization id of each slot freed, and its number
    v_org_nos    integer[];
    v_pool_freed bigint[];
    v_pool_nos   integer[];
    r            record;
    v_owed       integer;
    v_nos        integer[];
BEGIN
    IF cardinality(p_job_ids) > 1 THEN
        -- several slots: lock them in owner and slot order first, the order a limit change
        -- takes them in (pgd_sync_slots; config apply goes owner by owner in id order), so
        -- that a batch never holds a high slot while waiting for a low one (found by an
        -- adversarial run: a batch completion and a limit change deadlocked)
        PERFORM 1 FROM organization_slots s
          JOIN unnest(p_org_ids, p_job_ids) u(org_id, job_id)
            ON s.organization_id = u.org_id AND s.job_id = u.job_id
         ORDER BY s.organization_id, s.slot_no
           FOR NO KEY UPDATE OF s;
        PERFORM 1 FROM pool_slots s
          JOIN unnest(p_pool_ids, p_job_ids) u(pool_id, job_id)
            ON s.pool_id = u.pool_id AND s.job_id = u.job_id
         ORDER BY s.pool_id, s.slot_no
           FOR NO KEY UPDATE OF s;
    END IF;
    WITH freed AS (
        UPDATE organization_slots s SET job_id = NULL
          FROM unnest(p_org_ids, p_job_ids) u(org_id, job_id)
         WHERE s.organization_id = u.org_id AND s.job_id = u.job_id
        RETURNING s.organization_id, s.slot_no
    ) SELECT array_agg(organization_id), array_agg(slot_no) INTO v_org_freed, v_org_nos FROM freed;
    WITH freed AS (
        UPDATE pool_slots s SET job_id = NULL
          FROM unnest(p_pool_ids, p_job_ids) u(pool_id, job_id)
         WHERE s.pool_id = u.pool_id AND s.job_id = u.job_id
        RETURNING s.pool_id, s.slot_no
    ) SELECT array_agg(pool_id), array_agg(slot_no) INTO v_pool_freed, v_pool_nos FROM freed;

    IF NOT EXISTS (SELECT 1 FROM slot_retirements) THEN
        RETURN;  -- the usual case: nothing owed anywhere
    END IF;
    FOR r IN SELECT d.kind, d.owner_id FROM slot_retirements d
              WHERE (d.kind = 'organization' AND d.owner_id = ANY (v_org_freed))
                 OR (d.kind = 'pool' AND d.owner_id = ANY (v_pool_freed))
              ORDER BY d.kind, d.owner_id
    LOOP
        -- waits for another release or a limit change of this owner; the latest version
        SELECT d.owed INTO v_owed FROM slot_retirements d
         WHERE d.kind = r.kind AND d.owner_id = r.owner_id FOR UPDATE;
        CONTINUE WHEN NOT FOUND;
        IF r.kind = 'organization' THEN
            v_nos := ARRAY(SELECT u.no FROM unnest(v_org_freed, v_org_nos) u(owner, no)
                            WHERE u.owner = r.owner_id LIMIT v_owed);
            DELETE FROM organization_slots s
             WHERE s.organization_id = r.owner_id AND s.slot_no = ANY (v_nos);
        ELSE
            v_nos := ARRAY(SELECT u.no FROM unnest(v_pool_freed, v_pool_nos) u(owner, no)
                            WHERE u.owner = r.owner_id LIMIT v_owed);
            DELETE FROM pool_slots s WHERE s.pool_id = r.owner_id AND s.slot_no = ANY (v_nos);
        END IF;
        IF cardinality(v_nos) = v_owed THEN
            DELETE FROM slot_retirements d WHERE d.kind = r.kind AND d.owner_id = r.owner_id;
        ELSE
            UPDATE slot_retirements d SET owed = d.owed - cardinality(v_nos)
             WHERE d.kind = r.kind AND d.owner_id = r.owner_id;
        END IF;
    END LOOP;
END;
$$;

-- Running jobs of an organization or a pool: its held slots (an index-only count of the
-- held index). What the `running` column said before this migration.
CREATE FUNCTION pgd_organization_running(p_org_id bigint) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT count(*)::integer FROM organization_slots s
     WHERE s.organization_id = p_org_id AND s.job_id IS NOT NULL
$$;
CREATE FUNCTION pgd_pool_running(p_pool_id bigint) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT count(*)::integer FROM pool_slots s WHERE s.pool_id = p_pool_id AND s.job_id IS NOT NULL
$$;

-- The most claims that could race for capacity now: the slots of every runner that is
-- neither stopped nor draining. A runner that died without stopping still counts, which
-- only makes the fairness re-check run more often.
CREATE FUNCTION pgd_racing_claims() RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(r.slots), 0)::integer FROM runners r
     WHERE r.stopped_at IS NULL AND NOT r.draining
$$;

-- Whether capacity is scarce for a claim from organization p_org_id and pool p_pool_id:
-- either has fewer free slots (limit minus held) than p_racing claims. Reads without locks;
-- counts at most limit - p_racing + 1 held slots of each, so a large limit with few held
-- slots costs a few index entries.
CREATE FUNCTION pgd_capacity_scarce(p_org_id bigint, p_pool_id bigint, p_racing integer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT o.max_running < p_racing OR q.slots < p_racing
           OR (SELECT count(*) FROM (SELECT 1 FROM organization_slots s
                                      WHERE s.organization_id = o.id AND s.job_id IS NOT NULL
                                      LIMIT greatest(o.max_running - p_racing + 1, 0)) h)
              > o.max_running - p_racing
           OR (SELECT count(*) FROM (SELECT 1 FROM pool_slots s
                                      WHERE s.pool_id = q.id AND s.job_id IS NOT NULL
                                      LIMIT greatest(q.slots - p_racing + 1, 0)) h)
              > q.slots - p_racing
      FROM organizations o, pools q
     WHERE o.id = p_org_id AND q.id = p_pool_id
$$;

-- Release the capacity of finished attempts. The arrays are parallel, one entry per attempt:
-- its job (the slots' holder), project, organization and pool. Projects are locked by id and
-- decremented by their count; then each job's organization slot and pool slot are released
-- (pgd_release_slots).
DROP FUNCTION pgd_release_capacity(bigint[], bigint[], bigint[]);
CREATE FUNCTION pgd_release_capacity(p_job_ids bigint[], p_project_ids bigint[],
                                     p_org_ids bigint[], p_pool_ids bigint[])
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM projects p WHERE p.id = ANY (p_project_ids) ORDER BY p.id FOR NO KEY UPDATE;
    UPDATE projects p SET running = p.running - f.n
      FROM (SELECT id, count(*) AS n FROM unnest(p_project_ids) id GROUP BY id) f
     WHERE p.id = f.id;
    PERFORM pgd_release_slots(p_org_ids, p_pool_ids, p_job_ids);
END;
$$;

-- The functions below are 0004's and 0007's with the organization and pool counters replaced
-- by slots (and, in the claims, the re-check made conditional on pgd_capacity_scarce).
-- Applied migrations stay as they are, so each is restated in full.

-- claim_candidates: as in 0004; an organization or a pool has room when it has a free slot
-- (a probe of its free-slot index) instead of running < limit. Each probe is written like the
-- job probe (ORDER BY the index, LIMIT 1 OFFSET 0) so that it stays a probe: once the slot
-- tables had statistics saying most slots were free, the planner flattened the pool's EXISTS
-- into a semi-join that hashed every free slot of the pool for every claim (100,000 slots:
-- 11 ms per claim instead of 0.9; docs/benchmarks.md, "Latency at size").
CREATE OR REPLACE FUNCTION pgd_claim_candidates(p_pool_ids bigint[], p_org_id bigint)
RETURNS TABLE (org_id bigint, project_id bigint, pool_id bigint)
LANGUAGE sql STABLE AS $$
    SELECT p.organization_id AS org_id, pp.project_id, pp.pool_id
      FROM project_pools pp
      JOIN projects p ON p.id = pp.project_id
      JOIN organizations o ON o.id = p.organization_id
      JOIN pools q ON q.id = pp.pool_id
     WHERE pp.pool_id = ANY (p_pool_ids)
       AND p.paused_at IS NULL
       AND CASE WHEN p_org_id IS NULL
                THEN EXISTS (SELECT 1 FROM organization_slots s
                              WHERE s.organization_id = o.id AND s.job_id IS NULL
                              ORDER BY s.slot_no LIMIT 1 OFFSET 0)
                ELSE o.id = p_org_id END
       AND (p.max_running IS NULL OR p.running < p.max_running)
       AND EXISTS (SELECT 1 FROM pool_slots s
                    WHERE s.pool_id = q.id AND s.job_id IS NULL
                    ORDER BY s.slot_no LIMIT 1 OFFSET 0)
       AND EXISTS (SELECT 1
                     FROM jobs j
                    WHERE j.project_id = p.id AND j.pool_id = pp.pool_id
                      AND j.state = 'queued' AND j.ready_at <= now()
                      AND (j.target_id IS NULL
                           OR EXISTS (SELECT 1 FROM targets t
                                       WHERE t.id = j.target_id AND t.state = 'free'))
                    ORDER BY j.priority DESC, j.id
                    LIMIT 1 OFFSET 0)
     ORDER BY p.running::float8 / p.weight, p.last_claimed_at NULLS FIRST, p.id, pp.pool_id
     LIMIT 16
$$;

-- claim: as in 0007 (job SKIP LOCKED, target, project row with pause, bound and fairness),
-- then one free organization slot and one free pool slot, each taken SKIP LOCKED within its
-- limit; a candidate without both is passed over. On the first pass the fairness re-check
-- runs only while capacity is scarce (pgd_capacity_scarce).
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
    v_job     jobs%ROWTYPE;
    v_attempt bigint;
    v_claimed timestamptz;
    v_lease   timestamptz;
    v_racing  integer;
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

            SELECT * INTO v_proj FROM projects p WHERE p.id = c.project_id FOR NO KEY UPDATE;
            IF v_proj.paused_at IS NOT NULL
               OR (v_proj.max_running IS NOT NULL AND v_proj.running >= v_proj.max_running) THEN
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
            IF v_pass = 1 AND pgd_capacity_scarce(c.org_id, c.pool_id, v_racing)
               AND pgd_fairer_candidate_exists(v_pools, c.org_id, v_proj) THEN
                v_retry := true;
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
            UPDATE projects p SET running = p.running + 1, last_claimed_at = clock_timestamp()
             WHERE p.id = v_proj.id;

            -- a free organization slot and a free pool slot, SKIP LOCKED
            UPDATE organization_slots s SET job_id = v_job.id
             WHERE (s.organization_id, s.slot_no) = (
                   SELECT f.organization_id, f.slot_no FROM organization_slots f
                    WHERE f.organization_id = c.org_id AND f.job_id IS NULL
                    ORDER BY f.slot_no
                    LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED);
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

            UPDATE pool_slots s SET job_id = v_job.id
             WHERE (s.pool_id, s.slot_no) = (
                   SELECT f.pool_id, f.slot_no FROM pool_slots f
                    WHERE f.pool_id = c.pool_id AND f.job_id IS NULL
                    ORDER BY f.slot_no
                    LIMIT 1 FOR NO KEY UPDATE OF f SKIP LOCKED);
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;

            UPDATE jobs j
               SET state = 'running', generation = j.generation + 1,
                   attempts_made = j.attempts_made + 1,
                   started_at = coalesce(j.started_at, now())
             WHERE j.id = v_job.id
            RETURNING * INTO v_job;

            -- claimed_at is the clock now, after every reservation, not now() (the
            -- transaction's start, which may precede the wait for the project row).
            v_claimed := clock_timestamp();
            v_lease := v_claimed + make_interval(secs => p_lease_seconds);
            INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                                  claimed_at, lease_expires_at, last_heartbeat_at)
            VALUES (v_job.id, v_job.attempts_made, v_job.generation, p_runner_id, p_claim_token,
                    'running', v_claimed, v_lease, now())
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

-- claim_batch: as in 0007, with the free capacity read without locks counted in free slots
-- (at most the batch's size of each); under the project row lock, up to n free organization
-- slots, then as many free pool slots, SKIP LOCKED: the batch takes as many jobs as both gave.
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
    v_free    integer;
    v_ids     bigint[];
    v_racing  integer;
    v_org_slots  integer[];
    v_pool_slots integer[];
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
            SELECT least(coalesce(p.max_running - p.running, v_want),
                         (SELECT count(*) FROM (SELECT 1 FROM organization_slots f
                                                 WHERE f.organization_id = c.org_id AND f.job_id IS NULL
                                                 LIMIT v_want) s),
                         (SELECT count(*) FROM (SELECT 1 FROM pool_slots f
                                                 WHERE f.pool_id = c.pool_id AND f.job_id IS NULL
                                                 LIMIT v_want) s))
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

            SELECT * INTO v_proj FROM projects p WHERE p.id = c.project_id FOR NO KEY UPDATE;
            IF v_proj.paused_at IS NOT NULL THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            IF v_pass = 1 AND pgd_capacity_scarce(c.org_id, c.pool_id, v_racing)
               AND pgd_fairer_candidate_exists(v_pools, c.org_id, v_proj) THEN
                v_retry := true;
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
            v_n := least(cardinality(v_ids), coalesce(v_proj.max_running - v_proj.running, v_want));
            IF v_n < 1 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            -- up to v_n free organization slots, then as many free pool slots, SKIP LOCKED;
            -- the count taken is what both give (organization slots
            -- locked beyond it stay free, locked until the commit, and are skipped meanwhile)
            v_org_slots := ARRAY(
                SELECT f.slot_no FROM organization_slots f
                 WHERE f.organization_id = c.org_id AND f.job_id IS NULL
                 ORDER BY f.slot_no
                 LIMIT v_n FOR NO KEY UPDATE OF f SKIP LOCKED);
            v_pool_slots := ARRAY(
                SELECT f.slot_no FROM pool_slots f
                 WHERE f.pool_id = c.pool_id AND f.job_id IS NULL
                 ORDER BY f.slot_no
                 LIMIT cardinality(v_org_slots) FOR NO KEY UPDATE OF f SKIP LOCKED);
            v_n := cardinality(v_pool_slots);
            IF v_n < 1 THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            v_ids := v_ids[1:v_n];

            UPDATE projects SET running = running + v_n, last_claimed_at = clock_timestamp()
             WHERE id = v_proj.id;
            UPDATE organization_slots s SET job_id = u.job_id
              FROM unnest(v_org_slots[1:v_n], v_ids) u(slot_no, job_id)
             WHERE s.organization_id = c.org_id AND s.slot_no = u.slot_no;
            UPDATE pool_slots s SET job_id = u.job_id
              FROM unnest(v_pool_slots, v_ids) u(slot_no, job_id)
             WHERE s.pool_id = c.pool_id AND s.slot_no = u.slot_no;

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
                                      state, claimed_at, lease_expires_at, last_heartbeat_at)
                SELECT n.id, n.attempts_made, n.generation, p_runner_id, p_claim_tokens[n.n],
                       'running', v_claimed, v_lease, now()
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

-- complete_attempt: as in 0007; the release decrements the project counter and frees the
-- job's organization and pool slots.
CREATE OR REPLACE FUNCTION pgd_complete_attempt(p_attempt_id bigint, p_generation bigint, p_outcome text,
                                     p_exit_code integer, p_error text, p_output_tail text,
                                     p_receipt_key text, p_backoff_base_seconds double precision,
                                     p_backoff_cap_seconds double precision, p_release boolean)
RETURNS jsonb
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_receipt   delivery_receipts%ROWTYPE;
    v_ids       record;
    v_job       jobs%ROWTYPE;
    v_attempt   attempts%ROWTYPE;
    v_is_late   boolean;
    v_job_state text;
    v_att_state text;
    v_ready_at  timestamptz;
    v_failures  integer;
    v_response  jsonb;
BEGIN
    IF p_outcome NOT IN ('succeeded', 'failed', 'cancelled', 'handed_back', 'lost') THEN
        RAISE EXCEPTION 'unknown outcome %', p_outcome USING ERRCODE = 'PD422';
    END IF;
    IF p_receipt_key IS NULL OR length(p_receipt_key) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'receipt key must be 1 to 200 characters' USING ERRCODE = 'PD422';
    END IF;
    IF p_generation IS NULL THEN
        RAISE EXCEPTION 'a completion names the generation it holds' USING ERRCODE = 'PD422';
    END IF;

    SELECT a.job_id, j.project_id, j.pool_id, j.target_id, p.organization_id AS org_id
      INTO v_ids
      FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
     WHERE a.id = p_attempt_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown attempt %', p_attempt_id USING ERRCODE = 'PD404';
    END IF;

    -- Lock order. These ids never change after insert, so reading them unlocked is safe.
    SELECT * INTO v_job FROM jobs WHERE id = v_ids.job_id FOR NO KEY UPDATE;
    IF v_ids.target_id IS NOT NULL THEN
        PERFORM 1 FROM targets WHERE id = v_ids.target_id FOR NO KEY UPDATE;
    END IF;
    SELECT * INTO v_attempt FROM attempts WHERE id = p_attempt_id FOR NO KEY UPDATE;

    -- Checked under the attempt's lock, so a concurrent first delivery of the same key for
    -- this attempt is seen here.
    SELECT * INTO v_receipt FROM delivery_receipts WHERE key = p_receipt_key;
    IF FOUND THEN
        IF v_receipt.attempt_id <> p_attempt_id THEN
            RAISE EXCEPTION 'receipt key % belongs to attempt %', p_receipt_key, v_receipt.attempt_id
                USING ERRCODE = 'PD409';
        END IF;
        RETURN v_receipt.response || jsonb_build_object('repeated', true);
    END IF;

    IF v_attempt.generation <> p_generation OR v_job.generation <> p_generation THEN
        RAISE EXCEPTION 'attempt % generation % is fenced out (job % is at generation %)',
            p_attempt_id, p_generation, v_job.id, v_job.generation USING ERRCODE = 'PDF01';
    END IF;
    IF v_attempt.state = 'running' AND v_job.state = 'running' THEN
        v_is_late := false;
    ELSIF v_attempt.state = 'lost' AND v_job.state = 'uncertain' AND p_outcome IN ('succeeded', 'failed') THEN
        v_is_late := true;
    ELSIF v_attempt.state = 'expired' AND p_outcome IN ('succeeded', 'failed')
          AND (v_job.state = 'queued'
               OR (v_job.state = 'failed'
                   AND NOT EXISTS (SELECT 1 FROM job_dependencies WHERE depends_on_job_id = v_job.id))) THEN
        -- A build whose report arrives after its lease lapsed while nobody has claimed the job
        -- since (same generation): its result is real, so it counts. Its slots were released
        -- at expiry, which also counted the failure; a late failure changes only the attempt.
        -- A job that already failed for good is only revived when no dependent was cancelled.
        IF p_outcome = 'failed' THEN
            UPDATE attempts SET state = 'failed', exit_code = p_exit_code, error = p_error,
                                output_tail = coalesce(p_output_tail, output_tail)
             WHERE id = p_attempt_id;
            v_response := jsonb_build_object(
                'status', 'recorded', 'job_id', v_job.id, 'attempt_id', p_attempt_id,
                'job_state', v_job.state, 'attempt_state', 'failed', 'is_late_report', true,
                'ready_at', v_job.ready_at, 'repeated', false);
            INSERT INTO delivery_receipts (key, attempt_id, outcome, response)
            VALUES (p_receipt_key, p_attempt_id, p_outcome, v_response);
            RETURN v_response;
        END IF;
        v_is_late := true;
    ELSE
        RAISE EXCEPTION 'attempt % is % and job % is %: fenced out',
            p_attempt_id, v_attempt.state, v_job.id, v_job.state USING ERRCODE = 'PDF01';
    END IF;

    v_failures := v_job.failures;
    v_ready_at := v_job.ready_at;
    IF p_outcome = 'succeeded' THEN
        v_att_state := 'succeeded';
        v_job_state := 'succeeded';
    ELSIF p_outcome = 'lost' THEN
        IF v_ids.target_id IS NULL THEN
            RAISE EXCEPTION 'outcome lost is only for deployments' USING ERRCODE = 'PD422';
        END IF;
        v_att_state := 'lost';
        v_job_state := 'uncertain';
    ELSIF p_outcome = 'handed_back' AND v_job.cancel_requested_at IS NULL THEN
        v_att_state := 'cancelled';
        v_job_state := 'queued';
        v_ready_at := now();
    ELSIF p_outcome IN ('cancelled', 'handed_back') OR v_job.cancel_requested_at IS NOT NULL THEN
        v_att_state := CASE WHEN p_outcome = 'failed' THEN 'failed' ELSE 'cancelled' END;
        v_job_state := 'cancelled';
    ELSE
        v_att_state := 'failed';
        -- a late report's failure was already counted when its lease expired
        v_failures := v_failures + CASE WHEN v_is_late THEN 0 ELSE 1 END;
        IF v_failures < v_job.max_attempts THEN
            v_job_state := 'queued';
            v_ready_at := now() + make_interval(
                secs => pgd_backoff_seconds(v_failures, p_backoff_base_seconds, p_backoff_cap_seconds));
        ELSE
            v_job_state := 'failed';
        END IF;
    END IF;

    UPDATE jobs
       SET state = v_job_state,
           failures = v_failures,
           ready_at = v_ready_at,
           finished_at = CASE WHEN v_job_state IN ('succeeded', 'failed', 'cancelled') THEN now() END,
           last_error = CASE WHEN v_att_state = 'succeeded' THEN NULL
                             ELSE coalesce(p_error, 'exit code ' || p_exit_code::text, p_outcome) END
     WHERE id = v_job.id;

    IF v_ids.target_id IS NOT NULL THEN
        IF v_job_state = 'uncertain' THEN
            UPDATE targets SET state = 'uncertain' WHERE id = v_ids.target_id;
        ELSE
            UPDATE targets SET state = 'free', holder_job_id = NULL, held_since = NULL
             WHERE id = v_ids.target_id AND holder_job_id = v_job.id;
        END IF;
    END IF;

    IF v_job_state = 'succeeded' THEN
        PERFORM pgd_release_dependents(v_job.id);
    ELSIF v_job_state IN ('failed', 'cancelled') THEN
        PERFORM pgd_cancel_dependents(v_job.id, format('dependency %s %s', v_job.id, v_job_state));
    END IF;

    IF v_is_late AND v_ids.target_id IS NOT NULL THEN
        -- the uncertain target is freed by the runner, not an operator: say so in the audit
        -- log, so the next operator hears who resolved it
        PERFORM pgd_audit('runner:' || r.name, 'late_report', 'target:' || t.name,
                          format('attempt %s of job %s reported %s after its lease lapsed',
                                 p_attempt_id, v_job.id, p_outcome),
                          jsonb_build_object('job_id', v_job.id, 'attempt_id', p_attempt_id,
                                             'outcome', p_outcome))
          FROM runners r, targets t
         WHERE r.id = v_attempt.runner_id AND t.id = v_ids.target_id;
    END IF;

    v_response := jsonb_build_object(
        'status', 'recorded', 'job_id', v_job.id, 'attempt_id', p_attempt_id,
        'job_state', v_job_state, 'attempt_state', v_att_state, 'is_late_report', v_is_late,
        'ready_at', v_ready_at, 'repeated', false);
    INSERT INTO delivery_receipts (key, attempt_id, outcome, response)
    VALUES (p_receipt_key, p_attempt_id, p_outcome, v_response);

    -- the project's counter and the job's slots last
    IF p_release AND NOT v_is_late THEN
        UPDATE projects SET running = running - 1 WHERE id = v_ids.project_id;
        PERFORM pgd_release_slots(ARRAY[v_ids.org_id], ARRAY[v_ids.pool_id], ARRAY[v_job.id]);
    END IF;

    UPDATE attempts
       SET state = v_att_state,
           -- after the release, like claimed_at after the reservations (see pgd_claim); a
           -- late report keeps the time the lease lapsed, when its slots were released
           finished_at = CASE WHEN v_is_late THEN finished_at ELSE clock_timestamp() END,
           exit_code = p_exit_code,
           error = p_error,
           output_tail = coalesce(p_output_tail, output_tail)
     WHERE id = p_attempt_id;
    RETURN v_response;
END;
$$;

-- complete_batch: as in 0007; the release (pgd_release_capacity) names each item's job, the
-- holder of its slots.
CREATE OR REPLACE FUNCTION pgd_complete_batch(p_items jsonb, p_backoff_base_seconds double precision,
                                              p_backoff_cap_seconds double precision)
RETURNS SETOF jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_targets  bigint[];
    v_attempts bigint[];
    v_rows pgd_fast_completion[];
    v_jobs bigint[];
    v_done bigint[];
    v_answers jsonb[];
    v_answer  jsonb;
    v_fast_ords    bigint[];
    v_fast_answers jsonb[];
    v_orgs     bigint[] := '{}';
    v_projects bigint[] := '{}';
    v_pools    bigint[] := '{}';
    v_holders  bigint[] := '{}';
    v_released bigint[] := '{}';
    v_ids  record;
    it     record;
BEGIN
    IF p_items IS NULL OR jsonb_typeof(p_items) <> 'array' OR jsonb_array_length(p_items) > 1000 THEN
        RAISE EXCEPTION 'items must be an array of at most 1000 completions' USING ERRCODE = 'PD422';
    END IF;
    -- the same checks pgd_complete makes, before anything is written: a bad item fails the batch
    PERFORM 1 FROM jsonb_to_recordset(p_items) AS x(outcome text, receipt_key text)
     WHERE x.outcome IS NULL
        OR x.outcome NOT IN ('succeeded', 'failed', 'cancelled', 'handed_back', 'lost');
    IF FOUND THEN
        RAISE EXCEPTION 'unknown outcome in batch' USING ERRCODE = 'PD422';
    END IF;
    PERFORM 1 FROM jsonb_to_recordset(p_items) AS x(receipt_key text)
     WHERE x.receipt_key IS NULL OR length(x.receipt_key) NOT BETWEEN 1 AND 200;
    IF FOUND THEN
        RAISE EXCEPTION 'receipt key must be 1 to 200 characters' USING ERRCODE = 'PD422';
    END IF;
    PERFORM 1 FROM jsonb_to_recordset(p_items) AS x(attempt_id bigint, generation bigint)
     WHERE x.attempt_id IS NULL OR x.generation IS NULL;
    IF FOUND THEN
        RAISE EXCEPTION 'every item needs an attempt id and a generation' USING ERRCODE = 'PD422';
    END IF;
    v_answers := array_fill(NULL::jsonb, ARRAY[jsonb_array_length(p_items)]);

    -- The ids of every row to lock, read without locks (they never change after insert), one
    -- primary-key probe per item (OFFSET 0 keeps each probe a probe), then the locks in the
    -- lock order: jobs, targets, attempts, each by id.
    SELECT array_agg(DISTINCT a.job_id ORDER BY a.job_id),
           array_agg(DISTINCT j.target_id ORDER BY j.target_id) FILTER (WHERE j.target_id IS NOT NULL),
           array_agg(DISTINCT a.id ORDER BY a.id)
      INTO v_jobs, v_targets, v_attempts
      FROM (SELECT DISTINCT (e ->> 'attempt_id')::bigint AS id FROM jsonb_array_elements(p_items) e) u
      CROSS JOIN LATERAL (SELECT a.id, a.job_id FROM attempts a WHERE a.id = u.id OFFSET 0) a
      CROSS JOIN LATERAL (SELECT j.target_id FROM jobs j WHERE j.id = a.job_id OFFSET 0) j;
    PERFORM 1 FROM unnest(v_jobs) u(id)
      CROSS JOIN LATERAL (SELECT 1 FROM jobs j WHERE j.id = u.id FOR NO KEY UPDATE OFFSET 0) l;
    PERFORM 1 FROM targets t WHERE t.id = ANY (v_targets) ORDER BY t.id FOR NO KEY UPDATE;
    PERFORM 1 FROM unnest(v_attempts) u(id)
      CROSS JOIN LATERAL (SELECT 1 FROM attempts a WHERE a.id = u.id FOR NO KEY UPDATE OFFSET 0) l;
    -- every item's dependents at once, by id, before any item releases or cancels some
    PERFORM pgd_lock_dependents(v_jobs);

    -- The fast path, read under those locks: a build's success, reported by its current
    -- running attempt (generation matches job and attempt), with a receipt key not yet used,
    -- and neither the attempt nor the key named twice in this batch.
    v_rows := ARRAY(
        SELECT ROW(x.ord, x.attempt_id, w.job_id, w.org_id, w.project_id, w.pool_id,
                   x.receipt_key, x.exit_code, x.error, x.output_tail, w.ready_at)::pgd_fast_completion
          FROM (SELECT e.ord, i.*, count(*) OVER (PARTITION BY i.attempt_id) AS same_attempt,
                       count(*) OVER (PARTITION BY i.receipt_key) AS same_key
                  FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e(item, ord),
                       jsonb_to_record(e.item)
                       AS i(attempt_id bigint, generation bigint, outcome text, receipt_key text,
                            exit_code integer, error text, output_tail text)) x
          CROSS JOIN LATERAL (
                SELECT a.job_id FROM attempts a
                 WHERE a.id = x.attempt_id AND a.state = 'running' AND a.generation = x.generation
                OFFSET 0) a
          CROSS JOIN LATERAL (
                SELECT j.id AS job_id, p.organization_id AS org_id, j.project_id, j.pool_id, j.ready_at
                  FROM jobs j JOIN projects p ON p.id = j.project_id
                 WHERE j.id = a.job_id
                   AND j.state = 'running' AND j.target_id IS NULL AND j.generation = x.generation
                OFFSET 0) w
         WHERE x.outcome = 'succeeded' AND x.same_attempt = 1 AND x.same_key = 1
           AND NOT EXISTS (SELECT 1 FROM delivery_receipts r WHERE r.key = x.receipt_key));

    IF cardinality(v_rows) > 0 THEN
        UPDATE jobs j SET state = 'succeeded', finished_at = now(), last_error = NULL
          FROM unnest(v_rows) f WHERE j.id = f.job_id;

        -- Dependents (pgd_release_dependents for each finished job, at once): a dependent
        -- waiting on k of this batch's jobs loses k pending dependencies (already locked, by
        -- id, with every item's dependents above).
        v_done := ARRAY(SELECT f.job_id FROM unnest(v_rows) f);
        UPDATE jobs d
           SET pending_dependencies = d.pending_dependencies - k.n,
               state = CASE WHEN d.pending_dependencies = k.n
                                 AND (NOT d.requires_approval OR d.approved_at IS NOT NULL)
                            THEN 'queued' ELSE 'blocked' END,
               ready_at = CASE WHEN d.pending_dependencies = k.n THEN now() ELSE d.ready_at END
          FROM (SELECT jd.job_id, count(*) AS n FROM job_dependencies jd
                 WHERE jd.depends_on_job_id = ANY (v_done) GROUP BY jd.job_id) k
         WHERE d.id = k.job_id AND d.state = 'blocked';

        WITH answered AS (
            INSERT INTO delivery_receipts (key, attempt_id, outcome, response)
            SELECT f.receipt_key, f.attempt_id, 'succeeded',
                   jsonb_build_object('status', 'recorded', 'job_id', f.job_id,
                                      'attempt_id', f.attempt_id, 'job_state', 'succeeded',
                                      'attempt_state', 'succeeded', 'is_late_report', false,
                                      'ready_at', f.ready_at, 'repeated', false)
              FROM unnest(v_rows) f
            RETURNING attempt_id, response
        )
        SELECT array_agg(f.ord ORDER BY f.ord), array_agg(a.response ORDER BY f.ord)
          INTO v_fast_ords, v_fast_answers
          FROM answered a JOIN unnest(v_rows) f ON f.attempt_id = a.attempt_id;
        FOR i IN 1 .. cardinality(v_fast_ords) LOOP
            v_answers[v_fast_ords[i]] := v_fast_answers[i];
        END LOOP;
        v_orgs := ARRAY(SELECT f.org_id FROM unnest(v_rows) f);
        v_projects := ARRAY(SELECT f.project_id FROM unnest(v_rows) f);
        v_pools := ARRAY(SELECT f.pool_id FROM unnest(v_rows) f);
        v_holders := v_done;
    END IF;

    FOR it IN
        SELECT e.ord, x.*
          FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e(item, ord),
               jsonb_to_record(e.item)
               AS x(attempt_id bigint, generation bigint, outcome text, receipt_key text,
                    exit_code integer, error text, output_tail text)
         ORDER BY e.ord
    LOOP
        CONTINUE WHEN v_answers[it.ord] IS NOT NULL;
        BEGIN
            v_answer := pgd_complete_attempt(it.attempt_id, it.generation, it.outcome, it.exit_code,
                                             it.error, it.output_tail, it.receipt_key,
                                             p_backoff_base_seconds, p_backoff_cap_seconds, false);
            IF NOT (v_answer ->> 'repeated')::boolean AND NOT (v_answer ->> 'is_late_report')::boolean THEN
                SELECT p.organization_id AS org_id, j.project_id, j.pool_id, j.id AS job_id INTO v_ids
                  FROM jobs j JOIN projects p ON p.id = j.project_id
                 WHERE j.id = (v_answer ->> 'job_id')::bigint;
                v_orgs := v_orgs || v_ids.org_id;
                v_projects := v_projects || v_ids.project_id;
                v_pools := v_pools || v_ids.pool_id;
                v_holders := v_holders || v_ids.job_id;
                v_released := v_released || it.attempt_id;
            END IF;
        EXCEPTION WHEN SQLSTATE 'PDF01' THEN
            v_answer := jsonb_build_object('status', 'fenced', 'attempt_id', it.attempt_id,
                                           'error', SQLERRM);
        END;
        v_answers[it.ord] := v_answer;
    END LOOP;

    -- the project counters and the slots last
    IF cardinality(v_orgs) > 0 THEN
        PERFORM pgd_release_capacity(v_holders, v_projects, v_orgs, v_pools);
    END IF;
    -- the items completed one by one were stamped before the release: stamp them again after
    -- it, so that [claimed_at, finished_at) covers the time they held capacity
    UPDATE attempts SET finished_at = clock_timestamp() WHERE id = ANY (v_released);
    IF cardinality(v_rows) > 0 THEN
        UPDATE attempts a
           SET state = 'succeeded', finished_at = clock_timestamp(), exit_code = f.exit_code,
               error = f.error, output_tail = coalesce(f.output_tail, a.output_tail)
          FROM unnest(v_rows) f WHERE a.id = f.attempt_id;
    END IF;
    RETURN QUERY SELECT a FROM unnest(v_answers) a;
END;
$$;

-- expire: as in 0007; the release frees the job's organization and pool slots.
CREATE OR REPLACE FUNCTION pgd_expire_one(p_backoff_base_seconds double precision,
                                          p_backoff_cap_seconds double precision)
RETURNS jsonb
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c          record;
    v_job      jobs%ROWTYPE;
    v_attempt  attempts%ROWTYPE;
    v_failures integer;
    v_state    text;
    v_ready_at timestamptz;
BEGIN
    FOR c IN
        SELECT a.id AS attempt_id, a.job_id, j.project_id, j.pool_id, j.target_id,
               p.organization_id AS org_id
          FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
         WHERE a.state = 'running' AND a.lease_expires_at < clock_timestamp()
         ORDER BY a.lease_expires_at
         LIMIT 16
    LOOP
        BEGIN
            SELECT * INTO v_job FROM jobs WHERE id = c.job_id FOR NO KEY UPDATE SKIP LOCKED;
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'PDSKP'; END IF;
            IF c.target_id IS NOT NULL THEN
                PERFORM 1 FROM targets WHERE id = c.target_id FOR NO KEY UPDATE;
            END IF;
            SELECT * INTO v_attempt FROM attempts WHERE id = c.attempt_id FOR NO KEY UPDATE;
            -- a heartbeat or a completion may have won the race since the candidate read
            IF v_attempt.state <> 'running' OR v_attempt.lease_expires_at >= clock_timestamp()
               OR v_job.generation <> v_attempt.generation THEN
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;

            v_failures := v_job.failures + 1;
            v_ready_at := v_job.ready_at;
            IF c.target_id IS NOT NULL THEN
                v_state := 'uncertain';
                UPDATE targets SET state = 'uncertain' WHERE id = c.target_id;
            ELSIF v_job.cancel_requested_at IS NOT NULL THEN
                v_state := 'cancelled';
            ELSIF v_failures < v_job.max_attempts THEN
                v_state := 'queued';
                v_ready_at := now() + make_interval(
                    secs => pgd_backoff_seconds(v_failures, p_backoff_base_seconds, p_backoff_cap_seconds));
            ELSE
                v_state := 'failed';
            END IF;

            UPDATE jobs
               SET state = v_state, failures = v_failures, ready_at = v_ready_at,
                   finished_at = CASE WHEN v_state IN ('failed', 'cancelled') THEN now() END,
                   last_error = format('lease of attempt %s expired', c.attempt_id)
             WHERE id = c.job_id;
            IF v_state IN ('failed', 'cancelled') THEN
                PERFORM pgd_cancel_dependents(c.job_id, format('dependency %s %s', c.job_id, v_state));
            END IF;

            UPDATE projects SET running = running - 1 WHERE id = c.project_id;
            PERFORM pgd_release_slots(ARRAY[c.org_id], ARRAY[c.pool_id], ARRAY[c.job_id]);

            UPDATE attempts
               SET state = CASE WHEN c.target_id IS NOT NULL THEN 'lost' ELSE 'expired' END,
                   finished_at = clock_timestamp(), error = 'lease expired'
             WHERE id = c.attempt_id;
            RETURN jsonb_build_object('attempt_id', c.attempt_id, 'job_id', c.job_id,
                                      'job_state', v_state, 'is_deployment', c.target_id IS NOT NULL);
        EXCEPTION WHEN SQLSTATE 'PDSKP' THEN
            NULL;
        END;
    END LOOP;
    RETURN NULL;
END;
$$;
