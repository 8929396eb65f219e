-- 0002_claim_tombstones: lost-claim recovery decided by the database instead of by ending the
-- lost server session (which behind a pooler is not the client's, and needs rights a
-- scheduler role does not have). A recovery writes a tombstone for each token of the claim
-- whose answer was lost; a claim that carries a tombstoned token fails at its last step.
-- Do not edit: the current schema is sql/schema.sql; the argument is in
-- sql/functions/claim.sql and docs/design.md, "Lost claims".

CREATE TABLE claim_tombstones (
    claim_token uuid PRIMARY KEY,
    runner_id   bigint,
    voided_at   timestamptz NOT NULL DEFAULT now()
);
