-- 0007_duty_leases: the elected duties (summaries, expiry, cleanup) and their leases, the
-- runners' liveness for stale-runner cleanup, the rolled-up queue history; pgd_beat_runner
-- carries the election (it returns the duties now) and pgd_expire_one takes a pool filter.
-- Do not edit: the current definitions are in sql/schema.sql and sql/functions/.

ALTER TABLE runners ADD COLUMN beat_seconds double precision CHECK (beat_seconds > 0);
ALTER TABLE runners ADD COLUMN stop_reason text CHECK (stop_reason IN ('stopped', 'lost'));
ALTER TABLE runners ADD CHECK (stop_reason IS NULL OR stopped_at IS NOT NULL);
UPDATE runners SET stop_reason = 'stopped' WHERE stopped_at IS NOT NULL;

CREATE TABLE queue_history (
    at                  timestamptz NOT NULL,
    pool_id             bigint NOT NULL REFERENCES pools (id),
    waiting             integer NOT NULL,
    running             integer NOT NULL,
    oldest_wait_seconds double precision,
    PRIMARY KEY (at, pool_id)
);

CREATE TABLE duty_leases (
    duty         text PRIMARY KEY CHECK (duty IN ('summaries', 'expiry', 'cleanup')),
    runner_id    bigint REFERENCES runners (id),
    term         bigint NOT NULL DEFAULT 0 CHECK (term >= 0),
    held_since   timestamptz,
    expires_at   timestamptz NOT NULL DEFAULT '-infinity',
    last_done_at timestamptz,
    done_count   bigint NOT NULL DEFAULT 0
);
INSERT INTO duty_leases (duty) VALUES ('summaries'), ('expiry'), ('cleanup');

DROP FUNCTION IF EXISTS pgd_beat_runner(bigint, boolean);
DROP FUNCTION IF EXISTS pgd_expire_one(double precision, double precision);
