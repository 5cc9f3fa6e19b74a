"""Submit executions and wait for their results: :class:`Client` (async), :class:`SyncClient`.

``submit`` calls the SQL function ``<schema>.submit`` in one statement. Pass ``conn=`` to run
it inside your own psycopg transaction: the execution then commits or rolls back with your
data. Without ``conn`` it commits before ``submit`` returns.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg

from kestrel import codec, db
from kestrel.codec import DEFAULT_MAX_PAYLOAD_BYTES
from kestrel.config import QUEUE_NAME, SCHEMA_NAME
from kestrel.errors import ConfigError, ExecutionNotFound, WorkflowFailed
from kestrel.sql import queries
from kestrel.types import Execution, Status, StepRow
from kestrel.workflow import WorkflowFn, workflow_name


def _prepare(
    wf: WorkflowFn | str, args: tuple[Any, ...], queue: str, max_bytes: int
) -> tuple[str, str]:
    name = workflow_name(wf)
    if not name or len(name) > 1024:
        raise ConfigError("workflow name must be 1-1024 characters")
    if not QUEUE_NAME.fullmatch(queue):
        raise ConfigError(f"invalid queue name {queue!r}: 1-128 of A-Z a-z 0-9 _ . : -")
    return name, codec.encode(list(args), what=f"arguments of workflow {name!r}",
                              max_bytes=max_bytes)


def _check_schema(schema: str) -> None:
    if not SCHEMA_NAME.fullmatch(schema):
        raise ConfigError(f"invalid schema name {schema!r}")


def _outcome(ex: Execution) -> Any:
    if ex.status is Status.COMPLETED:
        return ex.result
    raise WorkflowFailed(ex.id, ex.status.value, (ex.error or {}).get("message", ex.error))


class Client:
    """Async client. Opens one connection per call unless given one; cheap to create."""

    def __init__(self, dsn: str, *, schema: str = "kestrel",
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        _check_schema(schema)
        self.dsn = dsn
        self.schema = schema
        self._q = queries(schema)
        self._max_bytes = max_payload_bytes

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        db.configure_connection(conn)
        return conn

    async def submit(
        self, wf: WorkflowFn | str, *args: Any, queue: str = "default", priority: int = 0,
        idempotency_key: str | None = None, conn: psycopg.AsyncConnection[Any] | None = None,
    ) -> Handle:
        """Enqueue *wf* with *args*; return its handle once the row is committed (or, with
        *conn*, written in that connection's transaction).

        Raises:
            SerializationError: an argument cannot round-trip through JSON (nothing written).
            IdempotencyConflict: *idempotency_key* belongs to an execution with other args.
        """
        name, encoded = _prepare(wf, args, queue, self._max_bytes)
        if conn is not None:
            eid = await db.submit(conn, self._q, workflow=name, args=encoded, queue=queue,
                                  priority=priority, idempotency_key=idempotency_key)
        else:
            async with await self._connect() as own:
                eid = await db.submit(own, self._q, workflow=name, args=encoded, queue=queue,
                                      priority=priority, idempotency_key=idempotency_key)
        return Handle(self, eid)

    async def get(self, execution_id: uuid.UUID | str) -> Execution:
        """Return the execution, live or finished.

        Raises:
            ExecutionNotFound: no execution has that id.
        """
        eid = uuid.UUID(str(execution_id))
        async with await self._connect() as conn:
            ex = await db.get_execution(conn, self._q, id=eid)
        if ex is None:
            raise ExecutionNotFound(f"no execution {eid}")
        return ex

    async def steps(self, execution_id: uuid.UUID | str) -> list[StepRow]:
        async with await self._connect() as conn:
            return await db.list_steps(conn, self._q, id=uuid.UUID(str(execution_id)))

    async def result(self, execution_id: uuid.UUID | str, timeout: float | None = None) -> Any:
        """Wait for the execution to finish and return its result.

        Raises:
            WorkflowFailed: it ended failed, cancelled or quarantined.
            TimeoutError: it did not finish within *timeout* seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        async with await self._connect() as conn:
            eid = uuid.UUID(str(execution_id))
            while True:
                ex = await db.get_execution(conn, self._q, id=eid)
                if ex is None:
                    raise ExecutionNotFound(f"no execution {eid}")
                if ex.status.terminal:
                    return _outcome(ex)
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"execution {eid} is still {ex.status} after {timeout}s")
                wait = delay if deadline is None else min(delay, deadline - time.monotonic())
                await asyncio.sleep(max(wait, 0))
                delay = min(delay * 1.5, 1.0)


@dataclass(frozen=True, slots=True)
class Handle:
    """A submitted execution."""

    client: Client
    id: uuid.UUID

    async def result(self, timeout: float | None = None) -> Any:
        return await self.client.result(self.id, timeout)

    async def get(self) -> Execution:
        return await self.client.get(self.id)


class SyncClient:
    """Blocking twin of :class:`Client` for scripts, web handlers and the CLI."""

    def __init__(self, dsn: str, *, schema: str = "kestrel",
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        _check_schema(schema)
        self.dsn = dsn
        self.schema = schema
        self._q = queries(schema)
        self._max_bytes = max_payload_bytes

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self.dsn, autocommit=True)
        db.configure_connection(conn)
        return conn

    def submit(
        self, wf: WorkflowFn | str, *args: Any, queue: str = "default", priority: int = 0,
        idempotency_key: str | None = None, conn: psycopg.Connection[Any] | None = None,
    ) -> SyncHandle:
        """See :meth:`Client.submit`."""
        name, encoded = _prepare(wf, args, queue, self._max_bytes)
        if conn is not None:
            eid = db.submit_sync(conn, self._q, workflow=name, args=encoded, queue=queue,
                                 priority=priority, idempotency_key=idempotency_key)
        else:
            with self._connect() as own:
                eid = db.submit_sync(own, self._q, workflow=name, args=encoded, queue=queue,
                                     priority=priority, idempotency_key=idempotency_key)
        return SyncHandle(self, eid)

    def get(self, execution_id: uuid.UUID | str) -> Execution:
        eid = uuid.UUID(str(execution_id))
        with self._connect() as conn:
            ex = db.get_execution_sync(conn, self._q, id=eid)
        if ex is None:
            raise ExecutionNotFound(f"no execution {eid}")
        return ex

    def steps(self, execution_id: uuid.UUID | str) -> list[StepRow]:
        with self._connect() as conn:
            return db.list_steps_sync(conn, self._q, id=uuid.UUID(str(execution_id)))

    def counts(self) -> dict[str, int]:
        with self._connect() as conn:
            return db.count_by_status_sync(conn, self._q)

    def result(self, execution_id: uuid.UUID | str, timeout: float | None = None) -> Any:
        """See :meth:`Client.result`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        eid = uuid.UUID(str(execution_id))
        with self._connect() as conn:
            while True:
                ex = db.get_execution_sync(conn, self._q, id=eid)
                if ex is None:
                    raise ExecutionNotFound(f"no execution {eid}")
                if ex.status.terminal:
                    return _outcome(ex)
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"execution {eid} is still {ex.status} after {timeout}s")
                wait = delay if deadline is None else min(delay, deadline - time.monotonic())
                time.sleep(max(wait, 0))
                delay = min(delay * 1.5, 1.0)


@dataclass(frozen=True, slots=True)
class SyncHandle:
    client: SyncClient
    id: uuid.UUID

    def result(self, timeout: float | None = None) -> Any:
        return self.client.result(self.id, timeout)

    def get(self) -> Execution:
        return self.client.get(self.id)
