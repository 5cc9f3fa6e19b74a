"""Submit executions and talk to them: :class:`Client` (async) and :class:`SyncClient`.

``submit`` calls the SQL function ``<schema>.submit`` in one statement. Pass ``conn=`` to run
it inside your own psycopg transaction: the execution then commits or rolls back with your
data. Without ``conn`` it commits before ``submit`` returns. ``signal``, ``cancel``,
``retry`` and ``fork`` call the SQL functions of the same names, so SQL, the CLI and Python
behave alike. ``result`` and ``get_event`` wait on LISTEN/NOTIFY with a polling fallback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from kestrel import codec, db, metrics
from kestrel.codec import DEFAULT_MAX_PAYLOAD_BYTES
from kestrel.config import QUEUE_NAME, SCHEMA_NAME
from kestrel.errors import ConfigError, ExecutionNotFound, WorkflowFailed
from kestrel.sql import queries
from kestrel.types import Execution, ExecutionSummary, Stats, Status, StepRow
from kestrel.workflow import WorkflowFn, workflow_name

log = logging.getLogger("kestrel.client")

_POOL_LOCK = threading.Lock()

MAX_SECONDS = 3_155_760_000
"""Longest timeout or delay accepted (100 years), as in the SQL function."""

POLL_CAP_S = 1.0
"""Longest gap between checks while waiting, in case a notification is lost."""


def _ident(execution_id: uuid.UUID | str) -> uuid.UUID:
    try:
        return uuid.UUID(str(execution_id))
    except ValueError:
        raise ConfigError(f"{execution_id!r} is not an execution id (a UUID)") from None


class _Base:
    """Shared set-up. Behind PgBouncer in transaction mode pass
    ``connection_mode="pgbouncer"`` (or set ``KESTREL_CONNECTION_MODE``): no prepared
    statements, and waits LISTEN only on ``listen_dsn`` (``KESTREL_LISTEN_DSN``), a direct
    connection, polling when there is none."""

    def __init__(self, dsn: str, *, schema: str = "kestrel",
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, pool_size: int = 4,
                 connection_mode: str | None = None, listen_dsn: str | None = None) -> None:
        if not SCHEMA_NAME.fullmatch(schema):
            raise ConfigError(f"invalid schema name {schema!r}")
        if pool_size < 0:
            raise ConfigError("pool_size must not be negative")
        mode = connection_mode or os.environ.get("KESTREL_CONNECTION_MODE") or "direct"
        if mode not in ("direct", "pgbouncer"):
            raise ConfigError(f"connection_mode must be direct or pgbouncer, not {mode!r}")
        self.dsn = dsn
        self.schema = schema
        self._q = queries(schema)
        self._max_bytes = max_payload_bytes
        self._pool_size = pool_size
        self._pooler = mode == "pgbouncer"
        self._listen_dsn = (listen_dsn or os.environ.get("KESTREL_LISTEN_DSN")
                            or (None if self._pooler else dsn))
        # psycopg prepares a statement after 5 runs; a transaction-mode pooler can't route it.
        self._conn_kwargs: dict[str, Any] = {"autocommit": True}
        if self._pooler:
            self._conn_kwargs["prepare_threshold"] = None

    def _submit_params(self, wf: WorkflowFn | str, args: tuple[Any, ...], queue: str,
                       priority: int, key: str | None, timeout: float | None,
                       delay: float | None = None, start_at: datetime | None = None,
                       dedup_key: str | None = None, on_duplicate: str = "return",
                       ) -> dict[str, Any]:
        # The rules of the SQL function (migration 0007), checked here before a round trip.
        name = codec.check_text(workflow_name(wf), what="workflow name")
        if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
            raise ConfigError(f"invalid queue name {_shown(queue)}: 1-128 of A-Z a-z 0-9 "
                              "_ . : -")
        if (isinstance(priority, bool) or not isinstance(priority, int)
                or not -(2**31) <= priority < 2**31):
            raise ConfigError(f"priority must be an integer in [-2^31, 2^31 - 1], got "
                              f"{_shown(priority)}")
        if timeout is not None and not 0 < timeout <= MAX_SECONDS:
            raise ConfigError(f"timeout must be positive and at most {MAX_SECONDS} seconds "
                              f"(100 years), got {timeout}")
        if delay is not None and start_at is not None:
            raise ConfigError("give delay or start_at, not both")
        if start_at is not None:
            if start_at.tzinfo is None:
                raise ConfigError("start_at must be timezone-aware")
            # Relative to this machine's clock; the database clock then holds the wake time.
            delay = max(0.0, (start_at - datetime.now(start_at.tzinfo)).total_seconds())
        if delay is not None and not 0 <= delay <= MAX_SECONDS:
            raise ConfigError(f"delay must be between 0 and {MAX_SECONDS} seconds (100 "
                              f"years), got {delay}")
        if on_duplicate not in ("return", "reject"):
            raise ConfigError(f"on_duplicate must be return or reject, not "
                              f"{_shown(on_duplicate)}")
        if key is not None:
            codec.check_text(key, what="idempotency key")
        if dedup_key is not None:
            codec.check_text(dedup_key, what="dedup key")
        encoded = codec.encode(list(args), what=f"arguments of workflow {name!r}",
                               max_bytes=self._max_bytes)
        return db.submit_params(workflow=name, args=encoded, queue=queue, priority=priority,
                                idempotency_key=key, timeout_s=timeout, delay_s=delay,
                                dedup_key=dedup_key, on_duplicate=on_duplicate)

    def _signal_params(self, execution_id: uuid.UUID | str, name: str, payload: Any,
                       key: str | None) -> dict[str, Any]:
        codec.check_text(name, what="signal name")
        if key is not None:
            codec.check_text(key, what="idempotency key")
        return {"id": _ident(execution_id), "name": name, "idempotency_key": key,
                "payload": codec.encode(payload, what=f"payload of signal {name!r}",
                                        max_bytes=self._max_bytes)}


def _shown(value: object) -> str:
    """*value* for an error message: printable whatever it holds, and short."""
    text = ascii(value)
    return text if len(text) <= 200 else text[:199] + "…"


def _count_submitted(workflow: str) -> None:
    """Count a submission. Runs after the row committed, so it must never raise: a caller
    that retried on the error would submit the work twice (bug 18)."""
    try:
        metrics.get().submitted.labels(workflow).inc()
    except Exception:
        log.exception("could not count a submission of %r in the metrics", workflow)


def _outcome(ex: Execution) -> Any:
    if ex.status is Status.COMPLETED:
        return ex.result
    raise WorkflowFailed(ex.id, ex.status.value, (ex.error or {}).get("message", ex.error))


def _remaining(deadline: float | None) -> float:
    if deadline is None:
        return POLL_CAP_S
    return max(0.0, min(POLL_CAP_S, deadline - time.monotonic()))


class Client(_Base):
    """Async client. Short calls borrow from a small connection pool (``pool_size``, opened
    on first use in the running event loop; 0 = a connection per call); waits for results and
    events use a connection of their own, since LISTEN is session state that must not go back
    to a pool. Close it with ``await client.close()`` or ``async with``.
    """

    _pool: AsyncConnectionPool[Any] | None = None
    _opening: asyncio.Future[None] | None = None

    async def _connect(self, dsn: str | None = None) -> psycopg.AsyncConnection[Any]:
        conn = await psycopg.AsyncConnection.connect(dsn or self.dsn, **self._conn_kwargs)
        db.configure_connection(conn)
        return conn

    @asynccontextmanager
    async def _borrow(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if self._pool_size == 0:
            async with await self._connect() as conn:
                yield conn
            return
        if self._opening is None:
            self._opening = asyncio.get_running_loop().create_future()
            self._pool = AsyncConnectionPool(
                self.dsn, min_size=1, max_size=self._pool_size, open=False,
                kwargs=self._conn_kwargs, configure=db.configure_connection_async,
                name=f"kestrel-client-{self.schema}")
            try:
                await self._pool.open()
            except BaseException as exc:
                self._opening.set_exception(exc)
                self._opening = None
                raise
            self._opening.set_result(None)
        await self._opening
        assert self._pool is not None
        async with self._pool.connection() as conn:
            yield conn

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
            self._opening = None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, query: str, params: dict[str, Any], key: str | None = None,
                    conn: psycopg.AsyncConnection[Any] | None = None) -> Any:
        if conn is not None:
            return await db.call(conn, query, params, key=key)
        async with self._borrow() as own:
            return await db.call(own, query, params, key=key)

    async def submit(
        self, wf: WorkflowFn | str, *args: Any, queue: str = "default", priority: int = 0,
        idempotency_key: str | None = None, timeout: float | None = None,
        delay: float | None = None, start_at: datetime | None = None,
        dedup_key: str | None = None, on_duplicate: str = "return",
        conn: psycopg.AsyncConnection[Any] | None = None,
    ) -> Handle:
        """Enqueue *wf* with *args*; return its handle once the row is committed (or, with
        *conn*, written in that connection's transaction).

        *priority*: higher first within the queue. *timeout*: seconds after which the
        execution ends failed. *delay* (seconds) or *start_at*: not claimed before then.
        *dedup_key*: at most one live execution per key in the queue; a duplicate returns the
        live one (``on_duplicate="return"``) or raises ``DuplicateExecution`` ("reject").

        The rules are those of the SQL function ``submit`` (one set at every door), checked
        here before the round trip; nothing is written when one is broken.

        Raises:
            ConfigError: an invalid queue name, priority, timeout, delay or on_duplicate.
            SerializationError: the workflow name or a key is empty, too long or holds NUL
                or a lone surrogate; an argument cannot round-trip through JSON.
            PayloadTooLarge: the encoded arguments are over ``max_payload_bytes``.
            IdempotencyConflict: *idempotency_key* belongs to an execution with other args.
            DuplicateExecution: *dedup_key* is live and *on_duplicate* is "reject".
        """
        params = self._submit_params(wf, args, queue, priority, idempotency_key, timeout,
                                     delay, start_at, dedup_key, on_duplicate)
        eid = await self._call(self._q.submit, params, idempotency_key, conn)
        _count_submitted(params["workflow"])
        return Handle(self, eid)

    async def signal(self, execution_id: uuid.UUID | str, name: str, payload: Any = None, *,
                     idempotency_key: str | None = None) -> bool:
        """Send signal *name*; False if *idempotency_key* was used already (counted once).

        Raises:
            SerializationError: the name, key or payload breaks the rules of ``submit``.
            ExecutionNotFound: no such execution.
            InvalidState: it has already finished.
        """
        params = self._signal_params(execution_id, name, payload, idempotency_key)
        return bool(await self._call(self._q.signal, params))

    async def cancel(self, execution_id: uuid.UUID | str) -> str:
        """Cancel it and its live children; return ``cancelled``, ``cancelling`` (running:
        stops at its next step boundary) or the terminal status it already had."""
        return str(await self._call(self._q.cancel, {"id": _ident(execution_id)}))

    async def retry(self, execution_id: uuid.UUID | str) -> Handle:
        """Re-run a failed, cancelled or quarantined execution from its last checkpoint."""
        eid = _ident(execution_id)
        await self._call(self._q.retry, {"id": eid})
        return Handle(self, eid)

    async def fork(self, execution_id: uuid.UUID | str, from_step: int) -> Handle:
        """Start a new execution that reuses the first *from_step* checkpoints."""
        new = await self._call(self._q.fork, {"id": _ident(execution_id),
                                              "from_step": from_step})
        return Handle(self, new)

    async def get(self, execution_id: uuid.UUID | str) -> Execution:
        """Return the execution, live or finished.

        Raises:
            ExecutionNotFound: no execution has that id.
        """
        eid = _ident(execution_id)
        async with self._borrow() as conn:
            ex = await db.get_execution(conn, self._q, id=eid)
        if ex is None:
            raise ExecutionNotFound(f"no execution {eid}")
        return ex

    async def steps(self, execution_id: uuid.UUID | str) -> list[StepRow]:
        async with self._borrow() as conn:
            return await db.list_steps(conn, self._q, id=_ident(execution_id))

    async def result(self, execution_id: uuid.UUID | str, timeout: float | None = None) -> Any:
        """Wait for the execution to finish and return its result.

        Raises:
            WorkflowFailed: it ended failed, cancelled or quarantined.
            TimeoutError: it did not finish within *timeout* seconds.
        """
        eid = _ident(execution_id)

        async def check(conn: psycopg.AsyncConnection[Any]) -> tuple[bool, Any]:
            ex = await db.get_execution(conn, self._q, id=eid)
            if ex is None:
                raise ExecutionNotFound(f"no execution {eid}")
            return ex.status.terminal, ex

        ex = await self._wait(check, self._q.listen_done, timeout,
                              lambda: f"execution {eid} did not finish in {timeout}s")
        return _outcome(ex)

    async def get_event(self, execution_id: uuid.UUID | str, key: str,
                        timeout: float | None = None) -> Any:
        """Return the latest value of event *key*, waiting up to *timeout* for one.

        Raises:
            TimeoutError: no value was published in time.
        """
        eid = _ident(execution_id)

        async def check(conn: psycopg.AsyncConnection[Any]) -> tuple[bool, Any]:
            return await db.get_event(conn, self._q, id=eid, key=key)

        return await self._wait(check, self._q.listen_events, timeout,
                                lambda: f"no event {key!r} on {eid} after {timeout}s")

    async def _wait(self, check: Any, listen: str, timeout: float | None,
                    message: Any) -> Any:
        """Re-run *check* on each notification (or poll) until it says done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        waiter = await self._connect(self._listen_dsn) if self._listen_dsn else None
        try:
            if waiter is not None:
                await waiter.execute(listen)
            while True:
                # Same connection when it is direct; a pooled one otherwise.
                if waiter is not None and self._listen_dsn == self.dsn:
                    done, value = await check(waiter)
                else:
                    async with self._borrow() as conn:
                        done, value = await check(conn)
                if done:
                    return value
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(message())
                if waiter is not None:
                    await _wait_notify(waiter, _remaining(deadline))
                else:
                    await asyncio.sleep(min(delay, _remaining(deadline)))
                    delay = min(delay * 1.5, POLL_CAP_S)
        finally:
            if waiter is not None:
                await waiter.close()


async def _wait_notify(conn: psycopg.AsyncConnection[Any], timeout: float) -> None:
    """Return at the next notification on *conn* or after *timeout* seconds."""
    gen = conn.notifies(timeout=timeout, stop_after=1)
    async for _ in gen:
        pass


@dataclass(frozen=True, slots=True)
class Handle:
    """A submitted execution."""

    client: Client
    id: uuid.UUID

    async def result(self, timeout: float | None = None) -> Any:
        return await self.client.result(self.id, timeout)

    async def get(self) -> Execution:
        return await self.client.get(self.id)


class SyncClient(_Base):
    """Blocking twin of :class:`Client` for scripts, web handlers and the CLI; thread-safe.

    Short calls borrow from a small connection pool (``pool_size``, opened on first use;
    0 = a connection per call); ``result`` and ``get_event`` wait on a connection of their
    own. Close it with ``client.close()`` or ``with``.
    """

    _pool: ConnectionPool[Any] | None = None

    def _connect(self, dsn: str | None = None) -> psycopg.Connection[Any]:
        conn = psycopg.connect(dsn or self.dsn, **self._conn_kwargs)
        db.configure_connection(conn)
        return conn

    @contextmanager
    def _borrow(self) -> Iterator[psycopg.Connection[Any]]:
        if self._pool_size == 0:
            with self._connect() as conn:
                yield conn
            return
        with _POOL_LOCK:
            if self._pool is None:
                self._pool = ConnectionPool(
                    self.dsn, min_size=1, max_size=self._pool_size, open=True,
                    kwargs=self._conn_kwargs, configure=db.configure_connection,
                    name=f"kestrel-client-{self.schema}")
        with self._pool.connection() as conn:
            yield conn

    def close(self) -> None:
        with _POOL_LOCK:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, query: str, params: dict[str, Any], key: str | None = None,
              conn: psycopg.Connection[Any] | None = None) -> Any:
        if conn is not None:
            return db.call_sync(conn, query, params, key=key)
        with self._borrow() as own:
            return db.call_sync(own, query, params, key=key)

    def submit(
        self, wf: WorkflowFn | str, *args: Any, queue: str = "default", priority: int = 0,
        idempotency_key: str | None = None, timeout: float | None = None,
        delay: float | None = None, start_at: datetime | None = None,
        dedup_key: str | None = None, on_duplicate: str = "return",
        conn: psycopg.Connection[Any] | None = None,
    ) -> SyncHandle:
        """See :meth:`Client.submit`."""
        params = self._submit_params(wf, args, queue, priority, idempotency_key, timeout,
                                     delay, start_at, dedup_key, on_duplicate)
        handle = SyncHandle(self, self._call(self._q.submit, params, idempotency_key, conn))
        _count_submitted(params["workflow"])
        return handle

    def signal(self, execution_id: uuid.UUID | str, name: str, payload: Any = None, *,
               idempotency_key: str | None = None) -> bool:
        """See :meth:`Client.signal`."""
        params = self._signal_params(execution_id, name, payload, idempotency_key)
        return bool(self._call(self._q.signal, params))

    def cancel(self, execution_id: uuid.UUID | str) -> str:
        """See :meth:`Client.cancel`."""
        return str(self._call(self._q.cancel, {"id": _ident(execution_id)}))

    def retry(self, execution_id: uuid.UUID | str) -> SyncHandle:
        """See :meth:`Client.retry`."""
        eid = _ident(execution_id)
        self._call(self._q.retry, {"id": eid})
        return SyncHandle(self, eid)

    def fork(self, execution_id: uuid.UUID | str, from_step: int) -> SyncHandle:
        """See :meth:`Client.fork`."""
        return SyncHandle(self, self._call(self._q.fork, {"id": _ident(execution_id),
                                                          "from_step": from_step}))

    def get(self, execution_id: uuid.UUID | str) -> Execution:
        eid = _ident(execution_id)
        with self._borrow() as conn:
            ex = db.get_execution_sync(conn, self._q, id=eid)
        if ex is None:
            raise ExecutionNotFound(f"no execution {eid}")
        return ex

    def steps(self, execution_id: uuid.UUID | str) -> list[StepRow]:
        with self._borrow() as conn:
            return db.list_steps_sync(conn, self._q, id=_ident(execution_id))

    def counts(self) -> dict[str, int]:
        with self._borrow() as conn:
            return db.count_by_status_sync(conn, self._q)

    def list(self, *, status: str | None = None, workflow: str | None = None,
             since: datetime | None = None, limit: int = 50) -> list[ExecutionSummary]:
        """Executions newest first, live and finished, optionally filtered."""
        if status is not None and status not in {s.value for s in Status}:
            raise ConfigError(f"unknown status {status!r}; one of "
                              f"{', '.join(s.value for s in Status)}")
        with self._borrow() as conn:
            return db.list_executions_sync(conn, self._q, status=status, workflow=workflow,
                                           since=since, limit=limit)

    def stats(self) -> Stats:
        with self._borrow() as conn:
            return db.stats_sync(conn, self._q)

    def result(self, execution_id: uuid.UUID | str, timeout: float | None = None) -> Any:
        """See :meth:`Client.result`."""
        eid = _ident(execution_id)

        def check(conn: psycopg.Connection[Any]) -> tuple[bool, Any]:
            ex = db.get_execution_sync(conn, self._q, id=eid)
            if ex is None:
                raise ExecutionNotFound(f"no execution {eid}")
            return ex.status.terminal, ex

        ex = self._wait(check, self._q.listen_done, timeout,
                        lambda: f"execution {eid} did not finish in {timeout}s")
        return _outcome(ex)

    def get_event(self, execution_id: uuid.UUID | str, key: str,
                  timeout: float | None = None) -> Any:
        """See :meth:`Client.get_event`."""
        eid = _ident(execution_id)

        def check(conn: psycopg.Connection[Any]) -> tuple[bool, Any]:
            row = conn.execute(self._q.get_event, {"id": eid, "key": key}).fetchone()
            return (True, row[0]) if row else (False, None)

        return self._wait(check, self._q.listen_events, timeout,
                          lambda: f"no event {key!r} on {eid} after {timeout}s")

    def _wait(self, check: Any, listen: str, timeout: float | None, message: Any) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        waiter = self._connect(self._listen_dsn) if self._listen_dsn else None
        try:
            if waiter is not None:
                waiter.execute(listen)
            while True:
                if waiter is not None and self._listen_dsn == self.dsn:
                    done, value = check(waiter)
                else:
                    with self._borrow() as conn:
                        done, value = check(conn)
                if done:
                    return value
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(message())
                if waiter is not None:
                    for _ in waiter.notifies(timeout=_remaining(deadline), stop_after=1):
                        pass
                else:
                    time.sleep(min(delay, _remaining(deadline)))
                    delay = min(delay * 1.5, POLL_CAP_S)
        finally:
            if waiter is not None:
                waiter.close()


@dataclass(frozen=True, slots=True)
class SyncHandle:
    client: SyncClient
    id: uuid.UUID

    def result(self, timeout: float | None = None) -> Any:
        return self.client.result(self.id, timeout)

    def get(self) -> Execution:
        return self.client.get(self.id)
