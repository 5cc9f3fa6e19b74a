"""The only module that executes runtime SQL: one function per named statement.

Every function is one statement and one round trip on a connection in autocommit mode, so
each write is its own short transaction and no user code ever runs inside one. Writes from
workers carry the lease epoch; the statements match zero rows for a superseded epoch and the
caller learns it from what comes back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

import orjson
import psycopg
from psycopg.types.json import set_json_loads
from psycopg_pool import AsyncConnectionPool

from kestrel import codec
from kestrel.codec import MAX_HISTORY_BYTES
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
from kestrel.sql import Queries
from kestrel.types import (
    Claimed,
    Execution,
    ExecutionSummary,
    Finish,
    QueueStat,
    RecordedStep,
    SignalTaken,
    Stats,
    Status,
    StepRow,
    StepSaved,
    StepWrite,
    SweepResult,
)

AnyConn = psycopg.AsyncConnection[Any]
T = TypeVar("T")

# SQLSTATEs that mean the server or the link went away, not that the statement is wrong.
_GONE = {"57P01", "57P02", "57P03"}  # admin shutdown, crash shutdown, cannot connect now


def is_transient(exc: BaseException) -> bool:
    """Whether *exc* means "the database is unreachable right now": wait and try again.

    Only connection-level failures are: class 08, a server shutting down, a connection
    psycopg lost (an OperationalError with no SQLSTATE, a closed connection, a pool that gave
    no connection in time) and OS-level socket errors. Every other error came back from a
    statement that the server ran and refused; sending it again unchanged would most likely
    fail the same way (a program limit, out of memory, a full disk, a statement timeout), so
    callers retry those a bounded number of times and then isolate what caused them.
    """
    if isinstance(exc, OSError | psycopg.InterfaceError):
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in _GONE


def is_data_error(exc: BaseException) -> bool:
    """Whether *exc* refuses a value as such (class 22 data exceptions, values psycopg
    cannot send such as a NUL in text, or text it cannot encode): the same value fails
    every time, whatever the database's state."""
    if isinstance(exc, psycopg.DataError | UnicodeError):
        return True
    return isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith("22")


def configure_connection(conn: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]) -> None:
    """Decode jsonb with orjson on *conn* (outputs round-trip through one codec)."""
    set_json_loads(orjson.loads, conn)


async def configure_connection_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`configure_connection` for an async pool's ``configure`` hook."""
    configure_connection(conn)


POOL_WAIT_S = 2.0

# Unless the DSN says otherwise: a connection attempt gives up after 5 s (libpq's default is
# to wait for the OS, minutes against a host that drops packets), and a peer that stops
# answering is noticed by TCP keepalives within ~25 s idle, or within 30 s of unacknowledged
# data (tcp_user_timeout), instead of a statement hanging for the OS's retransmission limit.
# Ignored on Unix sockets.
LINK_DEFAULTS = {"connect_timeout": "5", "keepalives": "1", "keepalives_idle": "10",
                 "keepalives_interval": "5", "keepalives_count": "3",
                 "tcp_user_timeout": "30000"}


def link_params(dsn: str) -> dict[str, Any]:
    """LINK_DEFAULTS less whatever *dsn* sets itself."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        given = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        given = {}
    return {k: v for k, v in LINK_DEFAULTS.items() if k not in given}


def make_pool(dsn: str, *, max_size: int, name: str,
              prepared: bool = True) -> AsyncConnectionPool[Any]:
    """Create (not open) this process's pool. Call only after fork: pools don't survive it.

    *prepared*: hot statements are prepared server-side from their first use (one parse per
    connection). Off behind a transaction-mode pooler that cannot route named prepared
    statements (PgBouncer before 1.21), where a later statement may land on a server
    connection that never saw the PREPARE.
    """
    return AsyncConnectionPool(
        dsn,
        min_size=1,
        max_size=max_size,
        kwargs={"autocommit": True, "prepare_threshold": 0 if prepared else None,
                # Operators can tell kestrel's backends apart in pg_stat_activity.
                "application_name": "kestrel-worker", **link_params(dsn)},
        configure=configure_connection_async,
        name=name,
        open=False,
        # No check at checkout: it costs a round trip on every statement (16% of a worker's
        # CPU in a profile). A connection that broke fails its statement with
        # OperationalError, which every caller retries; the pool discards it on return.
        #
        # Reconnecting after an outage: psycopg_pool's own retries back off 1, 2, 4, 8 s...
        # (a five-minute outage would leave minutes between attempts), so it gives up at
        # once (reconnect_timeout=0: after its first retry) and the callers do the retrying:
        # a new connection is attempted whenever a caller asks for one, none is there and
        # no attempt is in flight (each bounded by connect_timeout). A caller that asked
        # during the outage must not wait out psycopg_pool's 30 s default for an attempt
        # that already failed, or the process sits idle long after the database is back:
        # it gives up after POOL_WAIT_S (PoolTimeout is an OperationalError), backs off,
        # and asks again, which tries a new connection.
        reconnect_timeout=0,
        timeout=POOL_WAIT_S,
    )


def _recorded(steps: list[list[Any]] | None) -> dict[int, RecordedStep]:
    if not steps:
        return {}
    return {s[0]: RecordedStep(s[1], s[2], s[3]) for s in steps}


SUSPECT_AFTER = 2
"""Claims without finishing after which an execution is a suspect (see claim_batch)."""


def _claimed(row: Sequence[Any]) -> Claimed:
    """A row of claim_batch or claim_limited (both return the same columns). Arguments and
    checkpoints arrive as JSON text and are decoded here, one execution at a time, so a value
    that cannot be decoded fails that execution only (FAULTS P2)."""
    broken: Exception | None = None
    args: list[Any] = []
    steps: dict[int, RecordedStep] = {}
    try:
        args = codec.decode_exact(row[2])
        history = orjson.loads(row[5]) if row[5] is not None else None
    except ValueError as exc:
        broken = UndecodableInput(
            f"the stored arguments or checkpoints of execution {row[0]} cannot be decoded "
            f"unchanged ({exc}); submit them within JSON's double range and 64-bit integers")
    else:
        if isinstance(history, dict):
            broken = HistoryTooLarge(
                f"execution {row[0]} has {history.get('too_large')} bytes of recorded "
                "checkpoints, over --max-history-bytes: it cannot be loaded to replay")
        else:
            steps = _recorded(history)
    return Claimed(row[0], row[1], args, row[3], row[4], steps, row[6], row[7], row[8],
                   row[9], row[10], row[11], row[12], broken)


async def claim_batch(
    conn: AnyConn, q: Queries, *, owner: str, queues: Sequence[str], limit: int,
    lease_s: float, workflows: Sequence[str] | None = None,
    max_history_bytes: int = MAX_HISTORY_BYTES, take_suspect: bool = True,
) -> list[Claimed]:
    """Claim up to *limit* queued executions of *workflows* (None: any) with their recorded
    checkpoints.

    At most one of them is a suspect (claimed :data:`SUSPECT_AFTER` times before), and none
    when *take_suspect* is false.
    """
    cur = await conn.execute(
        q.claim_batch,
        {"owner": owner, "queues": list(queues), "limit": limit, "lease_s": lease_s,
         "suspect_after": SUSPECT_AFTER, "take_suspect": take_suspect,
         "workflows": list(workflows or ()), "any_workflow": workflows is None,
         "max_history_bytes": max_history_bytes},
    )
    return [_claimed(row) for row in await cur.fetchall()]


async def save_steps(conn: AnyConn, q: Queries, writes: Sequence[StepWrite]) -> list[StepSaved]:
    """Checkpoint *writes* in one statement; results are in the order of *writes*."""
    now = time.monotonic()
    cur = await conn.execute(
        q.save_steps_batch,
        {
            "ids": [w.execution_id for w in writes],
            "epochs": [w.epoch for w in writes],
            "step_ids": [w.step_id for w in writes],
            "names": [w.name for w in writes],
            "outputs": [w.output for w in writes],
            "errors": [w.error for w in writes],
            "attempts": [w.attempt for w in writes],
            "ran": [w.ran_s + max(0.0, now - w.ended_at) for w in writes],
            "waited": [max(0.0, now - w.ended_at) for w in writes],
        },
    )
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


async def park(
    conn: AnyConn, q: Queries, *, id: uuid.UUID, epoch: int, step_id: int, waiting_for: str,
    seconds: float | None, seen_seq: int | None,
) -> str:
    """Park the execution at a wait. Returns ``parked`` (now, or by an earlier try whose
    reply was lost), ``cancelled`` (a cancel was requested), ``signalled`` (a signal arrived
    since *seen_seq* was read: look again) or ``lost`` (no longer ours)."""
    cur = await conn.execute(q.park, {"id": id, "epoch": epoch, "step_id": step_id,
                                      "waiting_for": waiting_for, "seconds": seconds,
                                      "seen_seq": seen_seq})
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
    cur = await conn.execute(q.consume_signal, {"id": id, "epoch": epoch, "step_id": step_id,
                                                "name": name, "step_name": step_name})
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
    cur = await conn.execute(q.set_event, {"id": id, "epoch": epoch, "key": key,
                                           "value": value})
    row = await cur.fetchone()
    return bool(row and row[0])


async def expire_deadlines(conn: AnyConn, q: Queries, *, limit: int) -> int:
    """Fail queued and waiting executions past their workflow deadline; return how many.

    At most *limit*; they move to history and their parents are told.
    """
    cur = await conn.execute(q.expire_deadlines, {"limit": limit})
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def load_step(
    conn: AnyConn, q: Queries, *, execution_id: uuid.UUID, step_id: int
) -> RecordedStep | None:
    """Read the checkpoint recorded at *step_id*, or None if there is none."""
    cur = await conn.execute(q.load_step, {"execution_id": execution_id, "step_id": step_id})
    row = await cur.fetchone()
    return RecordedStep(row[0], row[1], row[2]) if row else None


async def complete_batch(
    conn: AnyConn, q: Queries, finishes: Sequence[Finish]
) -> set[uuid.UUID]:
    """Finish executions and move them to history; return the ids that were still owned."""
    cur = await conn.execute(
        q.complete_batch,
        {
            "ids": [f.execution_id for f in finishes],
            "epochs": [f.epoch for f in finishes],
            "statuses": [f.status.value for f in finishes],
            "results": [f.result for f in finishes],
            "errors": [f.error for f in finishes],
        },
    )
    return {row[0] for row in await cur.fetchall()}


async def finished_readback(
    conn: AnyConn, q: Queries, finishes: Sequence[Finish]
) -> set[uuid.UUID]:
    """Of *finishes*, the ids that are in history under their epoch and status: our own
    completion committed, though its reply was lost."""
    cur = await conn.execute(
        q.finished_readback,
        {"ids": [f.execution_id for f in finishes], "epochs": [f.epoch for f in finishes],
         "statuses": [f.status.value for f in finishes]},
    )
    return {row[0] for row in await cur.fetchall()}


async def release_batch(
    conn: AnyConn, q: Queries, *, held: Sequence[tuple[uuid.UUID, int]]
) -> set[uuid.UUID]:
    """Put still-owned executions back in the queue at once (drain)."""
    cur = await conn.execute(
        q.release_batch, {"ids": [h[0] for h in held], "epochs": [h[1] for h in held]}
    )
    return {row[0] for row in await cur.fetchall()}


async def reenqueue_expired(
    conn: AnyConn, q: Queries, *, limit: int, max_attempts: int
) -> SweepResult:
    """Requeue running executions whose lease expired, up to *limit*.

    Those claimed *max_attempts* times move to history as quarantined instead. ``examined``
    counts the expired leases found: callers loop while it reaches *limit*.
    """
    cur = await conn.execute(
        q.reenqueue_expired, {"limit": limit, "max_attempts": max_attempts}
    )
    row = await cur.fetchone()
    assert row is not None
    return SweepResult(requeued=row[0], quarantined=row[1], examined=row[2])


async def listen(conn: AnyConn, q: Queries) -> None:
    """LISTEN on *conn* for this schema's wake-ups (use a direct, non-pooled connection)."""
    await conn.execute(q.listen)


# -- statements defined once, run by either side ---------------------------------------------
#
# A Stmt is one statement with its parameters and the function that turns its rows into a
# result. It does no I/O: `run` executes it on an async connection and `run_sync` on a
# blocking one, so the async client, the sync client, the worker's heartbeat thread and the
# CLI share one definition of each statement instead of hand-written twins.


@dataclass(frozen=True, slots=True)
class Stmt(Generic[T]):
    """A statement, its parameters and how its rows become a result."""

    query: str
    params: Mapping[str, Any] | None
    decode: Callable[[list[tuple[Any, ...]]], T]
    key: str | None = None  # the idempotency key, for IdempotencyConflict's message


async def run(conn: AnyConn, stmt: Stmt[T]) -> T:
    """Execute *stmt* on an async connection; map kestrel's SQLSTATEs to typed errors."""
    try:
        cur = await conn.execute(stmt.query, stmt.params)
    except psycopg.Error as exc:
        mapped = _error(exc, stmt.key)
        if mapped is None:
            raise
        raise mapped from None
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
    return stmt.decode(cur.fetchall() if cur.description else [])


Script = Generator[Stmt[Any], Any, T]
"""Several statements in one transaction: a generator that yields each Stmt and is sent its
result, so one definition serves both sides (see :func:`run_script`)."""


async def run_script(conn: AnyConn, script: Script[T]) -> T:
    """Run *script* in one transaction on an async connection."""
    async with conn.transaction():
        try:
            stmt = next(script)
            while True:
                stmt = script.send(await run(conn, stmt))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def run_script_sync(conn: psycopg.Connection[Any], script: Script[T]) -> T:
    """:func:`run_script` on a blocking connection."""
    with conn.transaction():
        try:
            stmt = next(script)
            while True:
                stmt = script.send(run_sync(conn, stmt))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def _first(rows: list[tuple[Any, ...]]) -> Any:
    return rows[0][0] if rows else None


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


def command(query: str, params: Mapping[str, Any] | None = None) -> Stmt[None]:
    """A statement whose rows, if any, are not needed (LISTEN, an upsert)."""
    return Stmt(query, params, lambda _: None)


def value(query: str, params: Mapping[str, Any], *, key: str | None = None) -> Stmt[Any]:
    """One call of a kestrel SQL function (submit, signal, cancel, retry, fork): its value."""
    return Stmt(query, params, _first, key)


def submit_params(
    *, workflow: str, args: str, queue: str, priority: int, idempotency_key: str | None,
    id: uuid.UUID | None = None, parent: uuid.UUID | None = None,
    timeout_s: float | None = None, delay_s: float | None = None,
    dedup_key: str | None = None, on_duplicate: str = "return",
) -> dict[str, Any]:
    """Return the named parameters of the ``submit`` statement.

    *args* is the encoded argument list.
    """
    return {"workflow": workflow, "args": args, "queue": queue, "priority": priority,
            "idempotency_key": idempotency_key, "id": id, "parent": parent,
            "timeout_s": timeout_s, "delay_s": delay_s, "dedup_key": dedup_key,
            "on_duplicate": on_duplicate}


def _execution(row: Sequence[Any]) -> Execution:
    return Execution(
        id=row[0], workflow=row[1], queue=row[2], priority=row[3], status=Status(row[4]),
        args=row[5], result=row[6], error=row[7], attempts=row[8], lease_epoch=row[9],
        created_at=row[10], started_at=row[11], finished_at=row[12],
    )


def _step_row(row: Sequence[Any]) -> StepRow:
    return StepRow(
        step_id=row[0], name=row[1], output=row[2], error=row[3], attempt=row[4],
        lease_epoch=row[5], started_at=row[6], finished_at=row[7],
    )


def heartbeat(q: Queries, *, held: Sequence[tuple[uuid.UUID, int]],
              lease_s: float) -> Stmt[dict[uuid.UUID, bool]]:
    """Extend the leases in *held*: the ids still owned, each with its cancel flag."""
    return Stmt(q.heartbeat, {"ids": [h[0] for h in held], "epochs": [h[1] for h in held],
                              "lease_s": lease_s},
                lambda rows: {r[0]: bool(r[1]) for r in rows})


def get_event(q: Queries, *, id: uuid.UUID, key: str) -> Stmt[tuple[bool, Any]]:
    """The latest value of an event: (found, value)."""
    return Stmt(q.get_event, {"id": id, "key": key},
                lambda rows: (True, rows[0][0]) if rows else (False, None))


def get_execution(q: Queries, *, id: uuid.UUID) -> Stmt[Execution | None]:
    """One execution, live or finished."""
    return Stmt(q.get_execution, {"id": id},
                lambda rows: _execution(rows[0]) if rows else None)


def list_steps(q: Queries, *, id: uuid.UUID) -> Stmt[list[StepRow]]:
    """The checkpoints of one execution, live or finished."""
    return Stmt(q.list_steps, {"id": id}, lambda rows: [_step_row(r) for r in rows])


def _counts(rows: list[tuple[Any, ...]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status, n in rows:
        counts[status] = counts.get(status, 0) + n
    return counts


def count_by_status(q: Queries) -> Stmt[dict[str, int]]:
    """Executions by status, live and finished."""
    return Stmt(q.count_by_status, None, _counts)


def list_executions(q: Queries, *, status: str | None, workflow: str | None,
                    since: datetime | None, limit: int) -> Stmt[list[ExecutionSummary]]:
    """Executions newest first, live and finished, optionally filtered."""
    return Stmt(q.list_executions, {"status": status, "workflow": workflow, "since": since,
                                    "limit": limit},
                lambda rows: [ExecutionSummary(id=r[0], workflow=r[1], queue=r[2],
                                               status=Status(r[3]), attempts=r[4],
                                               created_at=r[5], finished_at=r[6])
                              for r in rows])


def queue_stats(q: Queries) -> Stmt[list[QueueStat]]:
    """Live executions by queue and status, with the oldest queued one's age."""
    return Stmt(q.queue_stats, None, lambda rows: [
        QueueStat(queue=r[0], status=r[1], count=int(r[2]),
                  oldest_age_s=float(r[3] or 0.0) if r[1] == "queued" else None)
        for r in rows])


def worker_stats(q: Queries) -> Stmt[dict[str, int]]:
    """Running executions by the worker holding their lease."""
    return Stmt(q.worker_stats, None, lambda rows: {r[0]: r[1] for r in rows})


def stats(q: Queries) -> Script[Stats]:
    """What ``stats`` shows, read in one transaction."""
    queues = yield queue_stats(q)
    workers = yield worker_stats(q)
    totals = yield count_by_status(q)
    return Stats(queues=queues, running_by_worker=workers, totals=totals)


def run_maintenance(q: Queries, *, interval: str, ahead: int, retention_days: float,
                    detach: bool = False) -> Script[tuple[bool, int, int]]:
    """One upkeep round in one transaction, if no other process holds the upkeep lock:
    (ran, partitions created, partitions dropped)."""
    got = yield Stmt(q.maintenance_lock, None, _first)
    if not got:
        return False, 0, 0
    created = yield Stmt(q.ensure_partitions, {"interval": interval, "ahead": ahead}, _first)
    dropped = 0
    if retention_days > 0:
        dropped = yield Stmt(q.drop_partitions, {"retention_days": retention_days,
                                                 "detach": detach}, _first)
    return True, int(created or 0), int(dropped or 0)


def list_partitions(q: Queries) -> Stmt[list[tuple[Any, ...]]]:
    """History partitions with their bounds and sizes."""
    return Stmt(q.list_partitions, None, list)


def db_now(q: Queries) -> Stmt[datetime]:
    """The database clock (kestrel_now())."""
    return Stmt(q.db_now, None, _first)


def upsert_queue_limit(q: Queries, *, queue: str, concurrency: int | None, rate: int | None,
                       period_s: float | None) -> Stmt[None]:
    """Declare (or change) a queue's limits."""
    return Stmt(q.upsert_queue_limit, {"queue": queue, "concurrency": concurrency,
                                       "rate": rate, "period_s": period_s}, lambda _: None)


def upsert_schedule(q: Queries, *, name: str, cron: str, workflow: str,
                    last_tick: datetime) -> Stmt[datetime]:
    """Register a schedule; its last tick (kept if it existed)."""
    return Stmt(q.upsert_schedule, {"name": name, "cron": cron, "workflow": workflow,
                                    "last_tick": last_tick}, _first)


async def claim_limited(
    conn: AnyConn, q: Queries, *, queue: str, owner: str, limit: int, lease_s: float,
    workflows: Sequence[str] | None = None, max_history_bytes: int = MAX_HISTORY_BYTES,
) -> list[Claimed] | None:
    """Claim from a limited queue within its limits, in one transaction under the queue's row
    lock; None when another process holds that lock right now (try again later)."""
    async with conn.transaction():
        locked = await (await conn.execute(q.lock_queue_limit, {"queue": queue})).fetchone()
        if locked is None:
            return None
        cur = await conn.execute(q.claim_limited, {
            "queue": queue, "owner": owner, "limit": limit, "lease_s": lease_s,
            "workflows": list(workflows or ()), "any_workflow": workflows is None,
            "max_history_bytes": max_history_bytes})
        rows = await cur.fetchall()
    return [_claimed(r) for r in rows]


async def get_schedule(conn: AnyConn, q: Queries, *, name: str) -> datetime | None:
    """Return the last tick of schedule *name*, or None if it is not registered."""
    row = await (await conn.execute(q.get_schedule, {"name": name})).fetchone()
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
    return True
