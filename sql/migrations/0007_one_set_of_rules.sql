-- 0007: one set of rules at every door (check_name, valid_queue_name, undecodable_number,
-- check_payload, used by submit and signal), children that cannot outlive a cancel, and
-- retry that keeps only the checkpoints before the first failure. All of it is functions,
-- defined in sql/functions/functions.sql, which every migrate applies after the
-- migrations; this migration changes no table.
SELECT 1;
