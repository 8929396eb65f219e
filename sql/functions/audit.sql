-- The audit log: every operator action, and what the system does on an operator's behalf
-- (a late report that frees an uncertain target, a submit), written by the transitions in
-- the transaction that makes the change. Audit events and delivery receipts are
-- append-only: the triggers below refuse UPDATE, DELETE and TRUNCATE (SQLSTATE PDIMM).
-- Tables: sql/schema.sql (audit_events, delivery_receipts).

-- Refuses the change: the rows of the table it guards are immutable.
CREATE OR REPLACE FUNCTION pgd_forbid_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% rows are immutable', TG_TABLE_NAME USING ERRCODE = 'PDIMM';
END;
$$;

CREATE OR REPLACE TRIGGER delivery_receipts_immutable BEFORE UPDATE OR DELETE ON delivery_receipts
    FOR EACH ROW EXECUTE FUNCTION pgd_forbid_change();

CREATE OR REPLACE TRIGGER delivery_receipts_no_truncate BEFORE TRUNCATE ON delivery_receipts
    FOR EACH STATEMENT EXECUTE FUNCTION pgd_forbid_change();

CREATE OR REPLACE TRIGGER audit_events_immutable BEFORE UPDATE OR DELETE ON audit_events
    FOR EACH ROW EXECUTE FUNCTION pgd_forbid_change();

CREATE OR REPLACE TRIGGER audit_events_no_truncate BEFORE TRUNCATE ON audit_events
    FOR EACH STATEMENT EXECUTE FUNCTION pgd_forbid_change();

-- Record one audit event; returns its id. p_actor is the authenticated identity.
CREATE OR REPLACE FUNCTION pgd_audit(p_actor text, p_action text, p_subject text, p_reason text,
                                     p_details jsonb DEFAULT '{}')
RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO audit_events (actor, action, subject, reason, details)
    VALUES (p_actor, p_action, p_subject, p_reason, coalesce(p_details, '{}'))
    RETURNING id
$$;

-- The last audit event about a subject, for "already resolved by alice at 14:02".
CREATE OR REPLACE FUNCTION pgd_last_actor(p_subject text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT format('%s at %s', actor, to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                       FROM audit_events WHERE subject = p_subject ORDER BY id DESC LIMIT 1),
                    'another actor')
$$;
