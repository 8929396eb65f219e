-- 0006_complete_entry_point: pgd_complete loses its p_release parameter, which let a caller
-- skip the release of a job's slots; the internal form with it is pgd_complete_attempt.
-- Do not edit: the current definitions are in sql/functions/complete.sql.

DROP FUNCTION IF EXISTS pgd_complete(bigint, bigint, text, integer, text, text, text,
                                     double precision, double precision, boolean);
