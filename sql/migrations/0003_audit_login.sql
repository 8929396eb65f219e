-- 0003_audit_login: every audit event records the database login that made it
-- (session_user, which a SECURITY DEFINER transition does not change) beside the actor the
-- transition authorized. Events written before it are marked as from an unknown login.
-- Do not edit: the current schema is sql/schema.sql; who acts is pgd_authorize in
-- sql/functions/audit.sql, the roles are sql/roles.sql and sql/grants.sql.

ALTER TABLE audit_events ADD COLUMN login text NOT NULL DEFAULT '(before logins were recorded)';
ALTER TABLE audit_events ALTER COLUMN login SET DEFAULT session_user;
