-- name: upsert_organization!
-- Declare an organization and its concurrency limit (idempotent by name); its capacity
-- stripes are re-split to the limit (trigger pgd_sync_stripes, sql/functions/capacity.sql).
INSERT INTO organizations (name, max_running) VALUES (:name, :max_running)
ON CONFLICT (name) DO UPDATE SET max_running = excluded.max_running
 WHERE organizations.max_running IS DISTINCT FROM excluded.max_running;

-- name: upsert_pool!
-- Declare a pool and its slots (idempotent by name); its stripes follow (pgd_sync_stripes).
INSERT INTO pools (name, slots) VALUES (:name, :slots)
ON CONFLICT (name) DO UPDATE SET slots = excluded.slots
 WHERE pools.slots IS DISTINCT FROM excluded.slots;

-- name: get_project_organization$
-- The organization a project belongs to, by names. Read-only.
SELECT o.name FROM projects p JOIN organizations o ON o.id = p.organization_id WHERE p.name = :name;

-- name: upsert_project!
-- Declare a project: organization, fairness weight, optional running bound (idempotent by name).
INSERT INTO projects (name, organization_id, weight, max_running)
SELECT :name, o.id, :weight, :max_running FROM organizations o WHERE o.name = :organization
ON CONFLICT (name) DO UPDATE SET weight = excluded.weight, max_running = excluded.max_running
 WHERE (projects.weight, projects.max_running) IS DISTINCT FROM (excluded.weight, excluded.max_running);

-- name: set_project_pools!
-- Grant exactly these pools to a project: add the missing grants.
INSERT INTO project_pools (project_id, pool_id)
SELECT p.id, q.id FROM projects p, pools q
 WHERE p.name = :project AND q.name = ANY (CAST(:pools AS text[]))
ON CONFLICT DO NOTHING;

-- name: revoke_other_pools!
-- Grant exactly these pools to a project: remove grants not listed.
DELETE FROM project_pools pp USING projects p, pools q
 WHERE pp.project_id = p.id AND pp.pool_id = q.id AND p.name = :project
   AND NOT (q.name = ANY (CAST(:pools AS text[])));

-- name: upsert_target!
-- Declare a deployment target (idempotent by name; a new target is free), with its approval
-- rule, supersede flag and deployment order; an existing target is left alone here
-- (set_target_rule changes its rule).
INSERT INTO targets (name, requires_approval, approver_role, supersede, deploy_order)
VALUES (:name, :requires_approval, :approver_role, :supersede, :deploy_order)
ON CONFLICT (name) DO NOTHING;

-- name: set_target_rule!
-- A target's approval rule, supersede flag and deployment order as declared; writes (and
-- locks) the row only when one changed. The approval rule applies to deployments submitted
-- after it (their blocked state is kept on the job), supersede to the submits after it, the
-- order to the next claim.
UPDATE targets SET requires_approval = :requires_approval, approver_role = :approver_role,
                   supersede = :supersede, deploy_order = :deploy_order
 WHERE name = :name
   AND (requires_approval, approver_role, supersede, deploy_order)
       IS DISTINCT FROM (:requires_approval, :approver_role, :supersede, :deploy_order);

-- name: list_target_names$
-- Every target's name. Read-only.
SELECT coalesce(array_agg(name ORDER BY name), '{}') FROM targets;

-- name: set_project_supersede_targets!
-- The targets a project's newer deployment supersedes its older waiting ones on (a
-- project-and-target pair, project_target_supersede): add the missing ones.
INSERT INTO project_target_supersede (project_id, target_id)
SELECT p.id, t.id FROM projects p, targets t
 WHERE p.name = :project AND t.name = ANY (CAST(:targets AS text[]))
ON CONFLICT DO NOTHING;

-- name: revoke_other_supersede_targets!
-- The same: remove the pairs of the project not listed.
DELETE FROM project_target_supersede s USING projects p, targets t
 WHERE s.project_id = p.id AND s.target_id = t.id AND p.name = :project
   AND NOT (t.name = ANY (CAST(:targets AS text[])));

-- name: grant_runner_pools!
-- Grant exactly these pools to a runner host's login: add the missing grants.
INSERT INTO runner_grants (login, pool_id)
SELECT :login, q.id FROM pools q WHERE q.name = ANY (CAST(:pools AS text[]))
ON CONFLICT DO NOTHING;

-- name: revoke_other_runner_pools!
-- Grant exactly these pools to a runner host's login: remove grants not listed.
DELETE FROM runner_grants g USING pools q
 WHERE g.pool_id = q.id AND g.login = :login AND NOT (q.name = ANY (CAST(:pools AS text[])));

-- name: revoke_undeclared_runner_logins!
-- A [[runners]] section names every runner host: logins it does not name lose every grant.
DELETE FROM runner_grants WHERE NOT (login = ANY (CAST(:logins AS text[])));

-- name: list_runner_grants
-- Every runner host login's granted pools, by login. Read-only.
SELECT g.login, array_agg(q.name ORDER BY q.name) AS pools
  FROM runner_grants g JOIN pools q ON q.id = g.pool_id
 GROUP BY g.login ORDER BY g.login;

-- name: lock_declared_projects
-- Lock the existing projects a config names, by id: the first rows of the lock order
-- (projects, organizations, pools); upserts lock their rows even when nothing changes.
SELECT id FROM projects WHERE name = ANY (CAST(:names AS text[])) ORDER BY id FOR NO KEY UPDATE;

-- name: lock_declared_organizations
-- Lock the existing organizations a config names, by id (after its projects).
SELECT id, name FROM organizations WHERE name = ANY (CAST(:names AS text[])) ORDER BY id FOR NO KEY UPDATE;

-- name: lock_declared_pools
-- Lock the existing pools a config names, by id (after its organizations).
SELECT id, name FROM pools WHERE name = ANY (CAST(:names AS text[])) ORDER BY id FOR NO KEY UPDATE;

-- name: list_runner_login_pools$
-- The names of the pools granted to a runner host's login, sorted. Read-only.
SELECT ARRAY(SELECT q.name FROM runner_grants g JOIN pools q ON q.id = g.pool_id
              WHERE g.login = :login ORDER BY q.name);
