-- 0012_supersede_and_order: a waiting deployment replaced by a newer one to a superseding
-- target ends `superseded` (a terminal job state: finished_at set); a target declares
-- whether a newer deployment supersedes the older waiting ones (targets.supersede, any
-- project) and its deployment order (targets.deploy_order); a project-and-target pair can
-- declare the same for that project's deployments only (project_target_supersede). The
-- claim takes a deployment only when it is its target's head (pgd_target_head, probed
-- through jobs_target_queue_idx); the queue summary counts the ready deployments that are
-- not (reason target_order). Small tables and new partial index only: no job row is
-- rewritten (the new columns have constant defaults).
-- Do not edit: the current schema is sql/schema.sql.

-- The two state checks of jobs widened. Each ADD scans jobs once under the upgrade's lock
-- (a check is validated by a scan; about 0.3 s per million jobs on the bench machine): the
-- price of the check the database enforces, paid once.
ALTER TABLE jobs DROP CONSTRAINT jobs_state_check,
    ADD CONSTRAINT jobs_state_check CHECK (state IN ('blocked', 'queued', 'running', 'succeeded',
                                                     'failed', 'cancelled', 'uncertain',
                                                     'superseded'));
ALTER TABLE jobs DROP CONSTRAINT jobs_check1,
    ADD CONSTRAINT jobs_check1
        CHECK ((state IN ('succeeded', 'failed', 'cancelled', 'superseded')) = (finished_at IS NOT NULL));

ALTER TABLE targets
    ADD COLUMN supersede boolean NOT NULL DEFAULT false,
    ADD COLUMN deploy_order text NOT NULL DEFAULT 'oldest_first'
        CHECK (deploy_order IN ('oldest_first', 'newest_ready_first'));

CREATE TABLE project_target_supersede (
    project_id bigint NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    target_id  bigint NOT NULL REFERENCES targets (id),
    PRIMARY KEY (project_id, target_id)
);
CREATE INDEX project_target_supersede_target_idx ON project_target_supersede (target_id);

CREATE INDEX jobs_target_queue_idx ON jobs (target_id, priority DESC, id)
    WHERE state = 'queued' AND target_id IS NOT NULL;
-- A target's superseded deployments, newest first, and their count (the target page).
CREATE INDEX jobs_target_superseded_idx ON jobs (target_id, id) INCLUDE (finished_at)
    WHERE state = 'superseded';

ALTER TABLE queue_summaries
    ADD COLUMN target_order integer NOT NULL DEFAULT 0,
    ADD COLUMN oldest_target_order_at timestamptz;
