-- 0005_runner_grants: a runner host is a database login, and the server decides which pools
-- it may take (runner_grants, declared by `apply`'s [[runners]]); approval is a property of
-- a target (requires_approval, approver_role, declared by `apply`'s [[targets]]).
-- Do not edit: the current schema is sql/schema.sql; the rules are in
-- sql/functions/claim.sql (grants) and sql/functions/operator.sql (approval).

CREATE TABLE runner_grants (
    login   text NOT NULL CHECK (length(login) BETWEEN 1 AND 63),
    pool_id bigint NOT NULL REFERENCES pools (id),
    PRIMARY KEY (login, pool_id)
);
CREATE INDEX runner_grants_pool_idx ON runner_grants (pool_id);

ALTER TABLE runners ADD COLUMN login text NOT NULL DEFAULT session_user;
CREATE INDEX runners_login_idx ON runners (login) WHERE stopped_at IS NULL;

ALTER TABLE targets ADD COLUMN requires_approval boolean NOT NULL DEFAULT false;
ALTER TABLE targets ADD COLUMN approver_role text NOT NULL DEFAULT 'operator'
    CHECK (approver_role IN ('operator', 'admin'));
