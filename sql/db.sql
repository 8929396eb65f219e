-- name: ping_database$
-- Liveness probe for /healthz: one round trip that reads no table and locks nothing.
SELECT 1 AS ok;
