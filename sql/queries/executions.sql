-- Hot-path statements on workflow_executions. Each is one round trip; every write a worker
-- makes carries the lease epoch it claimed with and matches zero rows once superseded.

-- name: claim_batch
-- Claim up to %(limit)s due executions: lock candidates with SKIP LOCKED in a CTE (not
-- `IN (SELECT … LIMIT)`, which the planner may re-evaluate and over-claim), flip them to
-- running, bump the epoch, and return each with its recorded checkpoints so a replay needs
-- no second round trip. Due means queued, or waiting with wake_at passed (a sleep ended, a
-- signal arrived, a wait timed out).
--
-- Only workflows this process registers (%(workflows)s) are claimed (all of them with
-- %(any_workflow)s, for tests and tools that run no workflow code): a name no live worker
-- knows (a typo, a rolling deploy) waits, visibly, for a worker that does (FAULTS P4).
-- The first claim stamps the claiming worker's %(app_version)s on the row (migration 0010).
-- No claim takes a row its own %(app_version)s gave back (a worker whose code was older than
-- the row's history: migration 0014); the filter is on rows the index scans return, which
-- are almost never given back. A claim clears given_back_at, and returns waiting_for, the
-- kind of wait a woken row was parked at (the replay checks the call at that position).
-- It also returns the submitter's trace context (traceparent, tracestate: migration 0018),
-- which the worker's spans continue.
-- Arguments and checkpoints come back as JSON text, decoded per execution by the worker, so
-- one value it cannot decode fails only its own execution (FAULTS P2); the checkpoints come
-- from history_of(), which never loads more than %(max_history_bytes)s (FAULTS P3).
--
-- Suspects: an execution already claimed 2 times (db.SUSPECT_AFTER; a constant here, so the
-- planner can use the partial index of migration 0008) without finishing may be what keeps
-- killing its workers (os._exit, a segfault, OOM). A process takes at most one suspect at a
-- time (%(take_suspect)s is false while it holds one), so a poison execution can never again
-- take healthy co-located executions down with it, and those never reach max_attempts on
-- its account.
--
-- Cost: each queue is read through an index in (priority, age) order and the scan stops
-- after the rows it takes (a LATERAL per queue; `queue = ANY(...) ORDER BY …` cannot use the
-- index order and sorted the whole backlog), so a claim costs the same with ten or a million
-- executions queued. Across several queues the best of each queue's first %(limit)s win.
--
-- Limited queues: a queue with a row in queue_limits (declared by any worker, in any
-- process of any version) is claimed only under that row's lock (statements.queues), also by
-- a process that does not declare it: this claim leaves it out (`served`, one primary-key
-- probe per queue asked for), so a limit holds from the moment its row commits, and the
-- process picks the queue up through the limited claim at its next look at the limits
-- (FAULTS C4).
WITH served AS (
    SELECT q.queue
      FROM unnest(%(queues)s::text[]) AS q(queue)
     WHERE NOT EXISTS (SELECT FROM __schema__.queue_limits AS l WHERE l.queue = q.queue)
), suspect AS (
    SELECT s.id
      FROM served AS q
     CROSS JOIN LATERAL (
            SELECT e.id
              FROM __schema__.workflow_executions AS e
             WHERE e.status = 'queued'
               AND e.attempts >= 2
               AND e.queue = q.queue
               AND (%(any_workflow)s OR e.workflow = ANY(%(workflows)s::text[]))
               AND %(take_suspect)s
               AND (e.given_back_by IS NULL OR %(app_version)s::text IS NULL
                    OR %(app_version)s::text <> ALL (e.given_back_by))
             ORDER BY e.priority DESC, e.created_at
             LIMIT 1
               FOR UPDATE SKIP LOCKED) AS s
     LIMIT 1
), woken AS (
    SELECT id
      FROM __schema__.workflow_executions
     WHERE status = 'waiting'
       AND wake_at <= __schema__.kestrel_now()
       AND queue = ANY(ARRAY(SELECT queue FROM served))
       AND (%(any_workflow)s OR workflow = ANY(%(workflows)s::text[]))
       AND (given_back_by IS NULL OR %(app_version)s::text IS NULL
            OR %(app_version)s::text <> ALL (given_back_by))
     ORDER BY wake_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), healthy AS (
    SELECT h.id
      FROM served AS q
     CROSS JOIN LATERAL (
            SELECT e.id, e.priority, e.created_at
              FROM __schema__.workflow_executions AS e
             WHERE e.status = 'queued'
               AND e.queue = q.queue
               AND e.attempts < 2
               AND (%(any_workflow)s OR e.workflow = ANY(%(workflows)s::text[]))
               AND (e.given_back_by IS NULL OR %(app_version)s::text IS NULL
                    OR %(app_version)s::text <> ALL (e.given_back_by))
             ORDER BY e.priority DESC, e.created_at
             LIMIT %(limit)s
               FOR UPDATE SKIP LOCKED) AS h
     ORDER BY h.priority DESC, h.created_at
     LIMIT %(limit)s
), candidate AS (
    (SELECT id FROM suspect)
    UNION ALL (SELECT id FROM woken)
    UNION ALL (SELECT id FROM healthy)
    LIMIT %(limit)s
), renewed AS (
-- include: claim_lease
), claimed AS (
-- include: claim_flip
)
-- include: claim_result
;

-- name: set_lock_timeout
-- Every worker statement carries a lock_timeout (--lock-timeout), so a lock held by a client's
-- open transaction or an operator's LOCK makes it fail with 55P03 and retry, instead of
-- waiting with a pooled connection for as long as the lock is held (FAULTS O4, O6). On a
-- direct connection the setting comes with the session (the `options` startup parameter);
-- behind a transaction-mode pooler, which passes no startup options and shares server
-- sessions, this statement goes first in the same pipeline as the statement it guards: one
-- round trip, one Sync, so both run in one implicit transaction and the setting ends with
-- it (db.LockTimeoutConnection).
SELECT set_config('lock_timeout', %(lock_timeout)s, true);

-- name: take_lease
-- The heartbeat, first statement: take or extend this process's lease (migration 0026) for
-- %(lease_s)s from now. Returns the owner, or nothing when the lease ran out before this
-- beat: it is never extended again (the sweeper may be re-queuing its rows), and the worker
-- drops every execution and takes a lease under a new name. A plain INSERT: Citus plans a
-- statement with an INSERT in a CTE CTE by CTE (docs/citus.md); this one is routed whole.
-- Citus refuses a function that is not IMMUTABLE in ON CONFLICT's WHERE: the clock comes
-- in the row (renewed_at).
INSERT INTO __schema__.leases AS l (owner, expires_at, renewed_at)
VALUES (%(owner)s, __schema__.kestrel_now() + make_interval(secs => %(lease_s)s),
        __schema__.kestrel_now())
    ON CONFLICT (owner) DO UPDATE
   SET expires_at = excluded.expires_at, renewed_at = excluded.renewed_at
 WHERE l.expires_at > excluded.renewed_at
RETURNING l.owner;

-- name: heartbeat
-- The heartbeat, second statement, in the same transaction: which of the executions this
-- process holds are still its own, each with its cancel flag: running under its epoch and
-- under its lease. Ids missing from the result were lost (swept, re-claimed under a newer
-- epoch): the worker drops them.
--
-- The executions are read, not locked: nothing that holds their rows (the worker's own
-- checkpoint batches FOR SHARE, a client's signal() in a transaction left open) can delay
-- a beat, and no lease lapses because of it (FAULTS C2, C3, O4).
--
-- The rule for every statement on rows a worker holds (here, the checkpoint batch, the
-- completion and their Citus forms): find each row by primary key alone, and ask whether it
-- runs under our epoch of the row as locked or read, never in the scan. `e.status =
-- 'running'` (or `parent_id IS NOT NULL`) there let PostgreSQL read a partial index
-- instead, every running execution's (every child's) entry, whenever its statistics had
-- last counted few (test_claim_plans). And every statement that locks several execution
-- rows locks them in id order (the checkpoint batch, completions with their parents,
-- release), so no two of them can deadlock however their batches overlap (FAULTS X3).
WITH seen AS MATERIALIZED (
    SELECT e.id, e.lease_epoch, e.status, e.lease_owner, e.cancel_requested
      FROM __schema__.workflow_executions AS e
     WHERE e.id = ANY (%(ids)s::uuid[])
)
SELECT s.id, s.cancel_requested
  FROM seen AS s
  JOIN unnest(%(ids)s::uuid[], %(epochs)s::integer[]) AS h(id, epoch)
    ON h.id = s.id AND h.epoch = s.lease_epoch
 WHERE s.status = 'running' AND s.lease_owner = %(owner)s;

-- name: running_under
-- The executions that run under this process's lease (claimed under its owner), which the
-- heartbeat reads after a claim whose reply was lost: what the claim committed, nobody here
-- runs, and the lease it runs under is alive, so the sweeper would never take it. The
-- worker gives back those it does not hold. Every running row is read (the work in flight,
-- never the backlog), and only then.
SELECT id, lease_epoch
  FROM __schema__.workflow_executions
 WHERE status = 'running' AND lease_owner = %(owner)s AND lease_expires_at IS NULL;

-- name: end_leases
-- End the lease of executions this process dropped without a statement that ended their
-- claim (a run cut short when its trust ran out, a completion refused or overtaken, rows a
-- claim with a lost reply committed): they run under its lease, which its heartbeat keeps
-- alive, so the sweeper would never take them. Each gets a lease of its own that has
-- already passed, and the sweeper's next round re-queues it, its attempt counted, or
-- quarantines it, as if its process had died. Fenced by the epoch. A row another
-- transaction holds is skipped, not waited for (the heartbeat sends this): it is not
-- returned, and the worker sends it again at the next beat while it is still running
-- under that epoch (returned with ended = false). No row: not ours any more.
WITH held(id, epoch) AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(epochs)s::integer[])
), mine AS MATERIALIZED (
    SELECT e.id
      FROM __schema__.workflow_executions AS e
      JOIN held AS h ON h.id = e.id AND h.epoch = e.lease_epoch
     WHERE e.id = ANY (%(ids)s::uuid[])
       AND e.status = 'running'
), locked AS (
    SELECT e.id
      FROM __schema__.workflow_executions AS e
     WHERE e.id = ANY (ARRAY(SELECT id FROM mine))
     ORDER BY e.id
       FOR NO KEY UPDATE OF e SKIP LOCKED
), ended AS (
    UPDATE __schema__.workflow_executions AS e
       SET lease_expires_at = '-infinity'
      FROM locked, held AS h
     WHERE e.id = locked.id AND h.id = e.id AND e.lease_epoch = h.epoch
       AND e.status = 'running'
    RETURNING e.id
)
SELECT m.id, m.id IN (SELECT id FROM ended) FROM mine AS m;

-- name: complete_batch
-- Finish many executions at once: delete the hot rows still owned under the given epoch and
-- append them to history in the same statement, so each execution is always in exactly one
-- place. A finished child signals its parent. Returns the ids that were finished; the others
-- were fenced, or met a recorded tail (below).
--
-- A row may carry the workflow's last checkpoint (its tail: the run ended right after that
-- step, whose write the worker held back), written here with the end it led to, under the
-- same lock and epoch check: one statement and one row lock fewer per workflow than a
-- checkpoint batch and then a completion (issue 23, item 3). A plain INSERT: its position
-- can be recorded already only by an older claim whose write committed after this claim
-- read the history (the checkpoint batch's rare fallback). Such an execution is not
-- finished here: its end was computed from a value that is not the recorded
-- one; its lease runs out and the next claim replays the recorded value. A row of that kind
-- committed after this statement's snapshot fails it with unique_violation, and the worker
-- sends it again (Stmt.if_recorded), when the next snapshot sees the row.
WITH finished(id, epoch, status, result, error, step_id, step_name, output, step_error,
              attempt, ran_s, waited_s, tries) AS (
    -- One JSON array of rows, as in save_steps_batch (statements/executions.py); the tail's
    -- seven fields follow the five of the end, or are absent.
    SELECT (r->>0)::uuid, (r->>1)::integer, r->>2,
           CASE WHEN jsonb_typeof(r->3) = 'array' THEN r->3->0 END,
           CASE WHEN jsonb_typeof(r->4) = 'array' THEN r->4->0 END,
           (r->>5)::integer, r->>6,
           CASE WHEN jsonb_typeof(r->7) = 'array' THEN r->7->0 END,
           CASE WHEN jsonb_typeof(r->8) = 'array' THEN r->8->0 END,
           (r->>9)::integer, (r->>10)::float8, (r->>11)::float8,
           CASE WHEN jsonb_typeof(r->12) = 'array' THEN r->12 END
      FROM jsonb_array_elements(%(rows)s::jsonb) AS r
), locked AS (
    -- Every row this statement will change, the finishing executions and the parents they
    -- tell, locked up front in id order (see heartbeat). text_results: docs/citus.md.
    -- Each is found by its primary key (`= ANY (ARRAY(…))`, an index scan whatever the
    -- estimates): written as `IN (…)` of the batch, PostgreSQL 15 planned a hash join over
    -- two sequential scans of the hot table, live and dead rows (6,832 rows: 6.4 ms of an
    -- 11 ms statement in the bench; auto_explain, BENCHMARKS.md).
    SELECT e.id, e.status, NULL::__schema__.workflow_executions AS text_results
      FROM __schema__.workflow_executions AS e
     WHERE e.id = ANY (ARRAY(SELECT id FROM finished
                             UNION
                             -- (a NULL parent matches nothing; see heartbeat)
                             SELECT c.parent_id FROM __schema__.workflow_executions AS c
                              WHERE c.id = ANY (ARRAY(SELECT id FROM finished))))
     ORDER BY e.id
       FOR UPDATE OF e
), removed AS (
    DELETE FROM __schema__.workflow_executions AS e
     USING finished AS f
     WHERE e.id = f.id
       AND e.lease_epoch = f.epoch
       -- By primary key, after the lock; running, as the locked row says (see heartbeat)
       AND e.id = ANY (ARRAY(SELECT id FROM locked WHERE status = 'running'))
       -- Not with a tail whose position is recorded already (above). A probe per row
       -- driven by `finished`: `e.id NOT IN (…)` read the whole hot table.
       AND NOT EXISTS (SELECT 1 FROM __schema__.operation_outputs AS o
                        WHERE o.execution_id = f.id AND o.step_id = f.step_id)
 RETURNING e.*, f.status AS final_status, f.result AS final_result, f.error AS final_error
), tails AS (
    INSERT INTO __schema__.operation_outputs
           (execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at,
            finished_at, tries)
    SELECT f.id, f.step_id, f.step_name, f.output, f.step_error, f.attempt, f.epoch,
           __schema__.kestrel_now() - make_interval(secs => f.ran_s),
           __schema__.kestrel_now() - make_interval(secs => f.waited_s), f.tries
      FROM finished AS f
      JOIN removed AS r ON r.id = f.id
     WHERE f.step_id IS NOT NULL
    RETURNING 1
), moved AS (
    INSERT INTO __schema__.workflow_history
           (id, workflow, queue, priority, status, args, result, error, idempotency_key,
            lease_epoch, attempts, created_at, started_at, finished_at, parent_id, deadline,
            app_version, concurrency_key, tags)
    SELECT id, workflow, queue, priority, final_status, args, final_result, final_error,
           idempotency_key, lease_epoch, attempts, created_at, started_at,
           __schema__.kestrel_now(), parent_id, deadline, app_version,
           concurrency_key, tags
      FROM removed
    RETURNING id, finished_at
), told AS (
    -- A parent finishing in this same statement needs no word (and its row, deleted here,
    -- must not also be updated by the same command). Reading all of `removed` first also
    -- lets the DELETE finish before any parent row is touched.
    -- Counted, not listed: a void column cannot be a CTE's result on Citus (docs/citus.md).
    SELECT count(__schema__.child_finished(parent_id, id, final_status, final_result,
                                           final_error)) AS n
      FROM removed
     WHERE parent_id IS NOT NULL
       AND parent_id NOT IN (SELECT id FROM removed)
), archived AS (
    -- Their signals and events follow them into history (one statement for the whole
    -- batch), under the finish time written above (one value: the same kestrel_now() for
    -- the batch). Their checkpoints stay where they were written (migration 0019).
    SELECT __schema__.archive_finished(array_agg(id), min(finished_at)) AS n FROM moved
)
-- Identical notifications in one transaction collapse into one: a waiting result() wakes
-- once per batch, not once per execution.
SELECT m.id, pg_notify('kestrel.__schema_name__.done', '')
  FROM moved AS m
 WHERE (SELECT n FROM told) >= 0
   AND (SELECT n FROM archived) >= 0;

-- name: complete_batch_delegated
-- complete_batch in its Citus form: a call of finish_batch() (sql/functions/30_finishing.sql),
-- which migrate delegates to the tenant's node in a distributed schema. It notifies no one:
-- the worker sends notify_done after it, on the coordinator.
SELECT id FROM __schema__.finish_batch(%(rows)s::jsonb);

-- name: release_batch
-- Give executions back to the queue without waiting for their leases to expire (drain on
-- shutdown). The claim already counted as an attempt, so undo that count: a clean release
-- must not push a healthy execution toward quarantine. Locks in id order (see heartbeat).
WITH held(id, epoch) AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(epochs)s::integer[])
), locked AS (
    SELECT e.id
      FROM __schema__.workflow_executions AS e
      JOIN held AS h ON h.id = e.id AND h.epoch = e.lease_epoch
     WHERE e.status = 'running'
     ORDER BY e.id
       FOR NO KEY UPDATE OF e
)
UPDATE __schema__.workflow_executions AS e
   SET status = 'queued',
       lease_owner = NULL,
       lease_expires_at = NULL,
       attempts = greatest(e.attempts - 1, 0),
       updated_at = __schema__.kestrel_now()
  FROM locked
 WHERE e.id = locked.id
RETURNING e.id;

-- name: give_back
-- Give back an execution whose history newer code wrote (CodeTooOld: a patch marker this
-- worker's code does not know) without running it: parked as 'waiting' until
-- wake_at = now + least(%(cap_s)s, %(base_s)s * 2^give_backs) (claims read waiting rows in
-- wake_at order: until then it costs no claim anything), the give-back counted, the giving
-- %(app_version)s recorded (that version's claims skip the row from now on: migration 0014),
-- and the claim not counted as an attempt. The wait it was parked at (wait_step, waiting_for,
-- wait_deadline) stays while that wait's position has no checkpoint: a newer worker replays
-- up to it, a signal for it still wakes the row early, a re-park keeps its deadline. A wait
-- whose position has one was passed (the row was claimed from it and replayed beyond): it is
-- cleared, so neither `show` nor anything else reads the row as parked at a recorded
-- position. Fenced by the epoch. A retry after a lost reply learns the committed outcome:
-- the row is then waiting under the same epoch (no claim since) with given_back_at set, and
-- the same count and wake_at are read back. No row: not ours.
WITH given AS (
    UPDATE __schema__.workflow_executions AS e
       SET status = 'waiting',
           lease_owner = NULL,
           lease_expires_at = NULL,
           attempts = greatest(e.attempts - 1, 0),
           give_backs = e.give_backs + 1,
           given_back_by = CASE
               WHEN %(app_version)s::text IS NULL
                    OR %(app_version)s::text = ANY (coalesce(e.given_back_by, '{}'))
               THEN e.given_back_by
               ELSE coalesce(e.given_back_by, '{}') || %(app_version)s::text END,
           given_back_at = __schema__.kestrel_now(),
           waiting_for = CASE WHEN p.passed THEN NULL ELSE e.waiting_for END,
           wait_deadline = CASE WHEN p.passed THEN NULL ELSE e.wait_deadline END,
           wait_step = CASE WHEN p.passed THEN NULL ELSE e.wait_step END,
           wake_at = __schema__.kestrel_now() + make_interval(secs => least(
               %(cap_s)s::float8, %(base_s)s::float8 * 2 ^ least(e.give_backs, 30))),
           updated_at = __schema__.kestrel_now()
      FROM (SELECT EXISTS (
                SELECT 1 FROM __schema__.workflow_executions AS w
                  JOIN __schema__.operation_outputs AS o
                    ON o.execution_id = w.id AND o.step_id = w.wait_step
                 WHERE w.id = %(id)s) AS passed) AS p
     WHERE e.id = %(id)s
       AND e.lease_epoch = %(epoch)s
       AND e.status = 'running'
       AND NOT e.cancel_requested
 RETURNING e.give_backs, e.wake_at
)
SELECT give_backs, wake_at, false AS cancelled FROM given
UNION ALL
SELECT e.give_backs, e.wake_at, false
  FROM __schema__.workflow_executions AS e
 WHERE e.id = %(id)s
   AND e.lease_epoch = %(epoch)s
   AND e.status = 'waiting'
   AND e.given_back_at IS NOT NULL
UNION ALL
-- A cancel requested while this worker decided to give the execution back: it is not
-- parked for another version (a cancel is done at once, FAULTS X2); the worker finishes it
-- as cancelled.
SELECT e.give_backs, NULL, true
  FROM __schema__.workflow_executions AS e
 WHERE e.id = %(id)s
   AND e.lease_epoch = %(epoch)s
   AND e.status = 'running'
   AND e.cancel_requested;

-- name: park
-- Park a running execution at a wait and say what happened: parked, cancelled, signalled or
-- lost (see park_execution in migration 0006).
SELECT __schema__.park_execution(%(id)s, %(epoch)s, %(step_id)s, %(waiting_for)s,
                                 %(seconds)s, %(seen_seq)s::bigint);

-- name: finished_readback
-- After a completion whose reply was lost and whose retry found nothing to finish: which of
-- these executions did finish under this epoch with this status (our own committed write),
-- as opposed to being fenced by a newer claim (FAULTS X4).
SELECT h.id
  FROM unnest(%(ids)s::uuid[], %(epochs)s::integer[], %(statuses)s::text[])
       AS f(id, epoch, status)
  JOIN __schema__.workflow_history AS h
    ON h.id = f.id AND h.lease_epoch = f.epoch AND h.status = f.status;
