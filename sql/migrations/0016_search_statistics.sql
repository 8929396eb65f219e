-- 0016_search_statistics: the job search's window (issue 20, item 5). The trigram step
-- ANDs jobs_command_trgm_idx's bitmap with a jobs_pkey range only when the planner's guess
-- of a word's matches is near the truth; from the default statistics (100 most common
-- trigrams of a 30,000-row sample) a word of a few thousand commands among a million is
-- guessed at 100 or at 10,000 by chance of the sample. A statistics target of 1000 on the
-- index's column (a 300,000-row sample; ANALYZE of jobs then takes seconds more at 1M jobs:
-- docs/operations.md, "Finding a job") makes the guess steady.
-- Do not edit: the current schema is sql/schema.sql.

ALTER INDEX jobs_command_trgm_idx ALTER COLUMN 1 SET STATISTICS 1000;
