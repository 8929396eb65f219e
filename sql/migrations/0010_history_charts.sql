-- 0010_history_charts: what the overview's charts need. Each attempt keeps the job's ready_at
-- of its claim (its wait is claimed_at - ready_at, whatever the job's ready_at becomes
-- later); queue_history gains, per pool and minute, the claims of that minute and their wait
-- p50/p95 (seconds); queue_reason_history holds the waiting jobs by primary reason per minute.
-- Do not edit: the current definitions are in sql/schema.sql and sql/functions/.

ALTER TABLE attempts ADD COLUMN ready_at timestamptz;

ALTER TABLE queue_history ADD COLUMN claimed integer NOT NULL DEFAULT 0 CHECK (claimed >= 0),
                          ADD COLUMN wait_p50_seconds double precision,
                          ADD COLUMN wait_p95_seconds double precision;

CREATE TABLE queue_reason_history (
    at      timestamptz NOT NULL,
    reason  text NOT NULL CHECK (reason ~ '^[a-z_]{1,40}$'),
    waiting integer NOT NULL CHECK (waiting >= 0),
    PRIMARY KEY (at, reason)
);
