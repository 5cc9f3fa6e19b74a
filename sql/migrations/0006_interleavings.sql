-- 0006: functions for decisions that hold against racing client transactions (FAULTS X)
-- and histories loaded within a bound (FAULTS P3): consume_signal, park_execution and
-- history_of. They are defined, like every function, in sql/functions/functions.sql, which
-- every migrate applies after the migrations; this migration changes no table.
SELECT 1;
