-- 0006_wakeups: wake idle schedulers with NOTIFY when a job becomes claimable now, instead of
-- leaving it for their next poll (issue 5; measured in docs/benchmarks.md, "Wake-ups").
--
-- A job becomes claimable when it is inserted as queued and ready, or moves into queued with
-- ready_at already reached: submit, approve, resume... (pgd_release_dependents, hand-back,
-- operator retry). Then the transaction sends NOTIFY pgdispatch_queued with the job's pool id
-- as payload; PostgreSQL delivers it at commit and folds identical notifications of one
-- transaction into one (PostgreSQL docs, NOTIFY), so a bulk submit to one pool sends one.
-- Claims, completions that succeed, heartbeats and expiry with backoff never match the WHEN
-- clauses: notifying commits take one cluster-wide lock in commit order, which the hot path
-- must not pay. A retry whose backoff has not elapsed is left to the 1 s poll, which stays.
--
-- Switch: ALTER DATABASE ... SET pgdispatch.notify = 'off' (or per role / session) stops the
-- notifications; schedulers then find work by polling alone.
CREATE FUNCTION pgd_notify_queued() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('pgdispatch.notify', true), '') <> 'off' THEN
        PERFORM pg_notify('pgdispatch_queued', NEW.pool_id::text);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER jobs_notify_queued_insert
    AFTER INSERT ON jobs FOR EACH ROW
    WHEN (NEW.state = 'queued' AND NEW.ready_at <= now())
    EXECUTE FUNCTION pgd_notify_queued();

CREATE TRIGGER jobs_notify_queued_update
    AFTER UPDATE OF state ON jobs FOR EACH ROW
    WHEN (NEW.state = 'queued' AND OLD.state <> 'queued' AND NEW.ready_at <= now())
    EXECUTE FUNCTION pgd_notify_queued();
