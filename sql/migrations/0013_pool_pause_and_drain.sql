-- 0013_pool_pause_and_drain: operators steer the fleet (issue 20, item 3). A pool can be
-- paused with a reason, like a project (no claim takes from it; its jobs wait with reason
-- pool_paused); a runner can be drained by an operator (its claims take nothing, it
-- finishes what it runs, and past an optional deadline hands its builds back). The
-- operator's drain is kept apart from runners.draining, the scheduler's own shutdown flag
-- that every beat writes: a beat never clears an operator's drain. Columns only, all NULL
-- by default: no rewrite of either table. The transitions: sql/functions/operator.sql.
-- Do not edit: the current schema is sql/schema.sql.

ALTER TABLE pools ADD COLUMN paused_at timestamptz,
                  ADD COLUMN pause_reason text,
                  ADD COLUMN paused_by text,
                  ADD CONSTRAINT pools_pause_check CHECK ((paused_at IS NULL) = (pause_reason IS NULL)
                                                         AND (paused_at IS NULL) = (paused_by IS NULL));

ALTER TABLE runners ADD COLUMN drain_requested_at timestamptz,
                    ADD COLUMN drain_requested_by text,
                    ADD COLUMN drain_reason text,
                    ADD COLUMN drain_deadline timestamptz,
                    ADD CONSTRAINT runners_drain_check CHECK (
                        (drain_requested_at IS NULL) = (drain_requested_by IS NULL)
                        AND (drain_requested_at IS NULL) = (drain_reason IS NULL)
                        AND (drain_deadline IS NULL OR drain_requested_at IS NOT NULL));
