-- 0015: retry() and fork() take an idempotency key (issue 22, FAULTS R1).
--
-- A client whose retry() or fork() committed and lost its reply cannot tell what happened:
-- a retry sent again found the execution live and raised InvalidState, a fork sent again
-- made a second fork. Both now take an optional key, kept in idempotency_keys beside
-- submit's (one namespace: a key names one operation); the same call with the same key
-- returns what the first one did. The new signatures replace the old ones (sql/functions
-- re-creates them after the migrations).
DROP FUNCTION __schema__.retry(uuid);
DROP FUNCTION IF EXISTS __schema__.fork(uuid, integer);
DROP FUNCTION IF EXISTS __schema__.fork(uuid, integer, uuid);
