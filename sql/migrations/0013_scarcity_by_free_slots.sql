-- 0013_scarcity_by_free_slots: the claim's "is capacity scarce?" read counts free slots up to
-- the racing claims instead of held slots up to the limit, so its cost no longer grows with
-- the running jobs (issue 5; docs/benchmarks.md, "Claim cost with many jobs running").
--
-- Before (0008): scarce when held > limit - racing, counting held slots (up to
-- limit - racing + 1 of them) for the organization and again for the pool, on every claim.
-- With 20,000 jobs running in one organization and pool that read was 6.3 of a claim's
-- 8.5 ms. Free slot rows are max(limit - held, 0) in every committed state (pgd_sync_slots
-- keeps that many; a release that owes a retirement deletes the slot it frees), so
--   held > limit - racing  <=>  limit - held < racing  <=>  free < racing   (racing >= 1),
-- and counting free rows stops after `racing` of them. Whichever side is smaller is
-- counted: free rows up to `racing` when racing <= limit / 2, held rows up to
-- limit - racing + 1 otherwise (many live runners against a small limit). Same answer,
-- read without locks as before.

CREATE OR REPLACE FUNCTION pgd_capacity_scarce(p_org_id bigint, p_pool_id bigint, p_racing integer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT o.max_running < p_racing OR q.slots < p_racing
           OR CASE WHEN p_racing >= 1 AND p_racing <= o.max_running / 2
                   THEN (SELECT count(*) FROM (SELECT 1 FROM organization_slots s
                                                WHERE s.organization_id = o.id AND s.job_id IS NULL
                                                LIMIT p_racing) f) < p_racing
                   ELSE (SELECT count(*) FROM (SELECT 1 FROM organization_slots s
                                                WHERE s.organization_id = o.id AND s.job_id IS NOT NULL
                                                LIMIT greatest(o.max_running - p_racing + 1, 0)) h)
                        > o.max_running - p_racing END
           OR CASE WHEN p_racing >= 1 AND p_racing <= q.slots / 2
                   THEN (SELECT count(*) FROM (SELECT 1 FROM pool_slots s
                                                WHERE s.pool_id = q.id AND s.job_id IS NULL
                                                LIMIT p_racing) f) < p_racing
                   ELSE (SELECT count(*) FROM (SELECT 1 FROM pool_slots s
                                                WHERE s.pool_id = q.id AND s.job_id IS NOT NULL
                                                LIMIT greatest(q.slots - p_racing + 1, 0)) h)
                        > q.slots - p_racing END
      FROM organizations o, pools q
     WHERE o.id = p_org_id AND q.id = p_pool_id
$$;
