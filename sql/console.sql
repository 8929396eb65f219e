-- name: ping_database$
-- Liveness probe for /healthz: one round trip that reads no table and locks nothing.
SELECT 1 AS ok;

-- name: list_filter_choices^
-- The names the console's filter menus offer (organizations, projects, pools), sorted. Read-only.
SELECT ARRAY(SELECT name FROM organizations ORDER BY name) AS organizations,
       ARRAY(SELECT name FROM projects ORDER BY name) AS projects,
       ARRAY(SELECT name FROM pools ORDER BY name) AS pools;
