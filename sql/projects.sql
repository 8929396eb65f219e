-- name: pause_project$
-- Pause a project with a reason (conditional on it running, audited); see pgd_pause_project.
SELECT pgd_pause_project(:project, :reason, :actor);

-- name: resume_project$
-- Resume a paused project (conditional on it being paused, audited).
SELECT pgd_resume_project(:project, :reason, :actor);

-- name: list_projects
-- Every project with its organization, limits, running count, pause state and granted pools.
SELECT p.id, p.name, p.organization_id, o.name AS organization, p.weight, p.max_running,
       pgd_project_running(p.id) AS running, p.paused_at, p.pause_reason, p.paused_by, p.last_claimed_at,
       ARRAY(SELECT q.name FROM project_pools pp JOIN pools q ON q.id = pp.pool_id
              WHERE pp.project_id = p.id ORDER BY q.name) AS pools
  FROM projects p JOIN organizations o ON o.id = p.organization_id
 ORDER BY o.name, p.name;

-- name: list_organizations
-- Every organization with its limit and running count (its held slots). Read-only.
SELECT id, name, max_running, pgd_organization_running(id) AS running FROM organizations ORDER BY name;

-- name: list_pools
-- Every pool with its slots, running count (its held slots) and pause (who, when, why).
-- Read-only.
SELECT id, name, slots, pgd_pool_running(id) AS running, paused_at, pause_reason, paused_by
  FROM pools ORDER BY name;

-- name: list_grants
-- Which project may run on which pool. Read-only.
SELECT project_id, pool_id FROM project_pools;

-- name: list_filter_choices^
-- The names the console's filter menus offer (organizations, projects, pools), sorted. Read-only.
SELECT ARRAY(SELECT name FROM organizations ORDER BY name) AS organizations,
       ARRAY(SELECT name FROM projects ORDER BY name) AS projects,
       ARRAY(SELECT name FROM pools ORDER BY name) AS pools;

