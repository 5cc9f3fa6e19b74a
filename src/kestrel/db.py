"""The only module that executes runtime SQL: one function per named statement.

Every function is one statement and one round trip on a connection in autocommit mode, so
each write is its own short transaction and no user code ever runs inside one. Writes from
workers carry the lease epoch; the statements match zero rows for a superseded epoch and the
caller learns it from what comes back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, TypeVar

import orjson
import psycopg
from psycopg.pq import TransactionStatus

from kestrel import codec
from kestrel.codec import MAX_HISTORY_BYTES
from kestrel.connections import (
    LINK_DEFAULTS as LINK_DEFAULTS,
)
from kestrel.connections import (  # re-exported as db.X
    POOL_WAIT_S as POOL_WAIT_S,
)
from kestrel.connections import (
    configure_connection as configure_connection,
)
from kestrel.connections import (
    configure_connection_async as configure_connection_async,
)
from kestrel.connections import (
    is_contended as is_contended,
)
from kestrel.connections import (
    is_data_error as is_data_error,
)
from kestrel.connections import (
    is_pool_timeout as is_pool_timeout,
)
from kestrel.connections import (
    is_transient as is_transient,
)
from kestrel.connections import (
    link_params as link_params,
)
from kestrel.connections import (
    sqlstate as sqlstate,
)
from kestrel.errors import (
    ConfigError,
    DuplicateExecution,
    ExecutionNotFound,
    HistoryTooLarge,
    IdempotencyConflict,
    InvalidState,
    KestrelError,
    ParentCancelled,
    PayloadTooLarge,
    SerializationError,
    UndecodableInput,
)
from kestrel.failpoints import LOST_REPLIES, lost_reply
from kestrel.sql import Queries, statement_name

# Re-exported (``X as X``): callers build statements as db.get_execution(...) and run them
# with db.run; the builders live in kestrel.statements, which executes nothing.
from kestrel.statements import (
    Script as Script,
)
from kestrel.statements import (
    Stmt as Stmt,
)
from kestrel.statements import (
    advance_clock as advance_clock,
)
from kestrel.statements import (
    command as command,
)
from kestrel.statements import (
    count_by_status as count_by_status,
)
from kestrel.statements import (
    db_now as db_now,
)
from kestrel.statements import (
    get_event as get_event,
)
from kestrel.statements import (
    get_execution as get_execution,
)
from kestrel.statements import (
    heartbeat as heartbeat,
)
from kestrel.statements import (
    list_executions as list_executions,
)
from kestrel.statements import (
    list_partitions as list_partitions,
)
from kestrel.statements import (
    list_steps as list_steps,
)
from kestrel.statements import (
    live_workers as live_workers,
)
from kestrel.statements import (
    patch_summary as patch_summary,
)
from kestrel.statements import (
    queue_stats as queue_stats,
)
from kestrel.statements import (
    recover_dead_worker as recover_dead_worker,
)
from kestrel.statements import (
    register_worker as register_worker,
)
from kestrel.statements import (
    replay_history as replay_history,
)
from kestrel.statements import (
    reset_for_test as reset_for_test,
)
from kestrel.statements import (
    run_maintenance as run_maintenance,
)
from kestrel.statements import (
    skip_to_next_sleep as skip_to_next_sleep,
)
from kestrel.statements import (
    stats as stats,
)
from kestrel.statements import (
    submit_params as submit_params,
)
from kestrel.statements import (
    take_uncounted_finishes as take_uncounted_finishes,
)
from kestrel.statements import (
    unclaimable_by_workflow as unclaimable_by_workflow,
)
from kestrel.statements import (
    unclaimable_total as unclaimable_total,
)
from kestrel.statements import (
    unregister_worker as unregister_worker,
)
from kestrel.statements import (
    upsert_queue_limit as upsert_queue_limit,
)
from kestrel.statements import (
    upsert_schedule as upsert_schedule,
)
from kestrel.statements import (
    value as value,
)
from kestrel.statements import (
    waiting_for as waiting_for,
)
from kestrel.statements import (
    waiting_stats as waiting_stats,
)
from kestrel.statements import (
    worker_stats as worker_stats,
)
from kestrel.types import (
    Claimed,
    Finish,
    RecordedStep,
    SignalTaken,
    StepSaved,
    StepWrite,
    SweepResult,
)

AnyConn = psycopg.AsyncConnection[Any]
T = TypeVar("T")

def _recorded(steps: list[list[Any]] | None) -> dict[int, RecordedStep]:
    if not steps:
        return {}
    return {s[0]: RecordedStep(s[1], s[2], s[3]) for s in steps}


SUSPECT_AFTER = 2
"""Claims without finishing after which an execution is a suspect (see claim_batch, where
it is written as a constant so that the planner can use the suspects' partial index)."""


_CLAIMED = ("id", "workflow", "epoch", "attempt", "wait_step", "wait_deadline", "signal_seq",
            "deadline", "cancel_requested", "db_now", "created_at", "waiting_for",
            "traceparent", "tracestate")
"""The columns of a claim's result (sql/fragments/claim.sql: claim_result) passed to
:class:`Claimed` as they are; ``args`` and ``steps`` are decoded first."""


def _claimed(row: Mapping[str, Any]) -> Claimed:
    """A row of claim_batch or claim_limited by column name (both end with the same
    claim_result, named as Claimed's fields). Arguments and checkpoints arrive as JSON text
    and are decoded here, one execution at a time, so a value that cannot be decoded fails
    that execution only (FAULTS P2)."""
    broken: Exception | None = None
    args: list[Any] = []
    steps: dict[int, RecordedStep] = {}
    try:
        args = codec.decode_exact(row["args"])
        history = orjson.loads(row["steps"]) if row["steps"] is not None else None
    except ValueError as exc:
        broken = UndecodableInput(
            f"the stored arguments or checkpoints of execution {row['id']} cannot be decoded "
            f"unchanged ({exc}); submit them within JSON's double range and 64-bit integers")
    else:
        if isinstance(history, dict):
            broken = HistoryTooLarge(
                f"execution {row['id']} has {history.get('too_large')} bytes of recorded "
                "checkpoints, over --max-history-bytes: it cannot be loaded to replay")
        else:
            steps = _recorded(history)
    return Claimed(args=args, steps=steps, broken=broken,
                   **{k: row[k] for k in _CLAIMED if k in row})


def _claims(cur: Any, rows: Sequence[Sequence[Any]]) -> list[Claimed]:
    names = [c.name for c in cur.description or ()]
    return [_claimed(dict(zip(names, r, strict=True))) for r in rows]


def claimed_from_texts(*, id: uuid.UUID, workflow: str, args: str, steps: str | None,
                       wait_step: int | None, waiting_for: str | None,
                       created_at: datetime | None) -> Claimed:
    """An execution as a claim would hand it to the runner, from its arguments and
    checkpoints as the database returns them (JSON text, ``history_of``'s shape), decoded as
    a claim's row is: what cannot be decoded, or a history over the bound, is ``broken``. A
    replay before deploy (kestrel.replay) loads histories through this, so it sees exactly
    what a worker would (no lease, no trace context)."""
    return _claimed({"id": id, "workflow": workflow, "args": args, "epoch": 0, "attempt": 1,
                     "steps": steps, "wait_step": wait_step, "waiting_for": waiting_for,
                     "created_at": created_at})


async def claim_batch(
    conn: AnyConn, q: Queries, *, owner: str, queues: Sequence[str], limit: int,
    lease_s: float, workflows: Sequence[str] | None = None,
    max_history_bytes: int = MAX_HISTORY_BYTES, take_suspect: bool = True,
    app_version: str | None = None,
) -> list[Claimed]:
    """Claim up to *limit* queued executions of *workflows* (None: any) with their recorded
    checkpoints.

    At most one of them is a suspect (claimed :data:`SUSPECT_AFTER` times before), and none
    when *take_suspect* is false. A first claim records *app_version* on the row.
    """
    params = {"owner": owner, "queues": list(queues), "limit": limit, "lease_s": lease_s,
              "take_suspect": take_suspect,
              "workflows": list(workflows or ()), "any_workflow": workflows is None,
              "max_history_bytes": max_history_bytes, "app_version": app_version}
    cur = await _exec(conn, q.claim_batch, params)
    return _claims(cur, await cur.fetchall())


async def save_steps(conn: AnyConn, q: Queries, writes: Sequence[StepWrite]) -> list[StepSaved]:
    """Checkpoint *writes* in one statement; results are in the order of *writes*.

    The statement is ``save_new_steps_batch``, a plain INSERT (no speculative insertion, so
    less WAL). If a step of the batch is already recorded (only a retry after a lost reply
    can meet one: FAULTS F3), it fails whole with unique_violation and the batch is sent
    again as ``save_steps_batch`` (``ON CONFLICT DO NOTHING``), which returns the output
    recorded first: a second round trip, on that rare path only.
    """
    params = _steps_params(writes)
    try:
        cur = await _exec(conn, q.save_new_steps_batch, params)
    except psycopg.errors.UniqueViolation:
        cur = await _exec(conn, q.save_steps_batch, params)
    by_key = {(r[0], r[1]): r for r in await cur.fetchall()}
    saved = []
    for w in writes:
        r = by_key[(w.execution_id, w.step_id)]
        owned, inserted = bool(r[2]), bool(r[3])
        if r[4] is not None:
            recorded: RecordedStep | None = RecordedStep(r[4], r[5], r[6])
        else:
            recorded = None
        saved.append(StepSaved(owned=owned, inserted=inserted, recorded=recorded,
                               cancelled=bool(r[7])))
    return saved


def _steps_params(writes: Sequence[StepWrite]) -> dict[str, str]:
    now = time.monotonic()
    return {"rows": _json_rows(
        [w.execution_id, w.epoch, w.step_id, w.name, _wrapped(w.output), _wrapped(w.error),
         w.attempt, w.ran_s + max(0.0, now - w.ended_at), max(0.0, now - w.ended_at)]
        for w in writes)}


def _wrapped(encoded: str | None) -> list[orjson.Fragment] | None:
    """An output or error already encoded as JSON, embedded as is, in a one-element array
    (None stays SQL NULL; a step that returned None is ``[null]``)."""
    return None if encoded is None else [orjson.Fragment(encoded)]


def _json_rows(rows: Iterable[list[Any]]) -> str:
    """Rows of a batch as one JSON array, the single parameter of the batched writes
    (``jsonb_array_elements`` unpacks it): orjson builds it in a few µs where psycopg took
    ~10 µs a row to dump one array per column. Text that cannot be encoded (a lone
    surrogate) is a UnicodeError, as psycopg's own refusal was, so a group commit isolates
    the item that holds it (:func:`is_data_error`)."""
    try:
        return orjson.dumps(list(rows)).decode()
    except orjson.JSONEncodeError as exc:
        raise UnicodeError(f"a value of this batch cannot be sent: {exc}") from exc


async def park(
    conn: AnyConn, q: Queries, *, id: uuid.UUID, epoch: int, step_id: int, waiting_for: str,
    seconds: float | None, seen_seq: int | None,
) -> str:
    """Park the execution at a wait. Returns ``parked`` (now, or by an earlier try whose
    reply was lost), ``cancelled`` (a cancel was requested), ``signalled`` (a signal arrived
    since *seen_seq* was read: look again) or ``lost`` (no longer ours)."""
    params = {"id": id, "epoch": epoch, "step_id": step_id, "waiting_for": waiting_for,
              "seconds": seconds, "seen_seq": seen_seq}
    cur = await _exec(conn, q.park, params)
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def consume_signal(
    conn: AnyConn, q: Queries, *, id: uuid.UUID, epoch: int, step_id: int, name: str,
    step_name: str,
) -> SignalTaken:
    """Take the oldest pending signal *name* into the checkpoint of the wait at *step_id*.

    Fenced by *epoch*. Returns ownership, the cancel flag, the recorded output (None when no
    signal is pending) and the ``signal_seq`` to park with.
    """
    params = {"id": id, "epoch": epoch, "step_id": step_id, "name": name,
              "step_name": step_name}
    cur = await _exec(conn, q.consume_signal, params)
    row = await cur.fetchone()
    assert row is not None
    return SignalTaken(owned=bool(row[0]), cancelled=bool(row[1]), output=row[2],
                       signal_seq=int(row[3] or 0))


async def set_event(
    conn: AnyConn, q: Queries, *, id: uuid.UUID, epoch: int, key: str, value: str
) -> bool:
    """Upsert event *key* to *value* (JSON text) and notify those waiting on it.

    Returns False if the execution is no longer running under *epoch*.
    """
    params = {"id": id, "epoch": epoch, "key": key, "value": value}
    cur = await _exec(conn, q.set_event, params)
    row = await cur.fetchone()
    return bool(row and row[0])


async def expire_deadlines(conn: AnyConn, q: Queries, *, limit: int) -> int:
    """Fail queued and waiting executions past their workflow deadline; return how many.

    At most *limit*; they move to history and their parents are told.
    """
    params = {"limit": limit}
    cur = await _exec(conn, q.expire_deadlines, params)
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def load_step(
    conn: AnyConn, q: Queries, *, execution_id: uuid.UUID, step_id: int
) -> RecordedStep | None:
    """Read the checkpoint recorded at *step_id*, or None if there is none."""
    params = {"execution_id": execution_id, "step_id": step_id}
    cur = await _exec(conn, q.load_step, params)
    row = await cur.fetchone()
    return RecordedStep(row[0], row[1], row[2]) if row else None


async def complete_batch(
    conn: AnyConn, q: Queries, finishes: Sequence[Finish]
) -> set[uuid.UUID]:
    """Finish executions and move them to history; return the ids that were still owned."""
    params = {"rows": _json_rows([f.execution_id, f.epoch, f.status.value,
                                  _wrapped(f.result), _wrapped(f.error)] for f in finishes)}
    cur = await _exec(conn, q.complete_batch, params)
    return {row[0] for row in await cur.fetchall()}


async def finished_readback(
    conn: AnyConn, q: Queries, finishes: Sequence[Finish]
) -> set[uuid.UUID]:
    """Of *finishes*, the ids that are in history under their epoch and status: our own
    completion committed, though its reply was lost."""
    params = {"ids": [f.execution_id for f in finishes], "epochs": [f.epoch for f in finishes],
              "statuses": [f.status.value for f in finishes]}
    cur = await _exec(conn, q.finished_readback, params)
    return {row[0] for row in await cur.fetchall()}


async def release_batch(
    conn: AnyConn, q: Queries, *, held: Sequence[tuple[uuid.UUID, int]]
) -> set[uuid.UUID]:
    """Put still-owned executions back in the queue at once (drain)."""
    params = {"ids": [h[0] for h in held], "epochs": [h[1] for h in held]}
    cur = await _exec(conn, q.release_batch, params)
    return {row[0] for row in await cur.fetchall()}


async def give_back(
    conn: AnyConn, q: Queries, *, id: uuid.UUID, epoch: int, app_version: str | None,
    base_s: float, cap_s: float,
) -> tuple[int, datetime] | Literal["cancelled"] | None:
    """Give back an execution this worker's code is too old for (CodeTooOld), unrun: it
    waits until now + ``min(cap_s, base_s * 2**give_backs)``, its give-back counted and
    *app_version* recorded, whose claims skip it from then on. Returns the execution's
    give-back count and when it can be claimed again (also on a retry after a lost reply),
    ``"cancelled"`` if a cancel was requested meanwhile (nothing given back: the worker
    finishes it as cancelled), or None if it is no longer ours."""
    cur = await _exec(conn, q.give_back, {"id": id, "epoch": epoch,
                                          "app_version": app_version, "base_s": base_s,
                                          "cap_s": cap_s})
    row = await cur.fetchone()
    if row is None:
        return None
    return "cancelled" if row[2] else (int(row[0]), row[1])


async def reenqueue_expired(
    conn: AnyConn, q: Queries, *, limit: int, max_attempts: int
) -> SweepResult:
    """Requeue running executions whose lease expired, up to *limit*.

    Those claimed *max_attempts* times move to history as quarantined instead. ``examined``
    counts the expired leases found: callers loop while it reaches *limit*.
    """
    params = {"limit": limit, "max_attempts": max_attempts}
    cur = await _exec(conn, q.reenqueue_expired, params)
    row = await cur.fetchone()
    assert row is not None
    return SweepResult(requeued=row[0], quarantined=row[1], examined=row[2])


async def listen(conn: AnyConn, q: Queries) -> None:
    """LISTEN on *conn* for this schema's wake-ups (use a direct, non-pooled connection)."""
    await conn.execute(q.listen)
    if LOST_REPLIES:
        await _lose_reply(conn, q.listen, None)


# -- running statements defined once (kestrel.statements) ----------------------------------


async def run(conn: AnyConn, stmt: Stmt[T]) -> T:
    """Execute *stmt* on an async connection; map kestrel's SQLSTATEs to typed errors."""
    try:
        cur = await conn.execute(stmt.query, stmt.params)
    except psycopg.Error as exc:
        mapped = _error(exc, stmt.key)
        if mapped is None:
            raise
        raise mapped from None
    if LOST_REPLIES:
        await _lose_reply(conn, stmt.query, stmt.params)
    return stmt.decode(await cur.fetchall() if cur.description else [])


def run_sync(conn: psycopg.Connection[Any], stmt: Stmt[T]) -> T:
    """:func:`run` on a blocking connection."""
    try:
        cur = conn.execute(stmt.query, stmt.params)
    except psycopg.Error as exc:
        mapped = _error(exc, stmt.key)
        if mapped is None:
            raise
        raise mapped from None
    if LOST_REPLIES:
        _lose_reply_sync(conn, stmt.query, stmt.params)
    return stmt.decode(cur.fetchall() if cur.description else [])


async def run_script(conn: AnyConn, script: Script[T]) -> T:
    """Run *script* in one transaction on an async connection."""
    sent: list[Stmt[Any]] = []
    async with conn.transaction():
        try:
            stmt = next(script)
            while True:
                sent.append(stmt)
                stmt = script.send(await run(conn, stmt))
        except StopIteration as done:
            result: T = done.value
    if LOST_REPLIES:
        for stmt in sent:
            await _lose_reply(conn, stmt.query, stmt.params)
    return result


def run_script_sync(conn: psycopg.Connection[Any], script: Script[T]) -> T:
    """:func:`run_script` on a blocking connection."""
    sent: list[Stmt[Any]] = []
    with conn.transaction():
        try:
            stmt = next(script)
            while True:
                sent.append(stmt)
                stmt = script.send(run_sync(conn, stmt))
        except StopIteration as done:
            result: T = done.value
    committed_sync(conn, sent)
    return result


def committed_sync(conn: psycopg.Connection[Any], sent: Sequence[Stmt[Any]]) -> None:
    """Tell the lost-reply failpoints that a transaction block which ran *sent* has just
    committed (a statement inside a block is only committed with it): if one of them is
    armed, the reply to the COMMIT is lost (see :func:`_lose_reply`)."""
    if LOST_REPLIES:
        for stmt in sent:
            _lose_reply_sync(conn, stmt.query, stmt.params)


# -- lost replies (FAULTS R1): a statement commits, then its reply never comes ---------------


async def _exec(conn: AnyConn, query: str, params: Any = None) -> psycopg.AsyncCursor[Any]:
    """Execute one named statement: every statement of this module goes through here, so a
    lost reply can be injected after any of them (:func:`_lose_reply`)."""
    cur = await conn.execute(query, params)
    if LOST_REPLIES:
        await _lose_reply(conn, query, params)
    return cur


async def _lose_reply(conn: AnyConn, query: str, params: Any) -> None:
    """If ``lost_reply:<name>`` is armed for this statement, which has just run, and it has
    committed (autocommit; inside a transaction block the commit comes later, and
    :func:`run_script` or the function owning the block asks again after it), close the
    connection and raise what a reply lost on its way would raise."""
    if conn.info.transaction_status != TransactionStatus.IDLE:
        return
    name = statement_name(query)
    if name is not None and lost_reply(name, params):
        await conn.close()
        raise psycopg.OperationalError(_LOST.format(name))


def _lose_reply_sync(conn: psycopg.Connection[Any], query: str, params: Any) -> None:
    """:func:`_lose_reply` on a blocking connection."""
    if conn.info.transaction_status != TransactionStatus.IDLE:
        return
    name = statement_name(query)
    if name is not None and lost_reply(name, params):
        conn.close()
        raise psycopg.OperationalError(_LOST.format(name))


_LOST = ("failpoint lost_reply:{}: the connection was lost after the statement committed, "
         "before its reply arrived")


def _error(exc: psycopg.Error, key: str | None = None) -> KestrelError | None:
    """Map the SQLSTATEs raised by kestrel's SQL functions to typed errors."""
    message = str(exc.diag.message_primary)
    if exc.sqlstate == "KS001":
        return IdempotencyConflict(message, key=key or "")
    if exc.sqlstate == "KS002":
        return ConfigError(message)
    if exc.sqlstate == "KS003":
        return ExecutionNotFound(message)
    if exc.sqlstate in ("KS004", "KS005"):
        return InvalidState(message)
    if exc.sqlstate == "KS006":
        return DuplicateExecution(message)
    if exc.sqlstate == "KS007":
        return SerializationError(message)
    if exc.sqlstate == "KS008":
        return PayloadTooLarge(message)
    if exc.sqlstate == "KS009":
        return ParentCancelled(message)
    return None


async def claim_limited(
    conn: AnyConn, q: Queries, *, queue: str, owner: str, limit: int, lease_s: float,
    workflows: Sequence[str] | None = None, max_history_bytes: int = MAX_HISTORY_BYTES,
    app_version: str | None = None,
) -> list[Claimed] | None:
    """Claim from a limited queue within its limits, in one transaction under the queue's row
    lock; None when another process holds that lock right now (try again later)."""
    params = {"queue": queue, "owner": owner, "limit": limit, "lease_s": lease_s,
              "workflows": list(workflows or ()), "any_workflow": workflows is None,
              "max_history_bytes": max_history_bytes, "app_version": app_version}
    async with conn.transaction():
        locked = await (await conn.execute(q.lock_queue_limit, {"queue": queue})).fetchone()
        if locked is None:
            return None
        cur = await conn.execute(q.claim_limited, params)
        rows = _claims(cur, await cur.fetchall())
    if LOST_REPLIES:
        await _lose_reply(conn, q.lock_queue_limit, {"queue": queue})
        await _lose_reply(conn, q.claim_limited, params)
    return rows


async def get_schedule(conn: AnyConn, q: Queries, *, name: str) -> datetime | None:
    """Return the last tick of schedule *name*, or None if it is not registered."""
    row = await (await conn.execute(q.get_schedule, {"name": name})).fetchone()
    if LOST_REPLIES:
        await _lose_reply(conn, q.get_schedule, {"name": name})
    return row[0] if row else None


async def start_tick(conn: AnyConn, q: Queries, *, name: str, seen: datetime, tick: datetime,
                     submit: dict[str, Any]) -> bool:
    """Advance a schedule from *seen* to *tick* and submit the tick, atomically; False if
    another process advanced it first."""
    async with conn.transaction():
        moved = await (await conn.execute(q.advance_schedule, {"name": name, "seen": seen,
                                                               "tick": tick})).fetchone()
        if moved is None:
            return False
        await run(conn, value(q.submit, submit, key=submit["idempotency_key"]))
    if LOST_REPLIES:
        await _lose_reply(conn, q.advance_schedule, {"name": name, "seen": seen, "tick": tick})
        await _lose_reply(conn, q.submit, submit)
    return True
